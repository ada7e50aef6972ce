// Op schemas and CPU registrations. Importing sgl_ecospec._C makes them available as
// torch.ops.sgl_ecospec.*; meta.cpp and (in CUDA builds) ops_cuda.cu register their kernels
// for the same schemas.
#include <Python.h>
#include <torch/library.h>

#include "checks.h"
#include "ecospec_ops.h"

TORCH_LIBRARY(sgl_ecospec, m) {
  m.def(SGL_ECOSPEC_TOPK_TO_BITMAP_SCHEMA);
  m.def(SGL_ECOSPEC_BITMAP_POPCOUNT_SCHEMA);
  m.def(SGL_ECOSPEC_SELECT_VERIFY_SET_SCHEMA);
}

TORCH_LIBRARY_IMPL(sgl_ecospec, CPU, m) { SGL_ECOSPEC_REGISTER_OPS(m, cpu); }

// A plain module init: the ops are reached through torch.ops, not through module attributes.
static struct PyModuleDef ecospec_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&ecospec_module); }
