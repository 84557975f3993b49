"""The SAM study's table: accuracy over seeds and the detector's statistics per method and rho."""

import statistics

from train.analysis import stats


def summarize(results: dict) -> str:
  """A markdown table of `training_runs.train_all`'s results."""
  def mean_std(values):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f'{100 * m:.2f} +- {100 * s:.2f}'

  head = ['method', 'rho', 'test accuracy % (mean +- std)', 'seeds',
          'val accuracy %', 'training loss, last fifth', 'SAM steps',
          'gradients per step',
          'runs flagged', 'flagged steps (mean)',
          '\\|g+\\|/\\|g\\| EMA at end', 'runs whose loss stalled']
  rows = []
  for (method, rho), runs in results.items():
    flagged = [r.get('opt/hallucination_steps', 0.0) for r in runs]
    n_flagged = sum(f > 0 for f in flagged)
    n_stalled = sum(bool(r.get('stalled')) for r in runs)
    sam_steps = [r.get('opt/sam_steps', 0.0) for r in runs]
    ratio = [r['opt/grad_ratio_ema'] for r in runs
             if r.get('opt/sam_steps', 0) > 0]
    rows.append([
        method, '-' if method == 'sgd' else f'{rho:g}',
        mean_std([r['test_accuracy'] for r in runs]), len(runs),
        mean_std([r['val_accuracy'] for r in runs]),
        f'{statistics.mean(r["late_train_loss"] for r in runs):.3f}',
        f'{statistics.mean(sam_steps):.0f}',
        f'{statistics.mean(1 + s / r["num_steps"] for s, r in zip(sam_steps, runs)):.2f}',
        f'{n_flagged}/{len(runs)}',
        f'{statistics.mean(flagged):.1f}',
        f'{statistics.mean(ratio):.3f}' if ratio else '-',
        f'{n_stalled}/{len(runs)}'])
  return stats.markdown_table(head, rows, '-' * len(head)) + '\n'
