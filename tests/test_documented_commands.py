"""Every command the documentation gives still runs as written.

Read from README.md, RESULTS.md, BENCHMARKS.md, docs/**/*.md (the lab's
pages, docs/lab/*.md, included: the README's commands moved there),
studies/**/README.md and the module docstrings of the repository's
packages: in fenced blocks, inline code (also across lines), indented
blocks and docstring lines, with `\\` continuations joined. Checked:
- `python -m M ...` (any interpreter path): M is a repository module (a .py
  file, or a package with __main__.py), or one installed in this
  interpreter (`pytest`, `pip`...); every `--flag`, `--noflag`,
  `--flag=value` and `--config.a.b=v` it passes to a repository module is
  defined by an absl DEFINE_* call (read from the source, no import) in M
  or a repository module it imports, at any depth, or is one of absl's own;
  a `--config=configs/x.py[:arg]` file exists;
- `pytest tests/...` (or `python -m pytest`): the files exist and so do the
  tests named after `::`;
- `make T`: Makefile has target T.
The Makefile's own recipes (`$(PY) -m M ...`) are checked alike.
Placeholders (`<module>`, `...`, `--flag=...`, `configs/X.py`) are skipped.
One test per documentation file, so a stale file shows by name. The README
and the lab's pages together still give `make run`, `make test` and a
command of every launcher in launch/.
"""

import ast
import functools
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, whose documentation this test reads.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
PACKAGES = ('bench', 'configs', 'geom', 'launch', 'studies', 'tests', 'train')
DOC_GLOBS = ('README.md', 'RESULTS.md', 'BENCHMARKS.md', 'docs/**/*.md',
             'studies/**/README.md')

_PYTHON = re.compile(r'(?<![\w/.-])(?:[\w.~$/-]*/)?python[\d.]*$')
_SEPARATORS = {';', '&', '&&', '|', '||', 'do', 'then', 'else', '(', ')'}
# `<module>`, `...`, and names in capitals: `M`, `configs/X.py`, `DIR`.
_PLACEHOLDER = re.compile(
    r'<[^>]*>?|\.\.\.|…|(?<![A-Za-z0-9])[A-Z][A-Z0-9]*(?![a-z0-9])')
_PYTHON_M = re.compile(r'(?<![\w/.-])(?:[\w.~$/-]*/)?python[\d.]*\s+-m\b')
_PYTEST = re.compile(r'\bpytest\s+\S*tests/')
# Inline code: one or more backticks, closed by as many, within a paragraph.
_INLINE_CODE = re.compile(r'(?<!`)(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)',
                          re.S)


def _doc_files() -> list[str]:
  files = set()
  for pattern in DOC_GLOBS:
    files.update(glob.glob(os.path.join(REPO_ROOT, pattern), recursive=True))
  # docs/_generated/ holds the site's copies of the studies' READMEs (made
  # by a build, or not): their originals are read above.
  return sorted(r for r in (os.path.relpath(f, REPO_ROOT) for f in files)
                if not r.startswith('docs/_generated/'))


def _module_docstrings() -> dict[str, tuple[str, int]]:
  """{path: (docstring, line of its first line)} of modules that give a command."""
  out = {}
  for package in PACKAGES:
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, package, '**', '*.py'),
                                 recursive=True)):
      with open(path) as f:
        source = f.read()
      if not (_PYTHON_M.search(source) or _PYTEST.search(source)):
        continue
      tree = ast.parse(source, path)
      if (tree.body and isinstance(tree.body[0], ast.Expr)
          and isinstance(tree.body[0].value, ast.Constant)
          and isinstance(tree.body[0].value.value, str)):
        doc = tree.body[0].value.value
        if _PYTHON_M.search(doc) or _PYTEST.search(doc):
          out[os.path.relpath(path, REPO_ROOT)] = (doc, tree.body[0].lineno)
  return out


DOCSTRINGS = _module_docstrings()


# --- Commands out of text -------------------------------------------------

def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
  out = []
  for number, line in lines:
    if out and out[-1][1].endswith('\\'):
      out[-1] = (out[-1][0], out[-1][1][:-1] + ' ' + line.strip())
    else:
      out.append((number, line))
  return out


