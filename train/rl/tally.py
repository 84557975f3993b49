"""What an RL run counts and records: counters, the pass@1 curve, its scalars.

`Tally` holds the counters behind the metrics (the trained batches'
staleness and difficulty, the batches admission dropped, samples, tokens,
the learner's busy seconds, the scheduler's), the curve of evaluations and
the run's wall clock, all kept in each checkpoint; it makes each update's
scalars, writes them with the progress line, and at the end makes
results.json and pass_at_1.png.
"""

import hashlib
import time
from typing import Any, Callable

import jax
import numpy as np

from train.analysis import plots
from train.rl import tasks
from train.run import metrics as metrics_lib

# The console line, every PROGRESS_EVERY versions and at evaluations.
PROGRESS_EVERY = 10
PROGRESS_KEYS = ('reward', 'staleness', 'samples_per_second',
                 'learner_busy_fraction', 'eval/pass_at_1')


def fingerprint(params: Any) -> str:
  """SHA-256 of the parameters' bytes in tree order: equal iff bit-equal."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


def counters(bound: int, saved: dict | None = None
              ) -> dict[str, np.ndarray]:
  """The trained batches' staleness (0..bound) and difficulty counts, their
  staleness per difficulty, the batches dropped by admission per
  difficulty, the totals (samples, tokens, learner busy seconds) and the
  scheduler's seconds on the learner (its own, the curvature's); kept in
  the checkpoint's meta."""
  difficulties = tasks.MAX_DIFFICULTY + 1
  counters = {'staleness': np.zeros(bound + 1, np.int64),
              'difficulty': np.zeros(difficulties, np.int64),
              'staleness_by_difficulty': np.zeros((difficulties, bound + 1),
                                                  np.int64),
              'dropped': np.zeros(difficulties, np.int64),
              'totals': np.zeros(3, np.float64),
              'scheduler': np.zeros(2, np.float64)}
  for key, value in (saved or {}).items():
    counters[key] = np.array(value, counters[key].dtype)
  return counters

