"""Sphinx extension of geom's site: a page per study, from its README.

At `builder-inited`, before Sphinx looks for the site's pages, each
`studies/<name>/README.md` of the checkout becomes
`docs/_generated/studies/<name>.md` (the folder is in .gitignore and is
rebuilt by every build), so the site shows each study's tables, spread
and commands as the room states them, never a copy that goes stale.
`docs/lab/studies.md` lists the pages in its toctree and links each
headline to its page. The Markdown reports a room stores beside its
results (`studies/<name>/results/**/*.md`, which the READMEs link) become
pages under `docs/_generated/studies/<name>/`, outside any table of
contents (`orphan`).

A README's relative links are written for the repository; on the site:
- another study's README: that study's page (an `#anchor` is kept);
- a report under a room's folder: its page;
- an image under a room's folder (`results/x.png`): copied beside the
  generated page, so it renders;
- a page of the site (`docs/...md`): that page;
- any other file of the repository (`RESULTS.md`, code): its path as code
  text, as the site's pages name such files;
- a target that does not exist stays as written, and the build (`-W`)
  fails on it as on any broken link.
Files are written only when their content changes, so an unchanged README
does not make Sphinx read its page again; a page whose README is gone is
removed.
"""

import os
import posixpath
import re
import shutil

GENERATED = '_generated'
STUDIES = 'studies'
IMAGES = ('.png', '.svg', '.jpg', '.jpeg', '.gif')

# [text](target) and ![alt](target): targets without spaces, as the
# READMEs write them (an optional "title" is kept).
_LINK = re.compile(r'(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)((?:\s+"[^"]*")?)\)')
_CODE_SPAN = re.compile(r'(`+)(?:(?!\1).)+?\1', re.S)
_SCHEME = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*:')


def repo_root(srcdir):
  """The checkout whose studies/ the site shows: the folder above docs/."""
  return os.path.dirname(os.path.abspath(srcdir))


def study_names(root):
  """The rooms with a README, sorted: studies/<name>/README.md."""
  folder = os.path.join(root, STUDIES)
  if not os.path.isdir(folder):
    return []
  return sorted(name for name in os.listdir(folder)
                if os.path.isfile(os.path.join(folder, name, 'README.md')))


def _reports(root, name):
  """Repository paths of the room's stored Markdown reports."""
  results = os.path.join(root, STUDIES, name, 'results')
  found = []
  for folder, _, files in os.walk(results):
    for file in files:
      if file.endswith('.md'):
        found.append(os.path.relpath(os.path.join(folder, file), root)
                     .replace(os.sep, '/'))
  return sorted(found)


def page_of(repo_path):
  """The generated page (a path under docs/) of a README or report, or None."""
  parts = repo_path.split('/')
  if len(parts) == 3 and parts[0] == STUDIES and parts[2] == 'README.md':
    return f'{GENERATED}/{STUDIES}/{parts[1]}.md'
  if (len(parts) >= 4 and parts[0] == STUDIES and parts[2] == 'results'
      and parts[-1].endswith('.md')):
    return f'{GENERATED}/{STUDIES}/' + '/'.join(parts[1:])
  return None


def _code(path):
  return f'`{path}`'


