"""Does a flatter pretrained LM forget less? The in-project byte-level
decoder pretrained five ways (baseline, SAM, a SAM mid-training window, a
large learning rate, a short anneal), then post-trained on another
distribution and quantised to 4 bits: the increase of its pretraining
held-out cross-entropy against the sharpness of the pretrained model.
`python -m studies.lm_forgetting`; README.md holds the figures.
"""
