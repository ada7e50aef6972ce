// Meta kernels: the ops' output shapes and dtypes without computing anything, so that
// torch.compile / make_fx (FakeTensor) can trace them. Each runs the same argument check as
// the CPU and CUDA launchers (checks.h), so a traced call rejects exactly what a real one
// would, with the same message; the tests compare the three.
#include <torch/library.h>

#include "checks.h"
#include "ecospec_ops.h"

namespace sgl_ecospec {

at::Tensor topk_to_bitmap_meta(const at::Tensor& topk_ids, int64_t num_experts) {
  const int64_t words = check_topk_to_bitmap_args(topk_ids, num_experts);
  auto shape = topk_ids.sizes().vec();
  shape.back() = words;
  return at::empty(shape, topk_ids.options().dtype(at::kLong));
}

at::Tensor bitmap_popcount_meta(const at::Tensor& bitmaps) {
  check_bitmap_popcount_args(bitmaps);
  auto shape = bitmaps.sizes().vec();
  shape.pop_back();
  return at::empty(shape, bitmaps.options());
}

at::Tensor select_verify_set_meta(const SelectCall& call) {
  return at::empty({call.shape.batch, call.shape.budget}, call.scores.options().dtype(at::kLong));
}

}  // namespace sgl_ecospec

TORCH_LIBRARY_IMPL(sgl_ecospec, Meta, m) { SGL_ECOSPEC_REGISTER_OPS(m, meta); }
