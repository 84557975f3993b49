"""Resuming a workdir with a config: which fields may change, which may not.

Each checkpoint saves the run's config. Before a run resumes (or reports a
finished run's result), the new config is compared with the saved one,
field by field. A field that changes what the run computes (model, data,
batch size, optimizer, seed, mesh, ...) would splice two different runs
into one workdir, so a change there is refused, naming every changed
field with its old and new values. `MAY_CHANGE` lists the fields that
may change, and why each is safe.
"""

from collections.abc import Iterable, Mapping
import json
from typing import Any

from absl import logging
import ml_collections

from train.errors import UsageError

# Field -> why changing it on resume does not change the run's meaning.
MAY_CHANGE = {
    'num_steps': 'extends the run (never below the latest checkpoint)',
    'log_every': 'logging cadence',
    'eval_every': 'validation cadence (evaluation reads, never trains)',
    'eval_batch_size': 'evaluation batching (every example is seen once)',
    'checkpoint_every': 'checkpoint cadence',
    'keep_checkpoints': 'checkpoint retention',
    'data_dir': 'where the same data set is read from',
    # The device layout: the same global batches on other devices (e.g. a
    # checkpoint of one process resumed on two). Sums run in another order,
    # so the resumed run is close to, not bit-identical with, the original.
    'cpu_devices': 'the device layout (not with a per-device method)',
    'mesh.shape': 'the device layout (not with a per-device method)',
}
# Changing these changes a per-device method's per-device batch (e.g.
# m-sharpness perturbs each device's share of the batch).
LAYOUT = ('cpu_devices', 'mesh.shape')


class ConfigChanged(UsageError):
  """The config differs from the saved one in fields that fix the run."""

  def __init__(self, workdir: str, step: int,
               changes: list[tuple[str, Any, Any]],
               may_change: Iterable[str] = tuple(MAY_CHANGE)):
    self.changes = changes
    listed = '; '.join(f'config.{k} {_show(old)} -> {_show(new)}'
                       for k, old, new in changes)
    super().__init__(
        '--workdir', workdir,
        f'holds a run (checkpoint at step {step}) with a different config: '
        f'{listed}. These fields fix what the run computes; only '
        f'{", ".join(may_change)} may change on resume. Use the saved '
        'values, or a new --workdir')


def _show(value: Any) -> str:
  return '(absent)' if value is _ABSENT else json.dumps(value)


_ABSENT = object()


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, Mapping):
    flat = {}
    for key, value in tree.items():
      flat.update(_flatten(value, f'{prefix}{key}.'))
    return flat
  return {prefix[:-1]: tree}


def as_json(config: ml_collections.ConfigDict) -> str:
  """The form a config is saved in (`ConfigDict.to_json_best_effort`)."""
  return config.to_json_best_effort()


def changed_fields(saved: Mapping[str, Any], current: Mapping[str, Any]
                   ) -> list[tuple[str, Any, Any]]:
  """(dotted field, old, new) for every leaf that differs (`_ABSENT` if
  missing on one side), in field order. A field missing on one side and
  None (unset) on the other is not a change: a field added to a config
  since, and left unset, computes what its absence did."""
  old, new = _flatten(saved), _flatten(current)
  unset = lambda v: v is None or v is _ABSENT
  return [(k, old.get(k, _ABSENT), new.get(k, _ABSENT))
          for k in sorted(set(old) | set(new))
          if old.get(k, _ABSENT) != new.get(k, _ABSENT)
          and not (unset(old.get(k, _ABSENT)) and unset(new.get(k, _ABSENT)))]


