// CPU kernels of the bitmap ops; arguments are checked by checks.h, like on every backend.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "ecospec_ops.h"

namespace sgl_ecospec {

namespace {
constexpr int64_t kWordBits = 64;

template <typename index_t>
void pack_rows(const index_t* ids, int64_t* out, int64_t rows, int64_t k, int64_t words,
               int64_t num_experts) {
  at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint64_t* row_out = reinterpret_cast<uint64_t*>(out + r * words);
      for (int64_t w = 0; w < words; ++w) row_out[w] = 0;
      const index_t* row_ids = ids + r * k;
      // Like the CUDA kernel, an id outside [0, E) sets no bit: no launcher reads values
      // to reject them (checks.h); topk_to_bitmap(validate=True) does.
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = static_cast<int64_t>(row_ids[j]);
        if (e >= 0 && e < num_experts) row_out[e / kWordBits] |= uint64_t{1} << (e % kWordBits);
      }
    }
  });
}
}  // namespace

at::Tensor topk_to_bitmap_cpu(const at::Tensor& topk_ids, int64_t num_experts) {
  const int64_t words = check_topk_to_bitmap_args(topk_ids, num_experts);
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t k = ids.size(-1);
  auto out_shape = ids.sizes().vec();
  out_shape.back() = words;
  at::Tensor out = at::empty(out_shape, ids.options().dtype(at::kLong));
  const int64_t rows = k == 0 ? out.numel() / words : ids.numel() / k;
  if (ids.scalar_type() == at::kInt) {
    pack_rows(ids.data_ptr<int32_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  } else {
    pack_rows(ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  }
  return out;
}

at::Tensor bitmap_popcount_cpu(const at::Tensor& bitmaps) {
  check_bitmap_popcount_args(bitmaps);
  const at::Tensor bm = bitmaps.contiguous();
  const int64_t words = bm.size(-1);
  auto out_shape = bm.sizes().vec();
  out_shape.pop_back();
  at::Tensor out = at::empty(out_shape, bm.options());
  const int64_t rows = out.numel();
  const uint64_t* in = reinterpret_cast<const uint64_t*>(bm.data_ptr<int64_t>());
  int64_t* counts = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t c = 0;
      for (int64_t w = 0; w < words; ++w) c += __builtin_popcountll(in[r * words + w]);
      counts[r] = c;
    }
  });
  return out;
}

}  // namespace sgl_ecospec
