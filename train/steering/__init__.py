"""Steering Flax models: hooks into their layers, saved vectors, the evaluation."""
