"""Does SAM during fine-tuning make a pretrained model forget less? Gemma 3
270M fine-tuned on arithmetic answers with AdamW and with SAM around it
(at each radius of `--rhos`): the increase of its cross-entropy on
held-out text it never sees in fine-tuning, next to what it learnt and
the sharpness of its fine-tuning loss. `python -m
studies.gemma_forgetting`; README.md holds the figures.
"""
