/* dtype.h: element types of tensors, in files and in buffers. */
#ifndef TSR_DTYPE_H
#define TSR_DTYPE_H

#include <stddef.h>

/* I8 and F8E4M3 (common/fp8.h): the weight matrices of an int8 or an FP8
 * checkpoint, each with a float "<name>_scale" (worker/engine_cpu.c). */
typedef enum {
    TSR_DT_F32 = 0, TSR_DT_F16 = 1, TSR_DT_BF16 = 2, TSR_DT_I32 = 3, TSR_DT_I8 = 4, TSR_DT_F8E4M3 = 5
} tsr_dtype_t;

/* Bytes per element of a dtype. */
size_t tsr_dtype_size(tsr_dtype_t t);
/* "F32", "F16", "BF16", "I32", "I8", "F8_E4M3". */
const char *tsr_dtype_name(tsr_dtype_t t);

#endif
