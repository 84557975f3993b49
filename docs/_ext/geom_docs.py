"""Sphinx extension of geom's site: the public-API check and the re-exports.

- The check (at `builder-inited`): every public name of geom, that is every
  name in the `__all__` of the package and of each of its modules, has a
  docstring, and every public function and class has an example in it (a
  doctest, `>>>`); so has every public method and property of those
  classes (a docstring, no example needed); a public constant has a doc comment (`#:` above it, or
  a string right below it), which is what autodoc shows for it. autodoc
  silently leaves out a member without a docstring, so this check is what
  makes the build (`-W`) fail on one. Each miss is one warning naming it.
- Bars in prose: geom's docstrings write norms as `|g|`, which
  reStructuredText reads as a substitution; `autodoc-process-docstring`
  escapes `|` outside code (backticks, literal blocks after `::`, doctest
  examples) before napoleon reads the docstring.
- The Lab section of the index lists `lab/index` first, then globs
  `lab/*`, pages written apart from the code; while there are none, the
  toctree is left out instead of warning that the glob is empty (and
  without a `lab/index`, that line).
- `.. geom-reexports::` documents the classes that the package `geom`
  re-exports from its modules as `geom.<Name>`, each pointing to its
  entry in its module's page, so every name of `geom.__all__` has an
  entry of its own in the site's inventory without a second copy of its
  documentation. They are noted as aliases, so a short reference
  resolves to the module's entry.
"""

import importlib
import inspect
import os
import pkgutil
import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

PACKAGE = 'geom'


def public_modules(package=PACKAGE):
  """The package and every module under it whose name has no underscore."""
  root = importlib.import_module(package)
  names = [package]
  for info in pkgutil.walk_packages(root.__path__, package + '.'):
    if not any(part.startswith('_') for part in info.name.split('.')):
      names.append(info.name)
  return sorted(names)


def _attribute_docs(module_name):
  try:
    analyzer = ModuleAnalyzer.for_module(module_name)
    analyzer.analyze()
  except Exception:  # pylint: disable=broad-except
    return {}
  return {name: doc for (scope, name), doc in analyzer.attr_docs.items()
          if scope == ''}


def _member_problems(cls, where):
  """Public methods and properties a class defines without a docstring."""
  found = []
  for name, member in vars(cls).items():
    if name.startswith('_'):
      continue
    if isinstance(member, (staticmethod, classmethod)):
      member = member.__func__
    if isinstance(member, property):
      member = member.fget
    elif not inspect.isfunction(member):
      continue  # Fields (NamedTuple, dataclass): documented by the class.
    if not (member.__doc__ or '').strip():
      found.append(f'{where}.{name}: public, and no docstring')
  return found


def problems(package=PACKAGE):
  """['module.name: what is missing', ...] over the package's public names."""
  found = []
  for module_name in public_modules(package):
    module = importlib.import_module(module_name)
    if not (module.__doc__ or '').strip():
      found.append(f'{module_name}: the module has no docstring')
    names = getattr(module, '__all__', None)
    if names is None:
      found.append(f'{module_name}: no __all__')
      continue
    attr_docs = _attribute_docs(module_name)
    for name in names:
      value = getattr(module, name, None)
      where = f'{module_name}.{name}'
      if inspect.ismodule(value):
        continue  # Checked as a module of its own.
      if inspect.isfunction(value) or inspect.isclass(value):
        if getattr(value, '__module__', None) != module_name:
          continue  # A re-export: checked where it is defined.
        doc = inspect.getdoc(value) or ''
        if not value.__doc__ or not doc.strip():
          found.append(f'{where}: public, and no docstring')
        elif '>>>' not in doc:
          found.append(f'{where}: its docstring has no example (>>>)')
        if inspect.isclass(value):
          found += _member_problems(value, where)
      elif not any(line.strip() for line in attr_docs.get(name, [])):
        found.append(f'{where}: a public constant with no doc comment (#:)')
  return found


_CODE_SPAN = re.compile(r'(`+).+?\1')


def _escape_outside_code(text):
  out, end = [], 0
  for match in _CODE_SPAN.finditer(text):
    out.append(text[end:match.start()].replace('|', r'\|'))
    out.append(match.group(0))
    end = match.end()
  out.append(text[end:].replace('|', r'\|'))
  return ''.join(out)


