/* dtype.h: element types of tensors, in files and in buffers. */
#ifndef TSR_DTYPE_H
#define TSR_DTYPE_H

#include <stddef.h>

/* I8: the weight matrices of an int8 checkpoint (each with a float
 * "<name>_scale" of one scale a row, worker/engine_cpu.c). */
typedef enum { TSR_DT_F32 = 0, TSR_DT_F16 = 1, TSR_DT_BF16 = 2, TSR_DT_I32 = 3, TSR_DT_I8 = 4 } tsr_dtype_t;

/* Bytes per element of a dtype. */
size_t tsr_dtype_size(tsr_dtype_t t);
/* "F32", "F16", "BF16", "I32", "I8". */
const char *tsr_dtype_name(tsr_dtype_t t);

#endif
