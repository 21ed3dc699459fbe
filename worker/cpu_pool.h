/* cpu_pool.h: one pool of threads for a whole forward step of the CPU engine.
 *
 * Why: the engine once made ~57 small OpenBLAS calls per decoded token, and
 * OpenBLAS threads woke and slept around each (20% of worker time went to
 * sched_yield).  The pool's threads stay awake across a step, and the
 * engine's own products (worker/matmul_f32.h, worker/matmul_bf16.h) split
 * each matrix between them.
 *
 * Threads: the caller's thread is one of the pool's threads; n-1 helpers
 * are started.  A helper spins for a short while after its work (so back to
 * back calls cost no system call), then sleeps on a futex.
 *
 * Thread safety: a pool serves one caller at a time; tsr_pool_for and the
 * products on it are not reentrant (fn must not call back into the pool).
 * Two engines in one process need two pools, or a lock around the calls. */
#ifndef TSR_CPU_POOL_H
#define TSR_CPU_POOL_H

typedef struct tsr_pool tsr_pool_t;

/* A pool of n_threads threads, the caller's included (n_threads-1 helpers
 * are started).  n_threads <= 0: $TSR_THREADS if set, else the number of
 * CPUs this process may run on (sched_getaffinity).
 * Returns NULL on failure (no thread could be started, no memory); caller
 * owns the pool and frees it with tsr_pool_destroy. */
tsr_pool_t *tsr_pool_new(int n_threads);

/* Stops and joins the helpers, frees the pool, sets *p_p NULL.  NULL-safe
 * (p_p NULL or *p_p NULL).  Must not run while a call is in progress. */
void tsr_pool_destroy(tsr_pool_t **p_p);

/* The pool size tsr_pool_new(0) takes: $TSR_THREADS, else the CPUs this process may
 * run on. */
int tsr_pool_default_threads(void);

/* Threads in the pool, the caller's included (>= 1). */
int tsr_pool_threads(const tsr_pool_t *p);

/* Runs fn(arg, i) for every i in [0, n), each exactly once, spread over the
 * pool's threads and the calling thread; returns when all calls are done.
 * Indices are handed out as they are claimed, so a helper that wakes late
 * finds less to do instead of holding the caller up.  n <= 0 does nothing.
 * Not reentrant: one caller at a time, and fn must not call into the pool. */
void tsr_pool_for(tsr_pool_t *p, int n, void (*fn)(void *arg, int i), void *arg);

/* How long a helper spins for new work before it sleeps (default
 * TSR_POOL_SPIN_US).  0 makes helpers sleep at once (useful to measure the
 * futex path).  Call between jobs only. */
void tsr_pool_set_spin_us(tsr_pool_t *p, int us);

/* 50 us rather than a few: it has to outlast the caller's single-threaded
 * work between two products (norms, RoPE, attention at short contexts) or
 * every product starts with helpers asleep.  Measured on a 2-core EPYC VM
 * (bench/bench_pool, a shared host): helpers asleep at each call cost a
 * decode step of 48 products 0.3-1.7 ms (2-13%); spinning, a handoff costs
 * the caller 0.2-0.3 us.  The price is at most 50 us of each helper's CPU
 * after the last product. */
#define TSR_POOL_SPIN_US 50

#endif
