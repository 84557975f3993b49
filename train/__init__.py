"""Flax training on a shared core, one subpackage per product.

The core (this package): `loop` (the training loop), `aot` (compiled
steps), `steps`, `experiment` (checks and assembly), `optim` (the optax
chain and the methods' config blocks), `sharding`, `input_pipeline`,
`checkpointing`, `metrics`, `plots`, `preemption`, `errors`, `fileio`,
`host_devices`. Products: `vision` (image classification), `lm` (the
decoder LM), `steering` (steering Flax models), `tta` (test-time
adaptation), `rl` (asynchronous GRPO on the decoder LM). A geom method reaches the
core only through its `geom.method_hooks.MethodHooks`.
"""
