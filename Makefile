# Two entry points (README.md; the layers: docs/lab/quickstart.md,
# "Installing"): `make run` and `make test`. Both create
# .venv on first use and install what they need, in layers; later calls
# reuse it and install nothing (a stamp per layer, redone when its files
# change):
#   run layer      requirements.txt, requirements-nodeps.txt and the
#                  library, geom (editable): `make run`, the launchers,
#                  `make bench`
#   test layer     requirements-test.txt: `make test`
#   compile layer  requirements-compile.txt (--no-deps) into
#                  .venv/compile_toolchain, never into site-packages
#                  (`make compile-toolchain`; `make test` runs it)
# uv does the installs (pip installs it, pinned, into .venv);
# `make INSTALLER=pip ...` has pip do them instead.
# The lab (train/, launch/, configs/, studies/, bench/, tests/) is not
# installed: the recipes run it from here (`python -m launch.train` finds
# it in the current directory), as big_vision and MaxText run from their
# checkouts; pytest finds it through pyproject.toml's `pythonpath`, and the
# processes tests start through PYTHONPATH (tests/conftest.py). The
# package that pyproject.toml builds holds geom alone (tests/test_wheel.py
# builds its wheel and checks it).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.run-layer
TEST_STAMP := $(VENV)/.test-layer
TOOLCHAIN := $(VENV)/compile_toolchain
TOOLCHAIN_STAMP := $(TOOLCHAIN)/.installed
WORKDIR ?= workdirs/digits
CONFIG ?= configs/digits.py
# Tests simulate an 8-device host; pytest-level setup lives in tests/conftest.py.
PYTEST_ARGS ?=

INSTALLER ?= uv
UV_VERSION := 0.13.8
PIP_VERSION := 26.3
ifeq ($(INSTALLER),uv)
# The venv starts without pip (ensurepip alone takes seconds); the base
# interpreter's pip installs uv into it (`pip --python`), else the venv's
# own pip once ensurepip has put it there; then uv puts pip in (pinned),
# for .venv/bin/pip.
VENV_ARGS := --without-pip
INSTALLER_STAMP := $(VENV)/.uv-$(UV_VERSION)
# uv reads no pip configuration: it takes packages from PyPI (or
# UV_DEFAULT_INDEX), certificates from the system's store (as pip does),
# and builds sdists (promise) with the pinned setuptools.
INSTALL := $(VENV)/bin/uv pip install --quiet --system-certs --python $(PY) \
    --build-constraints requirements.txt
else ifeq ($(INSTALLER),pip)
VENV_ARGS :=
INSTALLER_STAMP := $(VENV)/bin/pip
INSTALL := $(PY) -m pip install --quiet
else
$(error INSTALLER=$(INSTALLER): unknown installer; valid choices: uv, pip)
endif

.PHONY: run test test-all compile-toolchain bench bazel-test steering docs clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)

$(VENV)/bin/pip: | $(PY)
	test -x $@ || $(PY) -m ensurepip --default-pip

$(VENV)/.uv-$(UV_VERSION): | $(PY)
	if $(PYTHON) -m pip --version >/dev/null 2>&1; then \
	  $(PYTHON) -m pip --python $(PY) install --quiet uv==$(UV_VERSION); \
	else \
	  $(PY) -m ensurepip --default-pip && \
	  $(PY) -m pip install --quiet uv==$(UV_VERSION); \
	fi
	$(INSTALL) pip==$(PIP_VERSION)
	touch $@

# Each layer is complete (tests/test_requirements.py checks it), so it is
# installed as it stands, --no-deps: no resolution, and with uv no rebuild
# of the one sdist (promise) to read its metadata. Then geom, editable
# (its dependencies, jax, optax and numpy, are pinned in requirements.txt);
# only geom: the lab stays in the checkout (above). Redone when its
# version (geom/_version.py) changes, so that the installed metadata
# matches geom.__version__.
$(RUN_STAMP): requirements.txt requirements-nodeps.txt pyproject.toml geom/_version.py | $(INSTALLER_STAMP)
	$(INSTALL) --no-deps -r requirements.txt -r requirements-nodeps.txt
	$(INSTALL) --no-deps --no-build-isolation -e .
	touch $@

