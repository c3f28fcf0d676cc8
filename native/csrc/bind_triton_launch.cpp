// C++ launches of the batch-invariant mode's Triton kernels (rl_kernel_core/batch_invariant_mode/triton.py): the
// persistent matmul (pointer and TMA kernels) and the row-statistics pass; and of varlen_attention's forward
// (rl_kernel_core/batch_invariant_mode/triton_attention.py), which the mode's transformers attention runs once a layer per decode step. Python launches them through Triton's
// JITFunction.run, ~45 us of host time per launch (the argument binder, the specialization key, the generated
// launcher); a decode step issues hundreds. Here one call plans the launch (the same decisions as the Python code:
// kernel, tile, program count, tensor descriptors), computes the specialization Triton would compute for those
// arguments (a pointer's 16-byte alignment; an integer's ==1, %16 and 32/64-bit class), and launches the cubin that
// Triton compiled for that specialization with cuLaunchKernel. A specialization seen for the first time is not
// served here (the call returns None): Python launches it through Triton, which compiles it, and then hands the
// compiled kernel to remember_*, which plans the same arguments again, checks that its plan is the one Python
// launched, and keeps the kernel for that key. Same cubin, same grid, same arguments: the same bits as Triton's
// launch. Every entry point runs with the GIL held, which serializes access to the kernel table.
#include <torch/extension.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "message.h"

namespace {

using rlk::cat;

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error("triton_launch: " + message); }

// ---- the driver, opened at the first launch as Triton's own launcher does (nothing links against libcuda)
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
using ErrorStringFn = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelFn launch = nullptr;
  EncodeTiledFn encode_tiled = nullptr;
  ErrorStringFn error_string = nullptr;
};

const Driver& driver() {
  static const Driver loaded = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) fail(cat("cannot open libcuda.so.1: ", dlerror()));
    Driver d;
    d.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    d.encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    d.error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    if (!d.launch || !d.encode_tiled || !d.error_string)
      fail("libcuda.so.1 lacks cuLaunchKernel, cuTensorMapEncodeTiled or cuGetErrorString");
    return d;
  }();
  return loaded;
}

void check_cu(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  driver().error_string(result, &message);
  fail(cat(what, " failed: ", message ? message : "unknown error", " (CUresult ", static_cast<int>(result), ")"));
}

// ---- a kernel's arguments: what the caller passes, and how the compiled kernel takes each one
enum class Kind : int64_t { kConstant = 0, kPointer = 1, kInt32 = 2, kInt64 = 3, kFloat32 = 4, kTensorDesc = 5 };

struct Desc {  // a 2-D host tensor descriptor: base, shape and element strides (the last stride is 1)
  uint64_t base = 0;
  std::array<int64_t, 2> shape{};
  std::array<int64_t, 2> strides{};
};

struct Arg {
  enum class Family { kNone, kPointer, kInt, kFloat, kDesc } family = Family::kNone;
  int64_t value = 0;  // pointer address or integer
  float real = 0.f;
  Desc desc;
};

Arg none_arg() { return Arg{}; }
Arg pointer_arg(const at::Tensor& t) {
  Arg a;
  a.family = Arg::Family::kPointer;
  a.value = reinterpret_cast<int64_t>(t.data_ptr());
  return a;
}
Arg int_arg(int64_t v) {
  Arg a;
  a.family = Arg::Family::kInt;
  a.value = v;
  return a;
}
Arg float_arg(double v) {
  Arg a;
  a.family = Arg::Family::kFloat;
  a.real = static_cast<float>(v);
  return a;
}
Arg desc_arg(const at::Tensor& t, int64_t rows, int64_t cols, int64_t row_stride) {
  Arg a;
  a.family = Arg::Family::kDesc;
  a.desc.base = reinterpret_cast<uint64_t>(t.data_ptr());
  a.desc.shape = {rows, cols};
  a.desc.strides = {row_stride, 1};
  return a;
}

struct DescLayout {  // Triton's tensordesc_meta entry of one descriptor argument
  int64_t swizzle = 0, elem_size = 0, elem_type = 0;
  std::array<int64_t, 2> block{};
};

