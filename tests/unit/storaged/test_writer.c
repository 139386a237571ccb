/* Unit tests of storaged/writer.c on a real SQLite file: how a batch's jobs are answered when
 * one of them fails, and how writes refused for want of room extend the running leases. */
#include "../check.h"

#include "clock.h"
#include "db.h"
#include "store_clock.h"
#include "writer.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct ledger_config cfg = {.lease_ms = 30000, .timeout_ms = 3600000, .max_attempts = 10};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool gate_entered, gate_open;
static int n_done;

/* One job of a test: the row it inserts (0: none, the gate; REFUSE_ROW: none, it fails on
 * its own with CF_UNAVAILABLE) or the SQL it runs instead, once done, how it was answered. */
#define REFUSE_ROW (-2)
#define REFUSE_REASON "the job's own reason"

struct job {
    struct writer_job wj;
    int row;
    bool interrupt;    /* fail the way SQLite rolls the whole transaction back for */
    bool refuse_after; /* insert the row, then fail on its own */
    const char *sql;   /* set: run this instead (sql_job) */
    enum cf_status st;
    char msg[CF_ERROR_MSG_MAX];
};

static enum cf_status insert(sqlite3 *db, int row, struct cf_error *err)
{
    char sql[64];
    snprintf(sql, sizeof(sql), "INSERT INTO t(x) VALUES (%d)", row);
    return db_exec(db, sql, err);
}

/* run_gate holds the writer inside its first batch until the test has queued the next one. */
static enum cf_status run_gate(struct ledger_ctx *c, void *arg, struct cf_error *err)
{
    (void)c, (void)arg, (void)err;
    pthread_mutex_lock(&mu);
    gate_entered = true;
    pthread_cond_broadcast(&cv);
    while (!gate_open) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    return CF_OK;
}

static int stop_statement(void *arg)
{
    (void)arg;
    return 1;
}

/* run_job inserts the job's row. An interrupting job is stopped midway through a statement
 * that writes many rows (a progress handler: SQLITE_INTERRUPT), after which SQLite rolls the
 * whole explicit transaction back, savepoints included, as it may after SQLITE_FULL,
 * SQLITE_IOERR or SQLITE_NOMEM. */
static enum cf_status run_job(struct ledger_ctx *c, void *arg, struct cf_error *err)
{
    struct job *j = arg;
    if (j->sql) {
        return db_exec(c->db, j->sql, err);
    }
    if (j->row == REFUSE_ROW) {
        return cf_error_set(err, CF_UNAVAILABLE, REFUSE_REASON);
    }
    if (j->refuse_after) {
        enum cf_status st = insert(c->db, j->row, err);
        return st != CF_OK ? st : cf_error_set(err, CF_UNAVAILABLE, REFUSE_REASON);
    }
    if (!j->interrupt) {
        return insert(c->db, j->row, err);
    }
    sqlite3_progress_handler(c->db, 1000, stop_statement, NULL);
    enum cf_status st = db_exec(c->db,
                                "INSERT INTO t(x) WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL "
                                "SELECT i + 1 FROM n WHERE i < 100000) SELECT i FROM n",
                                err);
    sqlite3_progress_handler(c->db, 0, NULL, NULL);
    return st;
}

static void done(void *arg, enum cf_status st, const struct cf_error *err)
{
    struct job *j = arg;
    pthread_mutex_lock(&mu);
    j->st = st;
    snprintf(j->msg, sizeof(j->msg), "%s", st == CF_OK ? "" : err->msg);
    n_done++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void init_job(struct job *j, int row, bool interrupt)
{
    memset(j, 0, sizeof(*j));
    j->row = row;
    j->interrupt = interrupt;
    j->st = CF_UNAVAILABLE;
    j->wj.run = row ? run_job : run_gate;
    j->wj.done = done;
    j->wj.arg = j;
}

static int count_rows(const char *path)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *s = NULL;
    int n = -1;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT count(*) FROM t", -1, &s, NULL) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW) {
        n = sqlite3_column_int(s, 0);
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return n;
}

