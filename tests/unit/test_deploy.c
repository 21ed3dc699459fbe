/* test_deploy.c: the deployment file parser (common/deploy.c) and the model
 * config reader and layout arithmetic (common/modelcfg.c). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/log.h"
#include <unistd.h>

#include "common/deploy.h"
#include "common/budget.h"
#include "common/slice.h"
#include "common/modelcfg.h"

/* ---- helpers ------------------------------------------------------------ */

static int parse(const char *yaml, const char *name, tsr_config_t **cfg,
                 char *err, size_t errlen)
{
    err[0] = '\0';
    return tsr_config_parse(yaml, strlen(yaml), name, cfg, err, errlen);
}

/* Parses yaml that must be valid; fails the test with the message if not. */
static tsr_config_t *parse_ok(const char *yaml, const char *name)
{
    tsr_config_t *cfg = NULL;
    char err[512];
    if (parse(yaml, name, &cfg, err, sizeof err) < 0) fail_msg("%s", err);
    return cfg;
}

/* Asserts that yaml is rejected and the message starts with `prefix`
 * ("demo.yaml:LINE:COL: KEYPATH: ") and contains `detail` (may be NULL). */
static void expect_error(const char *yaml, const char *prefix, const char *detail)
{
    tsr_config_t *cfg = NULL;
    char err[512];

    assert_int_equal(parse(yaml, "demo.yaml", &cfg, err, sizeof err), -1);
    assert_null(cfg);
    if (strncmp(err, prefix, strlen(prefix)) != 0)
        fail_msg("message '%s' does not start with '%s'", err, prefix);
    if (detail && strstr(err, detail) == NULL)
        fail_msg("message '%s' does not contain '%s'", err, detail);
    assert_null(strchr(err, '\n'));
}

static char *make_tmpdir(void)
{
    char *dir = strdup("/tmp/tsr_test_deploy.XXXXXX");

    assert_non_null(dir);
    assert_non_null(mkdtemp(dir));
    return dir;
}

static char *write_file(const char *dir, const char *name, const char *text,
                        size_t len)
{
    char *path = NULL;
    FILE *f;

    assert_true(asprintf(&path, "%s/%s", dir, name) > 0);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
    return path;
}

static void remove_file_and_dir(char *path, char *dir)
{
    unlink(path);
    rmdir(dir);
    free(path);
    free(dir);
}

static const char valid_yaml[] =
    "version: 1\n"                              /* 1 */
    "coordinator:\n"                            /* 2 */
    "  workers_endpoint: tcp://0.0.0.0:7500\n"  /* 3 */
    "  control_endpoint: ipc:///tmp/tsr.sock\n" /* 4 */
    "  heartbeat_interval_ms: 50\n"             /* 5 */
    "  worker_timeout_ms: 500\n"                /* 6 */
    "deployments:\n"                            /* 7 */
    "  - name: tiny\n"                          /* 8 */
    "    model: models/tiny\n"                  /* 9 */
    "    device: cuda   # a comment\n"          /* 10 */
    "    parallel:\n"                           /* 11 */
    "      tensor: 2\n"                         /* 12 */
    "      pipeline: 2\n"                       /* 13 */
    "      replicas: 3\n"                       /* 14 */
    "    max_seq_len: 256\n"                    /* 15 */
    "  - name: small.v2-x_1\n"                  /* 16 */
    "    model: /abs/small\n";                  /* 17 */

/* ---- valid files -------------------------------------------------------- */

static void test_valid_file_loads_every_field_and_defaults(void **state)
{
    tsr_config_t *cfg = NULL;
    const tsr_deployment_t *d;
    char err[512];

    (void)state;
    assert_int_equal(parse(valid_yaml, "demo.yaml", &cfg, err, sizeof err), 0);
    assert_non_null(cfg);
    assert_string_equal(cfg->path, "demo.yaml");
    assert_string_equal(cfg->workers_endpoint, "tcp://0.0.0.0:7500");
    assert_string_equal(cfg->control_endpoint, "ipc:///tmp/tsr.sock");
    assert_int_equal(cfg->heartbeat_interval_ms, 50);
    assert_int_equal(cfg->worker_timeout_ms, 500);
    assert_int_equal(cfg->n_deployments, 2);

    d = &cfg->deployments[0];
    assert_string_equal(d->name, "tiny");
    assert_string_equal(d->model, "models/tiny");
    assert_string_equal(d->model_path, "models/tiny");
    assert_int_equal(d->device, TSR_DEVICE_CUDA);
    assert_int_equal(d->tensor, 2);
    assert_int_equal(d->pipeline, 2);
    assert_int_equal(d->replicas, 3);
    assert_int_equal(d->max_seq_len, 256);
    assert_int_equal(d->line, 8);
    assert_int_equal(d->column, 5);
    /* cuda's own default: a GPU step takes milliseconds */
    assert_int_equal(d->collective_timeout_ms, 10000);

    /* Second entry: everything but name and model is a default. */
    d = &cfg->deployments[1];
    assert_string_equal(d->name, "small.v2-x_1");
    assert_string_equal(d->model_path, "/abs/small");
    assert_int_equal(d->device, TSR_DEVICE_CPU);
    assert_int_equal(d->tensor, 1);
    assert_int_equal(d->pipeline, 1);
    assert_int_equal(d->replicas, 1);
    assert_int_equal(d->max_seq_len, 2048);
    assert_int_equal(d->max_batch, 32);
    assert_int_equal(d->prefill_chunk, 128);
    assert_int_equal(d->kv_cache_mib, 0);
    assert_int_equal(d->max_queue, 256);
    assert_int_equal(d->gpu_memory_percent, 90);
    assert_int_equal(d->collective_timeout_ms, 30000);
    assert_int_equal(d->kv_dtype, TSR_KV_AUTO);
    assert_int_equal(d->matmul_dtype, TSR_KV_AUTO);
    assert_int_equal(d->line, 16);

    assert_ptr_equal(tsr_config_find(cfg, "small.v2-x_1"), &cfg->deployments[1]);
    assert_null(tsr_config_find(cfg, "nope"));
    tsr_config_destroy(&cfg);
    assert_null(cfg);
    tsr_config_destroy(&cfg); /* safe on NULL */
}

static void test_minimal_file_gets_coordinator_defaults(void **state)
{
    static const char *const files[] = {
        "version: 1\n",
        "version: 1\ncoordinator:\ndeployments:\n",
        "version: 1\ndeployments: []\n",
    };
    tsr_config_t *cfg = NULL;
    char err[512];
    size_t i;

    (void)state;
    for (i = 0; i < sizeof files / sizeof files[0]; i++) {
        assert_int_equal(parse(files[i], NULL, &cfg, err, sizeof err), 0);
        assert_string_equal(cfg->path, "<input>");
        assert_string_equal(cfg->workers_endpoint, "tcp://0.0.0.0:7400");
        assert_string_equal(cfg->control_endpoint, "tcp://127.0.0.1:7401");
        assert_int_equal(cfg->heartbeat_interval_ms, 100);
        assert_int_equal(cfg->worker_timeout_ms, 1000);
        assert_int_equal(cfg->max_workers, 4096);
        assert_int_equal(cfg->dead_worker_ttl_s, 600);
        assert_int_equal(cfg->n_deployments, 0);
        assert_null(cfg->deployments);
        tsr_config_destroy(&cfg);
    }
}

static void test_largest_int_is_accepted(void **state)
{
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    assert_int_equal(parse("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                           "    max_seq_len: 2147483647\n", "demo.yaml", &cfg,
                           err, sizeof err), 0);
    assert_int_equal(cfg->deployments[0].max_seq_len, INT_MAX);
    tsr_config_destroy(&cfg);
}

static void test_relative_model_path_resolved_against_yaml_dir(void **state)
{
    static const char yaml[] =
        "version: 1\ndeployments:\n  - name: a\n    model: models/tiny\n"
        "  - name: b\n    model: /opt/m\n";
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    assert_int_equal(parse(yaml, "/srv/conf/demo.yaml", &cfg, err, sizeof err), 0);
    assert_string_equal(cfg->deployments[0].model, "models/tiny");
    assert_string_equal(cfg->deployments[0].model_path, "/srv/conf/models/tiny");
    assert_string_equal(cfg->deployments[1].model_path, "/opt/m");
    tsr_config_destroy(&cfg);

    assert_int_equal(parse(yaml, "conf/demo.yaml", &cfg, err, sizeof err), 0);
    assert_string_equal(cfg->deployments[0].model_path, "conf/models/tiny");
    tsr_config_destroy(&cfg);

    assert_int_equal(parse(yaml, "demo.yaml", &cfg, err, sizeof err), 0);
    assert_string_equal(cfg->deployments[0].model_path, "models/tiny");
    tsr_config_destroy(&cfg);
}

