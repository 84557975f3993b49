"""The paper's phenomenon, reproduced with geom.sam: stall, flag, escape by warm-start."""

import os

from absl import flags
from absl.testing import flagsaver
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import landscapes
from launch import sam_landscape

HALLUCINATING_RHOS = (0.6, 0.8, 1.0)


@pytest.fixture(scope='module')
def results():
  return sam_landscape.sweep((0.0,) + HALLUCINATING_RHOS, (0, 50),
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
  out = sam_landscape.sweep(HALLUCINATING_RHOS, (0,), steps=2000, lr=0.01,
                            response='warm_restart')
  for rho in HALLUCINATING_RHOS:
    assert out[(rho, 0)]['outcome'] == 'valley'
    assert out[(rho, 0)]['flagged_steps'] >= 1


def test_demo_writes_the_table_and_the_png(tmp_path):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(workdir=str(tmp_path), rhos=['0', '0.8'],
                           warmups=['0', '50'], steps=600):
    sam_landscape.main([])
  table = (tmp_path / 'landscape_table.md').read_text()
  assert '| 0.8 | 0 |' in table and 'hallucinated' in table
  with open(tmp_path / 'landscape.png', 'rb') as fp:
    assert fp.read(8) == b'\x89PNG\r\n\x1a\n'
  assert os.path.getsize(tmp_path / 'landscape.json') > 100
