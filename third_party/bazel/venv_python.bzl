"""Registers <repo>/.venv/bin/python3 as the Python toolchain.

Used from //:WORKSPACE so that plain `bazel test //...` runs every py_test /
py_binary with the project's virtualenv (created by `make`), wherever the
repository is checked out. No absolute path is committed: it is computed from
the location of this file when the repository rule runs. (The launcher stub
runs with the system python3 and then execs the venv interpreter.)
"""

def _venv_python_impl(rctx):
    # This file is <root>/third_party/bazel/venv_python.bzl.
    root = rctx.path(Label("//third_party/bazel:venv_python.bzl")).dirname.dirname.dirname
    python = root.get_child(rctx.attr.venv).get_child("bin").get_child("python3")
    if not python.exists:
        fail("Python virtualenv interpreter %s not found; create the venv " % python +
             "first (run `make`), then rerun bazel.")
    rctx.file("BUILD", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    # Bazel 4's default is "#!/usr/bin/env python", which Debian lacks.
    stub_shebang = "#!/usr/bin/env python3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(python = python))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    attrs = {"venv": attr.string(default = ".venv")},
    local = True,
)
