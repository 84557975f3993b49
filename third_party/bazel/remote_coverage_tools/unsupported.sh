#!/bin/sh
echo "bazel coverage is not supported (offline stub of @remote_coverage_tools)" >&2
exit 1
