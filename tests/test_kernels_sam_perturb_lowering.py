"""geom.kernels.sam_perturb lowers for GPU and TPU, checked from a CPU host.

`jax.export` lowers a function for a platform without its hardware, and
lowering is where Pallas enforces block shapes, alignment and memory
spaces: Pallas's interpreter, which the exactness tests use, accepts
kernels no accelerator compiles. Every pass is lowered here for 'cuda'
(Triton) and for 'tpu' as v5e (v6e and v5p: slow), for the trees a user
meets: one large leaf, ragged leaves, a mixed float32/bfloat16 MLP and
many small leaves, SAM and ASAM, with rho, eta and eps traced. What
lowering cannot see (registers, shared memory, VMEM on the chip, speed)
needs the hardware: see BENCHMARKS.md.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.sam.perturb_trees import TREES
from geom import validation
from geom.kernels import sam_perturb as k

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16

SCALAR = S((), F32)
TRITON_CALL = '__gpu$xla.gpu.triton'
TPU_CALL = 'tpu_custom_call'
# (device kind as jax reports it, Pallas's chip version, TensorCores).
TPU_CHIPS = {'v5e': ('TPU v5 lite', 'v5e', 1), 'v6e': ('TPU v6 lite', 'v6e', 1),
             'v5p': ('TPU v5p', 'v5p', 2)}
# v6e and v5p are slow here (test_lowers_for_the_other_tpu_chips): with
# the compile toolchain, test_kernels_sam_perturb_compile.py lowers and
# compiles the same trees for them and counts the same kernels.
OTHER_TPU_CHIPS = ('v6e', 'v5p')


@contextlib.contextmanager
def tpu_chip(name: str):
  """Lowers for this TPU chip from a CPU host.

  The chip is named through jax's public abstract mesh (an `AbstractDevice`
  with the chip's device kind), which is where Pallas's TPU lowering looks
  it up; the check that Pallas sees it uses private API, kept here.
  """
  kind, version, cores = TPU_CHIPS[name]
  mesh = jax.sharding.AbstractMesh(
      (1,), ('chip',), abstract_device=jax.sharding.AbstractDevice(
          device_kind=kind, num_cores=cores, platform='tpu'))
  with jax.sharding.use_abstract_mesh(mesh):
    from jax._src.pallas.mosaic import tpu_info  # pylint: disable=g-import-not-at-top
    assert tpu_info.get_tpu_info().chip_version.value == version
    yield


def lowered_text(fn, platforms, *args) -> str:
  """The StableHLO of `fn` exported for `platforms`."""
  # Triton kernels carry no serialization-compatibility guarantee, so
  # jax.export refuses them unless told: this export is only inspected.
  exported = jax.export.export(
      jax.jit(fn), platforms=platforms,
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          TRITON_CALL)])(*args)
  return exported.mlir_module()


def perturb(w, g, rho, eta, eps, *, adaptive, **kw):
  return k.sam_perturb(w, g, rho, eta=eta, eps=eps, adaptive=adaptive, **kw)


def _args(tree):
  return tree, tree, SCALAR, SCALAR, SCALAR


@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
@pytest.mark.parametrize('tree', TREES)
def test_lowers_for_cuda_with_triton(tree, adaptive):
  params, buffers = TREES[tree]
  text = lowered_text(functools.partial(perturb, adaptive=adaptive),
                      ['cuda'], *_args(params))
  # A norm and an update launch per buffer; no other platform's kernels.
  assert text.count(TRITON_CALL) == 2 * buffers
  assert TPU_CALL not in text


@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('chip', [c for c in TPU_CHIPS
                                  if c not in OTHER_TPU_CHIPS])
def test_lowers_for_tpu(chip, tree, adaptive):
  _check_tpu_lowering(chip, tree, adaptive)


@pytest.mark.slow
def test_lowers_for_the_other_tpu_chips():
  for chip in OTHER_TPU_CHIPS:
    for tree in TREES:
      for adaptive in (False, True):
        _check_tpu_lowering(chip, tree, adaptive)


def _check_tpu_lowering(chip, tree, adaptive):
  """test_lowers_for_tpu's checks of one tree and variant on one chip."""
  params, buffers = TREES[tree]
  with tpu_chip(chip):
    text = lowered_text(functools.partial(perturb, adaptive=adaptive),
                        ['tpu'], *_args(params))
  assert text.count(TPU_CALL) == 2 * buffers
  assert TRITON_CALL not in text


@pytest.mark.parametrize('flag', [True, False])
def test_gpu_kernels_are_triton_whatever_the_mosaic_gpu_flag(flag):
  # jax 0.10.2 lowers GPU kernels with Mosaic GPU by default, which refuses
  # these; the kernels name Triton's compiler parameters themselves.
  before = jax.config.jax_pallas_use_mosaic_gpu
  jax.config.update('jax_pallas_use_mosaic_gpu', flag)
  try:
    params, buffers = TREES['ragged']
    text = lowered_text(functools.partial(perturb, adaptive=False), ['cuda'],
                        *_args(params))
  finally:
    jax.config.update('jax_pallas_use_mosaic_gpu', before)
  assert text.count(TRITON_CALL) == 2 * buffers


