"""The steering study's stored evaluations rebuild its reports byte for byte.

studies/steering/README.md's "report alone" commands, run as written (a
workdir named as there, below a scratch directory: the stored configs name
their LMs' workdirs relative to it), on the evaluations stored in
studies/steering/results/: study.md and pareto_bands.png must equal the
stored ones, and no LM is trained (every evaluation is finished).
"""

import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'studies', 'steering', 'results')


# The subword study's command is slow (13 s, the byte one's code path
# again: the report, its bootstrap and figure, from another study's
# stored evaluations); the byte study's stays in the default suite.
@pytest.mark.parametrize('prefix, workdir, flags', [
    ('byte', 'workdirs/steering_study', []),
    pytest.param('subword', 'workdirs/steering_study_sp',
                 ['--lm_config_arg=tokenizer=sentencepiece', '--gate_betas='],
                 marks=pytest.mark.slow),
])
def test_stored_evaluations_rebuild_the_report(tmp_path, prefix, workdir,
                                               flags):
  study = tmp_path / workdir
  study.mkdir(parents=True)
  with tarfile.open(os.path.join(RESULTS, f'{prefix}_evaluations.tar.xz')
                    ) as tar:
    tar.extractall(study, filter='data')
  env = dict(os.environ, PYTHONPATH=ROOT)
  result = subprocess.run(
      [sys.executable, '-m', 'studies.steering', f'--workdir={workdir}',
       *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert not list(study.glob('lm_seed*'))
  for name, stored in (('study.md', f'{prefix}_study.md'),
                       ('pareto_bands.png', f'{prefix}_pareto_bands.png')):
    with open(os.path.join(RESULTS, stored), 'rb') as f:
      assert (study / name).read_bytes() == f.read(), name
