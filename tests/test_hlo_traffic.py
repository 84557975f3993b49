"""train.compilation.hlo_traffic: HBM bytes counted from optimized HLO.

Against a hand-written entry computation whose traffic is worked out
below, and against programs compiled here whose traffic is known in
closed form (an elementwise op reads its operands once and writes its
result once; a full reduction reads its operand and writes a scalar).
"""

import jax
import jax.numpy as jnp
import pytest

from train.compilation import hlo_traffic

# Each instruction's traffic, worked out by hand:
HAND_WRITTEN = """\
HloModule m, is_scheduled=true

%fused_add (p0: f32[256,128], p1: f32[256,128]) -> f32[256,128] {
  %p0 = f32[256,128]{1,0} parameter(0)
  %p1 = f32[256,128]{1,0} parameter(1)
  ROOT %add.9 = f32[256,128]{1,0} add(%p0, %p1)
}

ENTRY %main.1 (a: f32[256,128], b: f32[256,128], s: f32[10]) -> (f32[256,128], f32[]) {
  %a = f32[256,128]{1,0:T(8,128)} parameter(0), sharding={replicated}
  %b = f32[256,128]{1,0:T(8,128)} parameter(1)
  %s = f32[10]{0:T(128)} parameter(2)
  %c = f32[] constant(2)
  %fusion = f32[256,128]{1,0:T(8,128)} fusion(%a, %b), kind=kLoop, calls=%fused_add
  %copy-start = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%fusion)
  %copy-done = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %k = (f32[2,1,128]{2,1,0:T(1,128)}, f32[2,1,128]{2,1,0:T(1,128)}) custom-call(%copy-done, %a), custom_call_target="tpu_custom_call"
  %gte = f32[2,1,128]{2,1,0:T(1,128)} get-tuple-element(%k), index=0
  %m = f32[10]{0:T(128)} multiply(%s, %s)
  %r = f32[] reduce(%m, %c), dimensions={0}, to_apply=%fused_add
  %bc = f32[131072]{0} bitcast(%fusion)
  ROOT %out = (f32[256,128]{1,0:T(8,128)}, f32[]) tuple(%fusion, %r)
}
"""
KIB128 = 256 * 128 * 4  # One f32[256,128]: 128 KiB.
EXPECTED = {
    # Reads a and b, writes its result.
    'fusion': (2 * KIB128, KIB128),
    # Reads the fusion's result from HBM into VMEM (S(1)): nothing written
    # to HBM.
    'copy-start': (KIB128, 0),
    'copy-done': (0, 0),
    # Reads the VMEM copy (not HBM) and a; writes two (2, 1, 128) tiles.
    'k': (KIB128, 2 * 2 * 128 * 4),
    # f32[10] with T(128) tiles occupies 128 elements; read once though
    # named twice.
    'm': (512, 512),
    # Reads m and the constant (a scalar without a layout: 4 bytes), writes
    # a scalar.
    'r': (512 + 4, 4),
}


def test_hand_written_entry_computation():
  got = {i.name: (i.read, i.written)
         for i in hlo_traffic.instructions(HAND_WRITTEN)}
  for name in ('a', 'b', 's', 'c', 'gte', 'bc', 'out'):
    assert got.pop(name) == (0, 0), name  # Free instructions.
  assert got == EXPECTED
  assert hlo_traffic.traffic(HAND_WRITTEN) == sum(
      r + w for r, w in EXPECTED.values())
  targets = {i.name: i.target for i in hlo_traffic.instructions(HAND_WRITTEN)}
  assert targets['k'] == 'tpu_custom_call' and targets['fusion'] is None


def test_collectives_report_their_output_sizes():
  text = HAND_WRITTEN.replace(
      '  ROOT %out', '  %ag = (f32[256,128]{1,0}, f32[512,128]{1,0}) '
      'all-gather-start(%fusion), dimensions={0}\n'
      '  %agd = f32[512,128]{1,0} all-gather-done(%ag)\n'
      '  %ar = f32[] all-reduce(%r), to_apply=%fused_add\n  ROOT %out')
  assert hlo_traffic.collectives(text, 'all-gather') == [2 * KIB128]
  assert hlo_traffic.collectives(text, 'all-reduce') == [4]
  assert hlo_traffic.collectives(HAND_WRITTEN, 'all-gather') == []
  # The all-gather reads 128 KiB and writes 256 KiB; its done half is free.
  assert hlo_traffic.traffic(text) == hlo_traffic.traffic(HAND_WRITTEN) + (
      3 * KIB128) + 8


# Slices read what they keep: an unpacking fusion (two leaves sliced out of
# a packed buffer), a slice, and an async slice into on-chip memory.
SLICING = """\
HloModule m, is_scheduled=true

%unpack (p0: f32[1024], p1: f32[16]) -> (f32[100], f32[16]) {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %s = f32[100]{0} slice(%p0), slice={[0:100]}
  %m = f32[16]{0} multiply(%p1, %p1)
  ROOT %t = (f32[100]{0}, f32[16]{0}) tuple(%s, %m)
}

ENTRY %main (packed: f32[1024], small: f32[16]) -> (f32[100], f32[16]) {
  %packed = f32[1024]{0} parameter(0)
  %small = f32[16]{0} parameter(1)
  %fusion = (f32[100]{0}, f32[16]{0}) fusion(%packed, %small), kind=kLoop, calls=%unpack
  %slice = f32[24]{0} slice(%packed), slice={[1000:1024]}
  %slice-start = ((f32[1024]{0}), f32[512]{0:S(1)}, s32[]{:S(2)}) slice-start(%packed), slice={[0:512]}
  %slice-done = f32[512]{0:S(1)} slice-done(%slice-start)
  ROOT %out = (f32[100]{0}, f32[16]{0}) tuple(%fusion)
}
"""


def test_slices_read_only_what_they_keep():
  got = {i.name: (i.read, i.written)
         for i in hlo_traffic.instructions(SLICING) if i.bytes}
  assert got == {
      # 100 of the packed buffer's 1024 floats; all of the other operand.
      'fusion': (4 * (100 + 16), 4 * (100 + 16)),
      'slice': (4 * 24, 4 * 24),
      # 512 floats out of HBM into on-chip memory.
      'slice-start': (4 * 512, 0),
  }


N = 1024 * 1024
X = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)


@pytest.mark.parametrize('fn,args,closed_form', [
    (lambda x: x * 2 + 1, (X,), 2 * 4 * N),  # Read x, write the result.
    (lambda x, y: x * y + x, (X, X), 3 * 4 * N),
    (lambda x: jnp.sum(jnp.abs(x)), (X,), 4 * N + 4),
], ids=['scale', 'two_operands', 'reduction'])
def test_compiled_programs_of_known_traffic(fn, args, closed_form):
  compiled = jax.jit(fn).lower(*args).compile()
  assert hlo_traffic.traffic(compiled.as_text()) == closed_form
  # XLA's own estimate agrees on these programs.
  assert compiled.cost_analysis()['bytes accessed'] == closed_form
