// group_advantages: GRPO / Dr.GRPO / RLOO advantages with the semantics (and the fp64 arithmetic)
// of rl_kernel_core/advantages/reference.py (verl 0.9.1). Per group of n rewards: mean (the first
// reward plus the mean of the differences from it: exact for equal rewards) and the unbiased std
// (two passes: the sum, then the sum of squared deviations from the mean); grpo: (r - mean) /
// (std + eps), 0 where std + eps is 0 (or r - mean without std normalisation); dr_grpo: r - mean;
// rloo: (r - mean) n / (n - 1); a group of one gets mean 0 and std 1 (rloo: r).
//
// One block owns one group and reads it in a fixed order (per-thread strided sums, then a fixed
// shared-memory tree), so every member sees the same statistics and results are bitwise equal run
// to run. Groups given by size are contiguous runs (grid = number of groups). Groups given by index
// are laid out by a stable sort of the ids; every position learns its group's [start, end) from a
// binary search of the sorted ids (no host sync), and the block at a group's first position does
// the work (grid = N; the others return at once).
#include "codes.h"
#include "common.cuh"
#include "ops.h"
#include "tuning.h"

namespace rlk {
namespace {

__global__ void __launch_bounds__(kAdvThreads) group_advantages_kernel(
    const void* rewards, int rewards_t, const int64_t* __restrict__ order, const int64_t* __restrict__ starts,
    const int64_t* __restrict__ ends, void* out, int out_t, int64_t group_size, double eps, int estimator,
    bool norm_by_std) {
  __shared__ double sh[kAdvThreads];
  const int64_t pid = blockIdx.x;
  const bool by_index = order != nullptr;
  int64_t start, end;
  if (by_index) {
    start = starts[pid];
    end = ends[pid];
    if (start != pid) return;  // not the group's first position (uniform over the block)
  } else {
    start = pid * group_size;
    end = start + group_size;
  }
  auto src = [&](int64_t q) { return by_index ? order[q] : q; };
  const double first = load_f64(rewards, rewards_t, src(start));
  double v[1] = {0.0};
  for (int64_t q = start + threadIdx.x; q < end; q += kAdvThreads) v[0] += load_f64(rewards, rewards_t, src(q)) - first;
  block_sum<kAdvThreads, 1>(v, sh);
  const double n = static_cast<double>(end - start);
  const double mean = first + v[0] / n;
  v[0] = 0.0;
  for (int64_t q = start + threadIdx.x; q < end; q += kAdvThreads) {
    const double c = load_f64(rewards, rewards_t, src(q)) - mean;
    v[0] += c * c;
  }
  block_sum<kAdvThreads, 1>(v, sh);
  const bool single = end - start == 1;
  const double stdev = sqrt(v[0] / (single ? 1.0 : n - 1.0));
  const double den_eps = (single ? 1.0 : stdev) + eps;
  const double den = den_eps == 0.0 ? 1.0 : den_eps;  // std = eps = 0: every r - mean is exactly 0
  for (int64_t q = start + threadIdx.x; q < end; q += kAdvThreads) {
    const int64_t i = src(q);
    const double r = load_f64(rewards, rewards_t, i);
    double adv;
    if (estimator == kRloo) {
      adv = single ? r : (r - mean) * n / (n - 1.0);
    } else {
      adv = r - (single ? 0.0 : mean);
      if (estimator == kGrpo && norm_by_std) adv = adv / den;
    }
    if (out_t == kF64) static_cast<double*>(out)[i] = adv;
    else static_cast<float*>(out)[i] = static_cast<float>(adv);
  }
}

}  // namespace

at::Tensor group_advantages(const at::Tensor& rewards, std::optional<int64_t> group_size,
                            const std::optional<at::Tensor>& group_index, int64_t estimator, bool norm_by_std,
                            double eps) {
  check_cuda(rewards, "rewards");
  if (rewards.dim() != 1) fail(cat("rewards must be [N], got ", rewards.sizes()));
  if (group_size.has_value() == group_index.has_value()) fail("exactly one of group_size and group_index");
  if (estimator < kGrpo || estimator > kRloo) fail(cat("estimator code must be in [0, 2], got ", estimator));
  const c10::cuda::CUDAGuard guard(rewards.device());
  const int64_t n = rewards.size(0);
  const at::Tensor values = rewards.contiguous();
  at::Tensor out = at::empty({n}, rewards.options().dtype(rewards.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  if (n == 0) return out;
  at::Tensor order, starts, ends;
  int64_t grid, size = 0;
  if (group_size.has_value()) {
    size = *group_size;
    if (size <= 0 || n % size != 0) fail(cat("group_size must be positive and divide N = ", n, ", got ", size));
    grid = n / size;
  } else {
    check_cuda(*group_index, "group_index");
    if (group_index->dim() != 1 || group_index->size(0) != n)
      fail(cat("group_index must be [", n, "], got ", group_index->sizes()));
    order = at::argsort(*group_index, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor ids = group_index->index_select(0, order).contiguous();
    starts = at::searchsorted(ids, ids, /*out_int32=*/false, /*right=*/false);
    ends = at::searchsorted(ids, ids, /*out_int32=*/false, /*right=*/true);
    grid = n;
  }
  group_advantages_kernel<<<grid, kAdvThreads, 0, current_stream()>>>(
      values.data_ptr(), type_code(values), order.defined() ? order.data_ptr<int64_t>() : nullptr,
      starts.defined() ? starts.data_ptr<int64_t>() : nullptr, ends.defined() ? ends.data_ptr<int64_t>() : nullptr,
      out.data_ptr(), type_code(out), size, eps, static_cast<int>(estimator), norm_by_std);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace rlk
