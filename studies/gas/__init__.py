"""Does GAS (`geom.gas`: per-difficulty staleness budgets from the policy's
curvature, a bandit curriculum, execution-aware dispatch) beat fixed
staleness bounds on asynchronous GRPO, in pass@1 on the hardest solvable
difficulty and in throughput, measured on 2 cores and predicted at pod
scale by the runtime's simulator (calibration in results/)?
`python -m studies.gas`; README.md holds the figures.
"""
