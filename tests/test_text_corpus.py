"""Text corpus: byte codec, grammar, MC tasks, English sources, packing."""

import os
import re

import numpy as np
import pytest

from train.lm import corpus as tc

POS = tc.POSITIVE_SENTENCES
NEG = tc.NEGATIVE_SENTENCES
NEUTRAL = frozenset(tc.NEUTRAL_SENTENCES)


def sentences(text):
  # Every grammar sentence ends with '.', and sentences are joined by ' '.
  return re.split(r'(?<=\.) ', text)


def test_encode_decode_roundtrip_and_special_bytes():
  text = 'the soup was lovely.\nnever again!'
  ids = tc.encode(text)
  assert ids.dtype == np.int32 and len(ids) == len(text)
  assert tc.decode(ids) == text
  assert tc.decode(np.concatenate([[tc.BOS], ids, [tc.PAD, tc.PAD]])) == text
  # Non-ASCII and the reserved bytes become '?': BOS only ever marks a start.
  assert tc.decode(tc.encode('caf\u00e9\x01\x00')) == 'caf???'
  assert tc.VOCAB_SIZE == 256 and tc.encode('~').max() < tc.VOCAB_SIZE


def test_pools_are_disjoint_and_large_enough():
  assert not (POS & NEG) and not (POS & NEUTRAL) and not (NEG & NEUTRAL)
  assert len(tc.NOUNS) >= 30 and len(tc.POSITIVE_ADJECTIVES) >= 25
  assert len(tc.POSITIVE_ADJECTIVES) == len(tc.NEGATIVE_ADJECTIVES)
  assert len(tc.POSITIVE_PHRASES) == len(tc.NEGATIVE_PHRASES)


def test_attribute_documents_are_deterministic_balanced_and_agree():
  texts, labels = tc.attribute_documents(400, seed=3)
  again, labels2 = tc.attribute_documents(400, seed=3)
  assert texts == again and np.array_equal(labels, labels2)
  assert tc.attribute_documents(400, seed=4)[0] != texts
  assert labels.dtype == np.int32 and labels.sum() == 200
  for text, label in zip(texts, labels, strict=True):
    sents = sentences(text)
    assert 3 <= len(sents) <= 6 and text == text.lower()
    polar = POS if label else NEG
    assert all(s in polar or s in NEUTRAL for s in sents), text
    assert sum(s in polar for s in sents) >= 3, text
    assert sents[-1] in (tc.POSITIVE_CLOSINGS if label
                         else tc.NEGATIVE_CLOSINGS)


def test_attribute_splits_share_no_document():
  docs = {s: set(tc.attribute_documents(n, 0, s)[0])
          for s, n in (('train', 3000), ('validation', 400), ('test', 400))}
  assert not docs['train'] & docs['validation']
  assert not docs['train'] & docs['test']
  assert not docs['validation'] & docs['test']
  for split, texts in docs.items():
    assert all(tc.split_of(t) == split for t in texts)


def test_contrastive_pairs_differ_only_in_sentiment():
  pairs = tc.contrastive_pairs(100, seed=0)
  assert pairs == tc.contrastive_pairs(100, seed=0) and len(pairs) == 100
  for pos, neg in pairs:
    assert tc.split_of(pos) == tc.split_of(neg) == 'train'
    ps, ns = sentences(pos), sentences(neg)
    assert len(ps) == len(ns)
    for p, n in zip(ps, ns, strict=True):
      assert (p == n and p in NEUTRAL) or (p in POS and n in NEG), (p, n)


@pytest.mark.parametrize('name', ('copa', 'cloze'))  # The template tasks.
def test_mc_items_balanced_and_differ_in_sentiment(name):
  items = tc.mc_task(name, 200, seed=1)
  assert items == tc.mc_task(name, 200, seed=1)
  assert sum(item.label for item in items) == 100
  for item in items:
    pos, neg = item.choices[item.label], item.choices[1 - item.label]
    assert pos in POS and neg in NEG
    assert item.prefix() == item.context + ' '
    assert item.texts()[item.label] == item.context + ' ' + pos
    assert tc.split_of(item.texts()[1 - item.label]) == 'test'
    if name == 'copa':
      assert item.context in tc.PREMISES
      assert abs(len(tc.encode(pos)) - len(tc.encode(neg))) <= 3
    else:
      context = sentences(item.context)
      assert len(context) == 3 and all(s in NEG for s in context)
      assert pos in tc.POSITIVE_CLOSINGS and neg in tc.NEGATIVE_CLOSINGS


