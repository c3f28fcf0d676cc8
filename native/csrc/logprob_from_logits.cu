// logprob_from_logits: log p(target) and entropy of softmax(logits / T), one read of the logits.
//
// Forward: one block per row. Each thread runs an online log-sum-exp over its strided share of
// the row in fp32 (logits read in their own dtype, in groups of VEC = 16 bytes): with m the
// running max, s = sum exp(z - m) and u = sum exp(z - m) (z - m), moving to a larger max m'
// rescales by a = exp(m - m'): s' = a s, u' = a (u + (m - m') s). The threads' states are merged
// by a fixed shared-memory tree: lse = m + log s, logprob = z_t - lse, entropy = log s - u / s
// (formed relative to the row max, so large logits do not cancel). Rows at ignore_index are not
// read. A row's bits depend only on that row and V: no atomics, no split across blocks, and the
// same element groups and order whether a row start allows 16-byte loads (ALIGNED) or not (the
// groups are then read element by element), so a view's alignment never changes the bits.
//
// Backward: the softmax is recomputed from the logits and the saved lse, p = exp(z - lse):
// dz = g_lp (onehot - p) - g_ent p (log p + entropy), d logits = dz / T in the logits' dtype.
// Masked entries (-inf) have p = 0 and get gradient 0 (the products that would be 0 * inf are
// skipped).
#include "common.cuh"
#include "online_softmax.cuh"
#include "ops.h"
#include "tuning.h"

