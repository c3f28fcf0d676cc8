// The per-chunk pass of linear_logprob's native backend.
//
// The chunk driver (rl_kernel_core/linear/chunks.py, driven by rl_kernel_core/linear/native.py)
// has cuBLAS write the fp32 logits of a fixed-size chunk of rows, raw = h @ W^T, then calls one of
// these passes over the chunk's first n rows; z = (raw + b) / T:
//
// stats: one block per row, an online log-sum-exp with the entropy statistic over the row
//   (online_softmax.cuh), merged by a fixed shared-memory tree: lse, logprob = z_t - lse and
//   entropy. Rows at ignore_index give 0 (lse 0) and are not read.
// grad: one block per row sweeps the row in ascending tiles of THREADS * 4 columns and writes
//   dl = dL/d raw = (g_lp (onehot - p) - g_ent p (log p + entropy)) / T in dl's dtype. dl may
//   overwrite the logits in place as a 16-bit (or fp32) view whose rows start where the fp32 rows
//   do: a tile's stores land at bytes below the next tile's loads, and a barrier separates each
//   tile's loads from its stores. Rows at ignore_index get dl = 0.
//
// A row's bits depend only on that row's logits, bias, target and (grad) saved statistics: no
// atomics, no split of a row across blocks, and a fixed order of the element groups whether or
// not the rows allow 16-byte accesses.
#include "common.cuh"
#include "online_softmax.cuh"
#include "ops.h"
#include "tuning.h"

#include <type_traits>

