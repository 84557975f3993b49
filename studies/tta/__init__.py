"""How test-time adaptation on corrupted MNIST depends on its learning rate,
its method and its normalisation: source, BN statistics, TENT, EATA and SAR,
each with a fixed rate and with CONGA (`geom.conga`), on episodic,
continual and mixed streams; error against the base rate over two decades;
and where batch statistics fail (small batches, label shift) against
GroupNorm and LayerNorm sources. `python -m studies.tta`; README.md holds
the figures.
"""
