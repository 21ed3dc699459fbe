/* fuzz_safetensors.c: the safetensors header parser (common/safetensors.c,
 * tsr_st_parse_header) on arbitrary bytes.  The first 8 bytes of the input
 * are the claimed file size (so offsets past the bytes at hand are reached);
 * the rest is the start of the file.  Every tensor it accepts must lie inside
 * the data area with a byte count that matches its shape. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    tsr_log_init("fuzz", TSR_LOG_ERROR + 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512] = "";
    tsr_tensor_t *t = NULL;
    size_t n = 0;
    uint64_t file_size = 0;

    if (size < 8) return 0;
    memcpy(&file_size, data, 8);
    data += 8;
    size -= 8;
    /* Mostly the real size, sometimes a larger claimed one (a header read
     * from the front of a big file). */
    if (file_size & 1) file_size = size + (file_size >> 1) % (1u << 30);
    else file_size = size;
    if (tsr_st_parse_header(data, size, file_size, "model.safetensors", &t, &n, err,
                            sizeof err) < 0) {
        if (err[0] == '\0') abort();
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (!t[i].name || t[i].ndim < 0 || t[i].ndim > TSR_ST_MAX_DIMS ||
            t[i].offset > file_size || t[i].nbytes > file_size - t[i].offset)
            abort();
    }
    tsr_tensors_free(t, n);
    return 0;
}
