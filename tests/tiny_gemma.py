"""Small Gemma 3 GGUF files, written with llama.cpp's own writer (`gguf`).

`write(path, tensors(rng))` makes a two-layer Gemma 3 of `SHAPE` whose
300-piece vocabulary holds the specials, the 256 byte-fallback pieces and a
few words: every text tokenizes (digits and signs as byte pieces, one token
each), so the whole pretrained-model path (loader, tokenizer, fine-tuning,
SFT, GRPO) runs on it in seconds. `gemma_config(path, job)` is a
configs/gemma.py training config pointed at such a file.
"""

import dataclasses
import struct

import gguf
import numpy as np

from configs import gemma as gemma_config_module
from train.lm import gemma

# A GGUF file holds no global_every (llama.cpp fixes Gemma 3's at 6): a
# loaded file's two layers are both local, whatever SHAPE says.
SHAPE = gemma.Shape(vocab_size=300, d_model=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, mlp_dim=64,
                    sliding_window=4, local_base=10_000.0,
                    global_base=1_000_000.0, global_every=2)


def vocab():
  pieces = ['<pad>', '<eos>', '<bos>', '<unk>']
  types = [3, 3, 3, 2]
  pieces += [f'<0x{b:02X}>' for b in range(256)]
  types += [6] * 256
  words = ['▁', 'a', 'b', 'c', '▁a', 'ab', '▁ab', 'abc', '\n', '▁b']
  pieces += words + [f'w{i}' for i in range(300 - len(pieces) - len(words))]
  types += [1] * (300 - len(types))
  scores = [0.0] * 260 + [-float(i) for i in range(40)]
  return pieces, scores, types


def tensors(rng, shape=SHAPE):
  d, h, kv, hd, f = (shape.d_model, shape.num_heads, shape.num_kv_heads,
                     shape.head_dim, shape.mlp_dim)
  r = lambda *s: rng.standard_normal(s).astype(np.float32)
  out = {'token_embd.weight': r(shape.vocab_size, d),
         'output_norm.weight': 1 + 0.1 * r(d)}
  for i in range(shape.num_layers):
    b = f'blk.{i}.'
    out.update({
        b + 'attn_norm.weight': 1 + 0.1 * r(d), b + 'attn_q.weight': r(h * hd, d),
        b + 'attn_k.weight': r(kv * hd, d), b + 'attn_v.weight': r(kv * hd, d),
        b + 'attn_q_norm.weight': 1 + 0.1 * r(hd),
        b + 'attn_k_norm.weight': 1 + 0.1 * r(hd),
        b + 'attn_output.weight': r(d, h * hd),
        b + 'post_attention_norm.weight': 1 + 0.1 * r(d),
        b + 'ffn_norm.weight': 1 + 0.1 * r(d),
        b + 'ffn_gate.weight': r(f, d), b + 'ffn_up.weight': r(f, d),
        b + 'ffn_down.weight': r(d, f),
        b + 'post_ffw_norm.weight': 1 + 0.1 * r(d)})
  return out


def write(path, tensors, shape=SHAPE, arch='gemma3', quantize=(),
          skip_meta=()):
  w = gguf.GGUFWriter(str(path), arch=arch)
  meta = {
      'embedding_length': shape.d_model, 'block_count': shape.num_layers,
      'feed_forward_length': shape.mlp_dim,
      'attention.head_count': shape.num_heads,
      'attention.head_count_kv': shape.num_kv_heads,
      'attention.key_length': shape.head_dim,
      'attention.value_length': shape.head_dim,
      'attention.sliding_window': shape.sliding_window}
  for k, v in meta.items():
    if k not in skip_meta:
      w.add_uint32(f'{arch}.{k}', v)
  w.add_float32(f'{arch}.rope.freq_base', shape.global_base)
  w.add_float32(f'{arch}.attention.layer_norm_rms_epsilon', 1e-6)
  pieces, scores, types = vocab()
  w.add_tokenizer_model('llama')
  w.add_token_list(pieces)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_space_prefix(False)
  for name, x in tensors.items():
    if name in quantize:
      q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


# SHAPE widened to TPU tiles (128 lanes): a compiler for TPU pads SHAPE's
# 32-wide arrays to 128, so its argument bytes are not the parameters'.
TILED_SHAPE = dataclasses.replace(SHAPE, d_model=128, head_dim=128,
                                  mlp_dim=256)


