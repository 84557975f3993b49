r"""A small byte-level decoder LM (pre-RMSNorm, rotary, KV cache) to steer.

Trains on a mixture of the sentiment template corpus (a binary attribute
with known ground truth) and real English text, all offline:

  python -m launch.train --config=configs/lm.py --workdir=workdirs/lm

Variants through the config argument (comma-separated, combinable):

  python -m launch.train --config=configs/lm.py:runlocal --workdir=/tmp/lm
  python -m launch.train --config=configs/lm.py:english=pydoc --workdir=/tmp/p
  python -m launch.train --config=configs/lm.py:english=/data/books \
    --workdir=/tmp/b

`tokenizer=sentencepiece` trains the LM on subwords: a SentencePiece BPE
model of `tokenizer.vocab_size` pieces (1024; 384 with `runlocal`),
trained offline on the run's own training text at its first start and
kept beside its checkpoints (`train.lm.tokenizer`); `tokenizer=byte` (the
default) is ASCII bytes. `forgetting` is the smaller pretraining of the forgetting study
(`python -m studies.lm_forgetting`). `english=` picks the real-text
source: 'fortunes' (Debian's `fortunes`
package, `apt-get install fortunes`; the default), 'pydoc' (Python's own
documentation, always present) or a directory of .txt files.

`size=` 125m | 1b | 8b are the pod-scale LMs, Llama's shapes with a
32,000-piece SentencePiece vocabulary (trained on the run's own text):
125m (12 x 768, 134M parameters), 1b (Llama 3.2 1B's 16 x 2048 with 8
key/value heads, 1.10B) and 8b (Llama 3 8B's 32 x 4096 with 8 key/value
heads, 7.24B; 8.03B with Llama 3's 128k vocabulary, which the uint16 token
storage does not hold), 2048-token windows, bfloat16 compute, every block
rematerialised, and FSDP plus tensor parallelism: parameters split over
'data' along their embedding dimension and over 'model' along heads, MLP
and vocabulary. Compile one for a pod before renting it:

  python -m launch.compile --config=configs/lm.py:size=1b --target=v5e:16x16

Point `english=` at the corpus (a directory of .txt files) and raise
`data.train_bytes` to what it holds. `runlocal` shrinks everything for
tests (with `size=`, the size's layout at toy scale). The steering evaluation reads this run's
checkpoint: `python -m launch.steer_eval --config=configs/steering.py
--config.lm_workdir=workdirs/lm --workdir=workdirs/steer`.
"""

import ml_collections

from configs import config_args
from configs import decoder_blocks
from configs import optimizer_block


