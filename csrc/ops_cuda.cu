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
#include "selection_launch.h"

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

at::Tensor select_verify_set_cuda(const SelectCall& call) {
  const c10::cuda::CUDAGuard guard(call.scores.device());
  const SelectInputs inputs(call);
  const SelectShape& shape = call.shape;
  at::Tensor out = at::empty({shape.batch, shape.budget}, inputs.parents.options());
  if (shape.batch == 0) return out;

  const SelectLaunch launch =
      plan_select_call(shape, call.options, inputs.placement, select_shared_limit());
  at::Tensor scratch;
  if (launch.layout.global_bytes > 0) {
    scratch = at::empty({launch.blocks * launch.layout.global_bytes},
                        inputs.parents.options().dtype(at::kByte));
  }
  const SelectArgs args =
      select_args(inputs.buffers(out), scratch.defined() ? scratch.data_ptr<uint8_t>() : nullptr,
                  shape, call.options, inputs.placement, launch);
  select_kernel<<<static_cast<unsigned>(launch.blocks), kSelectThreads,
                  launch.layout.shared_bytes, c10::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace sgl_ecospec

TORCH_LIBRARY_IMPL(sgl_ecospec, CUDA, m) { SGL_ECOSPEC_REGISTER_OPS(m, cuda); }
