/* cpu_kernels.c: which build of the CPU kernels this process runs, asked
 * once (see cpu_kernels.h). */
#include "worker/cpu_kernels.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

tsr_cpu_kernels_t tsr_cpu_kernels(void)
{
    static int answer = -1;
    int a = __atomic_load_n(&answer, __ATOMIC_RELAXED);
    if (a < 0) {
        const char *k = getenv("TSR_CPU_KERNELS");
        if (k && *k && strcmp(k, "plain") && strcmp(k, "avx2") && strcmp(k, "avx512") &&
            strcmp(k, "amx"))
            tsr_warn("TSR_CPU_KERNELS \"%s\" is not plain, avx2, avx512 or amx; using the best "
                     "build this CPU has, without AMX", k);
        a = TSR_KERNELS_PLAIN;
#if defined(__x86_64__)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            !(k && !strcmp(k, "plain")))
            a = __builtin_cpu_supports("avx512f") && !(k && !strcmp(k, "avx2"))
                    ? TSR_KERNELS_AVX512
                    : TSR_KERNELS_AVX2;
#endif
        (void)k;
        __atomic_store_n(&answer, a, __ATOMIC_RELAXED);
    }
    return (tsr_cpu_kernels_t)a;
}

const char *tsr_cpu_kernels_name(tsr_cpu_kernels_t k)
{
    return k == TSR_KERNELS_AVX512 ? "avx512" : k == TSR_KERNELS_AVX2 ? "avx2" : "plain";
}
