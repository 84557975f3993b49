"""Arithmetic tasks with verifiable rewards and difficulty levels.

A problem is a byte prompt such as `BOS "4821+377="` whose answer, the
digits of the result then a newline, the policy generates. Two families:

- 'add': the sum of two numbers of `difficulty` digits each;
- 'mul': a number of `difficulty` digits times a one-digit number.

Difficulty 1..`MAX_DIFFICULTY` sets the digits, so both the answer's
length (the tokens an actor generates) and the carries to track grow with
it. The verifier executes the prompt's expression (`evaluate`, an
arithmetic-only interpreter over Python's parse tree, not `eval`) and
compares it with the integer the completion spells before its newline:
reward 1 for the exact result followed by the newline, 0 otherwise,
including an answer with leading zeros, a sign, anything besides digits,
or no newline (the generation budget, `max_answer_tokens`, always leaves
room for it).

Text becomes tokens through a `Codec`: the in-project policies' bytes
(`BYTES`: BOS 1, PAD 0, each character its byte), or a pretrained
model's tokenizer (`codec`: Gemma's, which splits digits one per token).
A codec maps each character of the tasks' alphabet (digits, '+', '*',
'=', newline) to one token of its own, so prompt and answer lengths are
the same in tokens for every codec (`max_prompt_tokens`,
`max_answer_tokens`), and a completion ends at the first token whose text
holds a newline (for Gemma also '\n\n' and its other newline pieces).

Generation is a pure function of (family, difficulty, seed, index), so a
resumed run draws the same problems. Held-out sets: a problem is `'eval'`
when a hash of its expression falls in the lowest tenth, and training
draws (`sample`) skip those; every difficulty of at least 2 digits has
held-out problems that no training batch or SFT example contains. At one
digit the space is 100 problems ('add') or 80 ('mul', multipliers
2-9); there the evaluation set is the whole space, trained on as well,
and `heldout` says so.
"""

import ast
import dataclasses
import functools
import hashlib
import operator
import re
from typing import Any, Sequence

import numpy as np

from train.errors import ConfigError

FAMILIES = ('add', 'mul')
MAX_DIFFICULTY = 6
EOS = ord('\n')
BOS = 1
PAD = 0
# The share of each difficulty's problems held out for evaluation.
HELDOUT_FRACTION = 0.1

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub,
              ast.Mult: operator.mul}
