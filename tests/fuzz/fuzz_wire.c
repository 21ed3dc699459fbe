/* fuzz_wire.c: the wire decoder (common/wire.c, tsr_wire_decode) on
 * arbitrary bytes.  What it decodes must survive what the coordinator and the
 * workers do with any message: name its kind, check its name, encode it
 * again. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/wire.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    tsr_env_t *env = NULL, *again = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;

    /* Both limits: the workers channel and the control replies. */
    if (tsr_wire_decode(data, size, TSR_WIRE_MAX_WORKER, &env, err, sizeof err) < 0) {
        if (strlen(err) >= sizeof err) abort();
        if (tsr_wire_decode(data, size, TSR_WIRE_MAX_CONTROL, &env, err, sizeof err) < 0)
            return 0;
    }
    (void)tsr_env_kind(env);
    if (env->worker) (void)tsr_name_ok(env->worker);
    if (tsr_wire_encode(env, &buf, &len) < 0) abort();
    /* protobuf-c keeps unknown fields and packs them back as it found them,
     * field number 0 included, which it then refuses: so the copy need not
     * decode, but when it does it is the same kind of message. */
    if (tsr_wire_decode(buf, len, TSR_WIRE_MAX_CONTROL, &again, err, sizeof err) == 0 &&
        again->body_case != env->body_case)
        abort();
    tsr_env_free(&again);
    tsr_env_free(&env);
    free(buf);
    return 0;
}
