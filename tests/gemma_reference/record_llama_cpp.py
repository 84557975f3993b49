"""Records llama.cpp's outputs on the registry's Gemma 3 270M GGUF file.

tests/test_gemma_reference.py compares train.lm.gemma with these. llama.cpp
(its C++ model graph, tokenizer and dequantization, through llama-cpp-python
0.3.36) is the independent implementation; it is not a test dependency,
because it builds from source (minutes on 2 cores), so its outputs are
recorded here once into llama_cpp.npz:

  pip install llama-cpp-python==0.3.36     # builds llama.cpp, CPU only
  python -m tests.gemma_reference.record_llama_cpp [--f32_gguf=PATH]

What it records (texts.py holds the inputs):
- `corpus_ids_<i>`: llama.cpp's tokens of CORPUS[i] (no BOS, special
  tokens not parsed);
- `passage_ids`: BOS + the passage's tokens, and at every position the
  next-token logits' top 32 ids and values, the logits at 256 fixed random
  vocabulary ids, and the log-sum-exp of all of them; twice: `q_*` on the
  Q4_K_M file as shipped (llama.cpp's own dequantization, and its matmuls
  quantize the activations to 8 bits), and `f_*` on an F32 GGUF holding the
  same weights dequantized by llama.cpp's Python reader, where llama.cpp
  computes in float32 (KV cache float32 too), which isolates the model's
  arithmetic from the weights' decoding;
- `greedy_<i>`: 24 greedy tokens after BOS + PROMPTS[i], decoded one at a
  time with llama.cpp's KV cache, on the F32 file.

Optionally (`--control_vector`), llama.cpp steered by a control vector
that `launch.steer_eval --export_gguf` wrote (train.steering.gguf_export),
to check that llama.cpp adds what geom's addition adds, at the same block:

  python -m launch.steer_eval --config=configs/gemma.py:runlocal \
      --workdir=/tmp/gemma_cvec_eval \
      --export_gguf=/tmp/gemma-3-270m-cvec.gguf --export_alpha=0.1
  python -m tests.gemma_reference.record_llama_cpp \
      [--control_vector=/tmp/gemma-3-270m-cvec.gguf] [--control_vector_only]

(runlocal: the direction from 8 review pairs at block 6, its coefficient
the mean activation norm there, about 5,200; alpha 0.1 moves the logits
well past the unsteered tolerance.) `--control_vector_only` adds the keys
below to the existing `--out` file and leaves every other array as it is;
without it the whole file is recorded again. The vector goes in through
llama-cpp-python's binding of `llama_set_adapter_cvec`
(`llama_apply_adapter_cvec` in releases before 0.3.17), with the buffer
that llama.cpp's `common_control_vector_load` (common/, which
llama-cpp-python does not bind) builds from the file at strength 1, over
llama.cpp's default layer range, 1 to n_layer, on a fresh context of the
F32 file. New keys:
- `cvec_layers`, `cvec_vectors`: the file's N of each `direction.N`
  (llama.cpp adds it after 0-based block N, the block geom steers) and
  its values (n_embd float32 each), as llama.cpp was given them;
- `cvec_f_top_ids`, `cvec_f_top_logits`, `cvec_f_random_logits`,
  `cvec_f_lse`: as `f_*`, on `passage_ids` with the vector applied (the
  next-token log-probabilities are the logits less `lse`);
- `cvec_llama_cpp_version`.
"""

import argparse
import os

import numpy as np

from tests.gemma_reference import texts

TOP = 32
RANDOM_IDS = 256
GGML_TYPE_F32 = 0


def _write_f32(source: str, target: str) -> None:
  import gguf
  reader = gguf.GGUFReader(source)
  writer = gguf.GGUFWriter(target, arch='gemma3')
  for key, field in reader.fields.items():
    if key.startswith('GGUF.') or key == 'general.architecture':
      continue
    if key == 'general.file_type':
      continue
    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), kind, sub)
  writer.add_file_type(gguf.LlamaFileType.ALL_F32)
  for t in reader.tensors:
    values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    writer.add_tensor(t.name, values.reshape(
        [int(n) for n in reversed(t.shape)]))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _llama(path: str, n_ctx: int):
  import llama_cpp
  return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx,
                         n_ubatch=n_ctx, logits_all=True, n_threads=2,
                         type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                         flash_attn=False, verbose=False)


def _logit_summary(llm, ids, random_ids):
  llm.reset()
  llm.eval(list(map(int, ids)))
  scores = np.array(llm.scores[:len(ids)], np.float32)
  top = np.argsort(-scores, axis=1, kind='stable')[:, :TOP]
  m = scores.max(1, keepdims=True)
  lse = (m[:, 0] + np.log(np.exp(scores - m).sum(1))).astype(np.float32)
  return dict(top_ids=top.astype(np.int32),
              top_logits=np.take_along_axis(scores, top, 1),
              random_logits=scores[:, random_ids], lse=lse)


