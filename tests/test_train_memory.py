"""A model whose train state cannot fit is refused before anything is
allocated or written (`train.training.experiment._check_state_memory`)."""

import os
import sys

import jax
import pytest

from tests import launch_runs
from train.training import host_devices
from train.errors import ConfigError
from train.vision import experiment


def _allocated_bytes(tree) -> int:
  """What the devices of this host really hold of `tree`'s arrays."""
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards)


def test_the_state_bound_is_what_the_state_and_its_gradient_take(
    digits_config, tmp_path, monkeypatch):
  state = experiment.build(digits_config, str(tmp_path / 'probe')).init_state()
  # The train state and a gradient of the parameters' shape, as placed.
  need = _allocated_bytes(state) + _allocated_bytes(state.params)
  monkeypatch.setattr(host_devices, 'host_memory_bytes', lambda: need)
  experiment.build(digits_config, str(tmp_path / 'at_the_limit'))
  monkeypatch.setattr(host_devices, 'host_memory_bytes', lambda: need - 1)
  with pytest.raises(ConfigError, match=r"^config\.model=.*train state and "
                     r"gradient alone need .* GiB on this host, more than "
                     r"this host's memory"):
    experiment.build(digits_config, str(tmp_path / 'past_it'))
  assert not os.path.exists(tmp_path / 'past_it')


def test_a_huge_model_is_one_line_before_the_workdir_exists(tmp_path):
  workdir = tmp_path / 'w'
  result, peak = launch_runs.run_measured(
      launch_runs.command(str(workdir), '--config.model.d_model=1073741824',
                          config='configs/lm.py:runlocal'), timeout=120)
  lines = launch_runs.error_lines(result)
  assert result.returncode == 2, result.stderr[-2000:]
  assert len(lines) == 1 and lines[0].startswith(
      "error: config.model={'d_model': 1073741824"), lines
  assert 'GiB on this host' in lines[0]
  assert not workdir.exists()
  assert peak < 2**30, peak
