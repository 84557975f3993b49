"""Seeded random damage to the tests' small Gemma GGUF file: every mutated
file is loaded or refused with `DamagedModelFile` (one line), never another
exception, and reading it costs a bounded amount of memory."""

import dataclasses
import time
import tracemalloc

import numpy as np
import pytest

from train import errors
from train.lm import gemma_gguf
from tests import tiny_gemma

CASES = 320
SEED = 48
# Reading and decoding the 120 KB file peaks at about 6 MB; a declared size
# that is allocated before it is checked takes far more.
MEMORY_BOUND = 64 * 2**20

_U32, _I32, _U64, _I64, _F32, _BOOL = 4, 5, 10, 11, 6, 7
# Values a hostile or damaged file may give where a number is expected.
_HOSTILE = [(_U32, 0), (_U32, 1), (_U32, 3), (_U32, 2**32 - 1), (_I32, -1),
            (_I32, -2**31), (_U64, 2**63), (_U64, 2**64 - 1), (_U64, 10**9),
            (_I64, -2**63), (_F32, float('nan')), (_F32, float('inf')),
            (_F32, 0.0), (_F32, 2.5), (_BOOL, True),
            (tiny_gemma.STRING, ''), (tiny_gemma.STRING, '32'),
            (tiny_gemma.ARRAY, (_U32, [2, 2])),
            (tiny_gemma.ARRAY, (tiny_gemma.STRING, ['a']))]


def _pick(rng, seq):
  return seq[int(rng.integers(len(seq)))]


def _flip(rng, raw: bytes, end: int) -> bytes:
  out = bytearray(raw)
  for _ in range(int(rng.integers(1, 4))):
    out[int(rng.integers(end))] ^= int(rng.integers(1, 256))
  return bytes(out)


def _nested_value(rng) -> bytes:
  return tiny_gemma.nested(_pick(rng, [1, 2, 4, 5, 20, 5000]))


def _lying_array(rng) -> bytes:
  count = _pick(rng, [2**24, 2**24 + 1, 2**40, 2**64 - 1, 10**6])
  item = _pick(rng, [0, _U32, tiny_gemma.STRING, tiny_gemma.ARRAY])
  return np.array([item], '<u4').tobytes() + np.array([count],
                                                      '<u8').tobytes()


def _mutate(rng, parts: tiny_gemma.Layout, raw: bytes, header: int
            ) -> tuple[str, bytes]:
  """(what was done, the mutated file) for one of the kinds of damage."""
  kind = _pick(rng, ['flip_header', 'flip_any', 'truncate', 'value',
                     'alignment', 'nesting', 'tensor', 'counts', 'lie'])
  p = dataclasses.replace(parts, fields=[list(f) for f in parts.fields],
                          tensors=[list(t) for t in parts.tensors])
  if kind == 'flip_header':
    return kind, _flip(rng, raw, header)
  if kind == 'flip_any':
    return kind, _flip(rng, raw, len(raw))
  if kind == 'truncate':
    return kind, raw[:int(rng.integers(len(raw)))]
  if kind == 'value':
    field = _pick(rng, p.fields)
    field[1], field[2] = _pick(rng, _HOSTILE)
    return f'value {field[0]}={field[2]!r}', tiny_gemma.to_bytes(p)
  if kind == 'alignment':
    type_, value = _pick(rng, _HOSTILE + [(_U32, 64), (_U32, 32)])
    p = tiny_gemma.set_field(p, 'general.alignment', type_, value)
    return f'alignment {value!r}', tiny_gemma.to_bytes(p)
  if kind == 'nesting':
    field = _pick(rng, p.fields)
    field[1], field[2] = tiny_gemma.ARRAY, _nested_value(rng)
    return f'nesting at {field[0]}', tiny_gemma.to_bytes(p)
  if kind == 'tensor':
    tensor = _pick(rng, p.tensors)
    what = _pick(rng, ['dims', 'ndims', 'type', 'offset', 'name'])
    if what == 'dims':
      dims = list(tensor[1])
      dims[int(rng.integers(len(dims)))] = _pick(
          rng, [0, 2**32, 2**63, 2**64 - 1, 10**9])
      # Or a product that wraps int64 to 0 (2**64).
      tensor[1] = _pick(rng, [tuple(dims), (2**32, 2**32)])
    elif what == 'ndims':
      tensor[1] = tensor[1] + (1,) * int(rng.integers(1, 4))
    elif what == 'type':
      tensor[2] = int(rng.integers(0, 64))
    elif what == 'offset':
      tensor[3] = _pick(rng, [tensor[3] + 1, tensor[3] + 32, 2**63,
                              2**64 - 32])
    else:
      tensor[0] = _pick(rng, [p.tensors[0][0], 'x' * 64, ''])
    return f'tensor {what}', tiny_gemma.to_bytes(p)
  if kind == 'counts':
    n = _pick(rng, [0, 1, 2**16, 2**16 + 1, 10**6, 2**64 - 1])
    which = _pick(rng, ['n_fields', 'n_tensors'])
    return f'{which}={n}', tiny_gemma.to_bytes(p, **{which: n})
  field = _pick(rng, p.fields)
  field[1], field[2] = tiny_gemma.ARRAY, _lying_array(rng)
  return f'lying array at {field[0]}', tiny_gemma.to_bytes(p)


def test_mutated_files_load_or_are_refused_in_one_line(tmp_path):
  source = tiny_gemma.model_file(tmp_path / 'm.gguf')
  parts = tiny_gemma.layout(source)
  raw = tiny_gemma.to_bytes(parts)
  header = len(raw) - len(parts.data)
  rng = np.random.default_rng(SEED)
  cases = []
  for case in range(CASES):
    what, data = _mutate(rng, parts, raw, header)
    # A new name a case: the readers cache by path, size and mtime.
    path = tmp_path / f'case{case}.gguf'
    path.write_bytes(data)
    cases.append((case, what, str(path)))
  outcomes = {'loaded': 0, 'refused': 0}
  started, cpu = time.perf_counter(), time.process_time()
  tracemalloc.start()
  try:
    for case, what, path in cases:
      try:
        gemma_gguf.check_file(path)
        gemma_gguf.load(path)
        outcomes['loaded'] += 1
      except errors.DamagedModelFile as e:
        assert '\n' not in str(e), (case, what, str(e))
        outcomes['refused'] += 1
      except Exception as e:  # pylint: disable=broad-except
        pytest.fail(f'case {case} ({what}): {type(e).__name__}: {e}')
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  print(f'{CASES} cases read in {time.perf_counter() - started:.1f} s '
        f'({time.process_time() - cpu:.1f} s CPU): {outcomes}, peak '
        f'{peak / 2**20:.1f} MB')
  assert peak < MEMORY_BOUND, peak
  # The damage reaches both ends: some files still load, most do not.
  assert outcomes['loaded'] > 0 and outcomes['refused'] > CASES // 2