def _snippets(text: str, first_line: int = 1) -> list[tuple[int, str, bool]]:
  """(line, shell text, whole: the text is all code) in a document.

  Fenced lines and inline code are whole code; other lines (indented
  blocks, docstring lines, prose) only hold a command from `python -m`
  onwards, or, indented, from the line's start.
  """
  lines = text.split('\n')
  fenced, prose, in_fence = [], [], False
  for number, line in enumerate(lines, first_line):
    if line.lstrip().startswith(('```', '~~~')):
      in_fence = not in_fence
      prose.append('')
    elif in_fence:
      fenced.append((number, line))
      prose.append('')
    else:
      prose.append(line)
  out = [(n, line, True) for n, line in _join_continuations(fenced)]
  prose_text = '\n'.join(prose)
  for span in _INLINE_CODE.finditer(prose_text):
    content = span.group(2)
    number = first_line + prose_text.count('\n', 0, span.start(2))
    out.append((number, re.sub(r'\\?\n', ' ', content), True))
  without_spans = _INLINE_CODE.sub(
      lambda m: re.sub(r'[^\n]', ' ', m.group(0)), prose_text)
  for number, line in _join_continuations(
      list(enumerate(without_spans.split('\n'), first_line))):
    if re.match(r'\s{2,}(\S+=\S+\s+)*(make|pytest|\S*python[\d.]*)\s', line):
      out.append((number, line, True))
    else:
      out += [(number, line[m.start():], False)
              for m in _PYTHON_M.finditer(line)]
  return sorted(out)


def _tokens(snippet: str) -> list[str]:
  lexer = shlex.shlex(snippet, posix=True, punctuation_chars=';&|()')
  lexer.whitespace_split = True
  lexer.commenters = ''
  try:
    tokens = list(lexer)
  except ValueError:  # an unclosed quote: prose around the command
    tokens = re.findall(r'[;&|()]+|[^\s;&|()]+', snippet)
  out = []
  for token in tokens:
    if token.startswith('#') or re.match(r'\d?>', token):
      # A comment or a redirection ends the command; a separator follows.
      out.append(None)
    else:
      out.append(token)
  return out


def _commands(snippet: str, whole: bool) -> list[list[str]]:
  """The simple commands (argument lists) in a piece of shell text."""
  commands, current, skipping = [], [], False
  for token in _tokens(snippet) + [';']:
    if token in _SEPARATORS:
      if current:
        commands.append(current)
      current, skipping = [], False
    elif token is None:
      skipping = True
    elif not skipping:
      current.append(token)
  out = []
  for command in commands:
    # Environment assignments and `time` before the program.
    while command and (re.match(r'\w+=', command[0]) or command[0] == 'time'):
      command = command[1:]
    if not command:
      continue
    if _PYTHON.search(command[0]) and command[1:2] == ['-m']:
      out.append(command)
    elif whole and command[0] in ('make', 'pytest'):
      out.append(command)
    if not whole:  # prose: only the first command, from `python -m`
      break
  return out


# --- What a command may name ----------------------------------------------

def _module_file(module: str) -> str | None:
  """The repository file `python -m module` runs, or None."""
  base = os.path.join(REPO_ROOT, *module.split('.'))
  for path in (base + '.py', os.path.join(base, '__main__.py')):
    if os.path.isfile(path):
      return path
  return None


def _is_repository_module(module: str) -> bool:
  top = module.split('.')[0]
  return top in PACKAGES or os.path.isdir(os.path.join(REPO_ROOT, top))


@functools.cache
def _source(path: str) -> str:
  with open(path) as f:
    return f.read()


@functools.cache
def _parse(path: str) -> ast.Module:
  return ast.parse(_source(path), path)


@functools.cache
def _imported_files(path: str) -> frozenset[str]:
  """Repository files that importing the module at `path` executes."""
  tree = _parse(path)
  package = os.path.relpath(os.path.dirname(path), REPO_ROOT).split(os.sep)
  modules = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package[:len(package) - node.level + 1]
        module = '.'.join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      modules.add(module)
      modules.update(f'{module}.{a.name}' for a in node.names)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == 'run_module' and node.args
          and isinstance(node.args[0], ast.Constant)):
      # bench.rl.memory runs launch.rl in its own process, with its flags.
      modules.add(node.args[0].value)
  files = set()
  for module in modules:
    parts = module.split('.')
    if parts[0] not in PACKAGES:
      continue
    for i in range(1, len(parts) + 1):
      base = os.path.join(REPO_ROOT, *parts[:i])
      for candidate in (os.path.join(base, '__init__.py'), base + '.py'):
        if os.path.isfile(candidate):
          files.add(candidate)
  return frozenset(files)


