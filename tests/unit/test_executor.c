/* test_executor.c: the data-plane thread (worker/executor.c): an event that
 * cannot be queued is never lost silently; a tp=2 replica whose tensor
 * group is NCCL's (a fake NCCL) forms through the rendezvous relay and
 * generates the same tokens as over TCP; a group of one (the device
 * check's TSR_TEST_NCCL_SOLO) forms only from its relayed blob, sums
 * through NCCL, and is aborted by a newer epoch; a new epoch whose kv_dtype is
 * auto's own type keeps the loaded weights; every token wakes the agent's
 * event fd; a thread that does not let go of its epoch within the
 * collective deadline (weight loading aside) is reported stuck, fatal. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "fake_nccl.h"
#include "worker/engine.h"
#include "worker/executor.h"

static char model_dir[64];

static void *fail_alloc(size_t n, size_t size)
{
    (void)n;
    (void)size;
    return NULL;
}

/* A request submitted to a worker that leads no replica is answered with a
 * retryable error event; when that event cannot be allocated, the agent gets
 * a failure of the piece instead (so its requests resume elsewhere), and
 * then nothing more. */
static void test_an_event_lost_to_memory_becomes_a_retryable_failure(void **state)
{
    (void)state;
    char err[256];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);

    tsr_request_t r = {.request_id = 7, .n_prompt = 1, .max_tokens = 1};
    r.prompt = malloc(sizeof *r.prompt);
    r.prompt[0] = 1;
    tsr_executor_submit(ex, &r);
    tsr_event_t ev;
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 1);
    assert_int_equal(ev.kind, TSR_EV_TOKEN);
    assert_int_equal(ev.request_id, 7);
    assert_true(ev.retryable);
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 0);

    tsr_executor_test_set_event_alloc(fail_alloc);
    for (int k = 0; k < 3; k++) {
        r.prompt = malloc(sizeof *r.prompt);
        r.prompt[0] = 1;
        r.request_id = 8 + (uint64_t)k;
        tsr_executor_submit(ex, &r);
    }
    tsr_executor_test_set_event_alloc(NULL);
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 1);
    assert_int_equal(ev.kind, TSR_EV_FAILED);
    assert_true(ev.retryable);
    assert_non_null(strstr(ev.text, "lost 3 event(s)"));
    assert_int_equal(tsr_executor_pop_event(ex, &ev), 0);
    tsr_executor_destroy(&ex);
}

/* ---- a replica over the fake NCCL -------------------------------------------------- */

