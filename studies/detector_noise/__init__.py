"""Does the hallucination detector still flag SAM's stalls under gradient noise, without false alarms?

The landscape of `studies.sam_landscape` with minibatch-like noise in
every gradient: at a stall |g+|/|g| is then about |noise|/|grad f|, not
0. The study measures, per noise level, how many stalled runs the
detector flags and how many convergent runs (warm-started, convex) it
flags wrongly, for today's thresholds and the earlier ones (README.md).
"""
