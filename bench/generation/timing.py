"""The generation benchmarks' shared timing loop (no flags: any bench's
main may import it)."""

import time

import jax

from train.lm import generate as lm_generate


def time_variants(model, params, prompt, valid, steerings: dict, layer: str,
                  steps: int, repeats: int,
                  calls: int) -> dict[str, list[float]]:
  """{variant: per-repeat seconds per call} of one jitted `generate` per
  (steering, mode) variant, compiled and warmed up first, the variants
  alternating within each repeat."""
  compiled = {}
  for name, (steer, mode) in steerings.items():
    fn = jax.jit(lambda p, s, mode=mode: lm_generate.generate(
        model, p, prompt, valid, steps, steering=s, layer_path=layer,
        mode=mode).tokens)
    jax.block_until_ready(fn(params, steer))  # Compile and warm up.
    compiled[name] = (fn, steer)
  times = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, (fn, steer) in compiled.items():
      start = time.perf_counter()
      for _ in range(calls):
        jax.block_until_ready(fn(params, steer))
      times[name].append((time.perf_counter() - start) / calls)
  return times
