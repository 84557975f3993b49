"""Does SAM stall at hallucinated minimizers, does the detector flag them, and does a warm-start avoid them?

On a 2-D valley with a bump (`geom.landscapes.valley_with_bump`), SAM
with a constant rho converges, for rho in a middle band, to points where
|grad f| is large but the perturbed gradient vanishes; the study runs SAM
over a grid of rho and warm-start lengths, with the detector and with its
'warm_restart' response, and records where each run ends (README.md).
"""
