// Launch shapes of the native kernels, in one place: threads per block and the per-thread work
// that sets a block's tile. Most are part of the numerical result, not only of the speed: a
// shared-memory merge tree has one leaf per thread, and a block's tile of tokens sets which
// partial sums exist, so changing one changes the order of the sums. (The Triton backend's tiles:
// rl_kernel_core/triton/tuning.py)
#pragma once

#include <cstdint>

namespace rlk {

// logprob_from_logits.cu: the forward runs one block of kFwdThreads per row (its shared-memory
// merge tree has kFwdThreads leaves); the backward's block covers kBwdThreads * VEC * kBwdUnroll
// columns of a row (VEC = 16 bytes of the logits' dtype).
constexpr int kFwdThreads = 512;
constexpr int kBwdThreads = 256;
constexpr int kBwdUnroll = 4;

// linear_logprob.cu: the per-chunk statistics pass (one block per row, merge tree of
// kStatsThreads leaves) and gradient pass (one block per row, tiles of kGradThreads * 4 fp32
// columns).
constexpr int kStatsThreads = 512;
constexpr int kGradThreads = 256;

// linear_sm90.cu (Hopper): the tile of the Triton gemm-route passes it gives the bits of
// (kSm90BlockM x kSm90BlockN x kSm90BlockK; the statistics' vocab tiles are kSm90BlockN wide, so this
// is part of the result), kSm90Stages shared-memory slots of one hidden and one weight block, and
// blocks of one producer warpgroup and kSm90Consumers consumer warpgroups of 64 rows each.
constexpr int kSm90BlockM = 128;
constexpr int kSm90BlockN = 256;
constexpr int kSm90BlockK = 64;
constexpr int kSm90Stages = 4;
constexpr int kSm90Consumers = 2;
constexpr int kSm90Threads = 128 * (kSm90Consumers + 1);

// loss.cu: ratio_kl's elementwise kernels (kElemThreads per block, grid-stride); policy_loss's
// token kernels (a block of kTokThreads reduces kTokBlock = kTokThreads * kTokPerThread tokens of
// one sequence to its partial sums) and its one-block finish (kFinThreads).
constexpr int kElemThreads = 256;
constexpr int kTokThreads = 256;
constexpr int kTokPerThread = 4;
constexpr int64_t kTokBlock = int64_t(kTokThreads) * kTokPerThread;
constexpr int kFinThreads = 512;

// advantages.cu: one block of kAdvThreads per group (its fp64 sums by a shared-memory tree).
constexpr int kAdvThreads = 256;

}  // namespace rlk
