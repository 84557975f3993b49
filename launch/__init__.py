"""absl entry points: `python -m launch.<job> --config=... --workdir=...`."""

import os
import signal
import sys


def _interrupt(signum, frame) -> None:
  """Ctrl-C inside an import (jax, flax and TensorFlow take seconds to
  import, before any job has its own handlers): one line and exit 130
  instead of a KeyboardInterrupt traceback of 30 to 70 lines through the
  import machinery. Elsewhere, Python's own KeyboardInterrupt."""
  while frame is not None:
    if frame.f_code.co_filename.startswith('<frozen importlib'):
      sys.stderr.write(f'stopped by {signal.Signals(signum).name} outside '
                       'the run (starting up); nothing was written. Run the '
                       'same command again.\n')
      sys.stderr.flush()
      os._exit(128 + signum)  # pylint: disable=protected-access
    frame = frame.f_back
  raise KeyboardInterrupt


# Only for `python -m launch.<job>` (Python names the argument '-m' while it
# imports the module's package): importing launch elsewhere (tests, other
# programs) leaves their SIGINT alone.
if sys.argv[:1] == ['-m']:
  signal.signal(signal.SIGINT, _interrupt)
