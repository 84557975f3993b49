"""SAM against AdamW fine-tuning of Gemma 3 270M: what each forgets.

The flat-minima claim (shared/research/sam.md: SAM-trained models forget
less after post-training) on a pretrained model. Gemma 3 270M is
fine-tuned on arithmetic answers (an SFT config, `configs/gemma.py:sft`,
the GRPO warm start; `train.rl.sft`) by `variant`s of the same recipe, one
resumable trainer run per (variant, seed) below the study's workdir:

  adamw        the config's optimizer (AdamW) with SAM off;
  sam_rho<r>   SAM of radius r (the config's `optimizer.sam` otherwise)
               around the same AdamW, same learning rate and steps, for
               each r of `rhos`: SAM's radius trades fit for flatness, so
               more than one shows whether less forgetting only follows
               from learning less.

Measured per run: the forgetting, i.e. the increase of the model's
cross-entropy (nats per token) on held-out text it never sees in
fine-tuning (`train.lm.data.heldout_windows`: Python's documentation and
template reviews, test splits) over the pretrained model's; and what the
fine-tuning bought: the held-out answer cross-entropy and greedy pass@1
per difficulty. Seeds pair the variants (the same data order), so the
study reports per-seed paired differences as well as mean +- std. With
`sharpness_iters` > 0, also the sharpness of each model (the pretrained
one included) on the fine-tuning loss: the top eigenvalue of its Hessian
in the trained parameters (power iteration, `geom.curvature`) on a fixed
batch of `sharpness_problems` training problems, whether SAM's minima are
flatter where it matters to SAM.

Which parts are whose: SAM, the claim and its measure (held-out loss of
the original distribution after post-training) are the papers'; the task,
the steps, the learning rate and the frozen tied embedding (a CPU budget:
it halves a step and the optimizer state) are ours.
"""

import dataclasses
import functools
import json
import os
import statistics
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from geom import curvature
from train import fileio
from train import stats
from train import workdir_lock
from train.errors import UsageError
from train.lm import data as lm_data
from train.lm import models
from train.lm import tokenizer as lm_tokenizer
from train.rl import sft
from train.rl import tasks

REFERENCE = 'adamw'
SAM_PREFIX = 'sam_rho'
REPORT = 'forgetting.md'
RECORDS = 'forgetting.json'


@dataclasses.dataclass(frozen=True)
class Settings:
  """The study's own settings (flags of `launch.gemma_forgetting`)."""
  seeds: int = 3
  rhos: tuple[float, ...] = (0.05,)
  windows: int = 32
  window_len: int = 128
  sharpness_iters: int = 0
  sharpness_problems: int = 32

  @property
  def variants(self) -> tuple[str, ...]:
    return (REFERENCE,) + tuple(f'{SAM_PREFIX}{r:g}' for r in self.rhos)

  def check(self) -> None:
    """UsageError naming the flag, before anything is loaded or trained."""
    if not self.rhos or len(set(self.rhos)) != len(self.rhos) or not all(
        isinstance(r, (int, float)) and 0 < r < 10 for r in self.rhos):
      raise UsageError('--rhos', ','.join(map(str, self.rhos)),
                       'needs distinct SAM radii in (0, 10)')
    for flag, ok, what in (
        ('--seeds', 1 <= self.seeds <= 100, 'in [1, 100]'),
        ('--windows', 2 <= self.windows <= 4096, 'in [2, 4096]'),
        ('--window_len', 8 <= self.window_len <= 2048, 'in [8, 2048]'),
        ('--sharpness_iters', 0 <= self.sharpness_iters <= 1000,
         'in [0, 1000]'),
        ('--sharpness_problems', 1 <= self.sharpness_problems <= 4096,
         'in [1, 4096]')):
      if not ok:
        raise UsageError(flag, getattr(self, flag[2:]), f'must be {what}')


