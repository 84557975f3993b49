r"""Per-chip memory and roofline time of the pod-scale jobs, from the compilers.

  python -m bench.compilation.estimates            # print the tables
  python -m bench.compilation.estimates --write    # and put them in BENCHMARKS.md
  python -m bench.compilation.estimates --only='LM 1b'
  python -m bench.compilation.estimates --reuse --write  # rows compiled before

Each row is one `python -m launch.compile` run (a process of its own) of a
job users take to a pod or a GPU node, on a TPU v5e pod (v5e:16x16, 256
chips) and a node of 8 H100s (h100:1x1x8), with the layout that fits
there (the overrides column): the LMs of configs/lm.py `size=`, with and
without SAM; the SAM paper's WRN-28-10 on CIFAR-10 and ResNet-50 on
ImageNet, SAM against the base step; GRPO with the 1b policy on a pod
split into rollout and learner meshes; steering generation on the 1b LM.
Every figure is the compiler's estimate (memory analysis; FLOPs and HBM
bytes from its cost model; roofline = max(FLOPs / peak, bytes /
bandwidth)), never a measured time: nothing here ran on a TPU or GPU.
Each row's compile.json is kept under --workdir, in a folder named by its
command; `--reuse` takes it from there instead of compiling again.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

from bench import report
from train.analysis import stats

_WRITE = flags.DEFINE_bool('write', False, 'Write the tables to BENCHMARKS.md.')
_ONLY = flags.DEFINE_string('only', None, 'Run only rows whose name starts so.')
_WORKDIR = flags.DEFINE_string('workdir', '/tmp/geom_compile_estimates',
                               'Where each row writes its compile.json.')
_TABLE = flags.DEFINE_enum(
    'table', 'pods', ['pods', 'gemma'], 'Which table: the pod-scale jobs, '
    'or Gemma 3 fine-tuning (270M to 4B) on a few chips.')
_REUSE = flags.DEFINE_bool(
    'reuse', False, 'Take a row\'s compile.json from --workdir when it is '
    'there (from an earlier run of the same command) instead of compiling.')

POD, NODE = 'v5e:16x16', 'h100:1x1x8'
SAM = {'optimizer.sam.enabled': True}
# (name, config, model config, target, overrides). A GPU node holds fewer
# chips than a pod: smaller global batches there, and the 8b model split
# over 4 GPUs by tensor parallelism.
ROWS = [
    *[(f'LM {size}{" + SAM" if sam else ""}', f'configs/lm.py:size={size}',
       None, target, {**(SAM if sam else {}), **extra})
      for size, node in (('125m', {'batch_size': 64, 'eval_batch_size': 64}),
                         ('1b', {'batch_size': 32, 'eval_batch_size': 32}),
                         ('8b', {'batch_size': 16, 'eval_batch_size': 16}))
      for target, extra in ((POD, {}), (NODE, node))
      for sam in (False, True)],
    ('LM 8b', 'configs/lm.py:size=8b', None, 'v5e:2x2', {}),
    *[(f'{name}{" + SAM" if sam else ""}', config, None, target,
       {**extra, 'optimizer.sam.enabled': sam})
      for name, config in (('WRN-28-10 CIFAR-10', 'configs/wrn_cifar10.py'),
                           ('ResNet-50 ImageNet',
                            'configs/resnet50_imagenet.py'))
      for target, extra in ((POD, {}), (NODE, {}))
      for sam in (False, True)],
    ('GRPO 1b', 'configs/rl.py:size=1b', 'configs/rl_sft.py:size=1b', POD,
     {}),
    ('GRPO 1b', 'configs/rl.py:size=1b', 'configs/rl_sft.py:size=1b', NODE,
     {'rollout_devices': 4}),
    ('Steering 1b', 'configs/steering.py', 'configs/lm.py:size=1b', POD, {}),
    ('Steering 1b', 'configs/steering.py', 'configs/lm.py:size=1b', NODE, {}),
]


# Gemma 3 fine-tuning (configs/gemma.py:finetune; 1b and 4b in bfloat16
# compute with float32 parameters and remat), on the fewest chips that
# hold it: its own table (`--table=gemma`).
GEMMA_ROWS = [
    ('Gemma 3 270m fine-tune', 'configs/gemma.py:finetune', None, 'v5e:1x1',
     {}),
    ('Gemma 3 270m fine-tune', 'configs/gemma.py:finetune', None,
     'h100:1x1x1', {}),
    ('Gemma 3 1b fine-tune', 'configs/gemma.py:finetune,shape=1b', None,
     'v5e:2x2', {}),
    ('Gemma 3 1b fine-tune', 'configs/gemma.py:finetune,shape=1b', None,
     'h100:1x1x1', {}),
    *[(f'Gemma 3 4b fine-tune{" + SAM" if sam else ""}',
       'configs/gemma.py:finetune,shape=4b', None, target,
       {'optimizer.sam.enabled': sam})
      for target in ('v5e:4x4', 'h100:1x1x8') for sam in (False, True)],
    ('Gemma 3 4b fine-tune, frozen embedding',
     'configs/gemma.py:finetune,shape=4b', None, 'h100:1x1x1',
     {'optimizer.frozen': '^embedding$'}),
]


def _flag(key: str, value) -> str:
  if isinstance(value, tuple):
    value = '(' + ','.join(map(str, value)) + ')'
  return f'--config.{key}={value}'


def row_workdir(row) -> str:
  """The row's workdir under --workdir, named by its command."""
  digest = hashlib.sha256(command(row).encode()).hexdigest()[:16]
  return os.path.join(_WORKDIR.value, digest)


