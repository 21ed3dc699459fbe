/* engine.h: what executes a piece of the model.
 *
 * A table of functions, like the collectives, so the CPU engine (Tessera's
 * kernels on a thread pool) and the CUDA engine (cuBLAS and Tessera's
 * kernels) are interchangeable; the executor picks one by the piece's
 * device kind (tsr_backend_for) and cannot tell which it has.
 *
 * An engine holds the weights of one piece (a stage's layers, one
 * tensor-parallel slice) and a KV cache that is a pool of fixed-size blocks
 * (worker/kvpool.h).  One step runs a *batch*: entries of (sequence slot,
 * start position, token count), decodes and prompt chunks mixed.  The
 * hidden states entering and leaving the piece live in the engine's own
 * memory (device memory for CUDA); the executor hands those buffers to the
 * collectives and never copies them.  The last stage samples inside the
 * engine, so only token ids leave it. */
#ifndef TSR_ENGINE_H
#define TSR_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include "common/deploy.h"
#include "common/modelcfg.h"
#include "common/util.h"
#include "worker/collective.h"
#include "worker/kvpool.h"
#include "worker/kmath.h"

typedef struct {
    int tp_rank, tp_size;
    int stage, pp_size;
    int layer_begin, layer_end;     /* [begin, end) */
    int max_seq_len;
    int max_seqs;                   /* sequence slots (the deployment's max_batch) */
    int max_tokens;                 /* token rows one step may carry */
    int kv_blocks;                  /* KV pool size, in blocks of TSR_KV_BLOCK positions */
    int threads;                    /* CPU threads (0: every CPU the worker may use) */
    int device_index;               /* the GPU a CUDA engine runs on */
    int kv_dtype;                   /* tsr_kv_dtype_t (0, auto: the engine's own) */
    int matmul_dtype;               /* tsr_kv_dtype_t's values: the weights' and the
                                       products' input type (0, auto: the engine's own) */
    int weights_dtype;              /* tsr_kv_dtype_t's values: 0 (auto) as matmul_dtype
                                       says, 3 int8 with a scale per row */
    /* The sequence split (parallel.sequence): seq_size ranks (0 or 1: none)
     * run every step of the stage, each holding the KV blocks whose ids are
     * its rank modulo seq_size (kv_blocks counts all of them: it holds
     * kv_blocks / seq_size, rounded up) and attending over those; their
     * partial results are merged through the sequence communicator
     * (set_seq_comm), so every rank has every row's numbers. */
    int seq_rank, seq_size;
} tsr_piece_spec_t;

/* One entry of a batch: positions [pos, pos + n) of the sequence in slot. */
typedef struct {
    int slot, pos, n;
    int sample;                     /* last stage: pick a token after the entry's last position */
    float temperature, top_p;       /* temperature <= 0: greedy */
    uint64_t seed;                  /* the draw for position p is tsr_draw(seed, p) */
} tsr_entry_t;

typedef struct {
    const tsr_entry_t *entries;
    int n_entries;
    const int32_t *tokens;          /* host; stage 0: the ids of every entry's positions */
    int n_tokens;                   /* sum of the entries' n */
} tsr_batch_t;

typedef struct tsr_engine tsr_engine_t;

