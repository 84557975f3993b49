"""Arithmetic tasks: the verifier, determinism, held-out sets, difficulty."""

import numpy as np
import pytest

from train.errors import ConfigError
from train.rl import tasks


@pytest.mark.parametrize('family', tasks.FAMILIES)
@pytest.mark.parametrize('difficulty', range(1, tasks.MAX_DIFFICULTY + 1))
def test_answers_are_the_arithmetic_and_only_they_earn_reward(family,
                                                              difficulty):
  for p in tasks.sample(family, difficulty, 40, seed=difficulty):
    a, b = (int(x) for x in p.expression.split('+' if family == 'add'
                                               else '*'))
    assert int(p.answer) == (a + b if family == 'add' else a * b)
    assert len(str(a)) == difficulty
    assert tasks.reward(p, p.target) == 1.0
    assert tasks.reward(p, p.target + '17\n') == 1.0  # After EOS: ignored.
    wrong = str(int(p.answer) + 1)
    for bad in (wrong + '\n', p.answer, '0' + p.answer + '\n',
                '+' + p.answer + '\n', ' ' + p.answer + '\n', '\n', '',
                p.answer + ' \n', p.answer[:-1] + '\n'):
      if bad.split('\n')[0] != p.answer or '\n' not in bad:
        assert tasks.reward(p, bad) == 0.0, (p, bad)
    assert len(p.target) <= tasks.max_answer_tokens(family, difficulty)


def test_the_verifier_executes_the_expression_not_the_stored_answer():
  p = tasks.Problem('add', 2, '12+34', '99')  # A wrong stored answer.
  assert tasks.reward(p, '46\n') == 1.0
  assert tasks.reward(p, '99\n') == 0.0
  assert tasks.reward(p, '\u0664\u0666\n') == 0.0  # Arabic-Indic 46.
  assert tasks.evaluate('7*8-6+1') == 51


@pytest.mark.parametrize('expression', [
    '__import__("os")', 'a+1', '2**10', '10/2', '-3+1', 'print(1)',
    '1+', '1.5+2', 'True+1', '[1]'])
def test_evaluate_refuses_anything_but_integer_arithmetic(expression):
  with pytest.raises(ValueError, match='expression'):
    tasks.evaluate(expression)


def test_generation_is_deterministic_and_seeded():
  a = tasks.sample('add', 4, 50, seed=3)
  assert a == tasks.sample('add', 4, 50, seed=3)
  assert a != tasks.sample('add', 4, 50, seed=4)
  assert a[:20] == tasks.sample('add', 4, 20, seed=3)
  assert tasks.sample('mul', 4, 50, seed=3) != [
      tasks.Problem('mul', 4, p.expression, p.answer) for p in a]
  assert (tasks.evaluation_set('mul', 3, 100)
          == tasks.evaluation_set('mul', 3, 100))


@pytest.mark.parametrize('family', tasks.FAMILIES)
def test_heldout_problems_never_reach_training(family):
  for d in range(2, tasks.MAX_DIFFICULTY + 1):
    # 'mul' at 2 digits has 62 held-out problems: asking for one more
    # still returns them all (the draws give up after 1000 per problem
    # asked for), in 63,000 draws instead of the 150,000 of asking for 150.
    held = tasks.evaluation_set(family, d,
                                63 if (family, d) == ('mul', 2) else 150)
    assert len({p.expression for p in held}) == len(held)
    assert len(held) >= 60  # 'mul' at 2 digits has 62 in its space.
    trained = {p.expression for p in tasks.sample(family, d, 3000, seed=0)}
    assert not trained & {p.expression for p in held}
  # One digit: the whole space, trained on as well (documented).
  assert not tasks.heldout(1)
  assert len(tasks.evaluation_set('add', 1, 1000)) == 100
  assert len(tasks.evaluation_set('mul', 1, 1000)) == 80


