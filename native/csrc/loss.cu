// ratio_kl and policy_loss: the semantics of rl_kernel_core/loss/reference.py (verl 0.9.1),
// computed in fp32 with the reference's clamps:
//
//   ratio = exp(clamp(logprob - old, +-20)); KL estimators k1, abs, k2, k3 (x = clamp(ref - logprob,
//   +-20), clamp(e^x - x - 1, +-10)); a '+' keeps the base value and takes k2's gradient.
//   pg = max(-A r, -A clip(r, 1 - lo, 1 + hi)); dual clip min(pg, -A c) where A < 0; times the
//   rollout IS weights. Tokens outside the mask never enter a sum (not even as NaN).
//
// Gradients follow PyTorch's autograd of that reference, ties included: clamp passes the gradient
// on its closed interval; maximum/minimum split it in halves on ties (for the surrogate the
// unclipped branch carries it whenever -A r >= -A clip(r)).
//
// policy_loss is three launches, none with atomics: (1) one block per (sequence, 1024-token block)
// reduces its tokens to 7 partial sums (pg, kl, entropy, mask weight, clipped, dual-clipped,
// -log ratio) by a fixed tree; (2) one block sums the partials in a fixed order (per sequence, then
// over sequences), applies the aggregation and writes the loss, the 6 metrics, each sequence's mask
// weight and the 2 totals the backward needs, all on the device; (3) the backward recomputes each
// token's terms and scales them by its sequence's aggregation weight and the upstream gradient,
// read from device memory. Results are bitwise equal run to run.
#include "codes.h"
#include "common.cuh"
#include "ops.h"
#include "tuning.h"

#include <type_traits>

