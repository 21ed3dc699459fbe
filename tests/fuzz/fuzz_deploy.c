/* fuzz_deploy.c: the deployment file parser (common/deploy.c,
 * tsr_config_parse) on arbitrary bytes.  It must return 0 with a config whose
 * fields are in their documented ranges, or -1 with a message, quickly: a
 * hostile file is rejected in milliseconds, not seconds (-timeout in run.sh). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/deploy.h"
#include "common/log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512] = "";
    tsr_config_t *cfg = NULL;

    if (tsr_config_parse((const char *)data, size, "/etc/tessera/fuzz.yaml", &cfg, err,
                         sizeof err) < 0) {
        if (cfg != NULL || err[0] == '\0') abort();   /* a failure says why */
        return 0;
    }
    if (cfg->heartbeat_interval_ms <= 0 ||
        cfg->worker_timeout_ms <= cfg->heartbeat_interval_ms ||
        !cfg->workers_endpoint || !cfg->control_endpoint)
        abort();
    for (size_t i = 0; i < cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &cfg->deployments[i];
        if (!d->name || !d->model || !d->model_path || d->tensor < 1 || d->pipeline < 1 ||
            d->replicas < 1 || d->max_seq_len < 1 || d->max_batch < 1 ||
            d->max_batch > 1024 || d->prefill_chunk < 1 || d->kv_cache_mib < 0 ||
            d->max_queue < 0)
            abort();
        if (tsr_config_find(cfg, d->name) == NULL) abort();
    }
    tsr_config_destroy(&cfg);
    if (cfg != NULL) abort();
    return 0;
}