_SYMBOL = {'add': '+', 'mul': '*'}


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance: `prompt` (the expression and '='), the exact `answer`."""
  family: str
  difficulty: int
  expression: str
  answer: str

  @property
  def prompt(self) -> str:
    return self.expression + '='

  @property
  def target(self) -> str:
    """The completion that earns reward 1: the answer and the newline."""
    return self.answer + '\n'


# Every character a prompt or a correct answer holds.
ALPHABET = '0123456789+*=\n'


@dataclasses.dataclass(frozen=True, eq=False)
class Codec:
  """Task text <-> a policy's token ids (see the module docstring).

  Attributes:
    name: 'bytes', or the tokenizer's fingerprint.
    bos, pad: the ids that start a prompt and fill its left padding.
    ids: the id of each character of `ALPHABET`.
    ends: (vocab,) bool, the ids whose text holds a newline (a completion
      ends at the first).
    text: id -> its text, for ids outside `ids` (a policy may generate any
      token).
  """
  name: str
  bos: int
  pad: int
  ids: dict[str, int]
  ends: np.ndarray
  text: Any

  def encode(self, text: str) -> list[int]:
    return [self.ids[c] for c in text]

  def decode(self, tokens: Sequence[int]) -> str:
    """The text of `tokens` up to and including the first newline token."""
    chars = {v: k for k, v in self.ids.items()}
    out = []
    for t in tokens:
      t = int(t)
      out.append(chars[t] if t in chars else self.text(t))
      if 0 <= t < len(self.ends) and self.ends[t]:
        break
    return ''.join(out)


def _byte_text(t: int) -> str:
  return chr(t) if 0 <= t < 128 else '\ufffd'


BYTES = Codec('bytes', BOS, PAD, {c: ord(c) for c in ALPHABET},
              np.arange(256) == EOS, _byte_text)


def codec(tokenizer) -> Codec:
  """The codec of a pretrained tokenizer (`encode`, `decode`, `bos_id`,
  `pad_id`, `vocab_size`); bytes for the in-project byte tokenizer.

  Raises:
    ValueError: a character of `ALPHABET` is not one token of its own, or
      a problem's text does not tokenize character by character.
  """
  if getattr(tokenizer, 'kind', None) == 'byte':
    return BYTES
  if tokenizer.fingerprint not in _CODECS:
    _CODECS[tokenizer.fingerprint] = _codec(tokenizer)
  return _CODECS[tokenizer.fingerprint]


# A stretch of a prompt (digits, an operator between digits, '=' last) or
# of an answer (digits, then the newline).
_TASK_WINDOW = re.compile(r'\d*(?:[+*]\d+)?=?|\d*[+*]|\d*\n?')
# fingerprint -> codec: a vocabulary's newline ids are found once.
_CODECS: dict[str, Codec] = {}


def _codec(tokenizer) -> Codec:
  ids = {}
  for c in ALPHABET:
    encoded = [int(t) for t in tokenizer.encode(c)]
    if len(encoded) != 1 or tokenizer.decode(encoded) != c:
      raise ValueError(f'the tokenizer makes {encoded} of {c!r}: the tasks '
                       'need each character as one token')
    ids[c] = encoded[0]
  # Every window of two and three characters a prompt ('12+34=') or an
  # answer ('46\n') can hold, and whole problems: a merge of any of them
  # would change the lengths the tasks promise. (Gemma merges '++' and
  # '\n\n', which no task text holds.)
  windows = [a + b for a in ALPHABET for b in ALPHABET]
  windows += [a + b + c for a in ALPHABET for b in ALPHABET for c in ALPHABET]
  texts = [w for w in windows if _TASK_WINDOW.fullmatch(w)]
  for text in texts + ['4821+377=', '5198\n', '9*7=', '63\n']:
    if [int(t) for t in tokenizer.encode(text)] != [ids[c] for c in text]:
      raise ValueError(f'the tokenizer does not split {text!r} character '
                       'by character')
  text = functools.lru_cache(maxsize=None)(
      lambda t: tokenizer.decode([t]))
  ends = np.array(['\n' in text(t) for t in range(tokenizer.vocab_size)])
  return Codec(tokenizer.fingerprint, int(tokenizer.bos_id),
               int(getattr(tokenizer, 'pad_id', PAD)), ids, ends, text)


def check(family: str, difficulty: int, field: str = 'task') -> None:
  """ConfigError naming `field` for an unknown family or difficulty."""
  if family not in FAMILIES:
    raise ConfigError(f'{field}.family', family, 'unknown task family',
                      FAMILIES)
  if (not isinstance(difficulty, (int, np.integer))
      or not 1 <= difficulty <= MAX_DIFFICULTY):
    raise ConfigError(f'{field}.difficulty', difficulty,
                      f'must be an integer in 1..{MAX_DIFFICULTY}')


def evaluate(expression: str) -> int:
  """The value of an integer expression of +, - and * (ValueError otherwise)."""
  def value(node):
    if isinstance(node, ast.Expression):
      return value(node.body)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.left), value(node.right))
    # (A parsed literal is never negative: '-3' is a unary operation.)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    raise ValueError(f'not an integer arithmetic expression: {expression!r}')
  try:
    tree = ast.parse(expression, mode='eval')
  except SyntaxError:
    raise ValueError(f'not an expression: {expression!r}') from None
  return value(tree)


def reward(problem: Problem, completion: str) -> float:
  """1.0 if `completion` is the expression's value in canonical decimal
  digits followed by a newline (what follows the newline is ignored)."""
  if '\n' not in completion:
    return 0.0
  answer = completion.split('\n', 1)[0]
  if not answer or not answer.isascii() or not answer.isdigit():
    return 0.0
  if answer != str(int(answer)):  # Leading zeros are not the answer.
    return 0.0
  return float(int(answer) == evaluate(problem.expression))


def is_heldout(expression: str) -> bool:
  digest = hashlib.sha256(expression.encode()).digest()
  return int.from_bytes(digest[:8], 'little') < HELDOUT_FRACTION * 2**64


def heldout(difficulty: int) -> bool:
  """Whether `difficulty`'s evaluation problems are kept out of training."""
  return difficulty >= 2


