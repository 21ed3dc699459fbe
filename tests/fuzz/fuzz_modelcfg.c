/* fuzz_modelcfg.c: the config.json reader (common/modelcfg.c,
 * tsr_model_info_load) on arbitrary bytes.  The loader takes a directory, so
 * each input is written to config.json in a directory of its own under
 * /dev/shm (or TMPDIR) first.  An accepted config is then taken through the
 * checks and sums the planner and the worker make with it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/budget.h"
#include "common/deploy.h"
#include "common/log.h"
#include "common/modelcfg.h"

static char dir[256], path[300];

static void cleanup(void)
{
    unlink(path);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/tsr-fuzz-modelcfg-XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(dir)) { perror(dir); exit(1); }
    snprintf(path, sizeof path, "%s/config.json", dir);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    tsr_model_info_t m;
    FILE *f = fopen(path, "w");

    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
    if (tsr_model_info_load(dir, &m, err, sizeof err) < 0) {
        if (err[0] == '\0') abort();
        return 0;
    }
    if (m.num_hidden_layers < 1 || m.num_attention_heads < 1 || m.hidden_size < 1 ||
        m.num_key_value_heads < 1 || m.vocab_size < 1 || m.n_eos < 0 || m.n_eos > 8)
        abort();
    /* What the planner does with it: a layout check, the stage split and
     * the memory figure of every piece, for a few layouts. */
    static const int layouts[][3] = { {1, 1, 1}, {2, 2, 1}, {8, 4, 2}, {3, 5, 7} };
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
        tsr_deployment_t d = { .name = "fuzz", .model = dir, .model_path = dir,
                               .tensor = layouts[k][0], .pipeline = layouts[k][1],
                               .replicas = layouts[k][2], .max_seq_len = 2048,
                               .max_batch = 32, .prefill_chunk = 128, .line = 1, .column = 1 };
        if (tsr_model_check_layout(&m, &d, 0, "fuzz.yaml", err, sizeof err) < 0) continue;
        for (int s = 0; s < d.pipeline; s++) {
            int b, e;
            tsr_layer_split(m.num_hidden_layers, d.pipeline, s, &b, &e);
            if (b < 0 || e <= b || e > m.num_hidden_layers) abort();
            (void)tsr_model_piece_bytes(&m, d.pipeline, s, d.tensor);
            (void)tsr_model_check_piece(&m, dir, 0, d.tensor, s, d.pipeline, b, e, err,
                                        sizeof err);
        }
    }
    return 0;
}
