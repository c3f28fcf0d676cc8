#!/usr/bin/env bash
# On a CUDA machine with vLLM importable: the GRPO recipe on verl's own trainer (python -m verl.trainer.main_ppo: a Ray
# cluster, the FSDP2 actor, vLLM rollout), rl-kernel off then on, with its report. verl's wheels come from .verl-wheels
# and Ray's untrimmed wheel (the listed one lacks the cluster daemons main_ppo starts) from its parts, both checked
# against benchmarks/gpu_verl_wheels.txt (benchmarks/gpu_verl_install.sh). Fetch them where pip reaches the index:
#   python3 benchmarks/fetch_verl_wheels.py && python3 benchmarks/fetch_verl_wheels.py --ray-parts .ray
# then carry .verl-wheels and each .ray/pN in calls of their own, copying each part into RAY_PARTS (default
# /tmp/ray-parts) on the machine, and run
#   bash benchmarks/gpu_recipe_verl.sh [OUT] [RECIPE ARGS...]   (default: --data synthetic --preset tiny --steps 3)
# --batch-invariant among the arguments: the mode on both sides of the on run (verl's training/rollout_probs_diff_max).
# OUT gets recipe.log and recipe.tgz (the recipe's folder: report, plots, step logs, verl's logs).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-recipe-verl "${1:-}"
shift || true
source benchmarks/gpu_verl_install.sh
verl_install || exit 1
ray_full_install "${RAY_PARTS:-/tmp/ray-parts}" || exit 1
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--data synthetic --preset tiny --steps 3)
bash recipes/grpo_gsm8k.sh --engine verl --device cuda --no-progress "${args[@]}" --out "$out/recipe" 2>&1 | tee "$out/recipe.log" | tail -40
status=${PIPESTATUS[0]}
tar czf "$out/recipe.tgz" -C "$out" recipe && rm -rf "$out/recipe"
echo "gpu_recipe_verl status=$status"
exit $status
