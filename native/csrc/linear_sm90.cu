// linear_logprob's gemm-route passes on Hopper (sm_90a): the same functions as the Triton statistics
// pass (rl_kernel_core/linear/triton_stats.py: _stats_kernel, at its default tile: 128 x 256 x 64,
// 8 warps) and gradient pass (rl_kernel_core/linear/triton_grad.py: _grad_kernel), with the same bits,
// as one warp-specialized persistent kernel with two epilogues.
//
// One producer thread loads [128, 64] blocks of hidden and [256, 64] blocks of weight through TMA
// (128-byte swizzle) into a ring of kStages shared-memory slots; two consumer warpgroups each
// multiply 64 rows by the 256 columns of a vocab tile with wgmma (fp32 accumulators, the K blocks in
// ascending order: the instructions Triton issues, so the logits have Triton's bits) and then run
// the epilogue on their registers while the producer already loads the next tile:
//   statistics: per row and vocab tile j, m_j = max z, s_j = sum exp(z - m_j),
//     a_j = sum exp(z - m_j) (z - m_j) (with entropy), and z_t in the tile that holds the target;
//     optionally the raw logits too (fp32, for a gradient pass that reads them);
//   gradient: dl = (g (onehot(t) - p) - e p (log p + entropy)) / T with p = exp(z - lse), stored in
//     dl's 16-bit dtype; a row at ignore_index gets 0;
// z = (raw + bias) / T. Each epilogue repeats the arithmetic of Triton's compiled code in its order
// (its comments say where Triton fuses a multiply-add), which tests/core/linear/test_linear_sm90.py
// checks bit for bit.
//
// Built only for sm_90a (native_build adds the target for this group on a compute capability 9.0
// device); for any other target the kernel body is empty and the host refuses to launch it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "message.h"
#include "ops.h"
#include "tuning.h"

#ifndef USE_ROCM
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace rlk {
namespace {

// Messages are built with std::string (see message.h), never with TORCH_CHECK's formatting.
[[noreturn]] void fail(const std::string& message) { throw std::runtime_error("rl_kernel native: linear_sm90: " + message); }

constexpr int kBM = kSm90BlockM, kBN = kSm90BlockN, kBK = kSm90BlockK, kStages = kSm90Stages;
constexpr int kConsumers = kSm90Consumers;
constexpr int kThreads = kSm90Threads;
constexpr uint32_t kStageBytes = (kBM + kBN) * kBK * 2;  // one slot: a hidden block and a weight block

struct Smem {
  uint16_t a[kStages][kBM * kBK];
  uint16_t b[kStages][kBN * kBK];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + room to align the tiles to 1024 bytes (128B swizzle)

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RLK_SM90A 1
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#ifdef RLK_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
#endif
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef RLK_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef RLK_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef RLK_SM90A
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int k, int row) {
#ifdef RLK_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(smem_u32(bar))
      : "memory");
#endif
}

// wgmma descriptor of a K-major tile of 128-byte rows, 128-byte swizzle: 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef RLK_SM90A
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef RLK_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef RLK_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// d[64 x 256] += A[64 x 16] B[256 x 16]^T, both K-major in shared memory; d in wgmma's accumulator layout.
template <bool F16>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#ifdef RLK_SM90A
#define RLK_WGMMA(TYPE)                                                                  \
  asm volatile(                                                                          \
      "{\nwgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
      "}, %128, %129, 1, 1, 1, 0, 0;\n}\n"                                               \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(desc_a), "l"(desc_b))
  if constexpr (F16) {
    RLK_WGMMA("f16");
  } else {
    RLK_WGMMA("bf16");
  }
#undef RLK_WGMMA
#endif
}

// exp as Triton's tl.exp compiles for fp32: ex2.approx (denormals kept) of x * log2(e) rounded to fp32.
__device__ __forceinline__ float exp_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, 1.4426950408889634f)));
  return y;
}

