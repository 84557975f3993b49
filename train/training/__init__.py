"""The training loop and what it runs: steps compiled ahead of time, the
optax chain, sharding over the host's devices, input pipelines and the
assembly of an experiment."""
