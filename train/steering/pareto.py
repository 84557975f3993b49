"""The steering plots: success against KL per method, single runs (curves) and
the multi-seed study (means with 95% bands at matched KL)."""

from train.analysis import plots


def plot_pareto(rows: list[dict], tasks: list[str], out_path: str) -> None:
  """Steering success (multiple-choice accuracy on mean log-prob, one panel
  per task, and the positive share of generations) against the KL to the
  unsteered model on held-out text: one curve per method over alpha."""
  panels = [(f'{t}_acc_mean', f'{t}: accuracy (mean log-prob)')
            for t in tasks] + [('positive_share',
                                'generations: positive share')]
  fig, axes = plots.subplots(1, len(panels), figsize=(5 * len(panels), 4))
  methods = list(dict.fromkeys(r['method'] for r in rows))
  for ax, (key, title) in zip(axes, panels):
    for method in methods:
      pts = sorted((r['kl'], r[key]) for r in rows if r['method'] == method)
      if method == 'none':  # KL 0: a reference line, not a point.
        ax.axhline(pts[0][1], color='k', ls='--', lw=1, label='none (KL 0)')
        continue
      ax.plot(*zip(*pts), 'o-', label=method, markersize=4)
    ax.set_xscale('log')
    ax.set_xlabel('KL(unsteered || steered) per token, held-out text')
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  plots.save_png(fig, out_path)


def plot_bands(panels: dict[str, dict[str, tuple]], out_path: str,
               unsteered: dict[str, tuple] | None = None) -> None:
  """Accuracy at matched KL with its 95% band, one panel per task.

  Args:
    panels: {title: {method: (kl, mean, low, high)}}, arrays over a KL
      grid (NaN where not every LM reached that KL: left blank).
    out_path: the PNG.
    unsteered: {title: (mean, low, high)} of the unsteered model, drawn as
      a line with its band.
  """
  fig, axes = plots.subplots(
      1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, (title, curves) in zip(axes[0], panels.items()):
    if unsteered and title in unsteered:
      mean, low, high = unsteered[title]
      ax.axhline(mean, color='k', ls='--', lw=1, label='none (KL 0)')
      ax.axhspan(low, high, color='k', alpha=0.08)
    for method, (kl, mean, low, high) in curves.items():
      line, = ax.plot(kl, mean, '-', label=method, lw=1.5)
      ax.fill_between(kl, low, high, color=line.get_color(), alpha=0.2,
                      lw=0)
    ax.set_xscale('log')
    ax.set_xlabel('KL(unsteered || steered) per token, held-out text')
    ax.set_ylabel('accuracy (mean log-prob), 95% band')
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  plots.save_png(fig, out_path)
