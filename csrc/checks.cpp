// The argument checks of checks.h. Compiled once as C++ and called by every launcher
// (the CUDA one included), so there is one copy of each rule and of each message.
#include "checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace sgl_ecospec {

namespace {

constexpr std::initializer_list<at::ScalarType> kFloatTypes = {at::kHalf, at::kBFloat16,
                                                              at::kFloat, at::kDouble};
constexpr std::initializer_list<at::ScalarType> kIndexTypes = {at::kInt, at::kLong};

// torch's Python names, which the Python layer's messages use too.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

// "[..., L, K]" or "[B, N]".
std::string layout(std::initializer_list<NamedSize*> sizes, bool leading) {
  std::ostringstream s;
  s << "[";
  const char* sep = "";
  if (leading) {
    s << "...";
    sep = ", ";
  }
  for (const NamedSize* size : sizes) {
    s << sep << size->name;
    sep = ", ";
  }
  s << "]";
  return s.str();
}

std::string dtype_list(std::initializer_list<at::ScalarType> dtypes) {
  std::string out;
  size_t i = 0;
  for (at::ScalarType t : dtypes) {
    if (i > 0) out += i + 1 == dtypes.size() ? " or " : ", ";
    out += dtype_name(t);
    ++i;
  }
  return out;
}

}  // namespace

void TensorMatcher::match(const char* name, const at::Tensor& t,
                          std::initializer_list<NamedSize*> sizes,
                          std::initializer_list<at::ScalarType> dtypes) {
  match_impl(name, t, sizes, dtypes, false);
}

void TensorMatcher::match_trailing(const char* name, const at::Tensor& t,
                                   std::initializer_list<NamedSize*> sizes,
                                   std::initializer_list<at::ScalarType> dtypes) {
  match_impl(name, t, sizes, dtypes, true);
}

void TensorMatcher::match_impl(const char* name, const at::Tensor& t,
                               std::initializer_list<NamedSize*> sizes,
                               std::initializer_list<at::ScalarType> dtypes, bool leading) {
  const int64_t want = static_cast<int64_t>(sizes.size());
  TORCH_CHECK_VALUE(leading ? t.dim() >= want : t.dim() == want, op_, ": ", name, " must be ",
                    layout(sizes, leading), ", got shape ", t.sizes());
  bool dtype_ok = false;
  for (at::ScalarType d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  TORCH_CHECK_TYPE(dtype_ok, op_, ": ", name, " must have dtype ", dtype_list(dtypes), ", got ",
                   dtype_name(t.scalar_type()));
  // One device for all tensors: the dispatcher picks a kernel from the union of the
  // tensors' backends, so without this a CPU tensor could reach the CUDA kernel.
  if (!device_.has_value()) {
    device_ = t.device();
    device_source_ = name;
  }
  TORCH_CHECK_VALUE(t.device() == *device_, op_, ": ", name, " is on ", t.device(), " but ",
                    device_source_, " is on ", *device_, ": all tensors must be on one device");
  int64_t dim = t.dim() - want;
  for (NamedSize* size : sizes) {
    const int64_t got = t.size(dim++);
    if (size->value < 0) {
      size->value = got;
      size->source = name;
      continue;
    }
    TORCH_CHECK_VALUE(got == size->value, op_, ": ", name, " must be ", layout(sizes, leading),
                      " with ", size->name, " = ", size->value, " (from ", size->source,
                      "), got shape ", t.sizes());
  }
}

SelectCall check_select_verify_set_args(SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS) {
  TensorMatcher m("select_verify_set");
  NamedSize B{"B"}, N{"N"}, L{"L"}, W{"W"}, E{"E"};
  m.match("scores", scores, {&B, &N}, kFloatTypes);
  m.match("parents", parents, {&B, &N}, kIndexTypes);
  m.match("node_experts", node_experts, {&B, &N, &L, &W}, {at::kLong});
  // int64 only, like node_experts (and the Python layer): a bitmap is 64-bit words.
  if (root_experts.has_value()) m.match("root_experts", *root_experts, {&B, &L, &W}, {at::kLong});
  if (layer_weights.has_value()) m.match("layer_weights", *layer_weights, {&L}, kFloatTypes);
  if (expert_rank.has_value()) {
    TORCH_CHECK_VALUE(expert_rank->dim() == 1 || expert_rank->dim() == 2,
                      "select_verify_set: expert_rank must be [E] or [L, E], got shape ",
                      expert_rank->sizes());
    if (expert_rank->dim() == 1) {
      m.match("expert_rank", *expert_rank, {&E}, kIndexTypes);
    } else {
      m.match("expert_rank", *expert_rank, {&L, &E}, kIndexTypes);
    }
    const int64_t need = (E.value + kBitsPerWord - 1) / kBitsPerWord;
    TORCH_CHECK_VALUE(need == W.value, "select_verify_set: expert_rank has E = ", E.value,
                      " experts, so node_experts needs W = ceil(E / 64) = ", need,
                      " words per layer, got W = ", W.value);
  }
  TORCH_CHECK_VALUE(budget >= 0, "select_verify_set: budget must be >= 0, got ", budget);
  TORCH_CHECK_VALUE(policy == "confidence" || policy == "ecospec" || policy == "adaptive",
                    "select_verify_set: unknown policy '", policy,
                    "': expected confidence, ecospec or adaptive");
  const Policy kind = policy == "confidence" ? Policy::kConfidence
                      : policy == "ecospec"  ? Policy::kEcoSpec
                                             : Policy::kAdaptive;
  // Comparisons with NaN are false, so each range test below also rejects NaN.
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0,
                    "select_verify_set: eps must be finite and > 0, got ", eps);
  TORCH_CHECK_VALUE(num_ranks >= 1, "select_verify_set: num_ranks must be >= 1, got ", num_ranks);
  TORCH_CHECK_VALUE(total_weight >= 0 && total_weight <= 1,
                    "select_verify_set: total_weight must lie in [0, 1], got ", total_weight);
  TORCH_CHECK_VALUE(std::isfinite(step_tokens) && step_tokens >= 0,
                    "select_verify_set: step_tokens must be finite and >= 0, got ", step_tokens);
  TORCH_CHECK_VALUE(step_cost.has_value() || kind != Policy::kAdaptive,
                    "select_verify_set: policy 'adaptive' needs step_cost");
  TORCH_CHECK_VALUE(!step_cost.has_value() || (std::isfinite(*step_cost) && *step_cost > 0),
                    "select_verify_set: step_cost must be finite and > 0, got ",
                    step_cost.value_or(0.0));
  TORCH_CHECK_VALUE(std::isfinite(candidate_cost) && candidate_cost >= 0,
                    "select_verify_set: candidate_cost must be finite and >= 0, got ",
                    candidate_cost);
  TORCH_CHECK_VALUE(candidate_decay >= 0 && candidate_decay <= 1,
                    "select_verify_set: candidate_decay must lie in [0, 1], got ", candidate_decay);
  TORCH_CHECK_VALUE(std::isfinite(min_score) && min_score >= 0,
                    "select_verify_set: min_score must be finite and >= 0, got ", min_score);
  TORCH_CHECK_VALUE(!round_sync || share_buffer,
                    "select_verify_set: round_sync needs share_buffer");
  const SelectOptions options{kind,
                              eps,
                              share_buffer,
                              num_ranks,
                              total_weight,
                              step_tokens,
                              step_cost.value_or(0.0),
                              candidate_cost,
                              candidate_decay,
                              min_score,
                              round_sync};
  return SelectCall{scores,
                    parents,
                    node_experts,
                    root_experts,
                    layer_weights,
                    expert_rank,
                    SelectShape{B.value, N.value, L.value, W.value, budget},
                    E.value,
                    options};
}

