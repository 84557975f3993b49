"""The paper's phenomenon, reproduced with geom.sam: stall, flag, escape by
warm-start (studies/sam_landscape); its README's tables rebuild from the
stored run, and its command runs."""

import os

from absl import flags
from absl.testing import flagsaver
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import landscapes
from studies.sam_landscape import __main__ as landscape_main
from studies.sam_landscape import report
from studies.sam_landscape import sam_runs

ROOM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'studies', 'sam_landscape')

HALLUCINATING_RHOS = (0.6, 0.8, 1.0)


@pytest.fixture(scope='module')
def results():
  return sam_runs.sweep((0.0,) + HALLUCINATING_RHOS, (0, 50),
                        steps=2000, lr=0.01)


def test_the_landscape_has_the_stated_critical_points():
  grad = jax.grad(landscapes.valley_with_bump)
  hess = jax.hessian(landscapes.valley_with_bump)
  signs = {'minimum': (1, 1), 'maximum': (-1, -1), 'saddle': (-1, 1)}
  for c in landscapes.CRITICAL_POINTS:
    p = jnp.array([c.x, c.y])
    assert float(jnp.linalg.norm(grad(p))) < 1e-4
    eig = np.sort(np.linalg.eigvalsh(np.asarray(hess(p))))
    assert tuple(np.sign(eig).astype(int)) == signs[c.kind]


@pytest.mark.parametrize('rho', HALLUCINATING_RHOS)
def test_sam_alone_stalls_at_a_hallucinated_minimizer_and_is_flagged(
    results, rho):
  r = results[(rho, 0)]
  assert r['moved'] < 1e-4  # Converged ...
  assert r['grad_norm'] >= 1.0  # ... where f is not stationary ...
  assert r['perturbed_grad_norm'] <= 1e-4  # ... because grad f(x+) = 0.
  assert r['f_gap'] > 0.5
  saddle = landscapes.CRITICAL_POINTS[2]
  np.testing.assert_allclose(r['x_plus'], (saddle.x, saddle.y), atol=1e-3)
  # The detector flags it, within the first hundred steps, and keeps it.
  assert 0 <= r['first_flag'] < 100
  assert r['flagged_steps'] > 1800


@pytest.mark.parametrize('rho', HALLUCINATING_RHOS)
def test_a_short_warm_start_reaches_the_valley_unflagged(results, rho):
  r = results[(rho, 50)]
  assert r['outcome'] == 'valley' and r['f_gap'] < 1e-2
  assert r['flagged_steps'] == 0


def test_plain_descent_reaches_the_minimum(results):
  r = results[(0.0, 0)]
  assert r['f_gap'] < 1e-4 and r['grad_norm'] < 1e-3
  assert r['flagged_steps'] == 0


def test_warm_restart_response_escapes_after_one_flag():
  out = sam_runs.sweep(HALLUCINATING_RHOS, (0,), steps=2000, lr=0.01,
                       response='warm_restart')
  for rho in HALLUCINATING_RHOS:
    assert out[(rho, 0)]['outcome'] == 'valley'
    assert out[(rho, 0)]['flagged_steps'] >= 1


# Slow (8 s, the plot's import and the grid's runs). By default: the same
# sweep (the `results` fixture's tests) and the tables from the stored run
# (test_the_readme_tables_rebuild_from_the_stored_run).
@pytest.mark.slow
def test_the_readme_command_writes_the_table_json_and_png(tmp_path):
  # The command's main at a smaller grid (the full one takes 14 s), in
  # process: a subprocess would add an interpreter's and jax's start-up.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(workdir=str(tmp_path), rhos=['0', '0.8'],
                           warmups=['0', '50'], steps=600):
    landscape_main.main([])
  table = (tmp_path / 'landscape_table.md').read_text()
  assert '| 0.8 | 0 |' in table and 'hallucinated' in table
  with open(tmp_path / 'landscape.png', 'rb') as fp:
    assert fp.read(8) == b'\x89PNG\r\n\x1a\n'
  # What the command stored, the report reads back into the same table.
  assert report.table(*report.load(str(tmp_path / 'landscape.json'))) == table


def test_the_readme_tables_rebuild_from_the_stored_run():
  tables = report.table(*report.load(
      os.path.join(ROOM, 'results', 'landscape.json')))
  with open(os.path.join(ROOM, 'README.md')) as f:
    readme = f.read()
  assert tables.count('\n| ') > 45  # Both tables, every row.
  assert tables in readme