struct CompiledKernel {
  CUfunction function = nullptr;
  unsigned threads = 0, shared = 0;
  std::vector<Kind> kinds;         // one per argument, in the kernel's order
  std::vector<DescLayout> layouts;  // one per kTensorDesc argument, in order
};

// ---- the specialization key: everything Triton specializes a launch on, for these kernels
struct Key {
  std::array<uint64_t, 2> words{};
  int bit = 0;
  void put(uint64_t value, int width) {
    for (int i = 0; i < width; ++i, ++bit) {
      if (bit >= 128) fail("specialization key overflow");
      if ((value >> i) & 1) words[bit / 64] |= uint64_t{1} << (bit % 64);
    }
  }
  void put_int(int64_t v) {  // Triton: ==1 (a constant), %16 (aligned), i32 or i64
    put((v == 1 ? 1 : 0) | (v % 16 == 0 ? 2 : 0) | (v >= INT32_MIN && v <= INT32_MAX ? 0 : 4), 3);
  }
  void put_pointer(const at::Tensor& t) { put(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? 1 : 0, 1); }
  bool operator==(const Key& o) const { return words == o.words; }
};

struct KeyHash {
  size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.words[0] * 0x9E3779B97F4A7C15ULL ^ k.words[1]); }
};

enum KernelId : uint64_t { kPointerMatmul = 1, kTmaMatmul = 2, kRowStats = 3, kAttentionForward = 4 };

Key start_key(KernelId id, const at::Tensor& t) {
  Key key;
  key.put(id, 4);
  key.put(static_cast<uint64_t>(t.get_device()), 8);
  key.put(static_cast<uint64_t>(t.scalar_type()), 8);
  return key;
}

struct Table {
  std::unordered_map<Key, CompiledKernel, KeyHash> kernels;
  int64_t hits = 0, misses = 0;
};

Table& table() {
  static Table t;
  return t;
}

