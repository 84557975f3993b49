# Two entry points (see README.md): `make run` and `make test`. Both create
# .venv on first use and install the pinned stack; later calls reuse it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/digits
CONFIG ?= configs/digits.py
# Tests simulate an 8-device host; pytest-level setup lives in tests/conftest.py.
PYTEST_ARGS ?=

.PHONY: run test test-all bench bazel-test steering clean-venv

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m launch.train --config=$(CONFIG) --workdir=$(WORKDIR)

# The slowest tests are listed at the end, to keep the suite's time in view.
test: $(STAMP)
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m '' $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.trainer_overhead

# The steering study (RESULTS.md): the LM on templates + fortunes, then the
# method x alpha evaluation. Both resume / skip finished work.
steering: $(STAMP)
	test -d /usr/share/games/fortunes || apt-get install -y fortunes
	$(PY) -m launch.train --config=configs/lm.py --workdir=workdirs/lm
	$(PY) -m launch.steer_eval --config=configs/steering.py \
	    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer

# Bazel 4 from Debian (offline WORKSPACE, see third_party/bazel/); tests run
# with .venv's interpreter, so the venv comes first.
bazel-test: $(STAMP)
	command -v bazel >/dev/null || apt-get install -y bazel-bootstrap
	bazel test --local_test_jobs=2 //...

clean-venv:
	rm -rf $(VENV)
