/* tokload.h: reads deployments' tokenizer.json files on a thread of their own, so a
 * reload that brings a new model does not hold the coordinator's loop while a large
 * tokenizer is parsed (a 64 MiB one takes seconds).  The loop asks for a load, goes
 * on, and takes the finished loads when the loader's descriptor is readable. */
#ifndef TSR_COORD_TOKLOAD_H
#define TSR_COORD_TOKLOAD_H

#include <stdbool.h>
#include <stddef.h>

#include "common/tokenizer.h"
#include "common/util.h"

typedef struct tsr_tokload tsr_tokload_t;

/* Reads dir/tokenizer.json (tsr_tok_load), noting in *file the version it read: the file
 * is looked at just before, so a change during the read shows as a change later.  NULL
 * with the reason in err. */
tsr_tokenizer_t *tsr_tok_read_dir(const char *dir, tsr_file_id_t *file, char *err,
                                  size_t errlen);

/* One load, asked for and then finished. */
typedef struct tsr_tokjob {
    struct tsr_tokjob *next;
    char *name;                 /* the deployment that wants it */
    char *dir;                  /* its model directory */
    tsr_tokenizer_t *tok;       /* finished: the tokenizer, or NULL with err */
    tsr_file_id_t file;         /* dir/tokenizer.json as it was just before the read */
    char err[600];
    bool skipped;               /* no longer wanted when its turn came: not read */
} tsr_tokjob_t;

/* A loader with its descriptor and no thread yet (that starts with the first load).
 * NULL: out of memory or descriptors. */
tsr_tokload_t *tsr_tokload_new(void);
/* Waits for the read in progress, if any (a tokenizer's parse cannot be cut short: up to
 * seconds for one near the 64 MiB limit), and frees everything. */
void tsr_tokload_destroy(tsr_tokload_t **self_p);
/* Readable while finished loads wait to be taken. */
int tsr_tokload_fd(const tsr_tokload_t *self);
/* Queues the load of dir's tokenizer.json, for deployment name (the first to ask): 0; one
 * already queued or being read for the same directory is not queued twice: 1; -1 with
 * the reason in err. */
int tsr_tokload_request(tsr_tokload_t *self, const char *name, const char *dir, char *err,
                        size_t errlen);
/* Marks the queued loads that want(arg, name, dir) no longer wants: they are skipped
 * (a reload changed the deployment's model again, or removed it). */
void tsr_tokload_prune(tsr_tokload_t *self, bool (*want)(void *arg, const char *name,
                                                         const char *dir), void *arg);
/* Takes the finished loads, oldest first (NULL: none), and empties the descriptor. */
tsr_tokjob_t *tsr_tokload_take(tsr_tokload_t *self);
/* Frees a list tsr_tokload_take returned (the tokenizers still in it included). */
void tsr_tokjob_free(tsr_tokjob_t *jobs);
/* Loads queued or in progress. */
size_t tsr_tokload_pending(tsr_tokload_t *self);

#endif
