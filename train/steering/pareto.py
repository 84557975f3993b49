"""The steering plots: success against KL per method, single runs (curves) and
the multi-seed study (means with 95% bands at matched KL), and the gate's
value distribution on held-out tokens (`plot_gate`)."""

import numpy as np

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


def plot_gate(delta_hist, beta: float, trigger_rate: float, title: str,
              out_path: str, validation: tuple | None = None,
              beta_label: str = 'beta') -> None:
  """The vMF gate's value delta = -tanh(kappa cos) on held-out test tokens.

  Args:
    delta_hist: counts per bin, equal bins over [-1, 1]
      (`geom.steering.SteerStats.delta_hist`).
    beta: the gate's threshold, marked (a token is steered where
      delta > beta) and named `beta_label` (e.g. 'calibrated beta').
    trigger_rate: the share of the tokens steered, in the title.
    title: what the gate is (method, layer, kind), before the rate.
    out_path: the PNG.
    validation: optional (delta_hist, trigger_rate) of other tokens (the
      selection's validation text), drawn as a step line.
  """
  counts = np.asarray(delta_hist, np.float64)
  edges = np.linspace(-1.0, 1.0, counts.size + 1)
  tokens = int(counts.sum())
  fig, ax = plots.subplots(1, 1, figsize=(6.5, 4))
  ax.bar(edges[:-1], counts / max(tokens, 1), width=np.diff(edges),
         align='edge', color='C0', alpha=0.6, edgecolor='C0',
         label=f'held-out test tokens ({tokens})')
  if validation is not None:
    v = np.asarray(validation[0], np.float64)
    ax.stairs(v / max(v.sum(), 1.0), edges, color='C1', lw=1.5,
              label=f'validation tokens ({int(v.sum())}), trigger rate '
                    f'{validation[1]:.1%}')
  ax.axvline(beta, color='k', ls='--', lw=1.2,
             label=f'{beta_label} = {beta:+.3f} (steered where delta > beta)')
  ax.set_xlim(-1, 1)
  ax.set_xlabel('gate value delta = -tanh(kappa cos)')
  ax.set_ylabel('share of tokens')
  ax.set_title(f'{title}\ntrigger rate {trigger_rate:.1%} of the {tokens} '
               'held-out test tokens', fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  plots.save_png(fig, out_path)
