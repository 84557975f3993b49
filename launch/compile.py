r"""Compile a job for a TPU pod or GPU node from this host: per-chip memory and cost.

  python -m launch.compile --config=configs/lm.py:size=1b --target=v5e:16x16
  python -m launch.compile --config=configs/wrn_cifar10.py --target=h100:1x1x8 \
    --workdir=/tmp/compile_wrn
  python -m launch.compile --config=configs/lm.py:size=8b --target=v5p:4x4x4 \
    --num_slices=2

This repository's `train_compile` (MaxText's, for every job here): the job's
real step functions are built from the config with abstract arrays only
(every program its loop compiles: each kind of train step the method asks
for, e.g. SAM's and its plain warm-up steps; the eval step and the check
that guards checkpoints; TTA's adapt step; GRPO's learner update and the
rollout's generation, each on its own mesh; steering's generation), placed
on the target's compile-only devices with the config's mesh and logical-axis
rules, and compiled by the target's own compiler (libtpu for TPU, Mosaic
kernels included; XLA's GPU compiler, Triton kernels to cubin). Nothing
runs and no accelerator is needed. One table row per program: per-chip
bytes (arguments, outputs, temporaries, aliased, total) against the chip's
usable HBM, FLOPs and HBM bytes per chip, and a roofline step time
(`train.compile_report`). `--workdir` gets `compile.json`.

Targets: `v4:AxBxC`, `v5e:AxB`, `v5p:AxBxC`, `v6e:AxB` (TPU chips per
dimension; `--num_slices=N` compiles for N such slices over the
data-centre network, with the data axis spanning them), `h100:NxGx1`..
as XLA spells GPU topologies, e.g. `h100:1x1x8` (one node of 8 GPUs) and
`h200:2x1x8` (two nodes). The compilers are the compile toolchain (`make
compile-toolchain`, or `pip install .[tpu]` / `.[cuda12]`).

Jobs that read a trained model from another workdir (TTA's source, GRPO's
policy, steering's LM) take its config from `--model_config` (a config
file, e.g. `configs/lm.py:size=1b`), else from that workdir's checkpoint
when it has one, else from the job's documented default.

Limits, checked before JAX starts and before anything is written:
`--target` has at most 65,536 chips and `--num_slices` at most 65,536 /
the target's chips (the largest training job published ran on 50,944);
`model.num_layers` at most 128 (each layer is traced and compiled
unrolled; the deepest published models have 126). A program whose
arguments alone (parameters, optimizer state, batch) exceed a chip's
memory does not fit and is not compiled. Each step (building the
programs; tracing and compiling each one) has `--compile_timeout` seconds
(1200; 1 to 86,400), and runs off the main thread: SIGTERM or SIGINT end
the launcher within a second, in one line.

Exit status: 0 when every program compiles and fits; 3 when one does not
fit (one line naming it, its bytes and the chip's, and the size fields to
lower); 1 when one does not compile (one line naming it and the
compiler's message) or a step ran past `--compile_timeout` (one line
naming the program and the target); 2 for an unknown target (the line
lists the valid ones), a value past a limit above, a compiler that is not
installed, or any other mistake in the flags or config; 128 + the
signal's number for SIGTERM or SIGINT.
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from launch import compile_jobs
from launch import compile_watch
from launch import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'The job\'s config file (get_config(arg)).',
    lock_config=True)
_TARGET = flags.DEFINE_string(
    'target', None, 'What to compile for: v5e:16x16, v5p:4x4x4, v6e:8x8, '
    'v4:2x2x2, h100:1x1x8, h200:2x1x8, ... (TPU chips per dimension; GPU '
    'nodes x 1 x GPUs per node).')
_NUM_SLICES = flags.DEFINE_integer(
    'num_slices', 1, 'TPU slices over the data-centre network (the data '
    'axis spans them).')
_COMPILE_TIMEOUT = flags.DEFINE_float(
    'compile_timeout', compile_watch.DEFAULT_TIMEOUT_S,
    'Seconds each step may take (building the programs; tracing and '
    'compiling each one); then the launcher stops in one line naming it. '
    f'In [1, {compile_watch.MAX_TIMEOUT_S}].')
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Where to write compile.json (optional).')
_MODEL_CONFIG = config_flags.DEFINE_config_file(
    'model_config', None, 'For jobs that read a trained model from another '
    'workdir: that model\'s config file.', lock_config=True)
flags.mark_flags_as_required(['config', 'target'])


def _import_jax() -> None:
  """JAX on the CPU only, with the target compilers importable and no
  persistent compilation cache; imported (quietly), its backend not yet
  started."""
  os.environ['JAX_PLATFORMS'] = 'cpu'
  # A deviceless executable cannot be loaded back: with a persistent
  # compilation cache set up, every later compile of the same program read
  # its entry, warned "PjRtCompiler must be constructed with a Client to
  # call DeserializeLoadedExecutable" and compiled again.
  os.environ['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
  from train import targets  # pylint: disable=g-import-not-at-top
  targets.enable_toolchain()
  with compile_jobs.quiet_stderr():
    import jax  # pylint: disable=g-import-not-at-top,unused-import


def main(argv):
  del argv
  entry.quiet_libraries()
  config = _CONFIG.value
  # The flags and sizes first, before JAX is imported (a second of start-up
  # for a refusal otherwise).
  # pylint: disable=g-import-not-at-top
  from train.errors import UsageError
  from train.targets import ToolchainMissing
  # pylint: enable=g-import-not-at-top
  try:
    compile_jobs.check_flags(config, _TARGET.value, _NUM_SLICES.value,
                             _COMPILE_TIMEOUT.value, _MODEL_CONFIG.value)
  except (UsageError, ToolchainMissing) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  # Before run_job, whose imports import JAX (the CUDA plugin's lines);
  # its backend starts inside, where signals end the launcher in one line.
  _import_jax()
  entry.run_job(lambda: compile_jobs.run(
      config, _TARGET.value, _NUM_SLICES.value, _WORKDIR.value,
      _MODEL_CONFIG.value, _COMPILE_TIMEOUT.value))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
