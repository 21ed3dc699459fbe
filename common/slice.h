/* slice.h: which part of each tensor a piece holds.
 *
 * One answer to "which rows and columns of tensor T does (tp rank, stage)
 * hold", used by the planner's memory figures, every engine's loader and the
 * tests.  Megatron sharding: q, k, v, gate and up are split by output rows,
 * o and down by input columns; the embedding and the LM head by vocabulary
 * rows, in equal chunks of ceil(vocab / tp) (the last rank's chunk may be
 * short or empty), so every rank's logits have the same width for an
 * all-gather.  Norms are whole on every rank. */
#ifndef TSR_SLICE_H
#define TSR_SLICE_H

#include <stdbool.h>
#include <stdint.h>
#include "common/modelcfg.h"

typedef enum {
    TSR_T_EMBED = 0, TSR_T_LM_HEAD, TSR_T_FINAL_NORM,
    TSR_T_ATTN_NORM, TSR_T_MLP_NORM,
    TSR_T_Q, TSR_T_K, TSR_T_V, TSR_T_O,
    TSR_T_GATE, TSR_T_UP, TSR_T_DOWN,
    TSR_T_COUNT
} tsr_tensor_kind_t;

typedef struct {
    int64_t rows, cols;         /* the full tensor; cols 0 for a vector */
    int64_t r0, r1, c0, c1;     /* held: rows [r0, r1) x cols [c0, c1) (vectors: r0..r1) */
} tsr_slice_t;

/* The Hugging Face name of tensor t (layer for per-layer tensors); the LM
 * head is the embedding when the model ties them.  Writes into buf. */
const char *tsr_tensor_name(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, char *buf,
                            size_t len);

/* Fills *out with tp rank r's part of t.  Returns 0, or -1 when the layout
 * does not divide the model (tsr_model_check_piece says why). */
int tsr_slice_of(const tsr_model_info_t *m, tsr_tensor_kind_t t, int tp_rank, int tp_size,
                 tsr_slice_t *out);

/* tsr_tensor_name and tsr_slice_of together, for an engine about to read
 * its slice: the name into name[len], the slice into *out.  Returns 0, or
 * -1 with err naming the tensor when tp_size does not divide it. */
int tsr_slice_named(const tsr_model_info_t *m, tsr_tensor_kind_t t, int layer, int tp_rank,
                    int tp_size, char *name, size_t len, tsr_slice_t *out, char *err,
                    size_t errlen);

/* Whether stage `stage` of pp_size holds t at all (per-layer tensors: only
 * for its layers, which the caller iterates). */
bool tsr_stage_holds(tsr_tensor_kind_t t, int stage, int pp_size);

/* Vocabulary rows [*begin, *end) of tp rank r; *chunk is every rank's
 * padded width, ceil(vocab / tp). */
void tsr_vocab_range(const tsr_model_info_t *m, int tp_rank, int tp_size, int *begin, int *end,
                     int *chunk);

/* Elements of t held by (tp_rank of tp_size): (r1 - r0) * (c1 - c0). */
int64_t tsr_slice_elems(const tsr_slice_t *s);

#endif