@functools.cache
def _defined_flags(path: str) -> frozenset[str]:
  """Flags the DEFINE_* calls in the module at `path` define."""
  if 'DEFINE_' not in _source(path):
    return frozenset()
  names = set()
  for node in ast.walk(_parse(path)):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    name = (func.attr if isinstance(func, ast.Attribute)
            else func.id if isinstance(func, ast.Name) else '')
    if not name.startswith('DEFINE_'):
      continue
    arg = node.args[0] if node.args else next(
        (k.value for k in node.keywords if k.arg == 'name'), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
      names.add(arg.value)
  return frozenset(names)


@functools.cache
def _flags_of(path: str) -> frozenset[str]:
  """Flags defined once the module at `path` is imported (all it imports)."""
  seen, todo = set(), [path]
  package_init = os.path.join(os.path.dirname(path), '__init__.py')
  if os.path.isfile(package_init):
    todo.append(package_init)
  names = set()
  while todo:
    current = todo.pop()
    if current in seen:
      continue
    seen.add(current)
    names |= _defined_flags(current)
    todo += _imported_files(current) - seen
  return frozenset(names)


@functools.cache
def _absl_flags() -> frozenset[str]:
  """absl's own flags (--help, --verbosity, -v ...), from a fresh process."""
  result = subprocess.run(
      [sys.executable, '-c',
       'from absl import app, flags, logging\n'
       'print(" ".join(flags.FLAGS))'],
      capture_output=True, text=True, check=True)
  # app.run defines the --help family when it runs; the parser itself reads
  # --flagfile and --undefok.
  return frozenset(result.stdout.split()) | {
      'help', 'helpshort', 'helpfull', 'helpxml', 'flagfile', 'undefok'}


@functools.cache
def _make_targets() -> frozenset[str]:
  with open(os.path.join(REPO_ROOT, 'Makefile')) as f:
    makefile = f.read()
  return frozenset(
      target for match in re.finditer(r'^([^\s#:=][^:=]*?)\s*::?(?!=)',
                                      makefile, re.M)
      for target in match.group(1).split())


def _is_placeholder(text: str) -> bool:
  return bool(_PLACEHOLDER.search(text))


# --- The checks -----------------------------------------------------------

def _check_python(command: list[str]) -> list[str]:
  module = command[2] if len(command) > 2 else ''
  if not module or _is_placeholder(module) or module.startswith('-'):
    return []
  if module == 'pytest':
    return _check_pytest(command[3:])
  if not _is_repository_module(module):
    if importlib.util.find_spec(module.split('.')[0]) is None:
      return [f'no module {module} in the repository or installed']
    return []
  path = _module_file(module)
  if path is None:
    return [f'no module {module} (no {module.replace(".", "/")}.py, '
            'nor a package with __main__.py)']
  problems = []
  defined = _flags_of(path) | _absl_flags()
  undefined = set()
  for argument in command[3:]:
    if argument == '--':
      break
    if not argument.startswith('--'):
      continue
    name, _, value = argument[2:].partition('=')
    name = name.split('.')[0].rstrip(',;:.)')
    if not name or _is_placeholder(name):
      continue
    if (name not in defined and name not in undefined
        and not (name.startswith('no') and name[2:] in defined)):
      undefined.add(name)
      problems.append(f'{module} defines no flag --{name}')
    config_file = re.match(r'([a-z0-9_/]+\.py)(?::|$)', value)
    if name == 'config' and config_file and not os.path.isfile(
        os.path.join(REPO_ROOT, config_file.group(1))):
      problems.append(f'no config file {config_file.group(1)}')
  return problems


def _check_pytest(arguments: list[str]) -> list[str]:
  problems = []
  for argument in arguments:
    if argument.startswith('-') or _is_placeholder(argument):
      continue
    path, _, names = argument.partition('::')
    if not (path.startswith('tests/') or path.endswith('.py')):
      continue
    full = os.path.join(REPO_ROOT, path)
    if not os.path.exists(full):
      problems.append(f'no test file {path}')
      continue
    if not names or not os.path.isfile(full):
      continue
    with open(full) as f:
      source = f.read()
    for name in names.split('::'):
      name = name.split('[')[0]
      if not re.search(rf'^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b',
                       source, re.M):
        problems.append(f'no test {name} in {path}')
  return problems


def _check_make(command: list[str]) -> list[str]:
  return [f'Makefile has no target {target}' for target in command[1:]
          if not target.startswith('-') and '=' not in target
          and not _is_placeholder(target)
          and target not in _make_targets()]


def _check(command: list[str]) -> list[str]:
  if command[0] == 'make':
    return _check_make(command)
  if command[0] == 'pytest':
    return _check_pytest(command[1:])
  return _check_python(command)


def _problems(text: str, where: str, first_line: int = 1) -> list[str]:
  out = []
  for number, snippet, whole in _snippets(text, first_line):
    for command in _commands(snippet, whole):
      out += [f'{where}:{number}: {problem}: {" ".join(command)}'
              for problem in _check(command)]
  return out


@pytest.mark.parametrize('path', _doc_files())
def test_documented_commands_run(path):
  with open(os.path.join(REPO_ROOT, path)) as f:
    problems = _problems(f.read(), path)
  assert not problems, '\n'.join(problems)


def _makefile_as_shell() -> str:
  """The Makefile's recipes as a shell block; its variables placeholders."""
  with open(os.path.join(REPO_ROOT, 'Makefile')) as f:
    lines = f.read().split('\n')
  recipes = [re.sub(r'\$\((\w+)\)', lambda m: m.group(1).upper(),
                    line.replace('$(PY) ', '.venv/bin/python '))
             if line.startswith('\t') else '' for line in lines]
  return '```\n' + '\n'.join(recipes) + '\n```'


def test_makefile_commands_run():
  # The fence moves every line down one.
  problems = _problems(_makefile_as_shell(), 'Makefile', first_line=0)
  assert not problems, '\n'.join(problems)


@pytest.mark.parametrize('path', sorted(DOCSTRINGS))
def test_docstring_commands_run(path):
  doc, line = DOCSTRINGS[path]
  problems = _problems(doc, path, line)
  assert not problems, '\n'.join(problems)


def test_finds_the_commands_it_checks():
  """The parser sees each form the documentation writes commands in."""
  text = '\n'.join([
      'Prose `python -m',
      'launch.train --nosuch_a` across lines.',
      '```bash',
      '.venv/bin/python -m launch.train --config=configs/digits.py \\',
      '    --nosuch_b --config.a.b=1  # --in_a_comment',
      'for i in 0 1; do python3 -m launch.train --nosuch_c; done',
      'make test nosuch_target PYTEST_ARGS=-x',
      'pytest tests/test_no_such_file.py tests/test_layering.py::nosuch_test',
      '```',
      '',
      '    python -m launch.no_such_module --x',
      'Run python -m launch.train --nosuch_d, then look.',
      '`python -m launch.train --config=configs/no_such.py --workdir=... '
      '--helpfull --nomultihost --<flag>=1`',
  ])
  problems = _problems(text, 'doc')
  assert problems == [
      'doc:1: launch.train defines no flag --nosuch_a: '
      'python -m launch.train --nosuch_a',
      'doc:4: launch.train defines no flag --nosuch_b: '
      '.venv/bin/python -m launch.train --config=configs/digits.py '
      '--nosuch_b --config.a.b=1',
      'doc:6: launch.train defines no flag --nosuch_c: '
      'python3 -m launch.train --nosuch_c',
      'doc:7: Makefile has no target nosuch_target: '
      'make test nosuch_target PYTEST_ARGS=-x',
      'doc:8: no test file tests/test_no_such_file.py: pytest '
      'tests/test_no_such_file.py tests/test_layering.py::nosuch_test',
      'doc:8: no test nosuch_test in tests/test_layering.py: pytest '
      'tests/test_no_such_file.py tests/test_layering.py::nosuch_test',
      'doc:11: no module launch.no_such_module (no launch/no_such_module.py, '
      'nor a package with __main__.py): python -m launch.no_such_module --x',
      'doc:12: launch.train defines no flag --nosuch_d: '
      'python -m launch.train --nosuch_d,',
      'doc:13: no config file configs/no_such.py: python -m launch.train '
      '--config=configs/no_such.py --workdir=... --helpfull --nomultihost '
      '--<flag>=1',
  ], '\n'.join(problems)


def _commands_in(path: str) -> list[list[str]]:
  with open(os.path.join(REPO_ROOT, path)) as f:
    text = f.read()
  return [command for _, snippet, whole in _snippets(text)
          for command in _commands(snippet, whole)]


def test_the_lab_pages_are_checked_and_give_every_launcher():
  """The README's commands moved to docs/lab/: they stay checked, and none
  of the launchers or the two make targets dropped out on the way."""
  lab = sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(
      os.path.join(REPO_ROOT, 'docs', 'lab', '*.md')))
  assert 'docs/lab/index.md' in lab, lab
  assert set(lab) <= set(_doc_files()), sorted(set(lab) - set(_doc_files()))
  commands = [c for path in ['README.md'] + lab for c in _commands_in(path)]
  modules = {c[2] for c in commands if c[0] != 'make' and len(c) > 2}
  launchers = {f'launch.{name[:-3]}' for name in os.listdir(
      os.path.join(REPO_ROOT, 'launch'))
               if name.endswith('.py') and not name.startswith('_')}
  assert launchers <= modules, sorted(launchers - modules)
  targets = {t for c in commands if c[0] == 'make' for t in c[1:]}
  assert {'run', 'test'} <= targets, sorted(targets)
