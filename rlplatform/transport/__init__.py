"""How data moves between the job's workers.

Samples (`samples`: records and their msgpack wire format) go from rollout workers to reward
workers through the reward queue on Redis Streams (`reward_queue`, served by `redis_server`
when the job brings its own Redis); scored samples stay on Redis by id (`results`) for the
learner ranks to fetch, while their small metadata is grouped into batches (`buffer`);
the staleness gate (`staleness`) bounds how far rollout workers run ahead of the learner;
versioned weight snapshots go from the learner back to the rollout workers (`weights`; with
LoRA, snapshots of the adapters alone: `adapters`); the
prompt ledger (`ledger`) records every group from issue to its end; every wait on another
process has a deadline (`deadlines`).
Nothing here knows what a reward, a model or a loss is.
"""
