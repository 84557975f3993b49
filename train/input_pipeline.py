"""Deterministic, resumable batching with per-host slicing and device prefetch.

Batch k of a run is a pure function of (seed, k): epoch e = k // steps_per_epoch
is a permutation drawn from `np.random.default_rng([seed, e])`, and batch k
takes its slice. Resuming at step k therefore needs no iterator state in the
checkpoint: the step number is the data position. Each process takes its own
contiguous rows of every global batch (`process_index` of `process_count`),
and `jax.make_array_from_process_local_data` assembles the global array.
"""

from collections.abc import Iterator
import queue
import threading
from typing import Any

import jax
import numpy as np

from train.datasets import ArraySplit

Batch = dict[str, np.ndarray]


class TrainBatches:
  """Shuffled, drop-remainder training batches addressed by step number."""

  def __init__(self, data: ArraySplit, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f'global batch {global_batch_size} is not divisible by '
                       f'{process_count} processes')
    if global_batch_size > len(data):
      raise ValueError(f'global batch {global_batch_size} exceeds the '
                       f'{len(data)} training examples')
    self.data = data
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.steps_per_epoch = len(data) // global_batch_size
    local = global_batch_size // process_count
    self._rows = slice(process_index * local, (process_index + 1) * local)
    self._epoch = -1
    self._perm = None

  def global_indices(self, step: int) -> np.ndarray:
    """Example indices of the whole (all-process) batch at `step`."""
    epoch, k = divmod(step, self.steps_per_epoch)
    if epoch != self._epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(
          len(self.data))
      self._epoch = epoch
    b = self.global_batch_size
    return self._perm[k * b:(k + 1) * b]

  def local_batch(self, step: int) -> Batch:
    idx = self.global_indices(step)[self._rows]
    return {'image': self.data.images[idx], 'label': self.data.labels[idx]}

  def iterate(self, start_step: int, stop_step: int) -> Iterator[Batch]:
    for step in range(start_step, stop_step):
      yield self.local_batch(step)


def eval_batches(data: ArraySplit, global_batch_size: int,
                 process_index: int = 0,
                 process_count: int = 1) -> Iterator[Batch]:
  """Every example once, in order, in fixed-size batches padded with mask=0."""
  local = global_batch_size // process_count
  rows = slice(process_index * local, (process_index + 1) * local)
  n = len(data)
  for start in range(0, n, global_batch_size):
    idx = np.arange(start, start + global_batch_size)
    mask = idx < n
    idx = np.where(mask, idx, 0)[rows]
    yield {'image': data.images[idx], 'label': data.labels[idx],
           'mask': mask[rows].astype(np.float32)}


def to_global(batch: Batch, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """Assembles each process's rows into arrays sharded as `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v)
          for k, v in batch.items()}


def prefetch_to_device(batches: Iterator[Batch], sharding: jax.sharding.Sharding,
                       size: int = 2) -> Iterator[dict[str, jax.Array]]:
  """Moves batches to the devices `size` steps ahead, in a background thread.

  Host-side gathering and the host-to-device copy then overlap with the
  previous step's compute, which is what keeps the trainer within a few
  percent of a loop over a batch already on device.
  """
  q: queue.Queue[Any] = queue.Queue(maxsize=size)
  done = object()
  stop = threading.Event()

  def produce():
    try:
      for batch in batches:
        if stop.is_set():
          return
        q.put(to_global(batch, sharding))
      q.put(done)
    except BaseException as e:  # Surface producer errors in the consumer.
      q.put(e)

  thread = threading.Thread(target=produce, daemon=True)
  thread.start()
  try:
    while True:
      item = q.get()
      if item is done:
        return
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    # Unblock a producer waiting on a full queue so the thread can exit.
    while thread.is_alive():
      try:
        q.get_nowait()
      except queue.Empty:
        thread.join(timeout=0.01)
