"""Flax training on a shared core, one subpackage per product.

The core, by concern: `run` (the run core: a workdir's lock, checkpoints
and their checks, metrics logs, stop signals, resume), `training` (the
loop, steps compiled ahead of time, the optax chain and the methods'
config blocks, sharding, input pipelines, experiment assembly),
`compilation` (targets, and a compiled program's memory and traffic per
chip), `analysis` (statistics and plots), with `errors` and `fileio` under
them all. Products: `vision` (image classification), `lm` (the decoder LM
and Gemma 3), `steering` (steering those LMs), `tta` (test-time
adaptation), `rl` (asynchronous GRPO on the decoder LM). `jobs` runs what
launch/'s mains ask for. A geom method reaches the core only through its
`geom.method_hooks.MethodHooks`.
"""
