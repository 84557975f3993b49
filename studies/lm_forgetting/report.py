"""The study's table (`summarize`) and figure (`plot`) from its records
(one per variant and seed, `measure.measure`'s)."""

import statistics

from studies.lm_forgetting.settings import VARIANTS
from train.analysis import plots
from train.analysis import stats

# The companion paper's abstract: SAM mid-training's reduction of
# forgetting, in percent.
PAPER = {'post': 31, 'quant': 40}


def summarize(records: list[dict], paper: dict = PAPER) -> str:
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
  variants = [v for v in VARIANTS if any(r['variant'] == v for r in records)]
  fig, axes = plots.subplots(1, 3, figsize=(15, 4.2))
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
