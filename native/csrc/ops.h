// Host entry points of the rl-kernel native extension (bound to Python in bind_<family>.cpp).
//
// Arguments arrive validated by rl_kernel_core (shapes, dtypes, target ids); these functions
// check only what would make a kernel read or write out of bounds. Every launch goes to the
// current stream of the inputs' device; nothing synchronises with the host.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace rlk {

// logprob_from_logits. logits [N, V] fp32/bf16/fp16 with unit stride along V (rows may be
// strided), targets [N] int64/int32. Returns {logprob [N], entropy [N] or [0], lse [N]}, fp32;
// rows at ignore_index give 0 (lse 0) and are not read.
std::vector<at::Tensor> logprob_fwd(const at::Tensor& logits, const at::Tensor& targets, double temperature,
                                    int64_t ignore_index, bool with_entropy);

// d/d logits [N, V] (contiguous, logits' dtype) of sum(g_lp * logprob + g_ent * entropy), the
// softmax recomputed from logits and the saved lse. grad_logprob / grad_entropy: [N] fp32 (any
// stride, e.g. expanded) or None.
at::Tensor logprob_bwd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                       const at::Tensor& entropy, const std::optional<at::Tensor>& grad_logprob,
                       const std::optional<at::Tensor>& grad_entropy, double temperature, int64_t ignore_index);

// ratio_kl. kl_code: 0 k1, 1 abs, 2 k2, 3 k3; kl_plus: k2's gradient with the base value.
std::vector<at::Tensor> ratio_kl_fwd(const at::Tensor& logprob, const at::Tensor& old_logprob,
                                     const at::Tensor& ref_logprob, int64_t kl_code);
at::Tensor ratio_kl_bwd(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& ref_logprob,
                        const std::optional<at::Tensor>& grad_ratio, const std::optional<at::Tensor>& grad_kl,
                        int64_t kl_code, bool kl_plus);

// policy_loss over [S, T] tensors. agg: 0 token-mean, 1 seq-mean-token-sum, 2 seq-mean-token-mean,
// 3 seq-mean-token-sum-norm, 4 token-sum. Returns {loss [], metrics [6], seq_weight [S], totals [2]}.
std::vector<at::Tensor> policy_loss_fwd(const at::Tensor& logprob, const at::Tensor& old_logprob,
                                        const at::Tensor& advantages, const at::Tensor& mask,
                                        const at::Tensor& ref_logprob, const std::optional<at::Tensor>& entropy,
                                        const std::optional<at::Tensor>& rollout_is_weights, double clip_ratio_low,
                                        double clip_ratio_high, std::optional<double> clip_ratio_c, int64_t kl_code,
                                        double kl_coef, double entropy_coef, int64_t agg);

// Writes d loss / d logprob into grad_logprob and d loss / d entropy into grad_entropy (either may
// be None: not wanted); both [S, T] contiguous, in the dtype the caller allocated.
void policy_loss_bwd(const at::Tensor& grad_loss, const at::Tensor& logprob, const at::Tensor& old_logprob,
                     const at::Tensor& advantages, const at::Tensor& mask, const at::Tensor& ref_logprob,
                     const std::optional<at::Tensor>& rollout_is_weights, const at::Tensor& seq_weight,
                     const at::Tensor& totals, double clip_ratio_low, double clip_ratio_high,
                     std::optional<double> clip_ratio_c, int64_t kl_code, bool kl_plus, double kl_coef,
                     double entropy_coef, int64_t agg, const std::optional<at::Tensor>& grad_logprob,
                     const std::optional<at::Tensor>& grad_entropy);

// The per-chunk pass of linear_logprob over an fp32 logits chunk [rows, V] (unit stride along V)
// that cuBLAS wrote, raw = h @ W^T; z = (raw + bias) * inv_temp. Only the first n = targets.size(0)
// rows are read. stats writes logprob, lse and (unless None) entropy, each a contiguous fp32 [n]
// tensor (ignore_index rows: 0). grad writes dl[:n] (fp32/bf16/fp16, unit stride along V; it may
// overwrite the logits in place when its rows start where theirs do) = d/d raw of
// sum(grad_logprob * logprob + grad_entropy * entropy), from the saved lse (and entropy when
// grad_entropy is given); ignore_index rows get 0. bias: contiguous [V] of any float dtype, or None.
void linear_chunk_stats(const at::Tensor& logits, const std::optional<at::Tensor>& bias, const at::Tensor& targets,
                        double inv_temp, int64_t ignore_index, at::Tensor logprob,
                        const std::optional<at::Tensor>& entropy, at::Tensor lse);
void linear_chunk_grad(const at::Tensor& logits, at::Tensor dl, const std::optional<at::Tensor>& bias,
                       const at::Tensor& targets, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
                       const at::Tensor& grad_logprob, const std::optional<at::Tensor>& grad_entropy, double inv_temp,
                       int64_t ignore_index);

// linear_logprob's gemm-route passes on sm_90a (linear_sm90.cu), bit for bit the Triton passes at the
// default tile (rl_kernel_core/linear/triton_stats.py, triton_grad.py), over the first `rows` rows of
// hidden [>=rows, D] against weight [V, D] (both bf16 or both fp16, TMA-compatible: unit inner stride,
// 16-byte aligned rows and address); z = (hidden @ weight^T + bias) * inv_temp; targets [>=rows]
// int64/int32; bias: contiguous [V] of weight's dtype, or None; group_m: row blocks that sweep the
// vocab together (L2 reuse; no effect on the result).
// stats: the tile statistics into partials [3, >=rows, ceil(V / 256)] fp32 (max, sum, and with
//   want_entropy the entropy statistic) and ztgt [>=rows] fp32 (the target's z, written by the tile
//   that holds it); keep (or None): fp32 [>=rows, V] with unit inner stride that receives the raw
//   logits hidden @ weight^T (before bias and scale).
// grad: dl [>=rows, V] (weight's dtype, unit inner stride) = d/d raw logits of
//   sum(grad_logprob * logprob + grad_entropy * entropy) from the saved lse (and entropy, given
//   together with grad_entropy), all fp32 [>=rows]; ignore_index rows get 0.
// linear_sm90_built: whether this build holds the sm_90a code (else both refuse).
void linear_stats_sm90(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& targets, int64_t rows, double inv_temp, int64_t ignore_index,
                       at::Tensor partials, at::Tensor ztgt, bool want_entropy, const std::optional<at::Tensor>& keep,
                       int64_t group_m);
void linear_grad_sm90(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const at::Tensor& targets, int64_t rows, double inv_temp, int64_t ignore_index, const at::Tensor& lse,
                      const std::optional<at::Tensor>& entropy, const at::Tensor& grad_logprob,
                      const std::optional<at::Tensor>& grad_entropy, at::Tensor dl, int64_t group_m);
bool linear_sm90_built();

// group_advantages. Exactly one of group_size / group_index. estimator: 0 grpo, 1 dr_grpo, 2 rloo.
// Returns [N] fp32 (fp64 for fp64 rewards), computed in fp64.
at::Tensor group_advantages(const at::Tensor& rewards, std::optional<int64_t> group_size,
                            const std::optional<at::Tensor>& group_index, int64_t estimator, bool norm_by_std,
                            double eps);

}  // namespace rlk
