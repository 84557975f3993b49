"""Every job compiled for real TPU and GPU targets from this CPU host.

`launch.compile` builds each job's programs on shapes only and compiles
them with the target's own compiler (libtpu; XLA's GPU compiler), from the
compile toolchain that `make test` installs. Here: every job on a small
topology (v5e:2x2, v5p:2x2x1, h100:1x1x2, ...), checked against what is
known independently of the report: the compiler's own argument sizes
against the shards the config's rules make, the FLOP counts of programs
whose count has a closed form, the chip table against the TPU compiler's
own out-of-memory messages, the mesh a multi-slice target builds, and the
one-line errors and exit statuses of the launcher. The pod-size rows of
BENCHMARKS.md are `slow` (`make test-all`).
"""

import contextlib
import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from train.jobs import compile_jobs
from train.training import aot
from train.compilation import compile_report
from train.training import sharding as sharding_lib
from train.compilation import targets
from train.errors import UsageError

from tests import tiny_gemma

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _toolchain_missing() -> str | None:
  path = targets.toolchain_dir()
  for name in ('libtpu', 'jax_plugins'):
    if not os.path.isdir(os.path.join(path, name)):
      return (f'the compile toolchain is not installed ({path}/{name} is '
              'missing): run `make compile-toolchain`')
  return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None,
                                reason=str(_toolchain_missing()))


@pytest.fixture(scope='module', autouse=True)
def _toolchain():
  targets.enable_toolchain()


def _config(spec: str, overrides: dict | None = None
            ) -> ml_collections.ConfigDict:
  path, _, arg = spec.partition(':')
  config = compile_jobs._config_from_file(path, arg or None)  # pylint: disable=protected-access
  for key, value in (overrides or {}).items():
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def _compile(spec, target, overrides=None, model=None, num_slices=1):
  return compile_jobs.run(_config(spec, overrides), target, num_slices,
                          None, None if model is None else _config(model))


def _rows(result):
  return {r['function']: r for r in result['rows']}


@contextlib.contextmanager
def _keeping_compiled(kept: dict):
  """Fills `kept` with {name: (program, compiled executable)} of each
  program the launcher's path compiles within, for checks that need more
  than its row (the mesh, the compiler's input shardings): no second
  build or compile of the same program."""
  # pylint: disable=protected-access
  compile_program, compile_ = compile_report.compile_program, (
      compile_report._compile)
  current = []

  def program_kept(program, chip, step=None):
    current[:] = [program]
    return compile_program(program, chip, step)

  def compiled_kept(lowered, platform):
    compiled, options = compile_(lowered, platform)
    kept[current[0].name] = (current[0], compiled)
    return compiled, options

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(compile_report, 'compile_program', program_kept)
    patch.setattr(compile_report, '_compile', compiled_kept)
    yield


def _only(monkeypatch, *names):
  """The launcher's path compiles only the programs `names` of a
  training job (through the same code all the same)."""
  every_program = aot.programs
  monkeypatch.setattr(aot, 'programs', lambda exp: [
      p for p in every_program(exp) if p.name in names])


# Stands for the path of a two-layer Gemma 3 file the fixture writes.
TINY_GEMMA = '<tiny gemma file>'

DIGITS_SAM = {'optimizer.sam.enabled': True, 'optimizer.sam.warmup_steps': 5,
              'mesh.shape': (2, 2)}

