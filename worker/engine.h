/* engine.h: what executes a piece of the model.
 *
 * A table of functions, like the collectives, so the CPU engine (OpenBLAS)
 * and the CUDA engine (cuBLAS) are interchangeable.  An engine holds the
 * weights of one piece (a stage's layers, one tensor-parallel slice) and a KV
 * cache per sequence.  The two all-reduces of each layer and the vocabulary
 * gathers go through the communicator it is given, so the forward pass reads
 * like the model's definition with the sharding visible at those calls. */
#ifndef TSR_ENGINE_H
#define TSR_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include "common/modelcfg.h"
#include "worker/collective.h"

typedef struct {
    int tp_rank, tp_size;
    int stage, pp_size;
    int layer_begin, layer_end;     /* [begin, end) */
    int max_seq_len;
    int max_seqs;                   /* KV cache slots (concurrent sequences) */
} tsr_piece_spec_t;

typedef struct tsr_engine tsr_engine_t;

typedef struct {
    const char *name;
    /* Loads the piece from a Hugging Face directory: only its layers and its
     * tensor-parallel slice are read.  tp/ops: the stage's TP communicator
     * (NULL when tp_size is 1). */
    int (*load)(const char *model_dir, const tsr_piece_spec_t *spec, tsr_comm_t *tp,
                const tsr_coll_ops_t *ops, tsr_engine_t **out, char *err, size_t errlen);
    /* Runs n positions [pos, pos+n) of sequence slot seq through the piece.
     * Stage 0 takes token ids (hidden_in NULL); later stages take hidden_in
     * [n, hidden].  Stages before the last write hidden [n, hidden] to out;
     * the last stage writes the logits of the last position, [vocab], to out.
     * pos == 0 starts the sequence afresh. */
    int (*forward)(tsr_engine_t *e, int seq, int pos, int n, const int32_t *tokens,
                   const float *hidden_in, float *out, char *err, size_t errlen);
    /* Replaces the TP communicator (after the replica is rewired for a new
     * epoch; the weights stay). */
    void (*set_comm)(tsr_engine_t *e, tsr_comm_t *tp);
    const tsr_model_info_t *(*model)(const tsr_engine_t *e);
    uint64_t (*weight_bytes)(const tsr_engine_t *e);     /* bytes of weights held */
    uint64_t (*kv_bytes)(const tsr_engine_t *e);         /* bytes of KV cache held */
    void (*destroy)(tsr_engine_t **e_p);
} tsr_engine_ops_t;

extern const tsr_engine_ops_t tsr_engine_cpu;

/* Picks the next token from logits [vocab]: argmax (first maximum) when
 * temperature <= 0, else a draw from softmax(logits / temperature) kept to
 * the smallest set of tokens whose probability reaches top_p.  *rng is the
 * request's generator state (seeded from the request's seed). */
int32_t tsr_sample(const float *logits, int vocab, float temperature, float top_p,
                   uint64_t *rng);

#endif
