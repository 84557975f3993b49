"""geom.kernels.sam_perturb compiled for TPU and GPU chips from a CPU host.

Lowering (test_kernels_sam_perturb_lowering.py) checks block shapes and
memory spaces; compiling runs the rest of each compiler without the
hardware (`train.compilation.targets`): Mosaic for TPU v4, v5e, v5p and v6e (VMEM
allocation included) and Triton to PTX and a cubin for H100 and H200
(registers and shared memory, through ptxas), and XLA's SPMD partitioner
for sharded parameters. Every tree of the lowering tests, SAM and ASAM,
is compiled once per chip: one program per chip holds them all, each
under its own name scope, and the tests read their part of it (a program
that fails to compile is then compiled per tree to name the failing one).
`make test` compiles for v5e and H100; v4, v5p, v6e and H200 are `slow`,
and so is the sharded program for H100.

The compilers come from the compile toolchain (`make compile-toolchain`);
without it these tests skip, saying what is missing.
"""

import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from train.compilation import hlo_traffic
from bench.sam.perturb_trees import TREES
from geom.kernels import sam_perturb as k
from train.compilation import targets

ONE_CHIP = {'v4': 'v4:1x1x1', 'v5e': 'v5e:1x1', 'v5p': 'v5p:1x1x1',
            'v6e': 'v6e:1x1', 'h100': 'h100:1x1x1', 'h200': 'h200:1x1x1'}
# H200 is H100's compiler target (sm_90) with more memory: its program is
# the same, so its compile is slow (test_compiles_for_h200). One TPU (v5e)
# and one GPU (H100) compile in `make test`, Mosaic and Triton each: v4,
# v5p and v6e are Mosaic again on other chips (a compile of every tree of
# 5-8 s each), slow (test_compiles_for_v4_v5p_and_v6e).
OTHER_TPUS = ['v4', 'v5p', 'v6e']
DEFAULT_CHIPS = [c for c in ONE_CHIP if c != 'h200' and c not in OTHER_TPUS]
VARIANTS = {'sam': False, 'asam': True}
KERNEL_CALLS = {'tpu': 'tpu_custom_call', 'cuda': '__gpu$xla.gpu.triton'}


@functools.lru_cache(maxsize=None)
def _devices(target: str):
  """Compile-only devices of a target, or the skip reason (one line)."""
  try:
    found = targets.devices(targets.parse(target))
  except targets.ToolchainMissing as e:
    return f'compile toolchain missing: {e}'
  return found


def devices(target: str):
  found = _devices(target)
  if isinstance(found, str):
    pytest.skip(found)
  return found


def _abstract(tree, sharding):
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      tree)


def _perturb_all(trees, rho, eta, eps):
  """Every (tree, variant) in one program, each under its name scope."""
  out = {}
  for name, params in trees.items():
    for variant, adaptive in VARIANTS.items():
      with jax.named_scope(f'{name}__{variant}'):
        out[f'{name}__{variant}'] = k.sam_perturb(
            params, params, rho, eta=eta, eps=eps, adaptive=adaptive)
  return out


def _compile(chip: str, trees):
  mesh = Mesh(np.array(devices(ONE_CHIP[chip])), ('chip',))
  one = NamedSharding(mesh, P())
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=one)
  return jax.jit(_perturb_all).lower(
      _abstract(trees, one), scalar, scalar, scalar).compile()


@functools.lru_cache(maxsize=None)
def _program(chip: str):
  """(the compiled program of every tree, or the compiler's error)."""
  try:
    return _compile(chip, {name: params for name, (params, _) in
                           TREES.items()}), None
  except jax.errors.JaxRuntimeError as e:
    return None, e


def _compiler_message(error: Exception) -> str:
  """The compiler's error in one line: its first line, and the sentence
  with the limit that was exceeded (Mosaic prints the instruction between
  them)."""
  text = ' '.join(str(error).split())
  limit = re.search(r'Scoped allocation with size \S+ and limit \S+ '
                    r'exceeded scoped vmem limit by [0-9.]+\w', text)
  first = str(error).splitlines()[0]
  return first + (f' ...{limit.group(0)}' if limit and limit.group(0) not in
                  first else '')


def _kernel_calls(text: str, platform: str, scope: str) -> int:
  """Kernel launches (custom calls) in the entry computation under `scope`."""
  return sum(1 for line in hlo_traffic.entry_lines(text)
             if f'custom_call_target="{KERNEL_CALLS[platform]}"' in line
             and re.search(rf'op_name="[^"]*/{scope}/', line))


@pytest.mark.parametrize('variant', VARIANTS)
@pytest.mark.parametrize('tree', TREES)
@pytest.mark.parametrize('chip', DEFAULT_CHIPS)
def test_compiles(chip, tree, variant):
  _check_compiled(chip, tree, variant)