namespace rlk {
namespace {

constexpr int kF32Vec = kVec<float>;  // 4

// raw logit + bias (in the bias' own dtype, read through its type code), before the 1/T scaling.
template <bool BIAS>
__device__ __forceinline__ float biased(float raw, const void* bias, int bias_code, int64_t col) {
  return BIAS ? raw + load_f32(bias, bias_code, col) : raw;
}

template <bool ALIGNED, bool ENT, bool BIAS>
__global__ void __launch_bounds__(kStatsThreads) chunk_stats_kernel(
    const float* __restrict__ logits, int64_t row_stride, const void* __restrict__ bias, int bias_code,
    const int64_t* __restrict__ targets, float* __restrict__ logprob, float* __restrict__ entropy,
    float* __restrict__ lse_out, int64_t V, float inv_temp, int64_t ignore_index) {
  __shared__ float sh_m[kStatsThreads], sh_s[kStatsThreads], sh_u[kStatsThreads];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  if (zero_ignored_row<ENT>(targets[row] == ignore_index, row, logprob, entropy, lse_out)) return;
  const float* x = logits + row * row_stride;
  using VT = Vec<float, kF32Vec>;
  float m = -INFINITY, s = 0.f, u = 0.f;
  const int64_t nvec = V / kF32Vec;
  for (int64_t i = tid; i < nvec; i += kStatsThreads) {
    const VT a = load_group<float, kF32Vec, ALIGNED>(x, i);
    float z[kF32Vec];
#pragma unroll
    for (int k = 0; k < kF32Vec; ++k) z[k] = biased<BIAS>(a.v[k], bias, bias_code, i * kF32Vec + k) * inv_temp;
    absorb<ENT>(z, m, s, u);
  }
  for (int64_t j = nvec * kF32Vec + tid; j < V; j += kStatsThreads) {
    const float z[1] = {biased<BIAS>(x[j], bias, bias_code, j) * inv_temp};
    absorb<ENT>(z, m, s, u);
  }
  block_merge<ENT, kStatsThreads>(m, s, u, sh_m, sh_s, sh_u);
  if (tid == 0) {
    const int64_t tgt = targets[row];
    store_row_stats<ENT>(sh_m, sh_s, sh_u, biased<BIAS>(x[tgt], bias, bias_code, tgt) * inv_temp, row, logprob,
                         entropy, lse_out);
  }
}

template <typename T, bool ALIGNED, bool GENT, bool BIAS>
__global__ void __launch_bounds__(kGradThreads) chunk_grad_kernel(
    const float* logits, int64_t row_stride, T* dl, int64_t dl_stride, const void* __restrict__ bias, int bias_code,
    const int64_t* __restrict__ targets, const float* __restrict__ lse, const float* __restrict__ entropy,
    const float* __restrict__ g_lp, const float* __restrict__ g_ent, int64_t V, float inv_temp,
    int64_t ignore_index) {
  constexpr int64_t TILE = int64_t(kGradThreads) * kF32Vec;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t tgt = targets[row];
  // no __restrict__ on x / out: they may alias (in place)
  const float* x = logits + row * row_stride;
  T* out = dl + row * dl_stride;
  if (tgt == ignore_index) {
    for (int64_t j = tid; j < V; j += kGradThreads) out[j] = T(0.f);
    return;
  }
  const float l = lse[row];
  const float h = GENT ? entropy[row] : 0.f;
  const float gl = g_lp[row];
  const float ge = GENT ? g_ent[row] : 0.f;
  for (int64_t c0 = 0; c0 < V; c0 += TILE) {  // the same trip count in every thread (barrier below)
    const int64_t c = c0 + int64_t(tid) * kF32Vec;
    const bool whole = c + kF32Vec <= V;
    float raw[kF32Vec];
    if (ALIGNED && whole) {
      const Vec<float, kF32Vec> a = load_group<float, kF32Vec, true>(x, c / kF32Vec);
#pragma unroll
      for (int k = 0; k < kF32Vec; ++k) raw[k] = a.v[k];
    } else {
#pragma unroll
      for (int k = 0; k < kF32Vec; ++k) raw[k] = c + k < V ? x[c + k] : 0.f;
    }
    __syncthreads();  // every load of this tile lands before any store overwrites its bytes
    Vec<T, kF32Vec> o;
#pragma unroll
    for (int k = 0; k < kF32Vec; ++k)
      o.v[k] = T(dlogit<true, GENT>(biased<BIAS>(raw[k], bias, bias_code, c + k), c + k, tgt, inv_temp, l, h, gl, ge));
    if (ALIGNED && whole) {
      store_group<T, kF32Vec, true>(out, c / kF32Vec, o);
    } else {
#pragma unroll
      for (int k = 0; k < kF32Vec; ++k)
        if (c + k < V) out[c + k] = o.v[k];
    }
  }
}

void check_chunk(const at::Tensor& logits, const at::Tensor& targets, const std::optional<at::Tensor>& bias) {
  check_cuda(logits, "logits");
  check_cuda(targets, "targets");
  if (logits.dim() != 2 || logits.scalar_type() != at::kFloat)
    fail(cat("the logits chunk must be fp32 [rows, V], got ", logits.scalar_type(), " ", logits.sizes()));
  if (logits.size(1) > 1 && logits.stride(1) != 1) fail("the logits chunk must have unit stride along V");
  if (targets.dim() != 1 || targets.size(0) > logits.size(0))
    fail(cat("targets must be [n] with n <= the chunk's ", logits.size(0), " rows, got ", targets.sizes()));
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    if (bias->dim() != 1 || bias->size(0) != logits.size(1) || !bias->is_contiguous())
      fail(cat("bias must be a contiguous [", logits.size(1), "] tensor, got ", bias->sizes()));
  }
}

void check_rows(const at::Tensor& t, int64_t n, const char* name) {
  check_cuda(t, name);
  if (t.scalar_type() != at::kFloat || t.dim() != 1 || t.size(0) != n || !t.is_contiguous())
    fail(cat(name, " must be a contiguous fp32 [", n, "] tensor, got ", t.scalar_type(), " ", t.sizes()));
}

// f(std::bool_constant<B>) for a run-time flag, so a kernel template gets it at compile time.
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) f(std::true_type());
  else f(std::false_type());
}

}  // namespace

