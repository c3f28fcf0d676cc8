#!/usr/bin/env bash
# Usage: scripts/typecheck.sh [PYTHON]
# The static type check (mypy, configured in pyproject.toml [tool.mypy]): wrong arity, unknown
# keyword arguments and type errors in rl_kernel_* and tests/; then the formatter and linter (ruff,
# [tool.ruff]): `ruff format` must leave every file as it is, `ruff check` find nothing.
# PYTHON (default: the core tier's environment, built by scripts/env.sh) must have mypy, ruff and
# the core tier's packages.
# tests/verl and tests/vllm are checked in runs of their own: module names such as conftest,
# test_engine and test_plugin repeat across those folders, as pytest runs each tier separately.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${1:-}
if [ -z "$python" ]; then
  env=$(scripts/env.sh core) || { echo "typecheck: the core environment could not be built" >&2; exit 1; }
  python="$env/bin/python"
fi
status=0
"$python" -m mypy || status=1
for dir in tests/verl tests/vllm; do
  "$python" -m mypy "$dir" || status=1
done
"$python" -m ruff format --check . >/dev/null || { "$python" -m ruff format --check . | grep -v "already formatted"; echo "run: ruff format ." >&2; status=1; }
"$python" -m ruff check --quiet . || status=1
exit $status
