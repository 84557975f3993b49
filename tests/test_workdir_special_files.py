"""Special files in a workdir.

A FIFO, a socket, a device or a symlink out of the workdir where a run
expects its own file is refused in one line before it is opened (a FIFO
blocked the resume of a run forever).
"""

import os
import shutil
import socket
import stat
import time

import pytest

from tests import launch_runs
from train.run import checkpointing
from train import errors
from train import fileio
from train.run import metrics
from train.run import workdir_lock

EXIT_USAGE = 2


def _fifo(path) -> str:
  os.mkfifo(path)
  return str(path)


# --- The open helper ---------------------------------------------------------

@pytest.mark.parametrize('mode', ['r', 'rb', 'a', 'wb', 'a+'])
def test_a_fifo_is_refused_without_blocking(tmp_path, mode):
  path = _fifo(tmp_path / 'metrics.jsonl')
  with pytest.raises(fileio.SpecialFile, match='FIFO') as e:
    fileio.open_local(path, mode, root=tmp_path)
  assert isinstance(e.value, errors.UsageError)
  assert str(e.value).startswith(f'{path} is a FIFO (named pipe)')


def test_a_socket_is_refused(tmp_path, monkeypatch):
  path = str(tmp_path / 'results.json')
  monkeypatch.chdir(tmp_path)  # A socket's path has at most 107 bytes.
  with socket.socket(socket.AF_UNIX) as server:
    server.bind('results.json')
    with pytest.raises(fileio.SpecialFile, match='is a socket'):
      fileio.read_text(path)
    with pytest.raises(fileio.SpecialFile, match='is a socket'):
      fileio.open_local(path, 'a')


def test_a_symlink_to_dev_zero_is_refused(tmp_path):
  link = tmp_path / 'metrics.jsonl'
  os.symlink('/dev/zero', link)
  # Inside the workdir it leads out of it; anywhere, it is a device.
  with pytest.raises(fileio.SpecialFile, match='outside'):
    metrics.read_jsonl(str(link), str(tmp_path))
  with pytest.raises(fileio.SpecialFile, match='a character device'):
    fileio.read_bytes(str(link))


def test_a_symlink_out_of_the_workdir_is_refused_and_one_inside_is_read(
    tmp_path):
  workdir, outside = tmp_path / 'run', tmp_path / 'elsewhere.json'
  workdir.mkdir()
  outside.write_text('{"step": 1}\n')
  os.symlink(outside, workdir / 'metrics.jsonl')
  with pytest.raises(fileio.SpecialFile, match='a symlink to .*elsewhere'):
    fileio.open_local(str(workdir / 'metrics.jsonl'), 'a', root=workdir)
  assert outside.read_text() == '{"step": 1}\n'
  (workdir / 'kept.json').write_text('{"step": 2}\n')
  os.symlink('kept.json', workdir / 'alias.json')
  assert fileio.read_text(str(workdir / 'alias.json'), workdir) == (
      '{"step": 2}\n')


def test_a_fifo_put_in_place_after_the_check_is_refused_too(tmp_path,
                                                            monkeypatch):
  path = str(tmp_path / 'metrics.jsonl')
  real = fileio.check_local

  def check_then_swap(p, root=None):
    out = real(p, root)
    _fifo(p)
    return out
  monkeypatch.setattr(fileio, 'check_local', check_then_swap)
  for mode in ('r', 'a'):
    with pytest.raises(fileio.SpecialFile):
      fileio.open_local(path, mode)
    os.remove(path)


def test_an_atomic_write_replaces_a_fifo(tmp_path):
  path = _fifo(tmp_path / 'study.md')
  fileio.write_text_atomic(path, 'table\n')
  assert stat.S_ISREG(os.lstat(path).st_mode)
  assert (tmp_path / 'study.md').read_text() == 'table\n'