static void test_load_reads_file_and_resolves_against_its_dir(void **state)
{
    char *dir = make_tmpdir();
    char *path = write_file(dir, "demo.yaml", valid_yaml, strlen(valid_yaml));
    char *want = NULL;
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    assert_int_equal(tsr_config_load(path, &cfg, err, sizeof err), 0);
    assert_string_equal(cfg->path, path);
    assert_true(asprintf(&want, "%s/models/tiny", dir) > 0);
    assert_string_equal(cfg->deployments[0].model_path, want);
    free(want);
    tsr_config_destroy(&cfg);
    remove_file_and_dir(path, dir);
}

static void test_device_names_round_trip(void **state)
{
    tsr_device_t d;

    (void)state;
    assert_int_equal(tsr_device_parse("cuda", &d), 0);
    assert_string_equal(tsr_device_name(d), "cuda");
    assert_int_equal(tsr_device_parse("cpu", &d), 0);
    assert_string_equal(tsr_device_name(d), "cpu");
    assert_int_equal(tsr_device_parse("gpu", &d), -1);
}

/* ---- bad input ---------------------------------------------------------- */

/* parallel: auto chooses all three; tensor or pipeline auto alone leaves replicas to
 * be chosen too unless they are given; anything else where auto may stand is named. */
static void test_prefix_cache_and_kv_admission(void **state)
{
    (void)state;
    static const char head[] = "version: 1\ndeployments:\n  - name: a\n    model: m\n";
    char y[512];
    tsr_config_t *cfg = parse_ok(head, "demo.yaml");
    assert_true(cfg->deployments[0].prefix_cache);                 /* the defaults */
    assert_int_equal(cfg->deployments[0].kv_admission, TSR_KV_ADMIT_ON_DEMAND);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    prefix_cache: false\n    kv_admission: reserve\n", head);
    cfg = parse_ok(y, "demo.yaml");
    assert_false(cfg->deployments[0].prefix_cache);
    assert_int_equal(cfg->deployments[0].kv_admission, TSR_KV_ADMIT_RESERVE);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    prefix_cache: yes\n", head);
    expect_error(y, "demo.yaml:5:19: deployments[0].prefix_cache: ", "expected true or false, got 'yes'");
    snprintf(y, sizeof y, "%s    prefix_cache: [true]\n", head);
    expect_error(y, "demo.yaml:5:19: deployments[0].prefix_cache: ", "expected true or false");
    snprintf(y, sizeof y, "%s    kv_admission: lazy\n", head);
    expect_error(y, "demo.yaml:5:19: deployments[0].kv_admission: ",
                 "expected on_demand or reserve, got 'lazy'");
}

static void test_parallel_auto_and_its_keys(void **state)
{
    (void)state;
    static const char head[] = "version: 1\ndeployments:\n  - name: a\n    model: m\n";
    char y[512];
    snprintf(y, sizeof y, "%s    parallel: auto\n", head);
    tsr_config_t *cfg = parse_ok(y, "demo.yaml");
    const tsr_deployment_t *d = &cfg->deployments[0];
    assert_true(d->auto_tensor && d->auto_pipeline && d->auto_replicas);
    assert_int_equal(d->tensor, 1);  /* until the coordinator chooses */
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: {tensor: auto, pipeline: 2}\n", head);
    cfg = parse_ok(y, "demo.yaml");
    d = &cfg->deployments[0];
    assert_true(d->auto_tensor && !d->auto_pipeline && d->auto_replicas);
    assert_int_equal(d->pipeline, 2);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: {pipeline: auto, replicas: 3}\n", head);
    cfg = parse_ok(y, "demo.yaml");
    d = &cfg->deployments[0];
    assert_true(!d->auto_tensor && d->auto_pipeline && !d->auto_replicas);
    assert_int_equal(d->replicas, 3);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: {tensor: 2, replicas: auto}\n", head);
    cfg = parse_ok(y, "demo.yaml");
    d = &cfg->deployments[0];
    assert_true(!d->auto_tensor && !d->auto_pipeline && d->auto_replicas);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: auto\n    latency_target_ms_per_token: 7.5\n", head);
    cfg = parse_ok(y, "demo.yaml");
    assert_true(cfg->deployments[0].latency_target_ms == 7.5);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    latency_target_ms_per_token: 0\n", head);
    expect_error(y, "demo.yaml:5:34: deployments[0].latency_target_ms_per_token: ",
                 "above 0 and at most 1000000, got '0'");
    snprintf(y, sizeof y, "%s    parallel: automatic\n", head);
    expect_error(y, "demo.yaml:5:15: deployments[0].parallel: ",
                 "expected auto or a mapping of tensor, pipeline and replicas, got 'automatic'");
    snprintf(y, sizeof y, "%s    parallel: {tensor: \"auto\"}\n", head);
    expect_error(y, "demo.yaml:5:24: deployments[0].parallel.tensor: ", "quoted string 'auto'");
}

/* replicas: {min, max} follow load; the scale keys only with a range; the range and
 * coordinator.reserve_spares checked and named. */
static void test_a_range_of_replicas_and_its_keys(void **state)
{
    (void)state;
    static const char head[] = "version: 1\ndeployments:\n  - name: a\n    model: m\n";
    char y[512];
    snprintf(y, sizeof y, "coordinator:\n  reserve_spares: 2\n%s"
             "    parallel: {tensor: 2, replicas: {min: 2, max: 6}}\n"
             "    scale_up_queue_ms: 250\n    scale_down_idle_s: 60\n", head + 11);
    char full[600];
    snprintf(full, sizeof full, "version: 1\n%s", y);
    tsr_config_t *cfg = parse_ok(full, "demo.yaml");
    const tsr_deployment_t *d = &cfg->deployments[0];
    assert_int_equal(cfg->reserve_spares, 2);
    assert_int_equal(d->replicas, 2);       /* it starts at min */
    assert_int_equal(d->replicas_min, 2);
    assert_int_equal(d->replicas_max, 6);
    assert_false(d->auto_replicas);
    assert_int_equal(d->scale_up_queue_ms, 250);
    assert_int_equal(d->scale_up_window_s, 10);   /* the defaults */
    assert_int_equal(d->scale_down_idle_s, 60);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: {tensor: auto, replicas: {min: 1, max: 4}}\n", head);
    cfg = parse_ok(y, "demo.yaml");
    assert_true(cfg->deployments[0].auto_tensor && !cfg->deployments[0].auto_replicas);
    assert_int_equal(cfg->deployments[0].replicas_max, 4);
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    parallel: {replicas: 2}\n", head);
    cfg = parse_ok(y, "demo.yaml");
    assert_int_equal(cfg->deployments[0].replicas_max, 0);  /* a fixed count */
    tsr_config_destroy(&cfg);
    snprintf(y, sizeof y, "%s    scale_up_queue_ms: 250\n", head);
    expect_error(y, "demo.yaml:5:24: deployments[0].scale_up_queue_ms: ",
                 "applies only to replicas that follow load");
    snprintf(y, sizeof y, "%s    parallel: {replicas: {min: 3, max: 2}}\n", head);
    expect_error(y, "demo.yaml:5:40: deployments[0].parallel.replicas.max: ",
                 "expected at least min (3), got 2");
    snprintf(y, sizeof y, "%s    parallel: {replicas: {min: 1}}\n", head);
    expect_error(y, "demo.yaml:5:26: deployments[0].parallel.replicas.max: ", "required key missing");
    snprintf(y, sizeof y, "%s    parallel: {replicas: {min: 0, max: 2}}\n", head);
    expect_error(y, "demo.yaml:5:32: deployments[0].parallel.replicas.min: ", NULL);
    snprintf(y, sizeof y, "%s    parallel: {replicas: {min: 1, most: 2}}\n", head);
    expect_error(y, "demo.yaml:5:35: deployments[0].parallel.replicas.most: ", "unknown key");
    snprintf(y, sizeof y, "%s    parallel: {replicas: {min: 1, max: 2}}\n    scale_down_idle_s: 0\n",
             head);
    expect_error(y, "demo.yaml:6:24: deployments[0].scale_down_idle_s: ", NULL);
    expect_error("version: 1\ncoordinator:\n  reserve_spares: -1\n",
                 "demo.yaml:3:19: coordinator.reserve_spares: ", NULL);
}

