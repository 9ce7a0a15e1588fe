"""The OpenAI bridge's own additions to the OpenAI HTTP API, shared by the bridge (the server, in a
rollout worker) and the clients the platform ships (the verifiers harness): the header that makes
chat requests one episode, and the episode routes under `/v1`; and where a job's status names its
bridges' URLs."""

EPISODE_HEADER = "X-Episode-Id"  # chat requests carrying the same value are turns of one episode
FINISH_ROUTE = "/episodes/{episode_id}/finish"  # POST {"group", "row"}: the episode goes to the reward queue
DISCARD_ROUTE = "/episodes/{episode_id}"  # DELETE: the episode is dropped


def bridge_status_field(policy: str, index: int) -> str:
    """The job status field holding rollout worker `index`'s bridge URL while it serves (`rlp status`)."""
    return f"{BRIDGE_STATUS_PREFIX}{policy}/{index}"


BRIDGE_STATUS_PREFIX = "openai_bridge/"
