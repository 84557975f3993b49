"""studies.sam_recipes: the LM experiment, the per-method radii, the stall
measure and one-line flag errors (subprocesses: studies' flags share
names, so two cannot be imported in one process), and the runs' configs,
records and table on a stand-in trainer (in process: training_runs and
report define no flags)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from studies.sam_recipes import report
from studies.sam_recipes import training_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(tmp_path, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'studies.sam_recipes', f'--workdir={tmp_path}',
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# Slow (the LM trained in a subprocess, 15 s): its configs are
# test_the_lm_study_configs_take_its_steps_and_warm_start's, its records
# and table test_the_study_records_each_run_and_tables_them's.
@pytest.mark.slow
def test_the_lm_experiment_trains_the_config_and_steps_it_is_given(tmp_path):
  result = _study(tmp_path, '--experiment=lm', '--config_arg=runlocal',
                  '--num_steps=12', '--seeds=1', '--methods=sam_warmstart',
                  '--rhos=2.0', '--warmstart_steps=4')
  assert result.returncode == 0, result.stderr[-3000:]
  runs = json.loads((tmp_path / 'study.json').read_text())
  assert list(runs) == ['sam_warmstart/2.0']
  sam = runs['sam_warmstart/2.0'][0]
  # The LM's own trainer ran (per-source losses), for --num_steps, with SAM
  # on only after the warm-start.
  assert sam['step'] == 12 and 'val_pydoc_loss' in sam
  assert sam['opt/sam_steps'] == 12 - 4
  assert sam['opt/rho'] == pytest.approx(2.0)
  # The stall measure: the mean of the last fifth of the logged losses.
  with open(tmp_path / 'sam_warmstart_rho2_seed0' / 'metrics.jsonl') as f:
    losses = [r['train_loss'] for r in map(json.loads, f)
              if 'train_loss' in r]
  tail = losses[-max(1, len(losses) // 5):]
  assert len(losses) >= 2 and sam['late_train_loss'] == pytest.approx(sum(tail) / len(tail))
  table = (tmp_path / 'study.md').read_text()
  assert '| sam_warmstart | 2 |' in table and 'training loss' in table


@pytest.mark.parametrize('flags, start', [
    (['--methods=sgd,adam'], "error: --methods='adam': unknown method"),
    (['--experiment=vit'], "error: --experiment='vit': unknown experiment"),
    (['--rhos=0.5,-1'], "error: --rhos='-1': a radius must be"),
    (['--asam_rhos=big'], "error: --asam_rhos='big': a radius must be"),
    (['--experiment=lm', '--dataset=mnist5k'],
     "error: --dataset='mnist5k': the LM reads its own corpora"),
    (['--num_steps=0'], "error: --num_steps=0: must be >= 1"),
    (['--num_steps=50', '--warmstart_steps=50'],
     "error: --warmstart_steps=50: must lie in [0, num_steps)"),
    # It was a StatisticsError traceback (exit 1) after the empty study.
    (['--seeds=0'], 'error: --seeds=0: must be an integer >= 1: a study '
     'needs at least 1 seed'),
])
def test_a_bad_flag_is_one_line_before_any_run(tmp_path, flags, start):
  result = _study(tmp_path, *flags, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(start), result.stderr
  assert os.listdir(tmp_path) == []


def _readme_commands():
  """studies/sam_recipes/README.md's commands, as {flag: value}."""
  with open(os.path.join(ROOT, 'studies', 'sam_recipes', 'README.md')) as f:
    joined = re.sub(r'\\\n\s*', '', f.read())
  commands = [shlex.split(line.strip()) for line in joined.splitlines()
              if line.startswith('    python -m ')]
  assert all(c[:3] == ['python', '-m', 'studies.sam_recipes']
             for c in commands)
  return [dict(a[2:].split('=', 1) for a in c[3:]) for c in commands]


def test_every_readme_command_names_real_flags_and_configs():
  # The commands behind the README's tables train for hours: here, their
  # flags exist and every run's config builds (a renamed flag or config
  # argument would leave the README's commands failing).
  with open(os.path.join(ROOT, 'studies', 'sam_recipes', '__main__.py')) as f:
    defined = set(re.findall(r"flags\.DEFINE_\w+\(\s*'(\w+)'", f.read()))
  commands = _readme_commands()
  assert len(commands) == 10
  for flags in commands:
    assert set(flags) <= defined, flags
    study = training_runs.Study(
        root=flags['workdir'], experiment=flags.get('experiment', 'digits'),
        config_arg=flags.get('config_arg', ''),
        methods=tuple(flags.get('methods', ','.join(training_runs.RECIPES))
                      .split(',')),
        rhos=tuple(map(float, flags.get('rhos', '1').split(','))),
        asam_rhos=(tuple(map(float, flags['asam_rhos'].split(',')))
                   if 'asam_rhos' in flags else None),
        num_steps=int(flags['num_steps']) if 'num_steps' in flags else None)
    assert set(study.methods) <= set(training_runs.METHODS), flags
    for method in study.methods:
      for rho in study.radii(method):
        config = study.config(method, rho, 0)
        assert config.optimizer.sam.enabled == (method != 'sgd')
        assert config.optimizer.sam.every == training_runs.LOOKSAM.get(
            method, 1)
        ae = config.optimizer.sam.ae
        assert ae.enabled == (method in ('aesam', 'aesam_linear'))
        if method == 'aesam_linear':  # The paper's c, -1 to 1.
          assert (ae.margin_start, ae.margin_end) == (-1.0, 1.0)
        elif method == 'aesam':
          assert (ae.margin_start, ae.margin_end) == (0.0, 0.0)