# (config, target, overrides, model config, the functions it must compile).
JOBS = {
    # SAM with a plain-SGD warm-up: two kinds of train step. On the MLP:
    # the CNN's four programs took 23 s of CPU in the TPU compiler, the
    # MLP's 9 s; the CNN is compiled for the GPU below, and with SAM for TPU in
    # test_the_digits_cnn_compiles_with_sam_for_tpu (slow).
    'digits_sam': ('configs/digits.py:runlocal,model=mlp', 'v5e:2x2',
                   DIGITS_SAM, None, ['train_step (sam_step=True)',
                                      'train_step (sam_step=False)',
                                      'eval_step', 'state_is_finite']),
    # The CNN (convolutions, BatchNorm) through the GPU compiler, which
    # the SAM recipes' full-size runs target.
    'digits_cnn': ('configs/digits.py:runlocal', 'h100:1x1x2',
                   {'mesh.shape': (1, 2)}, None,
                   ['train_step', 'eval_step', 'state_is_finite']),
    # The pod LM's layout (GQA, bfloat16, remat, FSDP + tensor parallel),
    # on a GPU: its train step is also what
    # test_compiled_arguments_are_the_shards_the_rules_make reads (the GPU
    # compiler's argument bytes are the shards' bytes, without TPU tile
    # padding). For TPU, test_multi_slice_puts_the_data_axis_over_the_
    # slices compiles the same job's three programs (slow; by default its
    # finiteness check alone, test_multi_slice_state_check_...).
    'lm_size_layout': ('configs/lm.py:size=1b,runlocal', 'h100:1x1x4', {},
                       None, ['train_step', 'eval_step', 'state_is_finite']),
    'rl_sft': ('configs/rl_sft.py:runlocal', 'h100:1x1x2', {}, None,
               ['train_step', 'eval_step', 'state_is_finite']),
    'tta': ('configs/tta.py:runlocal,method=sar', 'h100:1x1x2', {},
            None, ['adapt_step (sar)']),
    'rl': ('configs/rl.py:runlocal', 'v5e:2x2', {'rollout_devices': 2},
           'configs/rl_sft.py:runlocal',
           ['learner_update', 'rollout_generate (5 tokens)']),
    # The steered generation only: the unsteered one ('none') is the
    # same program less the steering (it took a compile of its own).
    'steering': ('configs/steering.py:runlocal', 'v5p:2x2x1',
                 {'methods': ('spherical_gate',)},
                 'configs/lm.py:runlocal',
                 ['generate (spherical_gate, cached, 8 tokens)']),
    # Gemma 3's steering evaluation at the shape of the tests' two-layer
    # file (its header is read, no weights): 270M's programs but for their
    # sizes, which are slow (test_gemma_270m_steering_compiles_with_its_
    # parameters; 25-37 s of compiles here).
    'gemma_steering': ('configs/gemma.py:runlocal', 'v5e:2x2',
                       {'methods': ('spherical_gate',),
                        'generation.steps': 2, 'shape': 'gguf',
                        'gguf': TINY_GEMMA, 'layer': 1, 'sweep_layers': ()},
                       None,
                       ['generate (spherical_gate, cached, 2 tokens)',
                        'held-out log-probs (spherical_gate, 64 x 16 '
                        'tokens)']),
}


# The SAM paper's recipes (SAM on), full size: `slow` (the classification
# job's programs are compiled above; these take minutes).
RECIPES = {
    'wrn_cifar10': ('configs/wrn_cifar10.py', 'h100:1x1x8', {}),
    'resnet50_imagenet': ('configs/resnet50_imagenet.py', 'h100:1x1x8', {}),
}


@pytest.fixture(scope='module')
def tiny_gemma_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('gemma') / 'g.gguf',
                               shape=tiny_gemma.TILED_SHAPE)


class _Jobs(dict):
  """{name: the job's result}, each job built and compiled on first use
  (once for the module): a job whose tests are all slow (rl_sft) costs
  `make test` nothing. The LM's train step is kept as (program,
  compiled) in `lm_train_step`."""

  def __init__(self, gemma_file):
    super().__init__()
    self._gemma_file = gemma_file
    self._kept = {}

  def __missing__(self, name):
    spec, target, overrides, model, _ = JOBS[name]
    overrides = {k: self._gemma_file if v == TINY_GEMMA else v
                 for k, v in overrides.items()}
    with (_keeping_compiled(self._kept) if name == 'lm_size_layout'
          else contextlib.nullcontext()):
      self[name] = _compile(spec, target, overrides, model)
    return self[name]

  @property
  def lm_train_step(self):
    self['lm_size_layout']  # pylint: disable=pointless-statement
    return self._kept['train_step']


@pytest.fixture(scope='module')
def compiled_jobs(tiny_gemma_file):
  return _Jobs(tiny_gemma_file)


# rl_sft's job is the LM trainer's (train, eval, finiteness) on the RL
# task's SFT data, for h100 as lm_size_layout is: 10 s of compiles, slow
# (the RL product's own programs are the rl job's, for v5e).
_SLOW_JOBS = ('rl_sft',)


@pytest.mark.parametrize('name', [
    pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_JOBS else n
    for n in JOBS])
def test_every_job_compiles_and_fits_on_a_small_target(compiled_jobs, name):
  _check_job(compiled_jobs[name], JOBS[name][1], JOBS[name][4])


