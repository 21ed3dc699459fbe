/* cpu_pool.c: a thread pool for the CPU engine's forward step.
 *
 * A job is (fn, arg, n) plus one 64-bit claim word: the job's generation in
 * the high half, the number of indices not yet claimed in the low half.
 * Every thread, the caller's included, claims indices with a
 * compare-and-swap on that word, so a claim names the job it is for, and a
 * claimed-out job reads (g, 0) until the next is posted: a helper that read
 * a job late can claim nothing from a finished job nor from the one after.
 * (Counting up to n instead is wrong: a late helper holding the next job's
 * larger n would see (g, n_g) as work left.)  The generation is also the
 * futex word helpers sleep on, and a count of finished indices tells the
 * caller when the job is done.
 *
 *   caller                               helper
 *   fields, done = 0                     spin on gen (pause), then
 *   work = gen << 32 | n   (release)       sleepers++, recheck gen, futex_wait
 *   gen = that generation                claim, run, done += k
 *   if sleepers: futex_wake              (the last one wakes a sleeping caller)
 *   claim and run like a helper
 *   spin, then sleep, until done == n
 *
 * Both sleep paths are Dekker pairs over seq_cst atomics (the waker stores
 * and then loads the sleeper count; the sleeper adds itself and then loads
 * the word), so a wake-up cannot be lost, and the futex's own compare
 * closes the gap between the recheck and the sleep. */
#include "worker/cpu_pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#define MAX_THREADS 1024

typedef void (*tsr_pool_fn)(void *arg, int i);

struct tsr_pool {
    /* Written by the caller per job, read by every thread.  Atomic (relaxed)
     * because a helper that read the claim word late may read them while the
     * next job overwrites them; its claim then fails and it uses nothing. */
    alignas(64) _Atomic uint64_t work;  /* generation << 32 | indices left */
    _Atomic(tsr_pool_fn) fn;
    _Atomic(void *) arg;
    atomic_uint n;
    /* Futex word for sleeping helpers; on its own cache line so spinning
     * helpers do not steal the line the claims go through. */
    alignas(64) atomic_uint gen;
    atomic_int sleepers;
    atomic_bool stop;
    /* Indices finished in the current job; futex word for a sleeping caller. */
    alignas(64) atomic_uint done;
    atomic_int caller_waiting;
    /* The caller's own, and fixed while helpers run. */
    alignas(64) uint32_t posted;        /* generation of the last job */
    int n_threads;
    atomic_int spin_ns;
    int n_helpers;                      /* started, so joined by destroy */
    pthread_t *helpers;
};

static long futex(atomic_uint *word, int op, unsigned val)
{
    return syscall(SYS_futex, (uint32_t *)word, op, val, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spins until *word != val or spin_ns pass; returns the last value read.
 * The clock is read every 64 pauses only: a pause is 10-150 cycles, so this
 * overshoots the budget by well under a microsecond. */
static unsigned spin_while_equal(atomic_uint *word, unsigned val, int64_t spin_ns)
{
    unsigned v = atomic_load_explicit(word, memory_order_acquire);
    if (v != val || spin_ns <= 0) return v;
    int64_t until = now_ns() + spin_ns;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            cpu_relax();
            v = atomic_load_explicit(word, memory_order_acquire);
            if (v != val) return v;
        }
        if (now_ns() >= until) return v;
    }
}

/* Claims and runs indices of the job whose claim word was read as w, until
 * that job has none left.  Chunks shrink as the job drains (guided
 * scheduling), so a long loop costs few claims and its tail still spreads. */
static void run_job(tsr_pool_t *p, uint64_t w)
{
    const uint32_t g = (uint32_t)(w >> 32);
    tsr_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
    void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
    const uint32_t n = atomic_load_explicit(&p->n, memory_order_relaxed);
    for (;;) {
        uint32_t left = (uint32_t)w;
        if ((uint32_t)(w >> 32) != g || left == 0) return;
        uint32_t k = left / (2u * (uint32_t)p->n_threads);
        if (k == 0) k = 1;
        /* Success proves job g still had indices left, so fn, arg and n read
         * above are g's: the next job's are written only after g's last
         * index has been claimed and run. */
        if (!atomic_compare_exchange_weak_explicit(&p->work, &w, w - k, memory_order_acquire,
                                                   memory_order_acquire))
            continue;
        uint32_t i = n - left;
        for (uint32_t j = i; j < i + k; j++) fn(arg, (int)j);
        uint32_t prev = atomic_fetch_add_explicit(&p->done, k, memory_order_seq_cst);
        if (prev + k == n && atomic_load_explicit(&p->caller_waiting, memory_order_seq_cst))
            futex(&p->done, FUTEX_WAKE_PRIVATE, 1);
        w = atomic_load_explicit(&p->work, memory_order_acquire);
    }
}

static void *helper_main(void *arg)
{
    tsr_pool_t *p = arg;
    uint32_t seen = 0;
    for (;;) {
        int64_t spin = atomic_load_explicit(&p->spin_ns, memory_order_relaxed);
        unsigned g = spin_while_equal(&p->gen, seen, spin);
        while (g == seen) {
            atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
            g = atomic_load_explicit(&p->gen, memory_order_seq_cst);
            if (g == seen) {
                futex(&p->gen, FUTEX_WAIT_PRIVATE, seen);
                g = atomic_load_explicit(&p->gen, memory_order_acquire);
            }
            atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_relaxed);
        }
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        /* The claim word is stored before gen, so it names this job or a
         * newer one; waiting next for gen to leave that generation skips
         * nothing. */
        uint64_t w = atomic_load_explicit(&p->work, memory_order_acquire);
        seen = (uint32_t)(w >> 32);
        run_job(p, w);
    }
    return NULL;
}

