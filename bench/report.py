"""Writing a benchmark's section of BENCHMARKS.md (between its markers)."""

import os

from train import fileio

BENCHMARKS_MD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    'BENCHMARKS.md')


def write_section(name: str, body: str, path: str = BENCHMARKS_MD) -> None:
  """Replaces section `name` of BENCHMARKS.md (or appends it), atomically.

  Text outside the markers (notes written by hand) is kept.
  """
  begin, end = f'<!-- {name}:begin -->', f'<!-- {name}:end -->'
  text = open(path).read() if os.path.exists(path) else '# Benchmarks\n'
  block = f'{begin}\n{body.strip()}\n{end}'
  if begin in text:
    head, rest = text.split(begin, 1)
    text = head + block + rest.split(end, 1)[1]
  else:
    text = text.rstrip('\n') + '\n\n' + block + '\n'
  fileio.write_text_atomic(path, text)


def publish(name: str, lines: list[str], write: bool) -> None:
  """Prints a benchmark's section and, if `write`, puts it in BENCHMARKS.md."""
  body = '\n'.join(lines)
  print(body)
  if write:
    write_section(name, body)
