/* tokload.c: the tokenizer loader's thread and its two lists. */
#include "tokload.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"

struct tsr_tokload {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tsr_tokjob_t *todo, *done;  /* oldest first */
    tsr_tokjob_t *running;      /* being read (owned by the thread meanwhile) */
    bool stop, started;
    pthread_t th;
    int pipe[2];                /* a byte in it: something waits in done */
};

tsr_tokenizer_t *tsr_tok_read_dir(const char *dir, tsr_file_id_t *file, char *err,
                                  size_t errlen)
{
    char *path = tsr_path_join(dir, "tokenizer.json");
    memset(file, 0, sizeof *file);
    if (path) tsr_file_id(path, file);
    free(path);
    return tsr_tok_load(dir, err, errlen);
}

static void job_free(tsr_tokjob_t *j)
{
    tsr_tok_destroy(&j->tok);
    free(j->name);
    free(j->dir);
    free(j);
}

static void append(tsr_tokjob_t **list, tsr_tokjob_t *j)
{
    while (*list) list = &(*list)->next;
    j->next = NULL;
    *list = j;
}

/* A test setting: TSR_TEST_TOKLOAD_HOLD_MS holds each read that long before it starts
 * (at most 60 s; a stop ends the hold), so that tests see a read in progress for as long
 * as they need whatever the machine's speed.  Returns false when stopped.  mu held. */
static bool hold(tsr_tokload_t *l)
{
#ifdef TSR_TESTING
    const char *v = getenv("TSR_TEST_TOKLOAD_HOLD_MS");
    long ms = v ? strtol(v, NULL, 10) : 0;
    if (ms <= 0) return !l->stop;
    if (ms > 60000) ms = 60000;
    struct timespec until = tsr_monotonic_after_ms(ms);
    while (!l->stop && pthread_cond_timedwait(&l->cv, &l->mu, &until) == 0) {}
#endif
    return !l->stop;
}

static void *loader(void *arg)
{
    tsr_tokload_t *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && !l->todo) pthread_cond_wait(&l->cv, &l->mu);
        if (l->stop) break;
        tsr_tokjob_t *j = l->todo;
        l->todo = j->next;
        l->running = j;
        if (!hold(l)) {
            l->running = NULL;
            job_free(j);
            break;
        }
        bool skip = j->skipped;
        pthread_mutex_unlock(&l->mu);
        if (!skip) j->tok = tsr_tok_read_dir(j->dir, &j->file, j->err, sizeof j->err);
        pthread_mutex_lock(&l->mu);
        l->running = NULL;
        append(&l->done, j);
        /* Full means the loop has bytes to read already: one is enough. */
        ssize_t w = write(l->pipe[1], "t", 1);
        (void)w;
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

tsr_tokload_t *tsr_tokload_new(void)
{
    tsr_tokload_t *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    pthread_mutex_init(&l->mu, NULL);
    tsr_cond_init_monotonic(&l->cv);
    if (pipe2(l->pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return NULL;
    }
    return l;
}

/* The thread and its descriptor, at the first load. */
static int start(tsr_tokload_t *l, char *err, size_t errlen)
{
    if (l->started) return 0;
    /* Signals stay with the loop's thread, which acts on them. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&l->th, NULL, loader, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        snprintf(err, errlen, "cannot start the tokenizer loader: %s", strerror(rc));
        return -1;
    }
    l->started = true;
    return 0;
}

void tsr_tokjob_free(tsr_tokjob_t *jobs)
{
    while (jobs) {
        tsr_tokjob_t *n = jobs->next;
        job_free(jobs);
        jobs = n;
    }
}

void tsr_tokload_destroy(tsr_tokload_t **self_p)
{
    if (!self_p || !*self_p) return;
    tsr_tokload_t *l = *self_p;
    if (l->started) {
        pthread_mutex_lock(&l->mu);
        l->stop = true;
        pthread_cond_signal(&l->cv);
        pthread_mutex_unlock(&l->mu);
        pthread_join(l->th, NULL);
    }
    close(l->pipe[0]);
    close(l->pipe[1]);
    tsr_tokjob_free(l->todo);
    tsr_tokjob_free(l->done);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
    *self_p = NULL;
}

int tsr_tokload_fd(const tsr_tokload_t *self)
{
    return self->pipe[0];
}

static bool same(const tsr_tokjob_t *j, const char *dir)
{
    return !j->skipped && !strcmp(j->dir, dir);
}

int tsr_tokload_request(tsr_tokload_t *l, const char *name, const char *dir, char *err,
                        size_t errlen)
{
    if (start(l, err, errlen) < 0) return -1;
    pthread_mutex_lock(&l->mu);
    /* One queued or being read for the same pair is read as late as this one would be:
     * what it finds is what the deployment gets. */
    bool have = l->running && same(l->running, dir);
    for (tsr_tokjob_t *j = l->todo; j && !have; j = j->next) have = same(j, dir);
    pthread_mutex_unlock(&l->mu);
    if (have) return 1;
    tsr_tokjob_t *j = calloc(1, sizeof *j);
    if (j) {
        j->name = strdup(name);
        j->dir = strdup(dir);
    }
    if (!j || !j->name || !j->dir) {
        tsr_tokjob_free(j);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_lock(&l->mu);
    append(&l->todo, j);
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return 0;
}

void tsr_tokload_prune(tsr_tokload_t *l, bool (*want)(void *, const char *, const char *),
                       void *arg)
{
    pthread_mutex_lock(&l->mu);
    for (tsr_tokjob_t *j = l->todo; j; j = j->next)
        if (!want(arg, j->name, j->dir)) j->skipped = true;
    pthread_mutex_unlock(&l->mu);
}

tsr_tokjob_t *tsr_tokload_take(tsr_tokload_t *l)
{
    pthread_mutex_lock(&l->mu);
    tsr_tokjob_t *d = l->done;
    l->done = NULL;
    /* The pipe holds bytes only while done does (both change under the lock), so a tick
     * with nothing done makes no system call.  Emptied under the lock: a load finishing
     * now writes after, and is seen next. */
    char buf[64];
    while (d && read(l->pipe[0], buf, sizeof buf) > 0) {}
    pthread_mutex_unlock(&l->mu);
    return d;
}

size_t tsr_tokload_pending(tsr_tokload_t *l)
{
    size_t n = 0;
    pthread_mutex_lock(&l->mu);
    for (tsr_tokjob_t *j = l->todo; j; j = j->next) n++;
    n += l->running != NULL;
    pthread_mutex_unlock(&l->mu);
    return n;
}