def run_row(row, workdir: str) -> tuple[dict | None, str, float]:
  """compile.json of one row (None if it wrote none), its error line and
  the wall time (0 when reused)."""
  name, config, model, target, overrides = row
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'compile.json')
  if _REUSE.value and os.path.exists(path):
    result = json.load(open(path))
    fits = all(r['fits'] for r in result['rows'])
    return result, '' if fits else 'error: (reused) see its rows', 0.0
  cmd = [sys.executable, '-m', 'launch.compile', f'--config={config}',
         f'--target={target}', f'--workdir={workdir}',
         *[_flag(k, v) for k, v in overrides.items()]]
  if model:
    cmd.append(f'--model_config={model}')
  if os.path.exists(path):
    os.remove(path)
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                            os.path.abspath(__file__)))))
  seconds = time.perf_counter() - start
  error = next((l for l in done.stderr.splitlines()
                if l.startswith('error:')), '')
  if done.returncode not in (0, 3):
    print(f'{name} on {target}: exit {done.returncode}: {error or done.stderr[-2000:]}')
  result = json.load(open(path)) if os.path.exists(path) else None
  return result, error, seconds


def command(row) -> str:
  name, config, model, target, overrides = row
  del name
  parts = [f'--config={config}', f'--target={target}']
  parts += [_flag(k, v) for k, v in overrides.items()]
  if model:
    parts.append(f'--model_config={model}')
  return 'python -m launch.compile ' + ' '.join(parts)


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f}'


def table(results) -> list[str]:
  head = ['job', 'target', 'overrides', 'function', 'args GiB', 'temp GiB',
          'total GiB/chip', 'of HBM', 'TFLOPs/chip', 'HBM GB/chip',
          'roofline ms']
  align = '-' * len(head)
  lines = stats.markdown_table(head, [], align).split('\n')
  for row, result, error in results:
    name, _, _, target, overrides = row
    shown = ', '.join(f'{k}={v}' for k, v in overrides.items()
                      if k != 'optimizer.sam.enabled') or '-'
    if result is None:
      # By hand: its empty cells read '| |', stats.markdown_table's '|  |'.
      lines.append(f'| {name} | {target} | {shown} | (no result: {error}) '
                   '| | | | | | | |')
      continue
    programs = []
    for r in result['rows']:
      b = r['bytes']
      flops = '-' if r['flops'] is None else f'{r["flops"] / 1e12:.3g}'
      traffic = ('-' if r['hbm_traffic'] is None
                 else f'{r["hbm_traffic"] / 1e9:.3g}')
      roof = ('-' if r['roofline_seconds'] is None
              else f'{r["roofline_seconds"] * 1e3:.3g}')
      verdict = (f'{100 * r["total_bytes"] / r["hbm_bytes"]:.0f}%'
                 + ('' if r['fits'] else ' DOES NOT FIT'))
      if r['error'] and not r['oom']:
        verdict = f'DOES NOT COMPILE: {r["error"][:120]}'
      programs.append([name, target, shown, r['function'],
                       _gib(b['argument']) if b else '-',
                       _gib(b['temp']) if b else '-',
                       _gib(r['total_bytes']), verdict, flops, traffic,
                       roof])
    # The rows alone: the header is the first two lines above.
    lines += stats.markdown_table(head, programs, align).split('\n')[2:]
  return lines


