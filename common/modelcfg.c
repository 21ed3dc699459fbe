/* modelcfg.c: the few facts of a Hugging Face config.json the control plane
 * needs, plus the layout arithmetic built on them (stage splits, TP checks);
 * what a piece weighs is common/budget.c's. */
#include "modelcfg.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>

#include "modelfile.h"
#include "util.h"



/* A missing field is reported when def < 0; otherwise def is used. */
static int get_posint(json_t *root, const char *key, int def, int *out,
                      const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, key);
    json_int_t x;

    if (v == NULL && def > 0) {
        *out = def;
        return 0;
    }
    if (v == NULL || !json_is_integer(v) || (x = json_integer_value(v)) <= 0 ||
        x > INT_MAX) {
        tsr_set_err(err, errlen, "%s: %s missing or not a positive integer", path, key);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int get_tie(json_t *root, int *out, const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, "tie_word_embeddings");

    if (v == NULL || json_is_null(v)) {
        *out = 0;
        return 0;
    }
    if (!json_is_boolean(v)) {
        tsr_set_err(err, errlen, "%s: tie_word_embeddings must be true or false", path);
        return -1;
    }
    *out = json_is_true(v) ? 1 : 0;
    return 0;
}

/* Newer transformers releases write "dtype" instead of "torch_dtype"; the
 * old name wins when both are there, as it does in transformers. */
static int get_dtype(json_t *root, int *out, const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, "torch_dtype");
    const char *key = "torch_dtype";
    const char *s;

    if (v == NULL) {
        v = json_object_get(root, "dtype");
        key = "dtype";
    }
    if (v == NULL || json_is_null(v)) {
        *out = 2;
        return 0;
    }
    s = json_string_value(v);
    if (s != NULL && strcmp(s, "float32") == 0) {
        *out = 4;
        return 0;
    }
    if (s != NULL && (strcmp(s, "float16") == 0 || strcmp(s, "bfloat16") == 0)) {
        *out = 2;
        return 0;
    }
    tsr_set_err(err, errlen, "%s: %s '%s' not supported (expected float32, float16 "
            "or bfloat16)", path, key, s ? s : "(not a string)");
    return -1;
}

/* head_dim and GQA grouping are derived from these; a config that breaks
 * them would make every later size silently wrong. */
static int check_shapes(const tsr_model_info_t *m, const char *path,
                        char *err, size_t errlen)
{
    if (m->hidden_size % m->num_attention_heads != 0) {
        tsr_set_err(err, errlen, "%s: hidden_size %d is not divisible by "
                "num_attention_heads %d", path, m->hidden_size, m->num_attention_heads);
        return -1;
    }
    if (m->num_attention_heads % m->num_key_value_heads != 0) {
        tsr_set_err(err, errlen, "%s: num_attention_heads %d is not divisible by "
                "num_key_value_heads %d", path, m->num_attention_heads,
                m->num_key_value_heads);
        return -1;
    }
    return 0;
}

/* A present field must be a positive number (JSON integer or real);
 * absent or null gives def. */
static int get_posnum(json_t *obj, const char *key, const char *field, double def,
                      float *out, const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(obj, key);

    if (v == NULL || json_is_null(v)) {
        *out = (float)def;
        return 0;
    }
    if (!json_is_number(v) || !(json_number_value(v) > 0) ||
        json_number_value(v) > 3.0e38) {
        tsr_set_err(err, errlen, "%s: %s must be a positive number", path, field);
        return -1;
    }
    *out = (float)json_number_value(v);
    return 0;
}

/* Only the Llama family's forward pass exists; a GPT-2 or Qwen config with
 * the same size fields would otherwise load and produce garbage. */
