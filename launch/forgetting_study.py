r"""Flat minima against forgetting: pretraining variants, then post-training and 4-bit quantisation.

  python -m launch.forgetting_study --workdir=workdirs/forgetting

The companion paper (ICML 2026; abstract in shared/research/sam.md):
pretraining with SAM, with large learning rates or with a shortened
annealing period biases the model toward flatter minima, and then less is
forgotten after post-training (up to 80% less); a short SAM mid-training
phase on an existing checkpoint reduced forgetting by 31% after
fine-tuning and by 40% after 4-bit quantisation. Only the abstract is
public; the recipe here is ours and says so.

Pretraining (`configs/lm.py:forgetting`: the byte-level decoder, 2 layers,
d_model 64, on Python's documentation, 2,000 AdamW steps at 3e-3 with a
cosine to 5%), one run per variant and seed, each a resumable trainer run
below `--workdir` (a finished run is not trained again):

  baseline      as configured;
  sam           SAM (rho `--rho`) on every step;
  sam_mid       the baseline with SAM switched on for its last
                `--mid_steps` steps (`optimizer.sam.window_start`): its
                first steps are the baseline's, bit for bit (same seed,
                same data order), so this is SAM applied to the baseline's
                checkpoint at step N - mid_steps, at the same total steps;
  large_lr      peak learning rate `--large_lr`;
  short_anneal  warmup-stable-decay, the anneal over the last
                `--anneal_fraction` of the steps instead of a cosine over
                all of them.

From each pretrained model:
  (a) post-training: fine-tuning on another distribution
      (`--post_source`, default the templated review corpus 'attribute')
      for `--post_steps` AdamW steps at `--post_lr` (`config.init_from`:
      its own resumable run);
  (b) 4-bit weight quantisation, per-channel symmetric
      (`train.lm.quantization.fake_quantize`).
Measured per run: the pretraining held-out cross-entropy (nats per byte,
the validation windows of the pretraining data) before, after (a) and
after (b); the forgetting (its increase); the post-training target's
held-out CE after (a), so that a smaller forgetting bought by a worse fit
shows; and the sharpness of the starting point: the top Hessian
eigenvalue (power iteration) and the trace (Hutchinson) of the
pretraining loss on `--hessian_windows` training windows
(`geom.curvature`). The relative reduction of forgetting against the
baseline is 1 - F_variant / F_baseline per seed (the seeds pair: same data
and initialisation), reported as mean +- std over seeds.

Writes `forgetting.md`, `forgetting.json` and `forgetting.png`; each
(variant, seed)'s measures are kept in `measures/` so a rerun only
computes what is missing.
"""

import functools
import json
import os
import statistics

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import optax

from configs import lm
from geom import curvature
from launch import entry
from train import metrics
from train import plots
from train import stats
from train.errors import UsageError
from train.lm import data as lm_data
from train.lm import quantization
from train.lm import trainer

VARIANTS = ('baseline', 'sam', 'sam_mid', 'large_lr', 'short_anneal')

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/forgetting', 'Root dir.')
_CONFIG_ARG = flags.DEFINE_string('config_arg', 'forgetting',
                                  'Argument of configs/lm.py for pretraining.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per variant.')
_VARIANTS = flags.DEFINE_list('variants', list(VARIANTS), 'Variants.')
_RHO = flags.DEFINE_float('rho', 0.05, 'SAM radius (sam, sam_mid).')
_MID_STEPS = flags.DEFINE_integer('mid_steps', 400,
                                  'SAM steps at the end of sam_mid.')
_LARGE_LR = flags.DEFINE_float('large_lr', 1e-2, 'Peak lr of large_lr.')
_ANNEAL = flags.DEFINE_float('anneal_fraction', 0.1,
                             'Anneal fraction of short_anneal (wsd).')
_POST_SOURCE = flags.DEFINE_string('post_source', 'attribute',
                                   'Post-training data source.')