// z = inv_temp * raw as Triton rounds it; at UNIT (inv_temp == 1) the product is raw itself, bit for bit.
template <bool UNIT>
__device__ __forceinline__ float scaled(float raw, float inv_temp) {
  return UNIT ? raw : __fmul_rn(raw, inv_temp);
}

// fma(inv_temp, raw, -ref), Triton's fused form; at UNIT the one rounding of raw - ref.
template <bool UNIT>
__device__ __forceinline__ float scaled_minus(float raw, float inv_temp, float ref) {
  return UNIT ? __fsub_rn(raw, ref) : __fmaf_rn(inv_temp, raw, -ref);
}

// The vocab tile and row block of work unit u in grouped order (rl_kernel_core/triton/_matmul_helpers.py:
// grouped_tile): GROUP_M row blocks sweep the vocab together so their weight tiles share L2.
__device__ __forceinline__ void grouped(int u, int row_blocks, int vocab_tiles, int group_m, int& pm, int& pn) {
  const int per_group = group_m * vocab_tiles;
  const int first = (u / per_group) * group_m;
  const int size = min(row_blocks - first, group_m);
  pm = first + (u % per_group) % size;
  pn = (u % per_group) / size;
}

// What the statistics epilogue reads and writes (linear_stats_sm90 in ops.h).
struct StatsArgs {
  const void* bias;
  const int64_t* targets;
  float inv_temp;
  int64_t ignore_index;
  float* pmax;
  float* psum;
  float* pent;
  float* ztgt;
  int64_t stride_pm;
  float* keep;  // or null: the raw logits (before bias and scale) go there, row stride stride_km
  int64_t stride_km;
  bool keep_pairs;  // keep's rows allow 8-byte stores of two columns
};

// What the gradient epilogue reads and writes (linear_grad_sm90 in ops.h).
struct GradArgs {
  const void* bias;
  const int64_t* targets;
  float inv_temp;
  int64_t ignore_index;
  const float* lse;
  const float* ent;
  const float* glp;
  const float* gent;
  void* dl;
  int64_t stride_dm;
};

// The accumulators of one consumer thread: rows r0 = 64 c + 16 warp + lane / 4 and r0 + 8 of the tile,
// columns 8 j + 2 (lane % 4) + {0, 1} for j < 32; acc[4 j + 2 h + e] is row r0 + 8 h, column 8 j + 2 (lane % 4) + e.
struct Fragment {
  int r0;       // first row (global)
  int col0;     // first column (global)
  int tile_lo;  // the vocab tile's first column
  int pn;       // the vocab tile
  int quad;     // lane % 4
};

template <typename T, bool BIAS>
__device__ __forceinline__ void add_bias(float (&acc)[128], const void* bias, const Fragment& f, bool full_cols, int V) {
  if constexpr (!BIAS) return;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = f.col0 + 8 * j + e;
      const float b = full_cols || col < V ? static_cast<float>(static_cast<const T*>(bias)[col]) : 0.f;
      acc[4 * j + e] = __fadd_rn(acc[4 * j + e], b);
      acc[4 * j + 2 + e] = __fadd_rn(acc[4 * j + 2 + e], b);
    }
  }
}