static int check_arch(json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, "architectures");
    const char *a;

    if (v == NULL || json_is_null(v))
        return 0;
    a = json_string_value(json_array_get(v, 0));
    if (!json_is_array(v) || a == NULL) {
        tsr_set_err(err, errlen, "%s: architectures must be a non-empty list of names", path);
        return -1;
    }
    if (strcmp(a, "LlamaForCausalLM") != 0 && strcmp(a, "MistralForCausalLM") != 0) {
        tsr_set_err(err, errlen, "%s: architectures[0] '%s' not supported (expected "
                "LlamaForCausalLM or MistralForCausalLM)", path, a);
        return -1;
    }
    return 0;
}

static int check_act(json_t *root, const char *path, char *err, size_t errlen)
{
    json_t *v = json_object_get(root, "hidden_act");

    if (v == NULL || json_is_null(v) ||
        (json_is_string(v) && strcmp(json_string_value(v), "silu") == 0))
        return 0;
    tsr_set_err(err, errlen, "%s: hidden_act '%s' not supported (only silu)", path,
            json_is_string(v) ? json_string_value(v) : "(not a string)");
    return -1;
}

/* Llama and Mistral have no biases; a config that asks for them would be served without
 * them, wrongly: refused. */
static int check_biases(json_t *root, const char *path, char *err, size_t errlen)
{
    static const char *const keys[] = {"attention_bias", "mlp_bias"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        json_t *v = json_object_get(root, keys[k]);
        if (v == NULL || json_is_null(v) || json_is_false(v))
            continue;
        tsr_set_err(err, errlen, "%s: %s %s not supported (only models without biases)", path,
                    keys[k], json_is_true(v) ? "true" : "(not a boolean)");
        return -1;
    }
    return 0;
}

/* A token id: a non-negative integer; -1 when absent or null. */
static int token_id(json_t *v, int *out)
{
    if (v == NULL || json_is_null(v)) {
        *out = -1;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT_MAX)
        return -1;
    *out = (int)json_integer_value(v);
    return 0;
}

/* eos_token_id may be one id or a list (Llama 3 instruct stops on several);
 * generation must stop on all of them, so none is dropped silently. */
static int get_eos(json_t *root, tsr_model_info_t *m, const char *path, char *err,
                   size_t errlen)
{
    json_t *v = json_object_get(root, "eos_token_id"), *e;
    size_t max = sizeof m->eos_ids / sizeof m->eos_ids[0], i;

    m->eos_token_id = -1;
    m->n_eos = 0;
    if (!json_is_array(v)) {
        if (token_id(v, &m->eos_token_id) < 0)
            goto bad;
        if (m->eos_token_id >= 0)
            m->eos_ids[m->n_eos++] = m->eos_token_id;
        return 0;
    }
    if (json_array_size(v) > max) {
        tsr_set_err(err, errlen, "%s: eos_token_id lists %zu ids, at most %zu are supported",
                path, json_array_size(v), max);
        return -1;
    }
    json_array_foreach(v, i, e) {
        if (json_is_null(e) || token_id(e, &m->eos_ids[m->n_eos]) < 0)
            goto bad;
        m->n_eos++;
    }
    if (m->n_eos > 0)
        m->eos_token_id = m->eos_ids[0];
    return 0;
bad:
    tsr_set_err(err, errlen, "%s: eos_token_id must be a non-negative integer or a list of them",
            path);
    return -1;
}

static int get_tokens(json_t *root, tsr_model_info_t *m, const char *path, char *err,
                      size_t errlen)
{
    if (token_id(json_object_get(root, "bos_token_id"), &m->bos_token_id) < 0) {
        tsr_set_err(err, errlen, "%s: bos_token_id must be a non-negative integer", path);
        return -1;
    }
    return get_eos(root, m, path, err, errlen);
}

/* original_max_position_embeddings may be written as 8192 or 8192.0. */
static int get_rope_orig(json_t *rs, tsr_model_info_t *m, const char *path, char *err,
                         size_t errlen)
{
    json_t *v = json_object_get(rs, "original_max_position_embeddings");
    double d = json_number_value(v);

    if (!json_is_number(v) || !(d >= 1) || d > INT_MAX || d != (double)(int)d) {
        tsr_set_err(err, errlen, "%s: rope_scaling.original_max_position_embeddings missing or "
                "not a positive integer", path);
        return -1;
    }
    m->rope_original_max_pos = (int)d;
    return 0;
}