static void test_syntax_error_reports_libyaml_problem_and_position(void **state)
{
    (void)state;
    /* The unclosed flow sequence runs into the end of the stream. */
    expect_error("version: 1\ncoordinator: [a, b\n", "demo.yaml:3:1: syntax error: ",
                 "did not find expected ',' or ']'");
    /* A tab where indentation is expected. */
    expect_error("version: 1\ndeployments:\n\t- name: a\n", "demo.yaml:3:1: syntax error: ",
                 "found character that cannot start any token");
    /* Invalid UTF-8 is a reader error, located from its byte offset. */
    expect_error("version: 1\nx: \xff\n", "demo.yaml:2:4: syntax error: ", "invalid");
}

static void test_missing_version_is_rejected(void **state)
{
    (void)state;
    expect_error("coordinator:\n  heartbeat_interval_ms: 100\n", "demo.yaml:1:1: version: ",
                 "required key missing");
    expect_error("", "demo.yaml:1:1: version: ", "required key missing");
    expect_error("# only a comment\n", "demo.yaml:1:1: version: ", "missing");
}

static void test_version_2_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 2\n", "demo.yaml:1:10: version: ", "unsupported format version 2");
    expect_error("version: one\n", "demo.yaml:1:10: version: ", "'one'");
}

static void test_unknown_top_level_key_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\nworkers: 3\n", "demo.yaml:2:1: workers: ",
                 "unknown key (expected one of version, coordinator, deployments)");
}

static void test_unknown_nested_key_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ncoordinator:\n  heartbeat_ms: 100\n",
                 "demo.yaml:3:3: coordinator.heartbeat_ms: ",
                 "unknown key (expected one of workers_endpoint, control_endpoint, "
                 "heartbeat_interval_ms, worker_timeout_ms, max_workers, dead_worker_ttl_s, security, keys_dir, max_replays, replay_wait_ms, canary_interval_ms, canary_timeout_ms, http_endpoint, api_keys_file, reserve_spares, rebalance_interval_s)");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                 "    parallel:\n      data: 2\n",
                 "demo.yaml:6:7: deployments[0].parallel.data: ", "unknown key");
}

static void test_duplicate_key_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    model: n\n",
                 "demo.yaml:5:5: deployments[0].model: ",
                 "duplicate key (first given at line 4)");
    expect_error("version: 1\nversion: 1\n", "demo.yaml:2:1: version: ", "duplicate key");
}

static void test_wrong_node_type_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ncoordinator:\n  - a\n", "demo.yaml:3:3: coordinator: ",
                 "expected a mapping, got a sequence");
    expect_error("version: 1\ndeployments:\n  name: a\n", "demo.yaml:3:3: deployments: ",
                 "expected a sequence, got a mapping");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                 "    parallel: [1, 2]\n",
                 "demo.yaml:5:15: deployments[0].parallel: ",
                 "expected a mapping, got a sequence");
    expect_error("version: 1\ndeployments:\n  - name: [a]\n    model: m\n",
                 "demo.yaml:3:11: deployments[0].name: ", "expected a string, got a sequence");
    expect_error("- version: 1\n", "demo.yaml:1:1: (top level): ", "expected a mapping");
}

static const char par_head[] =
    "version: 1\ndeployments:\n  - name: a\n    model: m\n    parallel:\n";

static void expect_tensor_error(const char *value, const char *detail)
{
    char yaml[256];

    snprintf(yaml, sizeof yaml, "%s      tensor: %s\n", par_head, value);
    expect_error(yaml, "demo.yaml:6:15: deployments[0].parallel.tensor: ", detail);
}

static void test_non_integer_is_rejected(void **state)
{
    (void)state;
    expect_tensor_error("two", "expected a positive integer, got 'two'");
    expect_tensor_error("1.5", "got '1.5'");
    expect_tensor_error("0x10", "got '0x10'");
    expect_tensor_error("{a: 1}", "got a mapping");
    /* A quoted number is a string in YAML: the wrong type. */
    expect_tensor_error("\"2\"", "expected a positive integer, got the quoted string '2'");
}

static void test_zero_or_negative_is_rejected(void **state)
{
    (void)state;
    expect_tensor_error("0", "expected a positive integer, got '0'");
    expect_tensor_error("-3", "expected a positive integer, got '-3'");
}

static void test_overflow_is_rejected(void **state)
{
    (void)state;
    expect_tensor_error("2147483648", "too large");
    expect_tensor_error("99999999999999999999999", "too large");
}

/* ---- batching and memory keys -------------------------------------------- */

static const char batch_head[] =
    "version: 1\ndeployments:\n  - name: a\n    model: m\n";

/* Parses one deployment with `extra` (whole lines) after its name and model. */
static tsr_config_t *parse_batch(const char *extra)
{
    tsr_config_t *cfg = NULL;
    char yaml[512], err[512];

    snprintf(yaml, sizeof yaml, "%s%s", batch_head, extra);
    if (parse(yaml, "demo.yaml", &cfg, err, sizeof err) != 0)
        fail_msg("'%s' was refused: %s", extra, err);
    return cfg;
}

static void test_batching_keys_take_their_values(void **state)
{
    tsr_config_t *cfg;
    const tsr_deployment_t *d;

    (void)state;
    cfg = parse_batch("    max_batch: 64\n    prefill_chunk: 512\n"
                      "    kv_cache_mib: 4096\n    max_queue: 1000\n    gpu_memory_percent: 75\n"
                      "    collective_timeout_ms: 5000\n");
    d = &cfg->deployments[0];
    assert_int_equal(d->collective_timeout_ms, 5000);
    assert_int_equal(d->gpu_memory_percent, 75);
    assert_int_equal(d->max_batch, 64);
    assert_int_equal(d->prefill_chunk, 512);
    assert_int_equal(d->kv_cache_mib, 4096);
    assert_int_equal(d->max_queue, 1000);
    tsr_config_destroy(&cfg);
}

static void test_batching_keys_accept_both_ends_of_their_ranges(void **state)
{
    tsr_config_t *cfg;
    const tsr_deployment_t *d;

    (void)state;
    cfg = parse_batch("    max_batch: 1\n    prefill_chunk: 1\n"
                      "    kv_cache_mib: 1\n    max_queue: 0\n    collective_timeout_ms: 100\n");
    d = &cfg->deployments[0];
    assert_int_equal(d->collective_timeout_ms, 100);
    assert_int_equal(d->max_batch, 1);
    assert_int_equal(d->prefill_chunk, 1);
    assert_int_equal(d->kv_cache_mib, 1);
    assert_int_equal(d->max_queue, 0); /* no waiting: refuse when the batch is full */
    tsr_config_destroy(&cfg);

    cfg = parse_batch("    max_seq_len: 131072\n    max_batch: 1024\n"
                      "    prefill_chunk: 65536\n    kv_cache_mib: 16777216\n"
                      "    max_queue: 1000000\n    collective_timeout_ms: 3600000\n");
    d = &cfg->deployments[0];
    assert_int_equal(d->collective_timeout_ms, 3600000);
    assert_int_equal(d->max_batch, 1024);
    assert_int_equal(d->prefill_chunk, 65536);
    assert_int_equal(d->kv_cache_mib, 1 << 24);
    assert_int_equal(d->max_queue, 1000000);
    tsr_config_destroy(&cfg);
}

static void test_prefill_chunk_is_at_most_max_seq_len(void **state)
{
    tsr_config_t *cfg;

    (void)state;
    cfg = parse_batch("    max_seq_len: 256\n    prefill_chunk: 4096\n");
    assert_int_equal(cfg->deployments[0].prefill_chunk, 256);
    tsr_config_destroy(&cfg);
    /* The default chunk is clamped as well. */
    cfg = parse_batch("    max_seq_len: 64\n");
    assert_int_equal(cfg->deployments[0].prefill_chunk, 64);
    tsr_config_destroy(&cfg);
}

