// Resolved arguments of te_transpose.
#ifndef TRANSFORMER_ENGINE_SRC_TRANSPOSE_TRANSPOSE_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_TRANSPOSE_TRANSPOSE_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "transformer_engine/transpose.h"

namespace te {

struct TransposeArgs {
  const void *input;  // [rows, cols]
  void *output;       // [cols, rows]
  int64_t rows, cols;
  size_t element_size;  // 1, 2, 4 or 8 bytes
};

void transpose_ref(const TransposeArgs &args);
// CUDA launcher (in a CPU-only build it reports that the build has no CUDA kernels).
te_status transpose_cuda(const TransposeArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_TRANSPOSE_TRANSPOSE_IMPL_H_