/* Every llama3 parameter is required: guessing one would change the
 * frequencies of every position past the original context. */
static int get_llama3(json_t *rs, tsr_model_info_t *m, const char *path, char *err,
                      size_t errlen)
{
    static const char *keys[] = { "factor", "low_freq_factor", "high_freq_factor" };
    float *dst[] = { &m->rope_factor, &m->rope_low_freq_factor, &m->rope_high_freq_factor };
    char field[64];

    for (size_t i = 0; i < 3; i++) {
        snprintf(field, sizeof field, "rope_scaling.%s", keys[i]);
        if (json_object_get(rs, keys[i]) == NULL) {
            tsr_set_err(err, errlen, "%s: %s missing (required for llama3)", path, field);
            return -1;
        }
        if (get_posnum(rs, keys[i], field, 0, dst[i], path, err, errlen) < 0)
            return -1;
    }
    /* The smoothing between the bands divides by their difference. */
    if (!(m->rope_high_freq_factor > m->rope_low_freq_factor)) {
        tsr_set_err(err, errlen, "%s: rope_scaling.high_freq_factor must exceed low_freq_factor",
                path);
        return -1;
    }
    if (get_rope_orig(rs, m, path, err, errlen) < 0)
        return -1;
    m->rope_llama3 = 1;
    return 0;
}

static int get_rope_scaling(json_t *root, tsr_model_info_t *m, const char *path, char *err,
                            size_t errlen)
{
    json_t *rs = json_object_get(root, "rope_scaling");
    json_t *type;
    const char *s;

    m->rope_llama3 = 0;
    if (rs == NULL || json_is_null(rs))
        return 0;
    if (!json_is_object(rs)) {
        tsr_set_err(err, errlen, "%s: rope_scaling must be an object or null", path);
        return -1;
    }
    /* transformers renamed "type" to "rope_type"; both are in the wild. */
    type = json_object_get(rs, "rope_type");
    if (type == NULL)
        type = json_object_get(rs, "type");
    s = json_string_value(type);
    if (s != NULL && strcmp(s, "llama3") == 0)
        return get_llama3(rs, m, path, err, errlen);
    /* "default" is transformers' name for plain RoPE, i.e. no scaling. */
    if (s != NULL && strcmp(s, "default") == 0)
        return 0;
    tsr_set_err(err, errlen, "%s: rope_scaling type '%s' not supported (only llama3)", path,
            s ? s : "(missing)");
    return -1;
}

static int get_head_dim(json_t *root, tsr_model_info_t *m, const char *path, char *err,
                        size_t errlen)
{
    json_t *v = json_object_get(root, "head_dim");

    if (v == NULL || json_is_null(v)) {
        m->head_dim = m->hidden_size / m->num_attention_heads;
        return 0;
    }
    return get_posint(root, "head_dim", -1, &m->head_dim, path, err, errlen);
}

/* The fields the forward pass needs beyond the control plane's sizes. */
static int read_forward_fields(json_t *root, tsr_model_info_t *m, const char *path,
                               char *err, size_t errlen)
{
    if (get_posnum(root, "rms_norm_eps", "rms_norm_eps", 1e-6, &m->rms_norm_eps, path, err,
                   errlen) < 0 ||
        get_posnum(root, "rope_theta", "rope_theta", 10000.0, &m->rope_theta, path, err,
                   errlen) < 0 ||
        get_head_dim(root, m, path, err, errlen) < 0 ||
        get_tokens(root, m, path, err, errlen) < 0 ||
        get_rope_scaling(root, m, path, err, errlen) < 0)
        return -1;
    return 0;
}