/* run_as_one_batch has w run jobs[0..n) in one batch (queued while a gate job holds the
 * writer in the batch before) and waits until all are answered. */
static void run_as_one_batch(struct writer *w, struct job **jobs, int n)
{
    static struct job gate;
    init_job(&gate, 0, false);
    pthread_mutex_lock(&mu);
    gate_entered = gate_open = false;
    n_done = 0;
    pthread_mutex_unlock(&mu);
    writer_submit(w, &gate.wj);
    pthread_mutex_lock(&mu);
    while (!gate_entered) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n; i++) {
        writer_submit(w, &jobs[i]->wj);
    }
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    while (n_done < n + 1) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    CHECK(gate.st == CF_OK);
}

/* A job that fails on its own is rolled back alone: the jobs before and after it in the batch
 * are committed. */
static void test_job_rolled_back_alone(const char *path, struct writer *w)
{
    struct job before, failing, after;
    init_job(&before, 1, false);
    init_job(&failing, -1, false); /* a CHECK constraint refuses it */
    init_job(&after, 2, false);
    struct job *batch[] = {&before, &failing, &after};
    run_as_one_batch(w, batch, 3);
    CHECK(failing.st != CF_OK && strstr(failing.msg, "CHECK constraint") != NULL);
    CHECK(before.st == CF_OK && after.st == CF_OK);
    CHECK(count_rows(path) == 2);
}

/* A job whose failure makes SQLite roll the whole transaction back takes its batch-mates with
 * it: those that ran before it and those after it are answered with its cause, not with the
 * savepoint the rollback removed ("no such savepoint"), and nothing of the batch is written;
 * a batch-mate that had failed on its own keeps its own answer, whatever its status. The
 * writer goes on with the next batch. */
static void test_transaction_rolled_back_by_sqlite(const char *path, struct writer *w)
{
    int rows = count_rows(path);
    struct job before, refused, failing, after, next;
    init_job(&before, 3, false);
    init_job(&refused, REFUSE_ROW, false);
    init_job(&failing, 4, true);
    init_job(&after, 5, false);
    init_job(&next, 6, false);
    struct job *batch[] = {&before, &refused, &failing, &after};
    run_as_one_batch(w, batch, 4);
    CHECK(refused.st == CF_UNAVAILABLE);
    CHECK_STR(refused.msg, REFUSE_REASON);
    CHECK(failing.st != CF_OK && failing.st != CF_UNAVAILABLE);
    CHECK(strstr(failing.msg, "interrupt") != NULL);
    struct job *mates[] = {&before, &after};
    for (size_t i = 0; i < sizeof(mates) / sizeof(mates[0]); i++) {
        struct job *j = mates[i];
        CHECK(j->st == failing.st);
        CHECK(strstr(j->msg, "interrupt") != NULL);
        CHECK(strstr(j->msg, "no such savepoint") == NULL);
        if (!strstr(j->msg, "interrupt")) {
            fprintf(stderr, "  batch-mate answered: %s\n", j->msg);
        }
    }
    CHECK(count_rows(path) == rows);

    struct job *later[] = {&next}; /* the writer is not stuck in the rolled-back transaction */
    run_as_one_batch(w, later, 1);
    CHECK(next.st == CF_OK);
    CHECK(count_rows(path) == rows + 1);
}

/* row_exists says whether some job's row x was committed. */
static bool row_exists(const char *path, int x)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *s = NULL;
    bool found = false;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT 1 FROM t WHERE x = ?", -1, &s, NULL) == SQLITE_OK &&
        sqlite3_bind_int(s, 1, x) == SQLITE_OK) {
        found = sqlite3_step(s) == SQLITE_ROW;
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return found;
}

/* A job that wrote and then failed on its own leaves nothing of its work behind, first in its
 * batch, in the middle of it or alone, and its batch-mates' work is committed. */
