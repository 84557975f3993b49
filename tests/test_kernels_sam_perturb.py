"""geom.kernels.sam_perturb against its plain-jnp reference and unfused geom.sam.

As in jax's Pallas ops tests, one class holds the tests and subclasses run
them in interpret mode, once with the TPU kernel bodies and once with the
Triton (GPU) ones; the compiled class runs on GPU or TPU only. That the
kernels lower for GPU and TPU is checked from CPU in
test_kernels_sam_perturb_lowering.py.
"""

import doctest
import re

import jax
from jax.extend import core as jex
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

from geom import sam
from geom.kernels import sam_perturb as k
from train.compilation import hlo_traffic

# Odd sizes: the packed buffer (541 rows) and the aligned leaf of 300 rows
# of 128 (a buffer of its own) both end in a ragged block of 32 rows.
SHAPES = [(3,), (17, 5), (129, 31), (7,), (1000, 65), (2, 3, 5), (300, 128)]
# With the TPU bodies the 60 x 384 leaf keeps its 384 lanes (blocks of 8
# float32 rows, 16 bfloat16 ones; a ragged last block), and so does
# 2 x 8 x 256 in float32 (16 rows of 256; in bfloat16 its 8 rows are half
# a sublane tile, so it is viewed as 32 rows of 128). The Triton bodies
# see every leaf as rows of 128.
WIDE_SHAPES = SHAPES + [(60, 384), (2, 8, 256)]
SMALL_BLOCKS = k.BlockSizes(block_rows=32, pack_below=1024)
F32 = jnp.float32


# The kernels, the plain-jnp reference and geom.sam's unfused functions run
# jitted, as geom.sam runs them (eagerly each of their ops compiles for
# itself, per leaf shape). Test data is drawn with numpy, which compiles
# nothing (jax.random compiles per shape, about a second each on CPU).
_sam_perturb = jax.jit(k.sam_perturb, static_argnames=(
    'adaptive', 'block_sizes', 'target', 'interpret', 'shardings'))
_reference = jax.jit(k.sam_perturb_reference, static_argnames='adaptive')
_perturbation = jax.jit(sam.perturbation, static_argnames='adaptive')
_perturbed_params = jax.jit(sam.perturbed_params)


def _normals(rng, shape, scale, dtype):
  """Standard normals times `scale` (in float32), as `dtype` (numpy)."""
  x = rng.standard_normal(shape, np.float32) * np.float32(scale)
  return x.astype(dtype)


def _tree(dtype=jnp.float32, scale=1.0, seed=0, shapes=None):
  shapes = SHAPES if shapes is None else shapes
  rng = np.random.default_rng(seed)
  w, g = {}, {}
  for i, s in enumerate(shapes):
    w[f'l{i}'] = _normals(rng, s, 0.5, dtype)
    g[f'l{i}'] = _normals(rng, s, scale, dtype)
  return w, g


def _assert_tree_close(a, b, rtol, atol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol,
      atol=atol), a, b)


