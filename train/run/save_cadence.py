"""Which steps of a run end with a save, and the stop that ends it early.

A step ends with a save at the config's cadence (`checkpoint_every`), at
the run's last step, and when a stop was requested: SIGTERM or SIGINT in
one process, JAX's preemption sync point in several, or a stop another
process of the job received (`request_stop`). The run then saves at that
step and raises `Preempted` (`train.run.resumable.Run.end_step`).
"""

from collections.abc import Callable
import contextlib

from train.errors import Preempted
from train.run import preemption


class SaveCadence:
  """The save and stop decisions of one run's steps.

  `due(step, total)` is asked first for each step; `forced` and
  `stops_after` answer for the step it was last asked about.
  """

  def __init__(self, should_save: Callable[[int], bool]):
    """`should_save(step)`: the checkpoints' cadence."""
    self._should_save = should_save
    self._flag = preemption.StopFlag()
    self._asked: int | None = None  # The step `_stopping` answers for.
    self._stopping = False

  def request_stop(self, signal_name: str) -> None:
    """As if SIGTERM or SIGINT (`signal_name`) had arrived here."""
    self._flag.request(signal_name)

  def installed(self) -> contextlib.AbstractContextManager[None]:
    """Inside the block, SIGTERM and SIGINT request a stop at the end of
    the current step."""
    return self._flag.installed()

  def due(self, step: int, total: int | None) -> bool:
    """Whether `step` ends with a save: the cadence, the last step, or a
    stop request (asked once per step, and alike on every process)."""
    if self._asked != step:
      self._asked, self._stopping = step, self._flag.requested(step)
    return self._stopping or step == total or self._should_save(step)

  def forced(self, step: int, total: int | None) -> bool:
    """Whether the save at `step` is off the cadence (a stop, the end)."""
    return self._stopping or step == total

  def stops_after(self, step: int, total: int | None) -> bool:
    """Whether the run stops after `step`, before its last one."""
    return self._stopping and step != total

  def preempted(self, step: int) -> Preempted:
    """The error that ends the run after its save at `step`."""
    return Preempted(step, self._flag.signal_name)