_POST_STEPS = flags.DEFINE_integer('post_steps', 400, 'Post-training steps.')
_POST_LR = flags.DEFINE_float('post_lr', 1e-3, 'Post-training peak lr.')
_BITS = flags.DEFINE_integer('bits', 4, 'Quantisation bits.')
_HESSIAN_WINDOWS = flags.DEFINE_integer(
    'hessian_windows', 64, 'Training windows of the sharpness estimates.')
_POWER_ITERS = flags.DEFINE_integer('power_iters', 30,
                                    'Power-iteration products (at most).')
_TRACE_SAMPLES = flags.DEFINE_integer('trace_samples', 32,
                                      'Hutchinson probes.')


def check_settings(pretrain) -> None:
  """UsageError naming the flag, before anything is trained."""
  unknown = [v for v in _VARIANTS.value if v not in VARIANTS]
  if unknown or not _VARIANTS.value:
    raise UsageError('--variants', unknown[0] if unknown else '',
                     'unknown variant', VARIANTS)
  if 'baseline' not in _VARIANTS.value:
    raise UsageError('--variants', ','.join(_VARIANTS.value),
                     'must include baseline (forgetting is relative to it)')
  stats.check_seed_count('--seeds', _SEEDS.value)
  n = pretrain.num_steps
  if 'sam_mid' in _VARIANTS.value and not 0 < _MID_STEPS.value < n:
    raise UsageError('--mid_steps', _MID_STEPS.value,
                     f'the SAM window must lie inside the pretraining run: '
                     f'need 0 < mid_steps < num_steps={n}')
  source = _POST_SOURCE.value
  if source not in lm_data.SOURCES and not os.path.isdir(source):
    raise UsageError('--post_source', source, 'unknown post-training '
                     'source (or not a directory of .txt files)',
                     lm_data.SOURCES)
  if lm_data.source_names(pretrain.data) == [source]:
    raise UsageError('--post_source', source, 'is the pretraining data: '
                     'post-training must move to another distribution')
  for flag, value, ok, what in (
      ('--rho', _RHO.value, _RHO.value > 0, '> 0'),
      ('--large_lr', _LARGE_LR.value, _LARGE_LR.value > 0, '> 0'),
      ('--anneal_fraction', _ANNEAL.value, 0 < _ANNEAL.value <= 1,
       'in (0, 1]'),
      ('--post_steps', _POST_STEPS.value, _POST_STEPS.value >= 1, '>= 1'),
      ('--post_lr', _POST_LR.value, _POST_LR.value > 0, '> 0'),
      ('--bits', _BITS.value, 2 <= _BITS.value <= 16, 'in [2, 16]')):
    if not ok:
      raise UsageError(flag, value, f'must be {what}')


def pretrain_config(variant: str, seed: int):
  config = lm.get_config(_CONFIG_ARG.value or None)
  config.seed = seed
  opt = config.optimizer
  if variant in ('sam', 'sam_mid'):
    opt.sam.enabled = True
    opt.sam.rho = _RHO.value
    if variant == 'sam_mid':
      opt.sam.window_start = config.num_steps - _MID_STEPS.value
  elif variant == 'large_lr':
    opt.learning_rate = _LARGE_LR.value
  elif variant == 'short_anneal':
    opt.schedule = 'wsd'
    opt.decay_fraction = _ANNEAL.value
  return config


