// Online softmax statistics shared by the row kernels of the rl-kernel native extension
// (logprob_from_logits.cu: logprob_from_logits; linear_logprob.cu: the per-chunk pass of linear_logprob).
//
// A thread's state over the scaled logits it has seen: m the running max, s = sum exp(z - m) and
// u = sum exp(z - m) (z - m); moving to a larger max m' rescales by a = exp(m - m'): s' = a s,
// u' = a (u + (m - m') s). lse = m + log s and entropy = log s - u / s once merged.
#pragma once

#include "common.cuh"

namespace rlk {
namespace {

template <typename T>
constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte group

// Fold K scaled logits into a thread's (m, s, u).
template <bool ENT, int K>
__device__ __forceinline__ void absorb(const float (&z)[K], float& m, float& s, float& u) {
  float mx = z[0];
#pragma unroll
  for (int k = 1; k < K; ++k) mx = fmaxf(mx, z[k]);
  if (mx > m) {
    if (s > 0.f) {
      const float d = m - mx;
      const float a = __expf(d);
      if (ENT) u = a * (u + d * s);
      s *= a;
    }
    m = mx;
  }
  if (m == -INFINITY) return;  // nothing but masked entries so far
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float d = z[k] - m;
    const float e = __expf(d);
    s += e;
    if (ENT) u += e > 0.f ? e * d : 0.f;
  }
}

// (m, s, u) <- merge of (m, s, u) and (m2, s2, u2); an empty state has s == 0.
template <bool ENT>
__device__ __forceinline__ void merge(float& m, float& s, float& u, float m2, float s2, float u2) {
  if (s2 == 0.f) return;
  if (s == 0.f) {
    m = m2; s = s2; u = u2;
    return;
  }
  const float mx = fmaxf(m, m2);
  const float d1 = m - mx, d2 = m2 - mx;
  const float a = expf(d1), b = expf(d2);
  if (ENT) u = a * (u + d1 * s) + b * (u2 + d2 * s2);
  s = a * s + b * s2;
  m = mx;
}

// Merge the THREADS threads' states by a fixed shared-memory tree (the same pairs in the same
// order for every row): afterwards sh_m[0], sh_s[0], sh_u[0] hold the block's state.
template <bool ENT, int THREADS>
__device__ __forceinline__ void block_merge(float m, float s, float u, float* sh_m, float* sh_s, float* sh_u) {
  const int tid = threadIdx.x;
  sh_m[tid] = m;
  sh_s[tid] = s;
  sh_u[tid] = u;
  __syncthreads();
  for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
    if (tid < stride) {
      float m1 = sh_m[tid], s1 = sh_s[tid], u1 = sh_u[tid];
      merge<ENT>(m1, s1, u1, sh_m[tid + stride], sh_s[tid + stride], sh_u[tid + stride]);
      sh_m[tid] = m1;
      sh_s[tid] = s1;
      sh_u[tid] = u1;
    }
    __syncthreads();
  }
}

// A row at ignore_index is not read: thread 0 writes logprob 0, lse 0 and (ENT) entropy 0.
// Returns whether the row is ignored, so the block can return.
template <bool ENT>
__device__ __forceinline__ bool zero_ignored_row(bool ignored, int64_t row, float* logprob, float* entropy,
                                                 float* lse_out) {
  if (ignored && threadIdx.x == 0) {
    logprob[row] = 0.f;
    lse_out[row] = 0.f;
    if (ENT) entropy[row] = 0.f;
  }
  return ignored;
}

// Thread 0's writes for a row from the block's merged state (block_merge) and the target's scaled
// logit z_t: lse = m + log s, logprob = z_t - lse and (ENT) entropy = log s - u / s.
template <bool ENT>
__device__ __forceinline__ void store_row_stats(const float* sh_m, const float* sh_s, const float* sh_u, float z_t,
                                                int64_t row, float* logprob, float* entropy, float* lse_out) {
  const float log_s = logf(sh_s[0]);
  const float lse = sh_m[0] + log_s;
  logprob[row] = z_t - lse;
  lse_out[row] = lse;
  if (ENT) entropy[row] = log_s - sh_u[0] / sh_s[0];
}

// Group i (VEC elements from x + i * VEC): one 16-byte load when ALIGNED, else element by element.
template <typename T, int VEC, bool ALIGNED>
__device__ __forceinline__ Vec<T, VEC> load_group(const T* x, int64_t i) {
  if constexpr (ALIGNED) {
    return reinterpret_cast<const Vec<T, VEC>*>(x)[i];
  } else {
    Vec<T, VEC> r;
#pragma unroll
    for (int k = 0; k < VEC; ++k) r.v[k] = x[i * VEC + k];
    return r;
  }
}

template <typename T, int VEC, bool ALIGNED>
__device__ __forceinline__ void store_group(T* out, int64_t i, const Vec<T, VEC>& g) {
  if constexpr (ALIGNED) {
    reinterpret_cast<Vec<T, VEC>*>(out)[i] = g;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[i * VEC + k] = g.v[k];
  }
}

// d loss / d raw logit of one entry (raw: before the 1/T scaling), the softmax recomputed from lse:
// p = exp(raw / T - lse), dz = g_lp (onehot - p) - g_ent p (log p + entropy), returned as dz / T.
template <bool GLP, bool GENT>
__device__ __forceinline__ float dlogit(float raw, int64_t col, int64_t tgt, float inv_temp, float lse, float ent,
                                        float g_lp, float g_ent) {
  const float log_p = raw * inv_temp - lse;
  const float p = __expf(log_p);
  float dz = 0.f;
  if (GLP) dz = (col == tgt ? g_lp : 0.f) - g_lp * p;
  if (GENT) dz -= p > 0.f ? g_ent * p * (log_p + ent) : 0.f;
  return dz * inv_temp;
}

// Whether every listed row (start pointer, row stride in elements) allows 16-byte accesses.
template <typename T>
bool aligned_rows(std::initializer_list<std::pair<const void*, int64_t>> rows) {
  bool ok = true;
  for (const auto& r : rows) ok = ok && reinterpret_cast<uintptr_t>(r.first) % 16 == 0 && r.second % kVec<T> == 0;
  return ok;
}

}  // namespace
}  // namespace rlk
