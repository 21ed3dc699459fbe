/* deploy.h: the deployment file (format version 1), read into typed structs.
 *
 * The parser is a pure function of bytes to struct (tsr_config_parse), so it
 * can be unit tested and fuzzed without touching the file system; the file
 * loader only reads the bytes and resolves relative model paths. */
#ifndef TSR_DEPLOY_H
#define TSR_DEPLOY_H

#include <stdbool.h>
#include <stddef.h>

/* collective_timeout_ms: its range and defaults.  The worker falls back on
 * the device's default for an assignment that carries none, and its
 * watchdog uses the cpu one while no deployment's value applies. */
#define TSR_COLL_TIMEOUT_MS_MIN 100
#define TSR_COLL_TIMEOUT_MS_MAX 3600000
#define TSR_COLL_TIMEOUT_MS_DEFAULT 30000       /* device: cpu */
#define TSR_COLL_TIMEOUT_MS_CUDA_DEFAULT 10000  /* device: cuda: a GPU step takes
                                                   milliseconds, and a wedged rank is
                                                   replaced within replay_wait_ms */

/* The status document lists every known worker in one reply of at most
 * 64 MiB; at most ~4.5 KB each (escaped reasons), 10,000 fit. */
#define TSR_MAX_WORKERS_LIMIT 10000
/* Mapping and sequence nesting a deployment file may have (it needs 4). */
#define TSR_CONFIG_MAX_DEPTH 32

typedef enum { TSR_DEVICE_CPU = 0, TSR_DEVICE_CUDA = 1 } tsr_device_t;

/* "cpu" / "cuda"; never NULL. */
const char *tsr_device_name(tsr_device_t d);
/* collective_timeout_ms when a deployment sets none: by its device. */
static inline int tsr_coll_timeout_default(tsr_device_t d)
{
    return d == TSR_DEVICE_CUDA ? TSR_COLL_TIMEOUT_MS_CUDA_DEFAULT : TSR_COLL_TIMEOUT_MS_DEFAULT;
}
/* 0 and *out set on success, -1 on an unknown name. */
int tsr_device_parse(const char *s, tsr_device_t *out);

/* The KV cache's element type (kv_dtype).  auto is the engine's own: f32
 * on the CPU, bf16 on CUDA (whose pool is bf16 only).  bf16 halves what
 * attention reads and doubles the sequences a budget holds; keys and values
 * are rounded to it as they are cached.  int8 (cpu only) keeps each cached
 * row of one KV head (head_dim elements of one position) as integers in
 * [-127, 127] times one f32 scale, its largest magnitude / 127: head_dim + 4
 * bytes, about a quarter of f32's.  The same values serve matmul_dtype, which
 * takes auto, f32 and bf16. */
typedef enum { TSR_KV_AUTO = 0, TSR_KV_F32 = 1, TSR_KV_BF16 = 2, TSR_KV_INT8 = 3 } tsr_kv_dtype_t;
/* "auto", "f32", "bf16", "int8"; NULL for any other value. */
const char *tsr_kv_dtype_name(int kv_dtype);
/* The type a piece on device d keeps: kv_dtype, or for auto the device's
 * own (above).  What the coordinator sends and compares, so a reload from
 * auto to the type it stands for changes nothing. */
int tsr_kv_dtype_on(tsr_device_t d, int kv_dtype);
/* Bytes one position of one KV head takes in a cache of kv_dtype (auto
 * resolved first), keys or values: head_dim elements, and int8's scale;
 * 0 for auto or an unknown value. */
int tsr_kv_row_bytes(int kv_dtype, int head_dim);

/* kv_admission: admit a sequence by what it needs now (preempting when the
 * pool runs out), or only when the pool holds its worst case. */
enum { TSR_KV_ADMIT_ON_DEMAND = 0, TSR_KV_ADMIT_RESERVE = 1 };

