"""What makes a checkpoint trustworthy: its arrays' fingerprints and its
metadata's digest, checked on every restore.

Every checkpoint carries a fingerprint of each array it holds
(`train.run.checksums`, computed on the devices), and a restore recomputes
and compares them, so a flipped bit on disk is found rather than trained
on. The metadata saved beside the arrays (the run's config, its inputs'
fingerprints) carries its own digest, so a flipped bit there is damage
too, never a different config. Both checkpoint back-ends
(`train.run.checkpointing`, `train.run.local_checkpoints`) seal and verify
through here.
"""

import hashlib
import json
from typing import Any

from absl import logging

from train.errors import RunError
from train.run import checksums

CHECKSUMS = 'checksums'
# The digest of the rest of the metadata (`meta_digest`).
META_DIGEST = 'meta_sha256'


class DamagedCheckpoint(RuntimeError):
  """A checkpoint that does not load, or whose arrays fail verification."""

  def __init__(self, step: int, reason: str):
    self.step = step
    self.reason = reason
    super().__init__(f'checkpoint at step {step}: {reason}')


class NoGoodCheckpoint(RunError):
  """Checkpoints exist and none of them is usable (the run cannot resume)."""
  exit_code = 4

  def __init__(self, directory: str, problems: list[DamagedCheckpoint]):
    self.problems = problems
    listed = '; '.join(f'step {p.step}: {p.reason}' for p in problems)
    super().__init__(
        f'no usable checkpoint in {directory} ({listed}). Nothing was '
        'changed; to start the run over, move that directory aside.')


def meta_digest(meta: dict[str, Any]) -> str:
  """SHA-256 of `meta` as canonical JSON: of what JSON gives back of it
  (integer keys come back as strings, and sort as strings), so the saved
  and the restored metadata agree."""
  text = json.dumps(json.loads(json.dumps(meta)), sort_keys=True,
                    separators=(',', ':'))
  return hashlib.sha256(text.encode()).hexdigest()


def sealed(meta: dict[str, Any], state: Any) -> dict[str, Any]:
  """`meta` as saved with `state`: with the arrays' fingerprints under
  'checksums', and the digest of all of it under 'meta_sha256'."""
  meta = dict(meta, **{CHECKSUMS: checksums.fingerprint(state)})
  meta[META_DIGEST] = meta_digest(meta)
  return meta


def verified_meta(step: int, meta: Any) -> dict[str, Any]:
  """`meta` without its digest, once the digest matches (older checkpoints
  have none).

  Raises:
    DamagedCheckpoint: `meta` is not a JSON object, or not what was saved.
  """
  if not isinstance(meta, dict):
    raise DamagedCheckpoint(step, 'metadata is not a JSON object')
  meta = dict(meta)
  saved = meta.pop(META_DIGEST, None)
  if saved is not None and saved != meta_digest(meta):
    raise DamagedCheckpoint(step, 'metadata checksum mismatch (the saved '
                            'config or fingerprints changed on disk)')
  return meta


def check_arrays(step: int, state: Any, meta: dict[str, Any],
                 directory: str) -> None:
  """Compares the restored `state` with the fingerprints saved in `meta`
  (a checkpoint saved without them is let through with a warning).

  Raises:
    DamagedCheckpoint: an array's fingerprint differs from the one saved.
  """
  saved = meta.get(CHECKSUMS)
  if saved is None:
    logging.warning('The checkpoint at step %d in %s has no checksums '
                    '(saved by an older version): not verified.', step,
                    directory)
    return
  bad = checksums.mismatches(saved, checksums.fingerprint(state))
  if bad:
    raise DamagedCheckpoint(
        step, f'checksum mismatch in {len(bad)} array(s), e.g. '
        f'state{bad[0]}')
