/* modelfile.h: opening a model directory's files (config.json, tokenizer.json,
 * tokenizer_config.json, the safetensors index and files) so that a link in the
 * directory does not lead out of it unless the operator allows it, and describing a
 * JSON file's syntax error without quoting its bytes.  A model directory is named by
 * a deployment file, but its files are read by daemons whose errors every API key can
 * read in status: tokenizer.json -> /etc/shadow once put a line of that file there. */
#ifndef TSR_MODELFILE_H
#define TSR_MODELFILE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* Whether a model directory's files may be links that lead out of it (the daemons'
 * --allow-model-links-outside; off by default).  Set at start, before a model is read. */
void tsr_model_links_outside(bool allow);

/* Opens dir/name for reading as tsr_open_regular does, refusing (unless allowed above)
 * a file whose real path, links followed, is not inside dir's real path.  The fd, or -1
 * with "DIR/NAME: why" in err. */
int tsr_model_open(const char *dir, const char *name, char *err, size_t errlen);

/* Reads dir/name whole (tsr_model_open), refusing one of more than max bytes: as
 * tsr_read_regular.  Caller frees the result. */
char *tsr_model_read(const char *dir, const char *name, size_t max, size_t *len, char *err,
                     size_t errlen);

/* What is wrong with a text jansson refused, in words of our own: jansson's message
 * quotes the text near the error.  The caller adds where (e->line, column, position). */
const char *tsr_json_error_what(const json_error_t *e);

#endif
