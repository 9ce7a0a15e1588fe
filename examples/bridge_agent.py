"""An agent that plays addition tasks through a running job's OpenAI bridge, as groups of episodes.

Each task is a group of `--group-size` two-turn episodes ("<a>+<b>=", then "and <c>+<d>="), each
finished into the group with the row its reward reads (`answer`). It answers the bridge's refusals as
an agent should: 429 (the job holds as many groups as its staleness bound allows) by finishing again
a little later; 410 `episode_expired` (the bridge dropped the episode after the agent went silent) by
playing that episode again under a new id; 410 `group_ended` (the group expired while the agent was
away) by playing the whole task again as a new group. Every finish and its answer is appended to
`--log` as a JSON line, and so is each turn refused because its episode expired. It runs until the
bridge stops answering.

    python examples/bridge_agent.py http://127.0.0.1:8000/v1 --group-size 4 --log agent.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.error
import urllib.request
import uuid
from typing import Dict, List, Optional, Tuple


class Refused(Exception):
    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{status} {code}")
        self.status, self.code = status, code


def post(url: str, body: Dict, episode: Optional[str] = None) -> Dict:
    headers = {"Content-Type": "application/json", **({"X-Episode-Id": episode} if episode else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        raise Refused(refused.code, json.loads(refused.read())["error"]["code"]) from None


def play_episode(url: str, turns: List[str], log) -> str:
    """The turns of one episode; returns its id (an expired one is played again under a new id)."""
    while True:
        episode, messages = f"ep-{uuid.uuid4().hex[:10]}", []
        try:
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                reply = post(f"{url}/chat/completions", {"model": "policy", "messages": messages}, episode)
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            return episode
        except Refused as refused:
            if refused.code != "episode_expired":
                raise
            record(log, episode=episode, outcome="turn_refused_expired")


def finish(url: str, episode: str, group: str, answer: str, log) -> str:
    """Finish `episode` into `group`: "finished", or "episode_expired" / "group_ended" when refused 410."""
    while True:
        try:
            post(f"{url}/episodes/{episode}/finish", {"group": group, "row": {"answer": answer}})
            outcome = "finished"
        except Refused as refused:
            if refused.status == 429:
                time.sleep(0.2)
                continue
            if refused.status != 410:
                raise
            outcome = refused.code
        record(log, group=group, episode=episode, outcome=outcome)
        return outcome


def record(log, **entry) -> None:
    log.write(json.dumps({"time": time.time(), **entry}) + "\n")
    log.flush()


def discard(url: str, episode: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{url}/episodes/{episode}", method="DELETE"), timeout=120).read()


def task(rng: random.Random) -> Tuple[List[str], str]:
    a, b, c, d = (rng.randrange(10) for _ in range(4))
    return [f"{a}+{b}=", f"and {c}+{d}="], str(c + d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the bridge's base URL, as `rlp status` shows it")
    parser.add_argument("--group-size", type=int, required=True, help="the job's rl.group_size")
    parser.add_argument("--log", required=True, help="JSON lines of every finish and its outcome")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.log, "a") as log:
        try:
            while True:
                turns, answer = task(rng)
                group = f"agent-{uuid.uuid4().hex[:10]}"
                for _ in range(args.group_size):
                    episode = play_episode(args.url, turns, log)
                    while (outcome := finish(args.url, episode, group, answer, log)) == "episode_expired":
                        episode = play_episode(args.url, turns, log)
                    if outcome == "group_ended":  # it expired while this agent was away: the task again, anew
                        discard(args.url, episode)
                        break
        except (urllib.error.URLError, ConnectionError, Refused):
            return  # the bridge stopped: the job ended


if __name__ == "__main__":
    main()
