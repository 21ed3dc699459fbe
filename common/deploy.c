/* deploy.c: the deployment file (format version 1).
 *
 * The whole stream is loaded with libyaml's document API first, then walked
 * against a fixed schema.  The walk stops at the first error and reports it
 * as "FILE:LINE:COL: KEYPATH: problem"; positions come from the nodes'
 * start marks (0-based in libyaml, 1-based in messages). */
#include "deploy.h"
#include "modelcfg.h"
#include "util.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>
#include <arpa/inet.h>

#define TSR_CONFIG_MAX_BYTES (1024 * 1024)
#define PATH_MAX_LEN 256
#define NAME_MAX_LEN 64
#define QUOTE_MAX 40 /* longest value echoed back in a message */

/* ---- devices ------------------------------------------------------------ */

const char *tsr_device_name(tsr_device_t d)
{
    return d == TSR_DEVICE_CUDA ? "cuda" : "cpu";
}

int tsr_device_parse(const char *s, tsr_device_t *out)
{
    if (s == NULL)
        return -1;
    if (strcmp(s, "cpu") == 0) {
        *out = TSR_DEVICE_CPU;
        return 0;
    }
    if (strcmp(s, "cuda") == 0) {
        *out = TSR_DEVICE_CUDA;
        return 0;
    }
    return -1;
}

/* ---- parse context and errors ------------------------------------------- */

typedef struct {
    yaml_document_t *doc;
    const char *file;           /* for messages: never NULL */
    const char *file_for_paths; /* the caller's name: may be NULL */
    char *err;
    size_t errlen;
} pctx_t;

