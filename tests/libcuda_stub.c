/* A stand-in for the NVIDIA driver's libcuda.so.1 and libnvidia-encode.so.1 on a machine
 * without a GPU, so that the extensions linked against the driver load and their classes
 * can be inspected: every CUDA function says CUDA_ERROR_NO_DEVICE. tests/test_offline_gpu.py
 * compiles it and puts it under both names on LD_LIBRARY_PATH for tests/gpu_contract.py.
 * It exports every cu* symbol the GPU wheels' extensions leave undefined (found with
 * `nm -D --undefined-only`: PyNvVideoCodec 2.2 links these; kvikio, nvImageCodec and CuPy
 * load the driver at run time and take a failing cuInit/cuDriverGetVersion as "no GPU").
 * A wheel that links one more fails its import in the contract, naming the symbol. */

#include <stdlib.h>

#define CUDA_ERROR_NO_DEVICE 100

/* NVENC's version query, which PyNvVideoCodec's import uses to pick its NVENC 12.1 or
 * 13.0 module: $GPUIO_STUB_NVENC ("12.1", "13.0"; 13.0 if unset), as major << 4 | minor */
int NvEncodeAPIGetMaxSupportedVersion(unsigned int *version) {
    const char *given = getenv("GPUIO_STUB_NVENC");
    char *end;
    long major = strtol(given ? given : "13.0", &end, 10);
    long minor = *end == '.' ? strtol(end + 1, NULL, 10) : 0;
    *version = (unsigned int)(major << 4 | minor);
    return 0;
}

static const char no_device[] = "CUDA_ERROR_NO_DEVICE";
static const char no_device_text[] = "no CUDA-capable device is detected (stub libcuda)";

int cuGetErrorName(int error, const char **name) {
    (void)error;
    if (name) *name = no_device;
    return 0;
}

int cuGetErrorString(int error, const char **text) {
    (void)error;
    if (text) *text = no_device_text;
    return 0;
}

int cuDriverGetVersion(int *version) {
    (void)version;
    return CUDA_ERROR_NO_DEVICE;
}

/* the rest take arguments that are never read: the C calling convention lets a
 * no-argument function stand for each */
#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuCtxCreate_v2)
NO_DEVICE(cuCtxDestroy_v2)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuEventCreate)
NO_DEVICE(cuEventDestroy_v2)
NO_DEVICE(cuEventRecord)
NO_DEVICE(cuEventSynchronize)
NO_DEVICE(cuMemAlloc_v2)
NO_DEVICE(cuMemAllocAsync)
NO_DEVICE(cuMemAllocPitch_v2)
NO_DEVICE(cuMemFree_v2)
NO_DEVICE(cuMemFreeAsync)
NO_DEVICE(cuMemcpy2D_v2)
NO_DEVICE(cuMemcpy2DAsync_v2)
NO_DEVICE(cuMemcpyDtoH_v2)
NO_DEVICE(cuMemcpyDtoHAsync_v2)
NO_DEVICE(cuMemcpyHtoD_v2)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuStreamDestroy_v2)
NO_DEVICE(cuStreamGetCtx)
NO_DEVICE(cuStreamSynchronize)
NO_DEVICE(cuStreamWaitEvent)
