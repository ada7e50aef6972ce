// CUDA kernels of the sgl_ecospec ops, registered for the same schemas as the CPU ops and
// behind the same argument checks (checks.h). No host syncs and no allocation beyond the
// outputs and scratch tensors, so the ops can be captured in a CUDA graph. Value checks
// (ids in range, parents in range, no NaN, EP ranks in range) are the Python API's job, on
// every backend: here, as on the CPU, an out-of-range id sets no bit, an out-of-range parent
// makes its node unreachable and an expert with an out-of-range rank adds no load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

#include "checks.h"
#include "ecospec_ops.h"
#include "selection_core.h"
#include "selection_cuda.cuh"

namespace sgl_ecospec {

namespace {

constexpr int kThreads = 256;

template <typename index_t>
__global__ void topk_to_bitmap_kernel(const index_t* __restrict__ ids, int64_t* __restrict__ out,
                                      int64_t rows, int64_t k, int64_t words,
                                      int64_t num_experts) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  uint64_t* row_out = reinterpret_cast<uint64_t*>(out + r * words);
  for (int64_t w = 0; w < words; ++w) row_out[w] = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = static_cast<int64_t>(ids[r * k + j]);
    if (e >= 0 && e < num_experts) row_out[e / kBitsPerWord] |= uint64_t{1} << (e % kBitsPerWord);
  }
}

__global__ void popcount_kernel(const uint64_t* __restrict__ in, int64_t* __restrict__ out,
                                int64_t rows, int64_t words) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  int64_t c = 0;
  for (int64_t w = 0; w < words; ++w) c += popcount64(in[r * words + w]);
  out[r] = c;
}

// Dynamic shared memory select_kernel may use on the current device: the opt-in maximum
// per block less its static shared memory. Raises the kernel's limit to it on first use
// (once per device; not a stream operation, so safe while a CUDA graph is captured).
int64_t select_shared_limit() {
  static std::mutex mutex;
  static std::unordered_map<int, int64_t> limits;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = limits.find(device);
  if (found != limits.end()) return found->second;
  int optin = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, select_kernel));
  const int64_t limit = optin - static_cast<int64_t>(attributes.sharedSizeBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(
      select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  limits[device] = limit;
  return limit;
}

int64_t blocks_for(int64_t rows) { return std::max<int64_t>(1, (rows + kThreads - 1) / kThreads); }

}  // namespace

at::Tensor topk_to_bitmap_cuda(const at::Tensor& topk_ids, int64_t num_experts) {
  const int64_t words = check_topk_to_bitmap_args(topk_ids, num_experts);
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t k = ids.size(-1);
  auto shape = ids.sizes().vec();
  shape.back() = words;
  at::Tensor out = at::empty(shape, ids.options().dtype(at::kLong));
  const int64_t rows = out.numel() / words;
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (ids.scalar_type() == at::kInt) {
    topk_to_bitmap_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        ids.data_ptr<int32_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  } else {
    topk_to_bitmap_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor bitmap_popcount_cuda(const at::Tensor& bitmaps) {
  check_bitmap_popcount_args(bitmaps);
  const c10::cuda::CUDAGuard guard(bitmaps.device());
  const at::Tensor bm = bitmaps.contiguous();
  auto shape = bm.sizes().vec();
  const int64_t words = shape.back();
  shape.pop_back();
  at::Tensor out = at::empty(shape, bm.options());
  const int64_t rows = out.numel();
  if (rows == 0) return out;
  popcount_kernel<<<blocks_for(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint64_t*>(bm.data_ptr<int64_t>()), out.data_ptr<int64_t>(), rows,
      words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor select_verify_set_cuda(SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS) {
  const SelectSizes sizes = check_select_verify_set_args(SGL_ECOSPEC_SELECT_VERIFY_SET_ARGS);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t batch = sizes.batch, n = sizes.num_nodes;
  const int64_t layers = sizes.layers, words = sizes.words;

  const at::Tensor prob = scores.to(at::kDouble).contiguous();
  const at::Tensor par = parents.to(at::kLong).contiguous();
  const at::Tensor experts = node_experts.contiguous();
  at::Tensor roots, weights, ranks;
  if (root_experts.has_value()) roots = root_experts->contiguous();
  if (layer_weights.has_value()) weights = layer_weights->to(at::kDouble).contiguous();
  const Placement placement = make_placement(expert_rank, sizes, num_ranks, total_weight, ranks);
  at::Tensor out = at::empty({batch, budget}, par.options());
  if (batch == 0) return out;

  const SelectLaunch launch = plan_select(
      batch, n, layers, words, sizes.policy, share_buffer, placement.enabled,
      placement.layer_stride == 0 ? 1 : layers, placement.num_experts, placement.num_ranks,
      select_shared_limit());
  const WorkspaceLayout& layout = launch.layout;
  at::Tensor scratch;
  if (layout.global_bytes > 0) {
    scratch = at::empty({launch.blocks * layout.global_bytes}, par.options().dtype(at::kByte));
  }

  SelectArgs args{};
  args.prob = prob.data_ptr<double>();
  args.parents = par.data_ptr<int64_t>();
  args.experts = reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>());
  args.roots =
      roots.defined() ? reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>()) : nullptr;
  args.weights = weights.defined() ? weights.data_ptr<double>() : nullptr;
  args.rank = placement.enabled ? placement.rank : nullptr;
  args.scratch = scratch.defined() ? scratch.data_ptr<uint8_t>() : nullptr;
  args.out = out.data_ptr<int64_t>();
  args.batch = batch;
  args.num_nodes = n;
  args.layers = layers;
  args.words = words;
  args.budget = budget;
  args.requests_per_block = launch.group;
  args.policy = sizes.policy;
  args.eps = eps;
  args.step_tokens = step_tokens;
  args.step_cost = step_cost;
  args.min_score = min_score;
  args.candidate_cost = candidate_cost;
  args.candidate_decay = candidate_decay;
  args.ep = placement.enabled;
  args.rank_layer_stride = placement.layer_stride;
  args.num_experts = placement.num_experts;
  args.num_ranks = placement.num_ranks;
  args.total_weight = placement.total_weight;
  args.layout = layout;
  select_kernel<<<static_cast<unsigned>(launch.blocks), kSelectThreads, layout.shared_bytes,
                  c10::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace sgl_ecospec

TORCH_LIBRARY_IMPL(sgl_ecospec, CUDA, m) { SGL_ECOSPEC_REGISTER_OPS(m, cuda); }
