"""train.compilation.estimates: jobs compiled in processes of their own, tabulated.

No job compiles here (that needs the compile toolchain and minutes): the
tables are checked on compile.json rows written by hand, and one job runs
`launch.compile` far enough to be refused.
"""

import json
import os

from train.compilation import estimates
from train.compilation.estimates import Estimate
from train.compilation.estimates import Job

BASE = Job('LM 1b', 'configs/lm.py:size=1b', None, 'v5e:2x2',
           {'batch_size': 32})
VARIANT = Job('LM 1b + X', 'configs/lm.py:size=1b', None, 'v5e:2x2',
              {'batch_size': 32, 'optimizer.x.enabled': True})


def _program(function='train_step', total=2 * 2**30, fits=True, error='',
             oom=False, flops=3e12, traffic=4e9, roofline=0.005):
  return {'function': function, 'bytes': {'argument': 2**30, 'temp': 2**29},
          'total_bytes': total, 'hbm_bytes': 16 * 2**30, 'fits': fits,
          'error': error, 'oom': oom, 'flops': flops, 'hbm_traffic': traffic,
          'roofline_seconds': roofline}


def test_the_command_gives_every_flag_in_order():
  job = Job('GRPO', 'configs/rl.py:size=1b', 'configs/rl_sft.py:size=1b',
            'h100:1x1x8', {'rollout_devices': 4, 'mesh': (2, 4)})
  assert estimates.command(job) == (
      'python -m launch.compile --config=configs/rl.py:size=1b '
      '--target=h100:1x1x8 --config.rollout_devices=4 --config.mesh=(2,4) '
      '--model_config=configs/rl_sft.py:size=1b')


def test_each_command_has_a_workdir_of_its_own_across_runs():
  first = estimates.job_workdir('/w', BASE)
  assert first == estimates.job_workdir('/w', BASE._replace(name='renamed'))
  assert first != estimates.job_workdir('/w', VARIANT)
  assert os.path.dirname(first) == '/w'


def test_a_reused_compile_json_is_read_and_its_misfit_reported(tmp_path):
  result = {'rows': [_program(), _program('eval_step', fits=False)]}
  (tmp_path / 'compile.json').write_text(json.dumps(result))
  assert estimates.compile_job(BASE, str(tmp_path), reuse=True) == (
      result, 'error: (reused) see its rows', 0.0)


def test_a_job_runs_launch_compile_from_the_repository_root(
    tmp_path, monkeypatch):
  # From elsewhere the config path would not resolve: the error line
  # names the target, which launch.compile checks after loading it.
  monkeypatch.chdir(tmp_path)
  job = Job('digits', 'configs/digits.py', None, 'nosuch:1', {})
  result, error, seconds = estimates.compile_job(job, str(tmp_path / 'w'))
  assert result is None
  assert error.startswith("error: --target='nosuch:1': unknown target"), error
  assert seconds > 0


def test_the_table_has_a_row_per_program_and_says_what_failed():
  result = {'rows': [
      _program(),
      _program('eval_step', total=20 * 2**30, fits=False, oom=True,
               flops=None, traffic=None, roofline=None),
      _program('finite', fits=False, error='INVALID_ARGUMENT: no'),
  ]}
  lines = estimates.table([Estimate(VARIANT, result, ''),
                           Estimate(BASE, None, 'error: gone')],
                          hidden=('optimizer.x.enabled',))
  assert lines[0].startswith('| job | target | overrides | function |')
  assert lines[2:] == [
      '| LM 1b + X | v5e:2x2 | batch_size=32 | train_step | 1.00 | 0.50 '
      '| 2.00 | 12% | 3 | 4 | 5 |',
      '| LM 1b + X | v5e:2x2 | batch_size=32 | eval_step | 1.00 | 0.50 '
      '| 20.00 | 125% DOES NOT FIT | - | - | - |',
      '| LM 1b + X | v5e:2x2 | batch_size=32 | finite | 1.00 | 0.50 '
      '| 2.00 | DOES NOT COMPILE: INVALID_ARGUMENT: no | 3 | 4 | 5 |',
      '| LM 1b | v5e:2x2 | batch_size=32 | (no result: error: gone) '
      '| | | | | | | |',
  ]


def test_ratios_pair_each_variant_with_its_base_where_both_fit():
  base = {'rows': [_program(), _program('eval_step', total=2**40)]}
  variant = {'rows': [_program(total=3 * 2**30, roofline=0.0075)]}
  elsewhere = VARIANT._replace(target='h100:1x1x8')
  lines = estimates.ratios(
      [Estimate(BASE, base, ''), Estimate(VARIANT, variant, ''),
       Estimate(elsewhere, variant, '')], ' + X', 'X')
  assert lines == [
      '| job | target | memory X / base | roofline X / base |',
      '|---|---|---|---|',
      '| LM 1b | v5e:2x2 | 1.50x | 1.50x |',
  ]