def model_file(path, seed: int = 0, shape: gemma.Shape = SHAPE) -> str:
  """A small Gemma 3 GGUF of `shape` at `path` with random weights of
  `seed`."""
  return write(path, tensors(np.random.default_rng(seed), shape), shape)


def gemma_config(path: str, job: str = 'sft'):
  """configs/gemma.py:<job>,runlocal reading the small file at `path`
  (its own shape)."""
  config = gemma_config_module.get_config(f'{job},runlocal')
  config.model.gguf = str(path)
  config.model.shape = 'gguf'
  return config


# --- Raw files: a GGUF taken apart and put back together byte by byte, so
# that tests can write what no writer would (hostile values, lying counts).
_PACK = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f',
         7: '<?', 10: '<Q', 11: '<q', 12: '<d'}
STRING, ARRAY = 8, 9
WRITER_ALIGNMENT = 32  # gguf.GGUFWriter's, which `write` uses.


@dataclasses.dataclass
class Layout:
  """A GGUF file's parts as llama.cpp's reader sees them.

  `fields`: [key, GGUF value type, value]; an array's value is (item type,
  [items]), and a `bytes` value is written as it is after the type (for
  values no encoder would write). `tensors`: [name, dims (innermost
  first), GGML type, offset into `data`].
  """
  fields: list[list]
  tensors: list[list]
  data: bytes
  version: int = 3


def layout(path) -> Layout:
  """`path` taken apart by llama.cpp's `gguf.GGUFReader`."""
  reader = gguf.GGUFReader(str(path))
  fields = []
  for key, field in reader.fields.items():
    if key.startswith('GGUF.'):
      continue
    kinds = [int(t) for t in field.types]
    value = field.contents()
    fields.append([key, kinds[0], (kinds[1], value) if kinds[0] == ARRAY
                   else value])
  tensors = [[x.name, tuple(int(n) for n in x.shape), int(x.tensor_type),
              int(x.data_offset) - reader.data_offset] for x in reader.tensors]
  with open(path, 'rb') as f:
    data = f.read()[reader.data_offset:]
  return Layout(fields, tensors, data)


def encode(kind: int, value) -> bytes:
  """One metadata value of GGUF type `kind`, as GGUF writes it."""
  if isinstance(value, bytes):
    return value
  if kind == STRING:
    raw = value.encode()
    return struct.pack('<Q', len(raw)) + raw
  if kind == ARRAY:
    item, items = value
    return struct.pack('<IQ', item, len(items)) + b''.join(
        encode(item, x) for x in items)
  return struct.pack(_PACK[kind], value)


def nested(depth: int) -> bytes:
  """An array value holding arrays `depth` deep (the innermost empty),
  written without recursion."""
  return struct.pack('<IQ', ARRAY, 1) * (depth - 1) + struct.pack('<IQ', 0, 0)


def to_bytes(parts: Layout, n_fields: int | None = None,
             n_tensors: int | None = None,
             alignment: int = WRITER_ALIGNMENT) -> bytes:
  """The file of `parts`; `n_fields` / `n_tensors` override the counts the
  header declares, `alignment` the padding before the data."""
  out = [b'GGUF', struct.pack('<IQQ', parts.version,
                              len(parts.tensors) if n_tensors is None
                              else n_tensors,
                              len(parts.fields) if n_fields is None
                              else n_fields)]
  for key, kind, value in parts.fields:
    out += [encode(STRING, key), struct.pack('<I', kind), encode(kind, value)]
  for name, dims, ggml_type, offset in parts.tensors:
    out += [encode(STRING, name), struct.pack('<I', len(dims)),
            b''.join(struct.pack('<Q', n) for n in dims),
            struct.pack('<IQ', ggml_type, offset)]
  header = b''.join(out)
  return header + bytes(-len(header) % alignment) + parts.data


def set_field(parts: Layout, key: str, kind: int, value) -> Layout:
  """`parts` with metadata `key` set (added where absent)."""
  fields = [f for f in parts.fields if f[0] != key] + [[key, kind, value]]
  return dataclasses.replace(parts, fields=fields)