SelectInputs::SelectInputs(const SelectCall& call)
    : prob(call.scores.to(at::kDouble).contiguous()),
      parents(call.parents.to(at::kLong).contiguous()),
      experts(call.node_experts.contiguous()) {
  if (call.root_experts.has_value()) roots = call.root_experts->contiguous();
  if (call.layer_weights.has_value()) weights = call.layer_weights->to(at::kDouble).contiguous();
  placement = Placement{false, nullptr, 0, 0, 1, 0.0};
  if (call.expert_rank.has_value()) {
    ranks = call.expert_rank->to(at::kLong).contiguous();
    placement = Placement{true,
                          ranks.data_ptr<int64_t>(),
                          ranks.dim() == 2 ? call.num_experts : 0,
                          call.num_experts,
                          call.options.num_ranks,
                          call.options.total_weight};
  }
}

SelectBuffers SelectInputs::buffers(at::Tensor& out) const {
  return SelectBuffers{
      prob.data_ptr<double>(),
      parents.data_ptr<int64_t>(),
      reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>()),
      roots.defined() ? reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>()) : nullptr,
      weights.defined() ? weights.data_ptr<double>() : nullptr,
      out.data_ptr<int64_t>()};
}

int64_t check_topk_to_bitmap_args(const at::Tensor& topk_ids, int64_t num_experts) {
  TensorMatcher m("topk_to_bitmap");
  NamedSize L{"L"}, K{"K"};
  m.match_trailing("topk_ids", topk_ids, {&L, &K}, kIndexTypes);
  TORCH_CHECK_VALUE(num_experts >= 1, "topk_to_bitmap: num_experts must be >= 1, got ",
                    num_experts);
  return (num_experts + kBitsPerWord - 1) / kBitsPerWord;
}

void check_bitmap_popcount_args(const at::Tensor& bitmaps) {
  TensorMatcher m("bitmap_popcount");
  NamedSize W{"W"};
  m.match_trailing("bitmaps", bitmaps, {&W}, {at::kLong});
}

}  // namespace sgl_ecospec
