// The sgl_ecospec ops: their schemas and the C++ signature of every launcher, written
// once. ops.cpp registers the schemas; selection.cpp / bitmaps.cpp (CPU), ops_cuda.cu (CUDA)
// and meta.cpp (Meta: shapes only, for tracing) define kernels with the signatures below.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

// Schemas (torch.ops.sgl_ecospec.*); semantics in sgl_ecospec/ops/{bitmaps,selection}.py.
#define SGL_ECOSPEC_TOPK_TO_BITMAP_SCHEMA "topk_to_bitmap(Tensor topk_ids, int num_experts) -> Tensor"
#define SGL_ECOSPEC_BITMAP_POPCOUNT_SCHEMA "bitmap_popcount(Tensor bitmaps) -> Tensor"
// select_verify_set's scalar options travel as schema arguments, in the order
// sgl_ecospec.ops.selection.native_arguments lists them: a schema cannot take a struct, so
// checks.cpp gathers them into one SelectOptions (selection_call.h), checked once per call.
// The arguments added after the first release keep schema defaults, so raw callers written
// before them still work (test/ops/test_native.py); step_cost is optional because only
// "adaptive" reads it (the Python layer passes None for the other policies).
#define SGL_ECOSPEC_SELECT_VERIFY_SET_SCHEMA                                      \
  "select_verify_set(Tensor scores, Tensor parents, Tensor node_experts, int budget, " \
  "Tensor? root_experts, str policy, float eps, bool share_buffer, "              \
  "Tensor? layer_weights, Tensor? expert_rank=None, int num_ranks=1, "            \
  "float total_weight=0.0, float step_tokens=1.0, float? step_cost=1.0, "        \
  "float candidate_cost=0.0, float candidate_decay=1.0, float min_score=0.0, "     \
  "bool round_sync=False) -> Tensor"

// The C++ parameter list matching SGL_ECOSPEC_SELECT_VERIFY_SET_SCHEMA, taken only by the
// registered kernel (select_verify_set_kernel, checks.h) and by the check it calls;
// SGL_ECOSPEC_SELECT_VERIFY_SET_ARGS forwards them.
#define SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS                                                  \
  const at::Tensor &scores, const at::Tensor &parents, const at::Tensor &node_experts,       \
      int64_t budget, const std::optional<at::Tensor> &root_experts, const std::string &policy, \
      double eps, bool share_buffer, const std::optional<at::Tensor> &layer_weights,          \
      const std::optional<at::Tensor> &expert_rank, int64_t num_ranks, double total_weight,   \
      double step_tokens, std::optional<double> step_cost, double candidate_cost,             \
      double candidate_decay, double min_score, bool round_sync
#define SGL_ECOSPEC_SELECT_VERIFY_SET_ARGS                                                  \
  scores, parents, node_experts, budget, root_experts, policy, eps, share_buffer,          \
      layer_weights, expert_rank, num_ranks, total_weight, step_tokens, step_cost,         \
      candidate_cost, candidate_decay, min_score, round_sync

// Declares <op>_<backend> for each op. topk_to_bitmap: topk_ids int32/int64 [..., L, K] ->
// int64 [..., L, ceil(E / 64)]. bitmap_popcount: int64 [..., W] -> int64 [...].
// select_verify_set: a checked call (SelectCall, checks.h: scores float [B, N], parents int
// [B, N], node_experts int64 [B, N, L, W], root_experts int64 [B, L, W] or none,
// layer_weights float [L] or none, expert_rank int32/int64 [E] or [L, E] or none, and the
// options) -> int64 [B, budget].
#define SGL_ECOSPEC_DECLARE_OPS(backend)                                            \
  at::Tensor topk_to_bitmap_##backend(const at::Tensor& topk_ids, int64_t num_experts); \
  at::Tensor bitmap_popcount_##backend(const at::Tensor& bitmaps);                  \
  at::Tensor select_verify_set_##backend(const SelectCall& call);

// Registers the kernels declared by SGL_ECOSPEC_DECLARE_OPS(backend) under `m`;
// select_verify_set's through the shared check (select_verify_set_kernel, checks.h).
#define SGL_ECOSPEC_REGISTER_OPS(m, backend)                                 \
  m.impl("topk_to_bitmap", &sgl_ecospec::topk_to_bitmap_##backend);       \
  m.impl("bitmap_popcount", &sgl_ecospec::bitmap_popcount_##backend);     \
  m.impl("select_verify_set",                                              \
         &sgl_ecospec::select_verify_set_kernel<&sgl_ecospec::select_verify_set_##backend>)

namespace sgl_ecospec {

struct SelectCall;  // checks.h

SGL_ECOSPEC_DECLARE_OPS(cpu)
SGL_ECOSPEC_DECLARE_OPS(meta)
SGL_ECOSPEC_DECLARE_OPS(cuda)  // defined only in CUDA builds (ops_cuda.cu)

}  // namespace sgl_ecospec
