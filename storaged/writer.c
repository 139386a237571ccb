/* writer.c - group commit on one connection.
 *
 * Two threads. The writer takes every job queued while the previous transaction committed and
 * runs them as one batch (one transaction, a savepoint each, one COMMIT: with synchronous=FULL,
 * one WAL fsync for all of them). When more jobs are waiting, it hands the finished batch to the
 * completer, which calls each job's done (the RPC replies), and starts the next batch at once:
 * answering one batch overlaps with committing the next, so the replies are off the commit
 * path. When nothing waits and the completer is idle, the writer answers the batch itself: no
 * thread hand-off (a wake-up costs more than the replies) on a lightly loaded server. A job is
 * never answered before its COMMIT returned; batches are answered in commit order.
 */
#include "writer.h"

#include "clock.h"
#include "db.h"
#include "downtime.h"
#include "failpoint.h"
#include "log.h"
#include "mem.h"
#include "stmt.h"
#include "store_clock.h"
#include "thread.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

struct writer {
    sqlite3 *db;
    const struct ledger_config *cfg;
    int max_batch;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct writer_job *head, *tail;
    bool stopping;
    bool release_asked; /* under mu: drop the page cache when nothing is queued */
    pthread_t completer;
    pthread_mutex_t done_mu;
    pthread_cond_t done_cv;
    struct writer_job *done_head, *done_tail; /* committed or failed, not answered yet */
    bool writer_done;                         /* the writer thread ended: no more batches */
    bool completer_busy;                      /* the completer is answering a batch */
    bool synced;                              /* the connection is at synchronous=FULL */
    uint64_t batches, jobs;                   /* logged at stop */
    /* An outage no lease is counted against, not taken in yet (outage_of): time in which
     * no heartbeat could be stored. Its parts: stalls, where the writer found it had not run
     * for STALL_MIN_MS or more (the process frozen, its host paused, or one batch that long),
     * and writes refused for want of room or by the disk, from the first batch that failed so
     * (refused_since_mono, monotonic ms; 0: none) until a batch that wrote something commits
     * (outage_committed).
     * outage_since_mono: when its first part began (0: none); outage_ended_ms: the length of
     * its parts that ended; the two flags name them in the log. Only the writer thread
     * touches these. */
    int64_t refused_since_mono;
    int64_t outage_since_mono, outage_ended_ms;
    bool outage_stalled, outage_refused;
    /* a stall was found while nothing was queued: the idle writer takes it in at once */
    bool stall_found;
    /* a stall was taken in with nothing queued after the stop began (under mu) */
    bool stall_taken_stopping;
    /* the writer's last stamp awake (monotonic ms): it wakes at least every WRITER_TICK_MS */
    int64_t awake_mono;
    /* when writer_note_stop was called, by the monotonic clock (0: not noted) and by
     * CLOCK_BOOTTIME (ms). Main thread only. */
    int64_t stop_mono_ms, stop_boot_ms;
};

/* The writer wakes at least this often (ms), so a gap in its stamps tells a stall. */
#define WRITER_TICK_MS 1000
/* A gap in the writer's stamps this long (ms) is a stall. */
#define STALL_MIN_MS 3000

/* A write outage at least this long (ms) extends the leases that ran meanwhile. */
#define OUTAGE_MIN_MS 1000

/* The transaction statements, compiled once on the writer's connection (stmt.c). */
static const char begin_sql[] = "BEGIN IMMEDIATE", commit_sql[] = "COMMIT",
                  rollback_sql[] = "ROLLBACK", savepoint_sql[] = "SAVEPOINT job",
                  rollback_to_sql[] = "ROLLBACK TO job", release_sql[] = "RELEASE job",
                  full_sql[] = "PRAGMA synchronous=FULL",
                  normal_sql[] = "PRAGMA synchronous=NORMAL";

/* run runs one of them; on failure err says which, with SQLite's message. */
static enum cf_status run(struct writer *w, const char *sql, struct cf_error *err)
{
    return stmt_run(w->db, sql, err);
}

/* fail_rest gives every job of the batch that succeeded or never ran the batch's error: when
 * the transaction cannot be trusted, nothing in it is committed and nobody is told otherwise.
 * Jobs that failed on their own (refused) keep their own reason. */
static void fail_rest(struct writer_job *jobs, enum cf_status st, const char *what, const char *why)
{
    for (struct writer_job *j = jobs; j; j = j->next) {
        if (!j->refused) {
            j->st = cf_error_set(&j->err, st, "%s%s", what, why);
        }
    }
}

