"""Spherical steering against addition on the in-project LMs, at matched KL.

Does rotating a layer's activations toward a concept direction (with or
without a gate) buy more accuracy than adding the direction, at the same
KL to the unsteered model? Several LMs pretrained from different seeds,
each evaluated on the same item sets; methods compared at matched KL with
a hierarchical bootstrap over LMs, item sets and items
(`python -m studies.steering`; README.md holds the figures).
"""