def _fake_train(config, workdir):
  """A stand-in for trainers.train_and_evaluate: writes a run's metrics log
  as the trainer does (one record per log_every steps, the optimizer's
  statistics in it) without training, and returns its final metrics."""
  os.makedirs(workdir)
  sam = config.optimizer.sam
  steps = config.num_steps
  sam_steps = 0 if not sam.enabled else (
      (steps - sam.warmup_steps + sam.every - 1) // sam.every)
  # Losses 10, 9, ..., 1 (a run whose last fifth, 2 and 1, averages 1.5)
  # for SAM; ln 10 + 1 throughout (stalled) for plain SGD.
  records = [{'step': 4 * (i + 1),
              'train_loss': (10.0 - i) if sam.enabled else 3.3026,
              'opt/sam_steps': float(sam_steps),
              'opt/hallucination_steps': 3.0 if sam.adaptive else 0.0,
              'opt/grad_ratio_ema': 0.5, 'opt/rho': sam.rho}
             for i in range(10)]
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  return {'step': steps, 'test_accuracy': 0.5 + config.seed / 10,
          'val_accuracy': 0.25}


def test_the_study_records_each_run_and_tables_them(tmp_path, monkeypatch):
  # The study's own code between the trainer and its files: the runs'
  # configs (label noise, each method's radius, LookSAM's k, AE-SAM's
  # switch), the records it keeps of a run's log (the optimizer's last
  # statistics, the late loss, the stall) and the table of them, on a
  # stand-in trainer. test_label_noise's study command trains the same
  # runs (slow).
  monkeypatch.setattr(training_runs.trainers, 'train_and_evaluate',
                      _fake_train)
  study = training_runs.Study(
      root=str(tmp_path), config_arg='runlocal,label_noise=0.4,model=mlp',
      methods=('sgd', 'sam', 'asam', 'looksam5', 'aesam'), rhos=(0.5,),
      asam_rhos=(3.0,), seeds=2)
  config = study.config('looksam5', 0.5, 1)
  assert (config.label_noise, config.seed, config.num_steps) == (0.4, 1, 40)
  assert config.optimizer.sam.every == 5 and not config.optimizer.sam.ae.enabled
  assert study.config('aesam', 0.5, 0).optimizer.sam.ae.enabled
  asam = study.config('asam', 3.0, 0).optimizer.sam
  assert asam.adaptive and asam.rho == 3.0 and study.radii('asam') == (3.0,)
  runs = training_runs.train_all(study)
  assert list(runs) == [('sgd', 0.0), ('sam', 0.5), ('asam', 3.0),
                        ('looksam5', 0.5), ('aesam', 0.5)]
  assert sorted(os.listdir(tmp_path)) == sorted(
      f'{m}_rho{r:g}_seed{s}' for m, r in runs for s in range(2))
  look = runs[('looksam5', 0.5)][1]
  assert look['opt/sam_steps'] == 8 and look['num_steps'] == 40
  assert look['late_train_loss'] == 1.5 and not look['stalled']
  assert look['test_accuracy'] == 0.6 and 'train_loss' not in look
  # SGD's loss stays above 0.9 ln 10 = 2.07: stalled.
  assert runs[('sgd', 0.0)][0]['stalled']
  table = report.summarize(runs).splitlines()
  assert 'runs flagged' in table[0] and 'stalled' in table[0]
  # Accuracy 55 +- 7.07 over the seeds; LookSAM's 8 g+ in 40 steps are
  # 1.20 gradients a step; ASAM's 3 flagged steps in both runs.
  assert table[5].startswith('| looksam5 | 0.5 | 55.00 +- 7.07 | 2 | ')
  assert '| 1.500 | 8 | 1.20 | 0/2 | 0.0 | 0.500 | 0/2 |' in table[5]
  assert '| 2/2 | 3.0 |' in table[4] and table[2].startswith('| sgd | - |')
  assert table[2].endswith('| 2/2 |')


def test_the_lm_study_configs_take_its_steps_and_warm_start():
  # The LM experiment's run configs, as test_the_lm_experiment_trains_...
  # (slow) trains one: --num_steps and --warmstart_steps reach the LM's
  # config, and the stall compares with ln of its vocabulary.
  study = training_runs.Study(root='unused', experiment='lm',
                              config_arg='runlocal', num_steps=12,
                              warmstart_steps=4, rhos=(2.0,))
  config = study.config('sam_warmstart', 2.0, 0)
  assert config.task == 'lm' and config.num_steps == 12
  sam = config.optimizer.sam
  assert sam.enabled and sam.warmup_steps == 4 and sam.rho == 2.0
  assert training_runs.num_classes(config) == config.model.vocab_size
  records = [{'train_loss': x} for x in (9.0, 8.0, 7.0, 6.0, 5.0, 4.0)]
  assert training_runs.late_loss(records) == 4.0  # The last fifth: 1 of 6.
  assert training_runs.stalled(records, 2) and not training_runs.stalled(
      records, 1000)