// The statistics epilogue, in the order of Triton's compiled _stats_kernel: z = inv_temp * raw rounded;
// the per-thread sums run in accumulator order, then across the row's 4 lanes by xor 2 and xor 1; the
// entropy term's z - ref is one fused multiply-add from the unscaled logit, as Triton contracts it.
// FULL: the vocab tile lies inside V; UNIT: inv_temp == 1 (both only drop work, never change a bit).
template <typename T, bool BIAS, bool ENT, bool FULL, bool UNIT>
__device__ __forceinline__ void stats_epilogue(float (&acc)[128], const StatsArgs& a, const Fragment& f, int M, int V) {
  const bool full_cols = FULL || f.tile_lo + kBN <= V;
  if (a.keep != nullptr) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = f.r0 + 8 * h;
      if (r >= M) continue;
      float* out = a.keep + int64_t(r) * a.stride_km;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = f.col0 + 8 * j;
        if (a.keep_pairs && (full_cols || col + 1 < V)) {
          *reinterpret_cast<float2*>(out + col) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        } else {
          if (full_cols || col < V) out[col] = acc[4 * j + 2 * h];
          if (full_cols || col + 1 < V) out[col + 1] = acc[4 * j + 2 * h + 1];
        }
      }
    }
  }
  add_bias<T, BIAS>(acc, a.bias, f, full_cols, V);
  const float inv_temp = a.inv_temp;
  float m0 = -INFINITY, m1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = full_cols || f.col0 + 8 * j + e < V;
      m0 = fmaxf(m0, ok ? scaled<UNIT>(acc[4 * j + e], inv_temp) : -INFINITY);
      m1 = fmaxf(m1, ok ? scaled<UNIT>(acc[4 * j + 2 + e], inv_temp) : -INFINITY);
    }
  }
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
  m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
  m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
  // a tile of -inf logits has m = -inf: exponentials relative to 0 give s = 0, not NaN
  const float ref0 = m0 == -INFINITY ? 0.f : m0, ref1 = m1 == -INFINITY ? 0.f : m1;
  float s0 = 0.f, s1 = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) {
    const bool second = (i & 2) != 0;
    const float ref = second ? ref1 : ref0;
    const bool ok = full_cols || f.col0 + 8 * (i / 4) + (i & 1) < V;
    const float ex = exp_approx(__fsub_rn(ok ? scaled<UNIT>(acc[i], inv_temp) : -INFINITY, ref));
    const float term = ENT && ex > 0.f ? __fmul_rn(ex, scaled_minus<UNIT>(acc[i], inv_temp, ref)) : 0.f;
    if (second) {
      s1 = __fadd_rn(s1, ex);
      if (ENT) a1 = __fadd_rn(a1, term);
    } else {
      s0 = __fadd_rn(s0, ex);
      if (ENT) a0 = __fadd_rn(a0, term);
    }
  }
#pragma unroll
  for (int o = 2; o >= 1; o >>= 1) {
    s0 = __fadd_rn(s0, __shfl_xor_sync(0xffffffffu, s0, o));
    s1 = __fadd_rn(s1, __shfl_xor_sync(0xffffffffu, s1, o));
    if (ENT) {
      a0 = __fadd_rn(a0, __shfl_xor_sync(0xffffffffu, a0, o));
      a1 = __fadd_rn(a1, __shfl_xor_sync(0xffffffffu, a1, o));
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.r0 + 8 * h;
    if (r >= M) continue;
    const int64_t off = int64_t(r) * a.stride_pm + f.pn;
    if (f.quad == 0) {
      a.pmax[off] = h ? m1 : m0;
      a.psum[off] = h ? s1 : s0;
      if (ENT) a.pent[off] = h ? a1 : a0;
    }
    const int64_t tgt = a.targets[r];
    const int64_t co = tgt - f.col0;  // this thread holds columns col0 + 8 j + {0, 1}
    if (tgt >= f.tile_lo && tgt < f.tile_lo + kBN && co >= 0 && (co & 7) < 2) {
      float zt = 0.f;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (co == 8 * j + e) zt = scaled<UNIT>(acc[4 * j + 2 * h + e], inv_temp);
        }
      }
      a.ztgt[r] = zt;
    }
  }
}

template <typename T>
__device__ __forceinline__ uint16_t to_bits(float v) {
  const T x(v);  // round to nearest even, as Triton's cvt.rn
  return reinterpret_cast<const uint16_t&>(x);
}

