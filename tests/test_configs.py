"""Every config: get_config(arg), its command line in the docstring, overrides through absl flags."""

import importlib
import os
import re

from absl import flags
from ml_collections import config_flags
import pytest

from tests.conftest import REPO_ROOT
from train.run import resume_check
from train.tta import adapt

CONFIG_MODULES = sorted(
    f[:-3] for f in os.listdir(os.path.join(REPO_ROOT, 'configs'))
    if f.endswith('.py') and f != '__init__.py'
    and 'def get_config(' in open(os.path.join(REPO_ROOT, 'configs', f)).read())


@pytest.mark.parametrize('name', CONFIG_MODULES)
def test_config_documents_its_command_and_has_a_small_mode(name):
  module = importlib.import_module(f'configs.{name}')
  assert re.search(rf'python -m launch\.\w+ --config=configs/{name}\.py',
                   module.__doc__)
  full, small = module.get_config(), module.get_config('runlocal')
  if 'num_steps' in full:  # Training configs.
    assert small.num_steps < full.num_steps
    assert small.batch_size <= full.batch_size
  elif 'num_versions' in full:  # RL: fewer updates of smaller batches.
    assert small.num_versions < full.num_versions
    assert (small.prompts_per_batch * small.grpo.group_size
            < full.prompts_per_batch * full.grpo.group_size)
  elif 'corruptions' in full:  # Test-time adaptation: a shorter stream.
    assert full.corruptions == 'all'
    assert 0 < len(small.corruptions.split(',')) < 15
  else:  # Evaluation configs: fewer items and settings.
    assert sum(small.tasks.values()) < sum(full.tasks.values())
    assert len(small.alphas) < len(full.alphas)


@pytest.mark.parametrize('name', CONFIG_MODULES)
def test_config_rejects_an_unknown_argument(name):
  module = importlib.import_module(f'configs.{name}')
  with pytest.raises(ValueError, match='unknown config argument'):
    module.get_config('runlcoal')


def _parse(argv):
  values = flags.FlagValues()
  # sys_argv: the overrides are otherwise read from pytest's own sys.argv.
  holder = config_flags.DEFINE_config_file('config', None, 'config',
                                           flag_values=values,
                                           lock_config=True,
                                           sys_argv=['prog', *argv])
  values(['prog', *argv])
  return holder.value


def test_overrides_and_arguments_reach_the_config():
  path = os.path.join(REPO_ROOT, 'configs', 'digits.py')
  config = _parse([f'--config={path}:runlocal,model=mlp',
                   '--config.optimizer.learning_rate=0.05',
                   '--config.mesh.shape=(8,1)'])
  assert config.model.name == 'mlp'
  assert config.num_steps == 40
  assert config.optimizer.learning_rate == 0.05
  assert tuple(config.mesh.shape) == (8, 1)


def test_a_misspelled_override_is_refused():
  path = os.path.join(REPO_ROOT, 'configs', 'digits.py')
  with pytest.raises((flags.Error, AttributeError, KeyError),
                     match='Did you mean "learning_rate"'):
    _parse([f'--config={path}', '--config.optimizer.learning_rat=0.05'])


def test_data_dir_override_is_a_string():
  path = os.path.join(REPO_ROOT, 'configs', 'digits.py')
  config = _parse([f'--config={path}', '--config.data_dir=gs://b/tfds'])
  assert config.data_dir == 'gs://b/tfds'


def test_conga_settings_of_the_tta_config_are_flags():
  # method.conga was an empty block under a locked config: "no field".
  path = os.path.join(REPO_ROOT, 'configs', 'tta.py')
  config = _parse([f'--config={path}:schedule=conga',
                   '--config.method.conga.margin=0.3',
                   '--config.method.conga.max_learning_rate=0.01'])
  assert config.method.conga.margin == 0.3
  assert config.method.conga.max_learning_rate == 0.01
  assert config.method.conga.grad_decay is None  # geom's default.
  config = _parse([f'--config={path}:schedule=conga',
                   '--config.method.conga.margin=2.0',
                   '--config.source_workdir=/nonexistent'])
  with pytest.raises(adapt.ConfigError,
                     match=r'^config.method.conga.margin=2.0: must be in'):
    adapt.check_config(config)


def test_a_field_added_since_and_left_unset_is_not_a_config_change():
  # Runs saved before method.conga listed its fields (an empty block)
  # resume; a value set in either is a change.
  saved = {'method': {'conga': {}, 'name': 'tent'}}
  assert resume_check.changed_fields(
      saved, {'method': {'conga': {'margin': None}, 'name': 'tent'}}) == []
  [(field, old, new)] = resume_check.changed_fields(
      saved, {'method': {'conga': {'margin': 0.3}, 'name': 'tent'}})
  assert field == 'method.conga.margin' and new == 0.3
  assert resume_check.changed_fields({'seed': 0}, {}) != []


@pytest.mark.parametrize('spec,override,field,value', [
    ('rl.py:runlocal', 'runtime.buffer_capacity=4', 'runtime.buffer_capacity',
     4),
    ('lm.py:runlocal', 'init_from=/runs/lm', 'init_from', '/runs/lm'),
])
def test_documented_fields_that_start_unset_are_flags(spec, override, field,
                                                      value):
  # Unsupported type None (buffer_capacity) and no field (init_from).
  config = _parse([f'--config={os.path.join(REPO_ROOT, "configs", spec)}',
                   f'--config.{override}'])
  block, _, name = field.rpartition('.')
  assert (config[block] if block else config)[name] == value