/* `key: value` on line 5 is refused with a message naming the file, line,
 * column of the value and the key, containing detail. */
static void expect_batch_error(const char *key, const char *value, const char *detail)
{
    char yaml[256], prefix[128];

    snprintf(yaml, sizeof yaml, "%s    %s: %s\n", batch_head, key, value);
    snprintf(prefix, sizeof prefix, "demo.yaml:5:%zu: deployments[0].%s: ",
             4 + strlen(key) + 2 + 1, key);
    expect_error(yaml, prefix, detail);
}

static void test_batching_keys_out_of_range_are_rejected(void **state)
{
    (void)state;
    expect_batch_error("max_batch", "0", "value '0' is out of range (1 to 1024)");
    expect_batch_error("max_batch", "1025", "value '1025' is out of range (1 to 1024)");
    expect_batch_error("prefill_chunk", "0", "out of range (1 to 65536)");
    expect_batch_error("prefill_chunk", "65537", "out of range (1 to 65536)");
    expect_batch_error("kv_cache_mib", "0", "out of range (1 to 16777216)");
    expect_batch_error("gpu_memory_percent", "9", "value '9' is out of range (10 to 99)");
    expect_batch_error("gpu_memory_percent", "100", "value '100' is out of range (10 to 99)");
    expect_batch_error("kv_cache_mib", "16777217", "out of range (1 to 16777216)");
    expect_batch_error("max_queue", "1000001", "out of range (0 to 1000000)");
    expect_batch_error("max_queue", "99999999999999999999999", "out of range (0 to 1000000)");
    expect_batch_error("collective_timeout_ms", "99", "value '99' is out of range (100 to 3600000)");
    expect_batch_error("collective_timeout_ms", "3600001", "out of range (100 to 3600000)");
    expect_batch_error("collective_timeout_ms", "30s", "expected an integer");
}

static void test_kv_dtype_takes_auto_f32_bf16_or_int8_and_cuda_refuses_f32_and_int8(void **state)
{
    (void)state;
    static const char *const names[] = {"auto", "f32", "bf16", "int8"};
    for (int k = 0; k < 4; k++) {
        char line[64];
        snprintf(line, sizeof line, "    kv_dtype: %s\n", names[k]);
        tsr_config_t *cfg = parse_batch(line);
        assert_int_equal(cfg->deployments[0].kv_dtype, k);
        assert_string_equal(tsr_kv_dtype_name(k), names[k]);
        tsr_config_destroy(&cfg);
    }
    assert_null(tsr_kv_dtype_name(4));
    /* auto stands for f32 on a cpu and bf16 on cuda; the others for themselves */
    assert_int_equal(tsr_kv_dtype_on(TSR_DEVICE_CPU, TSR_KV_AUTO), TSR_KV_F32);
    assert_int_equal(tsr_kv_dtype_on(TSR_DEVICE_CUDA, TSR_KV_AUTO), TSR_KV_BF16);
    assert_int_equal(tsr_kv_dtype_on(TSR_DEVICE_CPU, TSR_KV_BF16), TSR_KV_BF16);
    assert_int_equal(tsr_kv_dtype_on(TSR_DEVICE_CUDA, TSR_KV_F32), TSR_KV_F32);
    expect_batch_error("kv_dtype", "fp8", "expected auto, f32, bf16 or int8, got 'fp8'");
    expect_batch_error("kv_dtype", "F32", "expected auto, f32, bf16 or int8, got 'F32'");
    /* whichever key comes first, a cuda pool is bf16 only */
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    kv_dtype: f32\n"
                 "    device: cuda\n",
                 "demo.yaml:5:15: deployments[0].kv_dtype: ", "a cuda deployment keeps its KV cache in bf16");
    /* int8 is the CPU engine's alone */
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    device: cuda\n"
                 "    kv_dtype: int8\n",
                 "demo.yaml:6:15: deployments[0].kv_dtype: ",
                 "a cuda deployment keeps its KV cache in bf16; int8 is for cpu ones");
    tsr_config_t *cfg = parse_ok("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                                 "    device: cuda\n    kv_dtype: bf16\n", "demo.yaml");
    assert_int_equal(cfg->deployments[0].kv_dtype, TSR_KV_BF16);
    tsr_config_destroy(&cfg);
}

static void test_matmul_dtype_takes_auto_f32_or_bf16_and_cuda_refuses_f32(void **state)
{
    (void)state;
    static const char *const names[] = {"auto", "f32", "bf16"};
    for (int k = 0; k < 3; k++) {
        char line[64];
        snprintf(line, sizeof line, "    matmul_dtype: %s\n", names[k]);
        tsr_config_t *cfg = parse_batch(line);
        assert_int_equal(cfg->deployments[0].matmul_dtype, k);
        assert_int_equal(cfg->deployments[0].kv_dtype, TSR_KV_AUTO);   /* its own key */
        tsr_config_destroy(&cfg);
    }
    expect_batch_error("matmul_dtype", "int8", "expected auto, f32 or bf16, got 'int8'");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    matmul_dtype: f32\n"
                 "    device: cuda\n",
                 "demo.yaml:5:19: deployments[0].matmul_dtype: ",
                 "a cuda deployment keeps its weights in bf16");
    tsr_config_t *cfg = parse_ok("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                                 "    device: cuda\n    matmul_dtype: bf16\n", "demo.yaml");
    assert_int_equal(cfg->deployments[0].matmul_dtype, TSR_KV_BF16);
    tsr_config_destroy(&cfg);
}

/* weights_dtype: auto (the default) or int8 on cpu; fp8 is named as not
 * built, and int8 is refused on cuda and beside matmul_dtype bf16 (int8
 * weights multiply as integers), whichever order the keys come in. */
static void test_weights_dtype_takes_auto_or_int8_on_cpu(void **state)
{
    (void)state;
    tsr_config_t *cfg = parse_batch("    kv_dtype: bf16\n");
    assert_int_equal(cfg->deployments[0].weights_dtype, TSR_KV_AUTO);
    tsr_config_destroy(&cfg);
    cfg = parse_batch("    weights_dtype: int8\n");
    assert_int_equal(cfg->deployments[0].weights_dtype, TSR_KV_INT8);
    assert_int_equal(cfg->deployments[0].matmul_dtype, TSR_KV_AUTO);
    tsr_config_destroy(&cfg);
    cfg = parse_batch("    weights_dtype: auto\n");
    assert_int_equal(cfg->deployments[0].weights_dtype, TSR_KV_AUTO);
    tsr_config_destroy(&cfg);
    expect_batch_error("weights_dtype", "fp8", "expected auto or int8, got 'fp8' (fp8 weights "
                       "are not built yet)");
    expect_batch_error("weights_dtype", "bf16", "expected auto or int8, got 'bf16'");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    weights_dtype: int8\n"
                 "    device: cuda\n",
                 "demo.yaml:5:20: deployments[0].weights_dtype: ",
                 "a cuda deployment holds its weights in bf16; int8 is for cpu ones");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    weights_dtype: int8\n"
                 "    matmul_dtype: bf16\n",
                 "demo.yaml:5:20: deployments[0].weights_dtype: ",
                 "int8 weights multiply as integers, not in bf16");
}

static void test_batching_keys_of_the_wrong_type_are_rejected(void **state)
{
    (void)state;
    expect_batch_error("max_batch", "-1", "expected an integer from 1 to 1024, got '-1'");
    expect_batch_error("max_queue", "-1", "expected an integer from 0 to 1000000, got '-1'");
    expect_batch_error("prefill_chunk", "1.5", "got '1.5'");
    expect_batch_error("kv_cache_mib", "4GiB", "got '4GiB'");
    expect_batch_error("max_queue", "0x10", "got '0x10'");
    expect_batch_error("max_batch", "\"8\"", "got the quoted string '8'");
    expect_batch_error("kv_cache_mib", "[1]", "got a sequence");
}

static void test_duplicate_deployment_name_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n"
                 "  - name: a\n    model: n\n",
                 "demo.yaml:5:11: deployments[1].name: ",
                 "duplicate deployment name 'a' (also deployments[0], line 3)");
}