// The gradient epilogue, in the order of Triton's compiled _grad_kernel: log p = fma(inv_temp, raw, -lse);
// dz = fma(-g, p, onehot ? g : 0); with the entropy term dz -= p > 0 ? (log p + entropy) (e p) : 0;
// dl = inv_temp * dz rounded to T (0 on an ignored row). PAIRS: dl's rows allow 4-byte stores of two columns;
// FULL and UNIT as for the statistics.
template <typename T, bool BIAS, bool GENT, bool PAIRS, bool FULL, bool UNIT>
__device__ __forceinline__ void grad_epilogue(float (&acc)[128], const GradArgs& a, const Fragment& f, int M, int V) {
  const bool full_cols = FULL || f.tile_lo + kBN <= V;
  add_bias<T, BIAS>(acc, a.bias, f, full_cols, V);
  const float inv_temp = a.inv_temp;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = f.r0 + 8 * h;
    if (r >= M) continue;
    const int64_t tgt = a.targets[r];
    const bool valid = tgt != a.ignore_index;
    const float lse = a.lse[r];
    const float g = valid ? a.glp[r] : 0.f;
    const float ent = GENT ? a.ent[r] : 0.f;
    const float ge = GENT && valid ? a.gent[r] : 0.f;
    uint16_t* out = static_cast<uint16_t*>(a.dl) + int64_t(r) * a.stride_dm;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = f.col0 + 8 * j;
      uint16_t bits[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float logp = scaled_minus<UNIT>(acc[4 * j + 2 * h + e], inv_temp, lse);
        const float p = exp_approx(logp);
        float dz = __fmaf_rn(-g, p, col + e == tgt ? g : 0.f);
        if (GENT) {
          const float term = __fmul_rn(__fadd_rn(logp, ent), __fmul_rn(ge, p));
          dz = __fsub_rn(dz, p > 0.f ? term : 0.f);
        }
        bits[e] = valid ? to_bits<T>(scaled<UNIT>(dz, inv_temp)) : uint16_t(0);
      }
      if (PAIRS && (full_cols || col + 1 < V)) {
        *reinterpret_cast<uint32_t*>(out + col) = uint32_t(bits[0]) | (uint32_t(bits[1]) << 16);
      } else {
        if (full_cols || col < V) out[col] = bits[0];
        if (full_cols || col + 1 < V) out[col + 1] = bits[1];
      }
    }
  }
}

