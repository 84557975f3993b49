"""The supervised warm start of the RL policy (`config.task = 'rl_sft'`).

An LM (`train.lm.models`: the in-project decoder from scratch in bytes, or
a pretrained Gemma 3 fine-tuned in its own tokens, its file pinned by
SHA-256) learns to complete task prompts with
their answers on the shared loop (`train.training.loop`: mesh, optax chain,
checkpoints, resume, metrics). Each example is one problem, BOS +
prompt + answer + newline, right-padded; the loss is the cross-entropy
of the answer tokens only (the prompt's random digits are not a thing to
predict), and the reported accuracy is the share of problems whose every
answer token is the argmax under teacher forcing. Difficulties are mixed
uniformly (`config.data.difficulties`, per family).

At the end, pass@1 by greedy decoding on each difficulty's held-out set
(`train.rl.tasks.evaluation_set`) is written to `<workdir>/pass_at_1.json`
and added to the final metrics as `pass_at_1_<family>_d<k>`. The RL run
starts from this checkpoint (`load_policy`: the model, its parameters and
the codec of its tokens, `train.rl.tasks.Codec`).

`config.init_from` (optional) names an LM run's workdir (`config.task =
'lm'`, e.g. a Gemma continued on text): a new run starts from its latest
verified parameters with a fresh optimizer state, post-training a
mid-trained model. Its parameters are pinned by content (a resume from
a source that trained on since is refused), and its tokenizer must be
this run's.
"""

from collections.abc import Sequence
import dataclasses
import functools
import json
from typing import Any, NamedTuple

from absl import logging
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from train.training import experiment as experiment_lib
from train import fileio
from train.training import loop
from train.run import checksums
from train.run import resume_check
from train.errors import ConfigError
from train.lm import models
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.rl import rollout
from train.rl import tasks

PASS_AT_1 = 'pass_at_1.json'
TASK = 'rl_sft'


@dataclasses.dataclass(frozen=True)
class Examples:
  """(N, L + 1) tokens (uint8 bytes, or the vocabulary's dtype) and (N, L)
  uint8 answer masks (an `input_pipeline.Split`)."""
  tokens: np.ndarray
  loss_mask: np.ndarray

  def __len__(self) -> int:
    return len(self.tokens)

  def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return {'tokens': self.tokens[indices],
            'loss_mask': self.loss_mask[indices]}

  def columns(self) -> dict[str, np.ndarray]:
    return {'tokens': self.tokens, 'loss_mask': self.loss_mask}


def sequence_length(data: ml_collections.ConfigDict) -> int:
  """L: the tokens of the longest BOS + prompt + target, less one."""
  longest = max(tasks.max_prompt_tokens(f, d) + tasks.max_answer_tokens(f, d)
                for f in data.families for d in data.difficulties)
  return longest - 1


