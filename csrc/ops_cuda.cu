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

// Blocks of select_kernel that can be resident at once on the current device with
// `shared_bytes` of dynamic shared memory each: a cooperative launch (round_sync) may not
// have more.
int64_t select_resident_blocks(int64_t shared_bytes) {
  int device = 0, processors = 0, per_processor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_processor, select_kernel, kSelectThreads, static_cast<size_t>(shared_bytes)));
  return static_cast<int64_t>(processors) * per_processor;
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

  const int64_t shared_limit = select_shared_limit();
  // round_sync's grid: first planned for one block per multiprocessor, then checked against
  // the occupancy its workspace allows (more requests per block when fewer fit).
  int64_t resident = select_resident_blocks(0);
  SelectLaunch launch = plan_select_call(shape, call.options, inputs.placement, shared_limit,
                                         resident);
  while (launch.rounds && launch.blocks > 1 &&
         launch.blocks > (resident = select_resident_blocks(launch.layout.shared_bytes))) {
    TORCH_CHECK(resident >= 1, "select_verify_set: no block of the round_sync kernel fits on "
                               "this device");
    launch = plan_select_call(shape, call.options, inputs.placement, shared_limit, resident);
  }
  at::Tensor scratch;
  if (launch.scratch_bytes() > 0) {
    scratch = at::empty({launch.scratch_bytes()}, inputs.parents.options().dtype(at::kByte));
    if (launch.union_bytes > 0) {
      scratch.narrow(0, launch.union_offset(), launch.union_bytes).zero_();
    }
  }
  SelectArgs args =
      select_args(inputs.buffers(out), scratch.defined() ? scratch.data_ptr<uint8_t>() : nullptr,
                  shape, call.options, inputs.placement, launch);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (launch.rounds) {
    // The blocks meet after every round (grid.sync), which only a cooperative launch allows.
    void* params[] = {&args};
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel(
        reinterpret_cast<void*>(select_kernel), dim3(static_cast<unsigned>(launch.blocks)),
        dim3(kSelectThreads), params, static_cast<size_t>(launch.layout.shared_bytes), stream));
  } else {
    select_kernel<<<static_cast<unsigned>(launch.blocks), kSelectThreads,
                    launch.layout.shared_bytes, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace sgl_ecospec

TORCH_LIBRARY_IMPL(sgl_ecospec, CUDA, m) { SGL_ECOSPEC_REGISTER_OPS(m, cuda); }