typedef struct {
    char *name;
    char *model;          /* as written in the file */
    char *model_path;     /* resolved: absolute, or relative to the YAML's directory */
    tsr_device_t device;  /* default cpu */
    int tensor;           /* parallel.tensor, default 1 */
    int pipeline;         /* parallel.pipeline, default 1 */
    int replicas;         /* parallel.replicas, default 1 */
    /* `parallel: auto`, or `tensor: auto` / `pipeline: auto` / `replicas: auto`: the
     * coordinator chooses that dimension from the workers (coordinator/resolve.c);
     * until it has, the fields above hold 1.  Replicas are auto when tensor or
     * pipeline is and replicas is not given. */
    bool auto_tensor, auto_pipeline, auto_replicas;
    double latency_target_ms;  /* latency_target_ms_per_token: an auto cut must meet it by
                                  the estimate (coordinator/layout.c); 0: none */
    /* `replicas: {min: N, max: M}`: replicas follow load (coordinator/autoscale.c),
     * from min (where replicas starts) to max; both 0: a fixed count.  One more when
     * the deployment's queue wait stays above scale_up_queue_ms (default 1000) for
     * scale_up_window_s (default 10); one fewer when the others could hold every
     * request in flight for scale_down_idle_s (default 300). */
    int replicas_min, replicas_max;
    int scale_up_queue_ms, scale_up_window_s, scale_down_idle_s;
    int max_seq_len;      /* default 2048 */
    /* Batching and memory, sent to every piece with its assignment. */
    int max_batch;        /* sequences in one step, 1..1024, default 32 */
    int prefill_chunk;    /* most prompt tokens of one sequence in one step,
                             1..65536, default 128; at most max_seq_len (a
                             larger value is taken as max_seq_len) */
    int kv_cache_mib;     /* KV cache budget per piece in MiB, 1..2^24; 0 (the
                             default): room for max_batch sequences of
                             max_seq_len positions, sized by the worker */
    int max_queue;        /* requests waiting per replica, 0..1000000, default
                             256; 0: refuse when the batch is full */
    int collective_timeout_ms; /* the deadline of one tensor-parallel operation
                                  (all-reduce, all-gather), 100..3600000, default
                                  10000 on cuda, 30000 on cpu (set at parse time,
                                  tsr_coll_timeout_default); pipeline hand-offs and a step's tokens
                                  wait twice that.  A worker whose data plane
                                  does not let go of an epoch within it is stuck:
                                  it reports itself dead and exits */
    int gpu_memory_percent; /* cuda: the share of each GPU's memory a piece may
                               use, 10..99, default 90; without kv_cache_mib,
                               the KV pool takes what weights and reserve leave */
    int kv_dtype;         /* tsr_kv_dtype_t: the KV cache's element type,
                             default auto (the engine's own) */
    int matmul_dtype;     /* tsr_kv_dtype_t's values: the weights' type and the
                             type each product's inputs are rounded to (f32
                             accumulation); default auto (the engine's own:
                             f32 on cpu, bf16 on cuda) */
    int weights_dtype;    /* TSR_KV_AUTO (as matmul_dtype says) or TSR_KV_INT8: each
                             weight matrix in int8 with a scale per row, multiplied
                             in f32 (cpu only) */
    bool prefix_cache;    /* keep finished prompts' KV blocks and reuse them (default
                             true; prefix_cache: false turns it off) */
    int kv_admission;     /* TSR_KV_ADMIT_ON_DEMAND (the default) or TSR_KV_ADMIT_RESERVE */
    char chat_template[16];  /* llama2, llama3, chatml or mistral; "" (the default):
                                recognised from the model's tokenizer_config.json */
    int line, column;     /* 1-based position of the entry, for messages */
} tsr_deployment_t;

