r"""Fine-tuning Gemma 3 270M on the shared loop: tokens/s of its train step.

  python -m bench.training.gemma            # writes the BENCHMARKS.md section
  python -m bench.training.gemma --steps=2 --repeats=1 --nowrite

The trainer's own compiled step (`train.training.aot.compile_steps`, the state
donated, batches placed beforehand) on the registry's Gemma 3 270M
(float32, one CPU device), for the two jobs of `configs/gemma.py`
(`finetune`: 8 windows of 64 text tokens; `sft`: 16 arithmetic problems
of 13 tokens) and four optimizers: AdamW and SAM around it, training the
whole model or with the tied embedding frozen (`optimizer.frozen`). Each
variant runs `--steps` timed steps after one untimed step per repeat;
variants alternate over `--repeats` repeats and the median of the
per-repeat ratios to full-model AdamW on the same job is reported, with
the median tokens/s (tokens in a batch, padding included, per second).
"""

import os
import platform
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax

from bench import report
from configs import gemma as gemma_config
from train.training import aot
from train.training import input_pipeline
from train.analysis import stats
from train.lm import models
from train.lm import trainer as lm_trainer
from train.rl import sft

_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps per repeat.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'gemma_training'
JOBS = ('finetune', 'sft')
VARIANTS = {'AdamW, whole model': '', 'AdamW, frozen embedding': ',frozen',
            'SAM, whole model': ',sam', 'SAM, frozen embedding': ',sam,frozen'}


def _build(job: str, suffix: str, workdir: str):
  config = gemma_config.get_config(job + suffix)
  product = lm_trainer if job == 'finetune' else sft
  exp = product.build(config, workdir)
  data = (lm_trainer.load_data(config, workdir) if job == 'finetune'
          else sft.load_data(config, workdir))
  return config, exp, data


def _timed(exp, compiled, data, params, steps: int) -> float:
  """Seconds per step after one untimed step."""
  batches = input_pipeline.TrainBatches(data.train, exp.config.batch_size,
                                        exp.config.seed)
  placed = jax.block_until_ready(list(input_pipeline.to_devices(
      batches.iterate(0, steps + 1, indices_only=compiled.data_on_device),
      exp.batch_sharding)))
  state = exp.init_state({'params': params})
  state, _ = compiled.train(state, placed[0], 0)
  state = jax.block_until_ready(state)
  start = time.perf_counter()
  for i, batch in enumerate(placed[1:]):
    state, _ = compiled.train(state, batch, i + 1)
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start
  del state
  return elapsed / steps


def main(argv):
  del argv
  params = models.pretrained(gemma_config.get_config('sft')).params
  rows, sequence = [], {}
  with tempfile.TemporaryDirectory() as workdir:
    for job in JOBS:
      built = {name: _build(job, suffix, os.path.join(workdir, job))
               for name, suffix in VARIANTS.items()}
      compiled = {name: aot.compile_steps(exp, data.train)
                  for name, (_, exp, data) in built.items()}
      times = {name: [] for name in VARIANTS}
      for _ in range(_REPEATS.value):
        for name, (_, exp, data) in built.items():
          times[name].append(_timed(exp, compiled[name], data, params,
                                    _STEPS.value))
      config = built['AdamW, whole model'][0]
      sequence[job] = built['AdamW, whole model'][1].columns['tokens'][0][0]
      tokens = config.batch_size * sequence[job]
      base = times['AdamW, whole model']
      for name in VARIANTS:
        ratio = statistics.median(b / t for b, t in zip(base, times[name]))
        rows.append([job, name, f'{statistics.median(times[name]):.2f}',
                     f'{tokens / statistics.median(times[name]):.0f}',
                     '1 (baseline)' if name == 'AdamW, whole model'
                     else f'**{ratio:.2f}x**'])
  shapes = {job: (gemma_config.get_config(job).batch_size,
                  sequence[job]) for job in JOBS}
  lines = [
      '## Gemma 3 270M fine-tuning',
      '',
      'The trainer\'s compiled step on the registry\'s Gemma 3 270M '
      '(float32 parameters from the Q4_K_M file, one CPU device): '
      f'`finetune` ({shapes["finetune"][0]} text windows of '
      f'{shapes["finetune"][1]} tokens) and `sft` ({shapes["sft"][0]} '
      f'arithmetic problems of {shapes["sft"][1]} tokens, padded), AdamW or '
      'SAM around it, the whole model or '
      f'the tied embedding frozen. Median of {_REPEATS.value} alternating '
      f'repeats of {_STEPS.value} steps; speed-ups are against full-model '
      'AdamW on the same job.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'jax {jax.__version__}.',
      '',
      stats.markdown_table(['job', 'optimizer', 's/step', 'tokens/s',
                            'speed / AdamW whole model'], rows, 'll---'),
      '',
      'Reproduce: `.venv/bin/python -m bench.training.gemma '
      f'--steps={_STEPS.value} --repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
