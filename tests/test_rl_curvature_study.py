"""studies.rl_curvature: the stored report rebuilds byte for byte from its
JSON, and the README's command runs at smoke size on the suite's SFT
warm start (a subprocess: the studies' absl flags share names)."""

import json
import os

from studies.rl_curvature import measure
from studies.rl_curvature import report
from tests import launch_runs

RESULTS = os.path.join(launch_runs.REPO_ROOT, 'studies', 'rl_curvature',
                       'results')


def test_the_stored_report_rebuilds_from_its_json():
  with open(os.path.join(RESULTS, 'rl_curvature.json')) as f:
    results = json.load(f)
  with open(os.path.join(RESULTS, 'rl_curvature.md')) as f:
    text = f.read()
  assert report.table(results) == text == results['table']


def test_the_readme_command_runs_at_smoke_size(sft_policy_run, tmp_path):
  out = tmp_path / 'curvature.json'
  result = launch_runs.run_module(
      'studies.rl_curvature', f'--sft_workdirs={sft_policy_run[0]}',
      '--difficulties=1,2', '--prompts=2', '--samples=2', '--num_iters=3',
      '--check_iters=3', f'--out={out}', timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(out) as f:
    results = json.load(f)
  with open(tmp_path / 'curvature.md') as f:
    text = f.read()
  assert report.table(results) == text == results['table']
  assert text in result.stdout
  (run,) = results['runs']
  assert [r['difficulty'] for r in run['rows']] == [1, 2]
  assert all(r['power'] > 0 and r['rayleigh'] >= 0 for r in run['rows'])
