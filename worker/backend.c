/* backend.c: the one place a piece's device kind picks its engine and
 * collectives.  A build without the CUDA engine (make CUDA=0, or no nvcc)
 * has no row for cuda, so a cuda piece fails with that reason instead of
 * running on the CPU. */
#include <stdbool.h>
#include <stdio.h>

#include "worker/engine.h"
#ifdef TSR_HAVE_CUDA
#include "worker/coll_nccl.h"
#include "worker/cuda/cuda.h"

/* libnccl.so.2, opened on first use; without it the staged collectives. */
static const tsr_nccl_api_t *real_nccl(char *why, size_t len)
{
    return tsr_nccl_real_load(why, len) == 0 ? &tsr_nccl_real : NULL;
}
#endif

static const struct {
    tsr_device_t device;
    tsr_backend_t b;
} backends[] = {
    {TSR_DEVICE_CPU, {&tsr_engine_cpu, &tsr_coll_tcp, NULL, NULL}},
#ifdef TSR_HAVE_CUDA
    /* NCCL where a group can have it; the TCP collectives staged through
     * host memory where it cannot (ranks sharing a GPU, no libnccl). */
    {TSR_DEVICE_CUDA, {&tsr_engine_cuda, &tsr_coll_gpu, &tsr_coll_staged, real_nccl}},
#endif
};

/* Tests: the row that replaces device kind d's (set: false, none). */
static tsr_backend_t test_row;
static tsr_device_t test_device;
static bool test_set;

void tsr_backend_test_override(tsr_device_t d, const tsr_backend_t *b)
{
    test_set = b != NULL;
    test_device = d;
    if (b) test_row = *b;
}

int tsr_backend_for(tsr_device_t d, tsr_backend_t *out, char *err, size_t errlen)
{
    if (test_set && d == test_device) {
        *out = test_row;
        return 0;
    }
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (backends[i].device == d) {
            *out = backends[i].b;
            return 0;
        }
    if (d == TSR_DEVICE_CUDA)
        snprintf(err, errlen, "this worker was built without CUDA: it cannot run a cuda piece");
    else
        snprintf(err, errlen, "this worker has no engine for device kind %d", (int)d);
    return -1;
}
