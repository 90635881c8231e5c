// A tiny test harness for the C API tests: CHECK records a failure and goes on, main() returns
// nonzero if any check failed, so ctest reports it.
#ifndef TRANSFORMER_ENGINE_TESTS_TEST_UTIL_H_
#define TRANSFORMER_ENGINE_TESTS_TEST_UTIL_H_

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "transformer_engine/transformer_engine.h"

namespace te_test {

inline int &failures() {
  static int n = 0;
  return n;
}

inline std::vector<std::pair<const char *, std::function<void()>>> &registry() {
  static std::vector<std::pair<const char *, std::function<void()>>> r;
  return r;
}

struct Register {
  Register(const char *name, std::function<void()> fn) { registry().emplace_back(name, fn); }
};

#define TEST_CASE(name)                                   \
  static void name();                                     \
  static te_test::Register name##_registered(#name, name); \
  static void name()

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++te_test::failures();                                                 \
    }                                                                        \
  } while (0)

// The call failed with this status and a message containing every fragment.
#define CHECK_ERROR(call, status, ...)                                                    \
  do {                                                                                    \
    te_status s_ = (call);                                                                \
    CHECK(s_ == (status));                                                                \
    for (const char *frag : {__VA_ARGS__}) {                                              \
      if (std::strstr(te_last_error(), frag) == nullptr) {                                \
        std::fprintf(stderr, "%s:%d: message '%s' lacks '%s'\n", __FILE__, __LINE__,      \
                     te_last_error(), frag);                                              \
        ++te_test::failures();                                                            \
      }                                                                                   \
    }                                                                                     \
  } while (0)

inline te_buffer cpu_buffer(void *data, te_dtype dtype, std::vector<int64_t> shape) {
  te_buffer b{};
  b.data = data;
  b.dtype = dtype;
  b.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) b.shape[i] = shape[i];
  b.device = TE_DEVICE_CPU;
  return b;
}

// Owns a handle for the duration of a test.
struct TensorHandle {
  te_tensor *t = nullptr;
  explicit TensorHandle(te_scaling_mode mode = TE_SCALING_TENSOR) { te_tensor_create(mode, &t); }
  ~TensorHandle() { te_tensor_destroy(t); }
  TensorHandle(const TensorHandle &) = delete;
  TensorHandle &operator=(const TensorHandle &) = delete;
  void set(te_tensor_slot slot, void *data, te_dtype dtype, std::vector<int64_t> shape) {
    te_buffer b = cpu_buffer(data, dtype, shape);
    te_tensor_set(t, slot, &b);
  }
  operator te_tensor *() const { return t; }
};

inline int run_all() {
  for (auto &[name, fn] : registry()) {
    const int before = failures();
    fn();
    std::printf("%s %s\n", failures() == before ? "PASS" : "FAIL", name);
  }
  std::printf("%d checks failed\n", failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace te_test

#endif  // TRANSFORMER_ENGINE_TESTS_TEST_UTIL_H_
