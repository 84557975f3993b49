"""Which config changes a resume accepts (train.run.resume_check), field by field."""

import json
import re

from absl import logging
import pytest

from configs import digits
from tests import config_edits
from train.run import resume_check
from train.errors import UsageError


def _meta(config):
  return {'config': resume_check.as_json(config)}


def _changed(**changes):
  return config_edits.apply(digits.get_config('runlocal'), changes)


SAVED = _meta(digits.get_config('runlocal'))


@pytest.mark.parametrize('changes', [
    {}, {'log_every': 5}, {'eval_every': 7, 'eval_batch_size': 16},
    {'checkpoint_every': 10, 'keep_checkpoints': 9},
    {'data_dir': '/elsewhere'}, {'cpu_devices': 4},
    {'mesh.shape': (4, 2)},
])
def test_allowed_changes_resume(changes):
  resume_check.check(_changed(**changes), '/w', 20, SAVED)


@pytest.mark.parametrize('changes,listed', [
    ({'seed': 1}, 'config.seed 0 -> 1'),
    ({'optimizer.learning_rate': 0.05},
     'config.optimizer.learning_rate 0.1 -> 0.05'),
    ({'model.features': (8, 16)},
     'config.model.features [32, 64] -> [8, 16]'),
    ({'optimizer.sam.enabled': True},
     'config.optimizer.sam.enabled false -> true'),
    ({'logical_axis_rules': (('batch', 'data'),)},
     'config.logical_axis_rules'),
    ({'nonfinite': 'skip'}, 'config.nonfinite "stop" -> "skip"'),
])
def test_changes_that_fix_the_run_are_refused_by_name(changes, listed):
  with pytest.raises(resume_check.ConfigChanged) as e:
    resume_check.check(_changed(**changes), '/w', 20, SAVED)
  assert listed in str(e.value)
  assert str(e.value).startswith(
      "--workdir='/w': holds a run (checkpoint at step 20) with a different "
      'config: ')
  assert '\n' not in str(e.value)


def test_every_changed_field_is_named_and_a_new_field_shows_as_absent():
  config = _changed(seed=3, batch_size=32)
  saved = json.loads(SAVED['config'])
  del saved['nonfinite']  # As saved by a version before the field existed.
  with pytest.raises(resume_check.ConfigChanged) as e:
    resume_check.check(config, '/w', 20, {'config': json.dumps(saved)})
  assert [c[0] for c in e.value.changes] == ['batch_size', 'nonfinite', 'seed']
  assert 'config.nonfinite (absent) -> "stop"' in str(e.value)


def test_the_layout_may_not_change_under_a_per_device_method():
  with pytest.raises(resume_check.ConfigChanged, match='config.cpu_devices 8 '
                     '-> 4'):
    resume_check.check(_changed(cpu_devices=4), '/w', 20, SAVED,
                       per_device_method=True)


def test_num_steps_extends_but_never_shortens(monkeypatch):
  warnings = []
  monkeypatch.setattr(logging, 'warning',
                      lambda msg, *a: warnings.append(msg % a))
  resume_check.check(_changed(num_steps=80), '/w', 40, SAVED)
  assert len(warnings) == 1 and 'config.num_steps 40 -> 80' in warnings[0]
  resume_check.check(_changed(num_steps=40), '/w', 40, SAVED)  # Finished.
  with pytest.raises(UsageError, match=r'^config.num_steps=30: below the '
                     'latest checkpoint of /w \\(step 40\\)'):
    resume_check.check(_changed(num_steps=30), '/w', 40, SAVED)


def test_a_new_device_layout_resumes_with_a_warning(caplog):
  # It resumed silently, and not bit for bit; the README said refused.
  config = digits.get_config('runlocal')
  saved = {'config': resume_check.as_json(config)}
  moved = _changed(**{'mesh.shape': (4, 2)})
  with caplog.at_level('WARNING'):
    resume_check.check(moved, '/w', 20, saved)
  assert re.search(r'config.mesh.shape .* -> .*: the run resumes on another '
                   r'device layout; .* not bit for bit', caplog.text), (
                       caplog.text)
  with pytest.raises(resume_check.ConfigChanged, match='mesh.shape'):
    resume_check.check(moved, '/w', 20, saved, per_device_method=True)