void launch(const CompiledKernel& k, int64_t grid, int64_t grid_y, const std::vector<Arg>& args, int device) {
  if (args.size() != k.kinds.size()) fail(cat(args.size(), " arguments for a kernel taking ", k.kinds.size()));
  alignas(128) CUtensorMap maps[3];  // Triton's launcher keeps its maps 128-byte aligned
  std::array<int64_t, 48> slots{};
  std::array<void*, 64> params{};
  uint64_t global_scratch = 0, profile_scratch = 0;  // remember_* keeps only kernels that need neither
  size_t slot = 0, param = 0, map = 0;
  auto put_slot = [&](auto value) {
    if (slot >= slots.size() || param >= params.size()) fail("too many kernel arguments");
    std::memcpy(&slots[slot], &value, sizeof(value));
    params[param++] = &slots[slot++];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const Arg& a = args[i];
    switch (k.kinds[i]) {
      case Kind::kConstant:
        break;  // compiled into the kernel (an integer equal to 1, a None)
      case Kind::kPointer:
        put_slot(static_cast<uint64_t>(a.value));
        break;
      case Kind::kInt32:
        put_slot(static_cast<int32_t>(a.value));
        break;
      case Kind::kInt64:
        put_slot(a.value);
        break;
      case Kind::kFloat32:
        put_slot(a.real);
        break;
      case Kind::kTensorDesc: {
        if (map >= 3 || map >= k.layouts.size()) fail("too many tensor descriptors");
        const DescLayout& l = k.layouts[map];
        // as Triton's fill_tma_descriptor: dimensions innermost first, strides in bytes
        cuuint64_t dims[2] = {static_cast<cuuint64_t>(a.desc.shape[1]), static_cast<cuuint64_t>(a.desc.shape[0])};
        cuuint64_t strides[1] = {static_cast<cuuint64_t>(a.desc.strides[0] * l.elem_size)};
        cuuint32_t box[2] = {static_cast<cuuint32_t>(l.block[1]), static_cast<cuuint32_t>(l.block[0])};
        cuuint32_t element_strides[2] = {1, 1};
        check_cu(driver().encode_tiled(&maps[map], static_cast<CUtensorMapDataType>(l.elem_type), 2,
                                       reinterpret_cast<void*>(a.desc.base), dims, strides, box, element_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(l.swizzle),
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                 "cuTensorMapEncodeTiled");
        params[param++] = &maps[map++];
        for (int64_t s : a.desc.shape) put_slot(static_cast<int32_t>(s));
        for (int64_t s : a.desc.strides) put_slot(s);
        break;
      }
    }
  }
  params[param++] = &global_scratch;
  params[param++] = &profile_scratch;
  CUstream stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  check_cu(driver().launch(k.function, static_cast<unsigned>(grid), static_cast<unsigned>(grid_y), 1, k.threads, 1, 1,
                           k.shared, stream,
                           params.data(), nullptr),
           "cuLaunchKernel");
}

// ---- planning: the Python code's decisions for one call, the arguments it passes and the key

struct Plan {
  Key key;
  int64_t grid = 0, grid_y = 1;
  bool tma = false;
  std::array<int64_t, 2> block{};  // (BLOCK_M, BLOCK_N) of a matmul plan
  std::vector<Arg> args;
};

struct MatmulConfig {  // rl_kernel_core.batch_invariant_mode.triton's choices for one (device, dtype)
  int64_t pointer_block_m = 0, pointer_block_n = 0;
  int64_t tma_block_m = 0, tma_block_n = 0;
  int64_t narrow_block_m = 0, narrow_block_n = 0;  // the TMA kernel's tile for a weight gradient that fills waves fuller
  bool tma_capable = false;  // 16-bit dtype on a device with TMA
  int64_t tma_min_rows = 0, tma_min_weight_grad_k = 0, program_slots = 0;
};

std::unordered_map<int64_t, MatmulConfig>& matmul_configs() {
  static std::unordered_map<int64_t, MatmulConfig> configs;
  return configs;
}

int64_t config_key(int64_t device, at::ScalarType dtype) { return device * 256 + static_cast<int64_t>(dtype); }

constexpr int64_t kTmaAlignBytes = 16;

bool on_current_device(const at::Tensor& t) {
  return t.is_cuda() && t.get_device() == static_cast<int64_t>(c10::cuda::current_device());
}

// The TMA operand of x [R, K] (batch_invariant._tma_operand): x itself, or x.T for a column-major x. A layout
// TMA cannot describe is copied there; not here (no plan).
std::optional<Arg> tma_operand(const at::Tensor& x, Key& key) {
  const int64_t align = kTmaAlignBytes / x.element_size();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % kTmaAlignBytes != 0) return std::nullopt;
  const int64_t r = x.size(0), k = x.size(1);
  if (x.stride(1) == 1 && x.stride(0) % align == 0) {
    key.put(0, 1);  // A_TRANS / B_TRANS are constexprs
    return desc_arg(x, r, k, x.stride(0));
  }
  if (x.stride(0) == 1 && x.stride(1) % align == 0) {
    key.put(1, 1);
    return desc_arg(x, k, r, x.stride(1));
  }
  return std::nullopt;
}

// batch_invariant.tma_tile: whether the (nm, nn) tile's programs fill their waves over `slots` fuller than the
// (wm, wn) tile's, for an [m, n] output
bool fills_fuller(int64_t m, int64_t n, int64_t nm, int64_t nn, int64_t wm, int64_t wn, int64_t slots) {
  if (nm <= 0 || nn <= 0 || slots <= 0) return false;
  const int64_t tiles_w = ((m + wm - 1) / wm) * ((n + wn - 1) / wn);
  const int64_t tiles_n = ((m + nm - 1) / nm) * ((n + nn - 1) / nn);
  return tiles_n * ((tiles_w + slots - 1) / slots) > tiles_w * ((tiles_n + slots - 1) / slots);
}

