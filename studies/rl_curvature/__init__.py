"""Does the policy's curvature grow with task difficulty, as GAS
(`geom.gas`) assumes when it sets shorter staleness budgets for harder
problems? lambda_max of the answer-token NLL per difficulty on the SFT
warm starts, by power iteration and by the one-product Rayleigh proxy,
and the slope alpha fitted from each. `python -m studies.rl_curvature`;
README.md holds the figures.
"""