namespace rlk {
namespace {

constexpr float kLogRatioClamp = 20.f;  // reference.policy_loss.LOG_RATIO_CLAMP
constexpr float kLowVarKlClamp = 10.f;  // reference.policy_loss.LOW_VAR_KL_CLAMP
constexpr int kPartials = 7;

// How the per-token kernels read their tensors: kAnyTypes through each tensor's type code; the
// other two are the common layouts, read directly (so loads are not serialised behind a branch):
// every float tensor fp32 (gradients included), the mask bool or fp32.
enum LoadMode : int { kAnyTypes = 0, kF32BoolMask = 1, kF32FloatMask = 2 };

template <int MODE>
__device__ __forceinline__ float ld(const void* p, int code, int64_t i) {
  if constexpr (MODE == kAnyTypes) return load_f32(p, code, i);
  else return static_cast<const float*>(p)[i];
}

template <int MODE>
__device__ __forceinline__ float ld_mask(const void* p, int code, int64_t i) {
  if constexpr (MODE == kF32BoolMask) return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
  else if constexpr (MODE == kF32FloatMask) return static_cast<const float*>(p)[i];
  else return load_f32(p, code, i);
}

template <int MODE>
__device__ __forceinline__ void st(void* p, int code, int64_t i, float v) {
  if constexpr (MODE == kAnyTypes) store_f32(p, code, i, v);
  else static_cast<float*>(p)[i] = v;
}

__device__ __forceinline__ float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// k3 pieces for d_ref = logprob - ref: x = clamp(-d_ref, +-20), ex = e^x, k3 = ex - x - 1.
struct K3 {
  float ex, k3;
};

__device__ __forceinline__ K3 k3_terms(float d_ref) {
  const float x = clampf(-d_ref, -kLogRatioClamp, kLogRatioClamp);
  const float ex = expf(x);
  return {ex, ex - x - 1.f};
}

__device__ __forceinline__ float kl_value(int kl, float d_ref, const K3& t) {
  switch (kl) {
    case kK1: return d_ref;
    case kAbs: return fabsf(d_ref);
    case kK2: return 0.5f * d_ref * d_ref;
    default: return clampf(t.k3, -kLowVarKlClamp, kLowVarKlClamp);
  }
}

__device__ __forceinline__ float kl_grad(int kl, bool plus, float d_ref, const K3& t) {
  if (plus || kl == kK2) return d_ref;
  if (kl == kK1) return 1.f;
  if (kl == kAbs) return d_ref > 0.f ? 1.f : (d_ref < 0.f ? -1.f : 0.f);
  const bool passes = t.k3 >= -kLowVarKlClamp && t.k3 <= kLowVarKlClamp && d_ref >= -kLogRatioClamp &&
                      d_ref <= kLogRatioClamp;
  return passes ? 1.f - t.ex : 0.f;
}

// ------------------------------------------------------------------------------------ ratio_kl

template <int MODE>
__global__ void __launch_bounds__(kElemThreads) ratio_kl_fwd_kernel(
    const void* lp, int lp_t, const void* old, int old_t, const void* ref, int ref_t,
    float* __restrict__ ratio, float* __restrict__ kl, int64_t n, int kl_code) {
  for (int64_t i = blockIdx.x * int64_t(kElemThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kElemThreads) {
    const float l = ld<MODE>(lp, lp_t, i);
    const float d_old = l - ld<MODE>(old, old_t, i);
    const float d_ref = l - ld<MODE>(ref, ref_t, i);
    ratio[i] = expf(clampf(d_old, -kLogRatioClamp, kLogRatioClamp));
    kl[i] = kl_value(kl_code, d_ref, k3_terms(d_ref));
  }
}

template <int MODE>
__global__ void __launch_bounds__(kElemThreads) ratio_kl_bwd_kernel(
    const void* lp, int lp_t, const void* old, int old_t, const void* ref, int ref_t,
    const float* __restrict__ g_ratio, const float* __restrict__ g_kl, void* grad, int grad_t,
    int64_t n, int kl_code, bool kl_plus) {
  for (int64_t i = blockIdx.x * int64_t(kElemThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kElemThreads) {
    const float l = ld<MODE>(lp, lp_t, i);
    float g = 0.f;
    if (g_ratio != nullptr) {
      const float d_old = l - ld<MODE>(old, old_t, i);
      const bool passes = d_old >= -kLogRatioClamp && d_old <= kLogRatioClamp;
      g += passes ? g_ratio[i] * expf(d_old) : 0.f;
    }
    if (g_kl != nullptr) {
      const float d_ref = l - ld<MODE>(ref, ref_t, i);
      g += g_kl[i] * kl_grad(kl_code, kl_plus, d_ref, k3_terms(d_ref));
    }
    st<MODE>(grad, grad_t, i, g);
  }
}

// Grid of the grid-stride elementwise kernels: one element per thread up to 2^20 blocks.
int elementwise_blocks(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kElemThreads), 1 << 20)); }

// ---------------------------------------------------------------------------------- policy_loss

struct TokenArgs {
  const void *lp, *old, *adv, *mask, *ref, *ent, *w;
  int lp_t, old_t, adv_t, mask_t, ref_t, ent_t, w_t;
  int64_t S, T, NB;
  float clip_lo, clip_hi, clip_c, kl_coef, entropy_coef;
  int kl, agg;
  bool kl_plus, dual, add_kl;
};

// The clipped surrogate of token i: its value pg, d pg / d logprob, and the metric flags.
struct Surrogate {
  float pg, dpg, log_ratio;
  bool clipped, dual;
};

template <int MODE>
__device__ __forceinline__ Surrogate surrogate(const TokenArgs& a, int64_t i, float lp) {
  const float adv = ld<MODE>(a.adv, a.adv_t, i);
  const float d_old = lp - ld<MODE>(a.old, a.old_t, i);
  Surrogate r;
  r.log_ratio = clampf(d_old, -kLogRatioClamp, kLogRatioClamp);
  const float ratio = expf(r.log_ratio);
  const float unclipped = -adv * ratio;
  const float clipped_loss = -adv * clampf(ratio, a.clip_lo, a.clip_hi);
  r.pg = fmaxf(unclipped, clipped_loss);
  // maximum splits ties in halves, and on a tie both branches carry -A r (clamp passes it)
  r.dpg = (unclipped >= clipped_loss && d_old >= -kLogRatioClamp && d_old <= kLogRatioClamp) ? -adv * ratio : 0.f;
  r.clipped = clipped_loss > unclipped;
  r.dual = false;
  if (a.dual && adv < 0.f) {
    const float dual_loss = -adv * a.clip_c;
    r.dual = r.pg > dual_loss;
    r.dpg *= r.pg < dual_loss ? 1.f : (r.pg == dual_loss ? 0.5f : 0.f);
    r.pg = fminf(dual_loss, r.pg);
  }
  if (a.w != nullptr) {
    const float w = ld<MODE>(a.w, a.w_t, i);
    r.pg *= w;
    r.dpg *= w;
  }
  return r;
}

template <int MODE>
__global__ void __launch_bounds__(kTokThreads) policy_tokens_fwd_kernel(TokenArgs a, float* __restrict__ partials) {
  __shared__ float sh[kPartials * kTokThreads];
  const int64_t s = blockIdx.x / a.NB, b = blockIdx.x % a.NB;
  float acc[kPartials] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kTokPerThread; ++k) {
    const int64_t t = b * kTokBlock + int64_t(k) * kTokThreads + threadIdx.x;
    if (t < a.T) {
      const int64_t i = s * a.T + t;
      const float m = ld_mask<MODE>(a.mask, a.mask_t, i);
      if (m != 0.f) {
        const float lp = ld<MODE>(a.lp, a.lp_t, i);
        const Surrogate r = surrogate<MODE>(a, i, lp);
        const float d_ref = lp - ld<MODE>(a.ref, a.ref_t, i);
        acc[0] += r.pg * m;
        acc[1] += kl_value(a.kl, d_ref, k3_terms(d_ref)) * m;
        if (a.ent != nullptr) acc[2] += ld<MODE>(a.ent, a.ent_t, i) * m;
        acc[4] += r.clipped ? m : 0.f;
        acc[5] += r.dual ? m : 0.f;
        acc[6] += -r.log_ratio * m;
      }
      acc[3] += m;
    }
  }
  block_sum<kTokThreads, kPartials>(acc, sh);
  if (threadIdx.x == 0) {
    const int64_t stride_q = a.S * a.NB;
#pragma unroll
    for (int q = 0; q < kPartials; ++q) partials[q * stride_q + s * a.NB + b] = acc[q];
  }
}