static void test_bad_name_chars_are_rejected(void **state)
{
    char yaml[256];

    (void)state;
    expect_error("version: 1\ndeployments:\n  - name: tiny model\n    model: m\n",
                 "demo.yaml:3:11: deployments[0].name: ", "invalid name 'tiny model'");
    expect_error("version: 1\ndeployments:\n  - name: a/b\n    model: m\n",
                 "demo.yaml:3:11: deployments[0].name: ", "invalid name");
    expect_error("version: 1\ndeployments:\n  - name: ''\n    model: m\n",
                 "demo.yaml:3:11: deployments[0].name: ", "invalid name");
    /* 65 characters: one over the limit. */
    snprintf(yaml, sizeof yaml, "version: 1\ndeployments:\n  - name: %065d\n    model: m\n", 0);
    expect_error(yaml, "demo.yaml:3:11: deployments[0].name: ", "invalid name");
}

static void test_missing_model_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ndeployments:\n  - name: a\n    device: cpu\n",
                 "demo.yaml:3:5: deployments[0].model: ", "required key missing");
    expect_error("version: 1\ndeployments:\n  - model: m\n",
                 "demo.yaml:3:5: deployments[0].name: ", "required key missing");
}

static void test_bad_device_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    device: tpu\n",
                 "demo.yaml:5:13: deployments[0].device: ", "expected cpu or cuda, got 'tpu'");
}

static void test_bad_endpoint_is_rejected(void **state)
{
    (void)state;
    /* YAML's null is no string: not a path "~" */
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: ~\n",
                 "demo.yaml:4:12: deployments[0].model: ", "expected a string, got null");
    expect_error("version: 1\ncoordinator:\n  control_endpoint: null\n",
                 "demo.yaml:3:21: coordinator.control_endpoint: ", "expected a string, got null");
    expect_error("version: 1\ncoordinator:\n  control_endpoint: http://x:1\n",
                 "demo.yaml:3:21: coordinator.control_endpoint: ",
                 "tcp://, ipc:// or inproc://, got 'http://x:1'");
    expect_error("version: 1\ncoordinator:\n  workers_endpoint: tcp://\n",
                 "demo.yaml:3:21: coordinator.workers_endpoint: ", "got 'tcp://'");
    expect_error("version: 1\ncoordinator:\n  workers_endpoint: tcp://0.0.0.0:99999\n",
                 "demo.yaml:3:21: coordinator.workers_endpoint: ",
                 "the port '99999' is not a number from 1 to 65535");
    expect_error("version: 1\ncoordinator:\n  control_endpoint: tcp://127.0.0.1:7401x\n",
                 "demo.yaml:3:21: coordinator.control_endpoint: ", "the port '7401x'");
    expect_error("version: 1\ncoordinator:\n  control_endpoint: tcp://300.0.0.1:7401\n",
                 "demo.yaml:3:21: coordinator.control_endpoint: ",
                 "'300.0.0.1' is not an IPv4 address");
    expect_error("version: 1\ncoordinator:\n  control_endpoint: tcp://[::1:7401\n",
                 "demo.yaml:3:21: coordinator.control_endpoint: ", "no closing ']'");
    char why[320];
    assert_true(tsr_endpoint_check("tcp://*:7400", why, sizeof why));
    assert_true(tsr_endpoint_check("tcp://[::1]:7400", why, sizeof why));
    assert_true(tsr_endpoint_check("tcp://gpu01.example:7400", why, sizeof why));
    assert_true(tsr_endpoint_check("tcp://10.0.0.1;10.0.0.2:7400", why, sizeof why));
    assert_true(tsr_endpoint_check("ipc:///tmp/x", why, sizeof why));
    assert_false(tsr_endpoint_check("tcp://gpu 01:7400", why, sizeof why));
}

static void test_timeout_not_above_heartbeat_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\ncoordinator:\n  heartbeat_interval_ms: 500\n"
                 "  worker_timeout_ms: 500\n",
                 "demo.yaml:4:22: coordinator.worker_timeout_ms: ",
                 "must be greater than heartbeat_interval_ms");
    /* Against the default timeout of 1000, reported at the mapping. */
    expect_error("version: 1\ncoordinator:\n  heartbeat_interval_ms: 2000\n",
                 "demo.yaml:3:3: coordinator.worker_timeout_ms: ", "(1000 <= 2000)");
}

static void test_second_document_is_rejected(void **state)
{
    (void)state;
    expect_error("version: 1\n---\nversion: 1\n", "demo.yaml:3:1: (document): ",
                 "only one YAML document");
}

static void test_messages_stay_on_one_line(void **state)
{
    (void)state;
    /* A block scalar holds newlines; the echo of it must not break the line. */
    expect_error("version: 1\ndeployments:\n  - name: |\n      a\n      b\n    model: m\n",
                 "demo.yaml:3:11: deployments[0].name: ", "invalid name 'a?b?'");
}

static void test_missing_file_is_reported(void **state)
{
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    assert_int_equal(tsr_config_load("/nonexistent/demo.yaml", &cfg, err, sizeof err), -1);
    assert_null(cfg);
    assert_string_equal(err, "/nonexistent/demo.yaml: No such file or directory");
}

static void test_oversized_file_is_rejected(void **state)
{
    size_t len = 1024 * 1024 + 1;
    char *big = malloc(len);
    char *dir = make_tmpdir();
    char *path;
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    assert_non_null(big);
    /* Valid YAML (one long comment after the version), only too big. */
    memset(big, '#', len);
    memcpy(big, "version: 1\n", 11);
    big[len - 1] = '\n';
    path = write_file(dir, "big.yaml", big, len);
    assert_int_equal(tsr_config_load(path, &cfg, err, sizeof err), -1);
    assert_null(cfg);
    assert_non_null(strstr(err, "big.yaml: too large"));
    assert_int_equal(tsr_config_parse(big, len, "big.yaml", &cfg, err, sizeof err), -1);
    assert_non_null(strstr(err, "big.yaml: too large"));
    /* One byte less is accepted. */
    big[len - 2] = '\n';
    assert_int_equal(tsr_config_parse(big, len - 1, "big.yaml", &cfg, err, sizeof err), 0);
    tsr_config_destroy(&cfg);
    free(big);
    remove_file_and_dir(path, dir);
}

/* ---- model config ------------------------------------------------------- */

static const char model_json[] =
    "{\n"
    "  \"architectures\": [\"LlamaForCausalLM\"],\n"
    "  \"hidden_size\": 768,\n"
    "  \"intermediate_size\": 2048,\n"
    "  \"num_hidden_layers\": 10,\n"
    "  \"num_attention_heads\": 12,\n"
    "  \"vocab_size\": 32000,\n"
    "  \"max_position_embeddings\": 1024,\n"
    "  \"tie_word_embeddings\": true,\n"
    "  \"torch_dtype\": \"float32\"\n"
    "}\n";

/* Writes text as DIR/config.json and loads it; returns the load's result. */
static int load_model_json(const char *text, tsr_model_info_t *m, char *err,
                           size_t errlen, char **dir_out)
{
    char *dir = make_tmpdir();
    char *path = write_file(dir, "config.json", text, strlen(text));
    int rc;

    err[0] = '\0';
    rc = tsr_model_info_load(dir, m, err, errlen);
    unlink(path);
    free(path);
    *dir_out = dir;
    return rc;
}

static void done_dir(char *dir)
{
    rmdir(dir);
    free(dir);
}

static void test_model_config_loads_with_defaults(void **state)
{
    tsr_model_info_t m;
    char err[512], *dir;

    (void)state;
    assert_int_equal(load_model_json(model_json, &m, err, sizeof err, &dir), 0);
    assert_int_equal(m.hidden_size, 768);
    assert_int_equal(m.intermediate_size, 2048);
    assert_int_equal(m.num_hidden_layers, 10);
    assert_int_equal(m.num_attention_heads, 12);
    assert_int_equal(m.num_key_value_heads, 12); /* defaulted to heads */
    assert_int_equal(m.vocab_size, 32000);
    assert_int_equal(m.max_position_embeddings, 1024);
    assert_int_equal(m.tie_word_embeddings, 1);
    assert_int_equal(m.dtype_bytes, 4);
    done_dir(dir);

    assert_int_equal(load_model_json("{\"hidden_size\": 64, \"intermediate_size\": 128,"
                                     "\"num_hidden_layers\": 2, \"num_attention_heads\": 8,"
                                     "\"num_key_value_heads\": 2, \"vocab_size\": 100,"
                                     "\"max_position_embeddings\": 64}",
                                     &m, err, sizeof err, &dir), 0);
    assert_int_equal(m.num_key_value_heads, 2);
    assert_int_equal(m.tie_word_embeddings, 0);
    assert_int_equal(m.dtype_bytes, 2); /* no torch_dtype */
    done_dir(dir);
}