// The statistics pass or the gradient pass (Args) over the [M, V] logits of hidden [M, D] and weight [V, D].
template <typename Args, typename T, bool F16, bool BIAS, bool FLAG, bool PAIRS>
__global__ void __launch_bounds__(kThreads, 1) linear_sm90_kernel(
    const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w, int M, int V, int D,
    int group_m, const __grid_constant__ Args args) {
#ifdef RLK_SM90A
  extern __shared__ uint8_t smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = threadIdx.x / 128;
  const int row_blocks = (M + kBM - 1) / kBM;
  const int vocab_tiles = (V + kBN - 1) / kBN;
  const int units = row_blocks * vocab_tiles;
  const int k_blocks = (D + kBK - 1) / kBK;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int pm, pn;
        grouped(u, row_blocks, vocab_tiles, group_m, pm, pn);
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&s.empty[stage], phase ^ 1);
          mbar_expect_tx(&s.full[stage], kStageBytes);
          tma_load(s.a[stage], &map_h, &s.full[stage], kb * kBK, pm * kBM);
          tma_load(s.b[stage], &map_w, &s.full[stage], kb * kBK, pn * kBN);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;  // consumer: rows [64 c, 64 c + 64) of the tile
  const int t = threadIdx.x % 128;
  const int lane = t % 32;
  float acc[128];
  const bool unit = args.inv_temp == 1.f;
  int stage = 0;
  uint32_t phase = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    int pm, pn;
    grouped(u, row_blocks, vocab_tiles, group_m, pm, pn);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int prev = -1;
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbar_wait(&s.full[stage], phase);
      wgmma_fence();
      const uint64_t da = smem_desc(&s.a[stage][c * 64 * kBK]);
      const uint64_t db = smem_desc(&s.b[stage][0]);
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64n256k16<F16>(acc, da + 2 * kk, db + 2 * kk);  // +32 bytes per k16
      wgmma_commit();
      wgmma_wait<1>();  // the previous K block's products are done: its slot can be refilled
      if (prev >= 0 && t == 0) mbar_arrive(&s.empty[prev]);
      prev = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    if (t == 0) mbar_arrive(&s.empty[prev]);
    const Fragment f{pm * kBM + c * 64 + (t / 32) * 16 + lane / 4, pn * kBN + 2 * (lane % 4), pn * kBN, pn, lane % 4};
    // the tiles inside V at unit temperature (nearly all in RL training) take the epilogue without column
    // checks or scaling; a biased head keeps the one general epilogue, as three copies with a bias spill
    // registers (ptxas: up to 884 bytes per thread)
    const bool full = !BIAS && f.tile_lo + kBN <= V;
    if constexpr (std::is_same_v<Args, StatsArgs>) {
      if (full && unit) stats_epilogue<T, BIAS, FLAG, true, true>(acc, args, f, M, V);
      else if (full) stats_epilogue<T, BIAS, FLAG, true, false>(acc, args, f, M, V);
      else stats_epilogue<T, BIAS, FLAG, false, false>(acc, args, f, M, V);
    } else {
      if (full && unit) grad_epilogue<T, BIAS, FLAG, PAIRS, true, true>(acc, args, f, M, V);
      else if (full) grad_epilogue<T, BIAS, FLAG, PAIRS, true, false>(acc, args, f, M, V);
      else grad_epilogue<T, BIAS, FLAG, PAIRS, false, false>(acc, args, f, M, V);
    }
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || p == nullptr) {
      fail("the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A TMA map of the first `rows` rows of the row-major 16-bit matrix t, boxes of [box_rows, 64], 128B swizzle;
// rows and columns past the matrix read as 0.
CUtensorMap tile_map(const at::Tensor& t, int64_t rows, uint32_t box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0) * t.element_size())};
  const cuuint32_t box[2] = {kBK, box_rows};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                    2, t.data_ptr(), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail(cat("cuTensorMapEncodeTiled failed with CUresult ", int(r)));
  return map;
}

