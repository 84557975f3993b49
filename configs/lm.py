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
(`python -m launch.forgetting_study`). `english=` picks the real-text
source: 'fortunes' (Debian's `fortunes`
package, `apt-get install fortunes`; the default), 'pydoc' (Python's own
documentation, always present) or a directory of .txt files. `runlocal`
shrinks everything for tests. The steering evaluation reads this run's
checkpoint: `python -m launch.steer_eval --config=configs/steering.py
--config.lm_workdir=workdirs/lm --workdir=workdirs/steer`.
"""

import ml_collections

from configs import config_args
from configs import optimizer_block


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The LM experiment; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/lm.py', {
      'runlocal': 'runlocal', 'english': 'english=SOURCE',
      'forgetting': 'forgetting', 'tokenizer': 'tokenizer=byte|sentencepiece'})
  config = ml_collections.ConfigDict()
  config.task = 'lm'
  config.seed = 0
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

  config.mesh = ml_collections.ConfigDict(
      dict(axes=('data', 'model'), shape=(-1, 1)))
  config.logical_axis_rules = (
      ('batch', 'data'),
      ('vocab', None),
      ('embed', None),
      ('heads', 'model'),
      ('mlp', 'model'),
  )
  config.batch_size = 32
  config.eval_batch_size = 64
  config.num_steps = 2500

  config.optimizer = optimizer_block.optimizer_block(
      name='adamw', learning_rate=3e-3, warmup_steps=100,
      end_lr_fraction=0.05, b2=0.98, eps=1e-9, weight_decay=0.05,
      grad_clip_norm=1.0)
  config.nonfinite = 'stop'
  config.log_every = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.keep_checkpoints = 2

  if 'forgetting' in args:
    # The pretraining of the forgetting study (launch.forgetting_study):
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

  if 'runlocal' in args:
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
