"""Parameter trees (shapes only) for the fused SAM perturbation kernel.

`TREES`: the trees the kernel's lowering and compile tests and its
on-device check use (`tests/test_kernels_sam_perturb_lowering.py`,
`tests/test_kernels_sam_perturb_compile.py`, `bench.sam.perturb`), each
with the number of (rows, 128) buffers the kernels see on one device.

`realistic()`: whole models' trees for `bench.sam.perturb_hbm`: decoder
LMs with the shapes of `configs/lm.py`'s `size=125m` and `size=1b` (the
leaves as `train/lm/decoder.py` declares them: rotary attention with
(d_model, heads, head_dim) projections, SwiGLU MLP, RMSNorm scales, untied
embedding and head, float32 parameters), a ResNet-50 v1.5 (HWIO convolution
kernels, BatchNorm scale and bias per convolution, 1000 classes) and the
'mlp' tree.
"""

import jax
import jax.numpy as jnp

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16

# name: (tree of parameter shapes, buffers the kernels see on one device).
TREES = {
    # 4M float32 elements: a buffer of its own (a reshape: free in GPU
    # memory; a relayout in TPU's tiled memory, 1024 lanes to 128).
    'large': ({'w': S((4096, 1024), F32)}, 1),
    # Not multiples of 128: one packed, zero-padded buffer.
    'ragged': ({'a': S((1000, 3), F32), 'b': S((7,), F32), 'c': S((1,), F32)},
               1),
    # Two aligned kernels (one bfloat16) and a pack per dtype.
    'mlp': ({'dense0': {'kernel': S((784, 512), F32), 'bias': S((512,), F32)},
             'dense1': {'kernel': S((512, 512), BF16),
                        'bias': S((512,), BF16)},
             'head': {'kernel': S((512, 10), F32), 'bias': S((10,), F32)}},
            4),
    '40_small': ({f'l{i}': S((i + 3,), F32) for i in range(40)}, 1),
}

VOCAB = 32_000
# configs/lm.py's SIZES: (d_model, layers, heads, key/value heads, MLP).
LM_SIZES = {'lm_125m': (768, 12, 12, 12, 2048),
            'lm_1b': (2048, 16, 32, 8, 8192)}


def lm(d_model: int, layers: int, heads: int, kv_heads: int, mlp: int,
       vocab: int = VOCAB):
  """A decoder LM's parameter shapes (float32)."""
  head_dim = d_model // heads
  block = {
      'attention_norm': {'scale': S((d_model,), F32)},
      'attention': {'query': S((d_model, heads, head_dim), F32),
                    'key': S((d_model, kv_heads, head_dim), F32),
                    'value': S((d_model, kv_heads, head_dim), F32),
                    'out': S((heads, head_dim, d_model), F32)},
      'mlp_norm': {'scale': S((d_model,), F32)},
      'mlp': {'gate': S((d_model, mlp), F32), 'up': S((d_model, mlp), F32),
              'down': S((mlp, d_model), F32)},
  }
  tree = {'embedding': S((vocab, d_model), F32)}
  tree.update({f'block_{i}': dict(block) for i in range(layers)})
  tree.update(final_norm={'scale': S((d_model,), F32)},
              head=S((d_model, vocab), F32))
  return tree


def resnet50(classes: int = 1000):
  """ResNet-50 v1.5's parameter shapes (float32): a 7x7 stem, bottleneck
  stages of 3, 4, 6 and 3 blocks, a projection on each stage's first
  block, BatchNorm scale and bias after every convolution."""

  def conv(kh, kw, cin, cout):
    return {'kernel': S((kh, kw, cin, cout), F32),
            'bn': {'scale': S((cout,), F32), 'bias': S((cout,), F32)}}

  tree = {'stem': conv(7, 7, 3, 64)}
  cin = 64
  for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256),
                                           (3, 512)]):
    for b in range(blocks):
      block = {'conv1': conv(1, 1, cin, width),
               'conv2': conv(3, 3, width, width),
               'conv3': conv(1, 1, width, 4 * width)}
      if b == 0:
        block['projection'] = conv(1, 1, cin, 4 * width)
      tree[f'stage{stage}_block{b}'] = block
      cin = 4 * width
  tree['head'] = {'kernel': S((cin, classes), F32), 'bias': S((classes,),
                                                               F32)}
  return tree


def realistic():
  """name -> parameter shapes of the models `bench.sam.perturb_hbm` uses."""
  trees = {name: lm(*size) for name, size in LM_SIZES.items()}
  trees['resnet50'] = resnet50()
  trees['mlp'] = TREES['mlp'][0]
  return trees


def parameters(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))
