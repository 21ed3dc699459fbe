/* topology.c: the NVLink domains of the live workers, from what each reported at
 * registration (its bus id and the bus ids its links reach). */
#include "topology.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int by_node(const void *a, const void *b)
{
    return strcmp((*(tsr_worker_t *const *)a)->node, (*(tsr_worker_t *const *)b)->node);
}

static bool linked(const tsr_worker_t *a, const tsr_worker_t *b)
{
    for (int i = 0; i < a->n_nvlink; i++) {
        if (!strcmp(a->nvlink[i], b->pci_bus_id)) return true;
        for (int j = 0; j < b->n_nvlink; j++)
            if (!strcmp(a->nvlink[i], b->nvlink[j])) return true;  /* one NVSwitch */
    }
    for (int j = 0; j < b->n_nvlink; j++)
        if (!strcmp(b->nvlink[j], a->pci_bus_id)) return true;
    return false;
}

/* The NVLink domains of the n live workers ws: on each node, the GPUs that
 * NVLinks join (directly, or through a switch both reach) are one domain,
 * named after the node and its lowest bus id; a GPU without NVLink has none. */
void tsr_nvlink_domains(tsr_worker_t **ws, size_t n)
{
    tsr_worker_t **s = malloc((n ? n : 1) * sizeof *s);
    int *up = malloc((n ? n : 1) * sizeof *up);
    const char **low = calloc(n ? n : 1, sizeof *low);
    if (!s || !up || !low) {
        free(s);
        free(up);
        free(low);
        return;
    }
    memcpy(s, ws, n * sizeof *s);
    qsort(s, n, sizeof *s, by_node);
    for (size_t a = 0, b; a < n; a = b) {
        for (b = a; b < n && !strcmp(s[b]->node, s[a]->node); b++) up[b] = (int)b;
        for (size_t i = a; i < b; i++)
            for (size_t j = a; j < i; j++) {
                if (!s[i]->n_nvlink || !s[j]->n_nvlink || !linked(s[i], s[j])) continue;
                int x = (int)i, y = (int)j;
                while (up[x] != x) x = up[x];
                while (up[y] != y) y = up[y];
                if (x != y) up[x] = y;
            }
        /* each root keeps its component's lowest bus id (up[] then points
         * only at roots, so low[] can live beside it in the root's slot) */
        for (size_t i = a; i < b; i++) {
            int x = (int)i;
            while (up[x] != x) x = up[x];
            up[i] = x;
            if (s[i]->pci_bus_id[0] &&
                (!low[x] || strcmp(s[i]->pci_bus_id, low[x]) < 0))
                low[x] = s[i]->pci_bus_id;
        }
        for (size_t i = a; i < b; i++) {
            s[i]->nvlink_domain[0] = '\0';
            if (s[i]->n_nvlink && s[i]->pci_bus_id[0])
                snprintf(s[i]->nvlink_domain, sizeof s[i]->nvlink_domain, "%s/nvl:%s",
                         s[i]->node, low[up[i]]);
        }
    }
    free(s);
    free(up);
    free(low);
}
