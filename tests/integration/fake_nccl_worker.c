/* fake_nccl_worker.c: the worker (worker/main.c) with its cuda row replaced
 * by the CPU engine over the fake NCCL of tests/unit/fake_nccl.h, so that
 * an integration test runs a cuda deployment's NCCL groups through a real
 * coordinator on a machine without a GPU.  The fake's groups live in one
 * process, so only groups of one (TSR_TEST_NCCL_SOLO=1) can form; groups
 * of two ranks must share a stand-in GPU (TSR_TEST_FAKE_CUDA_BUS), which
 * sends them to the TCP fallback. */
#include "tests/unit/fake_nccl.h"
#include "worker/engine.h"

int tsr_worker_main(int argc, char **argv);   /* worker/main.c, renamed */

static const tsr_nccl_api_t *fake_nccl_of(char *why, size_t len)
{
    (void)why;
    (void)len;
    return &fake_nccl;
}

int main(int argc, char **argv)
{
    static const tsr_backend_t row = {&tsr_engine_cpu, &tsr_coll_gpu, &tsr_coll_tcp,
                                      fake_nccl_of};
    tsr_backend_test_override(TSR_DEVICE_CUDA, &row);
    return tsr_worker_main(argc, argv);
}
