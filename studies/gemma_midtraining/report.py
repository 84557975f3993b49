"""The study's report from its stored measures.

`records(measures_dir, settings)` reads what `measure` stored;
`summarize(mids, posts)` is the markdown (midtraining.md): the
mid-trained models, their forgetting after post-training and after 4-bit
quantisation with reductions paired by seed (against AdamW mid-training,
the control, and against the checkpoint; Student's t interval over the
seeds for the control), what post-training bought, and
how sharpness and forgetting rank together; `write` writes it and the
JSON of the records (midtraining.json).
"""

import json
import os

import numpy as np

from studies.gemma_midtraining.settings import CHECKPOINT
from studies.gemma_midtraining.settings import PAPER
from studies.gemma_midtraining.settings import REFERENCE
from studies.gemma_midtraining.settings import Settings
from train import fileio
from train.analysis import stats

REPORT = 'midtraining.md'
RECORDS = 'midtraining.json'
KINDS = {'post': 'post-training', 'quant': '4-bit quantisation'}


def records(measures_dir: str, settings: Settings
            ) -> tuple[dict[str, dict], dict[str, dict]]:
  """({variant: {seed: mid record}}, {variant: {seed: post record}}); the
  checkpoint's one mid record stands for every seed."""
  def read(name):
    with open(os.path.join(measures_dir, f'{name}.json')) as f:
      return json.load(f)

  def mid(name):
    record = read(f'mid_{name}')
    path = os.path.join(measures_dir, f'sharpness_{name}.json')
    if os.path.exists(path):
      record.update({k: v for k, v in read(f'sharpness_{name}').items()
                     if k != 'identity'})
    return record
  seeds = range(settings.seeds)
  checkpoint = mid('checkpoint')
  mids = {CHECKPOINT: {s: checkpoint for s in seeds}}
  mids.update({v: {s: mid(f'{v}_seed{s}') for s in seeds}
               for v in settings.midtrained})
  posts = {v: {s: read(f'post_{v}_seed{s}') for s in seeds}
           for v in settings.variants}
  return mids, posts


def forgetting(mid: dict, post: dict) -> dict[str, float]:
  """Increase of held-out CE from the mid-trained model to its
  post-trained ('post') and quantised ('quant') versions, and the drop
  of the probes' answer log-probability ('post_probes', 'quant_probes')."""
  return dict(post=post['heldout_ce'] - mid['heldout_ce'],
              quant=mid['quant_ce'] - mid['heldout_ce'],
              post_probes=mid['probes']['logprob']
              - post['probes']['logprob'],
              quant_probes=mid['probes']['logprob']
              - mid['quant_probes']['logprob'])


def reductions(mids: dict, posts: dict, variant: str, reference: str,
               kind: str) -> list[float]:
  """1 - F_variant / F_reference per seed (seeds where the reference
  forgot)."""
  out = []
  for s in sorted(set(posts[variant]) & set(posts[reference])):
    f = forgetting(mids[variant][s], posts[variant][s])[kind]
    f_ref = forgetting(mids[reference][s], posts[reference][s])[kind]
    if f_ref > 0:
      out.append(1 - f / f_ref)
  return out


def _percent(values: list[float]) -> str:
  return stats.mean_std(values, 100, 0) + '%' if values else '-'


def _sci(values: list[float]) -> str:
  # Sharpness spans 1e2 to 1e5 across models.
  return stats.mean_std(values, digits=2, notation='e')


def _mid_table(mids: dict) -> str:
  head = ['mid-trained model', 'held-out CE', 'probe log-prob',
          'probes known %', 'lambda_max', 'lambda_min', 'trace',
          'trace stderr', 'mid-training loss']
  rows = []
  for v, by_seed in mids.items():
    rs = list({id(r): r for r in by_seed.values()}.values())
    col = lambda key: [r[key] for r in rs if key in r]
    rows.append([v, stats.mean_std(col('heldout_ce'), digits=4),
                 stats.mean_std([r['probes']['logprob'] for r in rs],
                                digits=3),
                 stats.mean_std([r['probes']['known'] for r in rs], 100),
                 _sci(col('lambda_max')),
                 _sci(col('lambda_min')),
                 _sci(col('trace')),
                 _sci(col('trace_stderr')),
                 stats.mean_std(col('final_train_loss'), digits=3)])
  return stats.markdown_table(head, rows)