def post_config(seed: int, pretrain_workdir: str):
  config = lm.get_config(_CONFIG_ARG.value or None)
  config.seed = seed
  config.data.mix = ((_POST_SOURCE.value, 1.0),)
  config.num_steps = _POST_STEPS.value
  config.optimizer.learning_rate = _POST_LR.value
  config.optimizer.warmup_steps = max(1, _POST_STEPS.value // 10)
  config.eval_every = config.checkpoint_every = _POST_STEPS.value
  config.log_every = max(1, min(config.log_every, _POST_STEPS.value))
  config.init_from = os.path.abspath(pretrain_workdir)
  return config


@functools.cache
def _per_window_ce(model):
  """Jitted (params, tokens) -> per-window mean CE: one per model, so the
  five measures of a run (and every run of one model) compile it once."""

  @jax.jit
  def per_window(p, tokens):
    logits, _ = model.apply({'params': p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean(-1)
  return per_window


def _held_out_ce(model, params, windows, batch: int = 64) -> float:
  """Mean next-byte cross-entropy (nats) over `windows` (N, seq + 1)."""

  per_window = _per_window_ce(model)
  tokens = np.asarray(windows, np.int32)
  out = 0.0
  for i in range(0, len(tokens), batch):
    chunk = tokens[i:i + batch]
    # One compiled shape: the last chunk is padded and the padding dropped.
    full = np.concatenate([chunk, np.repeat(chunk[:1], batch - len(chunk),
                                            0)])
    out += float(np.asarray(per_window(params, full))[:len(chunk)].sum())
  return out / len(tokens)


@functools.cache
def _sharpness_fns(model, power_iters: int, trace_samples: int):
  """Jitted (params, tokens, key) -> top Hessian eigenpair and Hutchinson
  trace, one pair per model and settings: each holds the LM's
  Hessian-vector product in a loop, the study's costliest compiles (10-20 s
  each on a CPU), and every variant and seed reuses them."""


  def loss_on(tokens):
    def loss(p):
      logits, _ = model.apply({'params': p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    return loss

  top = jax.jit(lambda p, tokens, key: curvature.power_iteration(
      loss_on(tokens), p, key, power_iters, tol=1e-3))
  trace = jax.jit(lambda p, tokens, key: curvature.hutchinson_trace(
      loss_on(tokens), p, jax.random.fold_in(key, 1), trace_samples))
  return top, trace


def _sharpness(model, params, windows, seed: int) -> dict:

  tokens = np.asarray(windows[:_HESSIAN_WINDOWS.value], np.int32)
  top_fn, trace_fn = _sharpness_fns(model, _POWER_ITERS.value,
                                    _TRACE_SAMPLES.value)
  key = jax.random.key(1000 + seed)
  top = top_fn(params, tokens, key)
  trace = trace_fn(params, tokens, key)
  return dict(lambda_max=float(top.eigenvalue),
              power_iterations=int(top.iterations),
              trace=float(trace.mean), trace_stderr=float(trace.stderr))


def measure(variant: str, seed: int) -> dict:
  """Trains what is missing for (variant, seed) and measures it."""
  root = _WORKDIR.value
  path = os.path.join(root, 'measures', f'{variant}_seed{seed}.json')
  if os.path.exists(path):
    return metrics.read_json(path)
  pre_dir = os.path.join(root, f'pretrain_{variant}_seed{seed}')
  post_dir = os.path.join(root, f'post_{variant}_seed{seed}')
  pre_config = pretrain_config(variant, seed)
  trainer.train_and_evaluate(pre_config, pre_dir)
  post = post_config(seed, pre_dir)
  post_final = trainer.train_and_evaluate(post, post_dir)
  with open(os.path.join(pre_dir, 'metrics.jsonl')) as f:
    last = [r for r in map(json.loads, f) if 'train_loss' in r][-1]
  pre = trainer.load_trained(pre_dir)
  model, pre_params = pre.model, pre.params
  post_params = trainer.load_trained(post_dir).params
  windows = functools.partial(lm_data.load_windows, seed=seed,
                              tokenizer=pre.tokenizer)
  held_out = windows(pre_config.data, 'validation').tokens
  target = windows(post.data, 'validation').tokens
  train_windows = windows(pre_config.data, 'train').tokens
  before = _held_out_ce(model, pre_params, held_out)
  after_post = _held_out_ce(model, post_params, held_out)
  quantised = quantization.fake_quantize(pre_params, _BITS.value)
  after_quant = _held_out_ce(model, quantised, held_out)
  out = dict(
      variant=variant, seed=seed, pretrain_ce=before,
      post_ce=after_post, quant_ce=after_quant,
      forgetting_post=after_post - before,
      forgetting_quant=after_quant - before,
      target_ce_before=_held_out_ce(model, pre_params, target),
      target_ce_after=_held_out_ce(model, post_params, target),
      post_trainer_val_loss=post_final['val_loss'],
      # The hallucination detector over pretraining (SAM variants).
      sam_steps=last.get('opt/sam_steps', 0),
      flagged_steps=last.get('opt/hallucination_steps', 0),
      **_sharpness(model, pre_params, train_windows, seed))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  metrics.write_json_atomic(path, out)
  logging.info('%s seed %d: %s', variant, seed, out)
  return out


def summarize(records: list[dict], paper: dict) -> str:
  by = {}
  for r in records:
    by.setdefault(r['variant'], {})[r['seed']] = r

  def ms(values, fmt='{:.3f}'):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f'{fmt.format(m)} +- {fmt.format(s)}'

  base = by['baseline']
  head = ['variant', 'pretraining CE', 'after post-training',
          'forgetting (post)', 'reduction vs baseline (post)', 'after 4-bit',
          'forgetting (4-bit)', 'reduction vs baseline (4-bit)',
          'post-training target CE', 'lambda_max', 'trace']
  rows = []
  for variant in [v for v in VARIANTS if v in by]:
    runs = by[variant]
    seeds = sorted(runs)
    col = lambda k: [runs[s][k] for s in seeds]

    def reduction(key):
      if variant == 'baseline':
        return '-'
      if any(base[s][key] <= 0 for s in seeds if s in base):
        return 'n/a (the baseline did not forget)'
      ratios = [1 - runs[s][key] / base[s][key] for s in seeds if s in base]
      return ms([100 * r for r in ratios], '{:.0f}') + '%'

    rows.append([
        variant, ms(col('pretrain_ce')), ms(col('post_ce')),
        ms(col('forgetting_post')), reduction('forgetting_post'),
        ms(col('quant_ce')), ms(col('forgetting_quant')),
        reduction('forgetting_quant'), ms(col('target_ce_after')),
        ms(col('lambda_max'), '{:.2f}'), ms(col('trace'), '{:.1f}')])
  lines = [stats.markdown_table(head, rows, '-' * len(head))]
  lines += ['', f'Paper (abstract): SAM mid-training reduced forgetting by '
            f'{paper["post"]}% after fine-tuning and {paper["quant"]}% after '
            '4-bit quantisation.']
  return '\n'.join(lines) + '\n'


def plot(records: list[dict], path: str) -> None:
  plt = plots.pyplot()
  variants = [v for v in VARIANTS if any(r['variant'] == v for r in records)]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for ax, key, title in ((axes[0], 'forgetting_post',
                          'forgetting after post-training'),
                         (axes[1], 'forgetting_quant',
                          'forgetting after 4-bit quantisation')):
    for i, v in enumerate(variants):
      ys = [r[key] for r in records if r['variant'] == v]
      ax.bar(i, statistics.mean(ys), color='lightgrey', edgecolor='k')
      ax.plot([i] * len(ys), ys, 'ko', ms=4)
    ax.set_xticks(range(len(variants)), variants, rotation=20)
    ax.set_ylabel('increase of pretraining held-out CE (nats/byte)')
    ax.set_title(title)
  for v in variants:
    rs = [r for r in records if r['variant'] == v]
    axes[2].plot([r['lambda_max'] for r in rs],
                 [r['forgetting_post'] for r in rs], 'o', label=v)
  axes[2].set_xlabel('top Hessian eigenvalue of the pretrained model')
  axes[2].set_ylabel('forgetting after post-training')
  axes[2].set_title('sharpness against forgetting (one point per seed)')
  axes[2].legend(fontsize=8)
  plots.save_png(fig, path)


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    pretrain = pretrain_config('baseline', 0)
    check_settings(pretrain)
    entry.configure_devices(pretrain)
    records = [measure(v, s) for v in _VARIANTS.value
               for s in range(_SEEDS.value)]
    root = _WORKDIR.value
    text = summarize(records, {'post': 31, 'quant': 40})
    # Atomic writes replace what is there (a FIFO would block an open).
    metrics.write_text_atomic(os.path.join(root, 'forgetting.md'), text)
    metrics.write_text_atomic(os.path.join(root, 'forgetting.json'),
                              json.dumps(records, indent=1))
    plot(records, os.path.join(root, 'forgetting.png'))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
