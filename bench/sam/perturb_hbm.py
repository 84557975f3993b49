r"""HBM traffic of the fused SAM perturbation against XLA's, from the compilers.

  python -m bench.sam.perturb_hbm    # every target and tree; BENCHMARKS.md

Estimated from compiled programs, not measured: no accelerator runs here.
For each target, a 4-chip slice or node (v4:2x2x1, v5e:2x2, v5p:2x2x1,
v6e:2x2, h100:1x1x4, h200:1x1x4), and each parameter tree
(`bench.sam.perturb_trees.realistic()`: the 125M and 1B LMs, ResNet-50, the
tests' MLP; float32, FSDP: each leaf split over the 4 chips along its first
dimension they divide, the others replicated), it compiles from this CPU
host (`train.compilation.targets`)
(a) `geom.kernels.sam_perturb`, SAM: the Mosaic kernels on TPU (in a
    shard_map over the slice, `shardings=`), the Triton kernels split by
    the partitioner on GPU;
(b) `sam_perturb_reference` under jit: the plain-jnp perturbation that XLA
    fuses by itself (what `geom.sam` computes without `fused=True`);
and counts the HBM bytes each chip reads and writes with
`train.compilation.sharded_traffic`, which also places the trees
(`hlo_traffic`: every top-level instruction's operands read plus its
result written; TPU layouts padded to their tiles, on-chip memory not
counted). On TPU it also gives `cost_analysis()['bytes accessed']`, which
GPU compilers do not report. `ideal` is one pass over g for the norm and
one over w and g writing w' (16 bytes per float32 parameter). The roofline
time is bytes / the chip's HBM bandwidth (`train.compilation.targets.CHIPS`).
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import sys
import time

# The compile toolchain must be importable before JAX starts, so that the
# CUDA plugin is found (and given custom_partitioning's partitioner) at
# start-up; everything runs on CPU.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Deviceless executables cannot be loaded from a persistent cache.
os.environ['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
from train.compilation import targets
targets.enable_toolchain()

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench import report
from bench.sam import perturb_trees
from geom.kernels import sam_perturb as k
from train.analysis import stats
from train.compilation import sharded_traffic

TARGETS = ('v4:2x2x1', 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2', 'h100:1x1x4',
           'h200:1x1x4')
_TARGETS = flags.DEFINE_list('targets', list(TARGETS), 'Compile targets.')
_TREES = flags.DEFINE_list('trees', list(perturb_trees.realistic()),
                           'Parameter trees.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')
SECTION = 'sam_perturb_hbm'


def programs(target: str, tree):
  """{'fused': compiled, 'xla': compiled} for a tree on a target, and the
  tree's placement there."""
  placed = sharded_traffic.fsdp_placement(target, tree)
  rho = jax.ShapeDtypeStruct((), jnp.float32,
                             sharding=NamedSharding(placed.mesh, P()))
  # The Mosaic kernels run in a shard_map that needs the shardings; the
  # partitioner splits the Triton ones by itself.
  given = (placed.shardings if targets.parse(target).platform == 'tpu'
           else None)
  fns = {'fused': lambda w, g, r: k.sam_perturb(w, g, r, shardings=given),
         'xla': lambda w, g, r: k.sam_perturb_reference(w, g, r)}
  return {name: jax.jit(fn, out_shardings=(placed.shardings, None)).lower(
      placed.params, placed.params, rho).compile()
          for name, fn in fns.items()}, placed


def measure(target: str, tree) -> dict[str, float]:
  compiled, placed = programs(target, tree)
  out = {}
  for name, c in compiled.items():
    t = sharded_traffic.traffic(c)
    out[name] = t.bytes
    out[f'{name}_ops'] = t.ops
    out[f'{name}_kernels'] = t.kernel_bytes
    out[f'{name}_cost'] = t.cost_bytes
  # Read g, then read w and g and write w'.
  out['ideal'] = 4 * sharded_traffic.local_bytes(placed)
  return out


def _mb(b) -> str:
  return '-' if b is None else f'{b / 1e6:,.0f}'


def main(argv):
  del argv
  trees = perturb_trees.realistic()
  rows, verdicts = [], {}
  for target in _TARGETS.value:
    chip = targets.chip_for(targets.parse(target))
    for name in _TREES.value:
      start = time.time()
      r = measure(target, trees[name])
      ratio = r['fused'] / r['xla']
      verdicts.setdefault(chip.name, []).append(ratio)
      rows.append([
          chip.name, name,
          f'{perturb_trees.parameters(trees[name]) / 1e6:,.1f}M',
          _mb(r['ideal']),
          f'{_mb(r["fused"])} ({_mb(r["fused_kernels"])} in kernels)',
          _mb(r['xla']), f'**{ratio:.2f}x**', _mb(r['fused_cost']),
          _mb(r['xla_cost']), r['fused_ops'], r['xla_ops'],
          f'{1e3 * r["fused"] / chip.hbm_bandwidth:.2f}',
          f'{1e3 * r["xla"] / chip.hbm_bandwidth:.2f}'])
      print(' | '.join(map(str, rows[-1])), f'({time.time() - start:.0f} s)',
            file=sys.stderr)
  lines = [
      '## Fused SAM perturbation: HBM traffic per chip (estimated from the '
      'compiler, not measured)',
      '',
      'Per chip of a 4-chip slice or node, float32 parameters split FSDP-'
      'style over the 4 chips, SAM; MB = 10^6 bytes read plus written, '
      'counted from each compiled program\'s optimized HLO '
      '(`train.compilation.hlo_traffic`). `fused`: `geom.kernels.sam_perturb` (TPU: '
      'Mosaic kernels in a shard_map, `shardings=`; GPU: Triton kernels split '
      'by the partitioner); `XLA`: `sam_perturb_reference` under jit. '
      '`ideal`: 16 bytes per parameter (g read for the norm; w and g read, w\' '
      'written). `cost_analysis`: TPU\'s `bytes accessed` (GPU compilers give '
      'none). `ops`: top-level instructions that touch memory (kernels, '
      'fusions, copies: launches on GPU). Roofline: HLO bytes / HBM bandwidth '
      '(`train.compilation.targets.CHIPS`). jax '
      f'{jax.__version__}.',
      '',
      stats.markdown_table(
          ['chip', 'tree', 'parameters', 'ideal MB', 'fused MB', 'XLA MB',
           'fused / XLA', 'fused cost_analysis MB', 'XLA cost_analysis MB',
           'fused ops', 'XLA ops', 'roofline fused (ms)',
           'roofline XLA (ms)'], rows, '-' * 13),
      '',
      'Reproduce: `python -m bench.sam.perturb_hbm` (needs the compile '
      'toolchain, `make compile-toolchain`; about '
      'ten minutes on 2 cores).',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