// One block. Threads form groups of ``lanes`` (a power of two fixed by NB): a group owns a
// sequence at a time, its lanes sum strided shares of the sequence's block partials and a tree
// over the lanes joins them, so long sequences (large NB) are read in parallel.
__global__ void __launch_bounds__(kFinThreads) policy_finish_kernel(
    const float* __restrict__ partials, float* __restrict__ loss, float* __restrict__ metrics,
    float* __restrict__ seq_weight, float* __restrict__ totals, int64_t S, int64_t T, int64_t NB, int lanes,
    float kl_coef, float entropy_coef, int agg, bool add_kl, bool add_ent) {
  // token-level totals of the 7 partials, then sequence-level sums of pg, kl, entropy and count
  constexpr int K = kPartials + 4;
  __shared__ float sh[K * kFinThreads];
  float acc[K] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int tid = threadIdx.x, lane = tid % lanes, groups = kFinThreads / lanes;
  const int64_t stride_q = S * NB;
  for (int64_t s0 = 0; s0 < S; s0 += groups) {
    const int64_t s = s0 + tid / lanes;
    float r[kPartials] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (s < S) {
      for (int64_t b = lane; b < NB; b += lanes) {
#pragma unroll
        for (int q = 0; q < kPartials; ++q) r[q] += partials[q * stride_q + s * NB + b];
      }
    }
#pragma unroll
    for (int q = 0; q < kPartials; ++q) sh[q * kFinThreads + tid] = r[q];
    __syncthreads();
    for (int stride = lanes / 2; stride > 0; stride >>= 1) {
      if (lane < stride) {
#pragma unroll
        for (int q = 0; q < kPartials; ++q) sh[q * kFinThreads + tid] += sh[q * kFinThreads + tid + stride];
      }
      __syncthreads();
    }
    if (lane == 0 && s < S) {
#pragma unroll
      for (int q = 0; q < kPartials; ++q) r[q] = sh[q * kFinThreads + tid];
      seq_weight[s] = r[3];
#pragma unroll
      for (int q = 0; q < kPartials; ++q) acc[q] += r[q];
      const bool used = r[3] > 0.f;
      if (agg == kSeqMeanTokenMean) {
        const float den = used ? r[3] : 1.f;
        r[0] /= den;
        r[1] /= den;
        r[2] /= den;
      }
      if (used) {
        acc[7] += r[0];
        acc[8] += r[1];
        acc[9] += r[2];
        acc[10] += 1.f;
      }
    }
    __syncthreads();  // sh is rewritten by the next round
  }
  block_sum<kFinThreads, K>(acc, sh);
  if (threadIdx.x != 0) return;
  const float w_total = acc[3], n_used = acc[10];
  const float w_den = w_total > 0.f ? w_total : 1.f;
  float pg, kl, ent;
  if (agg == kTokenMean) {
    pg = acc[0] / w_den;
    kl = acc[1] / w_den;
    ent = acc[2] / w_den;
  } else if (agg == kTokenSum) {
    pg = acc[0];
    kl = acc[1];
    ent = acc[2];
  } else {
    const float n_den = n_used > 0.f ? n_used : 1.f;
    pg = acc[7] / n_den;
    kl = acc[8] / n_den;
    ent = acc[9] / n_den;
    if (agg == kSeqMeanTokenSumNorm) {
      const float t_den = static_cast<float>(T > 1 ? T : 1);
      pg /= t_den;
      kl /= t_den;
      ent /= t_den;
    }
  }
  float out = pg;
  if (add_kl) out += kl_coef * kl;
  if (add_ent) out -= entropy_coef * ent;
  loss[0] = out;
  metrics[0] = pg;
  metrics[1] = acc[4] / w_den;
  metrics[2] = acc[5] / w_den;
  metrics[3] = acc[6] / w_den;
  metrics[4] = kl;
  metrics[5] = ent;
  totals[0] = w_total;
  totals[1] = n_used;
}