typedef struct {
    char *path;                   /* file name it was read from (for messages) */
    char *workers_endpoint;       /* default tcp://0.0.0.0:7400 */
    char *control_endpoint;       /* default tcp://127.0.0.1:7401 */
    int heartbeat_interval_ms;    /* default 100 */
    int worker_timeout_ms;        /* default 1000 */
    int max_workers;              /* workers the registry holds, alive or dead,
                                     1..TSR_MAX_WORKERS_LIMIT, default 4096 */
    int dead_worker_ttl_s;        /* a dead worker is forgotten after this,
                                     1..604800, default 600 */
    int max_replays;              /* times in a row a request is resumed after its
                                     replica fails without progress (two tokens) in
                                     between, and 4 times that in all, 0..100,
                                     default 3 */
    int replay_wait_ms;           /* how long an interrupted request waits for a
                                     ready replica, 0..3600000, default 30000 */
    int canary_interval_ms;       /* a one-token request on each idle ready replica
                                     this often, 0 (off) or 100..3600000, default 5000 */
    int canary_timeout_ms;        /* its token must come within this, 1..600000,
                                     default 2000; else the replica is unhealthy */
    int reserve_spares;           /* idle workers of each device kind replicas that follow
                                     load leave for failover, 0..TSR_MAX_WORKERS_LIMIT,
                                     default 0 */
    int rebalance_interval_s;     /* a piece left on a worst place by a failover (a tensor
                                     group across nodes or NVLink domains) moves back, make
                                     before break, at most once this often, 0 (off) or
                                     1..86400, default 30 (coordinator/rebalance.c) */
    bool security_none;           /* security: none (plain ZeroMQ); only with
                                     loopback endpoints.  Default: curve */
    char *keys_dir;               /* key store (common/keys.h), default
                                     /etc/tessera/keys; a relative path is
                                     taken from the file's directory */
    int security_line, security_column;  /* where security: was set */
    char *http_endpoint;          /* HOST:PORT of the OpenAI-compatible HTTP server;
                                     NULL (the default): no HTTP server */
    char http_host[64];           /* its numeric host (localhost: 127.0.0.1) */
    int http_port;
    char *api_keys_file;          /* bearer tokens the HTTP API accepts, one per line;
                                     NULL: none asked */
    tsr_deployment_t *deployments;
    size_t n_deployments;
} tsr_config_t;

/* Parses a YAML document held in buf.  `name` is used in messages and to
 * resolve relative model paths (its directory part; may be NULL).  On success
 * returns 0 and *out (caller owns; free with tsr_config_destroy).  On failure
 * returns -1 and writes a one-line message into err naming file, line, column
 * and the key at fault, e.g.
 *   "demo.yaml:12:7: deployments[0].parallel.tensor: expected a positive integer, got 'two'". */
int tsr_config_parse(const char *buf, size_t len, const char *name,
                     tsr_config_t **out, char *err, size_t errlen);

/* Reads and parses a file; same contract as tsr_config_parse. */
int tsr_config_load(const char *path, tsr_config_t **out, char *err, size_t errlen);

/* Frees a config and sets *self_p to NULL.  Safe on NULL. */
void tsr_config_destroy(tsr_config_t **self_p);

/* Whether a ZeroMQ endpoint is well formed: tcp://HOST:PORT (a host name, a numeric IPv4
 * address, [IPv6] or *, and a port 1 to 65535), ipc://PATH or inproc://NAME.  When it is
 * not, false with what is wrong in why. */
bool tsr_endpoint_check(const char *endpoint, char *why, size_t len);

/* The HOST of tcp://HOST:PORT (after a "source;" part, brackets kept) into host, and
 * where PORT starts into *port (may be NULL); false when endpoint has no such form. */
bool tsr_endpoint_host(const char *endpoint, char *host, size_t hostlen, const char **port);

/* True when endpoint can only be reached from this machine: ipc://,
 * inproc://, or tcp:// on 127.0.0.0/8, ::1 or localhost. */
bool tsr_endpoint_is_local(const char *endpoint);

/* Returns the deployment with that name, or NULL. */
const tsr_deployment_t *tsr_config_find(const tsr_config_t *cfg, const char *name);

#endif
