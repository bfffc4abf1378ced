/* A stand-in for the CUDA driver (libcuda.so.1) on a machine with no GPU.
 *
 * PyPI's sglang-kernel is a CUDA build; its extension modules link against libcuda.so.1 and
 * cannot be imported without one, although SGLang's CPU path never calls into them. Every
 * driver entry point they resolve answers CUDA_ERROR_NO_DEVICE (100). Built by
 * .ci/install_engines for SGLang's virtualenv only; nothing else loads it. */
#define NO_DEVICE 100
#define STUB(name) int name(void) { return NO_DEVICE; }
STUB(cuInit)
STUB(cuCtxFromGreenCtx)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc)
STUB(cuDevSmResourceSplitByCount)
STUB(cuDeviceGetDevResource)
STUB(cuDeviceGetCount)
STUB(cuDriverGetVersion)
STUB(cuGetErrorString)
STUB(cuGetProcAddress_v2)
STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy)
STUB(cuGreenCtxGetDevResource)
STUB(cuPointerGetAttribute)
STUB(cuStreamCreate)
