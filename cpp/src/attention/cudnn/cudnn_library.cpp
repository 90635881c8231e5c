// Opening libcudnn.so.9 and the per-device handles (see cudnn_library.h).
#include "attention/cudnn/cudnn_library.h"

#include <dlfcn.h>

#include <mutex>

namespace cudnn_frontend {
// cudnn-frontend's dynamic-loading mode looks every cuDNN symbol up in this handle; it must be
// set before the first frontend call, which is why every entry point asks cudnn_library_error()
// first. Hidden (the file is compiled with hidden visibility), so that another copy of the
// frontend in the process (PyTorch's, say) can never bind to ours or we to theirs.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace te {
namespace {

constexpr const char *kSoname = "libcudnn.so.9";
// The graph API's SDPA nodes with FP8 and ragged offsets; newer features are checked by the
// frontend against the loaded version when a graph is built.
constexpr size_t kMinVersion = 90100;

struct Library {
  void *handle = nullptr;
  std::string error;
  size_t version = 0;
  cudnnStatus_t (*create)(cudnnHandle_t *) = nullptr;
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t) = nullptr;
  const char *(*error_string)(cudnnStatus_t) = nullptr;
};

template <typename Fn>
bool resolve(void *handle, const char *name, Fn *fn, std::string *error) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*fn == nullptr) *error = std::string("cuDNN library lacks ") + name;
  return *fn != nullptr;
}

Library open_library() {
  Library lib;
  dlerror();
  // A copy that the process has already loaded first: two cuDNN copies in one process work,
  // but waste memory and may differ in version from what the framework reports.
  void *handle = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == nullptr) handle = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char *why = dlerror();
    lib.error = std::string("cuDNN could not be loaded (") + kSoname + "): " + (why != nullptr ? why : "not found");
    return lib;
  }
  size_t (*get_version)() = nullptr;
  if (!resolve(handle, "cudnnGetVersion", &get_version, &lib.error) ||
      !resolve(handle, "cudnnCreate", &lib.create, &lib.error) ||
      !resolve(handle, "cudnnSetStream", &lib.set_stream, &lib.error) ||
      !resolve(handle, "cudnnGetErrorString", &lib.error_string, &lib.error)) {
    return lib;
  }
  lib.version = get_version();
  if (lib.version < kMinVersion) {
    lib.error = "cuDNN " + cudnn_version_string(lib.version) + " is older than " +
                cudnn_version_string(kMinVersion) + ", the oldest the fused attention backend accepts";
    return lib;
  }
  lib.handle = handle;
  cudnn_frontend::cudnn_dlhandle = handle;
  return lib;
}

const Library &library() {
  static const Library lib = open_library();
  return lib;
}

std::string status_text(cudnnStatus_t status) {
  const char *text = library().error_string != nullptr ? library().error_string(status) : nullptr;
  return text != nullptr ? text : "status " + std::to_string(static_cast<int>(status));
}

}  // namespace

const std::string &cudnn_library_error() { return library().error; }

size_t cudnn_library_version() { return library().handle != nullptr ? library().version : 0; }

std::string cudnn_version_string(size_t version) {
  // cuDNN 9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

std::string cudnn_handle_for(int device, cudnnHandle_t *handle) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static cudnnHandle_t handles[kMaxDevices] = {};
  if (!cudnn_library_error().empty()) return cudnn_library_error();
  if (device < 0 || device >= kMaxDevices) return "device index must be below 64, got " + std::to_string(device);
  std::lock_guard<std::mutex> lock(mutex);
  if (handles[device] == nullptr) {
    // Kept for the process: destroying handles at exit races with the CUDA runtime's teardown.
    const cudnnStatus_t status = library().create(&handles[device]);
    if (status != CUDNN_STATUS_SUCCESS) {
      handles[device] = nullptr;
      return "cudnnCreate failed: " + status_text(status);
    }
  }
  *handle = handles[device];
  return "";
}

std::string cudnn_set_stream(cudnnHandle_t handle, cudaStream_t stream) {
  const cudnnStatus_t status = library().set_stream(handle, stream);
  return status == CUDNN_STATUS_SUCCESS ? "" : "cudnnSetStream failed: " + status_text(status);
}

}  // namespace te