def sam_ratios(results) -> list[str]:
  """SAM's train step against the base step's, per job and target."""
  by_key = {}
  for row, result, _ in results:
    if result is None:
      continue
    name, _, _, target, _ = row
    step = next((r for r in result['rows']
                 if r['function'].startswith('train_step')), None)
    if step is not None:
      by_key[(name, target)] = step
  rows = []
  for (name, target), sam in by_key.items():
    if not name.endswith(' + SAM'):
      continue
    base = by_key.get((name[:-len(' + SAM')], target))
    if base is None or not (sam['fits'] and base['fits']):
      continue
    roof = ('-' if not (sam['roofline_seconds'] and base['roofline_seconds'])
            else f'{sam["roofline_seconds"] / base["roofline_seconds"]:.2f}x')
    rows.append([name[:-len(' + SAM')], target,
                 f'{sam["total_bytes"] / base["total_bytes"]:.2f}x', roof])
  return stats.markdown_table(
      ['job', 'target', 'memory SAM / base', 'roofline SAM / base'], rows,
      '----').split('\n')


def main(argv):
  del argv
  table_rows = GEMMA_ROWS if _TABLE.value == 'gemma' else ROWS
  rows = [r for r in table_rows
          if not _ONLY.value or r[0].startswith(_ONLY.value)]
  results = []
  for row in rows:
    result, error, seconds = run_row(row, row_workdir(row))
    print(f'{row[0]} on {row[3]}: {seconds:.0f} s'
          + (f' ({error})' if error else ''), flush=True)
    results.append((row, result, error))
  if _TABLE.value == 'gemma':
    report.publish('compile_estimates_gemma', gemma_lines(rows, results),
                   _WRITE.value)
    return
  lines = [
      '## Estimated from the compiler (not measured): pod-scale jobs',
      '',
      'Per-chip memory and roofline time of each job\'s programs as the '
      'TPU compiler (libtpu 0.0.42) and the GPU compiler (jax-cuda12-plugin '
      '0.10.2, no autotuning) plan them for a v5e pod (v5e:16x16, 256 chips, '
      '15.75 GiB usable each) and a node of 8 H100s (h100:1x1x8, 59.3 GiB '
      'each: 80 GB x JAX\'s 0.75 preallocation). Roofline = max(FLOPs / '
      'peak bf16, HBM bytes / bandwidth) per chip from the datasheets: a '
      'lower bound that ignores collectives and overlap. Nothing here ran '
      'on a TPU or GPU. Reproduce: `python -m bench.compilation.estimates '
      '--write`; one row: the `launch.compile` command below it.',
      '', *table(results), '',
      'SAM against the base step (train step only):', '',
      *sam_ratios(results), '',
      'GRPO 1b on one v5e slice does not compile (row above, as of this '
      'libtpu): its rollout mesh holds 128 of the slice\'s 256 chips, and on '
      'v5e (limited ICI routing) the TPU compiler wants a program to span '
      'the whole slice. The rollout and the learner need a slice each '
      'there; with `--num_slices=2 --config.rollout_devices=256` the rollout '
      'compiled (5.54 GiB/chip) but the learner update did not '
      '("INVALID_ARGUMENT: Slice is empty"): open. On 8 H100s the split '
      'compiles.', '',
      'Commands:', '',
      *[f'- {row[0]} on {row[3]}: `{command(row)}`' for row in rows],
  ]
  report.publish('compile_estimates', lines, _WRITE.value)


def gemma_lines(rows, results) -> list[str]:
  return [
      '## Estimated from the compiler (not measured): Gemma 3 fine-tuning',
      '',
      'The train, eval and finiteness-check programs of `launch.train '
      '--config=configs/gemma.py:finetune` (batches of 16 windows of 65 '
      'tokens for 270M, 64 for 1B and 4B; AdamW, float32 parameters and '
      'moments; 1B '
      'and 4B compute in bfloat16 with every block rematerialised), FSDP '
      'over the chips (`decoder_blocks.SIZE_RULES`), as the TPU compiler '
      '(libtpu 0.0.42) and the GPU compiler (jax-cuda12-plugin 0.10.2, no '
      'autotuning) plan them on the fewest chips that hold each. Shapes '
      'only: 1B and 4B weights ship in no registry package. Roofline as '
      'in the pod-scale table; nothing here ran on a TPU or GPU. '
      'Reproduce: `python -m bench.compilation.estimates --table=gemma '
      '--write`.',
      '', *table(results), '',
      'SAM against the base step (train step only):', '',
      *sam_ratios(results), '',
      'Commands:', '',
      *[f'- {row[0]} on {row[3]}: `{command(row)}`' for row in rows],
  ]


if __name__ == '__main__':
  app.run(main)
