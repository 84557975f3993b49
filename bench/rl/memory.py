r"""Where an RL run's resident memory goes: `launch.rl` in this process,
sampled by a thread.

  python -m bench.rl.memory --config=configs/rl.py:gemma,runlocal \
    --config.sft_workdir=workdirs/gemma_sft --workdir=/tmp/gemma_rl

Takes launch.rl's flags unchanged. Every 20 ms the thread reads the
process's anonymous resident memory (RssAnon: what the OOM killer counts;
file pages of the mapped libraries are left out) and the innermost frame
of the main thread that lies in train/ (what it was doing); at every new
peak it also adds up `jax.live_arrays()`. At the end it prints the phases
in order (consecutive samples in the same function), each with the most
anonymous memory it reached and the live arrays at its peak, then the
peak overall and the kernel's ru_maxrss. One run answers where the memory
went; the numbers of two runs compare only on the same machine.
"""

import collections
import os
import resource
import runpy
import sys
import threading
import time

import jax
from jax._src import xla_bridge

_PERIOD = 0.02
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_TRAIN = os.path.join(_ROOT, 'train') + os.sep


def _anonymous_bytes() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('RssAnon:'):
        return int(line.split()[1]) * 1024
  return 0


def _where(main_id: int) -> str:
  """The main thread's innermost frame in train/ (file:function)."""
  frame = sys._current_frames().get(main_id)  # pylint: disable=protected-access
  while frame is not None:
    path = frame.f_code.co_filename
    if path.startswith(_TRAIN):
      return f'{os.path.relpath(path, _ROOT)}:{frame.f_code.co_name}'
    frame = frame.f_back
  return '(outside train/)'


def _live_bytes() -> int:
  # Asking before the launcher set the device count would start JAX's
  # backends too early.
  if not xla_bridge._backends:  # pylint: disable=protected-access
    return -1
  try:
    return sum(a.nbytes for a in jax.live_arrays())
  except Exception:  # pylint: disable=broad-except
    return -1  # An array deleted while summed.


class Sampler(threading.Thread):
  """Samples until `stop`; `phases` lists (where, peak bytes, live bytes
  at that peak, seconds)."""

  def __init__(self):
    super().__init__(daemon=True)
    self._main = threading.main_thread().ident
    self._halt = threading.Event()
    self.phases: list[list] = []
    self.peak = 0
    self.peak_where = ''

  def run(self) -> None:
    start = time.perf_counter()
    while not self._halt.wait(_PERIOD):
      rss, where = _anonymous_bytes(), _where(self._main)
      now = time.perf_counter() - start
      if not self.phases or self.phases[-1][0] != where:
        self.phases.append([where, rss, None, now, now])
      phase = self.phases[-1]
      phase[4] = now
      if rss > phase[1] or phase[2] is None:
        phase[1] = max(rss, phase[1])
        if rss >= self.peak * 0.98:
          phase[2] = _live_bytes()
      if rss > self.peak:
        self.peak, self.peak_where = rss, where

  def stop(self) -> None:
    self._halt.set()
    self.join()

  def report(self) -> str:
    # Merge the short repeats (a loop alternating two functions) by name,
    # keeping the first appearance's order.
    merged = collections.OrderedDict()
    for where, peak, live, begin, end in self.phases:
      m = merged.setdefault(where, [0, -1, 0.0, begin])
      if peak > m[0]:
        m[0], m[1] = peak, live if live is not None else -1
      m[2] += end - begin
    gib = 2.0 ** 30
    lines = ['| phase (main thread in) | peak anonymous RSS (GiB) | live '
             'jax arrays at it (GiB) | seconds |', '|---|---|---|---|']
    for where, (peak, live, seconds, _) in merged.items():
      lines.append(f'| {where} | {peak / gib:.2f} | '
                   f'{live / gib if live >= 0 else float("nan"):.2f} | '
                   f'{seconds:.1f} |')
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lines.append(f'peak anonymous RSS {self.peak / gib:.2f} GiB in '
                 f'{self.peak_where}; ru_maxrss {maxrss / gib:.2f} GiB')
    return '\n'.join(lines)


def main() -> None:
  sampler = Sampler()
  sampler.start()
  sys.argv = ['launch.rl'] + sys.argv[1:]
  try:
    runpy.run_module('launch.rl', run_name='__main__', alter_sys=True)
  finally:
    sampler.stop()
    print(sampler.report(), flush=True)


if __name__ == '__main__':
  main()