std::optional<Plan> plan_matmul(const at::Tensor& a, const at::Tensor& b_t, const std::optional<at::Tensor>& bias,
                                const at::Tensor& out) {
  if (!on_current_device(a) || !b_t.is_cuda() || b_t.get_device() != a.get_device() || a.dim() != 2 ||
      b_t.dim() != 2 || b_t.scalar_type() != a.scalar_type() || a.size(1) != b_t.size(1))
    return std::nullopt;
  if (bias && (!bias->is_cuda() || bias->get_device() != a.get_device())) return std::nullopt;
  auto found = matmul_configs().find(config_key(a.get_device(), a.scalar_type()));
  if (found == matmul_configs().end()) return std::nullopt;
  const MatmulConfig& c = found->second;
  const int64_t m = a.size(0), k = a.size(1), n = b_t.size(0);
  if (m == 0 || n == 0) return std::nullopt;
  const bool a_column_major = a.stride(0) == 1 && a.stride(1) != 1;
  Plan plan;
  plan.tma = c.tma_capable && (m >= c.tma_min_rows || (a_column_major && k >= c.tma_min_weight_grad_k));
  int64_t bm = plan.tma ? c.tma_block_m : c.pointer_block_m, bn = plan.tma ? c.tma_block_n : c.pointer_block_n;
  const bool narrow = plan.tma && a_column_major &&
                      fills_fuller(m, n, c.narrow_block_m, c.narrow_block_n, bm, bn, c.program_slots);
  if (narrow) {
    bm = c.narrow_block_m;
    bn = c.narrow_block_n;
  }
  plan.block = {bm, bn};
  const int64_t tiles = ((m + bm - 1) / bm) * ((n + bn - 1) / bn);
  plan.grid = std::min(tiles, c.program_slots);
  const at::Tensor& bias_or_a = bias ? *bias : a;
  plan.key = start_key(plan.tma ? kTmaMatmul : kPointerMatmul, a);
  plan.key.put(bias ? 1 + static_cast<uint64_t>(bias->scalar_type()) : 0, 8);
  plan.key.put_pointer(bias_or_a);
  plan.key.put_pointer(out);
  for (int64_t v : {m, n, k}) plan.key.put_int(v);
  if (plan.tma) {
    plan.key.put(narrow ? 1 : 0, 1);  // the tile: the descriptors' blocks and the compiled kernel differ
    auto a_op = tma_operand(a, plan.key);
    auto b_op = tma_operand(b_t, plan.key);
    if (!a_op || !b_op) return std::nullopt;
    const bool c_desc = n % (kTmaAlignBytes / out.element_size()) == 0;
    plan.key.put(c_desc ? 1 : 0, 1);
    plan.key.put_int(out.stride(0));
    plan.args = {*a_op, *b_op, pointer_arg(bias_or_a),
                 c_desc ? desc_arg(out, m, n, n) : none_arg(), pointer_arg(out),
                 int_arg(m), int_arg(n), int_arg(k), int_arg(out.stride(0))};
    return plan;
  }
  plan.key.put_pointer(a);
  plan.key.put_pointer(b_t);
  const std::array<int64_t, 7> ints = {a.stride(0), a.stride(1), b_t.stride(1), b_t.stride(0),
                                       out.stride(0), out.stride(1), plan.grid};
  for (int64_t v : ints) plan.key.put_int(v);
  plan.args = {pointer_arg(a), pointer_arg(b_t), pointer_arg(bias_or_a), pointer_arg(out),
               int_arg(m), int_arg(n), int_arg(k)};
  for (int64_t v : ints) plan.args.push_back(int_arg(v));
  return plan;
}

std::optional<Plan> plan_row_stats(const at::Tensor& x, const at::Tensor& out, int64_t mode, double eps) {
  if (!on_current_device(x) || x.dim() != 2 || x.size(0) == 0 || x.size(1) == 0 || x.stride(1) != 1 ||
      !out.is_cuda() || out.get_device() != x.get_device())
    return std::nullopt;
  Plan plan;
  plan.grid = x.size(0);
  plan.key = start_key(kRowStats, x);
  plan.key.put(static_cast<uint64_t>(mode), 2);
  plan.key.put(static_cast<uint64_t>(out.scalar_type()), 8);
  plan.key.put_pointer(x);
  plan.key.put_pointer(out);
  plan.key.put_int(x.size(1));
  plan.key.put_int(x.stride(0));
  plan.args = {pointer_arg(x), pointer_arg(out), int_arg(x.size(1)), int_arg(x.stride(0)), float_arg(eps)};
  return plan;
}

