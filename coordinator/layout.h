/* layout.h: how a deployment could be cut (tensor x pipeline), what each cut
 * costs in memory per device and in time per token, and which one to choose:
 * the smallest cut that fits, so that the remaining devices serve as replicas.
 *
 * Memory comes from common/budget.c, the functions the engines size their
 * allocations with; time from a model of one decode step (weights and KV read
 * at the device's memory bandwidth, matrix products at its rate, two
 * all-reduces a layer over the group's link, a hand-off between stages). */
#ifndef TSR_LAYOUT_H
#define TSR_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/deploy.h"
#include "common/modelcfg.h"

/* Where a tensor-parallel group's all-reduces travel. */
typedef enum { TSR_LINK_NONE, TSR_LINK_NVLINK, TSR_LINK_NODE, TSR_LINK_NETWORK } tsr_link_t;

/* The devices a deployment may use, as the cost model sees them. */
typedef struct {
    int devices;            /* workers of the deployment's kind free for it */
    int per_node;           /* of them on one node (the largest node) */
    int per_domain;         /* in one NVLink domain (0 or 1: none) */
    uint64_t memory;        /* bytes per device (0: not checked) */
    double mem_gbs;         /* memory bandwidth a device reads weights at, GB/s */
    double gflops;          /* matrix-product rate at the engine's type, GFLOP/s */
    double link_gbs[4];     /* all-reduce bandwidth over each tsr_link_t, GB/s */
    double link_us[4];      /* and the latency of one all-reduce or hand-off, us */
    int cores;              /* cpu: the cores a node's workers share (0: not limited) */
    int threads;            /* cpu: threads a worker runs (0: cores, a worker's default) */
} tsr_devices_t;

/* One candidate cut of a deployment. */
typedef struct {
    int tensor, pipeline;
    int replicas;           /* of this cut the devices hold (at most the deployment's) */
    bool valid;             /* the model splits so */
    char invalid[96];       /* why not */
    uint64_t need;          /* bytes on the fullest device: weights, least KV, reserve */
    uint64_t weights;       /* the fullest stage's weights */
    uint64_t have;          /* bytes a device has (0: not checked) */
    bool fits;              /* need <= memory (always, memory unknown) */
    tsr_link_t link;        /* where its all-reduces go */
    double ms_token;        /* one sequence alone: a decode step through every stage */
    double tok_s;           /* one replica at max_batch sequences */
    double tok_s_all;       /* every replica together */
} tsr_layout_t;

/* Deployment d cut into tensor t x pipeline p on devs, candidate or not (an
 * operator's explicit layout): valid false with the reason when it cannot be. */
void tsr_layout_of(const tsr_model_info_t *m, const tsr_deployment_t *d,
                   const tsr_devices_t *devs, int t, int p, tsr_layout_t *out);

/* The candidate cuts of deployment d on model m over devs: every tensor
 * size the model's heads divide, up to the devices (or a node), times every
 * pipeline depth up to the layers and the devices; at most max written to out,
 * the count returned (all there were, when larger than max). */
size_t tsr_layout_candidates(const tsr_model_info_t *m, const tsr_deployment_t *d,
                             const tsr_devices_t *devs, tsr_layout_t *out, size_t max);

/* The index in c[0..n) of the cut to run: the fewest devices per replica that
 * fits (and meets latency_ms, when > 0); between cuts of as many devices, the
 * faster per token (a tensor group on a fast link beats stages; stages beat a
 * group across the network).  why (may be NULL) gets the reason in words.  -1
 * when none does (why says what the closest needs, or how slow the fastest is). */
int tsr_layout_choose(const tsr_layout_t *c, size_t n, double latency_ms, char *why,
                      size_t why_len);

/* The cut of a deployment whose tensor or pipeline (or both) is auto: the
 * rule above over the cuts that keep its fixed dimension, at most a node's
 * devices in a tensor group.  0 with the cut in *out, or -1; why gets the
 * reason either way. */
int tsr_layout_choose_auto(const tsr_model_info_t *m, const tsr_deployment_t *d,
                           const tsr_devices_t *devs, tsr_layout_t *out, char *why,
                           size_t why_len);

/* The rates the estimates assume for a device of kind `kind` (memory
 * bandwidth, product rate, links), leaving the counts and memory alone: an
 * H100 SXM's published figures for cuda (3,350 GB/s, 989 TFLOP/s dense BF16,
 * NVLink 450 GB/s, PCIe 25 GB/s, a 100 Gb/s network), and for a cpu worker
 * 20 GB/s, 200 GFLOP/s, loopback 2 GB/s and a 10 Gb/s network. */
void tsr_devices_defaults(tsr_devices_t *v, tsr_device_t kind);

/* "nvlink", "node", "network" or "-" (a group of one). */
const char *tsr_link_name(tsr_link_t link);

#endif
