"""The supervised warm start of the RL policy (`config.task = 'rl_sft'`).

The decoder LM (`train.lm.decoder`) learns to complete task prompts with
their answers on the shared loop (`train.loop`: mesh, optax chain,
checkpoints, resume, metrics). Each example is one problem, BOS +
prompt + answer + newline, right-padded; the loss is the cross-entropy
of the answer tokens only (the prompt's random digits are not a thing to
predict), and the reported accuracy is the share of problems whose every
answer token is the argmax under teacher forcing. Difficulties are mixed
uniformly (`config.data.difficulties`, per family).

At the end, pass@1 by greedy decoding on each difficulty's held-out set
(`train.rl.tasks.evaluation_set`) is written to `<workdir>/pass_at_1.json`
and added to the final metrics as `pass_at_1_<family>_d<k>`. The RL run
starts from this checkpoint (`load_policy`).
"""

from collections.abc import Sequence
import dataclasses
import functools
import json
from typing import Any

from absl import logging
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from train import experiment as experiment_lib
from train import fileio
from train import loop
from train.errors import ConfigError
from train.lm import decoder as decoder_lm
from train.lm import trainer as lm_trainer
from train.rl import rollout
from train.rl import tasks

PASS_AT_1 = 'pass_at_1.json'
TASK = 'rl_sft'


@dataclasses.dataclass(frozen=True)
class Examples:
  """(N, L + 1) uint8 tokens and (N, L) uint8 answer masks (an `input_pipeline.Split`)."""
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


def encode(problems: list[tasks.Problem], length: int) -> Examples:
  tokens = np.full((len(problems), length + 1), tasks.PAD, np.uint8)
  mask = np.zeros((len(problems), length), np.uint8)
  for i, p in enumerate(problems):
    prompt = [tasks.BOS] + list(p.prompt.encode())
    full = prompt + list(p.target.encode())
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
  config, so `check_data` has nothing to check."""
  del check_data
  check_config(config)
  model = lm_trainer.create_model(config)
  length = sequence_length(config.data)
  return experiment_lib.assemble(
      config, workdir, model=model,
      init_variables=functools.partial(lm_trainer.init_variables, model),
      per_example=sft_loss,
      columns={'tokens': ((length + 1,), np.uint8),
               'loss_mask': ((length,), np.uint8)},
      devices=devices)


def load_data(config: ml_collections.ConfigDict) -> loop.Data:
  length = sequence_length(config.data)
  train = encode(_mixture(config.data, config.data.train_examples,
                          config.seed), length)
  heldout = heldout_problems(config.data)
  validation = encode([p for ps in heldout.values() for p in ps], length)
  logging.info('SFT data: %d training problems, %d held out', len(train),
               len(validation))

  def final():
    splits = {'val': validation}
    splits.update({f'val_{name}': encode(ps, length)
                   for name, ps in heldout.items()})
    splits['test'] = validation
    return splits

  return loop.Data(train=train, validation=validation, final=final)


def evaluate_pass_at_1(config: ml_collections.ConfigDict,
                       model: decoder_lm.DecoderLM, params) -> dict[str, float]:
  """Greedy pass@1 on each held-out set: {'<family>_d<k>': share}."""
  return {name: rollout.pass_at_1(model, params, problems)
          for name, problems in heldout_problems(config.data).items()}


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains the warm start into `workdir` (resuming) and measures pass@1.

  Returns the loop's final metrics plus `pass_at_1_<family>_d<k>`.
  """
  exp = build(config, workdir)
  final = dict(loop.train_and_evaluate(exp, functools.partial(load_data,
                                                              config)))
  path = fileio.join(exp.workdir, PASS_AT_1)
  if fileio.exists(path):
    scores = json.loads(fileio.read_text(path))
  else:
    _, model, params = load_policy(exp.workdir)
    scores = evaluate_pass_at_1(config, model, params)
    fileio.write_text_atomic(path, json.dumps(scores, indent=1,
                                              sort_keys=True) + '\n')
  for name, value in scores.items():
    logging.info('pass@1 %s: %.3f', name, value)
  final.update({f'pass_at_1_{k}': v for k, v in scores.items()})
  return final


def _hint(sft_workdir: str) -> str:
  return ('train the warm start first with `python -m launch.train '
          f'--config=configs/rl_sft.py --workdir={sft_workdir}`')


def check_has_checkpoints(sft_workdir: str) -> None:
  """UsageError unless `sft_workdir` has a checkpoints directory (cheap: no
  checkpoint is read)."""
  experiment_lib.require_checkpoints(sft_workdir, field='config.sft_workdir',
                                     hint=_hint(sft_workdir))


def load_policy(sft_workdir: str) -> tuple[ml_collections.ConfigDict,
                                           decoder_lm.DecoderLM, dict]:
  """The config, model and parameters of the newest good checkpoint of an
  SFT run.

  Raises:
    UsageError: `sft_workdir` holds no checkpoint, or not an SFT run's.
    NoGoodCheckpoint: it holds checkpoints and none loads and verifies.
  """
  run = experiment_lib.load_trained(
      sft_workdir, build, field='config.sft_workdir', task=TASK,
      what=f'an {TASK!r} run', hint=_hint(sft_workdir))
  logging.info('Loaded the SFT policy at step %d from %s', run.step,
               sft_workdir)
  return run.config, run.exp.model, run.state.params