class Tally:
  """The counters, the curve and the wall clock of a run (restored from a
  checkpoint's metadata), and what they make: scalars, results."""

  def __init__(self, config, version: int, meta: dict[str, Any]):
    self.config = config
    self.counters = counters(config.runtime.max_staleness,
                             meta.get('counters'))
    self.wall_offset = float(meta.get('wall_seconds', 0.0))
    self.curve = list(meta.get('curve', []))
    self.progress = metrics_lib.Progress(version, config.num_versions)
    self.started = time.perf_counter()

  def wall(self) -> float:
    """Seconds of the run, over its resumes."""
    return self.wall_offset + time.perf_counter() - self.started

  def evaluated(self, version: int, scores: dict[str, float]) -> None:
    self.curve.append({'version': version, 'wall': self.wall(), **scores})

  def meta(self, scheduler: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of it, with the `scheduler`'s state."""
    return {'counters': {k: c.tolist() for k, c in self.counters.items()},
            'scheduler': scheduler, 'wall_seconds': self.wall(),
            'curve': self.curve}

  def count(self, item, staleness: int, busy: float,
            scheduler_seconds: float, curvature_seconds: float) -> None:
    """Counts a trained batch (`item`: a `batches.Item`)."""
    out, c = item.rollout, self.counters
    c['staleness'][staleness] += 1
    c['difficulty'][item.difficulty] += 1
    c['staleness_by_difficulty'][item.difficulty, staleness] += 1
    c['totals'] += [len(out.rewards), out.generated_tokens, busy]
    c['scheduler'] += [scheduler_seconds, curvature_seconds]

  def scalars(self, item, staleness: int, update: dict[str, Any],
              scheduler: dict[str, float],
              curvatures: dict[int, float] | None) -> dict[str, float]:
    """An update's scalars: its `update` metrics, the `scheduler`'s and
    its `curvatures` (if measured), the batch's, and the rates since the
    start."""
    out, totals = item.rollout, self.counters['totals']
    elapsed = self.wall()
    scalars = {f'train/{key}': float(x) for key, x in update.items()}
    scalars.update(scheduler)
    if curvatures:
      scalars.update({f'gas/lambda_max/d{d}': x
                      for d, x in curvatures.items()})
    scalars.update({
        'reward': float(out.rewards.mean()),
        'difficulty': float(item.difficulty),
        'staleness': float(staleness),
        'generation_seconds': item.seconds,
        'samples_per_second': totals[0] / elapsed,
        'tokens_per_second': totals[1] / elapsed,
        'learner_busy_fraction': totals[2] / elapsed})
    return scalars

  def log(self, version: int, scalars: dict[str, float], writer,
          evaluate: Callable[[int], dict[str, float]]) -> None:
    """Evaluates when due; writes the metrics and the progress line."""
    config = self.config
    if version % config.eval_every == 0 or version == config.num_versions:
      scalars.update(evaluate(version))
    if version % config.log_every == 0 or 'eval/pass_at_1' in scalars:
      writer.write(version, scalars)
    if version % PROGRESS_EVERY == 0 or 'eval/pass_at_1' in scalars:
      rate, eta = self.progress.update(version)
      metrics_lib.log_progress(
          version, config.num_versions,
          {k: scalars[k] for k in PROGRESS_KEYS if k in scalars},
          rate, eta, console=('eval/pass_at_1',))

  def results(self) -> dict[str, Any]:
    return results(self.config, self.counters, self.curve, self.wall())


def results(config, counters, curve, seconds: float) -> dict[str, Any]:
  last = curve[-1]
  stale = counters['staleness']
  return {
      'versions': config.num_versions,
      'pass_at_1': {str(d): last[f'eval/pass_at_1_d{d}']
                    for d in config.difficulties},
      'mean_pass_at_1': last['eval/pass_at_1'],
      'initial_pass_at_1': {str(d): curve[0][f'eval/pass_at_1_d{d}']
                            for d in config.difficulties},
      'staleness_histogram': {str(i): int(n) for i, n in enumerate(stale)
                              if n},
      'difficulty_mix': {str(d): int(counters['difficulty'][d])
                         for d in config.difficulties},
      'staleness_by_difficulty': {
          str(d): {str(i): int(n) for i, n in enumerate(
              counters['staleness_by_difficulty'][d]) if n}
          for d in config.difficulties},
      'dropped': {str(d): int(counters['dropped'][d])
                  for d in config.difficulties},
      'scheduler_seconds': float(counters['scheduler'][0]),
      'curvature_seconds': float(counters['scheduler'][1]),
      'samples': int(counters['totals'][0]),
      'tokens': int(counters['totals'][1]),
      'wall_seconds': seconds,
      'samples_per_second': counters['totals'][0] / max(seconds, 1e-9),
      'learner_busy_fraction': counters['totals'][2] / max(seconds, 1e-9),
      'curve': curve,
  }


def plot(curve, config, path: str) -> None:
  fig, ax = plots.subplots(figsize=(6, 4))
  walls = [c['wall'] for c in curve]
  for d in config.difficulties:
    ax.plot(walls, [c[f'eval/pass_at_1_d{d}'] for c in curve], 'o-',
            label=f'{d} digits')
  ax.set_xlabel('wall time (s)')
  ax.set_ylabel('greedy pass@1 (held out)')
  bound = config.runtime.max_staleness
  ax.set_title(f'GRPO, {config.scheduler} scheduler, staleness <= {bound}, '
               f'{config.grpo.correction}')
  ax.grid(alpha=0.3)
  ax.legend()
  # Fixed margins, wide enough for extreme runs' labels (tests/test_plots):
  # every run draws this figure.
  fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.91)
  plots.save_png(fig, path, tight=False)