typedef struct {
    const char *name;
    tsr_device_t device;
    int kv_elem_bytes;              /* bytes of one cached element of its own type
                                       (kv_dtype auto) */
    /* Loads the piece from a Hugging Face directory: only its layers and its
     * tensor-parallel slice are read.  Caller owns *out (destroy). */
    int (*load)(const char *model_dir, const tsr_piece_spec_t *spec, tsr_engine_t **out,
                char *err, size_t errlen);
    /* Optional: loads as load does, taking from *donor (an engine of this kind, holding
     * another piece) the layers the new piece holds too with the same tensor-parallel
     * slice and weight type, read from the same model files unchanged since, instead of
     * reading them again; the rest of *donor is freed first, and all of it after
     * (*donor NULL).  *kept: the layers taken. */
    int (*load_from)(tsr_engine_t **donor, const char *model_dir, const tsr_piece_spec_t *spec,
                     tsr_engine_t **out, int *kept, char *err, size_t errlen);
    /* The stage's TP communicator (NULL when tp_size is 1), replaced after
     * the replica is rewired for a new epoch; the weights and pool stay.
     * timeout_ms: the deadline of each of its operations (the deployment's
     * collective_timeout_ms; <= 0: the engine device's default, tsr_coll_timeout_default). */
    void (*set_comm)(tsr_engine_t *e, const tsr_coll_ops_t *ops, tsr_comm_t *tp,
                     int timeout_ms);
    /* The hidden state entering (0) or leaving (1) the piece: max_tokens rows
     * of hidden_size in the engine's memory.  A step reads rows [0,
     * n_tokens) of the input (stages after the first) and writes those of
     * the output (stages before the last). */
    tsr_buf_t (*hidden)(tsr_engine_t *e, int which);
    /* Runs the batch.  Takes KV blocks for every entry's positions first
     * (fails, taking none, when the pool is short).  On the last stage,
     * tp rank 0 writes one token per sampling entry, in entry order, to
     * sampled (host). */
    int (*step)(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                size_t errlen);
    /* For tests and debugging: the full-vocabulary logits of the last step's
     * sampling entries, [rows][vocab] to host out (last stage, tp rank 0);
     * returns the rows written, at most max_rows. */
    int (*last_logits)(tsr_engine_t *e, float *out, int max_rows);
    /* Frees the KV blocks of slot (its sequence finished or was cancelled). */
    void (*release)(tsr_engine_t *e, int slot);
    /* KV pool blocks held by sequences, and its size. */
    void (*kv_usage)(const tsr_engine_t *e, int *used, int *total);
    const tsr_model_info_t *(*model)(const tsr_engine_t *e);
    uint64_t (*weight_bytes)(const tsr_engine_t *e);     /* bytes of weights held */
    uint64_t (*kv_bytes)(const tsr_engine_t *e);         /* bytes of the KV pool */
    /* Nonzero after an error that leaves the device unusable (an illegal
     * address, ECC): the worker reports it and exits to be restarted. */
    int (*fatal)(const tsr_engine_t *e);
    void (*destroy)(tsr_engine_t **e_p);
    /* The stream its work runs on, for NCCL (NULL, or no function: none). */
    void *(*stream)(const tsr_engine_t *e);
    /* Optional, for engines whose step returns before the device has run
     * it: from now on the engine adds 1 to *steps (__atomic builtins) as
     * each step finishes on the device.  Without it the replica counts a
     * step when step() returns.  The count goes out in heartbeats. */
    void (*set_progress)(tsr_engine_t *e, uint64_t *steps);
    /* Optional, for engines whose one step can take long (a big batch on a
     * CPU): from now on the engine adds 1 to *ticks (__atomic builtins) each
     * time its thread gets through a part of a step (the CPU engine: each
     * matrix product).  The worker's watchdog counts these and finished
     * steps as signs of life, so it tells a long step from a stuck thread. */
    void (*set_alive)(tsr_engine_t *e, uint64_t *ticks);
    /* The KV pool's bookkeeping (host memory), for the prefix cache: the
     * replica attaches cached blocks to a slot before a step and publishes
     * the blocks a step filled after it.  NULL, or no function: no cache. */
    tsr_kvpool_t *(*kvpool)(tsr_engine_t *e);
    /* Optional: the stage's sequence communicator (the seq_size ranks of
     * its tp rank, in seq_rank order; NULL when seq_size is 1), with
     * set_comm's ops and deadline, replaced as set_comm's is.  An engine
     * without it refuses a seq_size above 1 at load. */
    void (*set_seq_comm)(tsr_engine_t *e, tsr_comm_t *seq);
} tsr_engine_ops_t;

extern const tsr_engine_ops_t tsr_engine_cpu;

/* The engine and collectives for a piece of device kind d: the one place a
 * backend is chosen.  NULL with the reason in err when this build has none
 * ("this worker was built without CUDA"). */