template <int MODE>
__global__ void __launch_bounds__(kTokThreads) policy_tokens_bwd_kernel(
    TokenArgs a, const float* __restrict__ grad_loss, const float* __restrict__ seq_weight,
    const float* __restrict__ totals, void* grad_lp, int glp_t, void* grad_ent, int gent_t) {
  const int64_t s = blockIdx.x / a.NB, b = blockIdx.x % a.NB;
  // d loss / d (token term) = upstream * (aggregation scale of this sequence) * mask weight
  const float g = grad_loss[0];
  float scale;
  if (a.agg == kTokenMean) {
    const float w_total = totals[0];
    scale = g / (w_total > 0.f ? w_total : 1.f);
  } else if (a.agg == kTokenSum) {
    scale = g;
  } else {
    const float r_w = seq_weight[s], n_used = totals[1];
    scale = r_w > 0.f ? g / (n_used > 0.f ? n_used : 1.f) : 0.f;
    if (a.agg == kSeqMeanTokenMean) scale /= r_w > 0.f ? r_w : 1.f;
    if (a.agg == kSeqMeanTokenSumNorm) scale /= static_cast<float>(a.T > 1 ? a.T : 1);
  }
#pragma unroll
  for (int k = 0; k < kTokPerThread; ++k) {
    const int64_t t = b * kTokBlock + int64_t(k) * kTokThreads + threadIdx.x;
    if (t >= a.T) continue;
    const int64_t i = s * a.T + t;
    const float m = ld_mask<MODE>(a.mask, a.mask_t, i);
    const bool keep = m != 0.f;
    const float tok_scale = keep ? m * scale : 0.f;
    if (grad_lp != nullptr) {
      float out = 0.f;
      if (keep) {
        const float lp = ld<MODE>(a.lp, a.lp_t, i);
        float dpg = surrogate<MODE>(a, i, lp).dpg;
        if (a.add_kl) {
          const float d_ref = lp - ld<MODE>(a.ref, a.ref_t, i);
          dpg += a.kl_coef * kl_grad(a.kl, a.kl_plus, d_ref, k3_terms(d_ref));
        }
        out = tok_scale * dpg;
      }
      st<MODE>(grad_lp, glp_t, i, out);
    }
    if (grad_ent != nullptr) st<MODE>(grad_ent, gent_t, i, -a.entropy_coef * tok_scale);
  }
}

