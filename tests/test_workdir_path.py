"""Following `workdir` from a launcher's job goes down into the run core
and never climbs back up.

A trace function records, in call order, every function that receives the
run's workdir as an argument (a "stop"), and ranks its module by layer:
launch 5, train.jobs 4, a product (train.rl, train.vision, ...) 3, the
training/compilation/analysis core 2, the run core (train.run) 1. The
path may only go down: no stop in a higher layer than the one before it
(train.errors and train.fileio, leaves every layer calls, are left out).
So the product hands its workdir to one entry of the core, which does the
checks, the checkpoint back-end, the lock, the stop protocol and resume
itself (before issue 50 the RL path went down to the training core's
workdir check, back up to the RL module's checkpoint-format choice, then
down to the run core).
"""

import sys
import threading

import pytest

from configs import digits
from configs import rl as rl_config
from train.rl import run as rl_run
from train.vision import trainer as vision_trainer

_RANKS = (('launch', 5), ('train.jobs', 4), ('train.run', 1),
          ('train.training', 2), ('train.compilation', 2),
          ('train.analysis', 2), ('train.errors', None),
          ('train.fileio', None), ('train.', 3))


def _rank(module: str) -> int | None:
  for prefix, rank in _RANKS:
    if module == prefix or module.startswith(prefix + '.') or (
        prefix.endswith('.') and module.startswith(prefix)):
      return rank
  return None  # Not ours (jax, orbax, the standard library).


_CO_GENERATOR_LIKE = 0x20 | 0x80 | 0x200  # generator, coroutine, async gen


def stops_of(job, workdir: str) -> list[tuple[str, str, int]]:
  """(module, function, rank) of each call that is given `workdir`."""
  # Frames held, not only their ids: a dead frame's id could be reused.
  stops, seen = [], {}

  def trace(frame, event, arg):
    del event, arg  # A global trace function sees only 'call' events.
    code = frame.f_code
    module = frame.f_globals.get('__name__', '')
    if not module.startswith(('train.', 'launch.')):
      return None
    if code.co_filename == '<string>':
      return None  # A generated dataclass __init__: it only stores it.
    if code.co_flags & _CO_GENERATOR_LIKE:
      # A generator (a context manager's body) is "called" again at each
      # resume: one stop, at its start.
      if id(frame) in seen:
        return None
      seen[id(frame)] = frame
    n = code.co_argcount + code.co_kwonlyargcount
    if not any(isinstance(value, str) and value == workdir
               for value in (frame.f_locals.get(name)
                             for name in code.co_varnames[:n])):
      return None
    rank = _rank(module)
    if rank is not None:
      stops.append((module, code.co_qualname, rank))
    return None  # No line events: only calls are followed.

  # settrace, not setprofile: no events for C calls, which jax makes by
  # the million while it traces.
  sys.settrace(trace)
  threading.settrace(trace)
  try:
    job()
  finally:
    sys.settrace(None)
    threading.settrace(None)
  return stops


def climbs(stops) -> list[str]:
  """Each stop in a higher layer than the stop before it."""
  return [f'{module}.{name}' for (module, name, rank), (_, _, before)
          in zip(stops[1:], stops) if rank > before]


def test_the_counter_finds_a_climb_back_up():
  assert climbs([('train.rl.run', 'f', 3), ('train.training.e', 'c', 2),
                 ('train.run.a', 'g', 1), ('train.run.b', 'h', 1)]) == []
  assert climbs([('train.rl.run', 'f', 3), ('train.training.e', 'c', 2),
                 ('train.rl.run', 'check', 3),
                 ('train.run.b', 'h', 1)]) == ['train.rl.run.check']


def _show(stops):
  return '\n'.join(f'{r} {m}.{n}' for m, n, r in stops)


def test_the_rl_path_goes_down_once(tmp_path, sft_policy_run):
  config = rl_config.get_config('runlocal')
  config.sft_workdir = sft_policy_run[0]
  config.num_versions = 2
  workdir = str(tmp_path / 'rl')
  stops = stops_of(lambda: rl_run.train_and_evaluate(config, workdir),
                   workdir)
  assert any(r == 1 for _, _, r in stops), _show(stops)
  assert not climbs(stops), _show(stops)


def test_the_trainer_path_goes_down_once(tmp_path):
  config = digits.get_config('runlocal')
  config.num_steps = 8
  workdir = str(tmp_path / 'digits')
  stops = stops_of(
      lambda: vision_trainer.train_and_evaluate(config, workdir), workdir)
  assert any(r == 1 for _, _, r in stops), _show(stops)
  assert not climbs(stops), _show(stops)
