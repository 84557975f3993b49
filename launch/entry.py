"""Moved to train.jobs.entry (this alias goes once every importer is moved)."""
import sys

from train.jobs import entry as _moved

sys.modules[__name__] = _moved
