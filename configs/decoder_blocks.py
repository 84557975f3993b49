"""Config blocks of the decoder LM shared by configs/lm.py, configs/rl_sft.py
and configs/rl.py: the pod-scale sizes and their sharding rules, the small
LM's mesh and rules, and the small LM's optimizer and cadence.
"""

import ml_collections

from configs import optimizer_block


# size -> (d_model, num_layers, num_heads, num_kv_heads, mlp_dim, tensor
# parallelism): Llama's shapes (the 125m one GPT-3 Small's depth and width
# with a SwiGLU MLP of the same parameter count).
SIZES = {
    '125m': (768, 12, 12, 12, 2048, 1),
    '1b': (2048, 16, 32, 8, 8192, 1),
    '8b': (4096, 32, 32, 8, 14336, 4),
}
SIZE_VOCAB = 32_000
SIZE_SEQ_LEN = 2048


# FSDP: every parameter's embedding dimension split over 'data' (XLA
# gathers a layer's weights where it is used); tensor parallelism: heads,
# MLP and vocabulary over 'model'.
SIZE_RULES = (
    ('batch', 'data'),
    ('embed', 'data'),
    ('vocab', 'model'),
    ('heads', 'model'),
    ('kv_heads', 'model'),
    ('mlp', 'model'),
)


def size_model(size: str, vocab_size: int, max_len: int
               ) -> tuple[ml_collections.ConfigDict, tuple[int, int]]:
  """The decoder of `size` (bfloat16 compute, remat) and its mesh shape
  (data, model); `configs/rl_sft.py` builds its policies from it too."""
  if size not in SIZES:
    raise ValueError(f'size={size!r}; valid: ' + ', '.join(SIZES))
  d, layers, heads, kv_heads, mlp, model_parallel = SIZES[size]
  model = ml_collections.ConfigDict(dict(
      vocab_size=vocab_size, d_model=d, num_layers=layers, num_heads=heads,
      mlp_dim=mlp, max_len=max_len, num_kv_heads=kv_heads,
      dtype='bfloat16', remat=True))
  return model, (-1, model_parallel)


# The small LMs' rules: batch over 'data'; heads and MLP over 'model'
# (of size 1 unless a config sets it); embeddings and vocabulary
# replicated.
LOCAL_RULES = (
    ('batch', 'data'),
    ('vocab', None),
    ('embed', None),
    ('heads', 'model'),
    ('mlp', 'model'),
)


def local_mesh(config: ml_collections.ConfigDict) -> None:
  """Sets the small LM's mesh (all devices on 'data') and `LOCAL_RULES`."""
  config.mesh = ml_collections.ConfigDict(
      dict(axes=('data', 'model'), shape=(-1, 1)))
  config.logical_axis_rules = LOCAL_RULES


def local_training(config: ml_collections.ConfigDict,
                   weight_decay: float) -> None:
  """Sets the small LM's optimizer (AdamW 3e-3, 100 warm-up steps, cosine
  to 5%, clipping at 1) and cadence (stop on a non-finite loss; a log line
  every 100 steps, an evaluation and a checkpoint every 500, two kept)."""
  config.optimizer = optimizer_block.optimizer_block(
      name='adamw', learning_rate=3e-3, warmup_steps=100,
      end_lr_fraction=0.05, b2=0.98, eps=1e-9, weight_decay=weight_decay,
      grad_clip_norm=1.0)
  config.nonfinite = 'stop'
  config.log_every = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.keep_checkpoints = 2