def test_cost_grows_with_difficulty():
  for family in tasks.FAMILIES:
    lengths = [tasks.max_answer_tokens(family, d)
               for d in range(1, tasks.MAX_DIFFICULTY + 1)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    mean_answer = [np.mean([len(p.target) for p in tasks.sample(family, d,
                                                                 200, 0)])
                   for d in range(1, tasks.MAX_DIFFICULTY + 1)]
    assert np.all(np.diff(mean_answer) > 0.5)


@pytest.mark.parametrize('family,difficulty,field', [
    ('div', 2, 'task.family'), ('add', 0, 'task.difficulty'),
    ('add', tasks.MAX_DIFFICULTY + 1, 'task.difficulty'),
    ('mul', 2.0, 'task.difficulty')])
def test_bad_task_names_the_field(family, difficulty, field):
  with pytest.raises(ConfigError, match=field.replace('.', r'\.')):
    tasks.sample(family, difficulty, 1, 0)


def test_prompts_are_left_padded_and_completions_end_at_eos():
  problems = tasks.sample('add', 1, 1, 0) + tasks.sample('add', 3, 1, 0)
  tokens, valid = tasks.encode_prompts(problems)
  assert tokens.shape == valid.shape == (2, 1 + len(problems[1].prompt))
  assert tokens[0, -1] == tokens[1, -1] == ord('=')
  assert not valid[0, 0] and valid[0, -len(problems[0].prompt) - 1:].all()
  assert tokens[0, valid[0]][0] == tasks.BOS
  generated = np.array([[ord('7'), tasks.EOS, ord('9'), tasks.EOS],
                        [ord('1'), ord('2'), ord('3'), ord('4')]])
  np.testing.assert_array_equal(tasks.completion_mask(generated),
                                [[1, 1, 0, 0], [1, 1, 1, 1]])
  assert tasks.decode_completion(generated[0]) == '7\n'
  assert tasks.decode_completion([200, 10]) == '\ufffd\n'
  with pytest.raises(ValueError, match='length=3'):
    tasks.encode_prompts(problems, length=3)


@pytest.mark.parametrize('family', tasks.FAMILIES)
def test_max_prompt_tokens_is_the_longest_prompt(family):
  for d in range(1, tasks.MAX_DIFFICULTY + 1):
    # 62 for 'mul' at 2 digits: all its held-out problems, the same ones
    # as asking for 100, without the 100,000 draws that find no more.
    problems = (tasks.sample(family, d, 300, 0) + tasks.evaluation_set(
        family, d, 62 if (family, d) == ('mul', 2) else 100))
    tokens, _ = tasks.encode_prompts(problems)
    assert tokens.shape[1] == tasks.max_prompt_tokens(family, d)


class _Pieces:
  """A tokenizer over a fixed list of pieces, longest match first: enough
  to build codecs that merge characters or hold several newlines."""
  kind = 'pieces'
  bos_id, pad_id = 2, 0

  def __init__(self, pieces):
    self.pieces = ['<pad>', '<eos>', '<bos>'] + list(pieces)
    self.vocab_size = len(self.pieces)
    self.fingerprint = 'pieces:' + '|'.join(self.pieces)

  def encode(self, text):
    out = []
    while text:
      best = max((p for p in self.pieces[3:] if text.startswith(p)), key=len,
                 default=None)
      if best is None:  # Byte fallback of a sort: two ids for a character.
        out += [0, 0]
        text = text[1:]
        continue
      out.append(self.pieces.index(best))
      text = text[len(best):]
    return np.array(out, np.int32)

  def decode(self, ids):
    return ''.join(self.pieces[i] for i in ids if i > 2)


_ALPHABET_PIECES = list(tasks.ALPHABET) + ['x', '\n\n', 'y\nz']


def test_a_tokenizer_codec_maps_each_task_character_to_its_token():
  tok = _Pieces(_ALPHABET_PIECES)
  codec = tasks.codec(tok)
  assert tasks.codec(_Pieces(_ALPHABET_PIECES)) is codec  # One per vocabulary.
  problem = tasks.Problem('add', 2, '12+34', '46')
  tokens, valid = tasks.encode_prompts([problem], 8, codec)
  assert tokens[0, 0] == tok.pad_id
  assert tokens[0, 1:].tolist() == [tok.bos_id] + tok.encode('12+34=').tolist()
  assert valid[0].tolist() == [False] + [True] * 7
  # Every token whose text holds a newline ends a completion.
  ends = [tok.pieces.index(p) for p in ('\n', '\n\n', 'y\nz')]
  assert sorted(np.flatnonzero(codec.ends).tolist()) == ends
  for end in ends:
    completion = np.array([tok.encode('46').tolist() + [end, 7, 8]])
    assert tasks.completion_mask(completion, codec).tolist() == [
        [True, True, True, False, False]]
  # The reward reads the text, whatever the token: '46' + '\n\n' is right,
  # 'x' is not a digit, and ids past the vocabulary are no text at all.
  text = tasks.decode_completion(tok.encode('46').tolist() + [ends[1], 5],
                                 codec)
  assert text == '46\n\n' and tasks.reward(problem, text) == 1.0
  assert tasks.reward(problem, tasks.decode_completion(
      tok.encode('4x\n'), codec)) == 0.0
  assert tasks.completion_mask(np.array([[999, -1, ends[0]]]),
                               codec).tolist() == [[True, True, True]]


@pytest.mark.parametrize('pieces, message', [
    (_ALPHABET_PIECES + ['12'], "split '12'"),
    (_ALPHABET_PIECES + ['5='], "split '5='"),
    (_ALPHABET_PIECES + ['7\n'], "split '7\\\\n'"),
    ([c for c in _ALPHABET_PIECES if c != '='], "of '='"),
])
def test_a_tokenizer_that_merges_task_characters_is_refused(pieces, message):
  with pytest.raises(ValueError, match=message):
    tasks.codec(_Pieces(pieces))


def test_the_byte_codec_is_the_byte_tokenizers():
  from train.lm import tokenizer as lm_tokenizer  # pylint: disable=g-import-not-at-top
  assert tasks.codec(lm_tokenizer.ByteTokenizer()) is tasks.BYTES
  tokens = np.array([[ord('4'), ord('6'), tasks.EOS, ord('1')]])
  assert tasks.completion_mask(tokens).tolist() == [[True] * 3 + [False]]
  assert tasks.decode_completion(tokens[0]) == '46\n'
