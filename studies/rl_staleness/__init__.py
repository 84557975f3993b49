"""Does asynchronous GRPO, whose actors sample from a policy up to s versions
old, learn as well as synchronous GRPO on arithmetic, and do the off-policy
corrections (truncated importance sampling, decoupled PPO) matter? A warm
start per seed, then sync and bounded-staleness runs at bounds 1-4 (and 8
and 32 at a larger rate). `python -m studies.rl_staleness`; README.md holds
the figures. `studies.gas` runs the same machinery with GAS's scheduler.
"""