// attention._forward's launch of _attention_fwd_kernel: q, out [Tq, Hq, D], k, v [Tk, Hkv, D] contiguous, lse [Tq, Hq]
// fp32, the four int32 tables of _tables; grid (tiles, Hq). The compile-time arguments follow from the dtype, Hq,
// Hq / Hkv, D, causal and the tile (block_m, block_n), all in the key.
std::optional<Plan> plan_attention_forward(const std::vector<at::Tensor>& tensors, double scale, int64_t block_m,
                                           int64_t block_n, bool causal) {
  if (tensors.size() != 9) return std::nullopt;
  const at::Tensor &q = tensors[0], &k = tensors[1], &v = tensors[2], &out = tensors[3], &lse = tensors[4];
  if (!on_current_device(q) || q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || out.sizes() != q.sizes() ||
      lse.dim() != 2 || lse.scalar_type() != at::kFloat)
    return std::nullopt;
  for (const auto& t : tensors)
    if (!t.is_cuda() || t.get_device() != q.get_device() || !t.is_contiguous()) return std::nullopt;
  for (size_t i = 5; i < tensors.size(); ++i)
    if (tensors[i].dim() != 1 || tensors[i].scalar_type() != at::kInt) return std::nullopt;
  for (const auto& t : {k, v, out})
    if (t.scalar_type() != q.scalar_type()) return std::nullopt;
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  if (hkv <= 0 || hq % hkv != 0 || k.size(2) != d || v.sizes() != k.sizes() || hq >= 1024 || d >= 1024 ||
      hq / hkv >= 256 || block_m <= 0 || block_m >= 512 || block_n <= 0 || block_n >= 512 || tensors[7].size(0) == 0)
    return std::nullopt;
  Plan plan;
  plan.grid = tensors[7].size(0);
  plan.grid_y = hq;
  plan.key = start_key(kAttentionForward, q);
  plan.key.put(static_cast<uint64_t>(hq), 10);
  plan.key.put(static_cast<uint64_t>(hq / hkv), 8);
  plan.key.put(static_cast<uint64_t>(d), 10);
  plan.key.put(causal ? 1 : 0, 1);
  plan.key.put(static_cast<uint64_t>(block_m), 9);
  plan.key.put(static_cast<uint64_t>(block_n), 9);
  for (const auto& t : tensors) {
    plan.key.put_pointer(t);
    plan.args.push_back(pointer_arg(t));
  }
  plan.args.push_back(float_arg(scale));
  return plan;
}

// ---- serving and remembering

std::optional<at::Tensor> serve(const std::optional<Plan>& plan, const at::Tensor& out) {
  Table& t = table();
  if (!plan) return std::nullopt;
  auto found = t.kernels.find(plan->key);
  if (found == t.kernels.end()) {
    ++t.misses;
    return std::nullopt;
  }
  ++t.hits;
  launch(found->second, plan->grid, plan->grid_y, plan->args, out.get_device());
  return out;
}