/* end_transaction rolls back an open transaction (after a failed statement, COMMIT or
 * savepoint). SQLite may have rolled back already (then the connection is in autocommit mode
 * and there is nothing to do). If ROLLBACK itself fails, the connection stays inside the
 * transaction: the next batch finds it so and tries again before doing anything, and fails
 * its jobs until that works, so no later job can commit on top of half a batch. */
static bool end_transaction(struct writer *w)
{
    struct cf_error err;
    if (sqlite3_get_autocommit(w->db)) {
        return true;
    }
    if (run(w, rollback_sql, &err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_error("rollback_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
        return false;
    }
    return true;
}

/* set_sync puts the connection at synchronous=FULL (durable) or NORMAL. A batch that needs
 * FULL and cannot get it is not run: its jobs would be answered with less durability than
 * promised. Failing to leave FULL only costs speed. */
static enum cf_status set_sync(struct writer *w, bool durable, struct cf_error *err)
{
    if (durable == w->synced) {
        return CF_OK;
    }
    enum cf_status st = run(w, durable ? full_sql : normal_sql, err);
    if (st == CF_OK) {
        w->synced = durable;
        return CF_OK;
    }
    if (!durable) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_warn("sync_normal_failed", "err=%s", log_quote(q, sizeof(q), err->msg));
        return CF_OK; /* stays FULL */
    }
    return st;
}

/* move_times runs move (shift_times, ledger_extend_leases) with a and b in a savepoint of the
 * open transaction. Returns CF_OK with *moved set (how many submissions; -1 when the move
 * failed on its own: it is rolled back alone, logged as `what`, and the next batch tries
 * again), or the status with err set when the transaction cannot go on. */
static enum cf_status
move_times(struct writer *w, struct ledger_ctx *c,
           enum cf_status (*move)(struct ledger_ctx *, int64_t, int64_t, int *, struct cf_error *),
           int64_t a, int64_t b, const char *what, int *moved, struct cf_error *err)
{
    struct cf_error why;
    *moved = -1;
    enum cf_status st = run(w, savepoint_sql, err);
    if (st != CF_OK) {
        return st;
    }
    if ((st = move(c, a, b, moved, &why)) != CF_OK) {
        if (sqlite3_get_autocommit(w->db)) {
            *err = why; /* SQLite rolled the transaction back */
            return st;
        }
        char q[CF_ERROR_MSG_MAX + 16];
        log_warn(what, "err=%s", log_quote(q, sizeof(q), why.msg));
        if ((st = run(w, rollback_to_sql, err)) != CF_OK) {
            return st;
        }
    }
    return run(w, release_sql, err);
}

/* shift_times is ledger_shift_times in move_times' form (the second number unused). */
static enum cf_status shift_times(struct ledger_ctx *c, int64_t step_ms, int64_t unused, int *moved,
                                  struct cf_error *err)
{
    (void)unused;
    return ledger_shift_times(c, step_ms, moved, err);
}

/* take_clock_step sets c->now for the batch whose transaction was just begun: the store clock
 * (store_clock.h), or the wall clock once a step of it was taken in. A small step is adopted
 * at once; a larger one moves the unsettled work's times by the step (ledger_shift_times) and
 * sets *moved (the writer adopts it after the COMMIT). A step that cannot be taken in now is
 * tried again with the next batch, this one running on the store clock, which the stored
 * times still follow. Returns CF_OK, or the status with err set when the transaction cannot
 * go on. */
static enum cf_status take_clock_step(struct writer *w, struct ledger_ctx *c,
                                      const struct store_clock_reading *r, int *moved,
                                      struct cf_error *err)
{
    *moved = -1;
    if (r->step_ms > -STORE_CLOCK_STEP_MS && r->step_ms < STORE_CLOCK_STEP_MS) {
        store_clock_adopt(r);
        c->now = r->wall_ms;
        return CF_OK;
    }
    enum cf_status st =
        move_times(w, c, shift_times, r->step_ms, 0, "clock_step_deferred", moved, err);
    if (st == CF_OK && *moved >= 0) {
        c->now = r->wall_ms;
    }
    return st;
}

/* note_awake stamps the writer awake now; a gap of STALL_MIN_MS or more since the last stamp
 * is a stall, added to the outage not taken in yet (while writes are refused, their part
 * counts that time already). */
static void note_awake(struct writer *w)
{
    int64_t now = clock_mono_ms(), gap = now - w->awake_mono;
    if (gap >= STALL_MIN_MS && !w->refused_since_mono) {
        if (!w->outage_since_mono) {
            w->outage_since_mono = w->awake_mono;
        }
        w->outage_ended_ms += gap;
        w->outage_stalled = true;
        w->stall_found = true;
    }
    w->awake_mono = now;
}

/* note_refused starts the refused part of the outage (a batch failed for want of room or by
 * the disk), unless one runs: from the failed batch's start (the writer's last awake stamp),
 * since no lease could be renewed while it ran, however long the disk took to fail it. */
static void note_refused(struct writer *w)
{
    if (!w->refused_since_mono) {
        w->refused_since_mono = w->awake_mono;
        if (!w->outage_since_mono) {
            w->outage_since_mono = w->refused_since_mono;
        }
        w->outage_refused = true;
    }
}

/* outage_of tells the outage no lease counts against, as of mono_now: when it began (*since,
 * monotonic ms; 0: none) and how long it lasted (returned): its stalls' own lengths (time
 * between them counted as usual, however long the next write took to come) and writes
 * refused until mono_now. */
static int64_t outage_of(const struct writer *w, int64_t mono_now, int64_t *since)
{
    *since = w->outage_since_mono;
    return w->outage_ended_ms + (w->refused_since_mono ? mono_now - w->refused_since_mono : 0);
}

/* outage_cause names the outage's parts for the log. */
static const char *outage_cause(const struct writer *w)
{
    if (w->outage_stalled && w->outage_refused) {
        return "writer_stalled,writes_refused";
    }
    return w->outage_stalled ? "writer_stalled" : "writes_refused";
}

/* outage_committed notes a COMMIT at mono_now: the outage is over when the batch took it in;
 * else, if the batch wrote something, writes are no longer refused and the outage waits for
 * the next batch, its refused part ended now. A COMMIT that wrote nothing (a Claim that found
 * nothing) tells nothing of the room: writes may still be refused, and their part goes on. */
static void outage_committed(struct writer *w, bool taken_in, bool wrote, int64_t mono_now)
{
    if (taken_in) {
        w->outage_since_mono = w->outage_ended_ms = w->refused_since_mono = 0;
        w->outage_stalled = w->outage_refused = false;
        return;
    }
    if (wrote && w->refused_since_mono) {
        w->outage_ended_ms += mono_now - w->refused_since_mono;
        w->refused_since_mono = 0;
    }
}

/* failed_for_room tells whether a batch that did not commit failed for want of room or by the
 * disk (a job's status). */
static bool failed_for_room(const struct writer_job *jobs)
{
    for (const struct writer_job *j = jobs; j; j = j->next) {
        if (j->st == CF_FULL || j->st == CF_IO) {
            return true;
        }
    }
    return false;
}

/* run_batch runs jobs as one transaction; returns whether it committed. With no jobs, it
 * takes in what is pending alone (an outage, a clock step) and commits if there was any. */
static bool run_batch(struct writer *w, struct writer_job *jobs)
{
    struct cf_error err;
    enum cf_status st;
    struct store_clock_reading clock;
    store_clock_read(&clock);
    struct ledger_ctx ctx = {.db = w->db, .cfg = w->cfg, .now = clock.wall_ms - clock.step_ms};
    bool any_ok = false, durable = false;
    int moved = -1;    /* submissions whose times a clock step moved in this batch; -1: none */
    int extended = -1; /* submissions whose leases an outage extended in this batch */
    int64_t outage_since, outage_ms = outage_of(w, clock.mono_ms, &outage_since);

    for (struct writer_job *j = jobs; j; j = j->next) {
        durable = durable || j->durable;
        /* not run yet: fail_rest answers it if the batch stops before this job */
        j->st = cf_error_set(&j->err, CF_UNAVAILABLE, "not run");
        j->refused = false;
    }
    if (!end_transaction(w)) {
        fail_rest(jobs, CF_DB,
                  "the database connection is stuck in a transaction that cannot be rolled "
                  "back (see the log); nothing was written",
                  "");
        return false;
    }
    if ((st = set_sync(w, durable, &err)) != CF_OK) {
        fail_rest(jobs, st, "cannot set synchronous=FULL: ", err.msg);
        return false;
    }
    if ((st = run(w, begin_sql, &err)) != CF_OK) {
        fail_rest(jobs, st, "cannot begin transaction: ", err.msg);
        return false;
    }
    sqlite3_int64 changes_before = sqlite3_total_changes64(w->db);
    if ((st = take_clock_step(w, &ctx, &clock, &moved, &err)) != CF_OK) {
        goto broken;
    }
    if (outage_ms >= OUTAGE_MIN_MS &&
        (st = move_times(w, &ctx, ledger_extend_leases, ctx.now - (clock.mono_ms - outage_since),
                         outage_ms, "lease_extension_deferred", &extended, &err)) != CF_OK) {
        goto broken;
    }
    for (struct writer_job *j = jobs; j; j = j->next) {
        ctx.arena = j->arena;
        if ((st = run(w, savepoint_sql, &err)) != CF_OK) {
            goto broken;
        }
        cf_error_clear(&j->err);
        j->st = j->run(&ctx, j->arg, &j->err);
        j->refused = j->st != CF_OK;
        if (j->st != CF_OK && sqlite3_get_autocommit(w->db)) {
            /* The job's statement failed in a way after which SQLite rolls the whole
             * transaction back, its savepoints with it (a full disk, an I/O error, no memory,
             * an interrupt): the batch is gone, and its other jobs get the job's cause. */
            st = j->st;
            err = j->err;
            goto broken;
        }
        if (j->st != CF_OK && (st = run(w, rollback_to_sql, &err)) != CF_OK) {
            goto broken;
        }
        if ((st = run(w, release_sql, &err)) != CF_OK) {
            goto broken;
        }
        any_ok = any_ok || j->st == CF_OK;
    }
    if (!any_ok && (jobs || (extended < 0 && moved < 0))) {
        end_transaction(w);
        return false;
    }
    failpoint_hit("storaged.commit.before");
    if ((st = run(w, commit_sql, &err)) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_error("commit_failed", "code=%s err=%s", status_name(st),
                  log_quote(q, sizeof(q), err.msg));
        end_transaction(w);
        fail_rest(jobs, st, "commit failed: ", err.msg);
        return false;
    }
    failpoint_hit("storaged.commit.after");
    if (moved >= 0) {
        store_clock_adopt(&clock);
        log_warn("clock_stepped", "step_ms=%lld submissions_moved=%d", (long long)clock.step_ms,
                 moved);
    }
    if (extended >= 0) {
        log_warn("leases_extended", "outage_ms=%lld submissions=%d cause=%s", (long long)outage_ms,
                 extended, outage_cause(w));
    }
    bool wrote = sqlite3_total_changes64(w->db) != changes_before;
    outage_committed(w, extended >= 0 || (outage_ms < OUTAGE_MIN_MS && wrote), wrote,
                     clock_mono_ms());
    return true;

broken : {
    /* A savepoint statement failed, or SQLite rolled the transaction back itself: which work
     * is inside the transaction is unknown, so all of it is rolled back and every job not
     * refused on its own fails. */
    char q[CF_ERROR_MSG_MAX + 16];
    log_error("batch_rolled_back", "code=%s err=%s", status_name(st),
              log_quote(q, sizeof(q), err.msg));
    end_transaction(w);
    fail_rest(jobs, st, "the batch was rolled back: ", err.msg);
    return false;
}
}

/* hand_over queues a finished batch for the completer; the writer no longer touches it. */
static void hand_over(struct writer *w, struct writer_job *batch)
{
    struct writer_job *last = batch;
    while (last->next) {
        last = last->next;
    }
    pthread_mutex_lock(&w->done_mu);
    if (w->done_tail) {
        w->done_tail->next = batch;
    } else {
        w->done_head = batch;
    }
    w->done_tail = last;
    pthread_cond_signal(&w->done_cv);
    pthread_mutex_unlock(&w->done_mu);
}

/* answer calls each job's done (the RPC replies), in order. */
static void answer(struct writer_job *jobs)
{
    for (struct writer_job *j = jobs, *next; j; j = next) {
        next = j->next; /* done may free the job */
        j->done(j->arg, j->st, &j->err);
    }
}

/* finish answers a committed batch: on the writer thread when no job waits and the completer
 * has nothing to answer (so commit order holds), else through the completer. */
static void finish(struct writer *w, struct writer_job *batch)
{
    pthread_mutex_lock(&w->mu);
    bool waiting = w->head != NULL;
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_lock(&w->done_mu);
    bool idle = !w->done_head && !w->completer_busy;
    pthread_mutex_unlock(&w->done_mu);
    if (!waiting && idle) {
        answer(batch);
    } else {
        hand_over(w, batch);
    }
}

static void *completer_main(void *arg)
{
    struct writer *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->done_mu);
        while (!w->done_head && !w->writer_done) {
            pthread_cond_wait(&w->done_cv, &w->done_mu);
        }
        struct writer_job *jobs = w->done_head;
        w->done_head = w->done_tail = NULL;
        bool last = w->writer_done;
        w->completer_busy = jobs != NULL;
        pthread_mutex_unlock(&w->done_mu);
        answer(jobs);
        pthread_mutex_lock(&w->done_mu);
        w->completer_busy = false;
        pthread_mutex_unlock(&w->done_mu);
        if (!jobs && last) {
            return NULL;
        }
    }
}

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        note_awake(w);
        while (!w->head && !w->stopping && !w->stall_found) {
            if (w->release_asked) {
                w->release_asked = false;
                pthread_mutex_unlock(&w->mu);
                sqlite3_db_release_memory(w->db);
                pthread_mutex_lock(&w->mu);
                continue;
            }
            struct timespec tick;
            clock_deadline(&tick, WRITER_TICK_MS);
            clock_cond_wait(&w->cv, &w->mu, &tick);
            note_awake(w);
        }
        bool stall_found = w->stall_found;
        w->stall_found = false;
        if (!w->head && stall_found && !w->stall_taken_stopping) {
            /* nothing queued (or stopping): the stall is taken in now, not with a next write
             * that may be long in coming; if that fails, the next batch tries again. Once
             * only after the stop began: on a disk so slow that the batch taking a stall in
             * is itself one, the writer would never stop (a stall from the stop on is time
             * down, counted at the next start from the stop: writer_note_stop) */
            w->stall_taken_stopping = w->stopping;
            pthread_mutex_unlock(&w->mu);
            run_batch(w, NULL);
            continue;
        }
        if (!w->head) {
            pthread_mutex_unlock(&w->mu);
            pthread_mutex_lock(&w->done_mu);
            w->writer_done = true;
            pthread_cond_signal(&w->done_cv);
            pthread_mutex_unlock(&w->done_mu);
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

        w->batches++;
        w->jobs += (uint64_t)n;
        if (!run_batch(w, batch) && failed_for_room(batch)) {
            note_refused(w);
        }
        finish(w, batch);
    }
}