template <typename Args, typename T, bool F16, bool BIAS, bool FLAG, bool PAIRS>
void launch(const CUtensorMap& mh, const CUtensorMap& mw, int M, int V, int D, int group_m, int grid, const Args& args) {
  auto kernel = linear_sm90_kernel<Args, T, F16, BIAS, FLAG, PAIRS>;
  // per launch, not once per process: the attribute belongs to the current device's copy of the kernel
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  kernel<<<grid, kThreads, kSmemBytes, c10::cuda::getCurrentCUDAStream().stream()>>>(mh, mw, M, V, D, group_m, args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The instantiation for the operands' dtype, a bias or not, the pass's flag (entropy statistic / entropy
// gradient) and PAIRS.
template <typename Args, bool PAIRS>
void dispatch(bool f16, bool bias, bool flag, const CUtensorMap& mh, const CUtensorMap& mw, int M, int V, int D, int group_m,
              int grid, const Args& args) {
#define RLK_SM90_LAUNCH(T, F16)                                                                                    \
  do {                                                                                                              \
    if (bias && flag) launch<Args, T, F16, true, true, PAIRS>(mh, mw, M, V, D, group_m, grid, args);              \
    else if (bias) launch<Args, T, F16, true, false, PAIRS>(mh, mw, M, V, D, group_m, grid, args);                \
    else if (flag) launch<Args, T, F16, false, true, PAIRS>(mh, mw, M, V, D, group_m, grid, args);                \
    else launch<Args, T, F16, false, false, PAIRS>(mh, mw, M, V, D, group_m, grid, args);                         \
  } while (0)
  if (f16) RLK_SM90_LAUNCH(c10::Half, true);
  else RLK_SM90_LAUNCH(c10::BFloat16, false);
#undef RLK_SM90_LAUNCH
}

void check_operand(const at::Tensor& t, const char* name) {
  if (!(t.is_cuda() && t.dim() == 2 && t.stride(1) == 1 && (t.stride(0) * t.element_size()) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0)) {
    fail(cat(name, " must be a 2-d CUDA tensor with unit inner stride, 16-byte aligned rows and address (TMA), got ",
             t.sizes()));
  }
}

void check_vector(const at::Tensor& t, const char* name, int64_t rows) {
  if (!(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() >= rows)) {
    fail(cat(name, " must be a contiguous fp32 CUDA tensor of at least ", rows, " elements, got ", t.sizes()));
  }
}

// The checks both passes share; returns the launch's grid.
int common_checks(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const at::Tensor& targets, int64_t rows) {
  if (!linear_sm90_built()) fail("this build has no sm_90a code (TORCH_CUDA_ARCH_LIST without 9.0a)");
  if (hidden.scalar_type() != weight.scalar_type() ||
      (hidden.scalar_type() != at::kBFloat16 && hidden.scalar_type() != at::kHalf)) {
    fail("hidden and weight must both be bf16 or both fp16");
  }
  check_operand(hidden, "hidden");
  check_operand(weight, "weight");
  const int64_t V = weight.size(0);
  if (hidden.size(1) != weight.size(1) || rows > hidden.size(0) || rows > targets.size(0) || V >= (int64_t(1) << 31)) {
    fail(cat("shapes do not match: hidden ", hidden.sizes(), ", weight ", weight.sizes(), ", rows ", rows, ", targets ",
             targets.sizes()));
  }
  if (bias.has_value() && !(bias->scalar_type() == weight.scalar_type() && bias->is_contiguous() && bias->numel() == V)) {
    fail("bias must be a contiguous [V] tensor of weight's dtype");
  }
  const int64_t units = ((rows + kBM - 1) / kBM) * ((V + kBN - 1) / kBN);
  if (units >= (int64_t(1) << 31)) fail(cat(units, " tiles are more than a launch indexes"));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, hidden.get_device()));
  return int(std::min<int64_t>(units, sms));
}

}  // namespace

bool linear_sm90_built() {
#ifdef RLK_SM90A_BUILT
  return true;
#else
  return false;
#endif
}

void linear_stats_sm90(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& targets, int64_t rows, double inv_temp, int64_t ignore_index,
                       at::Tensor partials, at::Tensor ztgt, bool want_entropy, const std::optional<at::Tensor>& keep,
                       int64_t group_m) {
  const int grid = common_checks(hidden, weight, bias, targets, rows);
  const int64_t V = weight.size(0), n_tiles = (V + kBN - 1) / kBN;
  if (!(partials.is_cuda() && partials.scalar_type() == at::kFloat && partials.dim() == 3 && partials.size(0) == 3 &&
        partials.size(1) >= rows && partials.size(2) == n_tiles && partials.stride(2) == 1)) {
    fail(cat("partials must be fp32 [3, >=", rows, ", ", n_tiles, "] with unit inner stride, got ", partials.sizes()));
  }
  check_vector(ztgt, "ztgt", rows);
  if (keep.has_value() && !(keep->is_cuda() && keep->scalar_type() == at::kFloat && keep->dim() == 2 &&
                            keep->size(0) >= rows && keep->size(1) == V && keep->stride(1) == 1)) {
    fail(cat("keep must be fp32 [>=", rows, ", ", V, "] with unit inner stride, got ", keep->sizes()));
  }
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor tgt = targets.scalar_type() == at::kLong ? targets.contiguous() : targets.to(at::kLong);
  const StatsArgs args{bias.has_value() ? bias->data_ptr() : nullptr, tgt.data_ptr<int64_t>(), float(inv_temp), ignore_index,
                       partials[0].data_ptr<float>(), partials[1].data_ptr<float>(), partials[2].data_ptr<float>(),
                       ztgt.data_ptr<float>(), partials.stride(1),
                       keep.has_value() ? keep->data_ptr<float>() : nullptr, keep.has_value() ? keep->stride(0) : 0,
                       keep.has_value() && keep->stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(keep->data_ptr()) % 8 == 0};
  dispatch<StatsArgs, false>(hidden.scalar_type() == at::kHalf, bias.has_value(), want_entropy, tile_map(hidden, rows, kBM),
                             tile_map(weight, V, kBN), int(rows), int(V), int(hidden.size(1)), int(group_m), grid, args);
}

