/* buffers.h: every device buffer a CUDA piece allocates, and its size.
 *
 * Host arithmetic only, which plain C and a machine without a GPU can run:
 * the CUDA engine (engine_cuda.cu) allocates what this list says and
 * nothing else, besides two 32 MiB staging buffers while it loads (freed
 * before the activations are allocated); tests/cuda/test_buffers.cu holds
 * the list's sums against common/budget.c, the planner's model of a cuda
 * piece, so that the two cannot drift apart. */
#ifndef TSR_CUDA_BUFFERS_H
#define TSR_CUDA_BUFFERS_H

#include <stddef.h>
#include <stdint.h>
#include "common/modelcfg.h"
#include "worker/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a step's kernels read, uploaded in one copy: fixed-size arrays, then
 * the entries' block tables, ragged, sized per step. */
typedef struct {
    int32_t *tokens;         /* [T] stage 0 */
    int32_t *row_pos;        /* [T] -1: a padding row */
    int32_t *row_tbl;        /* [T] offset of the row's block table in tables */
    int32_t *tile_row0;      /* [tiles] first row of each attention tile */
    int32_t *tile_n;         /* [tiles] rows in it (0: padding) */
    int32_t *tile_pos0;      /* [tiles] position of its first row */
    int32_t *tile_tbl;       /* [tiles] offset of its block table */
    int32_t *samp_row;       /* [S] the row each sampled entry is picked after */
    float *samp_temp, *samp_top_p;
    unsigned long long *samp_seed, *samp_pos;
    int32_t *tables;         /* ragged block tables */
} tsr_cuda_meta_t;

/* The buffers.  The engine allocates cuBLAS's workspace first (cuda_load),
 * then the weights (load_weights), then the rest in the order listed
 * (alloc_all). */
typedef enum {
    /* weights (load_weights): the piece's, then one of each per layer */
    TSR_CB_EMBED, TSR_CB_FINAL_NORM, TSR_CB_LM_HEAD,
    TSR_CB_ATTN_NORM, TSR_CB_MLP_NORM, TSR_CB_WQKV, TSR_CB_WO, TSR_CB_WGU, TSR_CB_WD,
    /* the KV pool, the RoPE tables, the step's activations, then (last
     * stage) logits and sampling */
    TSR_CB_KPOOL, TSR_CB_VPOOL, TSR_CB_ROPE_COS, TSR_CB_ROPE_SIN,
    TSR_CB_X, TSR_CB_PROJ, TSR_CB_HIN, TSR_CB_HOUT, TSR_CB_QKV, TSR_CB_GU, TSR_CB_H,
    TSR_CB_ATT, TSR_CB_ACT,
    TSR_CB_LOGITS, TSR_CB_GATHERED, TSR_CB_W, TSR_CB_W_SORTED, TSR_CB_IDS, TSR_CB_IDS_SORTED,
    TSR_CB_SEG_BEGIN, TSR_CB_SEG_END, TSR_CB_BEST, TSR_CB_SAMPLED, TSR_CB_WSUM,
    /* the sort's scratch: cub says how much on the device; listed here as
     * its two alternate buffers (keys and values), 8 bytes a logit, and cub's
     * few KB of bookkeeping fall on the context's share */
    TSR_CB_SORT_TMP,
    TSR_CB_META,           /* the step metadata (tsr_cuda_meta_layout) */
    TSR_CB_WORKSPACE,      /* cuBLAS's (cuda_load) */
    TSR_CB_COUNT
} tsr_cuda_buf_id_t;

/* Which part of common/budget.c's model (tsr_piece_memory) a buffer is
 * priced in: the weights, the KV pool, the reserve, or the share of
 * TSR_CUDA_CONTEXT_BYTES that is the engine's own small buffers. */
typedef enum { TSR_CB_WEIGHTS, TSR_CB_KV, TSR_CB_RESERVE, TSR_CB_CONTEXT } tsr_cuda_part_t;

typedef struct {
    const char *what;          /* for "out of device memory for the KV pool" */
    tsr_cuda_part_t part;
    int count;                 /* how many: the layer count for a layer's, else 0 or 1 */
    size_t bytes;              /* each */
} tsr_cuda_buf_t;

typedef struct {
    tsr_cuda_buf_t buf[TSR_CB_COUNT];
    int max_tiles;             /* attention tiles of the largest step */
    int max_blocks_per_seq;    /* a block table's length */
    size_t meta_fixed;         /* the metadata's fixed arrays; the block tables follow */
} tsr_cuda_plan_t;

/* The buffers piece `spec` of model m allocates, into *out.  0, or -1 when
 * spec's tp_size does not divide the model (tsr_model_check_piece says
 * why). */
int tsr_cuda_plan(const tsr_model_info_t *m, const tsr_piece_spec_t *spec, tsr_cuda_plan_t *out);

/* Bytes of the buffers of `part` in plan p (count x bytes, summed); part
 * -1: of every buffer. */
uint64_t tsr_cuda_plan_bytes(const tsr_cuda_plan_t *p, int part);

/* Lays the step metadata of steps of max_tokens rows and max_seqs entries
 * out from base into *m (base NULL: only measures it): the fixed arrays,
 * each on 16 bytes, then the block tables.  Returns the buffer's bytes;
 * *fixed gets the fixed arrays' (may be NULL). */
size_t tsr_cuda_meta_layout(char *base, int max_tokens, int max_seqs, int max_tiles,
                            int max_blocks_per_seq, tsr_cuda_meta_t *m, size_t *fixed);

#ifdef __cplusplus
}
#endif

#endif