void writer_release_memory(struct writer *w)
{
    pthread_mutex_lock(&w->mu);
    w->release_asked = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

enum cf_status writer_start(struct writer **out, sqlite3 *db, const struct ledger_config *cfg,
                            int max_batch, struct cf_error *err)
{
    struct writer *w = mem_alloc(sizeof(*w));
    enum cf_status st;
    w->db = db;
    w->cfg = cfg;
    w->max_batch = max_batch > 0 ? max_batch : 256;
    w->synced = true; /* db_open sets FULL */
    w->awake_mono = clock_mono_ms();
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_init(&w->done_mu, NULL);
    pthread_cond_init(&w->done_cv, NULL);
    if ((st = thread_start(&w->completer, "sql-completer", 0, completer_main, w, err)) != CF_OK) {
        goto fail;
    }
    if ((st = thread_start(&w->thread, "sql-writer", 0, writer_main, w, err)) != CF_OK) {
        pthread_mutex_lock(&w->done_mu);
        w->writer_done = true;
        pthread_cond_signal(&w->done_cv);
        pthread_mutex_unlock(&w->done_mu);
        pthread_join(w->completer, NULL);
        goto fail;
    }
    *out = w;
    return CF_OK;
fail:
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->done_mu);
    pthread_cond_destroy(&w->done_cv);
    free(w);
    *out = NULL;
    return st;
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

void writer_note_stop(struct writer *w)
{
    w->stop_mono_ms = clock_mono_ms();
    w->stop_boot_ms = downtime_boot_ms();
}

void writer_stop(struct writer *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_join(w->completer, NULL); /* every queued job answered */
    log_info("writer_stats", "batches=%llu jobs=%llu jobs_per_batch=%.2f",
             (unsigned long long)w->batches, (unsigned long long)w->jobs,
             w->batches ? (double)w->jobs / (double)w->batches : 0.0);
    struct cf_error err;
    int64_t at = store_clock_now(), boot = downtime_boot_ms();
    if (w->stop_mono_ms > 0) {
        /* the noted moment on the store clock as it is now (it runs with the monotonic
         * clock): a step of the wall clock that the writer took in during the drain (its
         * times moved) is not taken in again at the next start, as it would be from the
         * clock's reading before the step. A suspend meanwhile is time down (the boot clock
         * counts it) and, once a batch took it in, a step the next start undoes. */
        at -= clock_mono_ms() - w->stop_mono_ms;
        boot = w->stop_boot_ms;
    }
    if (db_clean_stop(w->db, at, boot, &err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_warn("clean_stop_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
    }
    sqlite3_close(w->db);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->done_mu);
    pthread_cond_destroy(&w->done_cv);
    free(w);
}
