"""Flax trainers and their parts: models, sharding, data, checkpoints, metrics."""
