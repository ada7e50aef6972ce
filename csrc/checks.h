// Argument checks shared by every launcher of the sgl_ecospec ops (CPU, CUDA and Meta), so
// that each backend accepts exactly the same inputs and rejects the rest with the same
// error. In the spirit of SGLang's TensorMatcher: each tensor is described once by its
// named sizes ("scores [B, N]"), its dtypes and the one device all tensors share; the first
// tensor to mention a size fixes it and later tensors must agree.
//
// What is checked here: ranks, named sizes, dtypes, one device, and the ranges of the
// scalar arguments. What is NOT checked by any launcher: tensor values (expert ids in
// [0, E), parents in [-1, N) and acyclic, EP ranks in [0, R), scores not NaN). Reading values
// on CUDA needs a host sync, which would break CUDA-graph capture, so no launcher reads them
// and the Python layer's validate=True does. Every launcher treats bad values alike (shared
// rules in selection_core.h): an out-of-range id sets no bit, a node with an out-of-range
// parent (or in a cycle) is never reachable, an expert with an out-of-range rank adds no load.
//
// Errors: TORCH_CHECK_TYPE (Python TypeError) for dtypes, TORCH_CHECK_VALUE (ValueError) for
// everything else, each message starting with "<op>: ".
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <string>

#include "ecospec_ops.h"
#include "selection_call.h"
#include "selection_core.h"

namespace sgl_ecospec {

// A named size (B, N, L, ...): unknown until a tensor fixes it.
struct NamedSize {
  const char* name;
  int64_t value = -1;
  const char* source = nullptr;  // the tensor that fixed it
};

// Collects one op's tensors: checks each against its named sizes and dtypes, and that all
// of them share the device of the first.
class TensorMatcher {
 public:
  explicit TensorMatcher(const char* op) : op_(op) {}

  // `t` must have exactly sizes.size() dims, each equal to its named size (binding the
  // sizes not yet known), a dtype in `dtypes` and the common device.
  void match(const char* name, const at::Tensor& t, std::initializer_list<NamedSize*> sizes,
             std::initializer_list<at::ScalarType> dtypes);
  // The same for a tensor with any number of leading dims before `sizes` ("[..., L, K]").
  void match_trailing(const char* name, const at::Tensor& t,
                      std::initializer_list<NamedSize*> sizes,
                      std::initializer_list<at::ScalarType> dtypes);

 private:
  void match_impl(const char* name, const at::Tensor& t, std::initializer_list<NamedSize*> sizes,
                  std::initializer_list<at::ScalarType> dtypes, bool leading);
  const char* op_;
  std::optional<at::Device> device_;
  const char* device_source_ = nullptr;
};

// A checked select_verify_set call: its tensors as given, its sizes and its options.
struct SelectCall {
  at::Tensor scores, parents, node_experts;
  std::optional<at::Tensor> root_experts, layer_weights, expert_rank;
  SelectShape shape;
  int64_t num_experts;  // E of expert_rank, or -1 without it
  SelectOptions options;
};

// Checks select_verify_set's arguments (all of them, see above), once per call.
SelectCall check_select_verify_set_args(SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS);

// The kernel registered for a backend (SGL_ECOSPEC_REGISTER_OPS): the schema's arguments,
// checked into one SelectCall, handed to the backend's launcher.
template <at::Tensor (*Launch)(const SelectCall&)>
at::Tensor select_verify_set_kernel(SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS) {
  return Launch(check_select_verify_set_args(SGL_ECOSPEC_SELECT_VERIFY_SET_ARGS));
}

// A checked call's inputs in the launchers' types (prob float64, parents int64, weights
// float64, ranks int64; contiguous, on the inputs' device; the optional ones undefined when
// not given) and its EP placement (disabled without expert_rank; `ranks` viewed as [L, E] or
// [E]). Converting is an asynchronous copy on CUDA: no values are read (see above).
struct SelectInputs {
  at::Tensor prob, parents, experts, roots, weights, ranks;
  Placement placement;
  explicit SelectInputs(const SelectCall& call);
  // The raw pointers, with `out` int64 [B, budget] (selection_call.h).
  SelectBuffers buffers(at::Tensor& out) const;
};

// Checks topk_to_bitmap's arguments; returns W = ceil(num_experts / 64).
int64_t check_topk_to_bitmap_args(const at::Tensor& topk_ids, int64_t num_experts);

// Checks bitmap_popcount's arguments.
void check_bitmap_popcount_args(const at::Tensor& bitmaps);

}  // namespace sgl_ecospec
