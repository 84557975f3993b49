"""One room per study: `python -m studies.<name>` runs it (see studies/README.md).

Importing `launch` installs its start-up Ctrl-C handler for
`python -m studies.<name>` as it does for `python -m launch.<job>`.
"""

import launch  # noqa: F401  pylint: disable=unused-import