static const tsr_nccl_api_t *fake_nccl_of(char *why, size_t len)
{
    (void)why;
    (void)len;
    return &fake_nccl;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Runs a tp=2 replica of two executors in epoch, plays the coordinator's
 * relay (to both members, the blob's maker included), generates 8 greedy
 * tokens into toks; returns the number of rendezvous blobs each executor
 * published (offers[2]). */
static void run_pair(uint64_t epoch, int32_t toks[8], int offers[2])
{
    char err[256];
    tsr_executor_t *ex[2];
    for (int i = 0; i < 2; i++) {
        ex[i] = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
        if (!ex[i]) fail_msg("%s", err);
    }
    char *peers[2] = {(char *)tsr_executor_endpoint(ex[0]), (char *)tsr_executor_endpoint(ex[1])};
    char *devices[2] = {"00000000:01:00.0", "00000000:02:00.0"};
    static uint8_t secret[32] = "executor test data secret......";
    for (int i = 0; i < 2; i++) {
        Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
        a.deployment = "tiny";
        a.epoch = epoch;
        a.tp_rank = (uint32_t)i;
        a.tp_size = 2;
        a.pp_size = 1;
        a.layer_end = 4;
        a.model_path = model_dir;
        a.max_seq_len = 256;
        a.n_peers = 2;
        a.peers = peers;
        a.n_peer_devices = 2;
        a.peer_devices = devices;
        a.data_secret = (ProtobufCBinaryData){sizeof secret, secret};
        tsr_executor_assign(ex[i], &a);
    }
    int ready = 0, got = 0;
    offers[0] = offers[1] = 0;
    bool submitted = false;
    int64_t end = now_ms() + 30000;
    while (got < 8 && now_ms() < end) {
        tsr_event_t ev;
        bool any = false;
        for (int i = 0; i < 2; i++) {
            while (tsr_executor_pop_event(ex[i], &ev)) {
                any = true;
                switch (ev.kind) {
                case TSR_EV_RENDEZVOUS:
                    offers[i]++;
                    assert_int_equal(ev.epoch, epoch);
                    /* an older epoch's copy is ignored; the right one is taken */
                    for (int k = 0; k < 2; k++) {
                        tsr_executor_rendezvous(ex[k], epoch - 1, ev.group, ev.blob, ev.blob_len);
                        tsr_executor_rendezvous(ex[k], epoch, ev.group, ev.blob, ev.blob_len);
                    }
                    break;
                case TSR_EV_READY:
                    ready++;
                    break;
                case TSR_EV_FAILED:
                    fail_msg("executor %d failed: %s", i, ev.text);
                    break;
                case TSR_EV_TOKEN:
                    if (ev.token < 0) fail_msg("request failed: %s", ev.text);
                    assert_int_equal(ev.index, got);
                    toks[got++] = ev.token;
                    break;
                default:
                    break;
                }
            }
        }
        if (ready == 2 && !submitted) {
            tsr_request_t r = {.request_id = 1, .n_prompt = 3, .max_tokens = 8};
            r.prompt = malloc(3 * sizeof *r.prompt);
            r.prompt[0] = 1, r.prompt[1] = 2, r.prompt[2] = 3;
            tsr_executor_submit(ex[0], &r);
            submitted = true;
        }
        if (!any) usleep(2000);
    }
    assert_int_equal(got, 8);
    for (int i = 0; i < 2; i++) tsr_executor_destroy(&ex[i]);
}

static void test_a_tp2_replica_forms_its_nccl_group_through_the_relay(void **state)
{
    (void)state;
    int32_t over_tcp[8], over_nccl[8];
    int offers[2];
    run_pair(5, over_tcp, offers);  /* the table's cpu row: TCP */
    assert_int_equal(offers[0] + offers[1], 0);
    tsr_backend_t b = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp, fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    run_pair(9, over_nccl, offers);
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
    /* the tp group's rank 0 made the one blob; rank 1 received it */
    assert_int_equal(offers[0], 1);
    assert_int_equal(offers[1], 0);
    assert_memory_equal(over_nccl, over_tcp, sizeof over_tcp);
}

/* ---- a group of one (TSR_TEST_NCCL_SOLO) -------------------------------------------- */

/* The collective_timeout_ms assign_tiny sends (0: the worker's default). */
static uint32_t assign_coll_ms;

/* Sends ex the whole tiny model (tp=1) in epoch with kv_dtype, on the GPU
 * device (NULL: none named). */
static void assign_tiny(tsr_executor_t *ex, uint64_t epoch, uint32_t kv_dtype,
                        const char *device)
{
    static uint8_t secret[32] = "executor test data secret......";
    char *peers[1] = {(char *)tsr_executor_endpoint(ex)};
    char *devices[1] = {(char *)device};
    Tessera__Assignment a = TESSERA__ASSIGNMENT__INIT;
    a.deployment = "tiny";
    a.epoch = epoch;
    a.tp_size = 1;
    a.pp_size = 1;
    a.layer_end = 4;
    a.model_path = model_dir;
    a.max_seq_len = 256;
    a.kv_dtype = kv_dtype;
    a.collective_timeout_ms = assign_coll_ms;
    a.n_peers = 1;
    a.peers = peers;
    a.n_peer_devices = device ? 1 : 0;
    a.peer_devices = device ? devices : NULL;
    a.data_secret = (ProtobufCBinaryData){sizeof secret, secret};
    tsr_executor_assign(ex, &a);
}

/* Assigns the whole tiny model (tp=1, on the GPU "00000000:01:00.0") to ex
 * in epoch.  With hold, the first rendezvous blob it publishes is held
 * back for hold_ms (no READY may come meanwhile), then an older epoch's
 * copy is relayed, then the right one.  Generates 8 greedy tokens into
 * toks (NULL: none).  Returns the number of blobs published. */
static int solo_epoch(tsr_executor_t *ex, uint64_t epoch, int hold_ms, int32_t *toks)
{
    assign_tiny(ex, epoch, TSR_KV_AUTO, "00000000:01:00.0");
    int offers = 0, got = 0;
    bool ready = false, submitted = false;
    tsr_event_t held = {0};
    int64_t release = -1, end = now_ms() + 30000;
    while ((toks ? got < 8 : !ready) && now_ms() < end) {
        tsr_event_t ev;
        while (tsr_executor_pop_event(ex, &ev)) {
            if (ev.epoch != epoch && ev.kind != TSR_EV_TOKEN) continue;
            switch (ev.kind) {
            case TSR_EV_RENDEZVOUS:
                offers++;
                held = ev;
                release = now_ms() + hold_ms;
                break;
            case TSR_EV_READY:
                if (release >= 0) fail_msg("epoch %llu: ready before its blob was relayed",
                                           (unsigned long long)epoch);
                ready = true;
                break;
            case TSR_EV_FAILED:
                fail_msg("epoch %llu failed: %s", (unsigned long long)epoch, ev.text);
                break;
            case TSR_EV_TOKEN:
                if (ev.token < 0) fail_msg("request failed: %s", ev.text);
                toks[got++] = ev.token;
                break;
            default:
                break;
            }
        }
        if (release >= 0 && now_ms() >= release) {
            tsr_executor_rendezvous(ex, epoch - 1, held.group, held.blob, held.blob_len);
            tsr_executor_rendezvous(ex, epoch, held.group, held.blob, held.blob_len);
            release = -1;
        }
        if (ready && toks && !submitted) {
            tsr_request_t r = {.request_id = epoch, .n_prompt = 3, .max_tokens = 8};
            r.prompt = malloc(3 * sizeof *r.prompt);
            r.prompt[0] = 1, r.prompt[1] = 2, r.prompt[2] = 3;
            tsr_executor_submit(ex, &r);
            submitted = true;
        }
        usleep(2000);
    }
    if (toks) assert_int_equal(got, 8);
    else assert_true(ready);
    return offers;
}

/* Under TSR_TEST_NCCL_SOLO (the device check's way to run NCCL on one
 * GPU) a tp=1 piece whose backend has NCCL forms its stage's TP group, a
 * group of one: only from the blob the coordinator relays back to it (not
 * from the one it made, nor from an older epoch's copy); its sums run
 * through that communicator, with the tokens of a piece without one.  A
 * newer epoch aborts the communicator (ncclCommAbort, never a finalize
 * that could wait on a dead peer) and forms the next from its own blob. */
static void test_a_group_of_one_forms_from_the_relayed_blob_and_a_new_epoch_aborts_it(void **state)
{
    (void)state;
    char err[256];
    int32_t plain[8], solo[8];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);
    assert_int_equal(solo_epoch(ex, 2, 0, plain), 0);   /* the cpu row: no group */
    tsr_executor_destroy(&ex);

    tsr_backend_t b = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp, fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    /* without the setting, a tp=1 piece forms no group, NCCL or not */
    ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);
    assert_int_equal(solo_epoch(ex, 3, 0, NULL), 0);
    tsr_executor_destroy(&ex);
    setenv("TSR_TEST_NCCL_SOLO", "1", 1);
    ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    unsetenv("TSR_TEST_NCCL_SOLO");
    if (!ex) fail_msg("%s", err);
    unsigned long rounds = fake_count(&fake_rounds_run), aborts = fake_count(&fake_aborts);
    assert_int_equal(solo_epoch(ex, 7, 200, solo), 1);
    assert_memory_equal(solo, plain, sizeof plain);
    /* the sums went through the group: every layer's two, each step */
    assert_true(fake_count(&fake_rounds_run) >= rounds + 8 * 2 * 4);
    assert_int_equal(fake_count(&fake_aborts), aborts);
    assert_int_equal(solo_epoch(ex, 8, 0, NULL), 1);
    assert_int_equal(fake_count(&fake_aborts), aborts + 1);
    tsr_executor_destroy(&ex);
    assert_int_equal(fake_count(&fake_aborts), aborts + 2);   /* a stop aborts too */
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
}

