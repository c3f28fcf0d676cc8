// Shared device helpers of the rl-kernel native extension.
//
// Portability (the same sources go through PyTorch's hipify for ROCm, which is untested): only
// c10/ATen CUDA APIs and plain CUDA C++ are used; block reductions go through shared memory in a
// fixed tree order and never use warp shuffles, so neither the results nor their correctness depend
// on the warp (wavefront) size; 16-bit floats are c10::BFloat16 / c10::Half, not CUDA intrinsics.
// Only c10's CUDA headers are included (current stream, device guard, launch checks): they need
// nothing of the toolkit beyond the runtime, so a toolkit without the cuBLAS/cuSPARSE headers
// still builds the extension.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "message.h"

namespace rlk {

// Element types of tensors read at run time through a type code (the per-token tensors of the
// losses may each have their own float dtype; the branch is uniform across a launch).
enum TypeCode : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kU8 = 4 };

// Messages are built with cat (message.h), never with TORCH_CHECK's formatting.
[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error("rl_kernel native: " + message); }

inline int type_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    case at::kDouble: return kF64;
    case at::kBool:
    case at::kByte: return kU8;
    default: fail(cat("unsupported dtype ", t.scalar_type()));
  }
  return kF32;
}

__device__ __forceinline__ float load_f32(const void* p, int code, int64_t i) {
  switch (code) {
    case kBF16: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    case kF16: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    case kF64: return static_cast<float>(static_cast<const double*>(p)[i]);
    case kU8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ double load_f64(const void* p, int code, int64_t i) {
  if (code == kF64) return static_cast<const double*>(p)[i];
  return static_cast<double>(load_f32(p, code, i));
}

__device__ __forceinline__ void store_f32(void* p, int code, int64_t i, float v) {
  switch (code) {
    case kBF16: static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v); break;
    case kF16: static_cast<c10::Half*>(p)[i] = c10::Half(v); break;
    case kF64: static_cast<double*>(p)[i] = static_cast<double>(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// K values of type T summed over a block of THREADS threads (a power of two): every thread
// ends with the totals. ``sh`` holds K * THREADS elements. The tree order is fixed, so the
// result depends only on the inputs, never on scheduling.
template <int THREADS, int K, typename T>
__device__ __forceinline__ void block_sum(T (&v)[K], T* sh) {
  static_assert((THREADS & (THREADS - 1)) == 0, "THREADS must be a power of two");
  const int tid = threadIdx.x;
#pragma unroll
  for (int k = 0; k < K; ++k) sh[k * THREADS + tid] = v[k];
  __syncthreads();
#pragma unroll
  for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
    if (tid < stride) {
#pragma unroll
      for (int k = 0; k < K; ++k) sh[k * THREADS + tid] += sh[k * THREADS + tid + stride];
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = sh[k * THREADS];
  __syncthreads();  // sh may be reused by the caller
}

// N elements loaded or stored in one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

inline void check_cuda(const at::Tensor& t, const char* name) {
  if (!t.is_cuda()) fail(cat(name, " must be a CUDA tensor, got ", t.device()));
}

// The current stream of the current device (set by the callers' CUDAGuard).
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace rlk