static void test_model_config_missing_field_is_named(void **state)
{
    tsr_model_info_t m;
    char err[512], *dir, *want = NULL;

    (void)state;
    assert_int_equal(load_model_json("{\"hidden_size\": 64, \"intermediate_size\": 128,"
                                     "\"num_attention_heads\": 8, \"vocab_size\": 100,"
                                     "\"max_position_embeddings\": 64}",
                                     &m, err, sizeof err, &dir), -1);
    assert_true(asprintf(&want, "%s/config.json: num_hidden_layers missing or not a "
                         "positive integer", dir) > 0);
    assert_string_equal(err, want);
    free(want);
    done_dir(dir);

    assert_int_equal(load_model_json("{\"hidden_size\": 64, \"intermediate_size\": 128,"
                                     "\"num_hidden_layers\": 2, \"num_attention_heads\": 8,"
                                     "\"vocab_size\": 100, \"max_position_embeddings\": 64,"
                                     "\"torch_dtype\": \"int8\"}",
                                     &m, err, sizeof err, &dir), -1);
    assert_non_null(strstr(err, "config.json: torch_dtype 'int8' not supported"));
    done_dir(dir);
}

static void test_model_config_bad_json_is_reported(void **state)
{
    tsr_model_info_t m;
    char err[512], *dir;

    (void)state;
    assert_int_equal(load_model_json("{\"hidden_size\": 64,\n", &m, err, sizeof err, &dir), -1);
    assert_non_null(strstr(err, dir));
    assert_non_null(strstr(err, "/config.json:"));
    assert_non_null(strstr(err, "invalid JSON"));
    done_dir(dir);

    assert_int_equal(tsr_model_info_load("/nonexistent", &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "/nonexistent/config.json"));
}

/* A model shaped like model_json, without touching the file system. */
static tsr_model_info_t small_model(void)
{
    tsr_model_info_t m = {
        .hidden_size = 768, .intermediate_size = 2048, .num_hidden_layers = 10,
        .num_attention_heads = 12, .num_key_value_heads = 12, .vocab_size = 32000,
        .max_position_embeddings = 1024, .tie_word_embeddings = 0, .dtype_bytes = 2,
    };
    return m;
}

static void layout_of(const char *parallel, tsr_config_t **cfg)
{
    char yaml[512], err[512];

    snprintf(yaml, sizeof yaml,
             "version: 1\n"
             "deployments:\n"
             "  - name: other\n"
             "    model: models/other\n"
             "  - name: tiny\n"
             "    model: models/tiny\n"
             "    parallel: %s\n", parallel);
    assert_int_equal(parse(yaml, "demo.yaml", cfg, err, sizeof err), 0);
}

static void test_layout_heads_not_divisible_by_tensor_is_rejected(void **state)
{
    tsr_model_info_t m = small_model();
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    layout_of("{tensor: 5}", &cfg);
    assert_int_equal(tsr_model_check_layout(&m, &cfg->deployments[1], 1, cfg->path,
                                            err, sizeof err), -1);
    assert_string_equal(err, "demo.yaml:5:5: deployments[1] (tiny): models/tiny/config.json: "
                        "num_attention_heads 12 is not divisible by parallel.tensor 5");
    tsr_config_destroy(&cfg);

    /* 12 heads split over 3 ranks is fine, but 4 KV heads are not. */
    m.num_key_value_heads = 4;
    layout_of("{tensor: 3}", &cfg);
    assert_int_equal(tsr_model_check_layout(&m, &cfg->deployments[1], 1, NULL,
                                            err, sizeof err), -1);
    assert_non_null(strstr(err, "<input>:5:5: deployments[1] (tiny)"));
    assert_non_null(strstr(err, "num_key_value_heads 4 is not divisible by parallel.tensor 3"));
    tsr_config_destroy(&cfg);

    layout_of("{tensor: 4, pipeline: 10}", &cfg);
    assert_int_equal(tsr_model_check_layout(&m, &cfg->deployments[1], 1, cfg->path,
                                            err, sizeof err), 0);
    tsr_config_destroy(&cfg);
}

static void test_layout_more_stages_than_layers_is_rejected(void **state)
{
    tsr_model_info_t m = small_model();
    tsr_config_t *cfg = NULL;
    char err[512];

    (void)state;
    layout_of("{pipeline: 11}", &cfg);
    assert_int_equal(tsr_model_check_layout(&m, &cfg->deployments[1], 1, cfg->path,
                                            err, sizeof err), -1);
    assert_non_null(strstr(err, "demo.yaml:5:5: deployments[1] (tiny)"));
    assert_non_null(strstr(err, "parallel.pipeline 11 exceeds num_hidden_layers 10"));
    tsr_config_destroy(&cfg);
}

static void test_layer_split_is_even_and_contiguous(void **state)
{
    static const int want[4][2] = { { 0, 3 }, { 3, 6 }, { 6, 8 }, { 8, 10 } };
    int n, stages, s, b, e, next;

    (void)state;
    for (s = 0; s < 4; s++) {
        tsr_layer_split(10, 4, s, &b, &e);
        assert_int_equal(b, want[s][0]);
        assert_int_equal(e, want[s][1]);
    }
    /* Every split covers [0, n) without gaps, sizes differ by at most one. */
    for (n = 1; n <= 40; n++) {
        for (stages = 1; stages <= n; stages++) {
            for (s = 0, next = 0; s < stages; s++) {
                tsr_layer_split(n, stages, s, &b, &e);
                assert_int_equal(b, next);
                assert_in_range(e - b, n / stages, n / stages + 1);
                next = e;
            }
            assert_int_equal(next, n);
        }
    }
}

static void test_piece_bytes_are_what_tp_rank_0_holds(void **state)
{
    tsr_model_info_t m = {
        .hidden_size = 64, .intermediate_size = 160, .num_hidden_layers = 6,
        .num_attention_heads = 8, .num_key_value_heads = 2, .vocab_size = 1000,
        .max_position_embeddings = 128, .tie_word_embeddings = 0, .dtype_bytes = 2,
        .head_dim = 8,
    };
    /* Per layer: q,o 2*64*64 + k,v 2*64*16 + mlp 3*64*160 + norms 2*64 = 41088;
     * 6 layers + embedding 64000 + head 64000 + final norm 64, 2 bytes each. */
    const uint64_t whole = (6 * 41088ULL + 64000 + 64000 + 64) * 2;
    static const int stage_counts[] = { 1, 2, 3, 6 };
    (void)state;
    /* Without tensor parallelism the stages hold the model exactly once. */
    assert_int_equal(tsr_model_piece_bytes(&m, 1, 0, 1), whole);
    for (size_t i = 0; i < sizeof stage_counts / sizeof stage_counts[0]; i++) {
        uint64_t sum = 0;
        for (int s = 0; s < stage_counts[i]; s++) sum += tsr_model_piece_bytes(&m, stage_counts[i], s, 1);
        assert_int_equal(sum, whole);
    }
    /* tp 2, pp 2: each rank holds half of every matrix, whole norms and
     * half of the vocabulary (500 rows). Stage 0: 3 layers of
     * (8192 + 2048 + 30720) / 2 + 128, and the embedding's 500 rows. */
    assert_int_equal(tsr_model_piece_bytes(&m, 2, 0, 2), (3 * 20608ULL + 32000) * 2);
    assert_int_equal(tsr_model_piece_bytes(&m, 2, 1, 2), (3 * 20608ULL + 32000 + 64) * 2);
    /* A vocabulary that does not divide: rank 0 has the wider chunk, ceil(1000/3). */
    m.num_attention_heads = 6, m.num_key_value_heads = 3, m.intermediate_size = 150;
    m.head_dim = 8;
    tsr_slice_t sl;
    assert_int_equal(tsr_slice_of(&m, TSR_T_EMBED, 0, 3, &sl), 0);
    assert_int_equal(sl.r1 - sl.r0, 334);

    /* Tied: one pp stage shares the embedding; with two, the last needs a copy. */
    m = (tsr_model_info_t){
        .hidden_size = 64, .intermediate_size = 160, .num_hidden_layers = 6,
        .num_attention_heads = 8, .num_key_value_heads = 2, .vocab_size = 1000,
        .max_position_embeddings = 128, .tie_word_embeddings = 1, .dtype_bytes = 2,
        .head_dim = 8,
    };
    assert_int_equal(tsr_model_piece_bytes(&m, 1, 0, 1), whole - 64000 * 2);
    assert_int_equal(tsr_model_piece_bytes(&m, 2, 0, 1) + tsr_model_piece_bytes(&m, 2, 1, 1),
                     whole);
}