def _launches(jaxpr) -> int:
  """Pallas launches on the path a call takes (each platform's branch of a
  `platform_dependent` must make the same number)."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      count += 1
      continue
    subs = [v for v in eqn.params.values()
            if isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr))]
    subs += [x for v in eqn.params.values() if isinstance(v, tuple)
             for x in v if isinstance(x, (jex.Jaxpr, jex.ClosedJaxpr))]
    per_sub = [_launches(getattr(sub, 'jaxpr', sub)) for sub in subs]
    if eqn.primitive.name == 'cond':
      assert len(set(per_sub)) == 1, per_sub
      count += per_sub[0]
    else:
      count += sum(per_sub)
  return count


class TestSamPerturb:
  INTERPRET = False
  TARGET = None
  SHAPES = WIDE_SHAPES

  def tree(self, *args, **kw):
    return _tree(*args, shapes=self.SHAPES, **kw)

  def setup_method(self):
    if not self.INTERPRET and jax.default_backend() == 'cpu':
      pytest.skip('compiled Pallas kernels need a GPU or TPU')

  def perturb(self, *args, jit=True, **kw):
    kw.setdefault('block_sizes', SMALL_BLOCKS)
    return (_sam_perturb if jit else k.sam_perturb)(
        *args, interpret=self.INTERPRET, target=self.TARGET, **kw)

  @pytest.mark.parametrize('adaptive', [False, True])
  def test_matches_the_reference_in_float32(self, adaptive):
    w, g = self.tree()
    got, norm = self.perturb(w, g, 0.3, adaptive=adaptive)
    want, want_norm = _reference(w, g, 0.3, adaptive=adaptive)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    _assert_tree_close(got, want, rtol=1e-6, atol=1e-6)

  @pytest.mark.parametrize('adaptive', [False, True])
  def test_bfloat16_leaves_accumulate_in_float32(self, adaptive):
    w, g = self.tree(jnp.bfloat16)
    got, norm = self.perturb(w, g, 0.3, adaptive=adaptive)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    assert norm.dtype == jnp.float32
    # The reference also upcasts: same float32 arithmetic, same rounding.
    want, want_norm = _reference(w, g, 0.3, adaptive=adaptive)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-5)
    _assert_tree_close(got, want, rtol=1e-2, atol=1e-2)
    exact = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
    norm64 = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(exact)))
    if not adaptive:
      np.testing.assert_allclose(float(norm), norm64, rtol=1e-6)

  def test_mixed_dtypes_keep_each_leaf_dtype(self):
    w, g = self.tree()
    w['l1'] = w['l1'].astype(jnp.bfloat16)
    g['l1'] = g['l1'].astype(jnp.bfloat16)
    got, norm = self.perturb(w, g, 0.1)
    want, want_norm = _reference(w, g, 0.1)
    assert got['l1'].dtype == jnp.bfloat16 and got['l0'].dtype == jnp.float32
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)

  @pytest.mark.parametrize('adaptive', [False, True])
  def test_zero_gradient_gives_the_weights_back(self, adaptive):
    w, g = self.tree()
    zeros = jax.tree.map(np.zeros_like, g)
    got, norm = self.perturb(w, zeros, 0.3, adaptive=adaptive)
    assert float(norm) == 0.0
    jax.tree.map(np.testing.assert_array_equal, got, w)

  @pytest.mark.parametrize('scale', [1e20, 1e-25])
  def test_no_overflow_or_underflow_in_the_norm(self, scale):
    w, g = self.tree(scale=scale)
    # eps = 0: the step is then rho g / |g| however small |g| is.
    got, norm = self.perturb(w, g, 0.3, eps=0.0)
    exact = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
    norm64 = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(exact)))
    np.testing.assert_allclose(float(norm), norm64, rtol=1e-5)
    # A plain float32 sum of squares would give inf or 0 here.
    with np.errstate(over='ignore'):
      naive = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float32)))
                          for x in jax.tree.leaves(g)))
    assert naive in (0.0, float('inf'))
    # The plain-jnp reference is scale-safe too, and agrees with the kernel.
    want, want_norm = _reference(w, g, 0.3, eps=0.0)
    np.testing.assert_allclose(float(want_norm), norm64, rtol=1e-5)
    # atol: one float32 rounding of w (|w| < 4) where w + e nearly cancels.
    _assert_tree_close(got, want, rtol=1e-5, atol=5e-7)
    e = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, got, w)
    e_norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(e)))
    np.testing.assert_allclose(e_norm, 0.3, rtol=1e-3)

  @pytest.mark.parametrize('adaptive', [False, True])
  @pytest.mark.parametrize('scale', [1.0, 1e20, 1e-25])
  def test_equals_geom_sams_unfused_perturbation_at_every_scale(
      self, adaptive, scale):
    w, g = self.tree(scale=scale)
    got, norm = self.perturb(w, g, 0.3, adaptive=adaptive, eps=0.0)
    e, unfused_norm = _perturbation(g, w, 0.3, adaptive=adaptive, eps=0.0)
    assert np.isfinite(float(unfused_norm)) and float(unfused_norm) > 0
    np.testing.assert_allclose(float(norm), float(unfused_norm), rtol=1e-5)
    _assert_tree_close(got, _perturbed_params(w, e), rtol=1e-5, atol=1e-7)

  def test_equals_unfused_geom_sam_inside_jit(self):
    w, g = self.tree()
    loss = lambda p: sum(jnp.sum(jnp.sin(x) ** 2) for x in jax.tree.leaves(p))
    grad = jax.grad(loss)
    outs = {}
    for fused in (False, True):
      tx = sam.sam(optax.sgd(0.1, momentum=0.9), rho=0.2, fused=fused)

      @jax.jit
      def step(p, s, tx=tx):
        u, s = tx.update(grad(p), s, p, grad_fn=grad)
        return optax.apply_updates(p, u), s

      p, s = w, jax.jit(tx.init)(w)
      for _ in range(3):
        p, s = step(p, s)
      outs[fused] = p
    _assert_tree_close(outs[True], outs[False], rtol=1e-5, atol=1e-6)

  def test_few_launches_for_many_small_leaves(self):
    w = {f'l{i}': np.ones((i + 3,), np.float32) for i in range(40)}
    # 40 rows of 128: a buffer of its own.
    w['big'] = np.ones((5120,), np.float32)
    w['odd'] = np.ones((5001,), np.float32)  # Not a multiple of 128: packed.
    jaxpr = jax.make_jaxpr(lambda p: self.perturb(p, p, 0.1, jit=False))(w)
    # Norm and update, for the big leaf and the pack.
    assert _launches(jaxpr.jaxpr) == 4

  def test_grad_through_the_kernel_is_a_clear_error(self):
    w, g = self.tree()
    f = lambda p: jnp.sum(self.perturb(p, g, 0.1, jit=False)[0]['l0'])
    with pytest.raises(TypeError, match='not differentiable'):
      # Raised as the gradient is traced (eagerly, it comes only after the
      # kernel has run forward op by op).
      jax.jit(jax.grad(f))(w)


class TestSamPerturbInterpret(TestSamPerturb):
  INTERPRET = True


class TestSamPerturbInterpretTriton(TestSamPerturb):
  """The GPU bodies (masked loads and stores, power-of-two blocks)."""
  INTERPRET = True
  TARGET = 'gpu'
  SHAPES = SHAPES


# Sharded calls: a tree with large, aligned, ragged and tiny leaves on a
# (4, 2) mesh, laid out as FSDP, tensor parallelism or a mix per leaf.
SHARDED_SHAPES = {'emb': (1000, 64), 'kernel': (256, 384), 'bias': (384,),
                  'conv': (3, 3, 16, 32), 'col': (1000, 6), 'odd': (129, 31),
                  'tiny': (7,)}
LAYOUTS = {
    'replicated': {},
    'fsdp': {'emb': P('data'), 'kernel': P('data'), 'bias': P('data'),
             'conv': P(None, None, 'data'), 'col': P('data')},
    'tensor': {'emb': P(None, 'model'), 'kernel': P(None, 'model'),
               'bias': P('model'), 'conv': P(None, None, None, 'model'),
               'col': P(None, 'model')},
    # Both axes on one dimension, crossed axes, and leaves split over one
    # axis beside leaves replicated over it.
    'mixed': {'emb': P('data', 'model'), 'kernel': P('model', 'data'),
              'bias': P(('data', 'model')), 'conv': P(None, None, 'model'),
              'col': P('data')},
}


def _mesh():
  return jax.make_mesh((4, 2), ('data', 'model'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _sharded_tree(layout, seed=3):
  """(w, g, shardings) in numpy; 'kernel' and 'bias' in bfloat16, the rest
  float32."""
  rng = np.random.default_rng(seed)
  dtype = lambda key: jnp.bfloat16 if key in ('kernel', 'bias') else F32
  w = {k_: _normals(rng, s, 0.5, dtype(k_))
       for k_, s in SHARDED_SHAPES.items()}
  # Magnitudes that differ by leaf, so that a leaf counted twice or missed
  # moves the norm.
  g = {k_: _normals(rng, s, i + 1, dtype(k_))
       for i, (k_, s) in enumerate(SHARDED_SHAPES.items())}
  # The largest magnitude on only some devices' shards: each device's own
  # largest differs from the global one (the scale the sums combine at).
  g['emb'][0, 0] = 300
  mesh = _mesh()
  shardings = {k_: NamedSharding(mesh, LAYOUTS[layout].get(k_, P()))
               for k_ in SHARDED_SHAPES}
  return w, g, shardings


def _all_gathers(compiled) -> list[int]:
  return hlo_traffic.collectives(compiled.as_text(), 'all-gather')


@pytest.mark.parametrize('layout,adaptive,given', [
    *[(layout, False, False) for layout in LAYOUTS],
    # 'mixed' holds leaves split over 'data', over 'model', over both and
    # replicated: its cases cover the others' leaves, which are slow.
    ('mixed', True, False),
    pytest.param('tensor', True, False, marks=pytest.mark.slow),
    # Shardings given (shard_map, the route that runs Mosaic kernels
    # sharded on TPU).
    pytest.param('fsdp', False, True, marks=pytest.mark.slow),
    ('mixed', True, True),
    pytest.param('replicated', False, True, marks=pytest.mark.slow),
])
def test_sharded_equals_the_unsharded_reference(layout, adaptive, given):
  w, g, shardings = _sharded_tree(layout)
  ws, gs = jax.device_put(w, shardings), jax.device_put(g, shardings)
  fn = jax.jit(lambda a, b, rho: k.sam_perturb(
      a, b, rho, adaptive=adaptive, block_sizes=SMALL_BLOCKS,
      shardings=shardings if given else None),
               out_shardings=(shardings, None))
  compiled = fn.lower(ws, gs, 0.3).compile()
  got, norm = compiled(ws, gs, 0.3)
  want, want_norm = _reference(w, g, 0.3, adaptive=adaptive)
  np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
  if not adaptive:  # The global norm, counting each element once.
    norm64 = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                         for x in jax.tree.leaves(g)))
    np.testing.assert_allclose(float(norm), norm64, rtol=1e-6)
  for key, x in got.items():
    assert x.dtype == w[key].dtype, key
    assert x.sharding.spec == shardings[key].spec, key
    tol = 1e-2 if x.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(x, F32), np.asarray(want[key], F32),
                               rtol=tol, atol=tol, err_msg=key)
  # Each device perturbs its own shards: nothing is gathered.
  assert _all_gathers(compiled) == []


def test_each_device_runs_the_kernels_on_its_shards():
  # The program the partitioner builds: per device, the kernels see shard
  # shapes, and leaves of one dtype split over the same axes (in any order
  # or dimension) share one packed buffer. float32: emb 1000 x 64 split
  # 4 x 2 (250 x 32 = 8000 elements); conv over 'model' (2304); col over
  # 'data' (1500); odd and tiny whole (4006). bfloat16: kernel 256 x 384
  # split 2 x 4 (12288) with bias 384 / 8 (48).
  w, g, shardings = _sharded_tree('mixed')
  ws, gs = jax.device_put(w, shardings), jax.device_put(g, shardings)
  text = jax.jit(lambda a, b: k.sam_perturb(a, b, 0.1)).lower(
      ws, gs).compile().as_text()
  # (XLA:CPU computes bfloat16 in float32: the rows are what tell.)
  rows = set(re.findall(r'(?:f32|bf16)\[(\d+),128\]', text)) - {'1'}
  assert rows == {str(-(-n // 128))
                  for n in (8000, 2304, 1500, 4006, 12288 + 48)}


def test_tpu_buffers_keep_a_leafs_own_lanes_where_that_moves_no_data():
  width = lambda shape, dtype=F32: k._tpu_width(np.zeros(shape, dtype),
                                                np.zeros(shape, dtype))
  assert width((60, 384)) == width((60, 384), jnp.bfloat16) == 384
  # Leading dimensions merge into rows for free when the second-minor one
  # is whole sublane tiles (8 rows of float32, 16 of bfloat16).
  assert width((2, 8, 256)) == width((3, 3, 64, 256)) == 256
  assert width((2, 8, 256), jnp.bfloat16) == 128
  assert width((768, 12, 64)) == 128  # 64 lanes: half a TPU vector.
  # 8 rows of 2^15 float32 lanes fit VMEM three times, double-buffered;
  # 8 rows of 2^17 do not: that leaf is viewed as rows of 128.
  assert width((8, 2**15)) == 2**15 and width((8, 2**17)) == 128
  assert width((4096,)) == 128
  # The Triton bodies see 128 lanes whatever the leaf (power-of-two blocks,
  # and a reshape is free in GPU memory).
  for target, rows in (('gpu', 'f32[180,128]'), ('tpu', 'f32[60,384]')):
    text = str(jax.make_jaxpr(lambda a, t=target: k.sam_perturb(
        a, a, 0.1, target=t, interpret=True, block_sizes=SMALL_BLOCKS))(
            {'a': np.ones((60, 384), np.float32)}))
    assert rows in text and ('f32[180,128]' in text) == (target == 'gpu')


def test_uneven_dimensions_are_not_split():
  mesh = _mesh()
  even = k._even_spec(NamedSharding(mesh, P('data', 'model')), (129, 6), mesh)
  assert even == P(None, 'model')
  assert k._even_spec(NamedSharding(mesh, P(('data', 'model'))), (12,),
                      mesh) == P(None)
  assert k._even_spec(NamedSharding(mesh, P(('data', 'model'))), (16, 3),
                      mesh) == P(('data', 'model'), None)


def test_shardings_over_two_meshes_are_refused():
  mesh = _mesh()
  other = jax.make_mesh((8,), ('x',),
                        axis_types=(jax.sharding.AxisType.Auto,))
  w = {'a': np.ones((8, 128), np.float32), 'b': np.ones((8, 128), np.float32)}
  with pytest.raises(ValueError, match='shardings.*one mesh'):
    k.sam_perturb(w, w, 0.1, shardings={
        'a': NamedSharding(mesh, P('data')), 'b': NamedSharding(other, P())})


def test_per_data_device_norms_with_automatic_model_axis():
  # m-sharpness as train.training.steps runs it: a shard_map over 'data' only, the
  # parameters split over 'model' by the partitioner; each data device
  # perturbs with its own gradient and its own (whole-model) norm.
  mesh = _mesh()
  w, _, _ = _sharded_tree('replicated')
  w = {key: w[key].astype(F32) for key in ('emb', 'kernel', 'odd')}
  specs = {'emb': P(None, 'model'), 'kernel': P('model'), 'odd': P()}
  per_device = {key: np.stack([np.cos(np.float32(d + 1) * x)
                               * np.float32(d + 1) for d in range(4)])
                for key, x in w.items()}
  ws = jax.device_put(w, {key: NamedSharding(mesh, s)
                          for key, s in specs.items()})
  gs = jax.device_put(per_device, {key: NamedSharding(mesh, P('data', *s))
                                   for key, s in specs.items()})

  def local(w, g):
    out, norm = k.sam_perturb(w, jax.tree.map(lambda x: x[0], g), 0.5)
    return jax.tree.map(lambda x: x[None], out), norm[None]

  got, norms = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P('data')),
      out_specs=(P('data'), P('data')), axis_names={'data'},
      check_vma=False))(ws, gs)
  got, norms = jax.device_get((got, norms))
  for d in range(4):
    want, want_norm = _reference(
        w, jax.tree.map(lambda x: x[d], per_device), 0.5)
    np.testing.assert_allclose(norms[d], want_norm, rtol=1e-6)
    _assert_tree_close(jax.tree.map(lambda x: x[d], got), want, rtol=1e-6,
                       atol=1e-6)


def test_per_device_norms_inside_shard_map():
  mesh = jax.make_mesh((8,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))
  w = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
  g = np.cos(3 * w) * np.arange(1, 9, dtype=np.float32)[:, None]

  @jax.jit
  def per_device(w, g):
    return jax.shard_map(
        lambda a, b: k.sam_perturb(a, b, 0.5)[1][None], mesh=mesh,
        in_specs=(P('x'), P('x')), out_specs=P('x'), check_vma=False)(w, g)

  np.testing.assert_allclose(per_device(w, g), np.linalg.norm(g, axis=1),
                             rtol=1e-6)


def test_block_sizes_are_validated():
  with pytest.raises(ValueError, match="block_rows=0"):
    k.BlockSizes(block_rows=0)
  with pytest.raises(ValueError, match='num_warps=3: must be a power of two'):
    k.BlockSizes(num_warps=3)
  with pytest.raises(ValueError, match="target='cuda'.*tpu, gpu, interpret"):
    k.BlockSizes.for_target('cuda')
  assert k.BlockSizes.for_target('gpu').block_rows == 64


def test_a_gradient_of_another_shape_is_named():
  with pytest.raises(ValueError, match=r'grads.*leaf 1 has shape \(4,\), its '
                     r'parameter \(3,\)'):
    k.sam_perturb({'a': np.ones(2, F32), 'b': np.ones(3, F32)},
                  {'a': np.ones(2, F32), 'b': np.ones(4, F32)}, 0.1)


def test_docstring_example_runs():
  result = doctest.testmod(k, verbose=False)
  assert result.attempted > 0 and result.failed == 0