static int read_fields(json_t *root, tsr_model_info_t *m, const char *path,
                       char *err, size_t errlen)
{
    /* Family first: a GPT-2 config should be refused as GPT-2, not for a
     * missing Llama field. */
    if (check_arch(root, path, err, errlen) < 0 || check_act(root, path, err, errlen) < 0 ||
        check_biases(root, path, err, errlen) < 0 ||
        get_posint(root, "hidden_size", -1, &m->hidden_size, path, err, errlen) < 0 ||
        get_posint(root, "intermediate_size", -1, &m->intermediate_size, path, err, errlen) < 0 ||
        get_posint(root, "num_hidden_layers", -1, &m->num_hidden_layers, path, err, errlen) < 0 ||
        get_posint(root, "num_attention_heads", -1, &m->num_attention_heads, path, err, errlen) < 0 ||
        get_posint(root, "num_key_value_heads", m->num_attention_heads,
                   &m->num_key_value_heads, path, err, errlen) < 0 ||
        get_posint(root, "vocab_size", -1, &m->vocab_size, path, err, errlen) < 0 ||
        get_posint(root, "max_position_embeddings", -1, &m->max_position_embeddings,
                   path, err, errlen) < 0 ||
        get_tie(root, &m->tie_word_embeddings, path, err, errlen) < 0 ||
        get_dtype(root, &m->dtype_bytes, path, err, errlen) < 0 ||
        check_shapes(m, path, err, errlen) < 0)
        return -1;
    return read_forward_fields(root, m, path, err, errlen);
}

int tsr_model_info_load(const char *dir, tsr_model_info_t *out, char *err, size_t errlen)
{
    tsr_model_info_t m = { 0 };
    json_error_t jerr;
    json_t *root = NULL;
    char *path = NULL;
    int rc = -1;

    if ((path = tsr_path_join(dir, "config.json")) == NULL) {
        tsr_set_err(err, errlen, "%s/config.json: out of memory", dir);
        goto out;
    }
    size_t len = 0;
    char *text = tsr_model_read(dir, "config.json", TSR_MODEL_CONFIG_MAX_BYTES, &len, err,
                                errlen);
    if (text == NULL)
        goto out;
    root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (root == NULL) {
        tsr_set_err(err, errlen, "%s:%d:%d: invalid JSON (byte %d): %s", path, jerr.line,
                    jerr.column, jerr.position, tsr_json_error_what(&jerr));
        goto out;
    }
    if (!json_is_object(root)) {
        tsr_set_err(err, errlen, "%s: expected a JSON object at the top level", path);
        goto out;
    }
    if (read_fields(root, &m, path, err, errlen) < 0)
        goto out;
    *out = m;
    rc = 0;
out:
    json_decref(root);
    free(path);
    return rc;
}

