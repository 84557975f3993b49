"""The documentation site builds, documents every public name, and runs.

docs/site.md says what is checked and why. Here:
- the site builds offline with warnings as errors (`make docs`'s command,
  into a temporary folder, once for the module), and its inventory has an
  entry for every public name of geom;
- a public function whose docstring is removed (in a copy of geom and
  docs/) fails the build, naming it; one without an example is reported;
- every study folder with a README has a page in the built site
  (docs/_ext/study_pages.py renders it at build time) with the README's
  title, every row of its tables and its images, linked from
  docs/lab/studies.md;
- every Python block of every page (docs/**/*.md, README.md and the
  studies' READMEs, whose rendered copies under docs/_generated are not
  run twice) runs, a page's blocks in order in one namespace; a block opts
  out only with the fence ```python skip, and is counted;
- every docstring example of geom runs as a doctest, here or in the
  method's own test file (DOCTESTED_ELSEWHERE).
"""

import doctest
import glob
import html.parser
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

from markdown_it import MarkdownIt
import pytest
from sphinx.util.inventory import InventoryFile

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, whose documentation this test builds and runs.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
DOCS = os.path.join(REPO_ROOT, 'docs')


def _load_extension():
  """docs/_ext/geom_docs.py, the site's extension (not a package)."""
  path = os.path.join(DOCS, '_ext', 'geom_docs.py')
  spec = importlib.util.spec_from_file_location('geom_docs', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


geom_docs = _load_extension()

# The pages the site renders from the studies' READMEs at build time
# (docs/_generated, see docs/_ext/study_pages.py) are not pages of their
# own here: their READMEs are, so a README's Python blocks run (or opt out)
# as any page's, whether or not a build has written the copies.
STUDY_READMES = sorted(glob.glob(os.path.join(REPO_ROOT, 'studies', '*',
                                              'README.md')))
PAGES = sorted(
    [os.path.relpath(p, REPO_ROOT) for p in glob.glob(
        os.path.join(DOCS, '**', '*.md'), recursive=True)
     if not {'_build', '_generated'} & set(
         os.path.relpath(p, DOCS).split(os.sep))]
    + [os.path.relpath(p, REPO_ROOT) for p in STUDY_READMES] + ['README.md'])
MODULES = geom_docs.public_modules()
# Modules whose examples a method's own test file runs already.
DOCTESTED_ELSEWHERE = {
    'geom': 'tests/test_geom_api.py',
    'geom.curvature': 'tests/test_geom_api.py',
    'geom.gas': 'tests/test_geom_api.py',
    'geom.hallucination': 'tests/test_geom_api.py',
    'geom.method_hooks': 'tests/test_geom_api.py',
    'geom.validation': 'tests/test_geom_api.py',
    'geom.sam': 'tests/test_sam.py',
    'geom.conga': 'tests/test_conga.py',
    'geom.kernels.sam_perturb': 'tests/test_kernels_sam_perturb.py',
}
SKIP = 'skip'


def _sphinx(srcdir, outdir, keep_going=True):
  """`make docs`'s command; (return code, output, seconds). Not
  `keep_going`: the build stops at the first warning (Sphinx 8.1 made
  going on the default: a planted failure took the whole build, 8-11 s,
  against 2.4)."""
  command = [sys.executable, '-m', 'sphinx', '-W', '-n', '-q', '-b', 'html',
             '-d', os.path.join(outdir, 'doctrees'), srcdir,
             os.path.join(outdir, 'html')]
  command.insert(3, '--keep-going' if keep_going else '--exception-on-warning')
  start = time.perf_counter()
  done = subprocess.run(command, capture_output=True, text=True,
                        timeout=600, check=False)
  return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


@pytest.fixture(scope='module')
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp('site')
  code, output, seconds = _sphinx(DOCS, str(out))
  print(f'site built in {seconds:.1f} s')
  return code, output, out / 'html'


def test_the_site_builds_with_warnings_as_errors(site):
  code, output, html = site
  assert code == 0, output
  assert not output.strip(), output
  for page in ('index.html', 'api/geom.sam.html', 'methods/sam.html'):
    assert (html / page).is_file(), page


class _Page(html.parser.HTMLParser):
  """A built page's h1 and table rows, as text."""

  def __init__(self):
    super().__init__()
    self.h1, self.rows, self.images = [], [], []
    self._in_h1 = self._cell = self._row = None

  def handle_starttag(self, tag, attrs):
    if tag == 'h1':
      self._in_h1 = []
    elif tag == 'tr':
      self._row = []
    elif tag in ('td', 'th') and self._row is not None:
      self._cell = []
    elif tag == 'img':
      self.images.append(dict(attrs)['src'])

  def handle_endtag(self, tag):
    if tag == 'h1' and self._in_h1 is not None:
      # Less the heading's own link, a pilcrow.
      self.h1.append(_text(''.join(self._in_h1).rstrip('¶')))
      self._in_h1 = None
    elif tag in ('td', 'th') and self._cell is not None:
      self._row.append(_text(''.join(self._cell)))
      self._cell = None
    elif tag == 'tr' and self._row is not None:
      self.rows.append(tuple(self._row))
      self._row = None

  def handle_data(self, data):
    if self._cell is not None:
      self._cell.append(data)
    if self._in_h1 is not None:
      self._in_h1.append(data)


# Sphinx's smart quotes and dashes, back to what the Markdown writes.
_TYPOGRAPHY = str.maketrans({'\u2019': "'", '\u2018': "'", '\u201c': '"',
                             '\u201d': '"', '\u2014': '---', '\u2013': '--',
                             '\u2026': '...'})


def _text(text):
  return ' '.join(text.translate(_TYPOGRAPHY).split())


def _markdown_title_and_rows(path):
  """The Markdown file's first heading and its tables' rows, as text."""
  with open(path) as f:
    tokens = MarkdownIt('commonmark').enable('table').parse(f.read())
  title, rows, row = None, [], None
  for i, token in enumerate(tokens):
    if token.type == 'heading_open' and title is None:
      title = _text(_inline_text(tokens[i + 1]))
    elif token.type == 'tr_open':
      row = []
    elif token.type == 'inline' and row is not None:
      row.append(_text(_inline_text(token)))
    elif token.type == 'tr_close':
      rows.append(tuple(row))
      row = None
  return title, rows


def _inline_text(token):
  return ''.join(child.content for child in token.children or ()
                 if child.type in ('text', 'code_inline'))


def test_every_study_has_a_page_with_its_readme(site):
  # docs/_ext/study_pages.py renders studies/<name>/README.md as
  # _generated/studies/<name>.html: its title, its tables row by row, its
  # images; docs/lab/studies.md links each one.
  code, output, html_dir = site
  assert code == 0, output
  assert len(STUDY_READMES) >= 12, STUDY_READMES
  # The page's own text (furo's <article>), not the navigation around it.
  studies_page = (html_dir / 'lab' / 'studies.html').read_text()
  studies_page = studies_page[studies_page.index('<article'):]
  missing, rows_checked = [], 0
  for readme in STUDY_READMES:
    name = os.path.basename(os.path.dirname(readme))
    page = html_dir / '_generated' / 'studies' / f'{name}.html'
    if not page.is_file():
      missing.append(f'{name}: no page')
      continue
    parsed = _Page()
    parsed.feed(page.read_text())
    title, rows = _markdown_title_and_rows(readme)
    if parsed.h1[:1] != [title]:
      missing.append(f'{name}: title {parsed.h1[:1]}, not {title!r}')
    built_rows = set(parsed.rows)
    missing += [f'{name}: table row {row}' for row in rows
                if row not in built_rows]
    rows_checked += len(rows)
    missing += [f'{name}: image {src}' for src in parsed.images
                if not (page.parent / src).is_file()]
    if f'href="../_generated/studies/{name}.html"' not in studies_page:
      missing.append(f'{name}: not linked from lab/studies.html')
  assert not missing, missing
  assert rows_checked > 100, rows_checked


def _inventory(html):
  with open(html / 'objects.inv', 'rb') as f:
    inventory = InventoryFile.load(f, '', os.path.join)
  names = {}
  for kind, entries in inventory.items():
    if kind.startswith('py:'):
      for name, entry in entries.items():
        names[name] = entry
  return names


def test_every_public_name_has_an_entry_in_the_site(site):
  code, output, html = site
  assert code == 0, output
  names = _inventory(html)
  missing = []
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    if module_name not in names:
      missing.append(module_name)
    for name in module.__all__:
      if f'{module_name}.{name}' not in names:
        missing.append(f'{module_name}.{name}')
  assert not missing, f'no entry in the site: {missing}'
  # The package's re-exports point to their module's page.
  assert 'api/geom.sam.html' in names['geom.sam.sam'].uri
  assert 'api/geom.html' in names['geom.SAMOptions'].uri


def _copy_for_a_build(tmp_path):
  """A checkout's docs/, geom/ and studies/ under tmp_path; the build
  documents them."""
  ignore = shutil.ignore_patterns('_build', '_generated', '__pycache__')
  shutil.copytree(DOCS, tmp_path / 'docs', ignore=ignore)
  # The study pages are built from the rooms' READMEs and results.
  shutil.copytree(os.path.join(REPO_ROOT, 'studies'), tmp_path / 'studies',
                  ignore=ignore)
  shutil.copytree(os.path.join(REPO_ROOT, 'geom'), tmp_path / 'geom',
                  ignore=ignore)
  return tmp_path


@pytest.mark.slow
def test_a_public_name_without_a_docstring_fails_the_build(tmp_path):
  root = _copy_for_a_build(tmp_path)
  path = root / 'geom' / 'tree_norm.py'
  source = path.read_text()
  # Remove tree_norm_f32's docstring: from its first line to the closing
  # quotes (the body's code stays).
  start = source.index('  """sqrt(sum of squares)')
  end = source.index('  """\n', start + 1) + len('  """\n')
  path.write_text(source[:start] + source[end:])
  # The planted copy is what the build imports (conf.py puts the folder
  # above docs/ first on sys.path).
  code, output, _ = _sphinx(str(root / 'docs'), str(tmp_path / 'out'),
                            keep_going=False)
  assert code != 0, output
  assert 'geom.tree_norm.tree_norm_f32: public, and no docstring' in output


class _App:
  """What geom_docs.setup and its handlers use of a Sphinx application:
  the events it connects, and the config value it adds."""

  def __init__(self):
    self.handlers = {}
    self.config = type('Config', (), {})()

  def add_config_value(self, name, default, rebuild):
    del rebuild
    setattr(self.config, name, default)

  def connect(self, event, handler, priority=500):
    del priority
    self.handlers.setdefault(event, []).append(handler)

  def add_directive(self, name, directive):
    del name, directive


def test_a_public_name_without_a_docstring_is_a_build_warning(monkeypatch,
                                                              caplog):
  # The extension's hook at the start of every build, as Sphinx calls it:
  # with tree_norm_f32's docstring removed it warns, naming it, which -W
  # turns into a failed build (the slow test above builds a planted copy).
  from geom import tree_norm  # pylint: disable=g-import-not-at-top
  app = _App()
  geom_docs.setup(app)
  (check,) = app.handlers['builder-inited']
  monkeypatch.setattr(tree_norm.tree_norm_f32, '__doc__', None)
  with caplog.at_level('WARNING'):
    check(app)
  warnings = [r.getMessage() for r in caplog.records
              if r.levelname == 'WARNING']
  assert warnings == ['public API: geom.tree_norm.tree_norm_f32: public, '
                      'and no docstring'], warnings


def test_the_check_reports_a_missing_example_and_constant_doc(monkeypatch):
  from geom import steering  # pylint: disable=g-import-not-at-top
  assert geom_docs.problems() == []
  monkeypatch.setattr(steering.unit, '__doc__', 'A unit vector.')
  monkeypatch.setattr(steering, '__all__', steering.__all__ + ['_MIN_NORM'])
  found = geom_docs.problems()
  assert 'geom.steering.unit: its docstring has no example (>>>)' in found
  assert ('geom.steering._MIN_NORM: a public constant with no doc comment '
          '(#:)') in found
  assert len(found) == 2, found


def _python_blocks(path):
  """[(line, code, skipped)] of the page's fenced Python blocks."""
  with open(os.path.join(REPO_ROOT, path)) as f:
    tokens = MarkdownIt('commonmark').parse(f.read())
  blocks = []
  for token in tokens:
    words = token.info.split()
    if token.type == 'fence' and words[:1] == ['python']:
      assert set(words[1:]) <= {SKIP}, (
          f'{path}:{token.map[0] + 1}: unknown fence option {words[1:]}; '
          f'"{SKIP}" is the only one')
      blocks.append((token.map[0] + 1, token.content, SKIP in words[1:]))
  return blocks


@pytest.mark.parametrize('page', [p for p in PAGES if _python_blocks(p)])
def test_the_python_blocks_of_each_page_run(page, monkeypatch, capsys):
  blocks = _python_blocks(page)
  monkeypatch.chdir(REPO_ROOT)
  namespace = {'__name__': '__docs__'}
  ran = 0
  for line, code, skipped in blocks:
    if skipped:
      continue
    exec(compile(code, f'{page}:{line}', 'exec'), namespace)  # pylint: disable=exec-used
    ran += 1
  with capsys.disabled():
    skipped = [line for line, _, s in blocks if s]
    if blocks:
      print(f'\n{page}: {ran} Python blocks ran'
            + (f', {len(skipped)} skipped (lines {skipped})' if skipped
               else ''))


def test_python_is_fenced_as_python():
  # A block fenced ```py (or python3, pycon, ipython) would not run here.
  others = {'py', 'python3', 'py3', 'pycon', 'ipython', 'ipython3'}
  found = []
  for page in PAGES:
    with open(os.path.join(REPO_ROOT, page)) as f:
      tokens = MarkdownIt('commonmark').parse(f.read())
    found += [f'{page}:{t.map[0] + 1}: ```{t.info.strip()}' for t in tokens
              if t.type == 'fence' and t.info.split()[:1]
              and t.info.split()[0].lower() in others]
  assert not found, f'fence Python as ```python (or ```python skip): {found}'


def test_every_method_page_has_a_runnable_example():
  for page in glob.glob(os.path.join(DOCS, 'methods', '*.md')):
    page = os.path.relpath(page, REPO_ROOT)
    assert any(not skipped for _, _, skipped in _python_blocks(page)), page


def _examples(module):
  finder = doctest.DocTestFinder()
  return sum(len(t.examples) for t in finder.find(module))


@pytest.mark.parametrize('module_name', [
    m for m in MODULES if m not in DOCTESTED_ELSEWHERE])
def test_docstring_examples_run(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(module, verbose=False)
  assert result.failed == 0
  assert result.attempted == _examples(module)


def test_every_module_with_examples_is_doctested_somewhere():
  total = 0
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    total += _examples(module)
    where = DOCTESTED_ELSEWHERE.get(module_name)
    if where is None:
      continue
    with open(os.path.join(REPO_ROOT, where)) as f:
      source = f.read()
    short = module_name.rsplit('.', 1)[-1]
    assert 'doctest.testmod(' in source and re.search(
        rf'\b{short}\b', source), f'{where} does not doctest {module_name}'
  print(f'\n{total} docstring examples in {len(MODULES)} modules of geom')
  assert total > 300


def test_the_pages_name_only_files_that_exist():
  # A moved or renamed page leaves no dangling `docs/x.md` behind.
  missing = []
  sources = PAGES + [os.path.relpath(p, REPO_ROOT) for p in glob.glob(
      os.path.join(REPO_ROOT, 'geom', '**', '*.py'), recursive=True)]
  for path in sources:
    with open(os.path.join(REPO_ROOT, path)) as f:
      text = f.read()
    for name in set(re.findall(r'(?<![\w/.])docs/[\w/.-]+\.md\b', text)):
      if not os.path.exists(os.path.join(REPO_ROOT, name)):
        missing.append(f'{path}: {name}')
  assert not missing, missing