@pytest.mark.slow
def test_the_digits_cnn_compiles_with_sam_for_tpu():
  """digits_sam's job on the CNN (convolutions, BatchNorm) for TPU."""
  _check_job(_compile('configs/digits.py:runlocal', 'v5e:2x2', DIGITS_SAM),
             'v5e:2x2', JOBS['digits_sam'][4])


def _check_job(result, target, functions):
  """test_every_job_compiles_and_fits_on_a_small_target's checks of a
  job's `result` on `target`: exactly `functions`, each fits, its
  report's sums and roofline."""
  rows = _rows(result)
  assert list(rows) == functions
  chip = targets.chip_for(targets.parse(target))
  for row in rows.values():
    assert row['error'] is None and row['fits'], row
    assert row['total_bytes'] == pytest.approx(
        row['bytes']['argument'] + row['bytes']['output']
        - row['bytes']['alias'] + row['bytes']['temp']
        + row['bytes']['generated_code'])
    assert row['hbm_bytes'] == chip.hbm_bytes
    # Every program here multiplies matrices: the cost is read.
    assert row['flops'] > 0 and row['hbm_traffic'] > 0, row
    assert row['roofline_seconds'] == pytest.approx(max(
        row['flops'] / chip.peak_flops,
        row['hbm_traffic'] / chip.hbm_bandwidth))
  assert result['devices'] == targets.parse(target).num_chips


def _check_gemma_arguments(rows, parameters, slack):
  """In float32 the model's `parameters` are the arguments, with `slack`
  bytes at most of prompt, windows, direction and key."""
  for row in rows.values():
    extra = row['bytes']['argument'] - parameters * 4
    assert 0 <= extra < slack, row


def test_gemma_programs_take_the_models_parameters(compiled_jobs):
  """The two-layer file's 433,280 parameters (its tensors' sizes, counted
  here; 1.7 MB) with 16 kB at most besides (7-12 kB)."""
  count = sum(x.size for x in tiny_gemma.tensors(
      np.random.default_rng(0), tiny_gemma.TILED_SHAPE).values())
  _check_gemma_arguments(_rows(compiled_jobs['gemma_steering']), count,
                         2**14)


@pytest.mark.slow
def test_gemma_270m_steering_compiles_with_its_parameters():
  """The steering evaluation at Gemma 3 270M's shape (no weights read):
  both programs fit a v5e 2x2 slice, and their arguments are its
  268,098,176 parameters (the registry file's count, dequantized)."""
  spec, target, overrides, _, functions = JOBS['gemma_steering']
  overrides = {k: v for k, v in overrides.items()
               if k not in ('shape', 'gguf', 'layer', 'sweep_layers')}
  rows = _rows(_compile(spec, target, overrides))
  assert list(rows) == functions
  assert all(r['error'] is None and r['fits'] for r in rows.values()), rows
  _check_gemma_arguments(rows, 268_098_176, 2**20)


@pytest.mark.parametrize('name', [
    'digits_sam', 'lm_size_layout',
    pytest.param('rl_sft', marks=pytest.mark.slow)])
def test_donated_state_is_aliased_in_train_steps(compiled_jobs, name):
  # The loop donates the train state: its buffers are reused for the new
  # state, which the compiler reports as aliased bytes.
  row = _rows(compiled_jobs[name])['train_step' if name != 'digits_sam'
                                   else 'train_step (sam_step=False)']
  assert row['bytes']['alias'] > 0.5 * row['bytes']['argument'], row


def test_rl_compiles_learner_and_rollout_on_their_own_meshes(compiled_jobs):
  meshes = compiled_jobs['rl']['meshes']
  assert meshes['learner'].startswith('mesh data=2 (2 devices)')
  assert meshes['rollout'].startswith('mesh data=2 (2 devices)')


