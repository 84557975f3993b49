r"""Spherical steering's claims with their uncertainty: several LMs and item sets.

  python -m studies.steering --workdir=workdirs/steering_study
  python -m studies.steering --workdir=workdirs/steering_study_sp \
      --lm_config_arg=tokenizer=sentencepiece

For each LM seed (`--lm_seeds`), an LM is pretrained by `launch.train`
(`configs/lm.py`, argument `--lm_config_arg`) in `lm_seed<S>/` below
`--workdir`: resumable, and a finished run is not trained again. Each LM
is then evaluated (`configs/steering.py`, argument
`--steering_config_arg`) on the same item sets (`--item_seeds`), with the
steering direction extracted from that LM, in `eval_lm<S>/`; and once per
extra gate threshold (`--gate_betas`, the gated rotation only) in
`eval_lm<S>_beta<B>/`, for the gate's trigger rate against accuracy. An
evaluation already in its directory with the same config is reused; one
with another config is refused (a workdir holds one study). An LM whose
evaluations are all finished is not trained, even if its checkpoints are
gone: the evaluations' results.json files are the study's record, and a
study can be carried on elsewhere by copying them into a new --workdir.

Then `studies.steering.report` compares methods at matched KL
(`--targets`): accuracy with a 95% hierarchical bootstrap interval over
LMs, item sets and items, paired differences, the gate x geometry
ablation, the trigger rate against accuracy, and the generations'
measures. Writes `study.md`, `study.json` and `pareto_bands.png`.

A bad flag ends the run before any compute with one line naming it
(exit status 2).
"""

import os

from absl import app
from absl import flags

from configs import lm
from studies.steering import lm_runs
from train.training import experiment
from train.analysis import stats
from train.errors import UsageError
from train.jobs import entry
from train.steering import evaluation

_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the study.')
_LM_SEEDS = flags.DEFINE_list('lm_seeds', ['0', '1', '2'], 'LM seeds.')
_ITEM_SEEDS = flags.DEFINE_list('item_seeds', ['7', '8', '9'],
                                'Item-set seeds (the same for every LM).')
_LM_CONFIG_ARG = flags.DEFINE_string(
    'lm_config_arg', '', 'Argument of configs/lm.py (e.g. '
    'tokenizer=sentencepiece, runlocal).')
_STEERING_CONFIG_ARG = flags.DEFINE_string(
    'steering_config_arg', '', 'Argument of configs/steering.py (e.g. '
    'runlocal).')
_TARGETS = flags.DEFINE_list('targets', ['0.05', '0.1', '0.2', '0.33', '0.5'],
                             'KL values at which methods are compared.')
_GATE_BETAS = flags.DEFINE_list(
    'gate_betas', ['-0.5', '0.3'], 'Extra gate thresholds for the gated '
    'rotation (the trigger rate against accuracy); empty: none.')
_SAMPLES = flags.DEFINE_integer('bootstrap_samples', 2000,
                                'Bootstrap replicates per interval.')
flags.mark_flags_as_required(['workdir'])


def _numbers(flag: str, values: list[str], kind, check, problem: str):
  out = []
  for value in values:
    try:
      number = kind(value)
    except ValueError:
      raise UsageError(flag, value, f'not a number; {problem}') from None
    if not check(number):
      raise UsageError(flag, value, problem)
    out.append(number)
  if len(set(out)) != len(out):
    raise UsageError(flag, ','.join(values), 'has a repeated value')
  return out


def check_flags() -> dict:
  """The parsed settings; UsageError naming the flag, before any compute."""
  lm_seeds = stats.check_seed_list('--lm_seeds', _LM_SEEDS.value)
  item_seeds = stats.check_seed_list('--item_seeds', _ITEM_SEEDS.value)
  targets = _numbers('--targets', _TARGETS.value, float, lambda v: v > 0,
                     'a target KL is > 0')
  if not targets or targets != sorted(targets):
    raise UsageError('--targets', ','.join(_TARGETS.value),
                     'give increasing KL values')
  betas = _numbers('--gate_betas', _GATE_BETAS.value, float,
                   lambda v: -1.0 <= v < 1.0, 'a gate threshold is in [-1, 1)')
  if _SAMPLES.value < 100:
    raise UsageError('--bootstrap_samples', _SAMPLES.value, 'must be >= 100')
  base = lm_runs.eval_config(_WORKDIR.value, _STEERING_CONFIG_ARG.value, 0,
                             item_seeds)
  if base.beta in betas:
    raise UsageError('--gate_betas', base.beta, 'is the evaluation\'s own '
                     'beta (already in the main evaluation)')
  try:
    lm.get_config(_LM_CONFIG_ARG.value or None)
  except ValueError as e:
    raise UsageError('--lm_config_arg', _LM_CONFIG_ARG.value,
                     str(e).removeprefix('configs/lm.py: ')) from None
  evaluation.check_config(base)
  return dict(lm_seeds=lm_seeds, item_seeds=item_seeds, targets=targets,
              betas=betas)


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    settings = check_flags()
    experiment.check_workdir(_WORKDIR.value)
    root = _WORKDIR.value
    eval_config = lambda seed, beta=None: lm_runs.eval_config(
        root, _STEERING_CONFIG_ARG.value, seed, settings['item_seeds'], beta)
    entry.configure_devices(eval_config(0))
    # pylint: disable=g-import-not-at-top
    from studies.steering import report
    from train.run import metrics
    # pylint: enable=g-import-not-at-top
    plan = [(seed, beta, eval_config(seed, beta),
             f'eval_lm{seed}' + ('' if beta is None else f'_beta{beta:g}'))
            for seed in settings['lm_seeds']
            for beta in [None, *settings['betas']]]
    # Refuses another study's work before any compute. An LM whose
    # evaluations are all finished is not needed again: the evaluations'
    # results.json (small) can outlive the checkpoints.
    pending = {seed for seed, _, config, name in plan
               if lm_runs.finished(root, config, name) is None}
    runs, beta_runs = [], {b: [] for b in settings['betas']}
    for seed, beta, config, name in plan:
      if beta is None:
        if seed in pending:
          lm_runs.train_lm(root, _LM_CONFIG_ARG.value, seed)
        runs.append(lm_runs.evaluate(root, config, name))
      else:
        beta_runs[beta].append(lm_runs.evaluate(root, config, name))
    summary = report.build(runs, beta_runs, settings['targets'],
                           _SAMPLES.value)
    summary['lm_seeds'] = settings['lm_seeds']
    text = report.markdown(summary)
    metrics.write_json_atomic(os.path.join(root, 'study.json'), summary)
    metrics.write_text_atomic(os.path.join(root, 'study.md'), text)
    report.plot(runs, os.path.join(root, 'pareto_bands.png'))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
