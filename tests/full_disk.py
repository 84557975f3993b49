"""A full disk at a chosen write of a run's metrics log, in this process."""

import errno

import pytest

from train.run import metrics as metrics_lib


def on_metrics_write(monkeypatch: pytest.MonkeyPatch, log: str, n: int
                     ) -> None:
  """The `n`-th `MetricWriter.write` from now raises ENOSPC naming `log`,
  as a write to a full disk does."""
  real, calls = metrics_lib.MetricWriter.write, []

  def write(self, step, scalars):
    calls.append(step)
    if len(calls) == n:
      raise OSError(errno.ENOSPC, 'No space left on device', log)
    return real(self, step, scalars)

  monkeypatch.setattr(metrics_lib.MetricWriter, 'write', write)
