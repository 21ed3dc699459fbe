/* deptok.c: which tokenizer each deployment has: shared with another deployment or
 * with the state before a reload, read now, or read off the loop (tokload.c) and
 * installed when it is done; then published for the HTTP threads (tokref.h). */
#include "deptok.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

/* What goes between dir and a file's name in a message. */
static const char *sep(const char *dir)
{
    return dir[0] && dir[strlen(dir) - 1] != '/' ? "/" : "";
}

/* Whether dir has no tokenizer.json (a model for token ids only, no fault); then the
 * reason goes into s's tok_error. */
static bool tok_absent(tsr_dep_state_t *s, const char *dir)
{
    char *file = tsr_path_join(dir, "tokenizer.json");
    bool present = file && access(file, F_OK) == 0;
    free(file);
    if (!present)
        snprintf(s->tok_error, sizeof s->tok_error, "%s%stokenizer.json does not exist", dir,
                 sep(dir));
    return !present;
}

/* Whether s's tokenizer fits its model.  One without tokens for the model's ids is let
 * go, as a file that cannot be used is (the deployment takes token ids only, and status
 * says why): the text of the ids it cannot decode would come back empty.  One that knows
 * ids the model does not is kept (prompts with them are refused), with a warning when
 * warn. */
static void tok_vocab_check(tsr_dep_state_t *s, bool warn)
{
    if (!s->tok || !s->model_ok) return;
    char why[300];
    if (tsr_tok_covers(s->tok->tok, s->model.vocab_size, why, sizeof why) < 0) {
        snprintf(s->tok_error, sizeof s->tok_error, "%s%stokenizer.json %s", s->tok_dir,
                 sep(s->tok_dir), why);
        s->tok_broken = true;
        tsr_tokref_drop(&s->tok);
        tsr_warn("deployment %s takes token ids only: %s", s->name, s->tok_error);
        return;
    }
    int n = tsr_tok_vocab_size(s->tok->tok);
    if (warn && n > s->model.vocab_size)
        tsr_warn("deployment %s: the tokenizer has %d ids, the model's vocabulary %d; prompts "
                 "with the others are refused", s->name, n, s->model.vocab_size);
}

/* Gives s the tokenizer t read from dir (taking it); a tokenizer that could not be
 * read (t NULL, the reason in err) is logged, unless the file is simply not there (any
 * more). */
static void dep_tok_install(tsr_dep_state_t *s, const char *dir, tsr_tokenizer_t *t,
                            const char *err, const tsr_file_id_t *file)
{
    s->tok_loading = false;
    if (!t) {
        if (tok_absent(s, dir)) return;
        snprintf(s->tok_error, sizeof s->tok_error, "%s", err);
        s->tok_broken = true;
        tsr_warn("deployment %s takes token ids only: %s", s->name, err);
        return;
    }
    if (!s->tok_dir || strcmp(s->tok_dir, dir)) {
        free(s->tok_dir);
        s->tok_dir = strdup(dir);
    }
    s->tok = calloc(1, sizeof *s->tok);
    if (!s->tok || !s->tok_dir) {
        tsr_tok_destroy(&t);
        free(s->tok);
        s->tok = NULL;
        snprintf(s->tok_error, sizeof s->tok_error, "out of memory");
        return;
    }
    s->tok_error[0] = '\0';
    s->tok->tok = t;
    s->tok->file = *file;
    atomic_init(&s->tok->refs, 1);
    tok_vocab_check(s, true);
}

/* Why a deployment whose tokenizer is being read refuses text for now (clients see it). */
#define TOK_LOADING_MSG "its tokenizer.json is being read; try again in a moment"

static volatile sig_atomic_t *stop_flag;

void tsr_coord_stop_flag(volatile sig_atomic_t *flag) { stop_flag = flag; }

/* Reads dir's tokenizer.json into s now. */
static void dep_tok_read(tsr_dep_state_t *s, const char *dir)
{
    char err[600];
    tsr_file_id_t id;
    tsr_tokenizer_t *t = tsr_tok_read_dir(dir, &id, err, sizeof err);
    dep_tok_install(s, dir, t, err, &id);
}

/* s takes what another state has of the same directory's tokenizer: a hold on it, or
 * the read in progress, or the reason there is none. */
static void dep_tok_take(tsr_dep_state_t *s, const tsr_dep_state_t *from)
{
    s->tok = tsr_tokref_hold(from->tok);
    s->tok_loading = from->tok_loading;
    s->tok_broken = from->tok_broken;
    snprintf(s->tok_error, sizeof s->tok_error, "%s", from->tok_error);
}

/* Whether an earlier state's tokenizer serves s (from dir): one read or being read from
 * the same directory by a deployment of this configuration (prev, n_prev; a directory is
 * read once however many deployments use it), or by the same deployment before the
 * reload (old, n_old) when its tokenizer.json has not changed since. */
static bool dep_tok_share(tsr_dep_state_t *s, const char *dir, const tsr_dep_state_t *prev,
                          size_t n_prev, const tsr_dep_state_t *old, size_t n_old)
{
    const tsr_dep_state_t *from = NULL;
    for (size_t k = 0; k < n_prev && !from; k++)
        if ((prev[k].tok || prev[k].tok_loading) && prev[k].tok_dir &&
            !strcmp(prev[k].tok_dir, dir))
            from = &prev[k];
    bool fresh = from != NULL;   /* this configuration's: its vocabulary not yet checked */
    tsr_file_id_t now = {0};
    for (size_t j = 0; j < n_old && !from; j++) {
        if (!old[j].tok_dir || strcmp(old[j].tok_dir, dir) || strcmp(old[j].name, s->name))
            continue;
        if (old[j].tok_loading) {
            from = &old[j];
        } else if (old[j].tok) {
            char *file = tsr_path_join(dir, "tokenizer.json");
            if (file) tsr_file_id(file, &now);
            free(file);
            if (tsr_file_id_same(&old[j].tok->file, &now)) from = &old[j];
        }
    }
    if (!from || !(s->tok_dir = strdup(dir))) return false;   /* out of memory: read it */
    dep_tok_take(s, from);
    /* the model may have changed under a kept tokenizer */
    tok_vocab_check(s, fresh);
    return true;
}

