"""Sphinx configuration of geom's documentation site (`make docs`).

Why Sphinx, and how the site is checked: docs/site.md. Built offline
(no intersphinx), with warnings as errors (`-W --keep-going -n`):
a broken cross-reference, an unknown role, or a public name of geom
without a docstring or an example (docs/_ext/geom_docs.py) fails it.
Each study's README becomes a page of the site when it is built
(docs/_ext/study_pages.py, into docs/_generated/, which git ignores).
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
# The checkout's geom first (the build documents the code beside it, not an
# installed copy), then the site's own extension.
sys.path.insert(0, os.path.dirname(DOCS))
sys.path.insert(0, os.path.join(DOCS, '_ext'))

project = 'geom'
author = 'the geom authors'
copyright = 'the geom authors'  # pylint: disable=redefined-builtin

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',
    'sphinx.ext.mathjax',
    'sphinx.ext.napoleon',
    'myst_parser',
    'geom_docs',
    'study_pages',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
exclude_patterns = ['_build', '_ext', 'Thumbs.db', '.DS_Store']
# Every warning is an error in `make docs` and tests/test_docs.py; nitpicky
# makes an unresolved cross-reference one too.
nitpicky = True
# Names of other libraries in signatures (no intersphinx: the build is
# offline) and the typing aliases of geom's signatures.
nitpick_ignore_regex = [
    (r'py:.*', r'(jax|jaxlib|jnp|optax|numpy|np|chex|typing|collections|'
               r'dataclasses|enum|types)(\..*)?'),
    (r'py:.*', r'(ArrayTree|Any|Callable|Literal|NamedTuple|Mapping|Sequence|'
               r'Iterable|Iterator|Params|Updates|GradFn|LossFn|Array|'
               r'ArrayLike|PyTree|PRNGKey|Shape|DType)'),
    (r'py:.*', r'(int|float|str|bool|bytes|tuple|list|dict|object|None|'
               r'ValueError|TypeError|Exception)'),
]
# `name` in a docstring is code, not a cross-reference (geom's docstrings
# write code, argument names and expressions between single backticks).
default_role = 'literal'
# The Lab section globs lab/*, pages another part of the repository owns;
# an empty glob (before they exist) is not an error.
suppress_warnings = ['toc.empty_glob']

# autodoc: each module's `__all__`, in its order (the method's factory
# first). Type hints go with the documented arguments, not into the
# signature: jax's ArrayLike alone expands to a line of types there.
autodoc_default_options = {
    'members': True,
    'member-order': 'bysource',
    'show-inheritance': False,
}
autodoc_typehints = 'description'
autodoc_typehints_description_target = 'documented_params'
autodoc_typehints_format = 'short'
autodoc_preserve_defaults = True
autodoc_class_signature = 'mixed'
autosummary_generate = False
add_module_names = False

# napoleon: Google style (Args / Returns / Raises / Example / References).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of the class, not separate entries (NamedTuple
# fields are documented by autodoc already).
napoleon_use_ivar = True
# A Returns section's 'type: text' stays text (geom writes 'float32 scalars:
# ...'), not a cross-reference.
napoleon_use_rtype = False
napoleon_custom_sections = [('References', 'notes_style')]

myst_enable_extensions = ['dollarmath', 'amsmath', 'colon_fence']
myst_heading_anchors = 3
# Python blocks of the pages run as tests (tests/test_docs.py); "python
# skip" opts a block out and is shown as Python.
myst_fence_as_directive = []

# Equations are typeset by MathJax, from its CDN by default. Offline, point
# GEOM_DOCS_MATHJAX at a local MathJax 2 (Debian's libjs-mathjax:
# /usr/share/javascript/mathjax/MathJax.js); the screenshots in
# docs/_static/screenshots were taken that way.
if os.environ.get('GEOM_DOCS_MATHJAX'):
  mathjax_path = ('file://' + os.environ['GEOM_DOCS_MATHJAX']
                  + '?config=TeX-AMS-MML_HTMLorMML')
  # MyST marks its math with the class 'math' and the rest of the page as
  # ignored, in MathJax 3's terms; these are MathJax 2's.
  mathjax2_config = {'tex2jax': {
      'inlineMath': [['\\(', '\\)']], 'displayMath': [['\\[', '\\]']],
      'processClass': 'math', 'ignoreClass': 'tex2jax_ignore|mathjax_ignore'}}

html_theme = 'furo'
html_title = 'geom'
html_static_path = ['_static']
html_show_sourcelink = False
html_copy_source = False
templates_path = []
