r"""The fused SAM perturbation kernel against XLA's jnp version, and copy bandwidth.

  python -m bench.sam.perturb                   # CPU: interpret mode, for information
  python3 -m bench.sam.perturb --sizes=1e6,1e7,1e8,1e9 --section=sam_perturb_gpu
                                                # on a GPU (an H200): the real figures

First (`--check`, on by default) the kernels, compiled for the device,
must equal the plain-jnp reference on the trees of the lowering tests
(one large leaf, ragged leaves, a float32/bfloat16 MLP, 40 small leaves),
SAM and ASAM, at |g| = 1, 1e20 and 1e-25; a mismatch stops the run before
any timing, with exit status 1.

For each size n (float32 parameters and gradients, one flat leaf), times:
- `fused`: `geom.kernels.sam_perturb` (norm pass reading g, update pass
  reading w and g and writing w'): 16 n bytes of memory traffic;
- `xla`: `sam_perturb_reference` under jit (XLA fuses it as it can);
- `copy`: a device copy of 2 n floats (read and write), the bandwidth
  ceiling.
Effective bandwidth = 16 n bytes / time (the same figure for both
implementations, so their ratio is their speed ratio); copy bandwidth =
bytes read + written / time. Goal on a GPU: fused >= 80% of copy bandwidth
and at least as fast as XLA. Each figure is the median of `--repeats`
timed calls after a warm-up.
"""

import os
import platform
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench import report
from bench.sam import perturb_trees
from geom.kernels import sam_perturb as k
from train.analysis import stats

_SIZES = flags.DEFINE_list('sizes', ['1e6', '4e6'], 'Element counts.')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per figure.')
_SECTION = flags.DEFINE_string('section', None,
                               'BENCHMARKS.md section (default by backend).')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')
_CHECK = flags.DEFINE_bool('check', True,
                           'Check fused == reference on the device first.')

# The trees of the kernel's lowering and compile tests, as (shape, dtype).
_CHECK_TREES = {
    name: {'/'.join(str(getattr(key, 'key', key)) for key in path):
           (leaf.shape, leaf.dtype)
           for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for name, (params, _) in perturb_trees.TREES.items()}


def check(scales=(1.0, 1e20, 1e-25)) -> list[list[str]]:
  """Fused vs reference, compiled for the default device; raises on a
  mismatch. Returns one table row (its cells) per tree."""
  rows = []
  for name, spec in _CHECK_TREES.items():
    worst = 0.0
    for adaptive in (False, True):
      for scale in scales:
        keys = iter(jax.random.split(jax.random.key(len(name)), 2 * len(spec)))
        w = {k: jax.random.normal(next(keys), s).astype(d)
             for k, (s, d) in spec.items()}
        g = {k: (jax.random.normal(next(keys), s) * scale).astype(d)
             for k, (s, d) in spec.items()}
        fused = jax.jit(lambda w, g, a=adaptive: k.sam_perturb(
            w, g, 0.05, adaptive=a, eps=0.0))
        ref = jax.jit(lambda w, g, a=adaptive: k.sam_perturb_reference(
            w, g, 0.05, adaptive=a, eps=0.0))
        (got, norm), (want, want_norm) = fused(w, g), ref(w, g)
        np.testing.assert_allclose(float(norm), float(want_norm), rtol=1e-5,
                                   err_msg=f'{name} norm')
        for key in spec:
          x = np.asarray(got[key], np.float32)
          y = np.asarray(want[key], np.float32)
          bf16 = got[key].dtype == jnp.bfloat16
          np.testing.assert_allclose(x, y, rtol=1e-2 if bf16 else 1e-5,
                                     atol=1e-2 if bf16 else 5e-7,
                                     err_msg=f'{name}/{key}')
          worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
    rows.append([name, 'SAM, ASAM', '1, 1e20, 1e-25', f'{worst:.2e}'])
  return rows


def _median_seconds(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(n: int, repeats: int) -> dict[str, float]:
  key_w, key_g = jax.random.split(jax.random.key(0))
  w = {'w': jax.random.normal(key_w, (n,), jnp.float32)}
  g = {'w': jax.random.normal(key_g, (n,), jnp.float32)}
  fused = jax.jit(lambda w, g: k.sam_perturb(w, g, 0.05))
  xla = jax.jit(lambda w, g: k.sam_perturb_reference(w, g, 0.05))
  copy = jax.jit(lambda w, g: (w['w'] + 0, g['w'] + 0))
  t_fused = _median_seconds(fused, w, g, repeats=repeats)
  t_xla = _median_seconds(xla, w, g, repeats=repeats)
  t_copy = _median_seconds(copy, w, g, repeats=repeats)
  traffic = 16 * n
  return {'fused_s': t_fused, 'xla_s': t_xla,
          'fused_gbps': traffic / t_fused / 1e9,
          'xla_gbps': traffic / t_xla / 1e9,
          'copy_gbps': 16 * n / t_copy / 1e9}  # 2n floats read + written.


def main(argv):
  del argv
  backend = jax.default_backend()
  sizes = [int(float(s)) for s in _SIZES.value]
  checked = []
  if _CHECK.value:
    try:
      checked = check()
    except AssertionError as e:
      print(f'fused != reference on {backend}: {e}', file=sys.stderr)
      sys.exit(1)
  rows = []
  for n in sizes:
    r = measure(n, _REPEATS.value)
    rows.append([
        f'{n:,}', f'{1e3 * r["fused_s"]:.3f}', f'{1e3 * r["xla_s"]:.3f}',
        f'{r["xla_s"] / r["fused_s"]:.2f}x', f'{r["fused_gbps"]:.1f}',
        f'{r["xla_gbps"]:.1f}', f'{r["copy_gbps"]:.1f}',
        f'{100 * r["fused_gbps"] / r["copy_gbps"]:.0f}%'])
  device = jax.devices()[0]
  section = _SECTION.value or f'sam_perturb_{backend}'
  mode = ("in Pallas's interpreter, which emulates the kernel grid step by "
          'grid step with XLA operations: for information only'
          if backend == 'cpu' else 'compiled')
  lines = [
      f'## Fused SAM perturbation: {backend}',
      '',
      f'`geom.kernels.sam_perturb` ({mode}) vs XLA-fused jnp, one float32 '
      f'leaf; median of {_REPEATS.value} calls. Device: '
      f'{getattr(device, "device_kind", device.platform)}; '
      f'{platform.machine()}, {os.cpu_count()} CPU cores; jax '
      f'{jax.__version__}.',
      '',
      stats.markdown_table(
          ['elements', 'fused (ms)', 'XLA (ms)', 'XLA time / fused time',
           'fused GB/s', 'XLA GB/s', 'copy GB/s', 'fused / copy'], rows,
          '--------'),
      '',
      'Reproduce: `python -m bench.sam.perturb '
      f'--sizes={",".join(_SIZES.value)} --repeats={_REPEATS.value}`.',
  ]
  if checked:
    lines += [
        '',
        'Fused equals the jnp reference ('
        f'{"interpreted" if backend == "cpu" else "compiled"}; float32 within '
        'relative 1e-5 or 5e-7 absolute, bfloat16 within 1e-2), per tree; '
        'the last column is the largest absolute difference:',
        '',
        stats.markdown_table(
            ['tree', 'method', 'gradient scale', 'max abs difference'],
            checked, '----'),
    ]
  report.publish(section, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