int tsr_model_check_layout(const tsr_model_info_t *m, const tsr_deployment_t *d,
                           int index, const char *cfg_path, char *err, size_t errlen)
{
    const char *yaml = cfg_path ? cfg_path : "<input>";
    const char *mdir = d->model_path ? d->model_path : (d->model ? d->model : "?");
    const char *sep = mdir[0] && mdir[strlen(mdir) - 1] == '/' ? "" : "/";
    char where[512];

    snprintf(where, sizeof where, "%s:%d:%d: deployments[%d] (%s): %s%sconfig.json",
             yaml, d->line, d->column, index, d->name ? d->name : "?", mdir, sep);
    if (d->tensor <= 0 || d->pipeline <= 0) {
        tsr_set_err(err, errlen, "%s: parallel.tensor and parallel.pipeline must be "
                "positive", where);
        return -1;
    }
    if (m->num_attention_heads % d->tensor != 0) {
        tsr_set_err(err, errlen, "%s: num_attention_heads %d is not divisible by "
                "parallel.tensor %d", where, m->num_attention_heads, d->tensor);
        return -1;
    }
    /* With GQA each rank needs whole KV heads, which is the stricter test. */
    if (m->num_key_value_heads % d->tensor != 0) {
        tsr_set_err(err, errlen, "%s: num_key_value_heads %d is not divisible by "
                "parallel.tensor %d", where, m->num_key_value_heads, d->tensor);
        return -1;
    }
    /* The MLP is split by rows of gate/up and columns of down. */
    if (m->intermediate_size % d->tensor != 0) {
        tsr_set_err(err, errlen, "%s: intermediate_size %d is not divisible by "
                "parallel.tensor %d", where, m->intermediate_size, d->tensor);
        return -1;
    }
    if (d->pipeline > m->num_hidden_layers) {
        tsr_set_err(err, errlen, "%s: parallel.pipeline %d exceeds num_hidden_layers %d "
                "(a stage needs at least one layer)", where, d->pipeline,
                m->num_hidden_layers);
        return -1;
    }
    long long pieces = (long long)d->tensor * d->pipeline *
                       (d->replicas_max > d->replicas ? d->replicas_max : d->replicas);
    if (pieces > TSR_MAX_PIECES) {
        tsr_set_err(err, errlen, "%s: tensor x pipeline x replicas (at most) is %lld pieces; at most %d per "
                "deployment", where, pieces, TSR_MAX_PIECES);
        return -1;
    }
    return 0;
}

void tsr_layer_split(int n_layers, int stages, int stage, int *begin, int *end)
{
    int base, extra;

    if (n_layers <= 0 || stages <= 0 || stage < 0 || stage >= stages) {
        *begin = *end = 0;
        return;
    }
    base = n_layers / stages;
    extra = n_layers % stages;
    /* Stages before `stage` hold base layers each plus one for each of the
     * first `extra` of them. */
    *begin = stage * base + (stage < extra ? stage : extra);
    *end = *begin + base + (stage < extra ? 1 : 0);
}

int tsr_model_load_for(const tsr_deployment_t *d, int index, const char *cfg_path,
                       tsr_model_info_t *m, char *err, size_t errlen)
{
    char why[768];
    if (tsr_model_info_load(d->model_path, m, why, sizeof why) < 0) {
        tsr_set_err(err, errlen, "%s:%d:%d: deployments[%d] (%s): %s", cfg_path ? cfg_path : "<input>",
                d->line, d->column, index, d->name ? d->name : "?", why);
        return -1;
    }
    return tsr_model_check_layout(m, d, index, cfg_path, err, errlen);
}

int tsr_model_check_piece(const tsr_model_info_t *m, const char *dir, int tp_rank, int tp_size,
                          int stage, int pp_size, int layer_begin, int layer_end, char *err,
                          size_t errlen)
{
    if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || pp_size < 1 || stage < 0 ||
        stage >= pp_size) {
        tsr_set_err(err, errlen, "%s/config.json: impossible piece: stage %d of %d, tp %d of %d",
                    dir, stage, pp_size, tp_rank, tp_size);
        return -1;
    }
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > m->num_hidden_layers) {
        tsr_set_err(err, errlen, "%s/config.json: layers [%d,%d) do not fit a model of %d layers",
                    dir, layer_begin, layer_end, m->num_hidden_layers);
        return -1;
    }
    if (m->num_attention_heads % tp_size || m->num_key_value_heads % tp_size ||
        m->intermediate_size % tp_size) {
        tsr_set_err(err, errlen,
                    "%s/config.json: %d attention heads, %d KV heads and intermediate_size %d "
                    "cannot be split %d ways",
                    dir, m->num_attention_heads, m->num_key_value_heads, m->intermediate_size,
                    tp_size);
        return -1;
    }
    if (m->head_dim % 2) {
        tsr_set_err(err, errlen, "%s/config.json: head_dim %d is odd: rotary embeddings need pairs",
                    dir, m->head_dim);
        return -1;
    }
    return 0;
}
