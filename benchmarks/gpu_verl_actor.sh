#!/usr/bin/env bash
# On a CUDA machine: verl 0.9.1's FSDP2 actor with verl's default head, verl's fused Triton kernels and rl-kernel's
# switch, at Qwen3-0.6B and Qwen3-1.7B shapes (random bf16 weights), packed and padded, fp32 off-vs-on checks, and the
# largest micro-batch each variant fits (benchmarks/bench_verl_actor.py). verl and the dependencies the machine lacks
# are installed from the wheels of benchmarks/gpu_verl_wheels.txt (fetched here with
# `python3 benchmarks/fetch_verl_wheels.py`, into .verl-wheels, which the call carries), each checked by sha256.
#   bash benchmarks/gpu_verl_actor.sh [OUT] [JOB...]
# JOB: SHAPE or SHAPE:PART, SHAPE a make_random_model preset (qwen3-0.6b, qwen3-1.7b, qwen3-30b-a3b-8l, tiny,
# tiny-moe), PART in all (default: both layouts, then the search), packed, padded, search. Default jobs: qwen3-0.6b qwen3-1.7b. Per job OUT gets bench_verl_actor_<shape>_<parts>.json
# and a log. Environment: VERL_WHEELS (default .verl-wheels), VERL_SITE (install target, default /tmp/verl-site;
# benchmarks/gpu_verl_install.sh),
# BENCH_ARGS (more arguments for every job, e.g. "--reps 5"); for search jobs SEARCH_VARIANTS (default: all four, each
# in its own process) and SEARCH_PROMPTS (default 64: a batch large enough to reach the limits).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-verl-actor "${1:-}"
shift || true
source benchmarks/gpu_verl_install.sh
verl_install || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for job in ${@:-qwen3-0.6b qwen3-1.7b}; do
  shape=${job%%:*} part=${job#*:}
  [ "$part" = "$job" ] && part=all
  case $part in
    all) flags=(--layouts packed,padded --max-microbatch);;
    packed|padded) flags=(--layouts "$part");;
    search) flags=(--layouts none --max-microbatch);;  # below: one process per variant
    *) echo "job $job: PART must be all, packed, padded or search, got $part"; status=1; continue;;
  esac
  echo "== $shape $part"
  if [ "$part" = search ]; then
    # each variant in a fresh process: a process's earlier workers keep GPU memory the later ones' search would miss
    for variant in ${SEARCH_VARIANTS:-verl_default rl_kernel rl_kernel_batch_invariant verl_fused_triton}; do
      log="$out/bench_verl_actor_${shape}_search_$variant.log"
      python3 benchmarks/bench_verl_actor.py --model-shape "$shape" --model-dir "/tmp/rl-kernel-verl-$shape" "${flags[@]}" \
        --prompts ${SEARCH_PROMPTS:-64} --check-prompts 0 --variants "$variant" ${BENCH_ARGS:-} --out "$out" >"$log" 2>&1 || status=1
      grep '^max micro-batch' "$log" || tail -20 "$log"
    done
    continue
  fi
  python3 benchmarks/bench_verl_actor.py --model-shape "$shape" --model-dir "/tmp/rl-kernel-verl-$shape" "${flags[@]}" \
    ${BENCH_ARGS:-} --out "$out" >"$out/bench_verl_actor_${shape}_$part.log" 2>&1 || status=1
  grep -A12 '^layout ' "$out/bench_verl_actor_${shape}_$part.log" || tail -30 "$out/bench_verl_actor_${shape}_$part.log"
done
echo "gpu_verl_actor status=$status"
exit $status
