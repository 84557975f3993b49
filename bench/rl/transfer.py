r"""What a weight version costs to cross processes (`train.rl.transport`).

  python -m bench.rl.transfer            # writes its BENCHMARKS.md section

and the line fitted to its medians (`bench.rl.pod_simulation.Transfer`:
latency + MB / bandwidth) to `--fit_to`, which `bench.rl.simulator
--transfer_json` prices multi-process runs with.

Starts a 2-process loopback JAX job (jax.distributed on 127.0.0.1, 2 CPU
devices each). Process 1 (the learner's side) sends `--repeats` versions
of a tree of float32 arrays of each size to process 0 through
`DevicePutTransport`, one at a time; the time of one is from `send` to the
receiver's word that it has the arrays (set where its acknowledgement
is), polled here every millisecond (the receiver's transport thread finds
a new log entry within its 10 ms poll, so that is part of it). The baseline, in the same
process and on the same arrays: `jax.device_put` from one local device to
another, which is what the one-process runtime does to publish a version.
Medians over the repeats; the sender's own time in `send` (what the
learner waits) is reported beside them.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

SECTION = 'rl_transfer'
_SIZES = flags.DEFINE_list('sizes_mb', ['1', '16', '64'],
                           'Tree sizes (MB of float32, in 8 arrays).')
_REPEATS = flags.DEFINE_integer('repeats', 9, 'Versions sent per size.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md and '
                           '--fit_to.')
_FIT_TO = flags.DEFINE_string(
    'fit_to', 'studies/gas/results/rl_transfer.json',
    'Where the fitted transfer cost goes.')
_ROLE = flags.DEFINE_integer('process', None, 'Internal: this process.')
_PORTS = flags.DEFINE_list('ports', None, 'Internal: coordinator, 2 servers.')


def _peer() -> None:
  # pylint: disable=g-import-not-at-top
  import jax
  me = _ROLE.value
  ports = [int(p) for p in _PORTS.value]
  jax.config.update('jax_num_cpu_devices', 2)
  jax.config.update('jax_cpu_collectives_implementation', None)
  jax.config.update('jax_cross_host_transfer_socket_address',
                    f'127.0.0.1:{ports[1 + me]}')
  jax.distributed.initialize(f'127.0.0.1:{ports[0]}', num_processes=2,
                             process_id=me)
  import numpy as np
  from train.rl import control
  from train.rl import transport
  # pylint: enable=g-import-not-at-top
  ch = control.Channel(control.client(), 'bench', timeout=300)
  xport = transport.DevicePutTransport(ch, me, timeout=300)
  jax.devices()
  got = []
  def receive(kind, meta, src, arrays):
    del kind, src, arrays
    got.append(meta)
    ch.set(f'got/{meta["n"]}', 1)  # The sender deletes the ack it sees.

  xport.start(receive)
  rows = []
  n = 0
  for mb in (int(s) for s in _SIZES.value):
    leaf = mb * 2**20 // 4 // 8
    for r in range(_REPEATS.value + 1):  # The first warms the connection.
      if me == 1:
        local = jax.local_devices()
        arrays = [jax.device_put(np.full((leaf,), r, np.float32), local[0])
                  for _ in range(8)]
        jax.block_until_ready(arrays)
        begin = time.perf_counter()
        xport.send('weights', {'n': n}, arrays, 0)
        sent = time.perf_counter() - begin
        while ch.try_get(f'got/{n}') is None:
          time.sleep(0.001)
        total = time.perf_counter() - begin
        begin = time.perf_counter()
        jax.block_until_ready(jax.device_put(arrays, local[1]))
        local_copy = time.perf_counter() - begin
        if r:
          rows.append([mb, total, sent, local_copy])
      else:
        while len(got) <= n:
          xport.check()
          time.sleep(0.001)
      n += 1
  ch.set(f'finished/{me}', 1)
  ch.get(f'finished/{1 - me}')
  if me == 1:
    print(json.dumps(rows), flush=True)
  xport.stop()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def main(argv):
  del argv
  if _ROLE.value is not None:
    _peer()
    return
  # pylint: disable=g-import-not-at-top
  from bench import report
  from train.analysis import stats
  from bench.rl import pod_simulation as simulator
  # pylint: enable=g-import-not-at-top
  ports = ','.join(str(_free_port()) for _ in range(3))
  env = dict(os.environ, XLA_FLAGS='')
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'bench.rl.transfer', f'--process={i}',
       f'--ports={ports}', f'--sizes_mb={",".join(_SIZES.value)}',
       f'--repeats={_REPEATS.value}'], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(err[-3000:])
  rows = json.loads(outs[1][0].strip().splitlines()[-1])
  table, medians = [], []
  for mb in (int(s) for s in _SIZES.value):
    mine = [r for r in rows if r[0] == mb]
    total = statistics.median(r[1] for r in mine)
    sent = statistics.median(r[2] for r in mine)
    local = statistics.median(r[3] for r in mine)
    medians.append((mb, total))
    low, high = (1e3 * f(r[1] for r in mine) for f in (min, max))
    spread = f'{low:.0f}-{high:.0f}'
    table.append([mb, f'{1e3 * total:.1f}', spread, f'{1e3 * sent:.2f}',
                  f'{1e3 * local:.1f}', f'{total / local:.1f}x',
                  f'{mb / 2**10 / total:.2f}'])
  lines = [
      '## Weights across processes (`python -m bench.rl.transfer`)', '',
      'One version of a tree of 8 float32 arrays, learner process -> '
      'rollout process, through `train.rl.transport.DevicePutTransport` '
      '(cross-process `jax.device_put`, the CPU transfer server on '
      'loopback), against `jax.device_put` between two devices of one '
      'process (the one-process runtime\'s publish), in the same run. '
      f'Medians of {_REPEATS.value}; 2 CPU devices per process, this '
      '2-core machine, whose cores both processes share, so the large '
      'sizes vary between runs (see the range). The learner does not '
      'wait for the acknowledgement: it waits only the `send` column; '
      'the rollout process sees a new version after send-to-ack.', '',
      stats.markdown_table(
          ['MB', 'send to ack (ms)', 'range (ms)', 'sender waits (ms)',
           'in-process copy (ms)', 'ratio', 'GB/s'], table)]
  fit = simulator.Transfer.fit(
      *zip(*medians), source=f'bench.rl.transfer, medians of '
      f'{_REPEATS.value} at {",".join(_SIZES.value)} MB, loopback CPU')
  lines += ['', f'Fitted line (send to ack): {1e3 * fit.latency_seconds:.1f}'
            f' ms + MB x {1e3 * fit.seconds_per_mb:.2f} ms '
            f'({1 / 2**10 / max(fit.seconds_per_mb, 1e-12):.2f} GB/s), '
            f'in `{_FIT_TO.value}` for `bench.rl.simulator`.']
  report.publish(SECTION, lines, _WRITE.value)
  if _WRITE.value:
    fit.to_json(_FIT_TO.value)


if __name__ == '__main__':
  app.run(main)