/* A rank waiting for its group's relayed blob (the coordinator has not sent it) lets go
 * of the wait as soon as a newer epoch is assigned: the newer epoch's blob is published
 * within 100 ms (not after the rendezvous deadline), the old epoch never becomes ready,
 * and the newer one forms once its own blob is relayed. */
static void test_a_newer_epoch_ends_the_wait_for_a_blob_within_100_ms(void **state)
{
    (void)state;
    char err[256];
    tsr_backend_t b = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp, fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    setenv("TSR_TEST_NCCL_SOLO", "1", 1);
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    unsetenv("TSR_TEST_NCCL_SOLO");
    if (!ex) fail_msg("%s", err);
    assign_tiny(ex, 20, TSR_KV_AUTO, "00000000:01:00.0");
    int64_t end = now_ms() + 30000, assigned = -1, offered = -1;
    tsr_event_t held = {0};
    bool ready = false, offered20 = false;
    while (!ready && now_ms() < end) {
        tsr_event_t ev;
        while (tsr_executor_pop_event(ex, &ev)) {
            if (ev.kind == TSR_EV_RENDEZVOUS && ev.epoch == 20) offered20 = true;
            if (ev.kind == TSR_EV_RENDEZVOUS && ev.epoch == 21) {
                offered = now_ms();
                held = ev;
                tsr_executor_rendezvous(ex, 21, held.group, held.blob, held.blob_len);
            }
            if (ev.kind == TSR_EV_READY) {
                assert_int_equal(ev.epoch, 21);
                ready = true;
            }
            if (ev.kind == TSR_EV_FAILED && ev.epoch == 21)
                fail_msg("epoch 21 failed: %s", ev.text);
        }
        /* epoch 20's blob is never relayed: 200 ms after it was offered, epoch 21 comes */
        if (offered20 && assigned < 0) {
            usleep(200 * 1000);
            assign_tiny(ex, 21, TSR_KV_AUTO, "00000000:01:00.0");
            assigned = now_ms();
        }
        usleep(1000);
    }
    assert_true(offered20);
    assert_true(ready);
    assert_true(offered >= assigned);
    if (offered - assigned > 100)
        fail_msg("the newer epoch's blob came %lld ms after it was assigned",
                 (long long)(offered - assigned));
    tsr_executor_destroy(&ex);
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
}

