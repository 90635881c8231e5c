// The CUDA path of dropout (dropout.h): one grid-stride pass, each thread taking a run of kVec
// adjacent elements (one 16-byte load per operand where aligned), dropout_impl.h's formula per
// element, so the bits equal the CPU reference's.
#include <cuda_runtime.h>

#include "common/cuda_utils.cuh"
#include "dropout/dropout_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "dropout";
constexpr int kThreads = 256;

// `vector`: every pointer 16-byte aligned and n a multiple of the run, so runs are loaded and
// stored whole.
template <te_dtype D, bool vector>
__global__ void __launch_bounds__(kThreads) dropout_kernel(DropoutArgs a) {
  using T = typename Hp<D>::Storage;
  constexpr int kVec = 16 / sizeof(T);
  struct alignas(16) Run {
    T v[kVec];
  };
  const uint64_t key = mix64(static_cast<uint64_t>(a.rng[0])), offset = static_cast<uint64_t>(a.rng[1]);
  const float scale = 1.0f / (1.0f - a.p);
  const bool has_residual = a.residual != nullptr;
  const T *x = static_cast<const T *>(a.x), *r = static_cast<const T *>(a.residual);
  T *out = static_cast<T *>(a.out);
  const int64_t runs = div_up(a.n, kVec);
  for (int64_t run = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; run < runs;
       run += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e0 = run * kVec;
    Run xv{}, rv{}, ov{};
    if (vector) {
      xv = reinterpret_cast<const Run *>(x)[run];
      if (has_residual) rv = reinterpret_cast<const Run *>(r)[run];
    } else {
      for (int i = 0; i < kVec && e0 + i < a.n; ++i) {
        xv.v[i] = x[e0 + i];
        if (has_residual) rv.v[i] = r[e0 + i];
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float factor = dropout_factor(key, offset, e0 + i, a.p, scale);
      const float res = has_residual ? Hp<D>::decode(rv.v[i]) : 0.0f;
      ov.v[i] = Hp<D>::encode(dropout_value(Hp<D>::decode(xv.v[i]), factor, has_residual, res));
    }
    if (vector) {
      reinterpret_cast<Run *>(out)[run] = ov;
    } else {
      for (int i = 0; i < kVec && e0 + i < a.n; ++i) out[e0 + i] = ov.v[i];
    }
  }
}

}  // namespace

te_status dropout_cuda(const DropoutArgs &a, te_stream stream) {
  int sms = 0;
  if (te_status s = sm_count(kOp, &sms)) return s;
  return with_hp_dtype(a.dtype, [&](auto tag) {
    constexpr te_dtype D = decltype(tag)::value;
    constexpr int64_t kVec = 16 / sizeof(typename Hp<D>::Storage);
    const int64_t blocks = div_up(div_up(a.n, kVec), kThreads);
    const int grid = static_cast<int>(std::min<int64_t>(blocks, int64_t(sms) * 8));
    const bool vector = a.n % kVec == 0 && aligned(a.x, 16) && aligned(a.out, 16) &&
                        (a.residual == nullptr || aligned(a.residual, 16));
    cudaStream_t st = cuda_stream(stream);
    if (vector) {
      dropout_kernel<D, true><<<grid, kThreads, 0, st>>>(a);
    } else {
      dropout_kernel<D, false><<<grid, kThreads, 0, st>>>(a);
    }
    return launch_status(kOp);
  });
}

}  // namespace te
