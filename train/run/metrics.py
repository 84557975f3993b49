"""Run metrics: `metrics.jsonl`, TensorBoard event files and a console progress line.

`metrics.jsonl` holds one JSON object per line, `{"step": int, name: float, ...}`
(a non-finite value is null: strict JSON).
On resume from a checkpoint at step s, lines with step > s (written after
that checkpoint by the interrupted run) are dropped atomically and
TensorBoard is told to purge them, so the log of a resumed run is the log
of an uninterrupted one; a line torn by a crash is dropped then too. Only
process 0 writes. In a bucket (gs://), where
objects cannot be appended to, the whole (small) file is rewritten at each
logging step.
"""

from collections.abc import Mapping, Sequence
import datetime
import json
import math
import time

from absl import logging

from train import fileio
from train.run import process_group


def _finite_or_none(value: object) -> object:
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite_or_none(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite_or_none(v) for v in value]
  return value


def dumps(obj: object, **kw) -> str:
  """Strict JSON: non-finite floats (a skipped step's NaN loss) become null."""
  return json.dumps(_finite_or_none(obj), allow_nan=False, **kw)


def parse_jsonl(data: str | bytes) -> tuple[list[dict], int]:
  """The complete records of a JSONL text, and how many lines were not.

  A crash mid-write leaves a torn last line, or on some file systems a
  tail of NUL bytes; neither parses as a record, and both are dropped. So
  is a line of bytes that are not UTF-8 (a damaged disk block).
  """
  records, dropped = [], 0
  for line in data.splitlines():
    if not line.strip():
      continue
    try:
      record = json.loads(line)  # Bytes are decoded as UTF-8, strictly.
    except ValueError:  # UnicodeDecodeError is one.
      record = None
    if isinstance(record, dict) and isinstance(record.get('step'), int):
      records.append(record)
    else:
      dropped += 1
  return records, dropped


def read_jsonl(path: str, root: str | None = None) -> list[dict[str, float]]:
  """The complete records of `path` ([] if it does not exist); non-finite
  values are None. `root`: the workdir `path` must lie in
  (`fileio.check_local`)."""
  if not fileio.exists(path):
    return []
  records, dropped = parse_jsonl(fileio.read_bytes(path, root))
  if dropped:
    logging.warning('%s: %d damaged line(s) ignored (a crash mid-write)',
                    path, dropped)
  return records


def read_json(path: str, root: str | None = None) -> dict:
  """A JSON object from `path`; ValueError if it is not one. `root`: the
  workdir `path` must lie in (`fileio.check_local`)."""
  value = json.loads(fileio.read_text(path, root))
  if not isinstance(value, dict):
    raise ValueError(f'{path} holds {type(value).__name__}, not an object')
  return value


write_text_atomic = fileio.write_text_atomic


def write_json_atomic(path: str, obj: object) -> None:
  write_text_atomic(path, dumps(obj, indent=2, sort_keys=True) + '\n')


class MetricWriter:
  """Writes scalars to JSONL and TensorBoard (process 0 only).

  `records` counts the records in the file; a checkpoint saves it, so that
  a resume keeps exactly the records written before that checkpoint (the
  final evaluation's, logged at the last checkpoint's step but after it,
  included among those dropped).
  """

  def __init__(self, workdir: str, resume_step: int | None,
               keep_records: int | None = None):
    """Opens `workdir/metrics.jsonl`.

    Args:
      workdir: the run's workdir.
      resume_step: the checkpoint the run resumes from (None: a new run).
      keep_records: how many records that checkpoint saw; None (a
        checkpoint of an older version) keeps those at steps <=
        `resume_step`.
    """
    self.enabled = process_group.is_writer()
    self.path = fileio.join(workdir, 'metrics.jsonl')
    self._tb = None
    self.records = 0
    if not self.enabled:
      return
    if resume_step is None:
      kept = []
    else:
      kept = [r for r in read_jsonl(self.path, workdir)
              if r['step'] <= resume_step]
      if keep_records is not None:
        kept = kept[:keep_records]
    self.records = len(kept)
    # Rewritten whole (atomically): a torn tail of the crashed run goes.
    self._lines = [dumps(r) + '\n' for r in kept]
    write_text_atomic(self.path, ''.join(self._lines))
    self._file = (None if fileio.is_remote(self.path)
                  else fileio.open_local(self.path, 'a', root=workdir))
    # Imported here: only process 0 needs it.
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(
        fileio.join(workdir, 'tensorboard'),
        purge_step=None if resume_step is None else resume_step + 1)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    self.records += 1
    record = {'step': int(step)}
    record.update({k: float(v) for k, v in scalars.items()})
    line = dumps(record) + '\n'
    if self._file is None:
      self._lines.append(line)
      write_text_atomic(self.path, ''.join(self._lines))
    else:
      self._file.write(line)
      self._file.flush()
    for name, value in scalars.items():
      self._tb.add_scalar(name, float(value), global_step=int(step))

  def flush(self) -> None:
    if self.enabled:
      if self._file is not None:
        self._file.flush()
      self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      if self._file is not None:
        self._file.close()
      self._tb.close()


class Progress:
  """Steps/s over the last interval and ETA, for the console."""

  def __init__(self, start_step: int, total_steps: int):
    self.total = total_steps
    self._step = start_step
    self._time = time.perf_counter()

  def update(self, step: int) -> tuple[float, str]:
    """Returns (steps per second since the last update, ETA as H:MM:SS)."""
    now = time.perf_counter()
    rate = (step - self._step) / max(now - self._time, 1e-9)
    self._step, self._time = step, now
    remaining = (self.total - step) / rate if rate > 0 else math.inf
    eta = ('?' if not math.isfinite(remaining)
           else str(datetime.timedelta(seconds=int(remaining))))
    return rate, eta


def log_progress(step: int, total: int, scalars: Mapping[str, float],
                 rate: float, eta: str, console: Sequence[str] = ()) -> None:
  """The console line: scalars without a '/' in their name, and `console`
  (a method's chosen diagnostics, e.g. 'opt/grad_ratio_ema'); every scalar
  goes to the files."""
  shown = ' | '.join(f'{k} {v:.4g}' for k, v in scalars.items()
                     if '/' not in k or k in console)
  logging.info('step %d/%d | %s | %.1f steps/s | ETA %s', step, total, shown,
               rate, eta)
