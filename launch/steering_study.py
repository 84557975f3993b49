r"""Spherical steering's claims with their uncertainty: several LMs and item sets.

  python -m launch.steering_study --workdir=workdirs/steering_study
  python -m launch.steering_study --workdir=workdirs/steering_study_sp \
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

Then `train.steering.study_report` compares methods at matched KL
(`--targets`): accuracy with a 95% hierarchical bootstrap interval over
LMs, item sets and items, paired differences, the gate x geometry
ablation, the trigger rate against accuracy, and the generations'
measures. Writes `study.md`, `study.json` and `pareto_bands.png`.

A bad flag ends the run before any compute with one line naming it
(exit status 2).
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags
from absl import logging

from configs import lm
from configs import steering
from launch import entry
from train import experiment
from train import fileio
from train import stats
from train.errors import RunError
from train.errors import UsageError
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
  base = eval_config(0, item_seeds)
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


def lm_workdir(seed: int) -> str:
  return os.path.join(_WORKDIR.value, f'lm_seed{seed}')


def eval_config(seed: int, item_seeds, beta: float | None = None):
  config = steering.get_config(_STEERING_CONFIG_ARG.value or None)
  config.lm_workdir = lm_workdir(seed)
  config.mc_seeds = tuple(item_seeds)
  if beta is not None:
    config.methods = ('none', 'spherical_gate')
    config.beta = beta
  return config


def train_lm(seed: int) -> None:
  """`launch.train` for one LM seed (resumes; a finished run returns at once)."""
  workdir = lm_workdir(seed)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  cmd = [sys.executable, '-m', 'launch.train',
         '--config=configs/lm.py' + (f':{_LM_CONFIG_ARG.value}'
                                     if _LM_CONFIG_ARG.value else ''),
         f'--config.seed={seed}', f'--workdir={workdir}']
  log = os.path.join(_WORKDIR.value, f'lm_seed{seed}.log')
  logging.info('LM seed %d: %s (log %s)', seed, ' '.join(cmd), log)
  # The study's own files are opened through fileio: a FIFO put in their
  # place would block an open.
  with fileio.open_local(log, 'a', root=_WORKDIR.value) as f:
    proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                          cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
  if proc.returncode:
    with fileio.open_local(log, root=_WORKDIR.value) as f:
      errors = [l.strip() for l in f if l.startswith('error:')]
    raise RunError(f'training LM seed {seed} failed (exit {proc.returncode}): '
                   f'{errors[-1] if errors else "see " + log}')


def finished(config, name: str) -> dict | None:
  """The finished evaluation in `name/` if its config is `config`; None if
  there is none; UsageError if it was made with another config."""
  path = os.path.join(_WORKDIR.value, name, 'results.json')
  if not os.path.exists(path):
    return None
  results = json.loads(fileio.read_text(path, _WORKDIR.value))
  wanted = json.loads(config.to_json())
  have = results['meta'].get('config') or {}
  if have == wanted:
    return results
  diff = sorted(k for k in set(wanted) | set(have)
                if have.get(k) != wanted.get(k))
  raise UsageError('--workdir', _WORKDIR.value,
                   f'{name}/ holds an evaluation with another config '
                   f'({", ".join(diff)}); give a new --workdir')


def evaluate(config, name: str) -> dict:
  """The evaluation in `name/` (reused when its config is this one)."""
  results = finished(config, name)
  if results is not None:
    logging.info('%s: reusing the finished evaluation', name)
    return results
  workdir = os.path.join(_WORKDIR.value, name)
  evaluation.evaluate(config, workdir)
  return json.loads(fileio.read_text(os.path.join(workdir, 'results.json'),
                                     workdir))


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    settings = check_flags()
    experiment.check_workdir(_WORKDIR.value)
    entry.configure_devices(eval_config(0, settings['item_seeds']))
    # pylint: disable=g-import-not-at-top
    from train import metrics
    from train.steering import study_report
    # pylint: enable=g-import-not-at-top
    plan = [(seed, beta, eval_config(seed, settings['item_seeds'], beta),
             f'eval_lm{seed}' + ('' if beta is None else f'_beta{beta:g}'))
            for seed in settings['lm_seeds']
            for beta in [None, *settings['betas']]]
    # Refuses another study's work before any compute. An LM whose
    # evaluations are all finished is not needed again: the evaluations'
    # results.json (small) can outlive the checkpoints.
    pending = {seed for seed, _, config, name in plan
               if finished(config, name) is None}
    runs, beta_runs = [], {b: [] for b in settings['betas']}
    for seed, beta, config, name in plan:
      if beta is None:
        if seed in pending:
          train_lm(seed)
        runs.append(evaluate(config, name))
      else:
        beta_runs[beta].append(evaluate(config, name))
    summary = study_report.build(runs, beta_runs, settings['targets'],
                                 _SAMPLES.value)
    summary['lm_seeds'] = settings['lm_seeds']
    text = study_report.markdown(summary)
    root = _WORKDIR.value
    metrics.write_json_atomic(os.path.join(root, 'study.json'), summary)
    metrics.write_text_atomic(os.path.join(root, 'study.md'), text)
    study_report.plot(runs, os.path.join(root, 'pareto_bands.png'))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