/* ---- which assignments reload the weights ------------------------------------------ */

static int loads, kept_layers;

static int counting_load(const char *dir, const tsr_piece_spec_t *spec, tsr_engine_t **out,
                         char *err, size_t errlen)
{
    loads++;
    return tsr_engine_cpu.load(dir, spec, out, err, errlen);
}

static int counting_load_from(tsr_engine_t **donor, const char *dir, const tsr_piece_spec_t *spec,
                              tsr_engine_t **out, int *kept, char *err, size_t errlen)
{
    loads++;
    int rc = tsr_engine_cpu.load_from(donor, dir, spec, out, kept, err, errlen);
    kept_layers = *kept;
    return rc;
}

/* Assigns the whole tiny model to ex in epoch with kv_dtype, and waits for
 * the piece to be ready. */
static void wait_ready(tsr_executor_t *ex, uint64_t epoch)
{
    for (int64_t end = now_ms() + 30000; now_ms() < end;) {
        tsr_event_t ev;
        while (tsr_executor_pop_event(ex, &ev)) {
            if (ev.kind == TSR_EV_FAILED) fail_msg("epoch %llu failed: %s", (unsigned long long)epoch, ev.text);
            if (ev.kind == TSR_EV_READY && ev.epoch == epoch) return;
        }
        usleep(2000);
    }
    fail_msg("epoch %llu: not ready within 30 s", (unsigned long long)epoch);
}