def test_the_workdir_scan_finds_special_files_anywhere_in_it(tmp_path):
  workdir = tmp_path / 'run'
  (workdir / 'checkpoints' / '20').mkdir(parents=True)
  (workdir / 'metrics.jsonl').write_text('')
  os.symlink('checkpoints', workdir / 'ckpts')  # Inside: fine.
  fileio.check_tree(str(workdir))
  _fifo(workdir / 'checkpoints' / '20' / 'arrays.npz')
  with pytest.raises(fileio.SpecialFile, match='20/arrays.npz is a FIFO'):
    fileio.check_tree(str(workdir))
  os.remove(workdir / 'checkpoints' / '20' / 'arrays.npz')
  os.symlink(tmp_path, workdir / 'checkpoints' / 'up')
  with pytest.raises(fileio.SpecialFile, match='outside'):
    fileio.check_tree(str(workdir))
  fileio.check_tree(str(tmp_path / 'missing'))  # A new run's: nothing yet.


def test_holding_a_workdir_with_a_fifo_refuses_before_writing(tmp_path):
  _fifo(tmp_path / 'metrics.jsonl')
  with pytest.raises(fileio.SpecialFile, match='metrics.jsonl is a FIFO'):
    with workdir_lock.hold(str(tmp_path)):
      pass
  assert os.listdir(tmp_path) == ['metrics.jsonl']  # No lock file made.
  os.remove(tmp_path / 'metrics.jsonl')
  _fifo(tmp_path / workdir_lock.LOCK_FILE)
  with pytest.raises(fileio.SpecialFile, match='.lock is a FIFO'):
    workdir_lock.holder(str(tmp_path))


def test_another_runs_checkpoints_are_scanned_before_they_are_read(tmp_path):
  # A source model's workdir is read, not held: nothing else scans it.
  (tmp_path / 'checkpoints' / '20' / 'state').mkdir(parents=True)
  _fifo(tmp_path / 'checkpoints' / '20' / 'state' / 'manifest.ocdbt')
  with pytest.raises(fileio.SpecialFile, match='manifest.ocdbt is a FIFO'):
    checkpointing.Checkpoints(str(tmp_path), every_steps=1, keep=1,
                              read_only=True)


# --- A resumed run, as a user launches it ------------------------------------

def _resumable_copy(source, target) -> str:
  """`source` (a finished run) without its end: the next launch resumes."""
  shutil.copytree(source, target)
  os.remove(os.path.join(target, 'final_metrics.json'))
  os.remove(os.path.join(target, 'metrics.jsonl'))
  return str(target)


def _listing(root) -> dict:
  """Every entry's type, and a regular file's bytes (a FIFO's none)."""
  out = {}
  for directory, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(directory, name)
      mode = os.lstat(path).st_mode
      content = None
      if stat.S_ISLNK(mode):
        content = os.readlink(path)
      elif stat.S_ISREG(mode):
        with open(path, 'rb') as f:
          content = f.read()
      out[os.path.relpath(path, root)] = (stat.S_IFMT(mode), content)
  return out


# The symlink out of the workdir is slow (`make test-all`): the launcher's
# scan and its one line are the FIFO's path, and the symlink's own check is
# test_a_symlink_out_of_the_workdir_is_refused_and_one_inside_is_read.
@pytest.mark.parametrize('plant', [
    'fifo', pytest.param('symlink_out', marks=pytest.mark.slow)])
def test_a_resume_over_a_special_metrics_file_is_one_line_at_once(
    digits_runlocal_run, tmp_path, plant):
  workdir = _resumable_copy(digits_runlocal_run[0], tmp_path / 'run')
  target = os.path.join(workdir, 'metrics.jsonl')
  outside = tmp_path / 'notes.txt'
  outside.write_text('not the run\'s\n')
  if plant == 'fifo':
    _fifo(target)
  else:
    os.symlink(outside, target)
  before = _listing(workdir)
  start = time.monotonic()
  result, peak = launch_runs.run_measured(launch_runs.command(workdir),
                                          timeout=60)
  assert time.monotonic() - start < 30  # It blocked forever.
  assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1, result.stderr[-3000:]
  what = 'is a FIFO' if plant == 'fifo' else f'a symlink to {outside}'
  assert lines[0].startswith(f'error: {target}') and what in lines[0], lines
  assert _listing(workdir) == before  # Nothing written, the lock included.
  assert outside.read_text() == 'not the run\'s\n'
  assert peak < 2**30


# --- Seeds --------------------------------------------------------------------