def _operands(family: str, difficulty: int, rng: np.random.Generator
              ) -> tuple[int, int]:
  low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
  a = int(rng.integers(low, 10 ** difficulty))
  if family == 'add':
    return a, int(rng.integers(low, 10 ** difficulty))
  return a, int(rng.integers(2, 10))


def _problem(family: str, difficulty: int, a: int, b: int) -> Problem:
  expression = f'{a}{_SYMBOL[family]}{b}'
  return Problem(family, difficulty, expression, str(evaluate(expression)))


def _rng(family: str, difficulty: int, seed: int, stream: str
         ) -> np.random.Generator:
  return np.random.default_rng(
      [seed, FAMILIES.index(family), difficulty,
       int.from_bytes(stream.encode(), 'little')])


def sample(family: str, difficulty: int, n: int, seed: int) -> list[Problem]:
  """`n` training problems (held-out ones skipped), a pure function of the
  arguments; problems may repeat (draws with replacement)."""
  check(family, difficulty)
  rng = _rng(family, difficulty, seed, 'train')
  out = []
  while len(out) < n:
    p = _problem(family, difficulty, *_operands(family, difficulty, rng))
    if not (heldout(difficulty) and is_heldout(p.expression)):
      out.append(p)
  return out


def evaluation_set(family: str, difficulty: int, n: int,
                   seed: int = 0) -> list[Problem]:
  """`n` distinct held-out problems (every problem of the space, if it has
  fewer; see the module docstring for one digit)."""
  check(family, difficulty)
  if not heldout(difficulty):
    space = [_problem(family, difficulty, a, b)
             for a in range(10)
             for b in (range(10) if family == 'add' else range(2, 10))]
    return space[:n] if n < len(space) else space
  rng = _rng(family, difficulty, seed, 'eval')
  seen, out = set(), []
  for _ in range(1000 * n):
    p = _problem(family, difficulty, *_operands(family, difficulty, rng))
    if p.expression not in seen and is_heldout(p.expression):
      seen.add(p.expression)
      out.append(p)
      if len(out) == n:
        break
  return out


def max_prompt_tokens(family: str, difficulty: int) -> int:
  """The longest BOS + prompt at `difficulty` (every prompt of 'add' at
  two digits or more has it)."""
  digits = difficulty if family == 'add' else 1
  return 1 + difficulty + 1 + digits + 1  # BOS a op b =


def max_answer_tokens(family: str, difficulty: int) -> int:
  """The longest target (answer digits and the newline) at `difficulty`."""
  top = 10 ** difficulty - 1
  largest = top + top if family == 'add' else top * 9
  return len(str(largest)) + 1


def encode_prompts(problems: Sequence[Problem], length: int | None = None,
                   codec: Codec = BYTES) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded BOS + prompt tokens: (tokens (n, length) int32, valid bool)."""
  encoded = [[codec.bos] + codec.encode(p.prompt) for p in problems]
  length = length or max(len(e) for e in encoded)
  if any(len(e) > length for e in encoded):
    raise ValueError(f'length={length}: a prompt has '
                     f'{max(len(e) for e in encoded)} tokens')
  tokens = np.full((len(problems), length), codec.pad, np.int32)
  valid = np.zeros((len(problems), length), bool)
  for i, e in enumerate(encoded):
    tokens[i, length - len(e):] = e
    valid[i, length - len(e):] = True
  return tokens, valid


def decode_completion(tokens: Sequence[int], codec: Codec = BYTES) -> str:
  """The text of generated tokens up to and including the first newline."""
  return codec.decode(tokens)


def completion_mask(tokens: np.ndarray, codec: Codec = BYTES) -> np.ndarray:
  """(batch, steps) bool: generated tokens up to and including the first
  that ends a completion."""
  is_end = codec.ends[np.clip(tokens, 0, len(codec.ends) - 1)] & (
      (tokens >= 0) & (tokens < len(codec.ends)))
  before = np.cumsum(is_end, axis=1) - is_end  # Ends strictly before.
  return before == 0
