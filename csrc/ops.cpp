// Op schemas and CPU registrations. Importing sgl_ecospec._C makes them available as
// torch.ops.sgl_ecospec.*; CUDA builds register their kernels for the same schemas.
#include <Python.h>
#include <torch/library.h>

#include "ecospec_ops.h"

TORCH_LIBRARY(sgl_ecospec, m) {
  m.def("topk_to_bitmap(Tensor topk_ids, int num_experts) -> Tensor");
  m.def("bitmap_popcount(Tensor bitmaps) -> Tensor");
  m.def(
      "select_verify_set(Tensor scores, Tensor parents, Tensor node_experts, int budget, "
      "Tensor? root_experts, str policy, float eps, bool share_buffer, "
      "Tensor? layer_weights, Tensor? expert_rank=None, int num_ranks=1, "
      "float total_weight=0.0, float step_tokens=1.0, float step_cost=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_ecospec, CPU, m) {
  m.impl("topk_to_bitmap", &sgl_ecospec::topk_to_bitmap_cpu);
  m.impl("bitmap_popcount", &sgl_ecospec::bitmap_popcount_cpu);
  m.impl("select_verify_set", &sgl_ecospec::select_verify_set_cpu);
}

// A plain module init: the ops are reached through torch.ops, not through module attributes.
static struct PyModuleDef ecospec_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&ecospec_module); }
