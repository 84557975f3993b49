"""A short SAM mid-training phase on Gemma 3 270M, then post-training and
4-bit quantisation: the companion paper's protocol (README.md gives the
command and the results)."""
