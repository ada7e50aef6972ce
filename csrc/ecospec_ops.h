// CPU implementations of the sgl_ecospec ops; schemas are declared in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace sgl_ecospec {

// topk_ids int32/int64 [..., L, K] -> int64 [..., L, ceil(E / 64)].
at::Tensor topk_to_bitmap_cpu(const at::Tensor& topk_ids, int64_t num_experts);

// bitmaps int64 [..., W] -> int64 [...], set bits per row.
at::Tensor bitmap_popcount_cpu(const at::Tensor& bitmaps);

// scores float [B, N], parents int [B, N], node_experts int64 [B, N, L, W],
// root_experts int64 [B, L, W] or none, layer_weights float [L] or none,
// expert_rank int32/int64 [E] or [L, E] or none -> int64 [B, budget];
// semantics in sgl_ecospec/ops/selection.py.
at::Tensor select_verify_set_cpu(const at::Tensor& scores, const at::Tensor& parents,
                                 const at::Tensor& node_experts, int64_t budget,
                                 const std::optional<at::Tensor>& root_experts,
                                 const std::string& policy, double eps, bool share_buffer,
                                 const std::optional<at::Tensor>& layer_weights,
                                 const std::optional<at::Tensor>& expert_rank, int64_t num_ranks,
                                 double total_weight, double step_tokens, double step_cost);

}  // namespace sgl_ecospec