def check(config: ml_collections.ConfigDict, workdir: str, step: int,
          meta: Mapping[str, Any], *, per_device_method: bool = False
          ) -> None:
  """Refuses to resume the checkpoint at `step` (whose metadata is `meta`)
  with `config` if a field outside `MAY_CHANGE` differs (or a `LAYOUT`
  field, when `per_device_method`: the optimizer has a per-device update),
  or if num_steps falls below `step`.

  Raises:
    ConfigChanged: a field that fixes the run changed.
    UsageError: config.num_steps is below `step`.
  """
  if 'config' not in meta:
    logging.warning('The checkpoint at step %d has no saved config: the '
                    'config is not checked', step)
    return
  saved = json.loads(meta['config'])
  current = json.loads(as_json(config))
  changes = changed_fields(saved, current)
  fixed = [c for c in changes if c[0] not in MAY_CHANGE
           or (per_device_method and c[0] in LAYOUT)]
  if fixed:
    raise ConfigChanged(workdir, step, fixed)
  if config.num_steps < step:
    raise UsageError(
        'config.num_steps', config.num_steps,
        f'below the latest checkpoint of {workdir} (step {step}); a run '
        'cannot be shortened after the fact (use a new --workdir)')
  for field, old, new in changes:
    if field == 'num_steps':
      logging.warning(
          'config.num_steps %s -> %s: the run is extended; schedules that '
          'span num_steps (the learning rate, step windows) are rebuilt '
          'over %s steps, so from step %d on they follow the new length.',
          old, new, new, step)
    elif field in LAYOUT:
      logging.warning(
          'config.%s %s -> %s: the run resumes on another device layout; '
          'its sums now split over other devices, so it ends equal to '
          'float rounding, not bit for bit, to a run on the old layout.',
          field, _show(old), _show(new))
    else:
      logging.info('config.%s %s -> %s on resume (%s)', field, _show(old),
                   _show(new), MAY_CHANGE[field])


def check_task(config: ml_collections.ConfigDict, workdir: str, step: int,
               meta: Mapping[str, Any], *, task: str, what: str,
               may_change: Iterable[str]) -> None:
  """The check of a loop other than `train.training.loop` (test-time adaptation,
  RL): the checkpoint at `step` must hold a `task` run's config that
  differs from `config` only in `may_change`.

  Raises:
    UsageError: the checkpoint holds no config, or another task's run
      (`what` names this one, e.g. 'an RL run').
    ConfigChanged: a field outside `may_change` differs.
  """
  if 'config' not in meta:
    raise UsageError('--workdir', workdir,
                     f'holds a checkpoint at step {step} without a config: '
                     f'not {what}')
  saved = json.loads(meta['config'])
  if saved.get('task') != task:
    raise UsageError('--workdir', workdir,
                     f'holds a {saved.get("task", "classification")!r} run, '
                     f'not {what}; use a new --workdir')
  may_change = tuple(may_change)
  fixed = [c for c in changed_fields(saved, json.loads(as_json(config)))
           if c[0] not in may_change]
  if fixed:
    raise ConfigChanged(workdir, step, fixed, may_change)


# In a checkpoint's metadata: {name: fingerprint} of the inputs the run
# depends on beyond its config (a trained tokenizer's model file, a source
# model's parameters), pinned by content.
FINGERPRINTS = 'data_fingerprints'


def check_fingerprints(workdir: str, step: int, meta: Mapping[str, Any],
                       current: Mapping[str, str]) -> None:
  """Refuses a checkpoint whose recorded fingerprints differ from
  `current`'s (a name absent from either side is not compared: a
  checkpoint from before that input was recorded).

  Raises:
    UsageError: naming the input and both fingerprints, in one line.
  """
  saved = meta.get(FINGERPRINTS) or {}
  for name, value in sorted(current.items()):
    if name in saved and saved[name] != value:
      raise UsageError(
          name, short_fingerprint(value),
          f'differs from {short_fingerprint(saved[name])}, the one the '
          f'checkpoint of {workdir} at step {step} was made with (it changed '
          'since: replaced, or trained further?); a run resumes only with '
          'its own')


def short_fingerprint(fingerprint: str) -> str:
  """'kind:digest' cut to 12 hex digits of the digest, for messages."""
  kind, sep, digest = str(fingerprint).partition(':')
  return f'{kind}:{digest[:12]}' if sep and len(digest) > 12 else (
      str(fingerprint))
