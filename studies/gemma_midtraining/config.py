r"""The study's two trainer configs: mid-training and post-training.

  python -m studies.gemma_midtraining \
      --config=studies/gemma_midtraining/config.py \
      --workdir=workdirs/gemma_midtraining

`midtrain`: configs/gemma.py:finetune,frozen continued on Python's
documentation alone (training split; the held-out windows are its test
split and template reviews, so no evaluated text is trained on), 50 steps
of 8 windows of 64 tokens (25,600 tokens) at the repository's
fine-tuning rate (AdamW 3e-5, 10% warmup, cosine to 10%, clipping at 1).
`posttrain`: the Gemma forgetting study's arithmetic fine-tune
(configs/gemma.py:sft,frozen) shortened to 50 steps. Both sizes are a CPU
budget (README.md: a mid-training step of 512 tokens costs about 4 s on
2 cores, the 262k-token unembedding dominating). `runlocal` shrinks both
for tests. Any field can be overridden
(`--config.midtrain.num_steps=120 --config.posttrain.optimizer.learning_rate=1e-5`);
`--config.midtrain.model.gguf=` and `--config.posttrain.model.gguf=` must
name the same file.
"""

import ml_collections

from configs import gemma


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  runlocal = 'runlocal' in (arg or '').split(',')
  extra = ['runlocal'] if runlocal else []
  mid = gemma.get_config(','.join(['finetune', 'frozen'] + extra))
  # General text only: the documentation's training split.
  mid.data.mix = (('pydoc', 1.0),)
  post = gemma.get_config(','.join(['sft', 'frozen'] + extra))
  if not runlocal:
    mid.num_steps = post.num_steps = 50
    mid.batch_size = 8
    mid.data.seq_len = 64
    # The trainer's validation CE is not a measure of the study: a small
    # split, evaluated at the end only.
    mid.data.eval_bytes = 10_000
    mid.optimizer.warmup_steps = post.optimizer.warmup_steps = 5
    mid.eval_every = post.eval_every = 50
    mid.checkpoint_every = post.checkpoint_every = 25
    mid.log_every = post.log_every = 5
  return ml_collections.ConfigDict(dict(midtrain=mid, posttrain=post))
