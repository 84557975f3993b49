"""PNGs of a run's curves (from `metrics.jsonl`) and of a sweep's results,
written atomically, locally or to a bucket; headless (Agg)."""

import io

from train import fileio
from train.run import metrics as metrics_lib


def subplots(nrows: int = 1, ncols: int = 1, *, figsize=None, **kwargs):
  """`(figure, axes)` as `pyplot.subplots` returns them, without pyplot.

  A bare `matplotlib.figure.Figure` renders to PNG through the Agg canvas
  and needs no display or figure manager; importing pyplot (its backend
  machinery) cost a launcher process 1 s of its 7.5, against 0.5 s for
  the figure module, and every run that ends plots its curves. Imported
  when a plot is drawn, not with this module.
  """
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  fig = figure.Figure(figsize=figsize)
  return fig, fig.subplots(nrows, ncols, **kwargs)


def save_png(fig, out_path: str, *, tight: bool = True) -> None:
  """Writes the figure as PNG atomically (local or gs://); `tight=False`
  keeps the margins the figure has (`tight_layout` measures every label
  by rendering it: half the time of a run's curves)."""
  if tight:
    fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=100)
  fileio.write_bytes_atomic(out_path, buffer.getvalue())


def plot_curves(metrics_path: str, out_path: str) -> None:
  """Plots train/validation loss and accuracy against step."""
  records = metrics_lib.read_jsonl(metrics_path)
  fig, (ax_loss, ax_acc) = subplots(1, 2, figsize=(10, 4))
  for prefix, style in (('train', '-'), ('val', 'o-')):
    for name, ax in ((f'{prefix}_loss', ax_loss),
                     (f'{prefix}_accuracy', ax_acc)):
      points = [(r['step'], r[name]) for r in records
                if r.get(name) is not None]
      if points:
        steps, values = zip(*points)
        ax.plot(steps, values, style, label=name, markersize=3)
  tests = [r for r in records if r.get('test_accuracy') is not None]
  if tests:
    ax_acc.axhline(tests[-1]['test_accuracy'], color='k', ls='--', lw=0.8,
                   label=f'test_accuracy {tests[-1]["test_accuracy"]:.4f}')
  ax_loss.set_yscale('log')
  for ax, title in ((ax_loss, 'loss'), (ax_acc, 'accuracy')):
    ax.set_xlabel('step')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
  # Fixed margins, wide enough for extreme runs' labels (tests/test_plots):
  # every run that ends draws this figure.
  fig.subplots_adjust(left=0.085, right=0.985, bottom=0.12, top=0.93,
                      wspace=0.2)
  save_png(fig, out_path, tight=False)


def plot_sweep(groups: list[dict], keys: list[str], metric: str,
               out_path: str) -> None:
  """`metric` (mean, error bar one std) against the first swept key, one
  line per setting of the other swept keys; a bar per group if none."""
  fig, ax = subplots(figsize=(6, 4))
  if not keys:
    labels = [str(i) for i in range(len(groups))]
    ax.bar(labels, [g['mean'][metric] for g in groups],
           yerr=[g['std'][metric] for g in groups], capsize=4)
  else:
    x_key, rest = keys[0], keys[1:]
    lines: dict[str, list] = {}
    for g in groups:
      label = ', '.join(f'{k}={g["setting"][k]}' for k in rest) or metric
      lines.setdefault(label, []).append(g)
    numeric = all(isinstance(g['setting'][x_key], (int, float))
                  and not isinstance(g['setting'][x_key], bool)
                  for g in groups)
    for label, members in lines.items():
      members.sort(key=lambda g: g['setting'][x_key] if numeric
                   else str(g['setting'][x_key]))
      xs = [g['setting'][x_key] if numeric else str(g['setting'][x_key])
            for g in members]
      ax.errorbar(xs, [g['mean'][metric] for g in members],
                  yerr=[g['std'][metric] for g in members], marker='o',
                  capsize=3, label=f'{label} (n={members[0]["n"]})')
    xs = [g['setting'][x_key] for g in groups]
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 10:
      ax.set_xscale('log')
    ax.set_xlabel(x_key)
    ax.legend(fontsize=8)
  ax.set_ylabel(f'{metric} (mean +- std over seeds)')
  ax.grid(alpha=0.3)
  save_png(fig, out_path)