static void assign_whole(tsr_executor_t *ex, uint64_t epoch, uint32_t kv_dtype)
{
    assign_tiny(ex, epoch, kv_dtype, NULL);
    wait_ready(ex, epoch);
}

/* A new epoch whose kv_dtype is auto's own type (as a coordinator sends it
 * since it resolves auto) keeps the loaded engine; another type builds it again,
 * keeping the layers it holds (the engine's load_from). */
static void test_kv_dtype_auto_and_its_type_keep_the_weights_another_reloads(void **state)
{
    (void)state;
    static tsr_engine_ops_t counting;
    counting = tsr_engine_cpu;
    counting.load = counting_load;
    counting.load_from = counting_load_from;
    tsr_backend_t b = {&counting, &tsr_coll_tcp, NULL, NULL};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    char err[256];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);
    loads = 0;
    assign_whole(ex, 3, TSR_KV_AUTO);
    assert_int_equal(loads, 1);
    assign_whole(ex, 4, TSR_KV_F32);   /* auto on the CPU */
    assert_int_equal(loads, 1);
    kept_layers = -1;
    assign_whole(ex, 5, TSR_KV_BF16);
    assert_int_equal(loads, 2);
    assert_true(kept_layers > 0);           /* every layer of the tiny model */
    tsr_executor_destroy(&ex);
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
}

/* The agent sleeps on the event fd: every token must make it readable
 * (tokens are queued through a step and woken for once at its end), or a
 * client waits for a token that sits in the queue. */
static void test_every_token_makes_the_event_fd_readable(void **state)
{
    (void)state;
    char err[256];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);
    assign_whole(ex, 3, TSR_KV_AUTO);
    tsr_request_t r = {.request_id = 1, .n_prompt = 3, .max_tokens = 12};
    r.prompt = malloc(3 * sizeof *r.prompt);
    r.prompt[0] = 1, r.prompt[1] = 2, r.prompt[2] = 3;
    tsr_executor_submit(ex, &r);
    int got = 0, done = 0;
    while (!done) {
        struct pollfd pfd = {tsr_executor_event_fd(ex), POLLIN, 0};
        if (poll(&pfd, 1, 5000) != 1)
            fail_msg("after %d token(s) the event fd stayed unreadable for 5 s", got);
        tsr_event_t ev;
        while (tsr_executor_pop_event(ex, &ev)) {
            if (ev.kind != TSR_EV_TOKEN) continue;
            if (ev.token < 0) fail_msg("request failed: %s", ev.text);
            assert_int_equal(ev.index, got++);
            done = ev.done;
        }
    }
    assert_int_equal(got, 12);
    tsr_executor_destroy(&ex);
}

/* ---- the watchdog of the data-plane thread ------------------------------------------ */

/* An engine whose step, once armed, blocks where nothing reaches it (a
 * driver call that never returns), and whose load can be held the same way. */
static sem_t step_release, load_release;
static int step_block, load_block;     /* armed: the next step / load blocks */
static int step_slow;                  /* armed: the next step takes 3 s, ticking */
static uint64_t *alive_ticks;          /* the count set_alive was given */