void linear_chunk_stats(const at::Tensor& logits, const std::optional<at::Tensor>& bias, const at::Tensor& targets,
                        double inv_temp, int64_t ignore_index, at::Tensor logprob,
                        const std::optional<at::Tensor>& entropy, at::Tensor lse) {
  check_chunk(logits, targets, bias);
  const int64_t n = targets.size(0), V = logits.size(1);
  check_rows(logprob, n, "logprob");
  check_rows(lse, n, "lse");
  if (entropy.has_value()) check_rows(*entropy, n, "entropy");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor tgt = targets.to(at::kLong).contiguous();
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const void* b = bias.has_value() ? bias->data_ptr() : nullptr;
  const int b_code = bias.has_value() ? type_code(*bias) : kF32;
  float* ent = entropy.has_value() ? entropy->data_ptr<float>() : nullptr;
  const bool aligned = aligned_rows<float>({{x, stride}});
  with_flag(aligned, [&](auto al) {
    with_flag(entropy.has_value(), [&](auto en) {
      with_flag(bias.has_value(), [&](auto bi) {
        chunk_stats_kernel<decltype(al)::value, decltype(en)::value, decltype(bi)::value>
            <<<n, kStatsThreads, 0, current_stream()>>>(x, stride, b, b_code, tgt.data_ptr<int64_t>(),
                                                        logprob.data_ptr<float>(), ent, lse.data_ptr<float>(), V,
                                                        static_cast<float>(inv_temp), ignore_index);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

void linear_chunk_grad(const at::Tensor& logits, at::Tensor dl, const std::optional<at::Tensor>& bias,
                       const at::Tensor& targets, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
                       const at::Tensor& grad_logprob, const std::optional<at::Tensor>& grad_entropy, double inv_temp,
                       int64_t ignore_index) {
  check_chunk(logits, targets, bias);
  const int64_t n = targets.size(0), V = logits.size(1);
  check_cuda(dl, "dl");
  if (dl.dim() != 2 || dl.size(0) < n || dl.size(1) != V || (V > 1 && dl.stride(1) != 1))
    fail(cat("dl must be [>=", n, ", ", V, "] with unit stride along V, got ", dl.sizes()));
  const bool in_place = dl.data_ptr() == logits.data_ptr();
  if (in_place && dl.stride(0) * dl.element_size() != logits.stride(0) * 4)
    fail("an in-place dl must start its rows where the fp32 logits rows start");
  check_rows(lse, n, "lse");
  check_rows(grad_logprob, n, "grad_logprob");
  const bool gent = grad_entropy.has_value();
  if (gent && !entropy.has_value()) fail("grad_entropy needs the saved entropy");
  if (gent) {
    check_rows(*grad_entropy, n, "grad_entropy");
    check_rows(*entropy, n, "entropy");
  }
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor tgt = targets.to(at::kLong).contiguous();
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0), dl_stride = dl.stride(0);
  const void* b = bias.has_value() ? bias->data_ptr() : nullptr;
  const int b_code = bias.has_value() ? type_code(*bias) : kF32;
  const float* ent = gent ? entropy->data_ptr<float>() : nullptr;
  const float* ge = gent ? grad_entropy->data_ptr<float>() : nullptr;
  // 16-byte fp32 loads; the 4-element stores then fall on 4-element boundaries of dl as well
  const bool aligned = aligned_rows<float>({{x, stride}}) && reinterpret_cast<uintptr_t>(dl.data_ptr()) % 16 == 0 &&
                       dl_stride % kF32Vec == 0;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    with_flag(aligned, [&](auto al) {
      with_flag(gent, [&](auto en) {
        with_flag(bias.has_value(), [&](auto bi) {
          chunk_grad_kernel<T, decltype(al)::value, decltype(en)::value, decltype(bi)::value>
              <<<n, kGradThreads, 0, current_stream()>>>(x, stride, dl.data_ptr<T>(), dl_stride, b, b_code,
                                                         tgt.data_ptr<int64_t>(), lse.data_ptr<float>(), ent,
                                                         grad_logprob.data_ptr<float>(), ge, V,
                                                         static_cast<float>(inv_temp), ignore_index);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    });
  };
  switch (dl.scalar_type()) {
    case at::kFloat: launch(float()); break;
    case at::kBFloat16: launch(c10::BFloat16()); break;
    case at::kHalf: launch(c10::Half()); break;
    default: fail(cat("dl must be float32, bfloat16 or float16, got ", dl.scalar_type()));
  }
}

}  // namespace rlk