def _control_vector_buffer(path: str, n_embd: int):
  """(layers, vectors, buffer): the N and values of the file's
  `direction.N` tensors, and the buffer of n_embd floats per layer from
  layer 1 that common_control_vector_load_one fills from them at strength
  1 (direction.N at offset n_embd * (N - 1); N >= 1, float32, 1-D)."""
  import gguf
  layers, vectors = [], []
  for t in gguf.GGUFReader(path).tensors:
    prefix, _, index = t.name.partition('.')
    if prefix != 'direction' or not index.isdigit() or int(index) < 1:
      raise ValueError(f'{path}: tensor {t.name}: not direction.<N>, N >= 1')
    if (t.tensor_type != gguf.GGMLQuantizationType.F32
        or [int(n) for n in t.shape] != [n_embd]):
      raise ValueError(f'{path}: tensor {t.name}: not {n_embd} float32s')
    layers.append(int(index))
    vectors.append(np.array(t.data, np.float32))
  if not layers:
    raise ValueError(f'{path}: no direction tensors')
  buffer = np.zeros(n_embd * max(layers), np.float32)
  for n, v in zip(layers, vectors):
    buffer[n_embd * (n - 1):n_embd * n] += v
  return np.asarray(layers, np.int32), np.stack(vectors), buffer


def _steered(f32_path: str, vector_path: str, ids, random_ids) -> dict:
  """The `cvec_*` keys: llama.cpp on the F32 file with the control vector
  at `vector_path` applied, as `--control-vector` applies it."""
  import ctypes
  import llama_cpp
  llm = _llama(f32_path, 1024)  # A fresh context: no graph from before.
  n_embd = llm.n_embd()
  n_layer = llama_cpp.llama_model_n_layer(llm.model)
  layers, vectors, buffer = _control_vector_buffer(vector_path, n_embd)
  apply = (getattr(llama_cpp, 'llama_set_adapter_cvec', None)
           or llama_cpp.llama_apply_adapter_cvec)
  # common_init_from_params's defaults: layer_start 1, layer_end n_layer.
  if apply(llm.ctx, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
           buffer.size, n_embd, 1, n_layer):
    raise RuntimeError(f'llama.cpp refused the control vector {vector_path}')
  out = dict(cvec_layers=layers, cvec_vectors=vectors,
             cvec_llama_cpp_version=np.array(llama_cpp.__version__))
  for k, v in _logit_summary(llm, ids, random_ids).items():
    out['cvec_f_' + k] = v
  return out


def _arguments():
  parser = argparse.ArgumentParser()
  parser.add_argument('--gguf', default=None,
                      help='the Q4_K_M file (default: the registry\'s)')
  parser.add_argument('--f32_gguf', default='/tmp/gemma-3-270m-f32.gguf')
  parser.add_argument('--out', default=os.path.join(
      os.path.dirname(__file__), 'llama_cpp.npz'))
  parser.add_argument('--control_vector', default=None,
                      help='also record llama.cpp steered by this control '
                      'vector (launch.steer_eval --export_gguf)')
  parser.add_argument('--control_vector_only', action='store_true',
                      help='add only the control vector\'s keys to --out')
  args = parser.parse_args()
  if args.control_vector_only and not args.control_vector:
    parser.error('--control_vector_only needs --control_vector')
  return args


def main():
  args = _arguments()
  from train.lm import gemma_gguf
  import llama_cpp
  path = args.gguf or gemma_gguf.registry_file()
  if not os.path.exists(args.f32_gguf):
    _write_f32(path, args.f32_gguf)
  if args.control_vector_only:
    with np.load(args.out) as f:
      out = dict(f)
    out.update(_steered(args.f32_gguf, args.control_vector,
                        out['passage_ids'], out['random_ids']))
    np.savez_compressed(args.out, **out)
    print(f'added {args.control_vector} to {args.out}')
    return
  out = dict(llama_cpp_version=np.array(llama_cpp.__version__))
  q = _llama(path, 1024)
  for i, text in enumerate(texts.CORPUS):
    out[f'corpus_ids_{i}'] = np.asarray(
        q.tokenize(text.encode('utf-8'), add_bos=False, special=False),
        np.int32)
  ids = np.asarray(q.tokenize(texts.PASSAGE.encode('utf-8'), add_bos=True,
                              special=False), np.int32)
  out['passage_ids'] = ids
  random_ids = np.random.default_rng(0).choice(
      q.n_vocab(), RANDOM_IDS, replace=False).astype(np.int32)
  out['random_ids'] = random_ids
  for k, v in _logit_summary(q, ids, random_ids).items():
    out['q_' + k] = v
  del q
  f = _llama(args.f32_gguf, 1024)
  for k, v in _logit_summary(f, ids, random_ids).items():
    out['f_' + k] = v
  for i, prompt in enumerate(texts.PROMPTS):
    tokens = f.tokenize(prompt.encode('utf-8'), add_bos=True, special=False)
    f.reset()
    f.eval(tokens)
    generated = []
    for _ in range(texts.GREEDY_STEPS):
      nxt = int(np.argmax(f.scores[f.n_tokens - 1]))
      generated.append(nxt)
      f.eval([nxt])
    out[f'prompt_ids_{i}'] = np.asarray(tokens, np.int32)
    out[f'greedy_{i}'] = np.asarray(generated, np.int32)
  del f
  if args.control_vector:
    out.update(_steered(args.f32_gguf, args.control_vector, ids, random_ids))
  np.savez_compressed(args.out, **out)
  print(f'wrote {args.out}: {len(ids)} passage tokens')


if __name__ == '__main__':
  main()