static void test_job_undone_after_writing(const char *path, struct writer *w)
{
    struct job before, partial, after, leading, behind, lone, next;
    init_job(&before, 7, false);
    init_job(&partial, 8, false);
    partial.refuse_after = true;
    init_job(&after, 9, false);
    struct job *batch[] = {&before, &partial, &after};
    run_as_one_batch(w, batch, 3);
    CHECK(partial.st == CF_UNAVAILABLE);
    CHECK_STR(partial.msg, REFUSE_REASON);
    CHECK(before.st == CF_OK && after.st == CF_OK);
    CHECK(row_exists(path, 7) && !row_exists(path, 8) && row_exists(path, 9));

    init_job(&leading, 12, false);
    leading.refuse_after = true;
    init_job(&behind, 13, false);
    struct job *led[] = {&leading, &behind};
    run_as_one_batch(w, led, 2);
    CHECK(leading.st == CF_UNAVAILABLE && behind.st == CF_OK);
    CHECK(!row_exists(path, 12) && row_exists(path, 13));

    init_job(&lone, 10, false);
    lone.refuse_after = true;
    struct job *alone[] = {&lone};
    run_as_one_batch(w, alone, 1);
    CHECK(lone.st == CF_UNAVAILABLE);
    CHECK(!row_exists(path, 10));

    init_job(&next, 11, false); /* the writer goes on as usual */
    struct job *later[] = {&next};
    run_as_one_batch(w, later, 1);
    CHECK(next.st == CF_OK);
    CHECK(row_exists(path, 11) && !row_exists(path, 10));
}

/* lease_of reads the lease end of submission id (store clock ms; -1: not found). */
static int64_t lease_of(const char *path, const char *id)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *s = NULL;
    int64_t lease = -1;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT lease_expires_at FROM submissions WHERE submission_id = ?",
                           -1, &s, NULL) == SQLITE_OK &&
        sqlite3_bind_text(s, 1, id, -1, SQLITE_STATIC) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW) {
        lease = sqlite3_column_int64(s, 0);
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return lease;
}

