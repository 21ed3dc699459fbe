/* fake_nccl_worker.c: the worker (worker/main.c) with its cuda row replaced
 * by the CPU engine over a fake NCCL, so that an integration test runs a
 * cuda deployment's NCCL groups through a real coordinator on a machine
 * without a GPU.  By default the fake of tests/unit/fake_nccl.h, whose
 * groups live in one process: only groups of one (TSR_TEST_NCCL_SOLO=1)
 * form; groups of two ranks must share a stand-in GPU
 * (TSR_TEST_FAKE_CUDA_BUS), which sends them to the TCP fallback.
 * TSR_TEST_FAKE_NCCL=tcp: the fake of fake_nccl_tcp.h instead, whose
 * groups span processes (workers on distinct stand-in GPUs).
 *
 * TSR_TEST_FAKE_NCCL_ERROR_AFTER=N: the group of this process's N-th
 * all-reduce reports an asynchronous error (as ncclCommGetAsyncError
 * would), once.
 *
 * SIGUSR1: the next all-reduce never returns, whatever happens (an abort,
 * a newer epoch, a stop): the thread that calls it sleeps for good, as one
 * stuck in a driver call would, while the rest of the process (the agent,
 * its heartbeats) goes on.  Logged when it happens. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/integration/fake_nccl_tcp.h"
#include "tests/unit/fake_nccl.h"
#include "worker/engine.h"

int tsr_worker_main(int argc, char **argv);   /* worker/main.c, renamed */

static long error_after = -1, allreduces;   /* the executor's thread only */
static bool over_tcp;
static tsr_nccl_api_t api;

static volatile sig_atomic_t stall_next;

static void on_usr1(int sig)
{
    (void)sig;
    stall_next = 1;
}

static int allreduce_or_error(void *comm, void *buf, size_t count, tsr_dtype_t dt, void *stream)
{
    if (stall_next) {
        static const char msg[] = "fake NCCL: this all-reduce is stuck for good (SIGUSR1)\n";
        if (write(2, msg, sizeof msg - 1) < 0) {}
        for (;;) sleep(3600);
    }
    /* issued first, then failed, as an error NCCL finds while it runs */
    int rc = (over_tcp ? ft_allreduce : fake_allreduce)(comm, buf, count, dt, stream);
    if (++allreduces == error_after) {
        if (over_tcp) ft_inject_error(comm);
        else fake_nccl_inject_error(((fake_comm_t *)comm)->g->id);
    }
    return rc;
}

static const tsr_nccl_api_t *fake_nccl_of(char *why, size_t len)
{
    (void)why;
    (void)len;
    return &api;
}

int main(int argc, char **argv)
{
    const char *kind = getenv("TSR_TEST_FAKE_NCCL");
    over_tcp = kind && !strcmp(kind, "tcp");
    api = over_tcp ? fake_nccl_tcp : fake_nccl;
    api.allreduce_sum = allreduce_or_error;
    const char *after = getenv("TSR_TEST_FAKE_NCCL_ERROR_AFTER");
    if (after && *after) error_after = atol(after);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
    static const tsr_backend_t row = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp,
                                      fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CUDA, &row);
    return tsr_worker_main(argc, argv);
}