static int blocking_step(tsr_engine_t *e, const tsr_batch_t *b, int32_t *sampled, char *err,
                         size_t errlen)
{
    if (__atomic_exchange_n(&step_block, 0, __ATOMIC_ACQ_REL)) sem_wait(&step_release);
    /* a long step of a big model: a part done every 100 ms */
    if (__atomic_exchange_n(&step_slow, 0, __ATOMIC_ACQ_REL))
        for (int i = 0; i < 30; i++) {
            usleep(100 * 1000);
            __atomic_fetch_add(alive_ticks, 1, __ATOMIC_RELAXED);
        }
    return tsr_engine_cpu.step(e, b, sampled, err, errlen);
}

static void ticking_set_alive(tsr_engine_t *e, uint64_t *ticks)
{
    alive_ticks = ticks;
    tsr_engine_cpu.set_alive(e, ticks);
}

static int blocking_load(const char *dir, const tsr_piece_spec_t *spec, tsr_engine_t **out,
                         char *err, size_t errlen)
{
    if (__atomic_exchange_n(&load_block, 0, __ATOMIC_ACQ_REL)) sem_wait(&load_release);
    return tsr_engine_cpu.load(dir, spec, out, err, errlen);
}

/* The clock the watchdog is given: now_ms() plus a jump, as after a
 * SIGSTOP of the whole process. */
static int64_t clock_jump;

/* Calls the watchdog every 5 ms for ms; returns when it first fired
 * (ms after the start), or -1. */
static int64_t watch_for(tsr_executor_t *ex, int ms)
{
    int64_t t0 = now_ms();
    while (now_ms() - t0 < ms) {
        if (tsr_executor_watch(ex, now_ms() + clock_jump)) return now_ms() - t0;
        usleep(5000);
    }
    return -1;
}

/* A serving thread lets go of its epoch at once when the next assignment
 * comes; one blocked where no deadline reaches does not, and after the
 * job's collective_timeout_ms (at least 2 s: 300 here is raised to 2000) the
 * watchdog reports the piece failed, fatal,
 * naming the epoch it holds, once; the worker must then restart.  Weight
 * loading is not held to that limit. */