def test_mc_splits_share_no_item():
  texts = {s: {t for item in tc.mc_task('cloze', 150, 0, s)
               for t in item.texts()} for s in tc.SPLITS}
  assert not texts['test'] & texts['validation']
  assert not texts['test'] & texts['train']
  # No negative cloze text of the test split is a training document.
  train_docs = set(tc.attribute_documents(2000, 0, 'train')[0])
  assert not texts['test'] & train_docs


def test_bad_names_raise_with_the_argument_named():
  with pytest.raises(ValueError, match=r"name='boolq'.*'copa', 'cloze'"):
    tc.mc_task('boolq', 4, 0)
  with pytest.raises(ValueError, match='split='):
    tc.attribute_documents(4, 0, 'dev')
  with pytest.raises(ValueError, match=r"source='nope'.*'fortunes', 'pydoc'"):
    tc.english_documents('nope', 'train')
  with pytest.raises(ValueError, match='seq_len='):
    tc.pack_windows(['abc'], 0, 0)
  with pytest.raises(ValueError, match='documents='):
    tc.pack_windows(['abc'], 16, 0)
  with pytest.raises(ValueError, match='n='):
    tc.distinct_n(['a b'], 0)


def test_pack_windows_shapes_bos_and_determinism():
  docs = [f'document number {i} here.' for i in range(50)]
  windows = tc.pack_windows(docs, seq_len=31, seed=0)
  total = sum(len(d) + 1 for d in docs)
  assert windows.dtype == np.uint8
  assert windows.shape == (total // 32, 32)
  assert windows[0, 0] == tc.BOS
  np.testing.assert_array_equal(windows, tc.pack_windows(docs, 31, 0))
  assert not np.array_equal(windows, tc.pack_windows(docs, 31, 1))
  # BOS starts every document; only the dropped remainder is missing.
  segments = bytes(windows.ravel()).split(bytes([tc.BOS]))
  assert segments[0] == b''
  whole = [seg.decode() for seg in segments[1:-1]]
  assert len(set(whole)) == len(whole) >= len(docs) - 2
  assert set(whole) <= set(docs) and total - windows.size < 32


def test_mixture_honours_proportions():
  mix = [('attribute', 3.0), ('pydoc', 1.0), ('fortunes', 0.0)]
  docs = tc.mixture_documents(mix, 40_000, 'validation', seed=0)
  size = {s: sum(len(d) + 1 for src, d in docs if src == s) for s, _ in mix}
  assert abs(size['attribute'] - 30_000) <= 1
  assert abs(size['pydoc'] - 10_000) <= 1 and size['fortunes'] == 0
  pydoc_val = set(tc.english_documents('pydoc', 'validation'))
  assert all(any(p.startswith(d) for p in pydoc_val)
             for src, d in docs if src == 'pydoc')
  windows = tc.build_lm_windows(mix, 40_000, 63, 'validation', seed=0)
  assert windows.shape == (40_000 // 64, 64) and windows.dtype == np.uint8
  np.testing.assert_array_equal(
      windows, tc.build_lm_windows(mix, 40_000, 63, 'validation', seed=0))


def test_mixture_cycles_a_small_source(tmp_path):
  (tmp_path / 'a.txt').write_text('one small paragraph.\n\nanother one.\n')
  docs = tc.mixture_documents([(str(tmp_path), 1.0)], 2_000, 'train', 0)
  source_docs = tc.english_documents(str(tmp_path), 'train')
  assert source_docs and sum(d in source_docs for _, d in docs) > 10
  assert all(any(p.startswith(d) for p in source_docs) for _, d in docs)


def test_mixture_bad_weights_and_sources():
  with pytest.raises(ValueError, match=r'mix\[1\]\.weight=-1\.0'):
    tc.build_lm_windows([('attribute', 1.0), ('pydoc', -1.0)], 1000, 7,
                        'train', 0)
  with pytest.raises(ValueError, match=r'mix\[0\]\.weight=nan'):
    tc.build_lm_windows([('pydoc', float('nan'))], 1000, 7, 'train', 0)
  with pytest.raises(ValueError, match='mix=.*all weights are zero'):
    tc.build_lm_windows([('attribute', 0.0)], 1000, 7, 'train', 0)
  with pytest.raises(ValueError, match="source='wiki'"):
    tc.build_lm_windows([('wiki', 1.0)], 1000, 7, 'train', 0)
  with pytest.raises(ValueError, match='total_bytes='):
    tc.build_lm_windows([('attribute', 1.0)], 0, 7, 'train', 0)


def check_english(source):
  docs = {s: tc.english_documents(source, s) for s in tc.SPLITS}
  assert docs == {s: tc.english_documents(source, s) for s in tc.SPLITS}
  everything = [d for s in tc.SPLITS for d in docs[s]]
  assert len(everything) == len(set(everything))  # Disjoint, deduplicated.
  assert 0.8 < len(docs['train']) / len(everything) < 0.97
  for doc in everything:
    assert doc and doc == doc.strip() and '\n\n' not in doc and '  ' not in doc
    assert all(32 <= ord(c) < 127 or c == '\n' for c in doc), repr(doc)
  assert set(tc.english_text(source).split('\n\n')) == set(everything)
  return docs


def test_pydoc_source():
  docs = check_english('pydoc')
  assert any('assert' in d for d in docs['train'])


@pytest.mark.skipif(not os.path.isdir(tc.FORTUNES_DIR),
                    reason='apt-get install fortunes')
def test_fortunes_source():
  docs = check_english('fortunes')
  assert len(docs['train']) > 1000
  assert not any(line.strip() == '%' for s in tc.SPLITS for d in docs[s]
                 for line in d.split('\n'))


def test_missing_fortunes_says_how_to_install(monkeypatch, tmp_path):
  monkeypatch.setattr(tc, 'FORTUNES_DIR', str(tmp_path / 'none'))
  tc._all_documents.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.raises(FileNotFoundError,
                       match=r"apt-get install fortunes.*source='pydoc'"):
      tc.english_documents('fortunes', 'train')
  finally:
    tc._all_documents.cache_clear()  # pylint: disable=protected-access


def test_path_source_reads_paragraphs_of_txt_files(tmp_path):
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'a.txt').write_text('First  para\tline one\nline two.\n\n\n'
                                  'Second \u2014 para.\x07\n')
  (tmp_path / 'sub' / 'b.txt').write_text('Third para.\n\nFirst  para\t'
                                          'line one\nline two.\n')
  (tmp_path / 'c.md').write_text('Not read.\n')
  text = tc.english_text(str(tmp_path))
  assert text == 'First para line one\nline two.\n\nSecond -- para.\n\n' \
      'Third para.'
  single = tc.english_text(str(tmp_path / 'sub' / 'b.txt'))
  assert single == 'Third para.\n\nFirst para line one\nline two.'
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ValueError, match='holds no text'):
    tc.english_text(str(tmp_path / 'empty'))


def test_distinct_n_and_repetition_rate_by_hand():
  texts = ['a b a b', 'a b c']
  # Unigrams: a b a b a b c -> 3 unique of 7; bigrams: ab ba ab ab bc -> 3/5.
  assert tc.distinct_n(texts, 1) == pytest.approx(3 / 7)
  assert tc.distinct_n(texts, 2) == pytest.approx(3 / 5)
  assert tc.distinct_n(['a b'], 3) == 0.0 and tc.distinct_n([], 1) == 0.0
  # Bigrams of 'a b a b': ab ba ab -> 1 of 3 repeats; 'a b c': none; 'x' has
  # no bigram and is left out of the mean.
  assert tc.repetition_rate(texts + ['x'], 2) == pytest.approx((1 / 3) / 2)
  # Trigrams of 'x y z x y z x': xyz yzx zxy xyz yzx -> 2 of 5 repeat.
  assert tc.repetition_rate(['x y z x y z x']) == pytest.approx(2 / 5)
  assert tc.repetition_rate(['too short']) == 0.0