def check_config(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the field for a bad `config.data`."""
  data = config.data
  if not data.families:
    raise ConfigError('data.families', data.families, 'needs a family',
                      tasks.FAMILIES)
  if not data.difficulties:
    raise ConfigError('data.difficulties', data.difficulties,
                      f'needs a difficulty in 1..{tasks.MAX_DIFFICULTY}')
  for family in data.families:
    for d in data.difficulties:
      tasks.check(family, d, field='data')
  for field in ('train_examples', 'eval_examples'):
    if not isinstance(data[field], int) or data[field] <= 0:
      raise ConfigError(f'data.{field}', data[field],
                        'must be a positive integer')
  if sequence_length(data) + 1 > config.model.max_len:
    raise ConfigError('model.max_len', config.model.max_len,
                      f'must hold {sequence_length(data) + 1} tokens')


def token_dtype(config: ml_collections.ConfigDict) -> type:
  return lm_tokenizer.token_dtype(models.vocab_size(config))


def encode(problems: list[tasks.Problem], length: int,
           codec: tasks.Codec = tasks.BYTES, dtype: type = np.uint8
           ) -> Examples:
  tokens = np.full((len(problems), length + 1), codec.pad, dtype)
  mask = np.zeros((len(problems), length), np.uint8)
  for i, p in enumerate(problems):
    prompt = [codec.bos] + codec.encode(p.prompt)
    full = prompt + codec.encode(p.target)
    tokens[i, :len(full)] = full
    # Target t of position j is tokens[j + 1]: the answer's targets.
    mask[i, len(prompt) - 1:len(full) - 1] = 1
  return Examples(tokens, mask)


def _mixture(data: ml_collections.ConfigDict, n: int, seed: int
             ) -> list[tasks.Problem]:
  cells = [(f, d) for f in data.families for d in data.difficulties]
  share = [n // len(cells) + (i < n % len(cells)) for i in range(len(cells))]
  problems = [p for (f, d), k in zip(cells, share)
              for p in tasks.sample(f, d, k, seed)]
  order = np.random.default_rng([seed, 7]).permutation(len(problems))
  return [problems[i] for i in order]


def heldout_problems(data: ml_collections.ConfigDict
                     ) -> dict[str, list[tasks.Problem]]:
  """'<family>_d<k>' -> that difficulty's evaluation problems."""
  return {f'{f}_d{d}': tasks.evaluation_set(f, d, data.eval_examples)
          for f in data.families for d in data.difficulties}


def sft_loss(model, variables, batch, train: bool):
  """Answer-token cross-entropy and teacher-forced exact match, per example."""
  del train
  tokens = batch['tokens'].astype(jnp.int32)
  mask = batch['loss_mask'].astype(jnp.float32)
  logits, _ = model.apply({'params': variables['params']}, tokens[:, :-1])
  targets = tokens[:, 1:]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  loss = jnp.sum(losses * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
  wrong = (jnp.argmax(logits, -1) != targets) & (mask > 0)
  exact = 1.0 - jnp.any(wrong, -1).astype(jnp.float32)
  return loss, exact, variables['batch_stats']


def build(config: ml_collections.ConfigDict, workdir: str, *,
          devices: Sequence[Any] | None = None,
          check_data: bool = True) -> experiment_lib.Experiment:
  """Validates `config` and builds the parts; nothing placed or compiled.
  `devices`: the mesh's (default: this job's); the data is built from the
  config, and `check_data=False` skips only the check that a pretrained
  model's file is here (compiling needs shapes only)."""
  check_config(config)
  model = lm_trainer.create_model(config)
  lm_tokenizer.check_config(config)
  if check_data:
    models.check_inputs(config)
    if config.get('init_from'):
      experiment_lib.require_checkpoints(
          config.init_from, field='config.init_from',
          hint='train the LM run to start from first')
  length = sequence_length(config.data)
  return experiment_lib.assemble(
      config, workdir, model=model,
      init_variables=functools.partial(lm_trainer.init_variables, model),
      per_example=sft_loss,
      columns={'tokens': ((length + 1,), token_dtype(config)),
               'loss_mask': ((length,), np.uint8)},
      devices=devices)


def load_data(config: ml_collections.ConfigDict, workdir: str) -> loop.Data:
  tokenizer = lm_tokenizer.for_run(config, workdir)
  codec = _codec(tokenizer, config)
  length = sequence_length(config.data)
  enc = functools.partial(encode, length=length, codec=codec,
                          dtype=token_dtype(config))
  train = enc(_mixture(config.data, config.data.train_examples, config.seed))
  heldout = heldout_problems(config.data)
  validation = enc([p for ps in heldout.values() for p in ps])
  logging.info('SFT data: %d training problems, %d held out (%s tokens)',
               len(train), len(validation), tokenizer.kind)

  def final():
    splits = {'val': validation}
    splits.update({f'val_{name}': enc(ps) for name, ps in heldout.items()})
    splits['test'] = validation
    return splits

  return loop.Data(train=train, validation=validation, final=final,
                   fingerprints=_token_fingerprints(tokenizer))


def _token_fingerprints(tokenizer) -> dict[str, str]:
  # Byte runs recorded none before pretrained models: their checkpoints
  # stay valid.
  if isinstance(tokenizer, lm_tokenizer.ByteTokenizer):
    return {}
  return {lm_tokenizer.FILENAME: tokenizer.fingerprint}


def _codec(tokenizer, config) -> tasks.Codec:
  try:
    return tasks.codec(tokenizer)
  except ValueError as e:
    raise ConfigError('model', models.kind(config), str(e)) from None


def evaluate_pass_at_1(config: ml_collections.ConfigDict, model, params,
                       codec: tasks.Codec = tasks.BYTES) -> dict[str, float]:
  """Greedy pass@1 on each held-out set: {'<family>_d<k>': share}."""
  return {name: rollout.pass_at_1(model, params, problems, codec=codec)
          for name, problems in heldout_problems(config.data).items()}


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains the warm start into `workdir` (resuming) and measures pass@1.

  Returns the loop's final metrics plus `pass_at_1_<family>_d<k>`.
  """
  exp = build(config, workdir)
  inputs = dict(models.fingerprints(config))
  if config.get('init_from'):
    source = _source(config)
    inputs['config.init_from'] = checksums.digest(source.params)
    initial = lambda: {'params': source.params}
  elif models.kind(config) == 'decoder':
    initial = None
  else:
    pretrained = functools.cache(lambda: models.pretrained(config))
    initial = lambda: {'params': pretrained().params}
  final = dict(loop.train_and_evaluate(
      exp, functools.partial(load_data, config, exp.workdir), initial,
      inputs=inputs))
  path = fileio.join(exp.workdir, PASS_AT_1)
  if fileio.exists(path):
    scores = json.loads(fileio.read_text(path))
  else:
    policy = load_policy(exp.workdir)
    scores = evaluate_pass_at_1(config, policy.model, policy.params,
                                policy.codec)
    fileio.write_text_atomic(path, json.dumps(scores, indent=1,
                                              sort_keys=True) + '\n')
  for name, value in scores.items():
    logging.info('pass@1 %s: %.3f', name, value)
  final.update({f'pass_at_1_{k}': v for k, v in scores.items()})
  return final


def _source(config: ml_collections.ConfigDict) -> lm_trainer.TrainedLM:
  """The LM run `config.init_from`, its tokenizer checked against the
  one this config reads (ConfigError naming init_from otherwise)."""
  source = lm_trainer.load_trained(config.init_from)
  own = (lm_tokenizer.ByteTokenizer() if models.kind(config) == 'decoder'
         else models.tokenizer(config))
  if source.tokenizer.fingerprint != own.fingerprint:
    raise ConfigError('init_from', config.init_from,
                      f'its tokenizer ({source.tokenizer.kind}) is not this '
                      f"config's ({own.kind}): post-train a run of the "
                      'same model file')
  return source


def _hint(sft_workdir: str) -> str:
  return ('train the warm start first with `python -m launch.train '
          f'--config=configs/rl_sft.py --workdir={sft_workdir}`')


def check_has_checkpoints(sft_workdir: str) -> None:
  """UsageError unless `sft_workdir` has a checkpoints directory (cheap: no
  checkpoint is read)."""
  experiment_lib.require_checkpoints(sft_workdir, field='config.sft_workdir',
                                     hint=_hint(sft_workdir))


class Policy(NamedTuple):
  """An SFT run's policy: its config, model, parameters and token codec."""
  config: ml_collections.ConfigDict
  model: Any
  params: Any
  codec: tasks.Codec


def load_policy(sft_workdir: str) -> Policy:
  """The policy of the newest good checkpoint of an SFT run; its tokens'
  codec from the tokenizer the checkpoint recorded (bytes, or a
  pretrained model's kept in the workdir).

  Raises:
    UsageError: `sft_workdir` holds no checkpoint, or not an SFT run's,
      or its tokenizer file is missing or not the checkpoint's.
    NoGoodCheckpoint: it holds checkpoints and none loads and verifies.
  """
  run = experiment_lib.load_trained(
      sft_workdir, build, field='config.sft_workdir', task=TASK,
      what=f'an {TASK!r} run', hint=_hint(sft_workdir))
  recorded = (run.meta.get(resume_check.FINGERPRINTS) or {}).get(
      lm_tokenizer.FILENAME)
  tokenizer = lm_tokenizer.for_trained(run.config, sft_workdir, recorded)
  logging.info('Loaded the SFT policy at step %d from %s (%s tokens)',
               run.step, sft_workdir, tokenizer.kind)
  return Policy(run.config, run.exp.model, run.state.params,
                _codec(tokenizer, run.config))