def _size(config: ml_collections.ConfigDict, size: str) -> None:
  """The pod-scale LM of `size` (see module docstring)."""
  config.model, shape = decoder_blocks.size_model(size, decoder_blocks.SIZE_VOCAB, decoder_blocks.SIZE_SEQ_LEN)
  config.tokenizer = ml_collections.ConfigDict(dict(
      kind='sentencepiece', vocab_size=decoder_blocks.SIZE_VOCAB, model_type='bpe'))
  config.data.update(dict(seq_len=decoder_blocks.SIZE_SEQ_LEN, train_bytes=2_000_000_000,
                          eval_bytes=20_000_000))
  config.mesh = ml_collections.ConfigDict(dict(axes=('data', 'model'),
                                               shape=shape))
  config.logical_axis_rules = decoder_blocks.SIZE_RULES
  config.batch_size = 256
  config.eval_batch_size = 256
  config.num_steps = 100_000
  # Llama's recipe: AdamW (0.9, 0.95), weight decay 0.1, clipping at 1.
  config.optimizer = optimizer_block.optimizer_block(
      name='adamw', learning_rate=3e-4, warmup_steps=2000,
      end_lr_fraction=0.1, b2=0.95, eps=1e-8, weight_decay=0.1,
      grad_clip_norm=1.0)
  config.log_every = 100
  config.eval_every = 2000
  config.checkpoint_every = 1000


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The LM experiment; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/lm.py', {
      'runlocal': 'runlocal', 'english': 'english=SOURCE',
      'forgetting': 'forgetting', 'tokenizer': 'tokenizer=byte|sentencepiece',
      'size': 'size=' + '|'.join(decoder_blocks.SIZES)})
  config = ml_collections.ConfigDict()
  config.task = 'lm'
  config.seed = 0
  # Another LM run's workdir to start from (its newest good checkpoint's
  # parameters; a fresh optimizer): `--config.init_from=DIR`. Unset: from
  # config.seed's initialisation.
  config.init_from = ml_collections.config_dict.placeholder(str)
  config.cpu_devices = 8

  config.model = ml_collections.ConfigDict(dict(
      vocab_size=256, d_model=128, num_layers=4, num_heads=4, mlp_dim=384,
      max_len=256))
  config.data = ml_collections.ConfigDict(dict(
      mix=(('attribute', 0.5), (args.get('english', 'fortunes'), 0.5)),
      train_bytes=3_000_000,
      eval_bytes=100_000,
      seq_len=128,
  ))

  decoder_blocks.local_mesh(config)
  config.batch_size = 32
  config.eval_batch_size = 64
  config.num_steps = 2500
  decoder_blocks.local_training(config, weight_decay=0.05)

  if 'forgetting' in args:
    # The pretraining of the forgetting study (studies.lm_forgetting):
    # a smaller LM on Python's documentation alone (always present), so
    # that 5 variants x 3 seeds fit on a CPU; post-training then moves it
    # to another distribution.
    config.model.update(dict(d_model=64, num_layers=2, num_heads=2,
                             mlp_dim=192, max_len=128))
    config.data.update(dict(mix=(('pydoc', 1.0),), train_bytes=1_000_000,
                            eval_bytes=50_000, seq_len=64))
    config.num_steps = 2000

  tokenizer = args.get('tokenizer', 'byte')
  if tokenizer == 'sentencepiece':
    # Absent for bytes: the configs of runs from before subwords stay equal.
    vocab = 384 if 'runlocal' in args else 1024
    config.tokenizer = ml_collections.ConfigDict(dict(
        kind='sentencepiece', vocab_size=vocab, model_type='bpe'))
    config.model.vocab_size = vocab
  elif tokenizer != 'byte':
    raise ValueError(f'configs/lm.py: tokenizer={tokenizer!r}; valid: byte, '
                     'sentencepiece')

  if 'size' in args:
    if tokenizer != 'byte' or 'forgetting' in args:
      raise ValueError('configs/lm.py: size= sets its own tokenizer and '
                       'model; it combines with runlocal and english= only')
    _size(config, args['size'])
  if 'runlocal' in args and 'size' in args:
    # The size's layout (GQA, bfloat16, remat, FSDP rules) at toy scale.
    config.model.update(dict(vocab_size=384, d_model=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, mlp_dim=128,
                             max_len=64))
    config.tokenizer.vocab_size = 384
    config.mesh.shape = (-1, 2)
    config.data.update(dict(train_bytes=40_000, eval_bytes=6_000, seq_len=32,
                            mix=(('attribute', 0.5), ('pydoc', 0.5))))
    config.batch_size = 16
    config.eval_batch_size = 32
    config.num_steps = 30
    config.optimizer.warmup_steps = 5
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
  elif 'runlocal' in args:
    config.model.update(dict(d_model=32, num_layers=2, num_heads=2,
                             mlp_dim=64, max_len=256))
    config.data.update(dict(train_bytes=40_000, eval_bytes=6_000, seq_len=32))
    if 'english' not in args and 'forgetting' not in args:
      config.data.mix = (('attribute', 0.5), ('pydoc', 0.5))
    config.batch_size = 16
    config.eval_batch_size = 32
    config.num_steps = 30
    config.optimizer.warmup_steps = 5
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
  return config