// What remember_* did: "kept", "unplanned" (no plan serves this call; nothing kept) or why the compiled kernel
// does not fit the plan (a bug: the Python code and this file disagree). A string, not an exception: the caller
// raises it with the Python context.
std::string remember(const std::optional<Plan>& plan, bool tma, int64_t grid, int64_t grid_y,
                     const std::vector<int64_t>& block, int64_t function, int64_t num_warps, int64_t shared,
                     const std::vector<int64_t>& kinds, const std::vector<std::vector<int64_t>>& layouts) {
  if (!plan) return "unplanned";
  if (block.size() != 2) return "block is (BLOCK_M, BLOCK_N)";
  if (plan->tma != tma || plan->grid != grid || plan->grid_y != grid_y || plan->block[0] != block[0] ||
      plan->block[1] != block[1])
    return cat("the C++ plan (tma=", plan->tma, ", programs=", plan->grid, "x", plan->grid_y, ", tile ",
               plan->block[0], "x", plan->block[1], ") differs from the launch Python made (tma=", tma, ", programs=",
               grid, "x", grid_y, ", tile ", block[0], "x", block[1], "): the Python launch site and ",
               "native/csrc/bind_triton_launch.cpp disagree");
  if (kinds.size() != plan->args.size())
    return cat("the compiled kernel takes ", kinds.size(), " arguments, the plan passes ", plan->args.size());
  CompiledKernel k;
  k.function = reinterpret_cast<CUfunction>(function);
  k.threads = static_cast<unsigned>(32 * num_warps);
  k.shared = static_cast<unsigned>(shared);
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] < 0 || kinds[i] > static_cast<int64_t>(Kind::kTensorDesc))
      return cat("unknown argument kind ", kinds[i], " of argument ", i);
    const Kind kind = static_cast<Kind>(kinds[i]);
    const Arg::Family f = plan->args[i].family;
    const bool fits = kind == Kind::kConstant ? (f == Arg::Family::kNone || f == Arg::Family::kInt)
                      : kind == Kind::kPointer ? f == Arg::Family::kPointer
                      : kind == Kind::kInt32 || kind == Kind::kInt64 ? f == Arg::Family::kInt
                      : kind == Kind::kFloat32 ? f == Arg::Family::kFloat
                                               : f == Arg::Family::kDesc;
    if (!fits) return cat("argument ", i, " of the plan does not match the compiled kernel's signature");
    k.kinds.push_back(kind);
  }
  for (const auto& l : layouts) {
    if (l.size() != 5) return "a descriptor layout is (swizzle, elem_size, elem_type, block0, block1)";
    k.layouts.push_back(DescLayout{l[0], l[1], l[2], {l[3], l[4]}});
  }
  const auto descs = static_cast<size_t>(std::count(k.kinds.begin(), k.kinds.end(), Kind::kTensorDesc));
  if (descs != k.layouts.size() || descs > 3)
    return cat(descs, " descriptor arguments, ", k.layouts.size(), " descriptor layouts (at most 3)");
  table().kernels[plan->key] = std::move(k);
  return "kept";
}