def _forgetting_table(mids: dict, posts: dict) -> str:
  head = ['variant']
  for kind in KINDS:
    head += [f'forgetting ({kind})', f'reduction vs {REFERENCE}',
             f'reduction vs {CHECKPOINT}', f'probe drop ({kind})']
  rows = []
  for v in posts:
    row = [v]
    for kind in KINDS:
      f = [forgetting(mids[v][s], posts[v][s]) for s in sorted(posts[v])]
      row += [stats.mean_std([x[kind] for x in f], digits=4)]
      for ref in (REFERENCE, CHECKPOINT):
        row.append('-' if v == ref else
                   _percent(reductions(mids, posts, v, ref, kind)))
      row.append(stats.mean_std([x[f'{kind}_probes'] for x in f],
                                digits=3))
    rows.append(row)
  return stats.markdown_table(head, rows)


def _bought_table(mids: dict, posts: dict) -> str:
  difficulties = sorted(next(iter(posts[CHECKPOINT].values()))['pass_at_1'])
  before = next(iter(mids[CHECKPOINT].values())).get('pass_at_1', {})
  head = (['post-trained from', 'answer CE']
          + [f'pass@1 {d} %' for d in difficulties])
  rows = [[f'{CHECKPOINT}, before post-training', '-'] + [
      f'{100 * before[d]:.1f}' if d in before else '-' for d in difficulties]]
  for v, by_seed in posts.items():
    rs = [by_seed[s] for s in sorted(by_seed)]
    rows.append([v, stats.mean_std([r['answer_ce'] for r in rs], digits=3)]
                + [stats.mean_std([r['pass_at_1'][d] for r in rs], 100)
                   for d in difficulties])
  return stats.markdown_table(head, rows)


def _paired_lines(mids: dict, posts: dict) -> list[str]:
  lines = []
  for v in [v for v in posts if v not in (CHECKPOINT, REFERENCE)]:
    for kind, what in KINDS.items():
      red = reductions(mids, posts, v, REFERENCE, kind)
      per_seed = ', '.join(f'{100 * r:+.0f}%' for r in red) or 'none'
      lo, hi = stats.t_interval(red)
      interval = (f'; 95% t-interval [{100 * lo:.0f}%, {100 * hi:.0f}%]'
                  if np.isfinite(lo) else '')
      lines.append(f'- {v}, {what}: reduction against {REFERENCE} '
                   f'{_percent(red)} (per seed: {per_seed}; seeds where '
                   f'{REFERENCE} forgot: {len(red)}{interval}); paper '
                   f'{100 * PAPER[kind]:.0f}%.')
  return lines


def _rank_lines(mids: dict, posts: dict) -> list[str]:
  """Spearman's rank correlation of each sharpness with each forgetting
  over every (variant, seed) model."""
  pairs = [(mids[v][s], forgetting(mids[v][s], posts[v][s]))
           for v in posts for s in sorted(posts[v])]
  lines = []
  for key in ('lambda_max', 'trace'):
    if all(key in m for m, _ in pairs):
      for kind, what in KINDS.items():
        rho = stats.spearman([m[key] for m, _ in pairs],
                             [f[kind] for _, f in pairs])
        lines.append(f'- {key} against forgetting after {what}: Spearman '
                     f'{rho:.2f} over {len(pairs)} models.'
                     if np.isfinite(rho) else
                     f'- {key} against forgetting after {what}: undefined '
                     '(a constant side).')
  return lines


def summarize(mids: dict, posts: dict) -> str:
  """The report's markdown."""
  return '\n'.join([
      'Mid-trained models (mean ± std over seeds; the checkpoint is one '
      'model):', '', _mid_table(mids), '',
      'Forgetting: held-out CE increase (nats per token) from each '
      'mid-trained model to its post-trained and its 4-bit version; '
      'reductions 1 - F / F_reference paired by seed; probe drop: the '
      "probes' answer log-probability lost:", '',
      _forgetting_table(mids, posts), '',
      *_paired_lines(mids, posts), '',
      'What post-training bought:', '', _bought_table(mids, posts), '',
      'Sharpness and forgetting:', '', *_rank_lines(mids, posts)]) + '\n'


def write(root: str, mids: dict, posts: dict) -> str:
  """midtraining.md and midtraining.json into `root`; returns the former."""
  text = summarize(mids, posts)
  fileio.write_text_atomic(os.path.join(root, REPORT), text)
  plain = lambda d: {v: {str(s): r for s, r in by.items()}
                     for v, by in d.items()}
  fileio.write_text_atomic(os.path.join(root, RECORDS), json.dumps(
      dict(mid=plain(mids), post=plain(posts)), indent=1, sort_keys=True)
                           + '\n')
  return text
