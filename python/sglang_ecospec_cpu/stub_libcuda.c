/*
 * A stand-in libcuda.so.1 for machines without an NVIDIA driver (CPU development mode).
 *
 * The CUDA wheels of sglang-kernel (sgl_kernel) and torch link against the driver library
 * libcuda.so.1; without it `import sgl_kernel` fails at load time. This file provides every
 * driver symbol those wheels reference. Each entry point reports CUDA_ERROR_NO_DEVICE, so
 * the CUDA runtime sees no device and torch.cuda.is_available() stays False: nothing ever
 * runs on it. Built by scripts/build_cpu_dev.sh into .venv/lib/sgl_ecospec_stub/.
 *
 * NEVER put this library on LD_LIBRARY_PATH on a machine with a GPU: it would hide the real
 * driver. scripts/launch_cpu.sh refuses to use it when nvidia-smi finds a GPU.
 */
#include <stddef.h>

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

static const char kNoDevice[] =
    "CUDA driver stub (sgl-ecospec CPU development mode): no CUDA device";

/* Functions that hand back an out-parameter set it, so no caller reads garbage. */
CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

CUresult cuDriverGetVersion(int *version) {
  if (version) *version = 0;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
  if (count) *count = 0;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
  (void)error;
  if (str) *str = kNoDevice;
  return 0;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
  (void)error;
  if (str) *str = "CUDA_ERROR_NO_DEVICE";
  return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  (void)symbol; (void)version; (void)flags;
  if (pfn) *pfn = NULL;
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
  (void)symbol; (void)version; (void)flags;
  if (pfn) *pfn = NULL;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetExportTable(const void **table, const void *id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NO_DEVICE;
}

/* The remaining symbols are only linked, never reached once cuInit has failed. Arguments
 * are ignored: on x86-64 and aarch64 the caller owns its argument registers and stack, so
 * an argument-less definition is a valid target for any call. */
#define NO_DEVICE(name) \
  CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuDeviceGetName)
NO_DEVICE(cuDevicePrimaryCtxGetState)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuFuncGetAttribute)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuFuncSetCacheConfig)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuLaunchCooperativeKernel)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLinkAddData_v2)
NO_DEVICE(cuLinkComplete)
NO_DEVICE(cuLinkCreate_v2)
NO_DEVICE(cuLinkDestroy)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoad)
NO_DEVICE(cuModuleLoadData)
NO_DEVICE(cuModuleLoadDataEx)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuOccupancyMaxActiveBlocksPerMultiprocessor)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuTensorMapEncodeTiled)
