#!/usr/bin/env bash
# On a CUDA machine with vLLM installed: rollout (vLLM) vs training (transformers) log-probs of the
# same sampled tokens, at Qwen3-0.6B's shapes with random bf16 weights, three ways, each in a fresh
# process, and vLLM's generation throughput for each:
#   default    - vLLM as shipped (CUDA graphs, torch.compile), trainer forward as shipped (control)
#   vllm_bi    - vLLM's own VLLM_BATCH_INVARIANT=1, trainer forward as shipped
#   rl_kernel  - RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1, trainer under rl-kernel's mode
#                (decode batches as full CUDA graphs; rl_kernel_eager: the same with enforce_eager=True)
# On N GPUs, the rollout at tensor_parallel_size N against the one-GPU trainer (the mode's trainer sums each
# row-parallel linear's N rank products in rank order, the rollout's split and sum; N divides 16 at these shapes):
#   default_tpN / rl_kernel_tpN - default / rl_kernel with "tensor_parallel_size":N (default_tp2, rl_kernel_tp4, ...)
# and two more for the plugin's other hooks (vLLM's own kernels, CUDA graphs on; their throughput
# against `default` of the same job is what the hooks cost). Each setting: one warm-up generate call identical to the
# timed ones (WARMUP, default 1), then REPS (default 3) timed calls, median reported; PROMPT_LOGPROBS=1 also compares
# the prompt tokens' log-probs (prompt_gap); vLLM's JIT monitor lists every kernel compiled after its warm-up:
#   plugin_default - RL_KERNEL_VLLM=1: the default hook set (returned log-probs only)
#   plugin_sampler - RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1: the sampler hook on Model Runner V2
# and the same on vLLM's V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), against that runner in the same job:
#   default_v1 / plugin_default_v1 / plugin_sampler_v1 - the settings above on the V1 runner
# and, since the sampler hook leaves batches that return processed log-probs to vLLM's sampler, the sampler's own cost
# with requests that ask for no log-probs (--no-logprobs: no trainer, throughput only):
#   rollout / rollout_sampler, rollout_v1 / rollout_sampler_v1 - default / plugin_sampler (and their V1 settings)
#   without log-probs
#   bash benchmarks/gpu_vllm_consistency.sh [OUT] [SETTINGS...]   (default: default vllm_bi rl_kernel)
# The workload: PROMPTS (64) prompts of PROMPT_LEN (64) tokens, or of lengths drawn from PROMPT_LEN to PROMPT_LEN_MAX,
# the first SHARED_PREFIX (0) shared, SAMPLES (8) samples of MAX_TOKENS (256) new tokens each; MAX_MODEL_LEN (1024);
# ENGINE_EXTRA: more vllm.LLM arguments as JSON members without braces or spaces
# ('"enable_chunked_prefill":true,"max_num_batched_tokens":2048'); PROFILE=1: the report's rollout.profile holds one
# more call's kernels (torch.profiler); TRAIN_BATCH (32): sequences per trainer forward.
# Each setting takes about 2.5 minutes on an H200 at the default sizes (engine start, warm-up, timed calls, trainer pass).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-results "${1:-}"
shift || true
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
model=${MODEL_DIR:-/tmp/rl-kernel-qwen3-0.6b}
[ -f "$model/config.json" ] || python3 benchmarks/make_random_model.py --preset qwen3-0.6b --out "$model" || exit 1
engine="\"max_model_len\":${MAX_MODEL_LEN:-1024},\"skip_tokenizer_init\":true,\"gpu_memory_utilization\":0.45,\"jit_monitor_verbose\":true${ENGINE_EXTRA:+,$ENGINE_EXTRA}"  # no spaces: word-split in run()
args=(--model "$model" --prompts ${PROMPTS:-64} --prompt-len ${PROMPT_LEN:-64} --n ${SAMPLES:-8} --max-tokens ${MAX_TOKENS:-256}
      --dtype bfloat16 --train-batch-size ${TRAIN_BATCH:-32} --warmup ${WARMUP:-1} --reps ${REPS:-3} --engine "{$engine}"
      ${PROMPT_LEN_MAX:+--prompt-len-max "$PROMPT_LEN_MAX"} ${SHARED_PREFIX:+--shared-prefix "$SHARED_PREFIX"} ${PROFILE:+--profile})
run() {  # NAME TRAINER_FLAGS ENV_ASSIGNMENTS...
  local name=$1 flags=$2; shift 2
  echo "== $name"
  [ "${PROMPT_LOGPROBS:-0}" = 1 ] && [[ $flags != *--no-logprobs* ]] && flags="$flags --prompt-logprobs"
  env "$@" python3 -m rl_kernel_vllm.consistency "${args[@]}" $flags --out "$out/vllm_consistency_$name.json" \
    >"$out/vllm_consistency_$name.log" 2>&1 || { status=1; tail -40 "$out/vllm_consistency_$name.log"; }
  tail -1 "$out/vllm_consistency_$name.log"
  # vLLM's JIT monitor (verbose) logs each kernel compiled after its warm-up
  echo "compiled after warm-up: $(grep -o 'JIT compilation during inference: [A-Za-z0-9_]*' "$out/vllm_consistency_$name.log" | sort | uniq -c | awk '{print $NF"x"$1}' | tr '\n' ' ')"
}
for s in ${@:-default vllm_bi rl_kernel}; do
  case $s in
    default) run default '' RL_KERNEL_VLLM=0;;
    vllm_bi) run vllm_bi '' RL_KERNEL_VLLM=0 VLLM_BATCH_INVARIANT=1;;
    rl_kernel) run rl_kernel --batch-invariant RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1;;
    rl_kernel_eager) run rl_kernel_eager "--batch-invariant --engine {$engine,\"enforce_eager\":true}" \
      RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1;;
    default_tp[0-9]*) run "$s" "--engine {$engine,\"tensor_parallel_size\":${s#default_tp}}" RL_KERNEL_VLLM=0;;
    rl_kernel_tp[0-9]*) run "$s" "--batch-invariant --engine {$engine,\"tensor_parallel_size\":${s#rl_kernel_tp}}" \
      RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1;;
    plugin_default) run plugin_default '' RL_KERNEL_VLLM=1;;
    plugin_sampler) run plugin_sampler '' RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1;;
    rollout) run rollout --no-logprobs RL_KERNEL_VLLM=0;;
    rollout_sampler) run rollout_sampler --no-logprobs RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1;;
    default_v1) run default_v1 '' RL_KERNEL_VLLM=0 VLLM_USE_V2_MODEL_RUNNER=0;;
    plugin_default_v1) run plugin_default_v1 '' RL_KERNEL_VLLM=1 VLLM_USE_V2_MODEL_RUNNER=0;;
    plugin_sampler_v1) run plugin_sampler_v1 '' RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1 VLLM_USE_V2_MODEL_RUNNER=0;;
    rollout_v1) run rollout_v1 --no-logprobs RL_KERNEL_VLLM=0 VLLM_USE_V2_MODEL_RUNNER=0;;
    rollout_sampler_v1) run rollout_sampler_v1 --no-logprobs RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_SAMPLER=1 VLLM_USE_V2_MODEL_RUNNER=0;;
    *) echo "unknown setting $s: default vllm_bi rl_kernel rl_kernel_eager default_tpN rl_kernel_tpN plugin_default plugin_sampler rollout rollout_sampler default_v1 plugin_default_v1 plugin_sampler_v1 rollout_v1 rollout_sampler_v1"; status=1;;
  esac
done
echo "gpu_vllm_consistency status=$status"
exit $status