typedef struct {
    const tsr_engine_ops_t *engine;
    const tsr_coll_ops_t *coll;     /* tensors between ranks */
    const tsr_coll_ops_t *fallback; /* coll's host-staged choice (tsr_coll_ctx_t.fallback) */
    /* NCCL's functions for coll (NULL, or no function: none), or NULL with
     * the reason. */
    const tsr_nccl_api_t *(*nccl)(char *why, size_t len);
} tsr_backend_t;
int tsr_backend_for(tsr_device_t d, tsr_backend_t *out, char *err, size_t errlen);
/* Tests: pieces of device kind d get b instead (NULL: back to the table). */
void tsr_backend_test_override(tsr_device_t d, const tsr_backend_t *b);

/* Bytes one position of one KV head takes (tsr_kv_row_bytes) in a cache
 * of kv_dtype on engine eng, auto being the engine's own type; 0 for a
 * kv_dtype no engine knows. */
static inline int tsr_kv_engine_row_bytes(const tsr_engine_ops_t *eng, int kv_dtype, int head_dim)
{
    return kv_dtype == TSR_KV_AUTO ? eng->kv_elem_bytes * head_dim
                                   : tsr_kv_row_bytes(kv_dtype, head_dim);
}

/* 0 when an engine that holds the types of `takes` (a bit per
 * tsr_kv_dtype_t, 1 << TSR_KV_F32 ...) for deployment key `key` (kv_dtype,
 * matmul_dtype, weights_dtype) can serve value v (auto always can); else -1 with the
 * reason: a number no worker knows (from the wire), or a type this engine
 * (`engine`, for the message) does not `what` ("keep its KV cache in"). */
static inline int tsr_elem_dtype_check(const char *key, int v, unsigned takes, const char *engine,
                                       const char *what, char *err, size_t errlen)
{
    const char *name = tsr_kv_dtype_name(v);
    if (!name) {
        tsr_set_err(err, errlen, "%s %d is not one this worker knows (0 auto, 1 f32, 2 bf16, 3 int8)", key,
                    v);
        return -1;
    }
    if (v == TSR_KV_AUTO || (takes >> v & 1u)) return 0;
    tsr_set_err(err, errlen, "%s %s: the %s engine does not %s %s", key, name, engine, what, name);
    return -1;
}

static inline int tsr_kv_dtype_check(int kv_dtype, unsigned takes, const char *engine, char *err,
                                     size_t errlen)
{
    return tsr_elem_dtype_check("kv_dtype", kv_dtype, takes, engine, "keep its KV cache in", err,
                                errlen);
}

/* The rotary embedding's parameters of model m. */
static inline tsr_rope_cfg_t tsr_rope_cfg(const tsr_model_info_t *m)
{
    tsr_rope_cfg_t c = {m->rope_theta, m->rope_llama3, m->rope_factor, m->rope_low_freq_factor,
                        m->rope_high_freq_factor, m->rope_original_max_pos};
    return c;
}

/* What every engine does first in step: checks batch b against spec
 * (entries, rows, positions, distinct slots), writes each entry's first
 * row and each row's slot and position, and takes KV blocks from kv for
 * every entry's positions, taking none when the pool is short. */
int tsr_batch_prepare(const tsr_piece_spec_t *spec, tsr_kvpool_t *kv, const tsr_batch_t *b,
                      int *first_row, int32_t *row_slot, int32_t *row_pos, char *err,
                      size_t errlen);

/* The first `rows` of ns rows of logits all-gathered from tp ranks
 * ([tp][ns][chunk], each rank's chunk padded) as [rows][vocab] in out. */
void tsr_logits_ungather(const float *gathered, int tp, int ns, int chunk, int vocab, int rows,
                         float *out);

/* Picks the next token from logits [vocab]: argmax (first maximum) when
 * temperature <= 0, else a draw tsr_draw(seed, position) from
 * softmax(logits / temperature) kept to the smallest set of tokens whose
 * probability reaches top_p (no cut at top_p >= 1). */
int32_t tsr_sample(const float *logits, int vocab, float temperature, float top_p, uint64_t seed,
                   uint64_t position);

#endif