at::Tensor matmul_out(const at::Tensor& a, const at::Tensor& b_t) {
  return at::empty({a.size(0), b_t.size(0)}, a.options());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel: C++ launches of the batch-invariant mode's compiled Triton kernels";
  m.def("configure_matmul",
        [](const at::Tensor& sample, std::vector<int64_t> pointer_tile, std::vector<int64_t> tma_tile,
           std::vector<int64_t> tma_narrow_tile, bool tma_capable, int64_t tma_min_rows, int64_t tma_min_weight_grad_k,
           int64_t program_slots) {
          if (!sample.is_cuda()) fail("configure_matmul's sample must be a CUDA tensor");
          if (pointer_tile.size() != 2 || tma_tile.size() != 2 || tma_narrow_tile.size() != 2)
            fail("pointer_tile, tma_tile and tma_narrow_tile are (BLOCK_M, BLOCK_N)");
          matmul_configs()[config_key(sample.get_device(), sample.scalar_type())] =
              MatmulConfig{pointer_tile[0], pointer_tile[1], tma_tile[0], tma_tile[1], tma_narrow_tile[0],
                           tma_narrow_tile[1], tma_capable, tma_min_rows, tma_min_weight_grad_k, program_slots};
        },
        "set the matmul's tiles and kernel rule for the device and dtype of sample", py::arg("sample"),
        py::arg("pointer_tile"), py::arg("tma_tile"), py::arg("tma_narrow_tile"), py::arg("tma_capable"),
        py::arg("tma_min_rows"), py::arg("tma_min_weight_grad_k"), py::arg("program_slots"));
  m.def("matmul",
        [](const at::Tensor& a, const at::Tensor& b_t, const std::optional<at::Tensor>& bias) -> std::optional<at::Tensor> {
          if (!on_current_device(a)) return std::nullopt;
          at::Tensor out = matmul_out(a, b_t);
          return serve(plan_matmul(a, b_t, bias, out), out);
        },
        "a [M, K] @ b_t.T (+ bias) [M, N] from a remembered kernel, or None", py::arg("a"), py::arg("b_t"),
        py::arg("bias"));
  m.def("remember_matmul",
        [](const at::Tensor& a, const at::Tensor& b_t, const std::optional<at::Tensor>& bias, const at::Tensor& out,
           bool tma, int64_t grid, std::vector<int64_t> block, int64_t function, int64_t num_warps, int64_t shared,
           std::vector<int64_t> kinds, std::vector<std::vector<int64_t>> layouts) {
          return remember(plan_matmul(a, b_t, bias, out), tma, grid, 1, block, function, num_warps, shared, kinds,
                          layouts);
        },
        "keep the kernel Python launched for this call's specialization: 'kept', 'unplanned' or why not",
        py::arg("a"), py::arg("b_t"), py::arg("bias"), py::arg("out"), py::arg("tma"), py::arg("grid"),
        py::arg("block"), py::arg("function"), py::arg("num_warps"), py::arg("shared"), py::arg("kinds"),
        py::arg("layouts"));
  m.def("row_stats",
        [](const at::Tensor& x, const at::Tensor& out, int64_t mode, double eps) -> std::optional<at::Tensor> {
          return serve(plan_row_stats(x, out, mode, eps), out);
        },
        "the row-statistics pass into out from a remembered kernel, or None", py::arg("x"), py::arg("out"),
        py::arg("mode"), py::arg("eps"));
  m.def("remember_row_stats",
        [](const at::Tensor& x, const at::Tensor& out, int64_t mode, double eps, int64_t function, int64_t num_warps,
           int64_t shared, std::vector<int64_t> kinds) {
          auto plan = plan_row_stats(x, out, mode, eps);
          return remember(plan, false, plan ? plan->grid : 0, 1, {0, 0}, function, num_warps, shared, kinds, {});
        },
        "keep the row-statistics kernel Python launched for this call's specialization: 'kept', 'unplanned' or why not",
        py::arg("x"), py::arg("out"), py::arg("mode"), py::arg("eps"), py::arg("function"), py::arg("num_warps"),
        py::arg("shared"), py::arg("kinds"));
  m.def("attention_forward",
        [](const std::vector<at::Tensor>& tensors, double scale, int64_t block_m, int64_t block_n,
           bool causal) -> std::optional<at::Tensor> {
          if (tensors.size() != 9) fail("attention_forward takes q, k, v, out, lse and the four tables");
          return serve(plan_attention_forward(tensors, scale, block_m, block_n, causal), tensors[3]);
        },
        "varlen attention's forward into out (and lse) from a remembered kernel, or None", py::arg("tensors"),
        py::arg("scale"), py::arg("block_m"), py::arg("block_n"), py::arg("causal"));
  m.def("remember_attention_forward",
        [](const std::vector<at::Tensor>& tensors, double scale, int64_t block_m, int64_t block_n, bool causal,
           int64_t grid, int64_t grid_y, int64_t function, int64_t num_warps, int64_t shared,
           std::vector<int64_t> kinds) {
          return remember(plan_attention_forward(tensors, scale, block_m, block_n, causal), false, grid, grid_y,
                          {0, 0}, function, num_warps, shared, kinds, {});
        },
        "keep the attention forward kernel Python launched for this call's specialization: 'kept', 'unplanned' or "
        "why not",
        py::arg("tensors"), py::arg("scale"), py::arg("block_m"), py::arg("block_n"), py::arg("causal"),
        py::arg("grid"), py::arg("grid_y"), py::arg("function"), py::arg("num_warps"), py::arg("shared"),
        py::arg("kinds"));
  m.def("argument_names",
        []() {
          return std::unordered_map<std::string, std::vector<std::string>>{
              {"_persistent_matmul_kernel",
               {"a_ptr", "b_ptr", "bias_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_ak", "stride_bk",
                "stride_bn", "stride_cm", "stride_cn", "n_progs"}},
              {"_tma_matmul_kernel", {"a_desc", "b_desc", "bias_ptr", "c_desc", "c_ptr", "M", "N", "K", "stride_cm"}},
              {"_row_stats_kernel", {"x_ptr", "out_ptr", "L", "stride_row", "eps"}},
              {"_attention_fwd_kernel",
               {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "cu_q_ptr", "cu_k_ptr", "tile_seq_ptr",
                "tile_start_ptr", "scale"}}};
        },
        "the runtime arguments each plan passes, in order (checked against the kernels' signatures)");
  m.def("stats",
        []() {
          const Table& t = table();
          return std::unordered_map<std::string, int64_t>{
              {"kernels", static_cast<int64_t>(t.kernels.size())}, {"hits", t.hits}, {"misses", t.misses}};
        },
        "kernels remembered, calls served, calls not served (a specialization not seen yet)");
}