TokenArgs token_args(const at::Tensor& lp, const at::Tensor& old, const at::Tensor& adv, const at::Tensor& mask,
                     const at::Tensor& ref, const at::Tensor* ent, const at::Tensor* w, double lo, double hi,
                     std::optional<double> c, int64_t kl_code, bool kl_plus, double kl_coef, double entropy_coef,
                     int64_t agg) {
  TokenArgs a;
  a.lp = lp.data_ptr();
  a.old = old.data_ptr();
  a.adv = adv.data_ptr();
  a.mask = mask.data_ptr();
  a.ref = ref.data_ptr();
  a.ent = ent ? ent->data_ptr() : nullptr;
  a.w = w ? w->data_ptr() : nullptr;
  a.lp_t = type_code(lp);
  a.old_t = type_code(old);
  a.adv_t = type_code(adv);
  a.mask_t = type_code(mask);
  a.ref_t = type_code(ref);
  a.ent_t = ent ? type_code(*ent) : kF32;
  a.w_t = w ? type_code(*w) : kF32;
  a.S = lp.size(0);
  a.T = lp.size(1);
  a.NB = ceil_div(a.T, kTokBlock);
  a.clip_lo = static_cast<float>(1.0 - lo);
  a.clip_hi = static_cast<float>(1.0 + hi);
  a.dual = c.has_value();
  a.clip_c = static_cast<float>(c.value_or(0.0));
  a.kl = static_cast<int>(kl_code);
  a.kl_plus = kl_plus;
  a.kl_coef = static_cast<float>(kl_coef);
  a.add_kl = kl_coef != 0.0;
  a.entropy_coef = static_cast<float>(entropy_coef);
  a.agg = static_cast<int>(agg);
  return a;
}

void check_tokens(const at::Tensor& lp, std::initializer_list<const at::Tensor*> others) {
  check_cuda(lp, "logprob");
  if (lp.dim() != 2) fail(cat("policy_loss tensors must be [S, T], got ", lp.sizes()));
  for (const at::Tensor* t : others) {
    if (t == nullptr) continue;
    check_cuda(*t, "per-token tensor");
    if (t->sizes() != lp.sizes()) fail(cat("per-token tensors must share logprob's shape ", lp.sizes(), ", got ", t->sizes()));
  }
}

// The load mode of a launch over these tensors (None entries are absent).
int load_mode(const at::Tensor* mask, std::initializer_list<const at::Tensor*> floats) {
  for (const at::Tensor* t : floats)
    if (t != nullptr && t->scalar_type() != at::kFloat) return kAnyTypes;
  if (mask == nullptr || mask->scalar_type() == at::kFloat) return kF32FloatMask;
  if (mask->scalar_type() == at::kBool || mask->scalar_type() == at::kByte) return kF32BoolMask;
  return kAnyTypes;
}

// f(std::integral_constant<int, MODE>) for the run-time mode.
template <typename F>
void with_mode(int mode, F&& f) {
  switch (mode) {
    case kF32BoolMask: f(std::integral_constant<int, kF32BoolMask>()); break;
    case kF32FloatMask: f(std::integral_constant<int, kF32FloatMask>()); break;
    default: f(std::integral_constant<int, kAnyTypes>());
  }
}

// Lanes per sequence in policy_finish_kernel: the power of two >= NB, at most the block.
int finish_lanes(int64_t nb) {
  int lanes = 1;
  while (lanes < nb && lanes < kFinThreads) lanes *= 2;
  return lanes;
}

void check_codes(int64_t kl_code, int64_t agg) {
  if (kl_code < 0 || kl_code > 3) fail(cat("kl_code must be in [0, 3], got ", kl_code));
  if (agg < 0 || agg > 4) fail(cat("agg must be in [0, 4], got ", agg));
}

}  // namespace

