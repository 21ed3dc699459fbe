/* agent.h: the worker's side of the control protocol.
 *
 * Registers (with backoff), heartbeats, takes assignments, reports progress,
 * ready and failures, and keeps its piece across a coordinator restart: when
 * a new coordinator does not know it, it registers again with the piece it
 * holds so the coordinator can adopt it.  With no word from the coordinator
 * for longer than its lease it keeps the piece but takes no new work until
 * the coordinator is back. */
#ifndef TSR_AGENT_H
#define TSR_AGENT_H

#include <stdbool.h>
#include <stdint.h>
#include "common/wire.h"
#include "common/keys.h"
#include "worker/device.h"
#include "worker/executor.h"

typedef enum { TSR_A_REGISTERING = 0, TSR_A_REGISTERED } tsr_agent_phase_t;

typedef struct {
    char name[TSR_NAME_MAX + 1];
    char node[TSR_NAME_MAX + 1];
    char endpoint[512];
    tsr_device_info_t device;
    uint32_t protocol_version;    /* what it claims; differs only in tests */

    void *sock;
    tsr_agent_phase_t phase;
    int64_t next_register_ms;
    int register_backoff_ms;
    int hb_interval_ms, lease_ms;
    int64_t next_hb_ms, last_heard_ms;
    bool detached;                /* lease expired: no new work */
    uint64_t seq;
    int64_t load_cpu_us, load_wall_ms;  /* CPU time at the last heartbeat */

    bool has_piece;
    Tessera__WorkerState state;
    char deployment[TSR_NAME_MAX + 1];
    char model_path[TSR_PATH_MAX + 1];
    Tessera__Assignment piece;    /* strings point at the buffers above */
    char reason[512];
    bool retryable;               /* state failed: rewiring may mend it (Failed.retryable) */
    bool past_deadline;           /* ...because its TP group passed a deadline (Failed.past_deadline) */

    tsr_executor_t *ex;           /* the data plane; NULL: only the config check (tests) */

    /* NCCL rendezvous blobs this worker made (rank 0 of a group), sent to
     * the coordinator again every second while the piece is loading, so a
     * member that registered late, or an offer lost to a coordinator
     * restart, still gets one. */
    struct {
        uint64_t epoch, group;
        uint8_t blob[256];
        size_t len;
    } offers[3];
    int n_offers;
    int64_t next_offer_ms;

    uint64_t stale_dropped;
    uint64_t sends_failed;        /* messages the coordinator could not be sent */
    void *mon;                    /* the connection's events (handshake failures) */
    char identity[TSR_NAME_MAX + 1];  /* its CURVE key's name ("" without CURVE) */
    char keys_dir[TSR_PATH_MAX];
    uint64_t handshake_failures;
    const char *handshake_why;    /* the last failure logged, and when */
    int64_t handshake_logged_ms;
    int64_t reconnect_at_ms;      /* connect again then (0: not planned) */
    bool tcp_connected;           /* a TCP connection to the coordinator was made */
    bool handshake_ok;            /* ...and a handshake on one completed */
    uint32_t handshakes_cut;      /* handshakes closed by the far end since the last success */
    bool registered_once;         /* lease_ms is the coordinator's, not the default */
    int exit_code;                /* set with stop */
    bool stop;
} tsr_agent_t;

/* Connects to endpoint.  Returns NULL with a message in err. */
tsr_agent_t *tsr_agent_new(const char *name, const char *node, const char *endpoint,
                           const tsr_security_t *sec, const tsr_device_info_t *dev, char *err,
                           size_t errlen);
void tsr_agent_destroy(tsr_agent_t **self_p);

/* Handles every waiting message and due timer; returns the ms until the
 * next timer. */
int tsr_agent_step(tsr_agent_t *a, int64_t now_ms);

/* Checks that an assignment can be served from its model directory.  In
 * this release that is the model's config.json against the layout; the
 * weights come with the data plane.  Returns 0 or -1 with a reason. */
int tsr_agent_check_piece(const Tessera__Assignment *as, char *err, size_t errlen);

#endif
