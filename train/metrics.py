"""Run metrics: `metrics.jsonl`, TensorBoard event files and a console progress line.

`metrics.jsonl` holds one JSON object per line, `{"step": int, name: float, ...}`.
On resume from a checkpoint at step s, lines with step > s (written after
that checkpoint by the interrupted run) are dropped atomically and
TensorBoard is told to purge them, so the log of a resumed run is the log
of an uninterrupted one. Only process 0 writes. In a bucket (gs://), where
objects cannot be appended to, the whole (small) file is rewritten at each
logging step.
"""

from collections.abc import Mapping, Sequence
import datetime
import json
import math
import time

from absl import logging
import jax

from train import fileio


def read_jsonl(path: str) -> list[dict[str, float]]:
  if not fileio.exists(path):
    return []
  return [json.loads(line) for line in fileio.read_text(path).splitlines()
          if line.strip()]


def read_json(path: str) -> dict:
  return json.loads(fileio.read_text(path))


write_text_atomic = fileio.write_text_atomic


def write_json_atomic(path: str, obj: object) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + '\n')


class MetricWriter:
  """Writes scalars to JSONL and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str, resume_step: int | None):
    self.enabled = jax.process_index() == 0
    self.path = fileio.join(workdir, 'metrics.jsonl')
    self._tb = None
    if not self.enabled:
      return
    if resume_step is None:
      kept = []
    else:
      kept = [r for r in read_jsonl(self.path) if r['step'] <= resume_step]
    self._lines = [json.dumps(r) + '\n' for r in kept]
    write_text_atomic(self.path, ''.join(self._lines))
    self._file = (None if fileio.is_remote(self.path)
                  else open(self.path, 'a'))
    # Imported here: only process 0 needs it.
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(
        fileio.join(workdir, 'tensorboard'),
        purge_step=None if resume_step is None else resume_step + 1)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {'step': int(step)}
    record.update({k: float(v) for k, v in scalars.items()})
    line = json.dumps(record) + '\n'
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
