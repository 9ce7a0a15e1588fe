"""The job: one YAML file run end to end.

`controller.run_job(config)` starts (or joins) Ray and Redis, starts each policy's learner ranks,
rollout workers and evaluator (`workers`), runs the SFT stage (`sft`) and the asynchronous RL
stage (`rl_loop`), and writes the run directory. Everything below it is reached through the
transport (`rlplatform.transport`) and reported through `rlplatform.monitoring`.
"""