@pytest.mark.slow
def test_compiles_for_v4_v5p_and_v6e():
  for chip in OTHER_TPUS:
    for tree in TREES:
      for variant in VARIANTS:
        _check_compiled(chip, tree, variant)


@pytest.mark.slow
def test_compiles_for_h200():
  for tree in TREES:
    for variant in VARIANTS:
      _check_compiled('h200', tree, variant)


def _check_compiled(chip, tree, variant):
  """test_compiles' checks of one tree and variant on one chip."""
  compiled, error = _program(chip)
  if error is not None:  # Another tree's, or this one's: compile it alone.
    try:
      compiled = _compile(chip, {tree: TREES[tree][0]})
    except jax.errors.JaxRuntimeError as e:
      pytest.fail(f'{chip}: {tree} ({variant}) does not compile: '
                  f'{_compiler_message(e)}', pytrace=False)
  platform = targets.parse(ONE_CHIP[chip]).platform
  _, buffers = TREES[tree]
  # A norm and an update launch per buffer, of this chip's kernels only.
  text = compiled.as_text()
  assert _kernel_calls(text, platform, f'{tree}__{variant}') == 2 * buffers
  other = 'cuda' if platform == 'tpu' else 'tpu'
  assert KERNEL_CALLS[other] not in text
  if tree == 'large' and platform == 'tpu':
    # The leaf keeps its 1024 lanes: no relayout to rows of 128.
    assert 'f32[32768,128]' not in text
  memory = compiled.memory_analysis()
  used = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes)
  assert used < targets.chip_for(targets.parse(ONE_CHIP[chip])).hbm_bytes


def test_a_block_over_vmem_lowers_but_does_not_compile(monkeypatch):
  # What compiling adds: lowering accepts a block whose update needs
  # 24 MiB of scoped VMEM (three 8 MiB float32 operands); Mosaic refuses
  # it at compile. `BlockSizes` refuses it by name before either (the
  # lowering tests); here that check is lifted to show the compiler's.
  monkeypatch.setattr(k, '_TPU_SCOPED_VMEM_BYTES', 2**40)
  mesh = Mesh(np.array(devices('v5e:1x1')), ('chip',))
  one = NamedSharding(mesh, P())
  params = _abstract({'w': jax.ShapeDtypeStruct((16384, 128), jnp.float32)},
                     one)
  lowered = jax.jit(lambda w, g: k.sam_perturb(
      w, g, 0.1, block_sizes=k.BlockSizes(block_rows=16384))).lower(
          params, params)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r'(?s)vmem.*sam_perturb_update.*24\.00M and limit '
                     r'16\.00M'):
    lowered.compile()


# Sharded parameters: a large leaf split along its rows (FSDP), one along
# its columns (tensor parallelism), one over both axes, one replicated, and
# small ragged leaves packed.
SHARDED = {'fsdp': ((4096, 1024), P('data', None)),
           'tensor': ((1024, 2048), P(None, 'model')),
           'both': ((2048, 512), P(('data', 'model'), None)),
           'replicated': ((512, 512), P()),
           'bias': ((1024,), P('data')), 'odd': ((1000, 3), P()),
           'tiny': ((7,), P())}
SHARDED_TARGETS = {'v5e': 'v5e:2x2', 'v5p': 'v5p:2x2x1', 'h100': 'h100:1x1x2'}
# v5p's partitioned program is v5e's on another TPU (the partitioner is
# XLA's; each chip's Mosaic kernels are compiled by test_compiles): slow
# (test_sharded_parameters_compile_without_gathering_on_v5p). H100's (9 s
# of the GPU compiler) is slow too: its Triton kernels are compiled by
# test_compiles[h100-*], and the partitioner's per-device kernels on
# shards are run against the unsharded reference on CPU
# (test_kernels_sam_perturb.py).
SHARDED_DEFAULT = ['v5e', pytest.param('h100', marks=pytest.mark.slow)]


def _sharded(target: str):
  devs = devices(target)
  shape = (2, 2) if len(devs) == 4 else (2, 1)
  mesh = Mesh(np.array(devs).reshape(shape), ('data', 'model'))
  shardings = {name: NamedSharding(mesh, spec)
               for name, (_, spec) in SHARDED.items()}
  params = {name: jax.ShapeDtypeStruct(s, jnp.float32,
                                       sharding=shardings[name])
            for name, (s, _) in SHARDED.items()}
  scalar = jax.ShapeDtypeStruct((), jnp.float32,
                                sharding=NamedSharding(mesh, P()))
  return mesh, shardings, params, scalar


def _no_parameter_sized_all_gather(text: str):
  # Only scalars may be gathered; the smallest sharded leaf is 4 KiB.
  gathered = hlo_traffic.collectives(text, 'all-gather')
  assert all(b <= 64 for b in gathered), gathered


