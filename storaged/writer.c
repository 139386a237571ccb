/* writer.c - group commit on one connection; and the commit notifier. */
#include "writer.h"

#include "clock.h"
#include "db.h"
#include "failpoint.h"
#include "log.h"
#include "mem.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

struct notifier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t version;
};

struct writer {
    sqlite3 *db;
    const struct ledger_config *cfg;
    struct notifier *notifier;
    int max_batch;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct writer_job *head, *tail;
    bool stopping;
    bool synced; /* the connection is at synchronous=FULL */
};

static void run_batch(struct writer *w, struct writer_job *jobs)
{
    struct cf_error err;
    struct ledger_ctx ctx = {.db = w->db, .cfg = w->cfg, .now = clock_now_ms()};
    bool any_ok = false, durable = false;

    for (struct writer_job *j = jobs; j; j = j->next) {
        durable = durable || j->durable;
    }
    if (durable != w->synced) {
        db_exec(w->db, durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL", NULL);
        w->synced = durable;
    }
    if (db_exec(w->db, "BEGIN IMMEDIATE", &err) != CF_OK) {
        for (struct writer_job *j = jobs; j; j = j->next) {
            j->st = cf_error_set(&j->err, CF_DB, "cannot begin transaction: %s", err.msg);
        }
        return;
    }
    for (struct writer_job *j = jobs; j; j = j->next) {
        cf_error_clear(&j->err);
        ctx.arena = j->arena;
        db_exec(w->db, "SAVEPOINT job", NULL);
        j->st = j->run(&ctx, j->arg, &j->err);
        if (j->st != CF_OK) {
            db_exec(w->db, "ROLLBACK TO job", NULL);
        } else {
            any_ok = true;
        }
        db_exec(w->db, "RELEASE job", NULL);
    }
    if (!any_ok) {
        db_exec(w->db, "ROLLBACK", NULL);
        return;
    }
    failpoint_hit("storaged.commit.before");
    if (db_exec(w->db, "COMMIT", &err) != CF_OK) {
        log_error("commit_failed", "err=%s", status_name(err.code));
        db_exec(w->db, "ROLLBACK", NULL);
        for (struct writer_job *j = jobs; j; j = j->next) {
            if (j->st == CF_OK) {
                j->st = cf_error_set(&j->err, CF_DB, "commit failed: %s", err.msg);
            }
        }
        return;
    }
    failpoint_hit("storaged.commit.after");
    if (ctx.appended) {
        notifier_bump(w->notifier);
    }
}

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->head && !w->stopping) {
            pthread_cond_wait(&w->cv, &w->mu);
        }
        if (!w->head) {
            pthread_mutex_unlock(&w->mu);
            return NULL;
        }
        struct writer_job *batch = w->head, *last = w->head;
        int n = 1;
        while (last->next && n < w->max_batch) {
            last = last->next;
            n++;
        }
        w->head = last->next;
        if (!w->head) {
            w->tail = NULL;
        }
        last->next = NULL;
        pthread_mutex_unlock(&w->mu);

        run_batch(w, batch);
        for (struct writer_job *j = batch, *next; j; j = next) {
            next = j->next; /* done may free the job */
            j->done(j->arg, j->st, &j->err);
        }
    }
}

struct writer *writer_start(sqlite3 *db, const struct ledger_config *cfg, struct notifier *n,
                            int max_batch)
{
    struct writer *w = mem_alloc(sizeof(*w));
    w->db = db;
    w->cfg = cfg;
    w->notifier = n;
    w->max_batch = max_batch > 0 ? max_batch : 256;
    w->synced = true; /* db_open sets FULL */
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_create(&w->thread, NULL, writer_main, w);
    return w;
}

void writer_submit(struct writer *w, struct writer_job *job)
{
    job->next = NULL;
    pthread_mutex_lock(&w->mu);
    if (w->stopping) {
        pthread_mutex_unlock(&w->mu);
        job->st = cf_error_set(&job->err, CF_UNAVAILABLE, "storaged is shutting down");
        job->done(job->arg, job->st, &job->err);
        return;
    }
    if (w->tail) {
        w->tail->next = job;
    } else {
        w->head = job;
    }
    w->tail = job;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void writer_stop(struct writer *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    sqlite3_close(w->db);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

struct notifier *notifier_new(void)
{
    struct notifier *n = mem_alloc(sizeof(*n));
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    return n;
}

void notifier_free(struct notifier *n)
{
    if (n) {
        pthread_mutex_destroy(&n->mu);
        pthread_cond_destroy(&n->cv);
        free(n);
    }
}

void notifier_bump(struct notifier *n)
{
    pthread_mutex_lock(&n->mu);
    n->version++;
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
}

uint64_t notifier_version(struct notifier *n)
{
    pthread_mutex_lock(&n->mu);
    uint64_t v = n->version;
    pthread_mutex_unlock(&n->mu);
    return v;
}

uint64_t notifier_wait(struct notifier *n, uint64_t seen, int timeout_ms)
{
    struct timespec ts;
    clock_deadline(&ts, timeout_ms);
    pthread_mutex_lock(&n->mu);
    while (n->version == seen) {
        if (pthread_cond_timedwait(&n->cv, &n->mu, &ts) != 0) {
            break;
        }
    }
    uint64_t v = n->version;
    pthread_mutex_unlock(&n->mu);
    return v;
}