static void test_a_thread_that_does_not_let_go_of_its_epoch_is_reported_stuck(void **state)
{
    (void)state;
    static tsr_engine_ops_t blocking;
    blocking = tsr_engine_cpu;
    blocking.step = blocking_step;
    blocking.load = blocking_load;
    blocking.set_alive = ticking_set_alive;
    tsr_backend_t b = {&blocking, &tsr_coll_tcp, NULL, NULL};
    tsr_backend_test_override(TSR_DEVICE_CPU, &b);
    sem_init(&step_release, 0, 0);
    sem_init(&load_release, 0, 0);
    char err[256];
    tsr_executor_t *ex = tsr_executor_new("127.0.0.1", "127.0.0.1", err, sizeof err);
    if (!ex) fail_msg("%s", err);
    assign_coll_ms = 300;

    /* a load that takes longer than the limit, while the next job waits */
    __atomic_store_n(&load_block, 1, __ATOMIC_RELEASE);
    assign_tiny(ex, 2, TSR_KV_AUTO, NULL);
    /* a fresh, idle thread is not held to a job it has not taken yet */
    assert_false(tsr_executor_watch(ex, now_ms() + 50));
    while (__atomic_load_n(&load_block, __ATOMIC_ACQUIRE)) usleep(1000);
    assign_tiny(ex, 3, TSR_KV_AUTO, NULL);
    assert_int_equal(watch_for(ex, 2600), -1);
    sem_post(&load_release);
    wait_ready(ex, 3);
    assert_int_equal(watch_for(ex, 100), -1);

    /* healthy: a new epoch is taken at once */
    assign_whole(ex, 4, TSR_KV_AUTO);
    assert_int_equal(watch_for(ex, 2600), -1);

    /* a step of 3 s that shows signs of life all along is not stuck: the
     * next epoch is taken when it ends */
    __atomic_store_n(&step_slow, 1, __ATOMIC_RELEASE);
    tsr_request_t r = {.request_id = 1, .n_prompt = 3, .max_tokens = 8};
    r.prompt = malloc(3 * sizeof *r.prompt);
    r.prompt[0] = 1, r.prompt[1] = 2, r.prompt[2] = 3;
    tsr_executor_submit(ex, &r);
    while (__atomic_load_n(&step_slow, __ATOMIC_ACQUIRE)) usleep(1000);
    assign_tiny(ex, 5, TSR_KV_AUTO, NULL);
    assert_int_equal(watch_for(ex, 3300), -1);
    wait_ready(ex, 5);
    assert_int_equal(watch_for(ex, 100), -1);

    /* blocked in a step: the next epoch is never taken */
    __atomic_store_n(&step_block, 1, __ATOMIC_RELEASE);
    r = (tsr_request_t){.request_id = 2, .n_prompt = 3, .max_tokens = 8};
    r.prompt = malloc(3 * sizeof *r.prompt);
    r.prompt[0] = 1, r.prompt[1] = 2, r.prompt[2] = 3;
    tsr_executor_submit(ex, &r);
    while (__atomic_load_n(&step_block, __ATOMIC_ACQUIRE)) usleep(1000);
    assign_tiny(ex, 6, TSR_KV_AUTO, NULL);
    /* a gap of 5 s between two looks is a stopped process, not the thread's */
    assert_false(tsr_executor_watch(ex, now_ms()));
    clock_jump = 5000;
    int64_t fired = watch_for(ex, 5000);
    clock_jump = 0;
    if (fired < 1950 || fired > 3500)
        fail_msg("the watchdog fired %lld ms after the next assignment (limit 2000 ms)",
                 (long long)fired);
    assert_true(tsr_executor_device_lost(ex));
    assert_false(tsr_executor_watch(ex, now_ms() + 100));   /* once */
    tsr_event_t ev;
    bool reported = false;
    while (tsr_executor_pop_event(ex, &ev))
        if (ev.kind == TSR_EV_FAILED) {
            assert_true(ev.fatal);
            assert_int_equal(ev.epoch, 6);
            if (!strstr(ev.text, "stuck: it has not let go of epoch 5") ||
                !strstr(ev.text, "limit 2000 ms, from collective_timeout_ms"))
                fail_msg("the report: %s", ev.text);
            reported = true;
        }
    assert_true(reported);
    sem_post(&step_release);    /* so the thread can end and be joined */
    tsr_executor_destroy(&ex);
    assign_coll_ms = 0;
    sem_destroy(&step_release);
    sem_destroy(&load_release);
    tsr_backend_test_override(TSR_DEVICE_CPU, NULL);
}

static int setup(void **state)
{
    (void)state;
    snprintf(model_dir, sizeof model_dir, "/tmp/tsr-exec-XXXXXX");
    if (!mkdtemp(model_dir)) return -1;
    char *argv[] = {"model-init", model_dir, "--hidden", "64", "--intermediate", "128",
                    "--layers", "4", "--heads", "8", "--kv-heads", "4", "--vocab", "256",
                    "--max-pos", "512", "--seed", "23", "--force", NULL};
    return tsr_cmd_model_init(19, argv) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", model_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_an_event_lost_to_memory_becomes_a_retryable_failure),
        cmocka_unit_test(test_a_tp2_replica_forms_its_nccl_group_through_the_relay),
        cmocka_unit_test(test_a_group_of_one_forms_from_the_relayed_blob_and_a_new_epoch_aborts_it),
        cmocka_unit_test(test_a_newer_epoch_ends_the_wait_for_a_blob_within_100_ms),
        cmocka_unit_test(test_kv_dtype_auto_and_its_type_keep_the_weights_another_reloads),
        cmocka_unit_test(test_every_token_makes_the_event_fd_readable),
        cmocka_unit_test(test_a_thread_that_does_not_let_go_of_its_epoch_is_reported_stuck),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
