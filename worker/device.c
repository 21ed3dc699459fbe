#include "device.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The few NVML entry points used, declared here so no NVML header or
 * library is needed at build time. */
typedef struct {
    unsigned long long total, free, used;
} nvml_memory_t;
typedef int (*nvml_init_fn)(void);
typedef int (*nvml_count_fn)(unsigned *);
typedef int (*nvml_handle_fn)(unsigned, void **);
typedef int (*nvml_mem_fn)(void *, nvml_memory_t *);
typedef int (*nvml_name_fn)(void *, char *, unsigned);
typedef const char *(*nvml_err_fn)(int);
/* nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it. */
typedef struct {
    char bus_id_legacy[16];
    unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
    char bus_id[32];
} nvml_pci_t;
typedef int (*nvml_pci_fn)(void *, nvml_pci_t *);
typedef int (*nvml_link_state_fn)(void *, unsigned, int *);
typedef int (*nvml_link_pci_fn)(void *, unsigned, nvml_pci_t *);

/* Adds bus to info's NVLink peers unless it is there already. */
static void add_nvlink(tsr_device_info_t *info, const char *bus)
{
    for (int i = 0; i < info->n_nvlink; i++)
        if (!strcmp(info->nvlink[i], bus)) return;
    if (info->n_nvlink < TSR_NVLINK_MAX && *bus)
        snprintf(info->nvlink[info->n_nvlink++], sizeof info->nvlink[0], "%s", bus);
}

static int probe_cuda(unsigned index, tsr_device_info_t *info, char *err, size_t errlen)
{
    /* Tests on machines without a GPU: a stand-in device of this many MiB,
     * so placement and the "built without CUDA" refusal can be exercised. */
    const char *fake = NULL;
#ifdef TSR_TESTING
    fake = getenv("TSR_TEST_FAKE_CUDA_MIB");
#endif
    if (fake && *fake) {
        char *end;
        unsigned long long mib = strtoull(fake, &end, 10);
        if (*end || mib == 0) {
            snprintf(err, errlen, "TSR_TEST_FAKE_CUDA_MIB: expected a positive number, got '%s'", fake);
            return -1;
        }
        info->kind = TSR_DEVICE_CUDA;
        info->index = index;
        info->memory = (uint64_t)mib << 20;
        snprintf(info->description, sizeof info->description, "test stand-in (no GPU)");
        /* TSR_TEST_FAKE_CUDA_BUS: its PCI bus id (two stand-ins may share one) */
        const char *bus = getenv("TSR_TEST_FAKE_CUDA_BUS");
        if (bus && *bus) snprintf(info->pci_bus_id, sizeof info->pci_bus_id, "%s", bus);
        else snprintf(info->pci_bus_id, sizeof info->pci_bus_id, "00000000:%02X:00.0", index & 0xff);
        /* TSR_TEST_FAKE_CUDA_NVLINK: its NVLink peers, comma-separated */
        const char *links = getenv("TSR_TEST_FAKE_CUDA_NVLINK");
        char one[32];
        for (const char *p = links; p && *p;) {
            size_t n = strcspn(p, ",");
            snprintf(one, sizeof one, "%.*s", (int)(n < sizeof one ? n : sizeof one - 1), p);
            add_nvlink(info, one);
            p += n + (p[n] == ',');
        }
        return 0;
    }
    int rc = -1;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(err, errlen, "cuda device %u: cannot load the NVIDIA driver's NVML (%s)", index,
                 dlerror());
        return -1;
    }
    nvml_init_fn init = (nvml_init_fn)dlsym(lib, "nvmlInit_v2");
    nvml_count_fn count = (nvml_count_fn)dlsym(lib, "nvmlDeviceGetCount_v2");
    nvml_handle_fn handle = (nvml_handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    nvml_mem_fn mem = (nvml_mem_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo");
    nvml_name_fn name = (nvml_name_fn)dlsym(lib, "nvmlDeviceGetName");
    nvml_err_fn estr = (nvml_err_fn)dlsym(lib, "nvmlErrorString");
    nvml_pci_fn pci = (nvml_pci_fn)dlsym(lib, "nvmlDeviceGetPciInfo_v3");
    nvml_link_state_fn link_state = (nvml_link_state_fn)dlsym(lib, "nvmlDeviceGetNvLinkState");
    nvml_link_pci_fn link_pci = (nvml_link_pci_fn)dlsym(lib, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
    if (!init || !count || !handle || !mem || !name || !estr) {
        snprintf(err, errlen, "cuda device %u: NVML lacks an expected function", index);
        goto out;
    }
    int r = init();
    if (r) {
        snprintf(err, errlen, "cuda device %u: NVML init failed: %s", index, estr(r));
        goto out;
    }
    unsigned n = 0;
    if ((r = count(&n)) != 0 || index >= n) {
        snprintf(err, errlen, "cuda device %u not found: the driver reports %u device(s)", index,
                 n);
        goto out;
    }
    void *dev = NULL;
    nvml_memory_t m;
    if ((r = handle(index, &dev)) != 0 || (r = mem(dev, &m)) != 0) {
        snprintf(err, errlen, "cuda device %u: %s", index, estr(r));
        goto out;
    }
    info->memory = m.total;
    nvml_pci_t p;
    memset(&p, 0, sizeof p);
    if (pci && pci(dev, &p) == 0) {
        p.bus_id[sizeof p.bus_id - 1] = '\0';
        snprintf(info->pci_bus_id, sizeof info->pci_bus_id, "%s", p.bus_id);
    }
    /* NVLinks: an error (no NVLink on this GPU) just means none */
    for (unsigned l = 0; link_state && link_pci && l < TSR_NVLINK_MAX; l++) {
        int active = 0;
        memset(&p, 0, sizeof p);
        if (link_state(dev, l, &active) != 0 || !active || link_pci(dev, l, &p) != 0) continue;
        p.bus_id[sizeof p.bus_id - 1] = '\0';
        add_nvlink(info, p.bus_id);
    }
    if (name(dev, info->description, sizeof info->description) != 0)
        snprintf(info->description, sizeof info->description, "cuda device %u", index);
    rc = 0;
out:
    dlclose(lib);
    return rc;
}

int tsr_device_probe(tsr_device_t kind, unsigned index, tsr_device_info_t *info, char *err,
                     size_t errlen)
{
    memset(info, 0, sizeof *info);
    info->kind = kind;
    info->index = index;
    if (kind == TSR_DEVICE_CUDA) return probe_cuda(index, info, err, errlen);
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    info->memory = pages > 0 && psize > 0 ? (uint64_t)pages * (uint64_t)psize : 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(info->description, sizeof info->description, "cpu (%ld cores)", cores);
    info->cpu_cores = cores > 0 ? (unsigned)cores : 0;
    return 0;
}
