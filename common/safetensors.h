/* safetensors.h: reading a Hugging Face checkpoint's tensors.
 *
 * A checkpoint is DIR/model.safetensors, or the files listed in
 * DIR/model.safetensors.index.json ("weight_map": tensor -> file).  Every
 * header is validated before any use: its length against the file, the JSON,
 * each tensor's dtype (F32, F16, BF16), shape and [begin, end) offsets inside
 * the data area, and that the byte count equals the shape's.  Tensor data is
 * read with pread into the caller's buffers, converted to f32, one slice at a
 * time: a worker holds only the rows or columns of its tensor-parallel slice,
 * and the page cache is not charged to its resident memory. */
#ifndef TSR_SAFETENSORS_H
#define TSR_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"   /* files hold F32, F16 or BF16 */

#define TSR_ST_MAX_DIMS 4
#define TSR_ST_MAX_HEADER (100u * 1024u * 1024u)  /* 100 MiB of JSON at most */
#define TSR_ST_INDEX_MAX_BYTES (16u * 1024u * 1024u)  /* model.safetensors.index.json */

typedef struct {
    char *name;
    tsr_dtype_t dtype;
    int ndim;
    int64_t shape[TSR_ST_MAX_DIMS];
    uint64_t offset;             /* absolute offset of the first byte in its file */
    uint64_t nbytes;
    int file;                    /* index into the checkpoint's files */
} tsr_tensor_t;

/* Parses one file's header.  buf holds the first bytes of the file (at least
 * 8 + header length when available), file_size is the whole file's size,
 * and fname is used in messages.  A pure function of bytes to struct, so it
 * can be fuzzed.  On success returns 0 and *out / *n_out (caller frees with
 * tsr_tensors_free); on failure -1 and a message naming the file and, where
 * there is one, the tensor: "model.safetensors: tensor
 * model.layers.0.mlp.up_proj.weight: data [1024, 99999999) is outside the
 * data area of 4096 bytes". */
int tsr_st_parse_header(const uint8_t *buf, size_t len, uint64_t file_size, const char *fname,
                        tsr_tensor_t **out, size_t *n_out, char *err, size_t errlen);
void tsr_tensors_free(tsr_tensor_t *t, size_t n);

typedef struct tsr_st tsr_st_t;

/* Opens the checkpoint in dir (single file or index).  Caller owns the
 * result (tsr_st_close). */
int tsr_st_open(const char *dir, tsr_st_t **out, char *err, size_t errlen);
void tsr_st_close(tsr_st_t **self_p);

/* The tensor with that name, or NULL. */
const tsr_tensor_t *tsr_st_find(const tsr_st_t *st, const char *name);

/* Checks that tensor `name` exists with exactly the given shape (ndim
 * entries).  Returns 0, or -1 with "DIR: tensor NAME: missing" or "...: shape
 * [a, b] does not match the config's [c, d]". */
int tsr_st_expect(const tsr_st_t *st, const char *name, int ndim, const int64_t *shape,
                  char *err, size_t errlen);

/* Reads rows [r0, r1) and columns [c0, c1) of a 2-D tensor (a 1-D tensor is
 * one row) as f32 into dst, row-major, (r1-r0)*(c1-c0) floats.  Returns 0 or
 * -1 with a message (I/O error, short read, range outside the shape). */
int tsr_st_read_f32(const tsr_st_t *st, const tsr_tensor_t *t, int64_t r0, int64_t r1,
                    int64_t c0, int64_t c1, float *dst, char *err, size_t errlen);

/* The same slice in the file's own dtype (tsr_dtype_size(t->dtype) bytes
 * an element, little-endian), unconverted: (r1-r0)*(c1-c0) elements into
 * dst.  What an engine that converts on its device reads. */
int tsr_st_read_raw(const tsr_st_t *st, const tsr_tensor_t *t, int64_t r0, int64_t r1,
                    int64_t c0, int64_t c1, void *dst, char *err, size_t errlen);

/* Whether the reads above refuse a NaN or infinite element, naming it (true).  Only a
 * test that makes a NaN weight on purpose turns it off. */
extern bool tsr_st_refuse_nonfinite;

/* dtype conversions (exposed for tests and the model writer). */
float tsr_bf16_to_f32(uint16_t h);
uint16_t tsr_f32_to_bf16(float f);   /* round to nearest even */
float tsr_f16_to_f32(uint16_t h);
uint16_t tsr_f32_to_f16(float f);

#endif