/* The deployment's tokenizer: an earlier state's (dep_tok_share), else read now, or
 * (later: true, a reload) marked to be read off the loop.  None is not an error (requests
 * then take token ids only); a file that is there but cannot be used is logged. */
void tsr_deptok_choose(tsr_dep_state_t *s, const char *dir, const tsr_dep_state_t *prev,
                          size_t n_prev, const tsr_dep_state_t *old, size_t n_old, bool later)
{
    if (dep_tok_share(s, dir, prev, n_prev, old, n_old) || tok_absent(s, dir)) return;
    if (later && (s->tok_dir = strdup(dir))) {
        s->tok_loading = true;
        snprintf(s->tok_error, sizeof s->tok_error, TOK_LOADING_MSG);
        return;
    }
    if (stop_flag && *stop_flag) {   /* stopping as it starts: not worth the wait */
        snprintf(s->tok_error, sizeof s->tok_error, "not read: the coordinator is stopping");
        return;
    }
    dep_tok_read(s, dir);
}

/* Publishes the current deployments' tokenizers (after a load or a reload). */
void tsr_deptok_publish(tsr_coord_t *c)
{
    tsr_tokreg_entry_t *v = calloc(c->cfg->n_deployments ? c->cfg->n_deployments : 1, sizeof *v);
    pthread_mutex_lock(&c->tokreg.mu);
    tsr_tokreg_clear(&c->tokreg);
    for (size_t i = 0; v && i < c->cfg->n_deployments; i++) {
        const tsr_deployment_t *d = &c->cfg->deployments[i];
        snprintf(v[i].name, sizeof v[i].name, "%s", d->name);
        v[i].tok = tsr_tokref_hold(c->deps[i].tok);
        snprintf(v[i].chat_template, sizeof v[i].chat_template, "%s", d->chat_template);
        v[i].max_seq_len = d->max_seq_len;
        /* for HTTP clients: the reason without the server's directories */
        const char *why = c->deps[i].tok_error, *dir = d->model_path ? d->model_path : "";
        size_t dl = strlen(dir);
        if (dl && !strncmp(why, dir, dl)) why += dl + (why[dl] == '/');
        snprintf(v[i].tok_error, sizeof v[i].tok_error, "%s", why);
        v[i].tok_loading = c->deps[i].tok_loading;
    }
    c->tokreg.v = v;
    c->tokreg.n = v ? c->cfg->n_deployments : 0;
    pthread_mutex_unlock(&c->tokreg.mu);
}

/* A deployment waiting for dir's tokenizer.json, or -1. */
static int tok_waiter(const tsr_coord_t *c, const char *dir)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++)
        if (c->deps[i].tok_loading && !strcmp(c->deps[i].tok_dir, dir)) return (int)i;
    return -1;
}

static bool tok_wanted(void *arg, const char *name, const char *dir)
{
    (void)name;
    return tok_waiter(arg, dir) >= 0;
}

/* Asks the loader for the tokenizers the deployments wait for (one read a directory),
 * and drops the queued loads no deployment waits for any more.  One that cannot be
 * queued is read here. */
void tsr_deptok_request(tsr_coord_t *c)
{
    for (size_t i = 0; i < c->cfg->n_deployments; i++) {
        tsr_dep_state_t *s = &c->deps[i];
        if (!s->tok_loading) continue;
        char err[600];
        int rc = tsr_tokload_request(c->tokload, s->name, s->tok_dir, err, sizeof err);
        if (rc == 0)
            tsr_info("deployment %s: reading %s/tokenizer.json off the loop", s->name,
                     s->tok_dir);
        if (rc >= 0) continue;
        tsr_warn("deployment %s: %s; reading its tokenizer.json on the loop", s->name, err);
        dep_tok_read(s, s->tok_dir);
    }
    tsr_tokload_prune(c->tokload, tok_wanted, c);
}

/* Gives the deployments that wait for them the tokenizers the loader has read: the
 * first waiting for a directory takes it, the others hold it too. */
void tsr_deptok_collect(tsr_coord_t *c)
{
    tsr_tokjob_t *done = tsr_tokload_take(c->tokload);
    bool changed = false;
    for (tsr_tokjob_t *j = done; j; j = j->next) {
        int first = j->skipped ? -1 : tok_waiter(c, j->dir);
        if (first < 0) continue;
        tsr_dep_state_t *s = &c->deps[first];
        int ids = j->tok ? tsr_tok_vocab_size(j->tok) : 0;
        dep_tok_install(s, j->dir, j->tok, j->err, &j->file);
        if (s->tok) tsr_info("%s/tokenizer.json read (%d ids): deployment %s serves text "
                             "prompts", j->dir, ids, s->name);
        j->tok = NULL;
        for (int k; (k = tok_waiter(c, j->dir)) >= 0;) {
            tsr_dep_state_t *o = &c->deps[k];
            dep_tok_take(o, s);
            tok_vocab_check(o, true);
            if (o->tok) tsr_info("deployment %s serves text prompts too", o->name);
        }
        changed = true;
    }
    tsr_tokjob_free(done);
    if (changed) tsr_deptok_publish(c);
}