/* The worker-side check of one piece: each rule, and its message naming
 * the model's config.json. */
static void test_check_piece_rules_name_config_json(void **state)
{
    (void)state;
    tsr_model_info_t m = {.hidden_size = 64, .num_hidden_layers = 8, .num_attention_heads = 8,
                          .num_key_value_heads = 4, .intermediate_size = 690, .head_dim = 8};
    char err[512];
    assert_int_equal(tsr_model_check_piece(&m, "/m", 1, 2, 1, 2, 4, 8, err, sizeof err), 0);
    assert_int_equal(tsr_model_check_piece(&m, "/m", 0, 4, 0, 1, 0, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "/m/config.json: 8 attention heads, 4 KV heads and "
                                "intermediate_size 690 cannot be split 4 ways"));
    assert_int_equal(tsr_model_check_piece(&m, "/m", 0, 1, 1, 2, 4, 9, err, sizeof err), -1);
    assert_non_null(strstr(err, "layers [4,9) do not fit a model of 8 layers"));
    assert_int_equal(tsr_model_check_piece(&m, "/m", 0, 1, 1, 2, 4, 4, err, sizeof err), -1);
    assert_non_null(strstr(err, "layers [4,4)"));
    assert_int_equal(tsr_model_check_piece(&m, "/m", 2, 2, 0, 1, 0, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "impossible piece: stage 0 of 1, tp 2 of 2"));
    m.head_dim = 7;
    assert_int_equal(tsr_model_check_piece(&m, "/m", 0, 1, 0, 1, 0, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "head_dim 7 is odd"));
}

static void test_max_workers_and_dead_worker_ttl_are_read_and_range_checked(void **state)
{
    (void)state;
    tsr_config_t *cfg = NULL;
    const char *ok = "version: 1\ncoordinator:\n  max_workers: 10\n  dead_worker_ttl_s: 30\n";
    cfg = parse_ok(ok, "demo.yaml");
    assert_int_equal(cfg->max_workers, 10);
    assert_int_equal(cfg->dead_worker_ttl_s, 30);
    tsr_config_destroy(&cfg);
    expect_error("version: 1\ncoordinator:\n  max_workers: 10001\n",
                 "demo.yaml:3:16: coordinator.max_workers: ", "10000");
    expect_error("version: 1\ncoordinator:\n  dead_worker_ttl_s: 0\n",
                 "demo.yaml:3:22: coordinator.dead_worker_ttl_s: ", "604800");
    /* Replay and canary: defaults, values, ranges. */
    const char *d = "version: 1\n";
    cfg = parse_ok(d, "demo.yaml");
    assert_int_equal(cfg->max_replays, 3);
    assert_int_equal(cfg->replay_wait_ms, 30000);
    assert_int_equal(cfg->canary_interval_ms, 5000);
    assert_int_equal(cfg->canary_timeout_ms, 2000);
    tsr_config_destroy(&cfg);
    d = "version: 1\ncoordinator:\n  max_replays: 0\n  replay_wait_ms: 3600000\n";
    cfg = parse_ok(d, "demo.yaml");
    assert_int_equal(cfg->max_replays, 0);
    assert_int_equal(cfg->replay_wait_ms, 3600000);
    tsr_config_destroy(&cfg);
    expect_error("version: 1\ncoordinator:\n  max_replays: 101\n",
                 "demo.yaml:3:16: coordinator.max_replays: ", "100");
    expect_error("version: 1\ncoordinator:\n  replay_wait_ms: -1\n",
                 "demo.yaml:3:19: coordinator.replay_wait_ms: ", "3600000");
    /* The canary off, and the gap between 0 and 100. */
    d = "version: 1\ncoordinator:\n  canary_interval_ms: 0\n  canary_timeout_ms: 600000\n";
    cfg = parse_ok(d, "demo.yaml");
    assert_int_equal(cfg->canary_interval_ms, 0);
    assert_int_equal(cfg->canary_timeout_ms, 600000);
    tsr_config_destroy(&cfg);
    expect_error("version: 1\ncoordinator:\n  canary_interval_ms: 50\n",
                 "demo.yaml:3:23: coordinator.canary_interval_ms: ", "0 (off) or 100");
    expect_error("version: 1\ncoordinator:\n  canary_timeout_ms: 0\n",
                 "demo.yaml:3:22: coordinator.canary_timeout_ms: ", "600000");
}

/* The HTTP server's keys: HOST:PORT with a numeric host, keys file beside it, and the
 * chat template names. */
static void test_http_endpoint_api_keys_and_chat_template(void **state)
{
    (void)state;
    tsr_config_t *cfg = parse_ok("version: 1\n", "demo.yaml");
    assert_null(cfg->http_endpoint);  /* no key, no server */
    assert_null(cfg->api_keys_file);
    tsr_config_destroy(&cfg);
    cfg = parse_ok("version: 1\ncoordinator:\n  http_endpoint: localhost:8000\n"
                   "  api_keys_file: keys.txt\n", "conf/demo.yaml");
    assert_string_equal(cfg->http_endpoint, "localhost:8000");
    assert_string_equal(cfg->http_host, "127.0.0.1");
    assert_int_equal(cfg->http_port, 8000);
    assert_non_null(strstr(cfg->api_keys_file, "conf/keys.txt"));
    tsr_config_destroy(&cfg);
    cfg = parse_ok("version: 1\ncoordinator:\n  http_endpoint: \"[::1]:80\"\n", "demo.yaml");
    assert_string_equal(cfg->http_host, "::1");
    tsr_config_destroy(&cfg);
    expect_error("version: 1\ncoordinator:\n  http_endpoint: 127.0.0.1\n",
                 "demo.yaml:3:18: coordinator.http_endpoint: ", "HOST:PORT");
    expect_error("version: 1\ncoordinator:\n  http_endpoint: 127.0.0.1:70000\n",
                 "demo.yaml:3:18: coordinator.http_endpoint: ", "1 to 65535");
    expect_error("version: 1\ncoordinator:\n  http_endpoint: example.com:80\n",
                 "demo.yaml:3:18: coordinator.http_endpoint: ", "numeric IPv4");
    expect_error("version: 1\ncoordinator:\n  api_keys_file: k\n",
                 "demo.yaml:3:18: coordinator.api_keys_file: ", "set coordinator.http_endpoint");
    expect_error("version: 1\ndeployments:\n  - name: a\n    model: m\n    chat_template: jinja\n",
                 "demo.yaml:5:20: deployments[0].chat_template: ", "llama2, llama3, chatml or mistral");
    cfg = parse_ok("version: 1\ndeployments:\n  - name: a\n    model: m\n    chat_template: chatml\n",
                   "demo.yaml");
    assert_string_equal(cfg->deployments[0].chat_template, "chatml");
    tsr_config_destroy(&cfg);
}