void linear_grad_sm90(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const at::Tensor& targets, int64_t rows, double inv_temp, int64_t ignore_index, const at::Tensor& lse,
                      const std::optional<at::Tensor>& entropy, const at::Tensor& grad_logprob,
                      const std::optional<at::Tensor>& grad_entropy, at::Tensor dl, int64_t group_m) {
  const int grid = common_checks(hidden, weight, bias, targets, rows);
  const int64_t V = weight.size(0);
  if (!(dl.is_cuda() && dl.scalar_type() == weight.scalar_type() && dl.dim() == 2 && dl.size(0) >= rows &&
        dl.size(1) == V && dl.stride(1) == 1)) {
    fail(cat("dl must be a [>=", rows, ", ", V, "] tensor of weight's dtype with unit inner stride, got ", dl.sizes()));
  }
  if (entropy.has_value() != grad_entropy.has_value()) fail("entropy and grad_entropy must be given together");
  check_vector(lse, "lse", rows);
  check_vector(grad_logprob, "grad_logprob", rows);
  if (grad_entropy.has_value()) {
    check_vector(*entropy, "entropy", rows);
    check_vector(*grad_entropy, "grad_entropy", rows);
  }
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor tgt = targets.scalar_type() == at::kLong ? targets.contiguous() : targets.to(at::kLong);
  const bool gent = grad_entropy.has_value();
  const GradArgs args{bias.has_value() ? bias->data_ptr() : nullptr, tgt.data_ptr<int64_t>(), float(inv_temp), ignore_index,
                      lse.data_ptr<float>(), gent ? entropy->data_ptr<float>() : nullptr, grad_logprob.data_ptr<float>(),
                      gent ? grad_entropy->data_ptr<float>() : nullptr, dl.data_ptr(), dl.stride(0)};
  const bool pairs = dl.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(dl.data_ptr()) % 4 == 0;
  const CUtensorMap mh = tile_map(hidden, rows, kBM), mw = tile_map(weight, V, kBN);
  const bool f16 = hidden.scalar_type() == at::kHalf;
  if (pairs) {
    dispatch<GradArgs, true>(f16, bias.has_value(), gent, mh, mw, int(rows), int(V), int(hidden.size(1)), int(group_m), grid, args);
  } else {
    dispatch<GradArgs, false>(f16, bias.has_value(), gent, mh, mw, int(rows), int(V), int(hidden.size(1)), int(group_m), grid, args);
  }
}

}  // namespace rlk

#else  // ROCm: no Hopper code

namespace rlk {

bool linear_sm90_built() { return false; }

void linear_stats_sm90(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t,
                       double, int64_t, at::Tensor, at::Tensor, bool, const std::optional<at::Tensor>&, int64_t) {
  throw std::runtime_error("rl_kernel native: linear_sm90: a ROCm build has no sm_90a code");
}

void linear_grad_sm90(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t,
                      double, int64_t, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                      const std::optional<at::Tensor>&, at::Tensor, int64_t) {
  throw std::runtime_error("rl_kernel native: linear_sm90: a ROCm build has no sm_90a code");
}

}  // namespace rlk

#endif  // USE_ROCM