def test_one_function_carries_each_platforms_kernels_and_runs_on_cpu():
  rng = np.random.default_rng(0)
  w = {'a': jnp.asarray(rng.normal(size=(300, 128)), F32),
       'b': jnp.asarray(rng.normal(size=(1000, 3)), BF16)}
  g = jax.tree.map(lambda x: jnp.cos(3 * x), w)
  fn = functools.partial(perturb, adaptive=True)
  args = (w, g, SCALAR, SCALAR, SCALAR)
  with tpu_chip('v5e'):
    tpu = lowered_text(fn, ['tpu'], *args)
  cuda = lowered_text(fn, ['cuda'], *args)
  assert tpu.count(TPU_CALL) == 4 and TRITON_CALL not in tpu
  assert cuda.count(TRITON_CALL) == 4 and TPU_CALL not in cuda
  # Exported for CPU, the same function interprets the kernels and gives
  # the reference result. (One export for several platforms at once is not
  # supported: jax lowers every branch for each, and Pallas refuses to
  # lower a compiled kernel for CPU.)
  exported = jax.export.export(jax.jit(fn), platforms=['cpu'])(*args)
  got, norm = exported.call(w, g, np.float32(0.2), np.float32(0.05),
                            np.float32(1e-12))
  want, want_norm = k.sam_perturb_reference(w, g, 0.2, adaptive=True,
                                            eta=0.05)
  np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
  for key in w:
    assert got[key].dtype == w[key].dtype
    np.testing.assert_allclose(np.asarray(got[key], F32),
                               np.asarray(want[key], F32), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize('target,platform', [('gpu', 'cuda'), ('tpu', 'tpu')])
def test_a_block_the_backend_refuses_fails_lowering(monkeypatch, target,
                                                    platform):
  # What these tests guard: past our own block checks, lowering itself
  # refuses a misshapen block (12 rows: not a power of two for Triton, not
  # a multiple of 8 for TPU).
  monkeypatch.setattr(k, '_block_rows', lambda *args: 12)
  params = {'w': S((64, 128), F32)}
  with pytest.raises(Exception) as caught:
    with tpu_chip('v5e'):
      lowered_text(functools.partial(perturb, adaptive=False, target=target,
                                     interpret=False), [platform],
                   *_args(params))
  assert not isinstance(caught.value, validation.ArgumentError)
  assert 'power of 2' in str(caught.value) or 'divisible by 8' in str(
      caught.value)


@pytest.mark.parametrize('target,sizes,tree,problem', [
    ('gpu', k.BlockSizes(block_rows=48), {'w': S((256, 128), F32)},
     'power of two'),
    ('tpu', k.BlockSizes(block_rows=8), {'w': S((256, 128), BF16)},
     'multiple of 16'),
    ('tpu', k.BlockSizes(block_rows=8192), {'w': S((16384, 128), F32)},
     'MiB of VMEM'),
])
def test_block_sizes_a_backend_cannot_use_are_refused_by_name(
    target, sizes, tree, problem):
  fn = functools.partial(perturb, adaptive=False, block_sizes=sizes,
                         target=target, interpret=False)
  with pytest.raises(validation.ArgumentError,
                     match=f'block_rows={sizes.block_rows}: .*{problem}'):
    jax.eval_shape(fn, *_args(tree))


@pytest.mark.parametrize('target', ['tpu', 'gpu'])
def test_block_rows_that_suit_the_backend_lower(target):
  # float32 needs rows in multiples of 8 on TPU, bfloat16 of 16; a buffer
  # smaller than a block is one whole block (any row count).
  platform = {'tpu': 'tpu', 'gpu': 'cuda'}[target]
  for rows, dtype, block_rows in [(256, F32, 8), (256, BF16, 16), (5, F32, 64),
                                  (1, BF16, 1024)]:
    params = {'w': S((rows, 128), dtype)}
    fn = functools.partial(perturb, adaptive=True, target=target,
                           interpret=False,
                           block_sizes=k.BlockSizes(block_rows=block_rows,
                                                    pack_below=1))
    with tpu_chip('v5e'):
      text = lowered_text(fn, [platform], *_args(params))
    assert text.count(TPU_CALL if target == 'tpu' else TRITON_CALL) == 2


def test_target_is_checked():
  with pytest.raises(validation.ArgumentError, match="target='cuda'.*tpu, gpu"):
    k.sam_perturb({'a': jnp.ones(3)}, {'a': jnp.ones(3)}, 0.1, target='cuda')