def escape_bars(lines):
  """The docstring's lines with `|` escaped where reST would read markup."""
  out = []
  literal_indent = None  # The indent of the paragraph that ended in '::'.
  in_doctest = False
  for line in lines:
    stripped = line.strip()
    indent = len(line) - len(line.lstrip())
    if literal_indent is not None:
      if not stripped or indent > literal_indent:
        out.append(line)
        continue
      literal_indent = None
    if stripped.startswith('>>>'):
      in_doctest = True
    if in_doctest:
      in_doctest = bool(stripped)
      out.append(line)
      continue
    out.append(_escape_outside_code(line))
    if stripped.endswith('::'):
      literal_indent = indent
  return out


def references_as_bullets(lines):
  """A `References:` section's entries, each with its hanging indent, as bullets.

  geom writes a reference over several lines, the later ones indented;
  reST would read that as a definition list. Each entry becomes one
  bullet line.
  """
  out = []
  i = 0
  while i < len(lines):
    line = lines[i]
    out.append(line)
    i += 1
    if line.strip() != 'References:':
      continue
    section_indent = len(line) - len(line.lstrip())
    out.append('')
    entry, entry_indent = None, None
    while i < len(lines):
      text = lines[i]
      stripped = text.strip()
      indent = len(text) - len(text.lstrip())
      if stripped and indent <= section_indent:
        break
      if not stripped:
        i += 1
        continue
      if entry is None or indent <= entry_indent:
        if entry is not None:
          out.append(' ' * entry_indent + '- ' + entry)
        entry, entry_indent = stripped, indent
      else:
        entry += ' ' + stripped
      i += 1
    if entry is not None:
      out.append(' ' * entry_indent + '- ' + entry)
    out.append('')
  return out


def _process_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  lines[:] = references_as_bullets(escape_bars(lines))


_LAB_TOCTREE = re.compile(r'```\{toctree\}\n:caption: Lab\n.*?```\n', re.S)


def _source_read(app, docname, source):
  if docname != app.config.root_doc:
    return
  lab = os.path.join(app.srcdir, 'lab')
  pages = os.listdir(lab) if os.path.isdir(lab) else []
  if not any(f.endswith(('.md', '.rst')) for f in pages):
    source[0] = _LAB_TOCTREE.sub('', source[0])
  elif not {'index.md', 'index.rst'} & set(pages):
    source[0] = source[0].replace('\nlab/index\n', '\n')


def _check(app):
  for problem in problems(app.config.geom_docs_package):
    logger.warning('public API: %s', problem, type='geom', subtype='api')


class ReExports(SphinxDirective):
  """Entries `geom.<Name>` for the classes geom re-exports."""

  has_content = False

  def run(self):
    package = importlib.import_module(self.config.geom_docs_package)
    lines = []
    for name in package.__all__:
      value = getattr(package, name)
      if inspect.ismodule(value):
        continue
      target = f'{value.__module__}.{value.__qualname__}'
      # The docstring's first paragraph, on one line.
      first = ' '.join((inspect.getdoc(value) or '').strip().split('\n\n')[0]
                       .split())
      lines += [f'.. py:class:: {name}', f'   :module: {package.__name__}',
                '', f'   Re-exported from :py:class:`{target}`: {first}', '']
    node = nodes.section()
    node.document = self.state.document
    self.state.nested_parse(StringList(lines, source='geom-reexports'),
                            self.content_offset, node)
    # Aliases, as `:canonical:` makes them: a short name (`ArgumentError` in
    # a Raises section) resolves to the module's entry, not to both.
    domain = self.env.domains['py']
    for name in package.__all__:
      fullname = f'{package.__name__}.{name}'
      if fullname in domain.objects:
        domain.objects[fullname] = domain.objects[fullname]._replace(
            aliased=True)
    return node.children


def setup(app):
  app.add_config_value('geom_docs_package', PACKAGE, 'env')
  app.connect('builder-inited', _check)
  # Before napoleon (priority 500) turns the Google sections into reST.
  app.connect('autodoc-process-docstring', _process_docstring, priority=400)
  app.connect('source-read', _source_read)
  app.add_directive('geom-reexports', ReExports)
  return {'version': '1', 'parallel_read_safe': True,
          'parallel_write_safe': True}