# The suite starts hundreds of Python processes (launchers, multihost,
# kill-and-resume). Neither installer writes bytecode by default, and where
# PYTHONDONTWRITEBYTECODE is set (CI images) no import ever caches it, so
# each process compiled jax, flax and TF from source: 4.5 s against 1.2 s
# per `import jax, flax, optax`, and a suite of 54 min against 35. The test
# layer compiles site-packages once (25 s on 2 cores); `make run` does not
# pay for it.
$(TEST_STAMP): requirements-test.txt $(RUN_STAMP)
	$(INSTALL) --no-deps -r requirements-test.txt
	$(PY) -m compileall -q -j0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null
	touch $@

# Installed beside, then moved into place: an interrupted install leaves no
# half toolchain behind the stamp.
$(TOOLCHAIN_STAMP): requirements-compile.txt | $(INSTALLER_STAMP)
	rm -rf $(TOOLCHAIN).partial
	$(INSTALL) --no-deps --target $(TOOLCHAIN).partial -r requirements-compile.txt
	$(PY) -m compileall -q -j0 $(TOOLCHAIN).partial >/dev/null
	touch $(TOOLCHAIN).partial/.installed
	rm -rf $(TOOLCHAIN)
	mv $(TOOLCHAIN).partial $(TOOLCHAIN)

compile-toolchain: $(TOOLCHAIN_STAMP)

run: $(RUN_STAMP)
	$(PY) -m launch.train --config=$(CONFIG) --workdir=$(WORKDIR)

# The slowest tests are listed at the end, to keep the suite's time in view.
# One pytest-xdist worker per core, at most 4 (each simulates 8 devices and
# compiles pod-size programs), a test file per worker at a time. On 2 cores
# the suite's processes kept 1.4 cores busy on average when run one at a
# time (tests/conftest.py shares the trained fixtures between workers).
# Files start longest first (tests/conftest.py orders them; xdist's own
# order, by number of tests, is turned off).
TEST_WORKERS ?= -n logical --maxprocesses=4 --dist loadfile \
	--no-loadscope-reorder
# tests/test_bazel_load.py runs Bazel: Debian's bazel-bootstrap, installed
# here when missing, best effort (CI is a fresh Debian machine, as root);
# where it cannot be (no root, no Debian registry) that test skips in one
# line and the suite runs on.
BAZEL_INSTALL = command -v bazel >/dev/null || { \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q bazel-bootstrap || \
	{ apt-get update -q && apt-get install -y -q bazel-bootstrap; }; }
BAZEL_TRY_INSTALL = ( $(BAZEL_INSTALL) ) >$(VENV)/bazel-install.log 2>&1 || \
	echo "bazel-bootstrap not installed ($(VENV)/bazel-install.log):" \
	  "tests/test_bazel_load.py skips"
test: $(TEST_STAMP) $(TOOLCHAIN_STAMP)
	@$(BAZEL_TRY_INSTALL)
	$(PY) -m compileall -q geom train launch configs bench tests >/dev/null
	$(PY) -m pytest -q --durations=30 $(TEST_WORKERS) $(PYTEST_ARGS)

test-all: $(TEST_STAMP) $(TOOLCHAIN_STAMP)
	@$(BAZEL_TRY_INSTALL)
	$(PY) -m pytest -q -m '' $(TEST_WORKERS) $(PYTEST_ARGS)

bench: $(RUN_STAMP)
	$(PY) -m bench.training.trainer_overhead

# The documentation site (docs/site.md), from the code's docstrings and the
# pages under docs/, into docs/_build/html. Warnings are errors, as in
# tests/test_docs.py: a broken cross-reference, an unknown role, or a public
# name of geom without a docstring or an example fails the build.
docs: $(TEST_STAMP)
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html

# The steering study (RESULTS.md): the LM on templates + fortunes, then the
# method x alpha evaluation. Both resume / skip finished work.
steering: $(RUN_STAMP)
	test -d /usr/share/games/fortunes || apt-get install -y fortunes
	$(PY) -m launch.train --config=configs/lm.py --workdir=workdirs/lm
	$(PY) -m launch.steer_eval --config=configs/steering.py \
	    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer

# Bazel 4 from Debian (offline WORKSPACE, see third_party/bazel/); tests run
# with .venv's interpreter, so the venv comes first.
bazel-test: $(TEST_STAMP) $(TOOLCHAIN_STAMP)
	$(BAZEL_INSTALL)
	bazel test --local_test_jobs=2 //...

clean-venv:
	rm -rf $(VENV)
