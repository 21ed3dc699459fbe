/* modelcfg.h: the facts of a Hugging Face Llama-family config.json that the
 * control plane needs (layer count for stage splits, heads for TP checks,
 * sizes for memory estimates). */
#ifndef TSR_MODELCFG_H
#define TSR_MODELCFG_H

#include <stddef.h>
#include <stdint.h>
#include "deploy.h"

typedef struct {
    int hidden_size;
    int intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;     /* defaults to num_attention_heads */
    int vocab_size;
    int max_position_embeddings;
    int tie_word_embeddings;     /* 0 or 1, default 0 */
    int dtype_bytes;             /* from torch_dtype: 4 float32, 2 float16/bfloat16; default 2 */

    /* What the forward pass needs (defaults as in transformers' LlamaConfig). */
    float rms_norm_eps;          /* default 1e-6 */
    float rope_theta;            /* default 10000 */
    int head_dim;                /* "head_dim" if given, else hidden_size / num_attention_heads */
    int bos_token_id, eos_token_id;  /* -1 when absent; eos may be a list: the first is kept */
    int n_eos;                   /* all eos ids (eos_token_id may be a list), at most 8 */
    int eos_ids[8];
    /* rope_scaling of type "llama3" (rope_type or type); rope_llama3 0 when absent. */
    int rope_llama3;
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_pos;
} tsr_model_info_t;

/* Reads DIR/config.json.  Returns 0 on success; -1 with a message naming the
 * file and the field on failure ("models/tiny/config.json: num_hidden_layers
 * missing or not a positive integer").  Refuses architectures other than the
 * Llama family (architectures[0] must be LlamaForCausalLM or
 * MistralForCausalLM when present), hidden_act other than "silu", and
 * rope_scaling of any type but "llama3", naming the field. */
int tsr_model_info_load(const char *dir, tsr_model_info_t *out, char *err, size_t errlen);

/* Most pieces (workers) one deployment may have. */
#define TSR_MAX_PIECES 65536
/* config.json is a few kilobytes; a larger one is refused before it is parsed. */
#define TSR_MODEL_CONFIG_MAX_BYTES (1024 * 1024)

/* Checks that deployment d can be laid out on model m: heads, KV heads and
 * intermediate_size divisible by tensor, no more stages than layers, at most
 * TSR_MAX_PIECES pieces.  The message names the
 * YAML file, the deployment and its line, e.g. "demo.yaml:9:5: deployments[0]
 * (tiny): models/tiny/config.json: num_attention_heads 12 is not divisible by
 * parallel.tensor 5".  cfg_path may be NULL. */
int tsr_model_check_layout(const tsr_model_info_t *m, const tsr_deployment_t *d,
                           int index, const char *cfg_path, char *err, size_t errlen);

/* Checks that one piece (a stage's layers [layer_begin, layer_end), one of
 * tp_size ranks) can be cut from model m read from dir: a possible layout,
 * layers inside the model, heads, KV heads and intermediate_size divisible by
 * tp_size, an even head_dim (rotary pairs).  The message names dir's
 * config.json.  What a worker checks before it loads; deployment files are
 * checked by tsr_model_check_layout. */
int tsr_model_check_piece(const tsr_model_info_t *m, const char *dir, int tp_rank, int tp_size,
                          int stage, int pp_size, int layer_begin, int layer_end, char *err,
                          size_t errlen);

/* Loads deployment d's config.json and checks the layout against it; a
 * failure to read the model is prefixed with where the deployment is
 * ("demo.yaml:9:5: deployments[0] (tiny): models/x/config.json: ..."). */
int tsr_model_load_for(const tsr_deployment_t *d, int index, const char *cfg_path,
                       tsr_model_info_t *m, char *err, size_t errlen);

/* Splits n_layers into `stages` consecutive ranges as evenly as possible; the
 * first (n_layers % stages) stages get one extra layer.  Stage s covers
 * [*begin, *end). */
void tsr_layer_split(int n_layers, int stages, int stage, int *begin, int *end);

#endif
