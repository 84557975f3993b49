"""studies.sam_recipes: the LM experiment, the per-method radii, the stall
measure and one-line flag errors (subprocesses: studies' flags share
names, so two cannot be imported in one process)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from studies.sam_recipes import training_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(tmp_path, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'studies.sam_recipes', f'--workdir={tmp_path}',
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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
