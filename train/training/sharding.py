"""Mesh from config, logical-axis rules to mesh axes, and derived shardings.

Parameters are annotated with logical axis names in the model; the config's
`logical_axis_rules` map each name to a mesh axis (or None: replicated).
Shardings of parameters and optimizer state are derived from abstract
shapes (`jax.eval_shape`), so nothing is allocated before its sharding is
known, and every array is created directly where it belongs.
"""

from collections.abc import Sequence
import math
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax

from train.run import process_group
from train.errors import ConfigError

Rules = Sequence[tuple[str, str | None]]


def mesh_shape(shape: Sequence[int], axes: Sequence[str],
               num_devices: int, field: str = 'mesh') -> tuple[int, ...]:
  """Resolves one -1 entry and checks the product against the device count
  (errors name `<field>.shape`)."""
  shape = tuple(int(s) for s in shape)
  name = f'{field}.shape'
  if len(shape) != len(axes):
    raise ConfigError(name, shape,
                      f'needs one size per axis of {field}.axes={tuple(axes)}')
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ConfigError(name, shape,
                      'sizes must be positive, with at most one -1 '
                      '(meaning: all remaining devices)')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ConfigError(name, shape,
                        f'{num_devices} devices cannot be split into a '
                        f'multiple of {known}')
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ConfigError(name, shape,
                      f'needs {math.prod(shape)} devices but there are '
                      f'{num_devices}; shapes that fit: '
                      f'{_fitting_shapes(len(axes), num_devices)}')
  return shape


def _fitting_shapes(n_axes: int, num_devices: int) -> str:
  examples = [(-1,) + (1,) * (n_axes - 1)]
  if n_axes == 2:
    examples += [(num_devices // m, m) for m in (1, 2, 4)
                 if num_devices % m == 0]
  return ', '.join(str(e) for e in dict.fromkeys(examples))


def make_mesh(shape: Sequence[int], axes: Sequence[str],
              devices: Sequence[Any] | None = None,
              dcn_axis: str | None = None, field: str = 'mesh') -> Mesh:
  """A mesh in Auto mode (shardings given to jit), over all devices or over
  `devices` (e.g. a TPU pod's compile-only devices, `train.compilation.targets`).

  Devices are laid out in the physical order that keeps each axis's
  collectives on neighbouring chips (`mesh_utils`). When `devices` span
  several TPU slices, `dcn_axis` is the one axis that crosses the
  data-centre network between them (data parallelism, as MaxText lays it
  out); the other axes stay within a slice.
  """
  kinds = (jax.sharding.AxisType.Auto,) * len(axes)
  if devices is None and not process_group.is_alone():
    resolved = mesh_shape(shape, axes, jax.device_count(), field)
    return jax.make_mesh(resolved, tuple(axes), axis_types=kinds)
  if devices is None:
    devices = process_group.devices()
  devices = list(devices)
  resolved = mesh_shape(shape, axes, len(devices), field)
  slices = len({getattr(d, 'slice_index', 0) for d in devices})
  if slices > 1:
    axis = list(axes).index(dcn_axis) if dcn_axis in axes else None
    if axis is None or resolved[axis] % slices:
      raise ConfigError(f'{field}.shape', tuple(resolved),
                        f'{slices} slices need the data axis '
                        f'({dcn_axis!r}) to be divisible by {slices} so '
                        'that it spans them')
    ici = list(resolved)
    ici[axis] //= slices
    dcn = [1] * len(resolved)
    dcn[axis] = slices
    array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  elif devices[0].platform == 'tpu':
    array = mesh_utils.create_device_mesh(resolved, devices,
                                          allow_split_physical_axes=True)
  else:
    array = np.array(devices).reshape(resolved)
  return Mesh(array, tuple(axes), axis_types=kinds)


def check_rules(rules: Rules, mesh_axes: Sequence[str],
                field: str = 'logical_axis_rules') -> None:
  for logical, mesh_axis in rules:
    axes = mesh_axis if isinstance(mesh_axis, (tuple, list)) else (mesh_axis,)
    if any(a is not None and a not in mesh_axes for a in axes):
      raise ConfigError(field, (logical, mesh_axis),
                        'maps to an axis that is not in the mesh',
                        list(mesh_axes) + [None])


def logical_to_shardings(abstract_boxed: Any, mesh: Mesh,
                         rules: Rules) -> Any:
  """NamedShardings for a tree of `nn.Partitioned` (or plain) abstract values.

  Leaves without logical annotations (e.g. BatchNorm statistics) are
  replicated. A dimension that the rules split must divide evenly.
  """
  specs = nn.get_partition_spec(abstract_boxed)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  unboxed = nn.meta.unbox(abstract_boxed)

  def check(path, leaf, sharding):
    for dim, axis in zip(leaf.shape, sharding.spec):
      if axis is None:
        continue
      size = math.prod(mesh.shape[a] for a in
                       (axis if isinstance(axis, tuple) else (axis,)))
      if dim % size:
        raise ConfigError(
            'mesh.shape', tuple(mesh.shape.values()),
            f'parameter {jax.tree_util.keystr(path)} of shape {leaf.shape} '
            f'cannot be split over mesh axis {axis!r} of size {size}; '
            'change the mesh or the model width')
    return sharding

  return jax.tree_util.tree_map_with_path(check, unboxed, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
  """Leading (batch) dimension split as the 'batch' logical axis says."""
  spec = nn.logical_to_mesh_axes(('batch',), rules)
  return NamedSharding(mesh, spec)


def optimizer_state_shardings(tx: optax.GradientTransformation,
                              abstract_params: Any, param_shardings: Any,
                              mesh: Mesh) -> Any:
  """Per-parameter optimizer state follows its parameter; the rest is
  replicated. A transformation that holds no state for some parameters
  (`optax.masked`, `multi_transform`: frozen ones) keeps its placeholders."""
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(
      tx, lambda x, s: x if masked(x) else s, abstract_state,
      param_shardings, transform_non_params=lambda _: replicated(mesh),
      is_leaf=masked)


def device_bytes(tree: Any) -> int:
  """Bytes of one device's shards of `tree` (arrays or abstract arrays with
  shardings):
  the largest per-device sum, so an uneven split counts its largest part."""
  # Summed per sharding first: a pod's 65,536 devices times a model's
  # hundreds of arrays were millions of additions.
  per_sharding: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    if sharding is None:
      continue
    # Python integers: a shape from a hostile config can pass int64.
    shard = math.prod(int(n) for n in sharding.shard_shape(leaf.shape))
    per_sharding[sharding] = (per_sharding.get(sharding, 0)
                              + shard * _itemsize(leaf.dtype))
  per_device: dict[Any, int] = {}
  for sharding, size in per_sharding.items():
    for device in sharding.device_set:
      per_device[device] = per_device.get(device, 0) + size
  return max(per_device.values(), default=0)


def _itemsize(dtype: Any) -> int:
  """Bytes per element; a PRNG key's are its key data's (no NumPy dtype)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    data = jax.eval_shape(jax.random.key_data,
                          jax.ShapeDtypeStruct((), dtype))
    return math.prod(data.shape) * data.dtype.itemsize
  return jax.numpy.dtype(dtype).itemsize