std::vector<at::Tensor> ratio_kl_fwd(const at::Tensor& logprob, const at::Tensor& old_logprob,
                                     const at::Tensor& ref_logprob, int64_t kl_code) {
  check_cuda(logprob, "logprob");
  if (old_logprob.sizes() != logprob.sizes() || ref_logprob.sizes() != logprob.sizes())
    fail(cat("ratio_kl tensors must share one shape, got ", logprob.sizes(), ", ", old_logprob.sizes(), " and ",
             ref_logprob.sizes()));
  check_codes(kl_code, 0);
  const c10::cuda::CUDAGuard guard(logprob.device());
  auto f32 = logprob.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous);
  at::Tensor ratio = at::empty(logprob.sizes(), f32), kl = at::empty(logprob.sizes(), f32);
  const int64_t n = logprob.numel();
  if (n == 0) return {ratio, kl};
  const at::Tensor lp = logprob.contiguous(), old = old_logprob.contiguous(), ref = ref_logprob.contiguous();
  with_mode(load_mode(nullptr, {&lp, &old, &ref}), [&](auto mode) {
    ratio_kl_fwd_kernel<decltype(mode)::value><<<elementwise_blocks(n), kElemThreads, 0, current_stream()>>>(
        lp.data_ptr(), type_code(lp), old.data_ptr(), type_code(old), ref.data_ptr(), type_code(ref),
        ratio.data_ptr<float>(), kl.data_ptr<float>(), n, static_cast<int>(kl_code));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {ratio, kl};
}

at::Tensor ratio_kl_bwd(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& ref_logprob,
                        const std::optional<at::Tensor>& grad_ratio, const std::optional<at::Tensor>& grad_kl,
                        int64_t kl_code, bool kl_plus) {
  check_cuda(logprob, "logprob");
  check_codes(kl_code, 0);
  const c10::cuda::CUDAGuard guard(logprob.device());
  at::Tensor grad = at::empty(logprob.sizes(), logprob.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = logprob.numel();
  if (n == 0) return grad;
  const at::Tensor lp = logprob.contiguous(), old = old_logprob.contiguous(), ref = ref_logprob.contiguous();
  at::Tensor gr, gk;
  if (grad_ratio.has_value()) gr = grad_ratio->to(at::kFloat).expand(logprob.sizes()).contiguous();
  if (grad_kl.has_value()) gk = grad_kl->to(at::kFloat).expand(logprob.sizes()).contiguous();
  with_mode(load_mode(nullptr, {&lp, &old, &ref, &grad}), [&](auto mode) {
    ratio_kl_bwd_kernel<decltype(mode)::value><<<elementwise_blocks(n), kElemThreads, 0, current_stream()>>>(
        lp.data_ptr(), type_code(lp), old.data_ptr(), type_code(old), ref.data_ptr(), type_code(ref),
        gr.defined() ? gr.data_ptr<float>() : nullptr, gk.defined() ? gk.data_ptr<float>() : nullptr,
        grad.data_ptr(), type_code(grad), n, static_cast<int>(kl_code), kl_plus);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

std::vector<at::Tensor> policy_loss_fwd(const at::Tensor& logprob, const at::Tensor& old_logprob,
                                        const at::Tensor& advantages, const at::Tensor& mask,
                                        const at::Tensor& ref_logprob, const std::optional<at::Tensor>& entropy,
                                        const std::optional<at::Tensor>& rollout_is_weights, double clip_ratio_low,
                                        double clip_ratio_high, std::optional<double> clip_ratio_c, int64_t kl_code,
                                        double kl_coef, double entropy_coef, int64_t agg) {
  check_tokens(logprob, {&old_logprob, &advantages, &mask, &ref_logprob, entropy ? &*entropy : nullptr,
                         rollout_is_weights ? &*rollout_is_weights : nullptr});
  check_codes(kl_code, agg);
  const c10::cuda::CUDAGuard guard(logprob.device());
  const at::Tensor lp = logprob.contiguous(), old = old_logprob.contiguous(), adv = advantages.contiguous(),
                   msk = mask.contiguous(), ref = ref_logprob.contiguous();
  const at::Tensor ent = entropy ? entropy->contiguous() : at::Tensor();
  const at::Tensor w = rollout_is_weights ? rollout_is_weights->contiguous() : at::Tensor();
  TokenArgs a = token_args(lp, old, adv, msk, ref, ent.defined() ? &ent : nullptr, w.defined() ? &w : nullptr,
                           clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_code, false, kl_coef, entropy_coef, agg);
  auto f32 = logprob.options().dtype(at::kFloat);
  at::Tensor partials = at::empty({kPartials, a.S, a.NB}, f32);
  at::Tensor loss = at::empty({}, f32), metrics = at::empty({6}, f32);
  at::Tensor seq_weight = at::empty({a.S}, f32), totals = at::empty({2}, f32);
  const cudaStream_t stream = current_stream();
  if (a.S * a.NB > 0) {
    const int mode = load_mode(&msk, {&lp, &old, &adv, &ref, ent.defined() ? &ent : nullptr, w.defined() ? &w : nullptr});
    with_mode(mode, [&](auto m) {
      policy_tokens_fwd_kernel<decltype(m)::value><<<a.S * a.NB, kTokThreads, 0, stream>>>(a, partials.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  policy_finish_kernel<<<1, kFinThreads, 0, stream>>>(
      partials.data_ptr<float>(), loss.data_ptr<float>(), metrics.data_ptr<float>(), seq_weight.data_ptr<float>(),
      totals.data_ptr<float>(), a.S, a.T, a.NB, finish_lanes(a.NB), a.kl_coef, a.entropy_coef, a.agg, a.add_kl,
      ent.defined() && entropy_coef != 0.0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, metrics, seq_weight, totals};
}

void policy_loss_bwd(const at::Tensor& grad_loss, const at::Tensor& logprob, const at::Tensor& old_logprob,
                     const at::Tensor& advantages, const at::Tensor& mask, const at::Tensor& ref_logprob,
                     const std::optional<at::Tensor>& rollout_is_weights, const at::Tensor& seq_weight,
                     const at::Tensor& totals, double clip_ratio_low, double clip_ratio_high,
                     std::optional<double> clip_ratio_c, int64_t kl_code, bool kl_plus, double kl_coef,
                     double entropy_coef, int64_t agg, const std::optional<at::Tensor>& grad_logprob,
                     const std::optional<at::Tensor>& grad_entropy) {
  check_tokens(logprob, {&old_logprob, &advantages, &mask, &ref_logprob,
                         rollout_is_weights ? &*rollout_is_weights : nullptr,
                         grad_logprob ? &*grad_logprob : nullptr, grad_entropy ? &*grad_entropy : nullptr});
  check_codes(kl_code, agg);
  if (grad_logprob && !grad_logprob->is_contiguous()) fail("grad_logprob must be contiguous");
  if (grad_entropy && !grad_entropy->is_contiguous()) fail("grad_entropy must be contiguous");
  if (seq_weight.numel() != logprob.size(0) || totals.numel() != 2)
    fail(cat("seq_weight must be [", logprob.size(0), "] and totals [2], got ", seq_weight.sizes(), " and ",
             totals.sizes()));
  if (!grad_logprob && !grad_entropy) return;
  const c10::cuda::CUDAGuard guard(logprob.device());
  const at::Tensor lp = logprob.contiguous(), old = old_logprob.contiguous(), adv = advantages.contiguous(),
                   msk = mask.contiguous(), ref = ref_logprob.contiguous();
  const at::Tensor w = rollout_is_weights ? rollout_is_weights->contiguous() : at::Tensor();
  const TokenArgs a = token_args(lp, old, adv, msk, ref, nullptr, w.defined() ? &w : nullptr, clip_ratio_low,
                                 clip_ratio_high, clip_ratio_c, kl_code, kl_plus, kl_coef, entropy_coef, agg);
  if (a.S * a.NB == 0) return;
  const at::Tensor g = grad_loss.to(at::kFloat).reshape({1}).contiguous();
  const at::Tensor sw = seq_weight.to(at::kFloat).contiguous(), tot = totals.to(at::kFloat).contiguous();
  const int mode = load_mode(&msk, {&lp, &old, &adv, &ref, w.defined() ? &w : nullptr,
                                    grad_logprob ? &*grad_logprob : nullptr, grad_entropy ? &*grad_entropy : nullptr});
  with_mode(mode, [&](auto m) {
    policy_tokens_bwd_kernel<decltype(m)::value><<<a.S * a.NB, kTokThreads, 0, current_stream()>>>(
        a, g.data_ptr<float>(), sw.data_ptr<float>(), tot.data_ptr<float>(),
        grad_logprob ? grad_logprob->data_ptr() : nullptr, grad_logprob ? type_code(*grad_logprob) : kF32,
        grad_entropy ? grad_entropy->data_ptr() : nullptr, grad_entropy ? type_code(*grad_entropy) : kF32);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rlk
