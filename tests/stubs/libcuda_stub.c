/*
 * TEST-ONLY stand-in for the CUDA driver (libcuda.so.1). Never shipped.
 *
 * kvikio dlopen()s libcuda.so.1 and resolves its driver entry points on the
 * first read or write, even when the buffer is host memory. On CPU-only CI
 * machines there is no driver, so kvikio would refuse every I/O. This stub
 * exports exactly the symbols kvikio 26.10 requires at load, and answers
 * CUDA_ERROR_NOT_INITIALIZED (3) to almost everything: kvikio then classifies
 * every buffer as host memory and takes its POSIX (compat-mode) path, which
 * is real file I/O we can test byte for byte.
 *
 * Symbol names carry the _v2 suffixes that cuda.h maps the API names to,
 * because kvikio stringifies the names through cuda.h's macros.
 *
 * Set KVTIER_CUDA_STUB_TRACE=1 to log each call on stderr, so a test can
 * prove that this stub (and not some real driver) served kvikio.
 *
 * Built with -DKVTIER_STUB_BROKEN_DRIVER it instead mimics the CUDA toolkit's
 * link-time stub libcuda (every call, cuDriverGetVersion included, answers
 * CUDA_ERROR_STUB_LIBRARY), which kvtier must reject without hanging.
 */
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_STUB_LIBRARY 34

#define EXPORT __attribute__((visibility("default")))

static void trace(const char *name)
{
    if (getenv("KVTIER_CUDA_STUB_TRACE") != NULL) {
        fprintf(stderr, "kvtier-cuda-stub: %s\n", name);
    }
}

/*
 * Must succeed: kvikio's cudaAPI constructor checks this call, and its error
 * path re-enters the half-built cudaAPI singleton, which deadlocks on the
 * static-initialisation guard (observed with 26.10). 12000 (CUDA 12.0) is
 * below 12.8, so kvikio treats cuMemcpyBatchAsync as optional and the stub
 * need not export it.
 */
EXPORT CUresult cuDriverGetVersion(int *version)
{
    trace("cuDriverGetVersion");
    if (version == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
#ifdef KVTIER_STUB_BROKEN_DRIVER
    *version = 0;
    return CUDA_ERROR_STUB_LIBRARY;
#endif
    *version = 12000;
    return CUDA_SUCCESS;
}

/* Succeed with a real string so any error message kvikio formats is sane. */
EXPORT CUresult cuGetErrorName(CUresult error, const char **str)
{
    trace("cuGetErrorName");
    if (str == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *str = error == CUDA_ERROR_NOT_INITIALIZED ? "CUDA_ERROR_NOT_INITIALIZED"
                                               : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **str)
{
    trace("cuGetErrorString");
    if (str == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *str = error == CUDA_ERROR_NOT_INITIALIZED
               ? "initialization error (kvtier test stub: no CUDA driver)"
               : "unknown error (kvtier test stub)";
    return CUDA_SUCCESS;
}

/*
 * Everything else: "not initialized". Signatures are irrelevant to the C ABI
 * here because the stub never reads its arguments and returns in a register.
 */
#define NOT_INITIALIZED(sym)        \
    EXPORT CUresult sym(void)       \
    {                               \
        trace(#sym);                \
        return CUDA_ERROR_NOT_INITIALIZED; \
    }

/* Not resolved by kvikio 26.10; kept because every driver client's first
 * call is cuInit, so other kvikio/cuFile versions may look it up. */
NOT_INITIALIZED(cuInit)

/* Resolved by kvikio 26.10's cudaAPI constructor (all mandatory). */
NOT_INITIALIZED(cuMemHostAlloc)
NOT_INITIALIZED(cuMemFreeHost)
NOT_INITIALIZED(cuMemHostRegister_v2)
NOT_INITIALIZED(cuMemHostUnregister)
NOT_INITIALIZED(cuMemcpyHtoDAsync_v2)
NOT_INITIALIZED(cuMemcpyDtoHAsync_v2)
NOT_INITIALIZED(cuMemcpyAsync)
/* kvikio treats NOT_INITIALIZED from these as "host memory". */
NOT_INITIALIZED(cuPointerGetAttribute)
NOT_INITIALIZED(cuPointerGetAttributes)
NOT_INITIALIZED(cuCtxCreate_v2)
NOT_INITIALIZED(cuCtxDestroy_v2)
NOT_INITIALIZED(cuCtxPushCurrent_v2)
NOT_INITIALIZED(cuCtxPopCurrent_v2)
NOT_INITIALIZED(cuCtxGetCurrent)
NOT_INITIALIZED(cuCtxGetDevice)
NOT_INITIALIZED(cuMemGetAddressRange_v2)
NOT_INITIALIZED(cuDeviceGet)
NOT_INITIALIZED(cuDeviceGetCount)
NOT_INITIALIZED(cuDeviceGetAttribute)
NOT_INITIALIZED(cuDevicePrimaryCtxRetain)
NOT_INITIALIZED(cuDevicePrimaryCtxRelease_v2)
NOT_INITIALIZED(cuStreamSynchronize)
NOT_INITIALIZED(cuStreamCreate)
NOT_INITIALIZED(cuStreamDestroy_v2)
NOT_INITIALIZED(cuEventSynchronize)
NOT_INITIALIZED(cuEventCreate)
NOT_INITIALIZED(cuEventDestroy_v2)
NOT_INITIALIZED(cuEventRecord)
NOT_INITIALIZED(cuEventQuery)
NOT_INITIALIZED(cuLaunchHostFunc)
