"""geom.steering's direction methods against independent references:
repeng's pca_center against numpy's SVD of the same stacked matrix, the
logistic weights against the gradient of their documented objective (by
finite differences in float64), and every method at its edges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import steering as st

PAIRED = ('pca', 'pca_center', 'logistic')


def _pairs(n=24, dim=12, seed=0):
  """Paired activations sharing a large common part, as a layer's are."""
  rng = np.random.default_rng(seed)
  concept = rng.normal(size=dim)
  base = rng.normal(size=(n, dim)) * 5 + 3
  pos = base + concept + 0.5 * rng.normal(size=(n, dim))
  neg = base - concept + 0.5 * rng.normal(size=(n, dim))
  return pos.astype(np.float32), neg.astype(np.float32)


def test_pca_center_is_the_top_singular_vector_of_the_stacked_pairs():
  pos, neg = _pairs()
  p, q = pos.astype(np.float64), neg.astype(np.float64)
  center = (p + q) / 2
  _, _, vt = np.linalg.svd(np.concatenate([p - center, q - center]))
  ref = vt[0] * np.sign(vt[0] @ (p - q).mean(0))
  got = np.asarray(st.extract_direction(pos, neg, 'pca_center'))
  np.testing.assert_allclose(got, ref, atol=2e-5)
  # The rows are +-(p - q) / 2: the same direction as the uncentred PCA.
  np.testing.assert_allclose(got, np.asarray(st.pca_direction(pos, neg)),
                             atol=2e-5)


def _objective(w, z, c):
  """The docstring's J(w) = |w|^2 / 2 + 2 C sum_i softplus(-<w, z_i>)."""
  return 0.5 * w @ w + 2 * c * np.sum(np.logaddexp(0.0, -(z @ w)))


@pytest.mark.parametrize('c', [1.0, 0.05])
def test_logistic_weights_zero_the_gradient_of_their_objective(c):
  pos, neg = _pairs(n=40, dim=16, seed=1)
  w = np.asarray(st.logistic_weights(pos, neg, c=c), np.float64)
  half = (pos.astype(np.float64) - neg) / 2
  z = half / np.sqrt(np.mean(np.sum(half ** 2, -1)))
  h = 1e-5
  grad = lambda v: np.array([(_objective(v + h * e, z, c)
                              - _objective(v - h * e, z, c)) / (2 * h)
                             for e in np.eye(v.size)])
  assert np.linalg.norm(w) > 0.1
  assert np.linalg.norm(grad(w)) < 1e-4 * np.linalg.norm(grad(0 * w))
  if c == st.LOGISTIC_C:   # The method's direction is their unit vector.
    unit = np.asarray(st.extract_direction(pos, neg, 'logistic'))
    np.testing.assert_allclose(unit, w / np.linalg.norm(w), atol=1e-6)


def test_logistic_finds_the_one_separating_axis():
  """Positive and negative apart along axis 0 only, with wide noise on the
  others: the classifier's weights lie on the axis; the mean difference
  picks up the noise, the PCA of the differences follows it."""
  rng = np.random.default_rng(3)
  n = 200
  pos = np.c_[rng.uniform(0.5, 1.5, n), rng.normal(0, 3, (n, 3))]
  neg = np.c_[-rng.uniform(0.5, 1.5, n), rng.normal(0, 3, (n, 3))]
  got = {m: np.asarray(st.extract_direction(pos, neg, m))
         for m in st.DIRECTION_METHODS}
  assert got['logistic'][0] > 0.999
  assert got['mean_diff'][0] < 0.99 and abs(got['pca'][0]) < 0.5


@pytest.mark.parametrize('method', PAIRED)
def test_paired_methods_at_their_edges(method):
  pos, neg = _pairs(n=8, dim=6, seed=4)
  eager = np.asarray(st.extract_direction(pos, neg, method))
  assert np.linalg.norm(eager) == pytest.approx(1.0, abs=1e-6)
  assert eager @ (pos - neg).mean(0) > 0
  # One pair: its difference.
  d = pos[0] - neg[0]
  np.testing.assert_allclose(st.extract_direction(pos[:1], neg[:1], method),
                             d / np.linalg.norm(d), atol=1e-5)
  # bfloat16 activations are computed in float32.
  low = st.extract_direction(jnp.asarray(pos, jnp.bfloat16),
                             jnp.asarray(neg, jnp.bfloat16), method)
  assert low.dtype == jnp.float32 and float(low @ eager) > 0.999
  # Under jit: the same direction.
  jitted = jax.jit(lambda p, q: st.extract_direction(p, q, method))
  np.testing.assert_allclose(jitted(pos, neg), eager, atol=1e-5)
  with pytest.raises(ValueError, match='mean of the paired differences: is '
                     'zero'):
    st.extract_direction(pos, pos, method)
  with pytest.raises(ValueError, match=f'{method} needs paired'):
    st.extract_direction(pos, neg[:-1], method)


def test_logistic_refuses_a_bad_c():
  pos, neg = _pairs(n=4, dim=3)
  with pytest.raises(ValueError, match=r'c=0.0: must be > 0'):
    st.logistic_weights(pos, neg, c=0.0)
