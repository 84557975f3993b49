"""One process of tests/test_rl_transport.py's loopback jobs (run with -m).

The last process plays the learner: it sends `versions` weight versions to
every other process (each array filled with its version), while each other
process sends `batches` batches back from two threads at once (filled with
1000 * process + batch). Every receiver checks each array against the
stamp its entry carries, and prints one JSON line of what it received.
`--stall_entry=N` makes the learner hold back its call for entry N (a
sender that never sends). `--unpulled`: at the end, the learner stops its
transport and then posts one more entry for process 0, which waits for it
in vain while both end, by `multihost.exit_job` as `launch.rl` ends them,
or by the interpreter's teardown (`--end=teardown`, which hangs there).
"""

import argparse
import json
import os
import sys
import threading
import time

import jax

parser = argparse.ArgumentParser()
parser.add_argument('--process', type=int, required=True)
parser.add_argument('--num_processes', type=int, required=True)
parser.add_argument('--port', type=int, required=True)
parser.add_argument('--transfer_port', type=int, required=True)
parser.add_argument('--versions', type=int, default=4)
parser.add_argument('--batches', type=int, default=3)
parser.add_argument('--timeout', type=float, default=60)
parser.add_argument('--stall_entry', type=int, default=-1)
parser.add_argument('--unpulled', action='store_true')
parser.add_argument('--end', choices=('exit_job', 'teardown'),
                    default='exit_job')
args = parser.parse_args()

jax.config.update('jax_num_cpu_devices', 2)
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.config.update('jax_cross_host_transfer_socket_address',
                  f'127.0.0.1:{args.transfer_port + args.process}')
jax.distributed.initialize(f'127.0.0.1:{args.port}',
                           num_processes=args.num_processes,
                           process_id=args.process,
                           heartbeat_timeout_seconds=30)

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from train.jobs import multihost
from train.rl import control
from train.rl import transport
# pylint: enable=g-import-not-at-top,wrong-import-position

me, learner = args.process, args.num_processes - 1
rollouts = list(range(learner))
channel = control.Channel(control.client(), 'test', timeout=args.timeout)


class _Stalling(transport.DevicePutTransport):

  def _call(self, n, entry):
    if n == args.stall_entry and entry['src'] == me:
      time.sleep(3600)
    super()._call(n, entry)


got, bad = [], []
done = threading.Event()
expected = (args.versions if me != learner
            else args.batches * 2 * len(rollouts))


def receive(kind, meta, src, arrays):
  stamp = meta['stamp']
  host = [np.asarray(a) for a in arrays]
  if not all(np.all(h == stamp) for h in host):
    bad.append([kind, stamp, src, [float(h.flat[0]) for h in host]])
  got.append([kind, stamp, src])
  if len(got) == expected:
    done.set()


xport = _Stalling(channel, me, timeout=3 if args.stall_entry >= 0 else 60)
jax.devices()  # Every process starts its backend (the topology exchange).
xport.start(receive)


def send_batches(thread):
  for b in range(args.batches):
    stamp = 1000 * me + 10 * thread + b
    xport.send('batch', {'stamp': stamp},
               [np.full((8, 16), stamp, np.int32),
                np.full((8,), stamp, np.float32)], learner)


if me == learner:
  for v in range(args.versions):
    for p in rollouts:
      xport.send('weights', {'stamp': v},
                 [jax.numpy.full((64, 64), v, jax.numpy.float32),
                  np.full((3,), v, np.int32)], p)
else:
  threads = [threading.Thread(target=send_batches, args=(t,))
             for t in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()

try:
  deadline = time.monotonic() + 120
  while not done.wait(0.1):
    xport.check()
    if time.monotonic() > deadline:
      raise RuntimeError(f'received {len(got)} of {expected}')
  # The senders' arrays are let go once acknowledged.
  channel.set(f'finished/{me}', 1)
  for p in range(args.num_processes):
    channel.get(f'finished/{p}', timeout=120)
except transport.TransferTimeout as e:
  print(json.dumps({'error': str(e)}), flush=True)
  sys.stdout.flush()
  os._exit(1)  # pylint: disable=protected-access
# Every process walked every entry and every ack was seen: the store
# keeps no transfer's keys (the counter aside).
deadline = time.monotonic() + 30
while (left := [k for k in channel.keys('xfer/') if k != 'xfer/seq']
       ) and time.monotonic() < deadline:
  time.sleep(0.05)
print(json.dumps({'process': me, 'received': sorted(got), 'bad': bad,
                  'sent': xport.sent, 'keys_left': left}), flush=True)
if not args.unpulled:
  xport.stop()
else:
  channel.set(f'reported/{me}', 1)
  for p in range(args.num_processes):
    channel.get(f'reported/{p}', timeout=120)
  if me == learner:
    # One more version for process 0, from a sender whose transport has
    # stopped: process 0 waits for it, and it never comes.
    xport.stop()
    xport.send('weights', {'stamp': -1},
               [jax.numpy.full((64, 64), -1, jax.numpy.float32)], 0)
  else:
    while not [k for k in channel.keys('xfer/') if k != 'xfer/seq']:
      time.sleep(0.01)
    time.sleep(1)  # Its transport's thread is in the call, waiting.
    # Stopped as launch.rl's processes stop theirs before they end; then,
    # past the shutdown barrier, the learner ends and cuts that transfer.
    xport.stop()
    if args.end == 'exit_job':
      jax.distributed.shutdown()
      time.sleep(1)
      print(json.dumps({'failure': None if xport._failure is None  # pylint: disable=protected-access
                        else str(xport._failure)}), flush=True)  # pylint: disable=protected-access
# The job's end, as `launch.rl` ends it (`multihost.exit_job`), or the
# interpreter's own teardown (`--end=teardown`).
sys.stderr.flush()
if args.end == 'teardown':
  sys.exit(0)
multihost.exit_job(0)
