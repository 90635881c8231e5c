// The cuDNN library, opened at run time. libtransformer_engine has no link-time dependency on
// cuDNN: it loads, and serves every other op, on machines without it, and the fused-attention
// backend reports "cuDNN not found" through its *_support calls instead.
//
// Which libcudnn.so.9 is used: one that the process has already loaded (PyTorch and JAX load
// theirs, typically the Python environment's nvidia/cudnn/lib), else the dynamic linker's search
// from this library: LD_LIBRARY_PATH, then its RUNPATH (the build adds the Python environment's
// nvidia/cudnn/lib, relative to the installed library and as found at configure time), then
// the system's cache (e.g. /usr/lib/x86_64-linux-gnu). cudnn-frontend, compiled with
// NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, resolves every cuDNN call through the same handle.
// In that mode the frontend's few CUDA runtime calls of its own (device queries, workspace
// memsets of older cuDNN versions) go to a libcudart.so.13 (or .so.12) that it opens the same
// way; the RUNPATH has the CUDA toolkit's lib directory for it. Our kernels keep the static cudart.
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_CUDNN_LIBRARY_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_CUDNN_LIBRARY_H_

#include <cudnn.h>  // types only: no symbol of it is linked

#include <cstddef>
#include <string>

namespace te {

// Opens libcudnn.so.9 on the first call (thread-safe, once per process). "" when it is loaded
// and new enough, else why not ("cuDNN could not be loaded: ...").
const std::string &cudnn_library_error();

// cudnnGetVersion() of the loaded library (e.g. 91900 for 9.19.0); 0 when none is loaded.
size_t cudnn_library_version();

// "9.19.0" for 91900.
std::string cudnn_version_string(size_t version);

// The process-wide cuDNN handle of a device, created on first use; the device must be current.
// "" on success, else the reason.
std::string cudnn_handle_for(int device, cudnnHandle_t *handle);

// cudnnSetStream; "" on success, else the reason.
std::string cudnn_set_stream(cudnnHandle_t handle, cudaStream_t stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_CUDNN_LIBRARY_H_