def test_compiled_arguments_are_the_shards_the_rules_make(compiled_jobs):
  # The compiler's argument bytes for the train step equal the bytes of
  # one device's shards of the state and batch, computed here from the
  # config's rules alone: 'embed' over 'data' (2), heads, MLP and
  # vocabulary over 'model' (2). The step is lm_size_layout's, compiled
  # for h100:1x1x4 through the launcher's path.
  program, compiled = compiled_jobs.lm_train_step
  mesh = program.mesh
  assert dict(mesh.shape) == {'data': 2, 'model': 2}
  expected = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(program.args):
    spec = leaf.sharding.spec
    shard = list(leaf.shape)
    for i, axis in enumerate(spec):
      if axis is not None:
        shard[i] //= mesh.shape[axis]
    expected += math.prod(shard) * leaf.dtype.itemsize
    if 'embedding' in jax.tree_util.keystr(path) and 'params' in (
        jax.tree_util.keystr(path)):
      assert tuple(spec) == ('model', 'data'), path
  assert compiled.memory_analysis().argument_size_in_bytes == expected
  assert _rows(compiled_jobs['lm_size_layout'])[
      'train_step']['bytes']['argument'] == expected
  # And the compiled program keeps the rules' shardings for its inputs.
  shardings = compiled.input_shardings[0][0]
  for want, got in zip(jax.tree.leaves(program.args[0]),
                       jax.tree.leaves(shardings)):
    assert got.is_equivalent_to(want.sharding, len(want.shape))


def test_a_sharding_rule_that_does_not_divide_is_one_line_before_compiling():
  # Break the layout: the 2 key/value heads split over a model axis of 8.
  with pytest.raises(UsageError, match=r"config.mesh.shape=\(1, 8\): "
                     r"parameter .*\['attention'\]\['key'\] of shape "
                     r"\(64, 2, 16\) cannot be split over mesh axis "
                     r"'model' of size 8"):
    _compile('configs/lm.py:size=1b,runlocal', 'h100:1x1x8',
             {'mesh.shape': (1, 8)})


def test_device_bytes_count_prng_keys_by_their_key_data():
  mesh = Mesh(np.array(jax.devices()[:2]), ('data',))
  keys = jax.ShapeDtypeStruct((6,), jax.random.key(0).dtype,
                              sharding=NamedSharding(mesh, P('data')))
  floats = jax.ShapeDtypeStruct((4, 3), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P()))
  # threefry keys: two uint32 each; three keys per device, and the
  # replicated bfloat16 array whole.
  assert sharding_lib.device_bytes((keys, floats)) == 3 * 8 + 12 * 2


def test_a_program_that_does_not_compile_is_a_row_naming_the_error():
  # A key among the arguments (as GRPO's rollout has) must not stop the row.
  mesh = Mesh(np.array(jax.devices()[:2]), ('data',))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                             sharding=NamedSharding(mesh, P()))

  def fails(key):
    raise ValueError('no such program')

  program = aot.Program('broken', jax.jit(fails), (key,), mesh, ())
  row = compile_report.compile_program(
      program, targets.chip_for(targets.parse('v5e:2x2')))
  assert row.error == 'no such program' and not row.oom
  assert row.total_bytes == 8


