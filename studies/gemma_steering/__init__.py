"""Spherical steering against addition on Gemma 3 270M, at matched KL.

The in-project study's question (`studies.steering`) asked of a real
pretrained LM: one model, its main layer and a sweep of layers at the
reference settings (`layers`), or each method's layer, direction and gate
selected on validation items (`selected`), methods compared at matched KL
with intervals over item sets and items (`python -m studies.gemma_steering`;
README.md holds the figures).
"""
