/* backend.c: the one place a piece's device kind picks its engine and
 * collectives.  A build without the CUDA engine (make CUDA=0, or no nvcc)
 * has no row for cuda, so a cuda piece fails with that reason instead of
 * running on the CPU. */
#include <stdio.h>

#include "worker/engine.h"
#ifdef TSR_HAVE_CUDA
#include "worker/cuda/cuda.h"
#endif

static const struct {
    tsr_device_t device;
    tsr_backend_t b;
} backends[] = {
    {TSR_DEVICE_CPU, {&tsr_engine_cpu, &tsr_coll_tcp}},
#ifdef TSR_HAVE_CUDA
    /* Until the NCCL backend: the TCP collectives, staged through host memory. */
    {TSR_DEVICE_CUDA, {&tsr_engine_cuda, &tsr_coll_staged}},
#endif
};

int tsr_backend_for(tsr_device_t d, tsr_backend_t *out, char *err, size_t errlen)
{
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