def rewrite_links(text, source, page, root, pages, copies):
  """The Markdown of `source` (a repository path) with links for `page`.

  `pages` is the set of generated pages (paths under docs/); each image
  linked is added to `copies` as (repository path, path under docs/).
  Links inside code spans are left as they are.
  """
  here = posixpath.dirname(source)
  page_dir = posixpath.dirname(page)

  def link(match):
    bang, label, target, title = match.groups()
    if _SCHEME.match(target) or target.startswith(('#', '/')):
      return match.group(0)
    path, _, anchor = target.partition('#')
    repo_path = posixpath.normpath(posixpath.join(here, path))
    anchor = '#' + anchor if anchor else ''
    if repo_path.startswith('..') or not os.path.exists(
        os.path.join(root, repo_path)):
      return match.group(0)  # Broken: the build fails on it.
    generated = page_of(repo_path)
    if generated in pages:
      new = posixpath.relpath(generated, page_dir) + anchor
    elif repo_path.startswith('docs/') and repo_path.endswith('.md'):
      new = posixpath.relpath(repo_path[len('docs/'):], page_dir) + anchor
    elif (repo_path.startswith(STUDIES + '/')
          and repo_path.lower().endswith(IMAGES)):
      # Beside the page: _generated/studies/<name>/results/x.png.
      copy = f'{GENERATED}/' + repo_path
      copies.add((repo_path, copy))
      new = posixpath.relpath(copy, page_dir)
    else:
      plain = label.strip('`')
      if bang:
        return _code(repo_path)
      if plain in (repo_path, path, target):
        return _code(repo_path)
      return f'{label} ({_code(repo_path)})'
    return f'{bang}[{label}]({new}{title})'

  spans = [m.span() for m in _CODE_SPAN.finditer(text)]

  def outside_code(match):
    # A link inside a code span is code; a code span inside a link's
    # label is the label.
    if any(start < match.start() < end for start, end in spans):
      return match.group(0)
    return link(match)

  return _LINK.sub(outside_code, text)


def _title_and_note(text, source, orphan):
  """The page: a title first (the file's own H1 where it has one), then
  where it comes from."""
  lines = text.split('\n')
  note = f'*Rendered from `{source}` when the site is built'
  note += '.*' if orphan else '; run its commands from the repository root.*'

  first = next((i for i, line in enumerate(lines) if line.strip()), None)
  if first is not None and re.match(r'# \S', lines[first]):
    lines[first + 1:first + 1] = ['', note]
  else:
    lines[0:0] = [f'# `{source}`', '', note, '']
  front = ['---', 'orphan: true', '---', ''] if orphan else []
  return '\n'.join(front + lines)


def _write_if_changed(path, content):
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      if f.read() == content:
        return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  temporary = f'{path}.{os.getpid()}.tmp'
  with open(temporary, 'w', encoding='utf-8') as f:
    f.write(content)
  os.replace(temporary, path)


def _copy_if_changed(source, destination):
  if os.path.isfile(destination):
    with open(source, 'rb') as a, open(destination, 'rb') as b:
      if a.read() == b.read():
        return
  os.makedirs(os.path.dirname(destination), exist_ok=True)
  temporary = f'{destination}.{os.getpid()}.tmp'
  shutil.copyfile(source, temporary)
  os.replace(temporary, destination)


def generate(srcdir):
  """Writes the study pages under srcdir/_generated/studies; the rooms."""
  root = repo_root(srcdir)
  names = study_names(root)
  sources = {}  # page (under docs/) -> (repository path, orphan)
  for name in names:
    readme = f'{STUDIES}/{name}/README.md'
    sources[page_of(readme)] = (readme, False)
    for report in _reports(root, name):
      sources[page_of(report)] = (report, True)
  pages = set(sources)
  written, copies = set(), set()
  for page, (source, orphan) in sources.items():
    with open(os.path.join(root, source), encoding='utf-8') as f:
      text = f.read()
    text = rewrite_links(text, source, page, root, pages, copies)
    _write_if_changed(os.path.join(srcdir, page),
                      _title_and_note(text, source, orphan))
    written.add(os.path.normpath(os.path.join(srcdir, page)))
  for source, copy in copies:
    _copy_if_changed(os.path.join(root, source), os.path.join(srcdir, copy))
    written.add(os.path.normpath(os.path.join(srcdir, copy)))
  # What an earlier build wrote for a README or image that is gone.
  top = os.path.join(srcdir, GENERATED, STUDIES)
  for folder, _, files in os.walk(top, topdown=False):
    for file in files:
      path = os.path.normpath(os.path.join(folder, file))
      if path not in written and not file.endswith('.tmp'):
        os.remove(path)
    if folder != top and not os.listdir(folder):
      os.rmdir(folder)
  return names


def _generate(app):
  generate(app.srcdir)


def setup(app):
  app.connect('builder-inited', _generate)
  return {'version': '1', 'parallel_read_safe': True,
          'parallel_write_safe': True}
