"""What a job reports, and where: the W&B run, the console's progress line, the job status on
Redis (`rlp status`) and the event log (`metrics`, `job_status`); the RL stage's per-step
metric families (`rl_monitor`), alert rules (`alerts`) and the W&B dashboard layout
(`dashboard`), and the held-out evaluation's figures (`evaluation`). Monitoring reads figures
the job hands it; it never changes the job's course.
"""