static void test_security_defaults_to_curve_with_the_standard_key_store(void **state)
{
    (void)state;
    tsr_config_t *cfg = NULL;
    const char *y = "version: 1\n";
    cfg = parse_ok(y, "conf/demo.yaml");
    assert_false(cfg->security_none);
    assert_string_equal(cfg->keys_dir, "/etc/tessera/keys");
    tsr_config_destroy(&cfg);
    /* A relative keys_dir is taken from the file's directory, like models. */
    y = "version: 1\ncoordinator:\n  security: curve\n  keys_dir: keys\n";
    cfg = parse_ok(y, "conf/demo.yaml");
    assert_false(cfg->security_none);
    assert_string_equal(cfg->keys_dir, "conf/keys");
    tsr_config_destroy(&cfg);
    expect_error("version: 1\ncoordinator:\n  security: tls\n",
                 "demo.yaml:3:13: coordinator.security: ", "expected curve or none, got 'tls'");
    expect_error("version: 1\ncoordinator:\n  keys_dir: ''\n",
                 "demo.yaml:3:13: coordinator.keys_dir: ", "directory path");
}

/* security: none only where nobody else can connect: every endpoint on
 * loopback (or ipc/inproc); the default workers endpoint (0.0.0.0) is not. */
static void test_security_none_is_refused_unless_every_endpoint_is_loopback(void **state)
{
    (void)state;
    tsr_config_t *cfg = NULL;
    char err[512] = "";
    const char *ok[] = {
        "version: 1\ncoordinator:\n  workers_endpoint: tcp://127.0.0.1:7400\n"
        "  control_endpoint: tcp://127.0.0.1:7401\n  security: none\n",
        "version: 1\ncoordinator:\n  workers_endpoint: tcp://localhost:7400\n"
        "  control_endpoint: ipc:///tmp/tsr.ctl\n  security: none\n",
        "version: 1\ncoordinator:\n  workers_endpoint: tcp://127.3.2.1:7400\n"
        "  control_endpoint: tcp://[::1]:7401\n  security: none\n",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        if (tsr_config_parse(ok[i], strlen(ok[i]), "demo.yaml", &cfg, err, sizeof err) < 0)
            fail_msg("%zu: %s", i, err);
        assert_true(cfg->security_none);
        tsr_config_destroy(&cfg);
    }
    expect_error("version: 1\ncoordinator:\n  security: none\n",
                 "demo.yaml:3:13: coordinator.security: ",
                 "none is allowed only when every endpoint is loopback, and tcp://0.0.0.0:7400");
    expect_error("version: 1\ncoordinator:\n  workers_endpoint: tcp://127.0.0.1:7400\n"
                 "  control_endpoint: tcp://10.0.0.5:7401\n  security: none\n",
                 "demo.yaml:5:13: coordinator.security: ", "tcp://10.0.0.5:7401 is not");
    /* A host name that merely starts like a loopback address is not one. */
    expect_error("version: 1\ncoordinator:\n  workers_endpoint: tcp://127.0.0.1.evil.net:7400\n"
                 "  control_endpoint: tcp://127.0.0.1:7401\n  security: none\n",
                 "demo.yaml:5:13: coordinator.security: ", "127.0.0.1.evil.net");
    assert_false(tsr_endpoint_is_local("tcp://eth0;192.168.1.2:7400"));
    assert_false(tsr_endpoint_is_local("tcp://0.0.0.0;127.0.0.1:7400"));
    assert_false(tsr_endpoint_is_local("tcp://*:7400"));
}

/* Attack 13: a 200 KB file nested 100,000 deep took 24 s to refuse. */
static void test_deep_nesting_is_refused_at_once_naming_the_cap(void **state)
{
    (void)state;
    size_t depth = 100000;
    char *buf = malloc(2 * depth + 32);
    assert_non_null(buf);
    size_t n = (size_t)sprintf(buf, "version: 1\ndeployments: ");
    for (size_t i = 0; i < depth; i++) buf[n++] = '[';
    for (size_t i = 0; i < depth; i++) buf[n++] = ']';
    buf[n++] = '\n';
    buf[n] = '\0';
    tsr_config_t *cfg = NULL;
    char err[512] = "";
    int64_t t0 = tsr_now_ms();
    assert_int_equal(tsr_config_parse(buf, n, "deep.yaml", &cfg, err, sizeof err), -1);
    int64_t took = tsr_now_ms() - t0;
    free(buf);
    assert_null(cfg);
    assert_non_null(strstr(err, "nested more than 32 levels deep"));
    assert_non_null(strstr(err, "deep.yaml:2:"));
    assert_true(took < 500);
    /* Block style too: "- - - - ..." */
    char block[4096] = "version: 1\ndeployments:\n";
    for (int i = 0; i < 40; i++) strcat(block, "- ");
    strcat(block, "x\n");
    assert_int_equal(tsr_config_parse(block, strlen(block), "deep.yaml", &cfg, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "nested more than 32"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_file_loads_every_field_and_defaults),
        cmocka_unit_test(test_minimal_file_gets_coordinator_defaults),
        cmocka_unit_test(test_largest_int_is_accepted),
        cmocka_unit_test(test_relative_model_path_resolved_against_yaml_dir),
        cmocka_unit_test(test_load_reads_file_and_resolves_against_its_dir),
        cmocka_unit_test(test_device_names_round_trip),
        cmocka_unit_test(test_parallel_auto_and_its_keys),
        cmocka_unit_test(test_prefix_cache_and_kv_admission),
        cmocka_unit_test(test_a_range_of_replicas_and_its_keys),
        cmocka_unit_test(test_syntax_error_reports_libyaml_problem_and_position),
        cmocka_unit_test(test_missing_version_is_rejected),
        cmocka_unit_test(test_version_2_is_rejected),
        cmocka_unit_test(test_unknown_top_level_key_is_rejected),
        cmocka_unit_test(test_unknown_nested_key_is_rejected),
        cmocka_unit_test(test_max_workers_and_dead_worker_ttl_are_read_and_range_checked),
        cmocka_unit_test(test_deep_nesting_is_refused_at_once_naming_the_cap),
        cmocka_unit_test(test_http_endpoint_api_keys_and_chat_template),
        cmocka_unit_test(test_security_defaults_to_curve_with_the_standard_key_store),
        cmocka_unit_test(test_security_none_is_refused_unless_every_endpoint_is_loopback),
        cmocka_unit_test(test_duplicate_key_is_rejected),
        cmocka_unit_test(test_wrong_node_type_is_rejected),
        cmocka_unit_test(test_non_integer_is_rejected),
        cmocka_unit_test(test_zero_or_negative_is_rejected),
        cmocka_unit_test(test_overflow_is_rejected),
        cmocka_unit_test(test_batching_keys_take_their_values),
        cmocka_unit_test(test_batching_keys_accept_both_ends_of_their_ranges),
        cmocka_unit_test(test_prefill_chunk_is_at_most_max_seq_len),
        cmocka_unit_test(test_batching_keys_out_of_range_are_rejected),
        cmocka_unit_test(test_batching_keys_of_the_wrong_type_are_rejected),
        cmocka_unit_test(test_kv_dtype_takes_auto_f32_bf16_or_int8_and_cuda_refuses_f32_and_int8),
        cmocka_unit_test(test_matmul_dtype_takes_auto_f32_or_bf16_and_cuda_refuses_f32),
        cmocka_unit_test(test_weights_dtype_takes_auto_or_int8_on_cpu),
        cmocka_unit_test(test_duplicate_deployment_name_is_rejected),
        cmocka_unit_test(test_bad_name_chars_are_rejected),
        cmocka_unit_test(test_missing_model_is_rejected),
        cmocka_unit_test(test_bad_device_is_rejected),
        cmocka_unit_test(test_bad_endpoint_is_rejected),
        cmocka_unit_test(test_timeout_not_above_heartbeat_is_rejected),
        cmocka_unit_test(test_second_document_is_rejected),
        cmocka_unit_test(test_messages_stay_on_one_line),
        cmocka_unit_test(test_missing_file_is_reported),
        cmocka_unit_test(test_oversized_file_is_rejected),
        cmocka_unit_test(test_model_config_loads_with_defaults),
        cmocka_unit_test(test_model_config_missing_field_is_named),
        cmocka_unit_test(test_model_config_bad_json_is_reported),
        cmocka_unit_test(test_layout_heads_not_divisible_by_tensor_is_rejected),
        cmocka_unit_test(test_layout_more_stages_than_layers_is_rejected),
        cmocka_unit_test(test_layer_split_is_even_and_contiguous),
        cmocka_unit_test(test_piece_bytes_are_what_tp_rank_0_holds),
        cmocka_unit_test(test_check_piece_rules_name_config_json),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
