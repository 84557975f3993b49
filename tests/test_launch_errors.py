"""Bad input: one clear line naming the setting, non-zero exit, no traceback, workdir intact."""

import hashlib
import os
import subprocess

import ml_collections
import pytest

from train.jobs import entry
from train.jobs import trainers
from tests import config_edits
from tests import launch_runs
from train import errors


def _snapshot(root):
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope='module')
def finished_workdir(digits_runlocal_run):
  """A workdir holding a finished run: its files must survive every mistake."""
  return digits_runlocal_run[0]


# Config mistakes as config changes, checked in-process (the launcher
# prints `error: <the UsageError>` and exits 2: test_a_bad_config_through_
# the_launcher_is_one_line_and_exit_2).
CASES = {
    'unknown model': (
        {'model.name': 'vit'},
        "config.model.name='vit': unknown model; valid choices: 'cnn', "
        "'mlp', 'resnet', 'wrn'"),
    'unknown data set': (
        {'dataset': 'imagenet'},
        "config.dataset='imagenet': unknown data set; valid choices: "
        "'cifar10', 'cifar100', 'digits'"),
    'unknown optimizer': (
        {'optimizer.name': 'lamb'},
        "config.optimizer.name='lamb': unknown optimizer; valid choices: "
        "'sgd', 'momentum', 'adamw'"),
    'mesh does not match the devices': (
        {'mesh.shape': (3, 2)},
        'config.mesh.shape=(3, 2): needs 6 devices but there are 8; shapes '
        'that fit: (-1, 1), (8, 1), (4, 2), (2, 4)'),
    'batch not divisible by the data axis': (
        {'batch_size': 66},
        'config.batch_size=66: must be divisible by the data-parallel mesh '
        'size (4)'),
    # The digits data set was built in it, the directory made on the way.
    'data_dir that does not exist': (
        {'data_dir': '{empty}'},
        "config.data_dir='{empty}': no such directory (create it, or leave "
        'data_dir unset for $TFDS_DATA_DIR)'),
    # A traceback after the workdir was written.
    'data_dir that is a file': (
        {'data_dir': '/etc/passwd'},
        "config.data_dir='/etc/passwd': not a directory"),
    'negative SAM radius': (
        {'optimizer.sam.enabled': True, 'optimizer.sam.rho': -0.1},
        'config.optimizer.sam.rho=-0.1: must be finite and >= 0'),
    'infinite learning rate': (
        {'optimizer.learning_rate': float('inf')},
        'config.optimizer.learning_rate=inf: must be finite and > 0'),
    'zero steps': ({'num_steps': 0},
                   'config.num_steps=0: must be a positive integer'),
    'negative steps': ({'num_steps': -5},
                       'config.num_steps=-5: must be a positive integer'),
    # Both were tracebacks after the workdir was written (and -1 after
    # metrics were logged).
    # Allocated before anything said no.
    'a batch larger than the host': (
        {'batch_size': 10**9},
        'config.batch_size=1000000000: its input alone is '),
    'negative seed': ({'seed': -1},
                      'config.seed=-1: must be an integer in [0, 2**32)'),
    'seed over 32 bits': ({'seed': 2**70}, f'config.seed={2**70}: must be '
                          'an integer in [0, 2**32)'),
    'a conv block of no channels': (
        {'model.features': (0, 64)},
        'config.model.features=(0, 64): channels per conv block: a '
        'non-empty list of positive integers'),
    'negative hidden width': (
        {'model.hidden': -1},
        'config.model.hidden=-1: must be a positive integer'),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_bad_config_fails_before_compute_with_one_line(case, finished_workdir,
                                                        digits_config,
                                                        tmp_path):
  changes, expected = CASES[case]
  empty = str(tmp_path / 'no_data_here')
  config_edits.apply(digits_config, {
      path: value.format(empty=empty) if isinstance(value, str) else value
      for path, value in changes.items()})
  before = _snapshot(finished_workdir)
  with pytest.raises(errors.UsageError) as e:
    trainers.train_and_evaluate(digits_config, finished_workdir)
  assert str(e.value).startswith(expected.format(empty=empty)), str(e.value)
  assert '\n' not in str(e.value)
  assert _snapshot(finished_workdir) == before
  assert not os.path.exists(empty)


def test_a_bad_config_through_the_launcher_is_one_line_and_exit_2(
    finished_workdir):
  before = _snapshot(finished_workdir)
  result = launch_runs.run(finished_workdir, '--config.model.name=vit',
                           timeout=120)
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith(
      "error: config.model.name='vit': unknown model"), result.stderr
  assert _snapshot(finished_workdir) == before


@pytest.mark.parametrize('make_workdir', ['under_a_file', 'in_proc'])
def test_unwritable_workdir_names_the_flag(make_workdir, tmp_path):
  if make_workdir == 'under_a_file':
    (tmp_path / 'file').write_text('keep me')
    workdir = str(tmp_path / 'file' / 'run')
  else:
    workdir = '/proc/geom_run'  # Unwritable even for root.
  result = launch_runs.run(workdir, timeout=120)
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip() == (
      f'error: --workdir={workdir!r}: not a writable directory ('
      + ('Not a directory)' if make_workdir == 'under_a_file'
         else 'No such file or directory)'))
  if make_workdir == 'under_a_file':
    assert (tmp_path / 'file').read_text() == 'keep me'


FLAG_CASES = {
    'misspelled override': (
        ['--config=configs/digits.py', '--config.optimizer.learning_rat=1'],
        "error: --config.optimizer.learning_rat: the config has no field "
        "'learning_rat'; did you mean 'learning_rate'?"),
    'missing config file': (
        ['--config=configs/nothere.py'],
        'error: --config: cannot load the config file: [Errno 2] No such '
        "file or directory: 'configs/nothere.py'"),
    'unknown config argument': (
        ['--config=configs/digits.py:runlcl'],
        "unknown config argument 'runlcl'; valid: runlocal, model=cnn|mlp"),
    # A million devices grew by 40 MB/s with no output.
    'a million simulated devices': (
        ['--config=configs/digits.py:runlocal',
         '--config.cpu_devices=1000000'],
        'error: config.cpu_devices=1000000: simulated CPU devices: an '
        'integer in [1, 512]'),
}


@pytest.mark.parametrize('value', [0, -1, 513, 8.0])
def test_simulated_devices_out_of_range_name_the_field(value):
  # 0 was skipped as unset, and the mesh was blamed (config.mesh.shape).
  with pytest.raises(errors.ConfigError) as e:
    entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': value}))
  assert str(e.value) == (f'config.cpu_devices={value!r}: simulated CPU '
                          'devices: an integer in [1, 512]')


@pytest.mark.parametrize('case', sorted(FLAG_CASES))
def test_flag_mistakes_are_one_line(case, tmp_path):
  argv, expected = FLAG_CASES[case]
  cmd = launch_runs.command(str(tmp_path / 'run'))
  cmd = [a for a in cmd if not a.startswith('--config=')] + argv
  result = subprocess.run(cmd, cwd=launch_runs.REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and expected in lines[0], result.stderr
  assert not os.path.exists(tmp_path / 'run')
