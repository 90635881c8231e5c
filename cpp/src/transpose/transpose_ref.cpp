// CPU reference of te_transpose: element-wise copy on raw bytes.
#include <cstring>

#include "transpose/transpose_impl.h"

namespace te {

void transpose_ref(const TransposeArgs &a) {
  const char *in = static_cast<const char *>(a.input);
  char *out = static_cast<char *>(a.output);
  const size_t es = a.element_size;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) {
      memcpy(out + (c * a.rows + r) * es, in + (r * a.cols + c) * es, es);
    }
  }
}

}  // namespace te