/* sql_job has w run sql as a batch of its own and checks how it was answered. */
static void sql_job(struct writer *w, const char *sql, enum cf_status want)
{
    struct job j;
    init_job(&j, 1, false);
    j.sql = sql;
    pthread_mutex_lock(&mu);
    n_done = 0;
    pthread_mutex_unlock(&mu);
    writer_submit(w, &j.wj);
    pthread_mutex_lock(&mu);
    while (n_done < 1) {
        pthread_cond_wait(&cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    CHECK(j.st == want);
    if (j.st != want) {
        fprintf(stderr, "  %s: status %d, want %d (%s)\n", sql, j.st, want, j.msg);
    }
}

/* The disk is full for 3 s (SQLITE_FULL: max_page_count held at the database's size), and
 * between the writes it refuses, batches commit that write nothing, as a Claim that finds
 * nothing does. Such a COMMIT tells nothing of the room: the refused time stays one outage,
 * and the lease that ran through it is extended by about its length once writes land again.
 * (Ended by every empty COMMIT, as before 8b73e27, the outage never reached a second and
 * nothing was extended.) */
static void test_empty_commits_do_not_end_refused_writes(const char *path, struct writer *w)
{
    int64_t before = lease_of(path, "sub_running");
    CHECK(before > 0);
    sql_job(w, "PRAGMA max_page_count = 1", CF_OK); /* never below the size: no new page */
    int64_t start = clock_mono_ms();
    while (clock_mono_ms() - start < 3000) {
        sql_job(w, "INSERT INTO big(b) VALUES (zeroblob(200000))", CF_FULL);
        usleep(300 * 1000);
        sql_job(w, "SELECT 1", CF_OK);
        usleep(300 * 1000);
    }
    sql_job(w, "PRAGMA max_page_count = 1073741823", CF_OK);
    sql_job(w, "INSERT INTO big(b) VALUES (zeroblob(200000))", CF_OK);
    int64_t refused_ms = clock_mono_ms() - start, extended = lease_of(path, "sub_running") - before;
    /* the refused writes' parts: not the gap between a part taken in (by an empty batch once
     * it reached a second: the extension fits in place) and the next refusal, 300 ms, nor a
     * last part under a second, ended by the write without extending anything */
    CHECK(extended >= refused_ms / 2);
    CHECK(extended <= refused_ms);
    if (extended < refused_ms / 2 || extended > refused_ms) {
        fprintf(stderr, "  refused for %lld ms, lease extended by %lld ms\n", (long long)refused_ms,
                (long long)extended);
    }
}

/* sleep_ms(n), an SQL function of the test's: a statement as slow as a hanging disk. */
static void sql_sleep_ms(sqlite3_context *ctx, int argc, sqlite3_value **argv)
{
    (void)argc;
    clock_sleep_ms(sqlite3_value_int64(argv[0]));
    sqlite3_result_null(ctx);
}

/* A batch that takes 2 s and then fails for want of room (a disk that hangs, then refuses):
 * no lease could be renewed while it ran, so the refused time counts from its start, and the
 * running lease is extended by about that much once writes land. (Counted from its failure,
 * as before, the refused part was the few ms until the next write, and nothing moved.) */
static void test_slow_refused_batch_counts_whole(const char *path, struct writer *w)
{
    int64_t before = lease_of(path, "sub_running");
    sql_job(w, "PRAGMA max_page_count = 1", CF_OK);
    int64_t start = clock_mono_ms();
    sql_job(w, "SELECT sleep_ms(2000); INSERT INTO big(b) VALUES (zeroblob(200000))", CF_FULL);
    int64_t slow_ms = clock_mono_ms() - start;
    sql_job(w, "PRAGMA max_page_count = 1073741823", CF_OK);
    sql_job(w, "INSERT INTO big(b) VALUES (zeroblob(200000))", CF_OK);
    int64_t extended = lease_of(path, "sub_running") - before;
    CHECK(slow_ms >= 1000); /* long enough to be an outage */
    CHECK(extended >= slow_ms / 2);
    if (extended < slow_ms / 2) {
        fprintf(stderr, "  the batch took %lld ms, the lease extended by %lld ms\n",
                (long long)slow_ms, (long long)extended);
    }
}

int main(void)
{
    char path[128], side[160];
    sqlite3 *db = NULL;
    struct writer *w = NULL;
    struct cf_error err;
    snprintf(path, sizeof(path), "/tmp/cflue-test-writer-%d.db", (int)getpid());
    CHECK(db_open(path, true, &db, &err) == CF_OK);
    CHECK(db_exec(db, "CREATE TABLE t(x INTEGER CHECK (x > 0))", &err) == CF_OK);
    CHECK(db_exec(db, "CREATE TABLE big(b BLOB)", &err) == CF_OK);
    /* one running submission whose lease runs for a minute */
    char running[512];
    snprintf(running, sizeof(running),
             "INSERT INTO conversations(conversation_id, agent, created_at) VALUES ('c', 'a', 0);"
             "INSERT INTO submissions(submission_id, conversation_id, agent, payload, status, "
             "attempt_id, lease_expires_at, accepted_at, admit_pos) VALUES ('sub_running', 'c', "
             "'a', x'', 'running', 'att_1', %lld, 0, 0)",
             (long long)(store_clock_now() + 60000));
    CHECK(db_exec(db, running, &err) == CF_OK);
    CHECK(sqlite3_create_function(db, "sleep_ms", 1, SQLITE_UTF8, NULL, sql_sleep_ms, NULL, NULL) ==
          SQLITE_OK);
    CHECK(writer_start(&w, db, &cfg, 16, &err) == CF_OK);
    test_job_rolled_back_alone(path, w);
    test_transaction_rolled_back_by_sqlite(path, w);
    test_job_undone_after_writing(path, w);
    test_empty_commits_do_not_end_refused_writes(path, w);
    test_slow_refused_batch_counts_whole(path, w);
    writer_stop(w);
    unlink(path);
    snprintf(side, sizeof(side), "%s-wal", path);
    unlink(side);
    snprintf(side, sizeof(side), "%s-shm", path);
    unlink(side);
    return check_done("test_writer");
}
