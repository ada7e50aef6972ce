// The selection kernel alone, for the dry run's `nvcc -Xptxas -v` report (registers, shared
// memory, spills) without building the whole extension against torch's headers.
#include "selection_cuda.cuh"