def check_config(base: ml_collections.ConfigDict) -> None:
  """UsageError naming the field unless `base` fine-tunes a pretrained
  model on the tasks (and builds: every field checked, nothing read)."""
  if base.get('task') != sft.TASK or models.kind(base) != 'gemma':
    raise UsageError('--config', base.get('task'),
                     "the study fine-tunes a Gemma on the tasks: "
                     "configs/gemma.py:sft")
  if base.optimizer.sam.enabled:
    raise UsageError('--config.optimizer.sam.enabled', True,
                     'the study turns SAM on for its sam_rho<r> variants '
                     'alone (--rhos)')
  sft.check_config(base)
  models.check_config(base)


def run_config(base: ml_collections.ConfigDict, variant: str, seed: int
               ) -> ml_collections.ConfigDict:
  """The trainer config of one (variant, seed)."""
  config = ml_collections.ConfigDict(base.to_dict())
  config.seed = seed
  if variant.startswith(SAM_PREFIX):
    config.optimizer.sam.enabled = True
    config.optimizer.sam.rho = float(variant[len(SAM_PREFIX):])
  return config


@functools.cache
def _window_ce_fn(model):
  @jax.jit
  def per_window(params, tokens):
    logits, _ = model.apply({'params': params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean(-1)
  return per_window


def heldout_ce(model, params, windows: np.ndarray, batch: int = 8) -> float:
  """Mean next-token cross-entropy (nats) over `windows` (N, len + 1)."""
  fn = _window_ce_fn(model)
  total = 0.0
  for i in range(0, len(windows), batch):
    chunk = windows[i:i + batch]
    # One compiled shape: the last chunk is padded, the padding dropped.
    full = np.concatenate([chunk, np.repeat(chunk[:1], batch - len(chunk),
                                            0)])
    total += float(np.asarray(fn(params, full))[:len(chunk)].sum())
  return total / len(windows)


def sharpness_batch(config, codec: tasks.Codec, count: int
                    ) -> dict[str, np.ndarray]:
  """`count` training problems, the same for every model of a study
  (spread over the config's families and difficulties)."""
  cells = [(f, d) for f in config.data.families
           for d in config.data.difficulties]
  problems = [p for i, (f, d) in enumerate(cells)
              for p in tasks.sample(f, d, count // len(cells)
                                    + (i < count % len(cells)), 54321)]
  examples = sft.encode(problems, sft.sequence_length(config.data), codec,
                        sft.token_dtype(config))
  return examples.columns()


def top_eigenvalue(config, params, codec: tasks.Codec,
                   settings: Settings, workdir: str) -> dict:
  """The top Hessian eigenvalue of the fine-tuning loss at `params` in
  the parameters the config trains (its loss sees frozen ones through
  stop_gradient, so their rows of the Hessian are zero)."""
  exp = sft.build(config, workdir, check_data=False)
  batch = sharpness_batch(config, codec, settings.sharpness_problems)

  def loss(p):
    losses, _, _ = exp.per_example(exp.model, {'params': p,
                                               'batch_stats': {}}, batch,
                                   False)
    return losses.mean()

  top = jax.jit(lambda p, key: curvature.power_iteration(
      loss, p, key, settings.sharpness_iters, tol=1e-3))(
          params, jax.random.key(0))
  return dict(lambda_max=float(top.eigenvalue),
              power_iterations=int(top.iterations))


def measure_sharpness(settings: Settings, base, root: str, variant: str | None,
                      seed: int) -> dict:
  """`top_eigenvalue` of a run's model (the pretrained one for None):
  lambda_max and power_iterations."""
  config = run_config(base, variant or REFERENCE, seed)
  name = 'pretrained' if variant is None else f'{variant}_seed{seed}'
  identity = dict(iters=settings.sharpness_iters,
                  problems=settings.sharpness_problems,
                  gguf=models.fingerprints(config)[models.GGUF_FINGERPRINT],
                  config=None if variant is None
                  else json.loads(config.to_json()))

  def compute():
    if variant is None:
      loaded = models.pretrained(config)
      return top_eigenvalue(config, loaded.params,
                            tasks.codec(loaded.tokenizer), settings, root)
    run_dir = os.path.join(root, 'runs', name)
    policy = sft.load_policy(run_dir)
    return top_eigenvalue(config, policy.params, policy.codec, settings,
                          run_dir)
  record = _cached(os.path.join(root, 'measures', f'sharpness_{name}.json'),
                   identity, compute)
  return {k: record[k] for k in ('lambda_max', 'power_iterations')}


def _write_json(path: str, value: Any) -> None:
  fileio.write_text_atomic(path, json.dumps(value, indent=1,
                                            sort_keys=True) + '\n')


def _cached(path: str, identity: dict, compute) -> dict:
  """The record at `path` if it was made with `identity`, else computed
  and written (atomically); a record of other settings is refused."""
  if os.path.exists(path):
    record = json.loads(fileio.read_text(path))
    if record.get('identity') != identity:
      raise UsageError('--workdir', os.path.dirname(os.path.dirname(path)),
                       f'{os.path.basename(path)} was measured with other '
                       'settings or another model file; use another workdir')
    return record
  record = dict(compute(), identity=identity)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  _write_json(path, record)
  return record


def _identity(settings: Settings, config, gguf_sha: str) -> dict:
  return dict(gguf=gguf_sha, windows=settings.windows,
              window_len=settings.window_len,
              config=json.loads(config.to_json()))


def measure_pretrained(settings: Settings, base, root: str) -> dict:
  """The pretrained model's held-out CE and pass@1 (once per study)."""
  sha = models.fingerprints(base)[models.GGUF_FINGERPRINT]
  identity = dict(gguf=sha, windows=settings.windows,
                  window_len=settings.window_len,
                  data=json.loads(base.data.to_json()))

  def compute():
    loaded = models.pretrained(base)
    model = models.create(base)
    windows = lm_data.heldout_windows(loaded.tokenizer, settings.windows,
                                      settings.window_len)
    codec = tasks.codec(loaded.tokenizer)
    return dict(heldout_ce=heldout_ce(_wide(model, windows), loaded.params,
                                      windows),
                pass_at_1=sft.evaluate_pass_at_1(base, model, loaded.params,
                                                 codec))
  return _cached(os.path.join(root, 'measures', 'pretrained.json'),
                 identity, compute)


def _wide(model, windows: np.ndarray):
  """`model` with room for the held-out windows (the SFT model holds 32
  slots; the parameters do not depend on it)."""
  return model.clone(max_len=max(model.max_len, windows.shape[1]))


def measure_run(settings: Settings, base, root: str, variant: str,
                seed: int) -> dict:
  """Trains (or resumes, or reuses) one run and measures it."""
  config = run_config(base, variant, seed)
  run_dir = os.path.join(root, 'runs', f'{variant}_seed{seed}')
  sha = models.fingerprints(config)[models.GGUF_FINGERPRINT]

  def compute():
    final = sft.train_and_evaluate(config, run_dir)
    policy = sft.load_policy(run_dir)
    windows = lm_data.heldout_windows(
        lm_tokenizer.for_trained(policy.config, run_dir, policy.codec.name),
        settings.windows, settings.window_len)
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
      logged = [r for r in map(json.loads, f) if 'train_loss' in r]
    return dict(
        variant=variant, seed=seed,
        heldout_ce=heldout_ce(_wide(policy.model, windows), policy.params,
                              windows),
        answer_ce=final['val_loss'], answer_exact=final['val_accuracy'],
        pass_at_1={k[len('pass_at_1_'):]: v for k, v in final.items()
                   if k.startswith('pass_at_1_')},
        final_train_loss=logged[-1]['train_loss'],
        hallucination_steps=logged[-1].get('opt/hallucination_steps', 0))
  return _cached(os.path.join(root, 'measures', f'{variant}_seed{seed}.json'),
                 _identity(settings, config, sha), compute)


def summarize(pretrained: dict, records: list[dict]) -> str:
  """The report: per variant mean +- std over seeds, then per-seed paired
  differences against AdamW."""
  by = {}
  for r in records:
    by.setdefault(r['variant'], {})[r['seed']] = r
  difficulties = sorted(pretrained['pass_at_1'])
  sharp = 'lambda_max' in pretrained
  head = (['variant', 'held-out text CE', 'forgetting (CE increase)',
           'answer CE'] + [f'pass@1 {d}' for d in difficulties]
          + (['lambda_max (fine-tuning loss)'] if sharp else []))
  rows = [['pretrained', f'{pretrained["heldout_ce"]:.4f}', '-', '-'] + [
      f'{100 * pretrained["pass_at_1"][d]:.1f}' for d in difficulties] + (
          [f'{pretrained["lambda_max"]:.1f}'] if sharp else [])]
  for variant in by:
    runs = [by[variant][s] for s in sorted(by[variant])]
    rows.append([
        f'{variant} ({len(runs)} seeds)',
        stats.mean_std([r['heldout_ce'] for r in runs], digits=4),
        stats.mean_std([r['heldout_ce'] - pretrained['heldout_ce']
                        for r in runs], digits=4),
        stats.mean_std([r['answer_ce'] for r in runs], digits=4)] + [
            stats.mean_std([r['pass_at_1'][d] for r in runs], 100)
            for d in difficulties] + (
                [stats.mean_std([r['lambda_max'] for r in runs])]
                if sharp else []))
  lines = [stats.markdown_table(head, rows), '']
  for variant in [v for v in by if v != REFERENCE and REFERENCE in by]:
    lines += _paired(pretrained, by[REFERENCE], by[variant], variant)
  return '\n'.join(lines) + '\n'


def _paired(pretrained: dict, reference: dict, other: dict, name: str
            ) -> list[str]:
  """Per-seed differences of `other` against the reference (same seeds,
  same data order)."""
  seeds = sorted(set(reference) & set(other))
  rows, reductions = [], []
  for s in seeds:
    fa = reference[s]['heldout_ce'] - pretrained['heldout_ce']
    fs = other[s]['heldout_ce'] - pretrained['heldout_ce']
    red = 1 - fs / fa if fa > 0 else None
    if red is not None:
      reductions.append(red)
    fit = other[s]['answer_ce'] - reference[s]['answer_ce']
    rows.append([s, f'{fa:.4f}', f'{fs:.4f}', f'{fs - fa:+.4f}',
                 '-' if red is None else f'{100 * red:.0f}%', f'{fit:+.4f}'])
  head = ['seed', f'forgetting {REFERENCE}', f'forgetting {name}',
          'difference', 'reduction', 'answer CE difference']
  return [f'{name} against {REFERENCE}, paired by seed (same data order):',
          '', stats.markdown_table(head, rows), '',
          f'Reduction of forgetting by {name}: '
          f'{stats.mean_std(reductions, 100, 0)}% over the '
          f'{len(reductions)} of {len(seeds)} seeds where {REFERENCE} forgot '
          f'(1 - F_{name} / F_{REFERENCE} per seed).', '']


def run(settings: Settings, base: ml_collections.ConfigDict,
        workdir: str) -> str:
  """The whole study into `workdir` (reusing what is measured); returns
  the report's text.

  Raises:
    UsageError: a setting is invalid (before anything is loaded).
    WorkdirBusy: another study holds `workdir`.
  """
  settings.check()
  check_config(base)
  root = os.path.abspath(workdir)
  os.makedirs(root, exist_ok=True)
  with workdir_lock.hold(root):
    pretrained = measure_pretrained(settings, base, root)
    records = [measure_run(settings, base, root, v, s)
               for v in settings.variants for s in range(settings.seeds)]
    if settings.sharpness_iters:
      pretrained = {**pretrained,
                    **measure_sharpness(settings, base, root, None, 0)}
      records = [{**r, **measure_sharpness(settings, base, root,
                                           r['variant'], r['seed'])}
                 for r in records]
    text = summarize(pretrained, records)
    fileio.write_text_atomic(os.path.join(root, REPORT), text)
    _write_json(os.path.join(root, RECORDS),
                dict(pretrained=pretrained, runs=records))
  return text