/* Messages must stay on one line whatever the file name or value held. */
static void flatten(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

static void fail_at(pctx_t *c, int line0, int col0, const char *path,
                    const char *fmt, ...)
{
    char what[512];
    va_list ap;

    if (c->err == NULL || c->errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(c->err, c->errlen, "%s:%d:%d: %s: %s", c->file, line0 + 1,
             col0 + 1, path, what);
    flatten(c->err);
}

#define fail(c, node, path, ...)                                              \
    fail_at((c), (int)(node)->start_mark.line, (int)(node)->start_mark.column, \
            (path), __VA_ARGS__)

static void fail_plain(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    flatten(err);
}

static const char *node_kind(const yaml_node_t *n)
{
    switch (n->type) {
    case YAML_MAPPING_NODE: return "a mapping";
    case YAML_SEQUENCE_NODE: return "a sequence";
    case YAML_SCALAR_NODE: return "a scalar";
    default: return "nothing";
    }
}

/* A scalar's text, cut short for messages: values can be long block scalars. */
static void quote_value(const yaml_node_t *n, char *buf, size_t size)
{
    size_t len = n->data.scalar.length;
    size_t keep = len > QUOTE_MAX ? QUOTE_MAX : len;

    snprintf(buf, size, "%.*s%s", (int)keep, (const char *)n->data.scalar.value,
             len > keep ? "..." : "");
}

/* A plain empty, "~" or "null" scalar: YAML's spelling of "no value". */
static int is_null(const yaml_node_t *n)
{
    const char *v = (const char *)n->data.scalar.value;

    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return 0;
    return v[0] == '\0' || strcmp(v, "~") == 0 || strcmp(v, "null") == 0 ||
           strcmp(v, "Null") == 0 || strcmp(v, "NULL") == 0;
}

static void path_key(char *out, const char *parent, const char *key)
{
    if (parent[0] == '\0')
        snprintf(out, PATH_MAX_LEN, "%s", key);
    else
        snprintf(out, PATH_MAX_LEN, "%s.%s", parent, key);
}

/* ---- schema helpers ----------------------------------------------------- */

/* Validates every key of mapping `map` against `allowed` (n names) and stores
 * each value node in vals[i] (NULL when the key is absent).  Unknown keys,
 * duplicates and non-scalar keys are errors. */
static int map_fields(pctx_t *c, yaml_node_t *map, const char *path,
                      const char *const *allowed, size_t n, yaml_node_t **vals)
{
    yaml_node_t *keys[24] = { 0 };
    yaml_node_pair_t *p;
    char kpath[PATH_MAX_LEN];
    char list[512];
    size_t i, used = 0;

    if (n > sizeof keys / sizeof keys[0])
        return -1; /* a schema table larger than this is a programming error */
    for (i = 0; i < n; i++)
        vals[i] = NULL;
    for (p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(c->doc, p->key);
        yaml_node_t *v = yaml_document_get_node(c->doc, p->value);
        const char *ks;

        if (k->type != YAML_SCALAR_NODE) {
            fail(c, k, path[0] ? path : "(top level)",
                 "expected a plain key, got %s", node_kind(k));
            return -1;
        }
        ks = (const char *)k->data.scalar.value;
        path_key(kpath, path, ks);
        for (i = 0; i < n; i++)
            if (strcmp(ks, allowed[i]) == 0)
                break;
        if (i == n) {
            list[0] = '\0';
            for (i = 0, used = 0; i < n && used < sizeof list; i++)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s",
                                         i ? ", " : "", allowed[i]);
            fail(c, k, kpath, "unknown key (expected one of %s)", list);
            return -1;
        }
        if (vals[i] != NULL) {
            fail(c, k, kpath, "duplicate key (first given at line %d)",
                 (int)keys[i]->start_mark.line + 1);
            return -1;
        }
        keys[i] = k;
        vals[i] = v;
    }
    return 0;
}

static int want_mapping(pctx_t *c, yaml_node_t *n, const char *path)
{
    if (n->type == YAML_MAPPING_NODE)
        return 0;
    fail(c, n, path, "expected a mapping, got %s", node_kind(n));
    return -1;
}

/* An integer in [lo, hi], decimal digits only: YAML 1.1 would also read
 * 0x10, 1_000 or 1.5e3 as numbers, and accepting those silently would
 * surprise more than it helps.  The range is part of every message so the
 * fix is obvious; [1, INT_MAX] is said "a positive integer". */
static int get_int_range(pctx_t *c, yaml_node_t *n, const char *path, int lo, int hi,
                         int *out)
{
    const char *s;
    char q[QUOTE_MAX + 8], want[64];
    long long v = 0;
    size_t i;
    bool positive = lo == 1 && hi == INT_MAX;

    if (positive)
        snprintf(want, sizeof want, "a positive integer");
    else
        snprintf(want, sizeof want, "an integer from %d to %d", lo, hi);
    if (n->type != YAML_SCALAR_NODE) {
        fail(c, n, path, "expected %s, got %s", want, node_kind(n));
        return -1;
    }
    s = (const char *)n->data.scalar.value;
    quote_value(n, q, sizeof q);
    /* "2" in quotes is a string in YAML: a wrong type, not a number. */
    if (n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) {
        fail(c, n, path, "expected %s, got the quoted string '%s'", want, q);
        return -1;
    }
    if (n->data.scalar.length == 0)
        goto bad;
    for (i = 0; i < n->data.scalar.length; i++) {
        if (s[i] < '0' || s[i] > '9')
            goto bad;
        v = v * 10 + (s[i] - '0');
        if (v > hi)
            goto range; /* also stops long digit strings from overflowing */
    }
    if (v < lo)
        goto range;
    *out = (int)v;
    return 0;
range:
    if (!positive)
        fail(c, n, path, "value '%s' is out of range (%d to %d)", q, lo, hi);
    else if (v > hi)
        fail(c, n, path, "value '%s' is too large (at most %d)", q, INT_MAX);
    else
        goto bad;
    return -1;
bad:
    fail(c, n, path, "expected %s, got '%s'", want, q);
    return -1;
}

static int get_posint(pctx_t *c, yaml_node_t *n, const char *path, int *out)
{
    return get_int_range(c, n, path, 1, INT_MAX, out);
}

/* A plain number of milliseconds, above 0 and at most 10^6 (decimals allowed). */
static int get_ms(pctx_t *c, yaml_node_t *n, const char *path, double *out)
{
    char q[QUOTE_MAX + 8], *end;
    if (n->type != YAML_SCALAR_NODE) {
        fail(c, n, path, "expected a number of milliseconds, got %s", node_kind(n));
        return -1;
    }
    quote_value(n, q, sizeof q);
    const char *s = (const char *)n->data.scalar.value;
    double v = strtod(s, &end);
    if (n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE || !*s || *end || !(v > 0) || v > 1e6) {
        fail(c, n, path, "expected a number of milliseconds above 0 and at most 1000000, got '%s'",
             q);
        return -1;
    }
    *out = v;
    return 0;
}

/* Copies a scalar's text; an embedded NUL (possible with "\0" in double
 * quotes) would silently truncate it, so it is refused. */
static int get_string(pctx_t *c, yaml_node_t *n, const char *path, char **out)
{
    const char *s;

    if (n->type != YAML_SCALAR_NODE) {
        fail(c, n, path, "expected a string, got %s", node_kind(n));
        return -1;
    }
    s = (const char *)n->data.scalar.value;
    if (strlen(s) != n->data.scalar.length) {
        fail(c, n, path, "contains a NUL byte");
        return -1;
    }
    /* YAML's null, unquoted ("model: ~", "model:"), is no value: not the text "~" */
    if (is_null(n)) {
        fail(c, n, path, "expected a string, got null%s", *s ? " (quote it to mean the text)" : "");
        return -1;
    }
    *out = strdup(s);
    if (*out == NULL) {
        fail(c, n, path, "out of memory");
        return -1;
    }
    return 0;
}

/* true or false (YAML 1.1's yes/no/on/off are refused: they surprise). */
static int get_bool(pctx_t *c, yaml_node_t *n, const char *path, bool *out)
{
    const char *s = n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
    if (s && (!strcmp(s, "true") || !strcmp(s, "false"))) {
        *out = s[0] == 't';
        return 0;
    }
    fail(c, n, path, "expected true or false, got %s%.40s%s", s ? "'" : "", s ? s : node_kind(n),
         s ? "'" : "");
    return -1;
}

/* ---- coordinator -------------------------------------------------------- */

static int get_endpoint(pctx_t *c, yaml_node_t *n, const char *path, char **dst)
{
    static const char *const schemes[] = { "tcp://", "ipc://", "inproc://" };
    char *s = NULL;
    char q[QUOTE_MAX + 8];
    size_t i;
    int rc = -1;

    if (get_string(c, n, path, &s) < 0)
        goto out;
    for (i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
        if (strncmp(s, schemes[i], strlen(schemes[i])) == 0 &&
            s[strlen(schemes[i])] != '\0')
            break;
    char why[320];
    if (i == sizeof schemes / sizeof schemes[0]) {
        quote_value(n, q, sizeof q);
        fail(c, n, path, "expected an endpoint starting with tcp://, ipc:// or "
             "inproc://, got '%s'", q);
        goto out;
    }
    if (!tsr_endpoint_check(s, why, sizeof why)) {
        quote_value(n, q, sizeof q);
        fail(c, n, path, "'%s': %s", q, why);
        goto out;
    }
    free(*dst); /* replaces the default */
    *dst = s;
    s = NULL;
    rc = 0;
out:
    free(s);
    return rc;
}

static char *resolve_model(const char *file, const char *model);

/* http_endpoint: HOST:PORT with a numeric IPv4 host, [IPv6], or localhost. */
static int parse_http_endpoint(pctx_t *c, yaml_node_t *n, tsr_config_t *cfg)
{
    static const char *const path = "coordinator.http_endpoint";
    char *s = NULL;
    if (get_string(c, n, path, &s) < 0)
        return -1;
    char host[64] = "";
    const char *colon = strrchr(s, ':');
    size_t hl = colon ? (size_t)(colon - s) : 0;
    if (hl >= 2 && s[0] == '[' && s[hl - 1] == ']') {
        memcpy(host, s + 1, hl - 2 < sizeof host - 1 ? hl - 2 : sizeof host - 1);
    } else if (hl > 0 && hl < sizeof host) {
        memcpy(host, s, hl);
    }
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : 0;
    unsigned char addr[16];
    int ok = colon && end && !*end && end != colon + 1 && port >= 1 && port <= 65535 &&
             (!strcmp(host, "localhost") || inet_pton(AF_INET, host, addr) == 1 ||
              (s[0] == '[' && inet_pton(AF_INET6, host, addr) == 1));
    if (!ok) {
        char q[QUOTE_MAX + 8];
        quote_value(n, q, sizeof q);
        fail(c, n, path, "expected HOST:PORT with a numeric IPv4 address, [IPv6] or "
             "localhost, and a port 1 to 65535, e.g. 127.0.0.1:8000; got '%s'", q);
        free(s);
        return -1;
    }
    cfg->http_endpoint = s;
    snprintf(cfg->http_host, sizeof cfg->http_host, "%s",
             !strcmp(host, "localhost") ? "127.0.0.1" : host);
    cfg->http_port = (int)port;
    return 0;
}

static int parse_coordinator(pctx_t *c, yaml_node_t *n, tsr_config_t *cfg)
{
    static const char *const keys[] = { "workers_endpoint", "control_endpoint",
                                        "heartbeat_interval_ms", "worker_timeout_ms",
                                        "max_workers", "dead_worker_ttl_s",
                                        "security", "keys_dir", "max_replays",
                                        "replay_wait_ms", "canary_interval_ms",
                                        "canary_timeout_ms", "http_endpoint",
                                        "api_keys_file", "reserve_spares",
                                        "rebalance_interval_s" };
    yaml_node_t *v[16];

    if (is_null(n))
        return 0; /* "coordinator:" with nothing under it: all defaults */
    if (want_mapping(c, n, "coordinator") < 0 ||
        map_fields(c, n, "coordinator", keys, 16, v) < 0)
        return -1;
    if (v[0] && get_endpoint(c, v[0], "coordinator.workers_endpoint",
                             &cfg->workers_endpoint) < 0)
        return -1;
    if (v[1] && get_endpoint(c, v[1], "coordinator.control_endpoint",
                             &cfg->control_endpoint) < 0)
        return -1;
    if (v[2] && get_posint(c, v[2], "coordinator.heartbeat_interval_ms",
                           &cfg->heartbeat_interval_ms) < 0)
        return -1;
    if (v[3] && get_posint(c, v[3], "coordinator.worker_timeout_ms",
                           &cfg->worker_timeout_ms) < 0)
        return -1;
    if (v[4] && get_int_range(c, v[4], "coordinator.max_workers", 1, TSR_MAX_WORKERS_LIMIT,
                              &cfg->max_workers) < 0)
        return -1;
    if (v[5] && get_int_range(c, v[5], "coordinator.dead_worker_ttl_s", 1, 604800,
                              &cfg->dead_worker_ttl_s) < 0)
        return -1;
    if (v[8] && get_int_range(c, v[8], "coordinator.max_replays", 0, 100,
                              &cfg->max_replays) < 0)
        return -1;
    if (v[9] && get_int_range(c, v[9], "coordinator.replay_wait_ms", 0, 3600000,
                              &cfg->replay_wait_ms) < 0)
        return -1;
    if (v[10] && get_int_range(c, v[10], "coordinator.canary_interval_ms", 0, 3600000,
                               &cfg->canary_interval_ms) < 0)
        return -1;
    if (v[10] && cfg->canary_interval_ms > 0 && cfg->canary_interval_ms < 100) {
        fail(c, v[10], "coordinator.canary_interval_ms", "expected 0 (off) or 100 to 3600000, "
             "got %d", cfg->canary_interval_ms);
        return -1;
    }
    if (v[11] && get_int_range(c, v[11], "coordinator.canary_timeout_ms", 1, 600000,
                               &cfg->canary_timeout_ms) < 0)
        return -1;
    if (v[14] && get_int_range(c, v[14], "coordinator.reserve_spares", 0, TSR_MAX_WORKERS_LIMIT,
                               &cfg->reserve_spares) < 0)
        return -1;
    if (v[15] && get_int_range(c, v[15], "coordinator.rebalance_interval_s", 0, 86400,
                               &cfg->rebalance_interval_s) < 0)
        return -1;
    if (v[6]) {
        char *sec = NULL;
        char q[QUOTE_MAX + 8];
        if (get_string(c, v[6], "coordinator.security", &sec) < 0)
            return -1;
        int known = !strcmp(sec, "curve") || !strcmp(sec, "none");
        cfg->security_none = !strcmp(sec, "none");
        free(sec);
        if (!known) {
            quote_value(v[6], q, sizeof q);
            fail(c, v[6], "coordinator.security", "expected curve or none, got '%s'", q);
            return -1;
        }
        cfg->security_line = (int)v[6]->start_mark.line + 1;
        cfg->security_column = (int)v[6]->start_mark.column + 1;
    }
    if (v[7]) {
        char *dir = NULL;
        if (get_string(c, v[7], "coordinator.keys_dir", &dir) < 0)
            return -1;
        if (!dir[0] || strlen(dir) >= 4096) {
            fail(c, v[7], "coordinator.keys_dir", "expected a directory path of 1 to 4095 "
                 "characters");
            free(dir);
            return -1;
        }
        free(cfg->keys_dir);
        cfg->keys_dir = resolve_model(c->file_for_paths, dir);
        free(dir);
        if (cfg->keys_dir == NULL) {
            fail(c, v[7], "coordinator.keys_dir", "out of memory");
            return -1;
        }
    }
    if (v[12] && parse_http_endpoint(c, v[12], cfg) < 0)
        return -1;
    if (v[13]) {
        char *file = NULL;
        if (get_string(c, v[13], "coordinator.api_keys_file", &file) < 0)
            return -1;
        if (!file[0] || strlen(file) >= 4096) {
            fail(c, v[13], "coordinator.api_keys_file", "expected a file path of 1 to 4095 "
                 "characters");
            free(file);
            return -1;
        }
        cfg->api_keys_file = resolve_model(c->file_for_paths, file);
        free(file);
        if (cfg->api_keys_file == NULL) {
            fail(c, v[13], "coordinator.api_keys_file", "out of memory");
            return -1;
        }
        if (!cfg->http_endpoint) {
            fail(c, v[13], "coordinator.api_keys_file", "is for the HTTP server: set "
                 "coordinator.http_endpoint too");
            return -1;
        }
    }
    /* Without CURVE anyone who can reach an endpoint can speak for a worker
     * or a client, so plain ZeroMQ is only for endpoints this machine alone
     * can reach (tests, tessera local). */
    if (cfg->security_none) {
        const char *bad = !tsr_endpoint_is_local(cfg->workers_endpoint)
                              ? cfg->workers_endpoint
                              : !tsr_endpoint_is_local(cfg->control_endpoint)
                                    ? cfg->control_endpoint : NULL;
        if (bad) {
            fail(c, v[6], "coordinator.security",
                 "none is allowed only when every endpoint is loopback, and %s is not "
                 "(bind 127.0.0.1, or use security: curve with a key store)", bad);
            return -1;
        }
    }
    /* A timeout at or under the interval would declare healthy workers dead
     * between two heartbeats. */
    if (cfg->worker_timeout_ms <= cfg->heartbeat_interval_ms) {
        fail(c, v[3] ? v[3] : n, "coordinator.worker_timeout_ms",
             "must be greater than heartbeat_interval_ms (%d <= %d)",
             cfg->worker_timeout_ms, cfg->heartbeat_interval_ms);
        return -1;
    }
    return 0;
}

/* ---- deployments -------------------------------------------------------- */

static int valid_name(const char *s)
{
    size_t i, len = strlen(s);

    if (len == 0 || len > NAME_MAX_LEN)
        return 0;
    for (i = 0; i < len; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9') || ch == '_' || ch == '.' || ch == '-'))
            return 0;
    }
    return 1;
}

bool tsr_endpoint_host(const char *ep, char *host, size_t hostlen, const char **port)
{
    if (strncmp(ep, "tcp://", 6))
        return false;
    /* ZeroMQ's "source;address" connecting form: the address is the part after ';' */
    const char *h = strrchr(ep + 6, ';') ? strrchr(ep + 6, ';') + 1 : ep + 6;
    const char *colon = strrchr(h, ':');
    size_t n = colon ? (size_t)(colon - h) : 0;
    if (!colon || n == 0 || n >= hostlen)
        return false;
    memcpy(host, h, n);
    host[n] = '\0';
    if (port) *port = colon + 1;
    return true;
}

/* An IPv6 address, with ZeroMQ's optional %zone (an interface) after it. */
static bool ipv6_text(const char *s, size_t n)
{
    char a[64];
    unsigned char addr[16];
    size_t k = strcspn(s, "%");
    if (k > n) k = n;
    if (k == 0 || k >= sizeof a) return false;
    memcpy(a, s, k);
    a[k] = '\0';
    return inet_pton(AF_INET6, a, addr) == 1;
}

bool tsr_endpoint_check(const char *ep, char *why, size_t len)
{
    if ((!strncmp(ep, "ipc://", 6) && ep[6]) || (!strncmp(ep, "inproc://", 9) && ep[9]))
        return true;
    if (strncmp(ep, "tcp://", 6)) {
        snprintf(why, len, "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME");
        return false;
    }
    char host[256];
    const char *port_s = NULL;
    if (!tsr_endpoint_host(ep, host, sizeof host, &port_s)) {
        snprintf(why, len, "expected tcp://HOST:PORT (a host, then a colon and a port)");
        return false;
    }
    const size_t n = strlen(host);
    char *end = NULL;
    errno = 0;
    long port = strtol(port_s, &end, 10);
    if (!isdigit((unsigned char)port_s[0]) || *end || errno || port < 1 || port > 65535) {
        snprintf(why, len, "the port '%s' is not a number from 1 to 65535", port_s);
        return false;
    }
    if (host[0] == '[') {
        if (n < 3 || host[n - 1] != ']') {
            snprintf(why, len, "the IPv6 address '%s' has no closing ']' before the port", host);
            return false;
        }
        if (!ipv6_text(host + 1, n - 2)) {
            snprintf(why, len, "'%.*s' is not an IPv6 address", (int)(n - 2), host + 1);
            return false;
        }
        return true;
    }
    if (strchr(host, ':'))   /* an IPv6 address without brackets, as ZeroMQ takes it */
        return ipv6_text(host, n) ||
               (snprintf(why, len, "'%s' is not an IPv6 address (write [ADDRESS]:PORT)", host),
                false);
    struct in_addr a4;
    /* (inet_aton, as the resolver: it takes short forms such as 127.1) */
    if (strspn(host, "0123456789.") == n && inet_aton(host, &a4) == 0) {
        snprintf(why, len, "'%s' is not an IPv4 address", host);
        return false;
    }
    if (strcmp(host, "*") && strspn(host, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                          "0123456789.-_") != n) {
        snprintf(why, len, "'%s' is not a host name, an interface, an IPv4 address, [IPv6] "
                 "or *", host);
        return false;
    }
    return true;
}

bool tsr_endpoint_is_local(const char *ep)
{
    if (!strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9))
        return true;
    char host[64];
    /* "source;address" is a connecting form, not a bind address */
    if (strncmp(ep, "tcp://", 6) || strchr(ep, ';') ||
        !tsr_endpoint_host(ep, host, sizeof host, NULL))
        return false;
    if (!strcmp(host, "localhost") || !strcmp(host, "[::1]"))
        return true;
    struct in_addr a;
    return strspn(host, "0123456789.") == strlen(host) && inet_aton(host, &a) != 0 &&
           (ntohl(a.s_addr) >> 24) == 127;
}

/* model_path = directory of `file` (with its slash) + model, unless model is
 * absolute or the file name has no directory part. */
static char *resolve_model(const char *file, const char *model)
{
    const char *slash = file ? strrchr(file, '/') : NULL;
    size_t dlen;
    char *p;

    if (model[0] == '/' || slash == NULL)
        return strdup(model);
    dlen = (size_t)(slash - file) + 1;
    p = malloc(dlen + strlen(model) + 1);
    if (p == NULL)
        return NULL;
    memcpy(p, file, dlen);
    strcpy(p + dlen, model);
    return p;
}

static bool is_auto(const yaml_node_t *n)
{
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
           !strcmp((const char *)n->data.scalar.value, "auto");
}

/* replicas: {min: N, max: M}: replicas that follow load, from min to max. */
static int parse_replica_range(pctx_t *c, yaml_node_t *n, const char *path, tsr_deployment_t *d)
{
    static const char *const keys[] = { "min", "max" };
    yaml_node_t *v[2];
    char kpath[PATH_MAX_LEN];

    if (map_fields(c, n, path, keys, 2, v) < 0)
        return -1;
    if (!v[0] || !v[1]) {
        path_key(kpath, path, v[0] ? "max" : "min");
        fail(c, n, kpath, "required key missing (a range of replicas is {min: N, max: M})");
        return -1;
    }
    path_key(kpath, path, "min");
    if (get_int_range(c, v[0], kpath, 1, TSR_MAX_PIECES, &d->replicas_min) < 0)
        return -1;
    path_key(kpath, path, "max");
    if (get_int_range(c, v[1], kpath, 1, TSR_MAX_PIECES, &d->replicas_max) < 0)
        return -1;
    if (d->replicas_max < d->replicas_min) {
        fail(c, v[1], kpath, "expected at least min (%d), got %d", d->replicas_min,
             d->replicas_max);
        return -1;
    }
    d->replicas = d->replicas_min;
    return 0;
}

/* parallel: auto, or a mapping of tensor, pipeline and replicas, each a positive
 * integer or auto (replicas also a range {min, max}). */
static int parse_parallel(pctx_t *c, yaml_node_t *n, const char *path,
                          tsr_deployment_t *d)
{
    static const char *const keys[] = { "tensor", "pipeline", "replicas" };
    int *dst[3] = { &d->tensor, &d->pipeline, &d->replicas };
    bool *autos[3] = { &d->auto_tensor, &d->auto_pipeline, &d->auto_replicas };
    yaml_node_t *v[3];
    char kpath[PATH_MAX_LEN];
    size_t i;

    if (is_auto(n)) {
        d->auto_tensor = d->auto_pipeline = d->auto_replicas = true;
        return 0;
    }
    if (n->type == YAML_SCALAR_NODE) {
        char q[QUOTE_MAX + 8];
        quote_value(n, q, sizeof q);
        fail(c, n, path, "expected auto or a mapping of tensor, pipeline and replicas, got '%s'",
             q);
        return -1;
    }
    if (want_mapping(c, n, path) < 0 || map_fields(c, n, path, keys, 3, v) < 0)
        return -1;
    for (i = 0; i < 3; i++) {
        path_key(kpath, path, keys[i]);
        if (v[i] && is_auto(v[i]))
            *autos[i] = true;
        else if (i == 2 && v[i] && v[i]->type == YAML_MAPPING_NODE) {
            if (parse_replica_range(c, v[i], kpath, d) < 0)
                return -1;
        } else if (v[i] && get_posint(c, v[i], kpath, dst[i]) < 0)
            return -1;
    }
    /* a chosen cut leaves its replicas to be chosen too, unless they are given */
    if ((d->auto_tensor || d->auto_pipeline) && !v[2])
        d->auto_replicas = true;
    return 0;
}

static int parse_name(pctx_t *c, yaml_node_t *n, const char *path,
                      const tsr_config_t *cfg, size_t idx, tsr_deployment_t *d)
{
    char q[QUOTE_MAX + 8];
    size_t j;

    if (get_string(c, n, path, &d->name) < 0)
        return -1;
    if (!valid_name(d->name)) {
        quote_value(n, q, sizeof q);
        fail(c, n, path, "invalid name '%s' (use 1 to %d of A-Z a-z 0-9 _ . -)",
             q, NAME_MAX_LEN);
        return -1;
    }
    for (j = 0; j < idx; j++) {
        if (strcmp(cfg->deployments[j].name, d->name) == 0) {
            fail(c, n, path, "duplicate deployment name '%s' (also deployments[%zu], "
                 "line %d)", d->name, j, cfg->deployments[j].line);
            return -1;
        }
    }
    return 0;
}

static int parse_model(pctx_t *c, yaml_node_t *n, const char *path,
                       tsr_deployment_t *d)
{
    if (get_string(c, n, path, &d->model) < 0)
        return -1;
    if (d->model[0] == '\0') {
        fail(c, n, path, "must not be empty");
        return -1;
    }
    d->model_path = resolve_model(c->file_for_paths, d->model);
    if (d->model_path == NULL) {
        fail(c, n, path, "out of memory");
        return -1;
    }
    return 0;
}

static int parse_device(pctx_t *c, yaml_node_t *n, const char *path,
                        tsr_deployment_t *d)
{
    char *s = NULL;
    char q[QUOTE_MAX + 8];
    int rc = -1;

    if (get_string(c, n, path, &s) < 0)
        goto out;
    if (tsr_device_parse(s, &d->device) < 0) {
        quote_value(n, q, sizeof q);
        fail(c, n, path, "expected cpu or cuda, got '%s'", q);
        goto out;
    }
    rc = 0;
out:
    free(s);
    return rc;
}

const char *tsr_kv_dtype_name(int kv_dtype)
{
    return kv_dtype == TSR_KV_AUTO ? "auto"
           : kv_dtype == TSR_KV_F32 ? "f32"
           : kv_dtype == TSR_KV_BF16 ? "bf16"
           : kv_dtype == TSR_KV_INT8 ? "int8"
                                     : NULL;
}

int tsr_kv_row_bytes(int kv_dtype, int head_dim)
{
    return kv_dtype == TSR_KV_F32    ? 4 * head_dim
           : kv_dtype == TSR_KV_BF16 ? 2 * head_dim
           : kv_dtype == TSR_KV_INT8 ? head_dim + 4
                                     : 0;
}

int tsr_kv_dtype_on(tsr_device_t d, int kv_dtype)
{
    if (kv_dtype != TSR_KV_AUTO) return kv_dtype;
    return d == TSR_DEVICE_CUDA ? TSR_KV_BF16 : TSR_KV_F32;
}

/* kv_dtype or matmul_dtype (key) into *out, after device: a cuda piece
 * holds bf16 only, and cuda_says is what it keeps in it; int8 is a KV
 * cache's type only. */
/* weights_dtype into d, after device and matmul_dtype: auto (as matmul_dtype
 * says) or int8 (cpu: integer products, which bf16 products cannot be). */
static int parse_weights_dtype(pctx_t *c, yaml_node_t *n, const char *path, tsr_deployment_t *d)
{
    char kpath[PATH_MAX_LEN], *s = NULL;
    int rc = -1;
    path_key(kpath, path, "weights_dtype");
    if (get_string(c, n, kpath, &s) < 0)
        goto out;
    if (strcmp(s, "auto") && strcmp(s, "int8")) {
        fail(c, n, kpath, "expected auto or int8, got '%.40s'%s", s,
             !strcmp(s, "fp8") ? " (fp8 weights are not built yet)" : "");
        goto out;
    }
    d->weights_dtype = s[0] == 'i' ? TSR_KV_INT8 : TSR_KV_AUTO;
    if (d->weights_dtype == TSR_KV_INT8 && d->device == TSR_DEVICE_CUDA) {
        fail(c, n, kpath, "a cuda deployment holds its weights in bf16; int8 is for cpu ones");
        goto out;
    }
    if (d->weights_dtype == TSR_KV_INT8 && d->matmul_dtype == TSR_KV_BF16) {
        fail(c, n, kpath, "int8 weights multiply as integers, not in bf16: leave matmul_dtype "
             "auto or f32");
        goto out;
    }
    rc = 0;
out:
    free(s);
    return rc;
}

static int parse_elem_dtype(pctx_t *c, yaml_node_t *n, const char *path, const char *key,
                            const char *cuda_says, const tsr_deployment_t *d, int *out)
{
    char kpath[PATH_MAX_LEN], *s = NULL;
    int rc = -1, v;
    path_key(kpath, path, key);
    if (get_string(c, n, kpath, &s) < 0)
        goto out;
    const int kv = !strcmp(key, "kv_dtype");
    for (v = TSR_KV_AUTO; tsr_kv_dtype_name(v); v++)
        if (!strcmp(s, tsr_kv_dtype_name(v)) && (kv || v != TSR_KV_INT8))
            break;
    if (!tsr_kv_dtype_name(v)) {
        fail(c, n, kpath, "expected auto, f32%s, got '%.40s'", kv ? ", bf16 or int8" : " or bf16",
             s);
        goto out;
    }
    if (d->device == TSR_DEVICE_CUDA && v != TSR_KV_AUTO && v != TSR_KV_BF16) {
        fail(c, n, kpath, "a cuda deployment keeps %s in bf16; %s is for cpu ones", cuda_says,
             tsr_kv_dtype_name(v));
        goto out;
    }
    *out = v;
    rc = 0;
out:
    free(s);
    return rc;
}

/* The batching and memory keys: optional integers with a range each. */
static const struct {
    const char *key;
    int lo, hi;
    size_t offset;
} batch_keys[] = {
    { "max_batch", 1, 1024, offsetof(tsr_deployment_t, max_batch) },
    { "prefill_chunk", 1, 65536, offsetof(tsr_deployment_t, prefill_chunk) },
    { "kv_cache_mib", 1, 1 << 24, offsetof(tsr_deployment_t, kv_cache_mib) },
    { "max_queue", 0, 1000000, offsetof(tsr_deployment_t, max_queue) },
    { "gpu_memory_percent", 10, 99, offsetof(tsr_deployment_t, gpu_memory_percent) },
};
#define N_BATCH_KEYS (sizeof batch_keys / sizeof batch_keys[0])

static int parse_deployment(pctx_t *c, yaml_node_t *n, size_t idx,
                            tsr_config_t *cfg)
{
    static const char *const keys[] = { "name", "model", "device", "parallel",
                                        "max_seq_len", "max_batch", "prefill_chunk",
                                        "kv_cache_mib", "max_queue", "gpu_memory_percent",
                                        "chat_template", "kv_dtype", "matmul_dtype",
                                        "collective_timeout_ms",
                                        "latency_target_ms_per_token",
                                        "scale_up_queue_ms", "scale_up_window_s",
                                        "scale_down_idle_s", "prefix_cache", "kv_admission",
                                        "weights_dtype" };
    tsr_deployment_t *d = &cfg->deployments[idx];
    yaml_node_t *v[21];
    char path[PATH_MAX_LEN], kpath[PATH_MAX_LEN];
    size_t k;

    snprintf(path, sizeof path, "deployments[%zu]", idx);
    if (want_mapping(c, n, path) < 0 || map_fields(c, n, path, keys, 21, v) < 0)
        return -1;
    d->line = (int)n->start_mark.line + 1;
    d->column = (int)n->start_mark.column + 1;
    /* Required keys are reported at the entry, since they have no node. */
    if (v[0] == NULL || v[1] == NULL) {
        path_key(kpath, path, v[0] == NULL ? "name" : "model");
        fail(c, n, kpath, "required key missing");
        return -1;
    }
    path_key(kpath, path, "name");
    if (parse_name(c, v[0], kpath, cfg, idx, d) < 0)
        return -1;
    path_key(kpath, path, "model");
    if (parse_model(c, v[1], kpath, d) < 0)
        return -1;
    path_key(kpath, path, "device");
    if (v[2] && parse_device(c, v[2], kpath, d) < 0)
        return -1;
    path_key(kpath, path, "parallel");
    if (v[3] && parse_parallel(c, v[3], kpath, d) < 0)
        return -1;
    path_key(kpath, path, "max_seq_len");
    if (v[4] && get_posint(c, v[4], kpath, &d->max_seq_len) < 0)
        return -1;
    for (k = 0; k < N_BATCH_KEYS; k++) {
        path_key(kpath, path, batch_keys[k].key);
        if (v[5 + k] && get_int_range(c, v[5 + k], kpath, batch_keys[k].lo, batch_keys[k].hi,
                                      (int *)((char *)d + batch_keys[k].offset)) < 0)
            return -1;
    }
    if (v[10]) {
        char *name = NULL;
        path_key(kpath, path, "chat_template");
        if (get_string(c, v[10], kpath, &name) < 0)
            return -1;
        if (strcmp(name, "llama2") && strcmp(name, "llama3") && strcmp(name, "chatml") &&
            strcmp(name, "mistral")) {
            fail(c, v[10], kpath, "expected llama2, llama3, chatml or mistral, got '%.40s'", name);
            free(name);
            return -1;
        }
        snprintf(d->chat_template, sizeof d->chat_template, "%s", name);
        free(name);
    }
    if (v[11] && parse_elem_dtype(c, v[11], path, "kv_dtype", "its KV cache", d, &d->kv_dtype) < 0)
        return -1;
    if (v[12] && parse_elem_dtype(c, v[12], path, "matmul_dtype", "its weights", d,
                                  &d->matmul_dtype) < 0)
        return -1;
    path_key(kpath, path, "collective_timeout_ms");
    if (!v[13])
        d->collective_timeout_ms = tsr_coll_timeout_default(d->device);
    else if (get_int_range(c, v[13], kpath, TSR_COLL_TIMEOUT_MS_MIN, TSR_COLL_TIMEOUT_MS_MAX,
                           &d->collective_timeout_ms) < 0)
        return -1;
    path_key(kpath, path, "latency_target_ms_per_token");
    if (v[14] && get_ms(c, v[14], kpath, &d->latency_target_ms) < 0)
        return -1;
    /* replicas that follow load: when, and only with a range of them */
    static const struct { const char *key; int lo, hi; size_t offset; } scale_keys[] = {
        { "scale_up_queue_ms", 1, 3600000, offsetof(tsr_deployment_t, scale_up_queue_ms) },
        { "scale_up_window_s", 1, 3600, offsetof(tsr_deployment_t, scale_up_window_s) },
        { "scale_down_idle_s", 1, 86400, offsetof(tsr_deployment_t, scale_down_idle_s) },
    };
    for (k = 0; k < 3; k++) {
        if (!v[15 + k]) continue;
        path_key(kpath, path, scale_keys[k].key);
        if (!d->replicas_max) {
            fail(c, v[15 + k], kpath, "applies only to replicas that follow load: give "
                 "parallel.replicas as a range, {min: N, max: M}");
            return -1;
        }
        if (get_int_range(c, v[15 + k], kpath, scale_keys[k].lo, scale_keys[k].hi,
                          (int *)((char *)d + scale_keys[k].offset)) < 0)
            return -1;
    }
    path_key(kpath, path, "prefix_cache");
    if (v[18] && get_bool(c, v[18], kpath, &d->prefix_cache) < 0)
        return -1;
    if (v[19]) {
        char *how = NULL;
        path_key(kpath, path, "kv_admission");
        if (get_string(c, v[19], kpath, &how) < 0)
            return -1;
        if (strcmp(how, "on_demand") && strcmp(how, "reserve")) {
            fail(c, v[19], kpath, "expected on_demand or reserve, got '%.40s'", how);
            free(how);
            return -1;
        }
        d->kv_admission = how[0] == 'r' ? TSR_KV_ADMIT_RESERVE : TSR_KV_ADMIT_ON_DEMAND;
        free(how);
    }
    if (v[20] && parse_weights_dtype(c, v[20], path, d) < 0)
        return -1;
    /* A chunk longer than any sequence can be is just "the whole prompt". */
    if (d->prefill_chunk > d->max_seq_len)
        d->prefill_chunk = d->max_seq_len;
    return 0;
}

static int parse_deployments(pctx_t *c, yaml_node_t *n, tsr_config_t *cfg)
{
    yaml_node_item_t *it;
    size_t count, i;

    if (is_null(n))
        return 0; /* "deployments:" with nothing under it */
    if (n->type != YAML_SEQUENCE_NODE) {
        fail(c, n, "deployments", "expected a sequence, got %s", node_kind(n));
        return -1;
    }
    count = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    if (count == 0)
        return 0;
    cfg->deployments = calloc(count, sizeof *cfg->deployments);
    if (cfg->deployments == NULL) {
        fail(c, n, "deployments", "out of memory");
        return -1;
    }
    /* Defaults first, so every entry is sane even if parsing stops early;
     * n_deployments grows as entries are filled so destroy frees them. */
    for (i = 0; i < count; i++) {
        cfg->deployments[i].device = TSR_DEVICE_CPU;
        cfg->deployments[i].tensor = 1;
        cfg->deployments[i].pipeline = 1;
        cfg->deployments[i].replicas = 1;
        cfg->deployments[i].max_seq_len = 2048;
        cfg->deployments[i].max_batch = 32;
        cfg->deployments[i].prefill_chunk = 128;
        cfg->deployments[i].kv_cache_mib = 0;
        cfg->deployments[i].max_queue = 256;
        cfg->deployments[i].gpu_memory_percent = 90;
        cfg->deployments[i].collective_timeout_ms = TSR_COLL_TIMEOUT_MS_DEFAULT;
        cfg->deployments[i].scale_up_queue_ms = 1000;
        cfg->deployments[i].scale_up_window_s = 10;
        cfg->deployments[i].scale_down_idle_s = 300;
        cfg->deployments[i].prefix_cache = true;
    }
    for (i = 0, it = n->data.sequence.items.start; i < count; i++, it++) {
        cfg->n_deployments = i + 1;
        if (parse_deployment(c, yaml_document_get_node(c->doc, *it), i, cfg) < 0)
            return -1;
    }
    return 0;
}

/* ---- top level ---------------------------------------------------------- */

static int parse_version(pctx_t *c, yaml_node_t *root, yaml_node_t *n)
{
    int v = 0;

    if (n == NULL) {
        fail(c, root, "version", "required key missing (this build reads version 1)");
        return -1;
    }
    if (get_posint(c, n, "version", &v) < 0)
        return -1;
    if (v != 1) {
        fail(c, n, "version", "unsupported format version %d (this build reads "
             "version 1)", v);
        return -1;
    }
    return 0;
}

static int parse_root(pctx_t *c, tsr_config_t *cfg)
{
    static const char *const keys[] = { "version", "coordinator", "deployments" };
    yaml_node_t *root = yaml_document_get_root_node(c->doc);
    yaml_node_t *v[3];

    if (root == NULL) {
        fail_at(c, 0, 0, "version", "required key missing (the file is empty)");
        return -1;
    }
    if (root->type != YAML_MAPPING_NODE) {
        fail(c, root, "(top level)", "expected a mapping, got %s", node_kind(root));
        return -1;
    }
    if (map_fields(c, root, "", keys, 3, v) < 0 ||
        parse_version(c, root, v[0]) < 0)
        return -1;
    if (v[1] && parse_coordinator(c, v[1], cfg) < 0)
        return -1;
    if (v[2] && parse_deployments(c, v[2], cfg) < 0)
        return -1;
    return 0;
}

/* libyaml's reader errors carry a byte offset, not a mark; count lines
 * ourselves so every message has a position. */
static void offset_to_mark(const char *buf, size_t len, size_t off,
                           int *line0, int *col0)
{
    size_t i;

    *line0 = 0;
    *col0 = 0;
    for (i = 0; i < off && i < len; i++) {
        if (buf[i] == '\n') {
            (*line0)++;
            *col0 = 0;
        } else {
            (*col0)++;
        }
    }
}

static void syntax_error(pctx_t *c, const yaml_parser_t *p, const char *buf,
                         size_t len)
{
    int line0 = (int)p->problem_mark.line, col0 = (int)p->problem_mark.column;
    const char *problem = p->problem ? p->problem : "malformed YAML";

    if (p->error == YAML_READER_ERROR)
        offset_to_mark(buf, len, p->problem_offset, &line0, &col0);
    if (p->error == YAML_MEMORY_ERROR)
        problem = "out of memory";
    if (p->context && (int)p->context_mark.line != line0)
        fail_at(c, line0, col0, "syntax error", "%s %s (started at line %d)",
                problem, p->context, (int)p->context_mark.line + 1);
    else if (p->context)
        fail_at(c, line0, col0, "syntax error", "%s %s", problem, p->context);
    else
        fail_at(c, line0, col0, "syntax error", "%s", problem);
}

static tsr_config_t *config_new(const char *name)
{
    tsr_config_t *cfg = calloc(1, sizeof *cfg);

    if (cfg == NULL)
        return NULL;
    cfg->path = strdup(name);
    cfg->workers_endpoint = strdup("tcp://0.0.0.0:7400");
    cfg->control_endpoint = strdup("tcp://127.0.0.1:7401");
    cfg->heartbeat_interval_ms = 100;
    cfg->worker_timeout_ms = 1000;
    cfg->max_workers = 4096;
    cfg->dead_worker_ttl_s = 600;
    cfg->max_replays = 3;
    cfg->canary_interval_ms = 5000;
    cfg->canary_timeout_ms = 2000;
    cfg->replay_wait_ms = 30000;
    cfg->rebalance_interval_s = 30;
    cfg->keys_dir = strdup("/etc/tessera/keys");
    if (!cfg->path || !cfg->workers_endpoint || !cfg->control_endpoint || !cfg->keys_dir)
        tsr_config_destroy(&cfg);
    return cfg;
}

/* Walks the event stream once before the document is built and refuses
 * nesting deeper than TSR_CONFIG_MAX_DEPTH: a file nested 100,000 deep took
 * libyaml's loader 24 s to refuse; this stops at the first level too many. */
static int check_depth(pctx_t *c, const char *buf, size_t len)
{
    yaml_parser_t p;
    yaml_event_t ev;
    int depth = 0, rc = 0;

    if (!yaml_parser_initialize(&p)) {
        fail_plain(c->err, c->errlen, "%s: out of memory", c->file);
        return -1;
    }
    yaml_parser_set_input_string(&p, (const unsigned char *)(buf ? buf : ""), buf ? len : 0);
    for (;;) {
        if (!yaml_parser_parse(&p, &ev))
            break; /* the loader reports syntax errors with their position */
        yaml_event_type_t t = ev.type;
        if (t == YAML_SEQUENCE_START_EVENT || t == YAML_MAPPING_START_EVENT) {
            if (++depth > TSR_CONFIG_MAX_DEPTH) {
                fail_at(c, (int)ev.start_mark.line, (int)ev.start_mark.column,
                        "(document)", "nested more than %d levels deep (the limit)",
                        TSR_CONFIG_MAX_DEPTH);
                rc = -1;
            }
        } else if (t == YAML_SEQUENCE_END_EVENT || t == YAML_MAPPING_END_EVENT) {
            depth--;
        }
        yaml_event_delete(&ev);
        if (rc < 0 || t == YAML_STREAM_END_EVENT)
            break;
    }
    yaml_parser_delete(&p);
    return rc;
}

/* Loads the first document and makes sure no second one follows: a stray
 * "---" usually means two files were pasted together. */
static int load_documents(pctx_t *c, yaml_parser_t *parser, const char *buf,
                          size_t len)
{
    yaml_document_t extra;
    yaml_node_t *root;
    int have_extra = 0;
    int rc = -1;

    /* On failure yaml_parser_load frees what it built itself. */
    if (!yaml_parser_load(parser, c->doc)) {
        syntax_error(c, parser, buf, len);
        return -1;
    }
    if (yaml_document_get_root_node(c->doc) == NULL) {
        rc = 0; /* empty stream: nothing more to read */
        goto out;
    }
    if (!yaml_parser_load(parser, &extra)) {
        syntax_error(c, parser, buf, len);
        goto out;
    }
    have_extra = 1;
    root = yaml_document_get_root_node(&extra);
    if (root != NULL) {
        fail(c, root, "(document)", "only one YAML document is allowed");
        goto out;
    }
    rc = 0;
out:
    if (have_extra)
        yaml_document_delete(&extra);
    if (rc < 0)
        yaml_document_delete(c->doc);
    return rc;
}

int tsr_config_parse(const char *buf, size_t len, const char *name,
                     tsr_config_t **out, char *err, size_t errlen)
{
    pctx_t c = { 0 };
    yaml_parser_t parser;
    yaml_document_t doc;
    tsr_config_t *cfg = NULL;
    int parser_ready = 0, doc_ready = 0;
    int rc = -1;

    c.doc = &doc;
    c.file = name ? name : "<input>";
    c.file_for_paths = name;
    c.err = err;
    c.errlen = errlen;
    *out = NULL;
    if (len > TSR_CONFIG_MAX_BYTES) {
        fail_plain(err, errlen, "%s: too large (%zu bytes, limit %d)", c.file,
                   len, TSR_CONFIG_MAX_BYTES);
        goto out;
    }
    if (check_depth(&c, buf, len) < 0)
        goto out;
    cfg = config_new(c.file);
    if (cfg == NULL || !yaml_parser_initialize(&parser)) {
        fail_plain(err, errlen, "%s: out of memory", c.file);
        goto out;
    }
    parser_ready = 1;
    yaml_parser_set_input_string(&parser, (const unsigned char *)(buf ? buf : ""),
                                 buf ? len : 0);
    if (load_documents(&c, &parser, buf, len) < 0)
        goto out;
    doc_ready = 1;
    if (parse_root(&c, cfg) < 0)
        goto out;
    *out = cfg;
    cfg = NULL; /* transferred */
    rc = 0;
out:
    if (doc_ready)
        yaml_document_delete(&doc);
    if (parser_ready)
        yaml_parser_delete(&parser);
    tsr_config_destroy(&cfg);
    return rc;
}

int tsr_config_load(const char *path, tsr_config_t **out, char *err, size_t errlen)
{
    char *buf = NULL;
    size_t len = 0;
    int rc = -1;

    *out = NULL;
    if ((buf = tsr_read_regular(path, TSR_CONFIG_MAX_BYTES, &len, err, errlen)) == NULL)
        goto out;
    rc = tsr_config_parse(buf, len, path, out, err, errlen);
out:
    free(buf);
    return rc;
}

void tsr_config_destroy(tsr_config_t **self_p)
{
    tsr_config_t *cfg;
    size_t i;

    if (self_p == NULL || *self_p == NULL)
        return;
    cfg = *self_p;
    for (i = 0; i < cfg->n_deployments; i++) {
        free(cfg->deployments[i].name);
        free(cfg->deployments[i].model);
        free(cfg->deployments[i].model_path);
    }
    free(cfg->deployments);
    free(cfg->workers_endpoint);
    free(cfg->control_endpoint);
    free(cfg->keys_dir);
    free(cfg->http_endpoint);
    free(cfg->api_keys_file);
    free(cfg->path);
    free(cfg);
    *self_p = NULL;
}

const tsr_deployment_t *tsr_config_find(const tsr_config_t *cfg, const char *name)
{
    size_t i;

    if (cfg == NULL || name == NULL)
        return NULL;
    for (i = 0; i < cfg->n_deployments; i++)
        if (strcmp(cfg->deployments[i].name, name) == 0)
            return &cfg->deployments[i];
    return NULL;
}