@functools.lru_cache(maxsize=None)
def _sharded_program(target: str):
  """Both routes (the partitioner's, shardings given) in one program per
  target, each under its name scope. SAM only: ASAM splits the same way
  (test_kernels_sam_perturb.py runs both sharded)."""
  _, shardings, params, scalar = _sharded(target)

  def all_routes(w, grads, rho):
    # A gradient per route: the same kernel on the same operands in two
    # routes would be merged by XLA (CSE).
    out = {}
    for given, g in zip((False, True), grads):
      route = 'given' if given else 'partitioner'
      with jax.named_scope(route):
        out[route] = k.sam_perturb(w, g, rho,
                                   shardings=shardings if given else None)
    return out

  out_shardings = {route: (shardings, None)
                   for route in ('partitioner', 'given')}
  return jax.jit(all_routes, out_shardings=out_shardings).lower(
      params, (params, params), scalar).compile()


ROUTES = ['partitioner', 'given']


@pytest.mark.parametrize('route', ROUTES)
@pytest.mark.parametrize('chip', SHARDED_DEFAULT)
def test_sharded_parameters_compile_without_gathering(chip, route):
  _check_sharded(chip, route)


@pytest.mark.slow
def test_sharded_parameters_compile_without_gathering_on_v5p():
  for route in ROUTES:
    _check_sharded('v5p', route)


def _check_sharded(chip, route):
  """test_sharded_parameters_compile_without_gathering's checks."""
  target = SHARDED_TARGETS[chip]
  compiled = _sharded_program(target)
  text = compiled.as_text()
  _no_parameter_sized_all_gather(text)
  platform = targets.parse(target).platform
  calls = _kernel_calls(text, platform, route)
  if platform == 'tpu' and route == 'partitioner':
    # Mosaic kernels cannot be split by the partitioner: XLA's fusion of
    # the same arithmetic runs instead (see the kernel's docstring).
    assert calls == 0
  else:
    # Per device: the four large leaves' shards are buffers of their own;
    # bias (split over 'data') and odd and tiny (whole) are two packs.
    assert calls == 2 * 6, calls
  # Per chip, w and the two g in and the two w' out as shards, nothing
  # whole (up to TPU tile padding of the small leaves; the whole tree is
  # twice the shards).
  _, _, params, _ = _sharded(target)
  memory = compiled.memory_analysis()
  shard_bytes = sum(4 * np.prod(x.sharding.shard_shape(x.shape))
                    for x in params.values())
  assert memory.argument_size_in_bytes < 1.05 * 3 * shard_bytes
  assert memory.output_size_in_bytes < 1.05 * 2 * shard_bytes


def _split_axes(spec) -> set[str]:
  return {a for entry in spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)}


@pytest.mark.parametrize('manual', [('data', 'model'), ('data',)],
                         ids=['all_axes', 'data_axis'])
def test_m_sharpness_shard_map_compiles_for_tpu(manual):
  # m-sharpness on a TPU slice: each device perturbs with its own gradient
  # inside a shard_map with device-variance checks on (as train.training.steps runs
  # it on hardware). Over every axis, each device holds its shards and the
  # Mosaic kernels run; over 'data' only, as train.training.steps does, the
  # parameters are replicated over 'data' and split over 'model' by the
  # partitioner, and XLA's fusion runs.
  mesh, shardings, params, scalar = _sharded('v5e:2x2')
  specs = {name: s.spec for name, s in shardings.items()}
  if manual == ('data',):
    specs = {name: P(*(None if e is not None and 'data' in _split_axes((e,))
                       else e for e in spec)) for name, spec in specs.items()}
    params = {name: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, specs[name]))
              for name, x in params.items()}
    in_specs = {name: P() for name in specs}
  else:
    in_specs = specs

  def step(w, g, rho):
    # The gradient varies over the manual axes; so does w where SAM moves it.
    g = {name: jax.lax.pcast(x, tuple(set(manual) - _split_axes(specs[name])),
                             to='varying')
         if set(manual) - _split_axes(specs[name]) else x
         for name, x in g.items()}
    w = {name: jax.lax.pcast(x, tuple(set(manual) - _split_axes(specs[name])),
                             to='varying')
         if set(manual) - _split_axes(specs[name]) else x
         for name, x in w.items()}
    out, norm = k.sam_perturb(w, g, rho)
    # One number per device, from every perturbed leaf and the norm.
    return (norm + sum(jnp.sum(x) for x in jax.tree.leaves(out)))[None]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(in_specs, in_specs, P()),
                     out_specs=P(manual), axis_names=set(manual))
  text = jax.jit(fn).lower(params, params, scalar).compile().as_text()
  _no_parameter_sized_all_gather(text)
  calls = text.count(f'custom_call_target="{KERNEL_CALLS["tpu"]}"')
  # Per device: four large shards, and one pack of bias, odd and tiny
  # (each device's own leaves, one norm per device).
  assert calls == (10 if manual == ('data', 'model') else 0), calls