namespace rlk {
namespace {

template <typename T, bool ALIGNED, bool ENT>
__global__ void __launch_bounds__(kFwdThreads) logprob_fwd_kernel(
    const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ targets,
    float* __restrict__ logprob, float* __restrict__ entropy, float* __restrict__ lse_out,
    int64_t V, float inv_temp, int64_t ignore_index) {
  __shared__ float sh_m[kFwdThreads], sh_s[kFwdThreads], sh_u[kFwdThreads];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  if (zero_ignored_row<ENT>(targets[row] == ignore_index, row, logprob, entropy, lse_out)) return;
  const T* x = logits + row * row_stride;
  constexpr int VEC = kVec<T>;
  using VT = Vec<T, VEC>;
  float m = -INFINITY, s = 0.f, u = 0.f;
  const int64_t nvec = V / VEC;
  int64_t i = tid;
  // two groups in flight per thread, then the rest one at a time
  for (; i + kFwdThreads < nvec; i += 2 * kFwdThreads) {
    const VT a = load_group<T, VEC, ALIGNED>(x, i);
    const VT b = load_group<T, VEC, ALIGNED>(x, i + kFwdThreads);
    float za[VEC], zb[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      za[k] = static_cast<float>(a.v[k]) * inv_temp;
      zb[k] = static_cast<float>(b.v[k]) * inv_temp;
    }
    absorb<ENT>(za, m, s, u);
    absorb<ENT>(zb, m, s, u);
  }
  for (; i < nvec; i += kFwdThreads) {
    const VT a = load_group<T, VEC, ALIGNED>(x, i);
    float za[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) za[k] = static_cast<float>(a.v[k]) * inv_temp;
    absorb<ENT>(za, m, s, u);
  }
  for (int64_t j = nvec * VEC + tid; j < V; j += kFwdThreads) {
    const float z[1] = {static_cast<float>(x[j]) * inv_temp};
    absorb<ENT>(z, m, s, u);
  }
  block_merge<ENT, kFwdThreads>(m, s, u, sh_m, sh_s, sh_u);
  if (tid == 0) {
    const int64_t tgt = targets[row];
    store_row_stats<ENT>(sh_m, sh_s, sh_u, static_cast<float>(x[tgt]) * inv_temp, row, logprob, entropy, lse_out);
  }
}

// Block b handles row b / col_blocks, columns [(b % col_blocks) * COLS, ... + COLS).
template <typename T, bool ALIGNED, bool GLP, bool GENT>
__global__ void __launch_bounds__(kBwdThreads) logprob_bwd_kernel(
    const T* __restrict__ logits, int64_t row_stride, const int64_t* __restrict__ targets,
    const float* __restrict__ lse, const float* __restrict__ entropy,
    const float* __restrict__ g_lp, int64_t g_lp_stride, const float* __restrict__ g_ent, int64_t g_ent_stride,
    T* __restrict__ grad, int64_t V, int64_t col_blocks, float inv_temp, int64_t ignore_index) {
  constexpr int VEC = kVec<T>;
  constexpr int64_t COLS = int64_t(kBwdThreads) * VEC * kBwdUnroll;
  const int64_t row = blockIdx.x / col_blocks;
  const int64_t col0 = (blockIdx.x % col_blocks) * COLS;
  const int64_t tgt = targets[row];
  T* out = grad + row * V;
  const T* x = logits + row * row_stride;
  using VT = Vec<T, VEC>;
  if (tgt == ignore_index) {
#pragma unroll
    for (int r = 0; r < kBwdUnroll; ++r) {
      const int64_t c = col0 + (int64_t(r) * kBwdThreads + threadIdx.x) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        if (c + k < V) out[c + k] = T(0.f);
    }
    return;
  }
  const float l = lse[row];
  const float h = GENT ? entropy[row] : 0.f;
  const float gl = GLP ? g_lp[row * g_lp_stride] : 0.f;
  const float ge = GENT ? g_ent[row * g_ent_stride] : 0.f;
  VT buf[kBwdUnroll];
#pragma unroll
  for (int r = 0; r < kBwdUnroll; ++r) {
    const int64_t c = col0 + (int64_t(r) * kBwdThreads + threadIdx.x) * VEC;
    if (c + VEC <= V) buf[r] = load_group<T, VEC, ALIGNED>(x, c / VEC);
  }
#pragma unroll
  for (int r = 0; r < kBwdUnroll; ++r) {
    const int64_t c = col0 + (int64_t(r) * kBwdThreads + threadIdx.x) * VEC;
    if (c + VEC <= V) {
      VT o;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        o.v[k] = T(dlogit<GLP, GENT>(static_cast<float>(buf[r].v[k]), c + k, tgt, inv_temp, l, h, gl, ge));
      store_group<T, VEC, ALIGNED>(out, c / VEC, o);
    } else {
      for (int k = 0; k < VEC; ++k)
        if (c + k < V) out[c + k] = T(dlogit<GLP, GENT>(static_cast<float>(x[c + k]), c + k, tgt, inv_temp, l, h, gl, ge));
    }
  }
}

template <typename T, bool ENT>
void launch_fwd(const at::Tensor& logits, const at::Tensor& tgt, at::Tensor& lp, at::Tensor& ent, at::Tensor& lse,
                float inv_temp, int64_t ignore_index) {
  const int64_t n = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  const cudaStream_t stream = current_stream();
  float* ent_ptr = ENT ? ent.data_ptr<float>() : nullptr;
  auto kernel = aligned_rows<T>({{x, stride}}) ? logprob_fwd_kernel<T, true, ENT> : logprob_fwd_kernel<T, false, ENT>;
  kernel<<<n, kFwdThreads, 0, stream>>>(x, stride, tgt.data_ptr<int64_t>(), lp.data_ptr<float>(), ent_ptr,
                                         lse.data_ptr<float>(), V, inv_temp, ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool GLP, bool GENT>
void launch_bwd(const at::Tensor& logits, const at::Tensor& tgt, const at::Tensor& lse, const at::Tensor& ent,
                const at::Tensor& g_lp, const at::Tensor& g_ent, at::Tensor& grad, float inv_temp,
                int64_t ignore_index) {
  const int64_t n = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  T* out = grad.data_ptr<T>();
  const cudaStream_t stream = current_stream();
  const float* glp = GLP ? g_lp.data_ptr<float>() : nullptr;
  const float* gent = GENT ? g_ent.data_ptr<float>() : nullptr;
  const float* entp = GENT ? ent.data_ptr<float>() : nullptr;
  const int64_t glp_stride = GLP ? g_lp.stride(0) : 0, gent_stride = GENT ? g_ent.stride(0) : 0;
  const int64_t col_blocks = ceil_div(V, int64_t(kBwdThreads) * kVec<T> * kBwdUnroll);
  auto kernel = aligned_rows<T>({{x, stride}, {out, V}}) ? logprob_bwd_kernel<T, true, GLP, GENT>
                                                         : logprob_bwd_kernel<T, false, GLP, GENT>;
  kernel<<<n * col_blocks, kBwdThreads, 0, stream>>>(x, stride, tgt.data_ptr<int64_t>(), lse.data_ptr<float>(), entp,
                                                     glp, glp_stride, gent, gent_stride, out, V, col_blocks, inv_temp,
                                                     ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F>
void dispatch_logits_dtype(const at::Tensor& logits, F&& f) {
  switch (logits.scalar_type()) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    case at::kHalf: f(c10::Half()); break;
    default: fail(cat("logits must be float32, bfloat16 or float16, got ", logits.scalar_type()));
  }
}

void check_logits(const at::Tensor& logits, const at::Tensor& targets) {
  check_cuda(logits, "logits");
  check_cuda(targets, "targets");
  if (logits.dim() != 2) fail(cat("logits must be [N, V], got ", logits.sizes()));
  if (logits.size(1) > 1 && logits.stride(1) != 1) fail("logits must have unit stride along V");
  if (targets.dim() != 1 || targets.size(0) != logits.size(0))
    fail(cat("targets must be [", logits.size(0), "], got ", targets.sizes()));
}

}  // namespace

std::vector<at::Tensor> logprob_fwd(const at::Tensor& logits, const at::Tensor& targets, double temperature,
                                    int64_t ignore_index, bool with_entropy) {
  check_logits(logits, targets);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lp = at::empty({n}, f32), lse = at::empty({n}, f32);
  at::Tensor ent = at::empty({with_entropy ? n : 0}, f32);
  if (n == 0) return {lp, ent, lse};
  const at::Tensor tgt = targets.to(at::kLong).contiguous();
  const float inv_temp = static_cast<float>(1.0 / temperature);
  dispatch_logits_dtype(logits, [&](auto tag) {
    using T = decltype(tag);
    if (with_entropy) launch_fwd<T, true>(logits, tgt, lp, ent, lse, inv_temp, ignore_index);
    else launch_fwd<T, false>(logits, tgt, lp, ent, lse, inv_temp, ignore_index);
  });
  return {lp, ent, lse};
}

at::Tensor logprob_bwd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                       const at::Tensor& entropy, const std::optional<at::Tensor>& grad_logprob,
                       const std::optional<at::Tensor>& grad_entropy, double temperature, int64_t ignore_index) {
  check_logits(logits, targets);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor grad = at::empty({n, V}, logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (grad.numel() == 0) return grad;
  const bool glp = grad_logprob.has_value(), gent = grad_entropy.has_value();
  const at::Tensor tgt = targets.to(at::kLong).contiguous();
  const at::Tensor lse_c = lse.to(at::kFloat).contiguous();
  at::Tensor g_lp = glp ? grad_logprob->to(at::kFloat) : lse_c;
  at::Tensor g_ent = gent ? grad_entropy->to(at::kFloat) : lse_c;
  at::Tensor ent = gent ? entropy.to(at::kFloat).contiguous() : lse_c;
  if (g_lp.dim() != 1 || g_lp.size(0) != n || g_ent.dim() != 1 || g_ent.size(0) != n || ent.numel() != n)
    fail(cat("upstream gradients, lse and entropy must be [", n, "], got ", g_lp.sizes(), ", ", g_ent.sizes(), " and ",
             ent.sizes()));
  const float inv_temp = static_cast<float>(1.0 / temperature);
  dispatch_logits_dtype(logits, [&](auto tag) {
    using T = decltype(tag);
    if (glp && gent) launch_bwd<T, true, true>(logits, tgt, lse_c, ent, g_lp, g_ent, grad, inv_temp, ignore_index);
    else if (glp) launch_bwd<T, true, false>(logits, tgt, lse_c, ent, g_lp, g_ent, grad, inv_temp, ignore_index);
    else if (gent) launch_bwd<T, false, true>(logits, tgt, lse_c, ent, g_lp, g_ent, grad, inv_temp, ignore_index);
    else grad.zero_();
  });
  return grad;
}

}  // namespace rlk