def test_a_kernel_over_vmem_is_a_one_line_compile_failure(monkeypatch):
  # The launcher's path for a program whose Mosaic kernel needs more than
  # the 16 MiB of scoped VMEM (the fused SAM kernel alone, its update in
  # blocks of 16384 rows, the kernel's own check lifted): its row carries
  # Mosaic's message, not an HBM OOM, and `check` makes it the launcher's
  # one line (exit 1) naming the program. The same inside a trainer's SAM
  # step: the slow test below.
  # pylint: disable=g-import-not-at-top,protected-access
  from geom.kernels import sam_perturb
  monkeypatch.setattr(sam_perturb, '_TPU_SCOPED_VMEM_BYTES', 2**40)
  target = targets.parse('v5e:1x1')
  chip = targets.chip_for(target)
  mesh = Mesh(np.array(targets.devices(target)), ('chip',))
  w = jax.ShapeDtypeStruct((16384, 128), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  blocks = sam_perturb.BlockSizes(block_rows=16384)
  program = aot.Program('perturb (16384-row blocks)', jax.jit(
      lambda w, g: sam_perturb.sam_perturb(w, g, 0.1, block_sizes=blocks)),
                        (w, w), mesh)
  row = compile_report.compile_program(program, chip)
  assert row.error is not None and not row.oom, row
  with pytest.raises(compile_report.CompileFailed,
                     match=r'^perturb \(16384-row blocks\) does not compile '
                     r'for v5e:1x1: .*vmem') as caught:
    compile_report.check([row], chip, 'v5e:1x1')
  assert '\n' not in str(caught.value)


@pytest.mark.slow
def test_a_kernel_block_over_vmem_fails_the_compile_naming_the_step(
    monkeypatch):
  # Break the fused SAM kernel's TPU block size (16384 rows: its update
  # pass needs more than the 16 MiB of scoped VMEM) and lift the kernel's
  # own check: the train step does not compile, and the error names it
  # and carries Mosaic's message (exit 1 in the launcher), not an HBM OOM.
  # pylint: disable=g-import-not-at-top,protected-access
  from geom.kernels import sam_perturb
  monkeypatch.setattr(sam_perturb, '_TPU_SCOPED_VMEM_BYTES', 2**40)
  monkeypatch.setitem(sam_perturb._DEFAULTS, 'tpu',
                      sam_perturb.BlockSizes(block_rows=16384))
  # The kernels per static option are cached with their default block
  # sizes resolved: drop them, before (earlier tests') and after (ours).
  kernels = sam_perturb._differentiation_guarded
  kernels.cache_clear()
  # Only the step under test is compiled (through the launcher's path all
  # the same): the job's other three programs (the warm-up step, eval,
  # finiteness of the 2048-wide MLP) compile, and took 3 of the test's 10
  # s of CPU. Its error is the first row's either way.
  _only(monkeypatch, 'train_step (sam_step=True)')
  try:
    with pytest.raises(compile_report.CompileFailed,
                       match=r'^train_step \(sam_step=True\) does not '
                       r'compile for v5e:1x1: .*vmem') as caught:
      _compile('configs/digits.py:runlocal,model=mlp', 'v5e:1x1',
               {'optimizer.sam.enabled': True, 'optimizer.sam.fused': True,
                'optimizer.sam.warmup_steps': 5, 'mesh.shape': (1, 1),
                'model.widths': (2048, 2048)})
  finally:
    kernels.cache_clear()
  assert '\n' not in str(caught.value)


@pytest.mark.slow
def test_multi_slice_puts_the_data_axis_over_the_slices():
  # The LM job for TPU (its train, eval and finiteness programs), on two
  # v5e slices; the mesh is the one its programs were compiled on.
  kept = {}
  with _keeping_compiled(kept):
    result = _compile('configs/lm.py:size=1b,runlocal', 'v5e:2x2',
                      {'mesh.shape': (4, 2)}, num_slices=2)
  assert result['devices'] == 8 and result['num_slices'] == 2
  assert [r['function'] for r in result['rows']] == [
      'train_step', 'eval_step', 'state_is_finite']
  assert all(r['fits'] for r in result['rows'])
  _check_slices(kept['train_step'][0].mesh)


def _check_slices(mesh):
  grid = mesh.devices  # (data, model)
  assert grid.shape == (4, 2)
  slices = np.vectorize(lambda d: d.slice_index)(grid)
  # Each model-parallel group stays within one slice; data spans both.
  assert (slices == slices[:, :1]).all()
  assert sorted(set(slices[:, 0])) == [0, 1]


def test_multi_slice_state_check_puts_the_data_axis_over_the_slices(
    monkeypatch):
  # The same job's finiteness check alone (through the launcher's path),
  # on two v5e slices: the job's one mesh (its state's) over 8 chips of
  # two slices, the program compiled and fitting there. The train and eval steps on
  # it (13 s more of the TPU compiler) are the slow test above.
  _only(monkeypatch, 'state_is_finite')
  kept = {}
  with _keeping_compiled(kept):
    result = _compile('configs/lm.py:size=1b,runlocal', 'v5e:2x2',
                      {'mesh.shape': (4, 2)}, num_slices=2)
  assert result['devices'] == 8 and result['num_slices'] == 2
  assert [r['function'] for r in result['rows']] == ['state_is_finite']
  assert all(r['error'] is None and r['fits'] for r in result['rows'])
  # The program is traced under no mesh: the state's shardings carry it.
  state = kept['state_is_finite'][0].args[0]
  meshes = {leaf.sharding.mesh for leaf in jax.tree.leaves(state)}
  assert len(meshes) == 1, meshes
  _check_slices(meshes.pop())


@pytest.mark.parametrize('target', ['v5e:2x2', 'h100:1x1x2'])
def test_cost_of_a_matmul_is_its_closed_form(target):
  devices = targets.devices(targets.parse(target))
  mesh = Mesh(np.array(devices), ('data',))
  m, k, n = 1024, 512, 2048
  x = jax.ShapeDtypeStruct((m, k), jnp.float32,
                           sharding=NamedSharding(mesh, P('data')))
  w = jax.ShapeDtypeStruct((k, n), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  compiled = jax.jit(jnp.matmul).lower(x, w).compile()
  flops, traffic, _ = compile_report.cost(compiled, devices[0].platform)
  assert flops == 2 * m * k * n / len(devices)
  # At least the operands and the result are read and written once.
  assert traffic >= 4 * (m * k / len(devices) + k * n + m * n / len(devices))


def _conv_grad_program(mesh):
  x = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  k = jax.ShapeDtypeStruct((3, 3, 3, 32), jnp.float32,
                           sharding=NamedSharding(mesh, P()))

  def loss(x, k):
    y = jax.lax.conv_general_dilated(
        x, k, (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return jnp.sum(y ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, k).compile()


def test_gpu_convolution_flops_are_counted_from_the_cudnn_calls():
  # XLA's cost model counts the GPU compiler's cuDNN custom calls as no
  # FLOPs. A VALID 3x3 convolution of 8 x 16 x 16 x 3 into 32 features
  # has 8 x 14 x 14 x 32 outputs of 27 multiply-adds; its gradient with
  # respect to both operands does it three times (forward, input, filter).
  devices = targets.devices(targets.parse('h100:1x1x1'))
  compiled = _conv_grad_program(Mesh(np.array(devices), ('d',)))
  one = 2 * 8 * 14 * 14 * 32 * 27
  assert compile_report.cudnn_conv_flops(compiled.as_text()) == 3 * one
  flops, traffic, _ = compile_report.cost(compiled, 'cuda')
  assert flops >= 3 * one
  # Each convolution reads two of x (24 KiB), the kernel (3.4 KiB) and
  # the output's gradient (196 KiB) and writes the third: at least what
  # the three calls move, which XLA's cost model alone counts as -3 bytes.
  x, k, y = 8 * 16 * 16 * 3 * 4, 3 * 3 * 3 * 32 * 4, 8 * 14 * 14 * 32 * 4
  assert traffic >= 3 * (x + k + y)


def test_cudnn_conv_flops_reads_operand_shapes_by_name():
  text = '\n'.join([
      '  %p0 = f32[2,10,10,4]{3,2,1,0} parameter(0)',
      '  %w = f32[8,3,3,4]{3,2,1,0} parameter(1)',
      '  %conv = (f32[2,8,8,8]{3,2,1,0}, u8[0]{0}) custom-call(%p0, %w), '
      'window={size=3x3}, dim_labels=b01f_o01i->b01f, '
      'custom_call_target="__cudnn$convForward"',
      '  %dx = (f32[2,10,10,4]{3,2,1,0}, u8[0]{0}) custom-call(%conv.1, %w), '
      'window={size=3x3}, dim_labels=b01f_o01i->b01f, '
      'custom_call_target="__cudnn$convBackwardInput"',
      '  %conv.1 = f32[2,8,8,8]{3,2,1,0} parameter(2)',
  ])
  # 2 x 8 x 8 x 8 outputs of 3 x 3 x 4 = 36 multiply-adds, twice.
  assert compile_report.cudnn_conv_flops(text) == 2 * (2 * 2 * 8 * 8 * 8 * 36)


@pytest.mark.parametrize('family', ['v4', 'v5e', 'v5p', 'v6e'])
def test_usable_hbm_of_each_tpu_is_what_its_compiler_allows(family):
  # The table's usable HBM is the TPU compiler's own limit: a program
  # whose temporaries exceed it is refused with that number.
  topology = {'v4': '1x1x1', 'v5p': '1x1x1'}.get(family, '1x1')
  devices = targets.devices(targets.parse(f'{family}:{topology}'))
  chip = targets.chip_for(targets.parse(f'{family}:{topology}'))
  mesh = Mesh(np.array(devices), ('d',))
  side = 2 ** 18  # A 256 GiB float32 result.
  x = jax.ShapeDtypeStruct((side,), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  fn = jax.jit(lambda v: jnp.outer(v, v))
  with pytest.raises(Exception, match='RESOURCE_EXHAUSTED') as caught:
    fn.lower(x).compile()
  available = re.search(r'available HBM \(([\d.]+)G\)', str(caught.value))
  assert available, str(caught.value)[:500]
  assert float(available.group(1)) * 2**30 == chip.hbm_bytes


def test_gpu_memory_is_the_cards_times_jaxs_preallocated_fraction(
    monkeypatch):
  monkeypatch.delenv(targets.GPU_MEMORY_FRACTION_ENV, raising=False)
  h100 = targets.chip_for(targets.parse('h100:1x1x8'))
  assert h100.hbm_bytes == 0.75 * 84942979072
  assert h100.device_kind == targets.devices(
      targets.parse('h100:1x1x1'))[0].device_kind
  monkeypatch.setenv(targets.GPU_MEMORY_FRACTION_ENV, '0.9')
  assert targets.chip_for(targets.parse('h200:1x1x8')).hbm_bytes == (
      0.9 * 151397597184)


@pytest.mark.parametrize('text', ['v7:2x2', 'v5e:2x2x2', 'h100:8', 'tpu',
                                  'v5p:4x4'])
def test_unknown_targets_are_refused_naming_the_valid_ones(text):
  with pytest.raises(targets.TargetError, match='valid: v4:<topology>, '
                     r'v5e:<topology>.*\(e\.g\. v5e:16x16'):
    targets.parse(text)


def _launch(*args, timeout=300, env=None):
  return subprocess.run(
      [sys.executable, '-m', 'launch.compile', *args], cwd=REPO,
      capture_output=True, text=True, timeout=timeout, env=env)


def _error_lines(stderr: str) -> list[str]:
  return [l for l in stderr.splitlines() if l.startswith('error:')]


def test_launcher_exit_statuses_and_one_line_errors(tmp_path):
  # An unknown target: exit 2, one line listing the valid ones.
  bad = _launch('--config=configs/digits.py:runlocal', '--target=v9:2x2')
  assert bad.returncode == 2, bad.stderr
  lines = _error_lines(bad.stderr)
  assert len(lines) == 1 and 'v5e:16x16' in lines[0] and 'v9:2x2' in lines[0]
  # A model that does not fit (arguments alone exceed the chip): exit 3,
  # naming the function, its bytes and the chip's.
  # With a persistent compilation cache set up, which the launcher must
  # leave alone (as test_the_launcher_leaves_a_persistent_compilation_
  # cache_alone checks on a job that compiles and fits).
  cache = tmp_path / 'cache'
  big = _launch('--config=configs/lm.py:runlocal', '--target=v5e:2x2',
                f'--workdir={tmp_path}', '--config.model.d_model=16384',
                '--config.model.num_heads=64', '--config.model.mlp_dim=65536',
                '--config.mesh.shape=(4,1)',
                env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0'))
  assert big.returncode == 3, big.stderr[-2000:]
  lines = _error_lines(big.stderr)
  assert len(lines) == 1, big.stderr[-2000:]
  assert re.match(r'error: train_step does not fit on v5e:2x2: needs '
                  r'[\d.]+ GiB per chip.*TPU v5 lite has 15.75 GiB usable',
                  lines[0]), lines[0]
  saved = json.loads((tmp_path / 'compile.json').read_text())
  assert saved['target'] == 'v5e:2x2' and not saved['rows'][0]['fits']
  # The per-chip parameters alone: d_model 16384 x (4 x 16384 + 3 x 65536)
  # x 2 layers, float32, with AdamW's two moments, over 4 chips.
  params = 2 * 16384 * (4 * 16384 + 3 * 65536)
  assert saved['rows'][0]['total_bytes'] > 3 * 4 * params / 4
  assert not cache.exists() or not os.listdir(cache), os.listdir(cache)


@pytest.mark.slow
def test_the_launcher_leaves_a_persistent_compilation_cache_alone(tmp_path):
  # Deviceless executables cannot be loaded back: entries written here
  # made every later compile of the program warn and compile again.
  cache = tmp_path / 'cache'
  result = subprocess.run(
      [sys.executable, '-m', 'launch.compile',
       '--config=configs/digits.py:runlocal,model=mlp', '--target=v5e:2x2'],
      cwd=REPO,
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0'))
  assert result.returncode == 0, result.stderr[-2000:]
  assert not cache.exists() or not os.listdir(cache), os.listdir(cache)


@pytest.mark.slow
@pytest.mark.parametrize('name', RECIPES)
def test_the_sam_recipes_compile_full_size(name):
  spec, target, overrides = RECIPES[name]
  rows = _rows(_compile(spec, target, overrides))
  assert list(rows) == ['train_step', 'eval_step', 'state_is_finite']
  assert all(r['fits'] for r in rows.values())


@pytest.mark.slow
@pytest.mark.parametrize('spec,target,overrides,model,fits', [
    ('configs/lm.py:size=1b', 'v5e:16x16', {}, None, True),
    ('configs/lm.py:size=8b', 'v5e:2x2', {}, None, False),
    # Gemma 3's larger shapes, bfloat16, on one chip (BENCHMARKS.md).
    ('configs/gemma.py:shape=1b', 'h100:1x1x1',
     {'methods': ('spherical_gate',)}, None, True),
    ('configs/gemma.py:shape=4b', 'v5e:1x1',
     {'methods': ('spherical_gate',)}, None, True),
    # Fine-tuning Gemma 3 (bfloat16, remat, FSDP; BENCHMARKS.md
    # compile_estimates_gemma): 1B with SAM on a 2x2 slice; 4B not on one
    # chip.
    ('configs/gemma.py:finetune,sam,shape=1b', 'v5e:2x2', {}, None, True),
    ('configs/gemma.py:finetune,shape=4b', 'v5e:1x1', {}, None, False),
])
def test_pod_sizes(spec, target, overrides, model, fits):
  if fits:
    result = _compile(spec, target, overrides, model)
    assert all(r['fits'] for r in result['rows'])
  else:
    with pytest.raises(compile_report.DoesNotFit):
      _compile(spec, target, overrides, model)


def _gemma_training_rows(path, job):
  rows = _rows(_compile(f'configs/gemma.py:{job},runlocal', 'v5e:2x2',
                        {'model.shape': 'gguf', 'model.gguf': str(path)}))
  assert all(r['error'] is None and r['fits'] for r in rows.values()), rows
  return rows


def test_freezing_gemmas_embedding_drops_its_moments_from_the_state(
    tmp_path, monkeypatch):
  """The Gemma 3 fine-tune's state (SAM, FSDP rules; the finiteness
  check's arguments) at the tests' two-layer file's shape, compiled for a
  v5e 2x2 slice, whole and with the embedding frozen. Their train and
  eval steps (most of the 23 s the test took with them) are slow (the two
  tests below)."""
  path = tiny_gemma.model_file(tmp_path / 'g.gguf')
  _only(monkeypatch, 'state_is_finite')
  rows = _gemma_training_rows(path, 'finetune,sam')
  frozen = _gemma_training_rows(path, 'finetune,sam,frozen')
  assert list(rows) == list(frozen) == ['state_is_finite']
  _check_frozen_moments(rows, frozen)


def _check_frozen_moments(rows, frozen):
  # Frozen, the embedding has no AdamW moments: two float32 copies of it
  # fewer, FSDP-sharded over the 4 chips (and no more than that is gone).
  moments = 2 * tiny_gemma.SHAPE.vocab_size * tiny_gemma.SHAPE.d_model * 4 / 4
  saved = (rows['state_is_finite']['bytes']['argument']
           - frozen['state_is_finite']['bytes']['argument'])
  assert moments <= saved < 1.5 * moments, (saved, moments)


@pytest.mark.slow
def test_gemma_fine_tuning_compiles_for_a_tpu_slice(tmp_path, monkeypatch):
  """Gemma 3's training step (SAM, FSDP rules) at the tests' two-layer
  file's shape, for a v5e 2x2 slice: 270M's program but for its sizes
  (those rows are BENCHMARKS.md's; 1B and 4B are slow above). With the
  embedding frozen, its state (the finiteness check's arguments) is
  compiled; its train and eval steps are the test below."""
  path = tiny_gemma.model_file(tmp_path / 'g.gguf')
  rows = _gemma_training_rows(path, 'finetune,sam')
  assert list(rows) == ['train_step', 'eval_step', 'state_is_finite']
  _only(monkeypatch, 'state_is_finite')
  frozen = _gemma_training_rows(path, 'finetune,sam,frozen')
  assert list(frozen) == ['state_is_finite']
  _check_frozen_moments(rows, frozen)


@pytest.mark.slow
def test_gemma_fine_tuning_with_the_embedding_frozen_compiles(tmp_path):
  """The frozen-embedding job's train and eval steps as well (the eval
  step is the whole model's program; the train step differs by the
  optimizer's mask)."""
  path = tiny_gemma.model_file(tmp_path / 'g.gguf')
  rows = _gemma_training_rows(path, 'finetune,sam,frozen')
  assert list(rows) == ['train_step', 'eval_step', 'state_is_finite']