/* The pool size when the caller leaves it to us: $TSR_THREADS, else the
 * CPUs in this process's affinity mask (a worker started under taskset or
 * a cgroup cpuset should not run more threads than it has CPUs). */
int tsr_pool_default_threads(void)
{
    int n_cpus = 1;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        n_cpus = CPU_COUNT(&set);
    const char *env = getenv("TSR_THREADS");
    if (!env || !*env) return n_cpus;
    char *end;
    errno = 0;
    long v = strtol(env, &end, 10);
    if (errno || *end || v < 1 || v > MAX_THREADS) {
        tsr_warn("TSR_THREADS \"%s\" is not a thread count in 1..%d; using the %d CPUs this "
                 "process may run on", env, MAX_THREADS, n_cpus);
        return n_cpus;
    }
    return (int)v;
}

tsr_pool_t *tsr_pool_new(int n_threads)
{
    tsr_pool_t *p = NULL, *result = NULL;
    if (n_threads <= 0) n_threads = tsr_pool_default_threads();
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;

    size_t size = (sizeof *p + 63) / 64 * 64;
    p = aligned_alloc(64, size);
    if (!p) goto out;
    memset(p, 0, size);
    atomic_init(&p->work, 0);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->arg, NULL);
    atomic_init(&p->n, 0);
    atomic_init(&p->gen, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->done, 0);
    atomic_init(&p->caller_waiting, 0);
    atomic_init(&p->spin_ns, TSR_POOL_SPIN_US * 1000);
    p->n_threads = n_threads;
    p->helpers = calloc((size_t)n_threads, sizeof *p->helpers);
    if (!p->helpers) goto out;
    for (int i = 0; i < n_threads - 1; i++) {
        int err = pthread_create(&p->helpers[i], NULL, helper_main, p);
        if (err) {
            tsr_error("cpu pool: cannot start helper thread %d of %d: %s", i + 1, n_threads - 1,
                      strerror(err));
            goto out;
        }
        p->n_helpers++;
    }
    result = p;
    p = NULL;  /* transferred */
out:
    tsr_pool_destroy(&p);
    return result;
}

void tsr_pool_destroy(tsr_pool_t **p_p)
{
    if (!p_p || !*p_p) return;
    tsr_pool_t *p = *p_p;
    if (p->n_helpers > 0) {
        atomic_store_explicit(&p->stop, true, memory_order_release);
        atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst);
        futex(&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
        for (int i = 0; i < p->n_helpers; i++) pthread_join(p->helpers[i], NULL);
    }
    free(p->helpers);
    free(p);
    *p_p = NULL;
}

int tsr_pool_threads(const tsr_pool_t *p)
{
    return p->n_threads;
}

void tsr_pool_set_spin_us(tsr_pool_t *p, int us)
{
    atomic_store_explicit(&p->spin_ns, us > 0 ? us * 1000 : 0, memory_order_relaxed);
}

void tsr_pool_for(tsr_pool_t *p, int n, void (*fn)(void *arg, int i), void *arg)
{
    if (n <= 0) return;
    if (n == 1 || p->n_threads == 1) {  /* nobody to share with: no handoff at all */
        for (int i = 0; i < n; i++) fn(arg, i);
        return;
    }
    uint32_t g = ++p->posted;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->n, (uint32_t)n, memory_order_relaxed);
    uint64_t w = (uint64_t)g << 32 | (uint32_t)n;
    atomic_store_explicit(&p->work, w, memory_order_release);
    atomic_store_explicit(&p->gen, g, memory_order_seq_cst);
    /* Spinning helpers see gen change by themselves: the syscall is paid
     * only when one has gone to sleep. */
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0) {
        int want = n - 1 < p->n_helpers ? n - 1 : p->n_helpers;
        futex(&p->gen, FUTEX_WAKE_PRIVATE, (unsigned)want);
    }

    run_job(p, w);

    /* The wait is the imbalance between threads, normally short; a helper
     * descheduled mid-chunk (a busy host) would make it long, so after the
     * spin the caller sleeps rather than burn the CPU that helper needs. */
    const unsigned un = (unsigned)n;
    int64_t spin = atomic_load_explicit(&p->spin_ns, memory_order_relaxed);
    unsigned d = atomic_load_explicit(&p->done, memory_order_acquire);
    if (d != un) {
        int64_t until = now_ns() + spin;
        while (d != un && now_ns() < until) {
            for (int i = 0; i < 64 && d != un; i++) {
                cpu_relax();
                d = atomic_load_explicit(&p->done, memory_order_acquire);
            }
        }
    }
    while (d != un) {
        atomic_store_explicit(&p->caller_waiting, 1, memory_order_seq_cst);
        d = atomic_load_explicit(&p->done, memory_order_seq_cst);
        if (d != un) {
            futex(&p->done, FUTEX_WAIT_PRIVATE, d);
            d = atomic_load_explicit(&p->done, memory_order_acquire);
        }
        atomic_store_explicit(&p->caller_waiting, 0, memory_order_relaxed);
    }
}
