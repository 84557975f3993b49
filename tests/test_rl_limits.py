"""The RL run's size bounds (train.rl.limits): each at its limit passes, one
past it is one line naming the field and the limit; the issue's billion
versions and staleness end in exit 2 before anything is written."""

import os
import subprocess
import sys

import pytest

from configs import rl as rl_config
from tests import config_edits
from tests import launch_runs
from train.errors import ConfigError
from train.rl import limits


def _config(changes: dict):
  return config_edits.apply(rl_config.get_config('runlocal'), changes)


# (changes at the limit, the one change one past it, the refusal's text).
_LIMITS = [
    ({'num_versions': 2**31 - 1, 'eval_every': 2**31 - 1},
     {'num_versions': 2**31},
     'config.num_versions=2147483648: must be an integer in [1, 2147483647]'),
    ({'num_versions': 1000, 'runtime.max_staleness': 64},
     {'runtime.max_staleness': 65},
     'config.runtime.max_staleness=65: must be an integer in [0, 64]'),
    # Below 64 versions the run's length bounds it.
    ({'num_versions': 6, 'runtime.max_staleness': 6},
     {'runtime.max_staleness': 7},
     'config.runtime.max_staleness=7: must be an integer in [0, 6]'),
    ({'runtime.num_actors': 64}, {'runtime.num_actors': 65},
     'config.runtime.num_actors=65: must be an integer in [1, 64]'),
    ({'runtime.buffer_capacity': 1024}, {'runtime.buffer_capacity': 1025},
     'config.runtime.buffer_capacity=1025: must be an integer in [1, 1024]'),
    ({'grpo.iterations': 16}, {'grpo.iterations': 17},
     'config.grpo.iterations=17: must be an integer in [1, 16]'),
    ({'num_versions': 30_000, 'eval_every': 3}, {'num_versions': 30_003},
     'config.eval_every=3: gives 10001 evaluations of num_versions=30003; '
     'at most 10000 (eval_every >= 4)'),
    ({'difficulties': (1,) * 64}, {'difficulties': (1,) * 65},
     "config.difficulties='65 entries': must have at most 64"),
    ({'prompts_per_batch': 16384, 'grpo.group_size': 4},
     {'prompts_per_batch': 16385},
     'config.prompts_per_batch=16385: times grpo.group_size (4) must be at '
     'most 65536'),
    ({'eval_examples': 100_000}, {'eval_examples': 100_001},
     'config.eval_examples=100001: must be an integer in [1, 100000]'),
]


@pytest.mark.parametrize('at, past, text', _LIMITS, ids=[
    'num_versions', 'max_staleness', 'max_staleness_by_num_versions',
    'num_actors', 'buffer_capacity', 'iterations', 'evaluations',
    'difficulties', 'batch_rows', 'eval_examples'])
def test_each_size_passes_at_its_limit_and_is_refused_one_past_it(
    at, past, text):
  limits.check_sizes(_config(at))
  with pytest.raises(ConfigError) as e:
    limits.check_sizes(_config({**at, **past}))
  assert str(e.value).startswith(text), str(e.value)
  assert '\n' not in str(e.value)


def test_a_billion_versions_and_staleness_exit_2_in_one_line_at_once(
    sft_policy_run, tmp_path):
  # Issue 48: 14.2 GB, then killed by the kernel (rc 137).
  workdir = tmp_path / 'rl'
  result, peak = launch_runs.run_measured([
      sys.executable, '-m', 'launch.rl', '--config=configs/rl.py:runlocal',
      f'--config.sft_workdir={sft_policy_run[0]}', f'--workdir={workdir}',
      '--config.num_versions=1000000000',
      '--config.runtime.max_staleness=1000000000'], timeout=120)
  lines = launch_runs.error_lines(result)
  assert result.returncode == 2, result.stderr[-2000:]
  assert lines == ['error: config.runtime.max_staleness=1000000000: must be '
                   'an integer in [0, 64]: the learner keeps and checkpoints '
                   'that many past policies (at most 64, and at most '
                   'num_versions=1000000000)'], lines
  assert not os.path.exists(workdir)
  assert peak < 1 << 30, peak


_FINGERPRINT_MEMORY = '''
import resource
import jax.numpy as jnp
from train.run import checksums
tree = [jnp.full((1 << 23,), i, jnp.float32) for i in range(8)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
checksums.fingerprint(tree)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
'''


def test_fingerprinting_a_state_needs_twice_its_largest_leaf_not_the_state():
  # A checkpoint's fingerprints were one program over the whole state,
  # whose temporary buffers held two words per element of every leaf: the
  # real Gemma's RL run peaked there (15.9 GiB; 0.5 GiB over these 256 MiB).
  result = subprocess.run([sys.executable, '-c', _FINGERPRINT_MEMORY],
                          cwd=launch_runs.REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  grown = int(result.stdout.split()[-1]) * 1024
  assert grown < 256 << 20, f'{grown / 2**20:.0f} MiB over 8 x 32 MiB'


def _estimated(changes: dict, available: int, policy=1 << 30, vocab=256):
  config = _config(changes)
  return limits.check_memory(config, policy, vocab, 20, available=available)


def test_a_run_estimated_past_the_free_memory_is_refused_naming_what_to_lower():
  changes = {'num_versions': 100, 'runtime.max_staleness': 8,
             'rollout_devices': 1}
  peak = limits.estimate(_config(changes), 1 << 30, 256, 20).peak
  # A 1 GiB policy: with Adam 3 held, the 9 versions kept, and at a
  # checkpoint the 8 past ones on the learner and a host copy of the 11
  # saved; 1 GiB of overhead.
  assert peak == (3 + 9 + 8 + 11 + 1) * 2**30
  _estimated(changes, available=peak)
  with pytest.raises(ConfigError) as e:
    _estimated(changes, available=peak - 1)
  text = str(e.value)
  assert text.startswith('config.runtime.max_staleness=8: estimated peak '
                         '32.0 GiB (a policy of 1.00 GiB'), text
  assert 'exceeds the 32.0 GiB this host has free; lower it' in text
  # A batch whose logits are most of it: prompts_per_batch is named.
  with pytest.raises(ConfigError, match=r'^config\.prompts_per_batch=512: '):
    _estimated({'prompts_per_batch': 512}, 8 << 30, policy=1 << 20,
               vocab=262_144)
  # Nothing lowerable makes room: the policy (its workdir) is named.
  with pytest.raises(ConfigError, match=r'^config\.sft_workdir=.*a smaller '
                     'policy, or a host with more memory'):
    _estimated({'rollout_devices': 1}, 4 << 30)


def test_check_config_refuses_a_run_past_the_hosts_free_memory(
    sft_policy_run, monkeypatch):
  from train.rl import run  # pylint: disable=g-import-not-at-top
  config = _config({'num_versions': 10, 'runtime.max_staleness': 2})
  config.sft_workdir = sft_policy_run[0]
  run.check_config(config)
  monkeypatch.setattr(limits, 'available_bytes', lambda: 1 << 29)
  with pytest.raises(ConfigError, match='exceeds the 0.5 GiB this host has '
                     'free; a smaller policy'):
    run.check_config(config)
