/* Transformer Engine core: the tensor handle, data types, status codes.
 *
 * A te_tensor is an opaque, non-owning description of one logical tensor and the buffers
 * that travel with it: its data (row-wise, and optionally the transposed "column-wise"
 * copy), its scaling factors and its amax. The caller owns every buffer; the handle only
 * points at them. Every function returns a te_status; on failure te_last_error() gives a
 * thread-local message of the form "<op>: <argument> must be <expected>, got <actual>", and
 * no output buffer has been written.
 */
#ifndef TRANSFORMER_ENGINE_TENSOR_H_
#define TRANSFORMER_ENGINE_TENSOR_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Maximum rank of a buffer. */
#define TE_MAX_DIMS 8

typedef enum {
  TE_SUCCESS = 0,
  TE_ERROR_TYPE = 1,        /* wrong dtype or kind of buffer (Python: TypeError) */
  TE_ERROR_VALUE = 2,       /* wrong shape, size, mode or value (Python: ValueError) */
  TE_ERROR_UNSUPPORTED = 3, /* valid request this build or device cannot run (RuntimeError) */
  TE_ERROR_RUNTIME = 4,     /* CUDA or allocation failure (RuntimeError) */
} te_status;

typedef enum {
  TE_DTYPE_FLOAT32 = 0,
  TE_DTYPE_FLOAT16 = 1,
  TE_DTYPE_BFLOAT16 = 2,
  TE_DTYPE_FLOAT8_E4M3 = 3, /* "fn" variant: no infinities, max 448, NaN = S.1111.111 */
  TE_DTYPE_FLOAT8_E5M2 = 4, /* IEEE-like: max 57344 */
  TE_DTYPE_FLOAT8_E8M0 = 5, /* unsigned power-of-two scale 2^(e-127), 0xFF = NaN (MXFP8) */
  TE_DTYPE_INT8 = 6,
  TE_DTYPE_UINT8 = 7,
  TE_DTYPE_INT16 = 8,
  TE_DTYPE_INT32 = 9,
  TE_DTYPE_INT64 = 10,
  TE_DTYPE_COUNT = 11
} te_dtype;

typedef enum {
  TE_DEVICE_CPU = 0,
  TE_DEVICE_CUDA = 1,
} te_device_type;

/* How the FP8 data of a tensor is scaled. Scale-inverse buffers per mode, for data viewed
 * as a matrix [M, K] (M = product of all dimensions but the last, K = the last):
 *   TENSOR:        scale [1], scale_inv [1] fp32, shared by row-wise and column-wise data.
 *   BLOCK_1X128:   row-wise scale_inv [M, ceil(K/128)] fp32, one per 1x128 run of a row;
 *                  column-wise data is the transpose [K, M] with scale_inv [K, ceil(M/128)].
 *   BLOCK_128X128: row-wise scale_inv [ceil(M/128), ceil(K/128)] fp32, one per 128x128 tile;
 *                  column-wise data is the transpose [K, M] with scale_inv [ceil(K/128), ceil(M/128)].
 *   MXFP8:         row-wise scale_inv [M, ceil(K/32)] E8M0, one per 1x32 run of a row;
 *                  column-wise data keeps the layout [M, K] with blocks of 32 down each
 *                  column and scale_inv [ceil(M/32), K] E8M0 (Blackwell GEMMs read either). */
typedef enum {
  TE_SCALING_TENSOR = 0,
  TE_SCALING_BLOCK_1X128 = 1,
  TE_SCALING_BLOCK_128X128 = 2,
  TE_SCALING_MXFP8 = 3,
} te_scaling_mode;

/* The buffers a tensor handle can point at. */
typedef enum {
  TE_SLOT_DATA = 0,               /* row-wise data; the only slot of a plain tensor */
  TE_SLOT_COLUMNWISE_DATA = 1,    /* transposed (or column-blocked, MXFP8) FP8 data */
  TE_SLOT_SCALE = 2,              /* per-tensor scale [1] fp32 (TENSOR mode) */
  TE_SLOT_SCALE_INV = 3,          /* row-wise scale_inv (shape by mode, see above) */
  TE_SLOT_COLUMNWISE_SCALE_INV = 4,
  TE_SLOT_AMAX = 5,               /* amax [1] fp32 of the high-precision values */
  TE_SLOT_GATE = 6,               /* [1] fp32: the op runs only while it holds 0 (below) */
  TE_SLOT_COUNT = 7
} te_tensor_slot;

/* The gate. Delayed scaling scales a tensor whose amax history is still empty (a first step)
 * from the tensor's own amax, which must then be known before the cast. A caller that cannot
 * know on the host whether the history is empty (a compiled graph) runs the amax-producing op
 * once more before the real one, with the history's max as the gate of the tensor carrying
 * AMAX: te_compute_amax's output, te_norm_forward's output_fp8, te_activation_forward's output,
 * te_activation_backward's grad_input. When the gate holds a nonzero value the op writes AMAX = 0
 * and nothing else (on CUDA every block returns at once), so it costs one launch; when it holds
 * 0 the op runs as usual. A gated call needs AMAX, no accumulation, and no transpose or dbias. */

/* One dense, row-major (C-contiguous) buffer. data may be NULL only when it has no element. */
typedef struct {
  void *data;
  te_dtype dtype;
  int32_t ndim;
  int64_t shape[TE_MAX_DIMS];
  te_device_type device;
  int32_t device_id;
} te_buffer;

/* A CUDA stream (binary compatible with cudaStream_t); NULL is the legacy default stream.
 * Ignored for CPU tensors. */
typedef struct CUstream_st *te_stream;

typedef struct te_tensor_s te_tensor;

/* Creates an empty handle with the given scaling mode. [out] *tensor. */
te_status te_tensor_create(te_scaling_mode scaling_mode, te_tensor **tensor);

/* Destroys a handle (never the buffers it points at). NULL is a no-op. */
void te_tensor_destroy(te_tensor *tensor);

/* Points a slot of [in,out] tensor at [in] buffer (copied into the handle); a NULL buffer
 * clears the slot. Checks the buffer itself (rank, dtype, non-negative shape); how the slots
 * fit together is checked by each op. */
te_status te_tensor_set(te_tensor *tensor, te_tensor_slot slot, const te_buffer *buffer);

/* [out] *buffer: what [in] tensor's slot points at; returns TE_ERROR_VALUE if it is empty. */
te_status te_tensor_get(const te_tensor *tensor, te_tensor_slot slot, te_buffer *buffer);

/* [out] the scaling mode of [in] tensor. */
te_scaling_mode te_tensor_scaling_mode(const te_tensor *tensor);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char *te_last_error(void);

/* Name of a dtype ("float32", "float8_e4m3", ...), "invalid" when out of range. */
const char *te_dtype_name(te_dtype dtype);

/* Size of one element in bytes, 0 when out of range. */
size_t te_dtype_size(te_dtype dtype);

/* 1 when the library was compiled with its CUDA kernels, else 0. */
int te_built_with_cuda(void);

/* Version of the core as "MAJOR.MINOR.PATCH". */
const char *te_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_TENSOR_H_ */
