/* device.h: what a worker's device is (kind, index, memory), for its
 * registration.  CUDA devices are queried through NVML, loaded at run time
 * so the worker builds and runs on machines without the driver. */
#ifndef TSR_DEVICE_H
#define TSR_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/deploy.h"

#define TSR_NVLINK_MAX 18   /* NVML_NVLINK_MAX_LINKS */

typedef struct {
    tsr_device_t kind;
    unsigned index;
    uint64_t memory;        /* bytes: device memory, or RAM for cpu */
    char description[128];  /* "NVIDIA H200", "cpu (16 cores)" */
    char pci_bus_id[32];    /* cuda: "00000000:3B:00.0" (NVML's; "" when unknown) */
    bool nccl;              /* cuda: libnccl.so.2 loads, so its groups may use NCCL */
    /* cuda: the PCI bus ids at the far end of its active NVLinks (GPUs or
     * NVSwitches), n_nvlink of them */
    char nvlink[TSR_NVLINK_MAX][32];
    int n_nvlink;
    double mem_gbs, gflops;   /* its rates as the operator gave them (0: not given) */
    unsigned cpu_cores;       /* cpu: the node's online CPUs */
    unsigned cpu_threads;     /* cpu: the threads its engine runs (the pool's) */
} tsr_device_info_t;

/* Fills info for device `index` of `kind`.  Returns 0, or -1 with a reason
 * ("cuda device 3 not found: NVML reports 2 devices"). */
int tsr_device_probe(tsr_device_t kind, unsigned index, tsr_device_info_t *info, char *err,
                     size_t errlen);

#endif
