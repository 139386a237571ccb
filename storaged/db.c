/* db.c - SQLite connections for storaged.
 *
 * Durability: the database runs in WAL mode. Connections open with synchronous=FULL; the
 * writer (writer.c) keeps FULL for batches holding an admission, settlement, abort intent, join
 * finalization or input stamp, so those reach the disk (WAL fsync) before storaged answers, and
 * uses NORMAL for the rest (claims, leases, appends). A power loss can lose only NORMAL commits
 * made after the last synced one; db_boot fences the attempts that could write on top of such a
 * loss. Group commit shares the cost of each fsync between concurrent requests.
 */
#include "db.h"

#include "migrate.h"
#include "stmt.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

static const char schema_sql[] =
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE conversations("
    "  conversation_id TEXT PRIMARY KEY,"
    "  agent TEXT NOT NULL,"
    "  created_at INTEGER NOT NULL,"
    "  next_pos INTEGER NOT NULL DEFAULT 0,"
    "  epoch INTEGER NOT NULL DEFAULT 0,"
    "  " DB_PRINCIPAL_COLUMN ");"
    "CREATE TABLE submissions("
    "  sequence INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  submission_id TEXT NOT NULL UNIQUE,"
    "  conversation_id TEXT NOT NULL REFERENCES conversations(conversation_id),"
    "  agent TEXT NOT NULL,"
    "  idempotency_key TEXT,"
    "  payload BLOB NOT NULL,"
    "  status TEXT NOT NULL CHECK (status IN"
    "    ('queued','running','terminalizing','settled','joining','joined')),"
    "  outcome TEXT CHECK (outcome IN ('completed','failed','aborted')),"
    "  error TEXT,"
    "  attempt_id TEXT,"
    "  epoch INTEGER NOT NULL DEFAULT 0,"
    "  owner_id TEXT,"
    "  lease_expires_at INTEGER NOT NULL DEFAULT 0,"
    "  attempt_count INTEGER NOT NULL DEFAULT 0,"
    "  max_attempts INTEGER NOT NULL DEFAULT 10,"
    "  timeout_at INTEGER NOT NULL DEFAULT 0,"
    "  accepted_at INTEGER NOT NULL,"
    "  started_at INTEGER,"
    "  input_applied_at INTEGER,"
    "  abort_requested_at INTEGER,"
    "  abort_reason TEXT,"
    "  joined_into TEXT,"
    "  settled_at INTEGER,"
    "  answered_by TEXT,"
    "  reserved_outcome TEXT CHECK (reserved_outcome IN ('completed','failed','aborted')),"
    "  reserved_error TEXT,"
    "  admit_pos INTEGER NOT NULL,"
    "  input_tokens INTEGER NOT NULL DEFAULT 0,"
    "  output_tokens INTEGER NOT NULL DEFAULT 0,"
    "  cost_usd REAL NOT NULL DEFAULT 0,"
    "  kind INTEGER NOT NULL DEFAULT 1 CHECK (kind IN (1, 2)),"
    "  " DB_PARENT_COLUMN ","
    "  " DB_PRINCIPAL_COLUMN ","
    "  " DB_TRACEPARENT_COLUMN ","
    "  " DB_TRACESTATE_COLUMN ","
    "  " DB_OWNER_STARTED_COLUMN ","
    "  CHECK ((status = 'settled') = (outcome IS NOT NULL)));"
    "CREATE UNIQUE INDEX submissions_by_key ON submissions(agent, idempotency_key)"
    "  WHERE idempotency_key IS NOT NULL;"
    "CREATE INDEX submissions_by_conversation ON submissions(conversation_id, status, sequence);"
    "CREATE INDEX submissions_by_status ON submissions(status, sequence);"
    "CREATE INDEX submissions_by_host ON submissions(joined_into) WHERE joined_into IS NOT NULL;"
    "CREATE TABLE records" DB_RECORDS_TABLE ";" DB_RUNNABLE_SCHEMA DB_LIST_INDEXES DB_PARENT_INDEX
    "INSERT INTO meta(key, value) VALUES ('schema_version', '" DB_SCHEMA_VERSION "');";

enum cf_status db_code(int sqlite_rc)
{
    switch (sqlite_rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        return CF_UNAVAILABLE;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
        return CF_CORRUPT;
    case SQLITE_FULL:
        return CF_FULL; /* the disk: RESOURCE_EXHAUSTED, retried; nothing is lost */
    case SQLITE_IOERR:
    case SQLITE_READONLY:
    case SQLITE_CANTOPEN:
        return CF_IO;
    default:
        return CF_DB;
    }
}

/* code_of is db_code of rc, an error db just had: an I/O error that is the disk filling
 * (ENOSPC or EDQUOT under it; or the WAL's index that cannot grow, SQLITE_IOERR_SHMSIZE, when
 * SQLite kept no errno for it) is SQLITE_FULL's CF_FULL, waited out, not a fault. */
static enum cf_status code_of(sqlite3 *db, int rc)
{
    int e = sqlite3_system_errno(db);
    bool shm = sqlite3_extended_errcode(db) == SQLITE_IOERR_SHMSIZE && e == 0;
    if ((rc & 0xff) == SQLITE_IOERR && (e == ENOSPC || e == EDQUOT || shm)) {
        return CF_FULL;
    }
    return db_code(rc);
}

enum cf_status db_step_fail(sqlite3 *db, int step_rc, const char *what, struct cf_error *err)
{
    return cf_error_set(err, code_of(db, step_rc), "%s: %s (%s)", what, sqlite3_errmsg(db),
                        sqlite3_errstr(step_rc));
}

enum cf_status db_fail(sqlite3 *db, const char *what, struct cf_error *err)
{
    int rc = sqlite3_extended_errcode(db);
    return cf_error_set(err, code_of(db, rc == SQLITE_OK ? SQLITE_ERROR : rc), "%s: %s", what,
                        sqlite3_errmsg(db));
}

enum cf_status db_exec(sqlite3 *db, const char *sql, struct cf_error *err)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        enum cf_status st =
            cf_error_set(err, code_of(db, rc), "%s: %s", sql, msg ? msg : sqlite3_errmsg(db));
        sqlite3_free(msg);
        return st;
    }
    return CF_OK;
}

/* one_value reads the first column of sql's first row as text into out ("" when NULL);
 * *found tells whether there was a row. A failed read is an error, never "no row". */
static enum cf_status one_value(sqlite3 *db, const char *sql, const char *key, const char *what,
                                char *out, size_t out_len, bool *found, struct cf_error *err)
{
    struct stmt s;
    enum cf_status rc = stmt_open(&s, db, sql, what, err);
    *found = false;
    out[0] = '\0';
    if (rc != CF_OK) {
        return rc;
    }
    if (key) {
        stmt_text(&s, 1, key);
    }
    if ((rc = stmt_step(&s, found, err)) == CF_OK && *found) {
        const unsigned char *v = sqlite3_column_text(s.st, 0);
        snprintf(out, out_len, "%s", v ? (const char *)v : "");
    }
    stmt_close(&s);
    return rc;
}

/* check_version reads the stamp; *fresh is set when the database has no tables at all, and
 * *old_out to the version when it is one migrate_from upgrades (0 otherwise). A failed read is
 * an error, never taken for "no tables" (which would write a schema over it). */
static enum cf_status check_version(sqlite3 *db, const char *path, bool *fresh, int *old_out,
                                    struct cf_error *err)
{
    static const char tables_sql[] = "SELECT count(*) FROM sqlite_master WHERE type='table'";
    static const char version_sql[] = "SELECT value FROM meta WHERE key='schema_version'";
    char v[64];
    bool found;
    struct stmt probe;
    enum cf_status rc;
    *fresh = false;
    *old_out = 0;
    if (stmt_open(&probe, db, tables_sql, "read the schema", err) != CF_OK) {
        return cf_error_set(err, CF_CORRUPT, "%s is not a readable SQLite database: %s", path,
                            sqlite3_errmsg(db));
    }
    stmt_close(&probe);
    if ((rc = one_value(db, tables_sql, NULL, "read the schema", v, sizeof(v), &found, err)) !=
        CF_OK) {
        return rc;
    }
    if (!strcmp(v, "0")) {
        *fresh = true;
        return CF_OK;
    }
    if (stmt_open(&probe, db, version_sql, "read the schema version", err) != CF_OK) {
        return cf_error_set(err, CF_VERSION,
                            "%s holds tables but no cflue schema stamp (meta.schema_version); "
                            "it was not written by storaged; refusing to open it",
                            path);
    }
    stmt_close(&probe);
    if ((rc = one_value(db, version_sql, NULL, "read the schema version", v, sizeof(v), &found,
                        err)) != CF_OK) {
        return rc;
    }
    if (!found) {
        return cf_error_set(err, CF_VERSION, "%s has no schema_version stamp; refusing to open it",
                            path);
    }
    if (!strcmp(v, DB_SCHEMA_VERSION)) {
        return CF_OK;
    }
    if (!strcmp(v, MIGRATE_MOVING_STAMP)) {
        *old_out = 8; /* its records part way through the move to 9: migrate_from goes on */
        return CF_OK;
    }
    for (int old = MIGRATE_OLDEST_VERSION; old < atoi(DB_SCHEMA_VERSION); old++) {
        char name[16];
        snprintf(name, sizeof(name), "%d", old);
        if (!strcmp(v, name)) {
            *old_out = old;
            return CF_OK;
        }
    }
    return cf_error_set(err, CF_VERSION,
                        "%s was written with schema version %s; this storaged reads version %s "
                        "(and migrates versions %d to %d); refusing to open it",
                        path, v, DB_SCHEMA_VERSION, MIGRATE_OLDEST_VERSION,
                        atoi(DB_SCHEMA_VERSION) - 1);
}

enum cf_status db_hold(const char *path, bool *held, struct cf_error *err)
{
    *held = false;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        return cf_error_set(err, errno == ENOSPC ? CF_FULL : CF_IO, "cannot open database %s: %s",
                            path, strerror(errno));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
        *held = true; /* fd stays open: the lock lasts as long as the process */
        return CF_OK;
    }
    int e = errno;
    close(fd); /* SQLite has not opened the file yet: nothing of its is dropped */
    if (e == EWOULDBLOCK) {
        return cf_error_set(err, CF_PRECONDITION,
                            "database %s is in use by another process (is another storaged "
                            "running on it?)",
                            path);
    }
    return CF_OK; /* no flock here (some network file systems): go on without */
}

/* configure_sqlite runs once, before SQLite initializes: no memory accounting. With it on (the
 * default), every allocation SQLite makes and frees takes one process-wide mutex to count its
 * bytes, for counters storaged never reads (sqlite3_memory_used). */
static void configure_sqlite(void)
{
    (void)sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
}

enum cf_status db_open(const char *path, bool writer, sqlite3 **out, struct cf_error *err)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, configure_sqlite);
    sqlite3 *db = NULL;
    enum cf_status rc;
    bool fresh;
    int old;
    int flags = SQLITE_OPEN_NOMUTEX |
                (writer ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE : SQLITE_OPEN_READONLY);

    *out = NULL;
    if (sqlite3_open_v2(path, &db, flags, NULL) != SQLITE_OK) {
        rc = cf_error_set(err, CF_IO, "cannot open database %s: %s", path,
                          db ? sqlite3_errmsg(db) : "out of memory");
        sqlite3_close(db);
        return rc;
    }
    stmt_cache_attach(db);
    sqlite3_busy_timeout(db, 10000);
    sqlite3_extended_result_codes(db, 1);
    /* a page cache of 256 KiB per connection, not SQLite's 2 MiB; deleted content zeroed
     * whatever SQLite's build defaults to: see docs/storaged.md */
    if ((rc = db_exec(db,
                      "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
                      "PRAGMA foreign_keys=ON; PRAGMA cache_size=-256; PRAGMA temp_store=MEMORY;"
                      "PRAGMA secure_delete=ON;",
                      err)) != CF_OK) {
        goto fail;
    }
    if ((rc = check_version(db, path, &fresh, &old, err)) != CF_OK) {
        goto fail;
    }
    if (old && !writer) {
        rc = cf_error_set(err, CF_VERSION,
                          "%s has schema version %d; storaged's writer migrates it", path, old);
        goto fail;
    }
    if (old && (rc = migrate_from(db, path, old, err)) != CF_OK) {
        goto fail;
    }
    if (fresh) {
        if (!writer) {
            rc = cf_error_set(err, CF_VERSION, "%s has no schema yet", path);
            goto fail;
        }
        if ((rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
            goto fail;
        }
        if ((rc = db_exec(db, schema_sql, err)) != CF_OK) {
            /* closing the connection below rolls the open transaction back */
            goto fail;
        }
        if ((rc = db_exec(db, "COMMIT", err)) != CF_OK) {
            goto fail;
        }
    }
    *out = db;
    return CF_OK;
fail:
    sqlite3_close(db);
    return rc;
}

/* meta_get reads one meta value into out ("" when absent); *found tells which. */
static enum cf_status meta_get(sqlite3 *db, const char *key, char *out, size_t out_len, bool *found,
                               struct cf_error *err)
{
    static const char sql[] = "SELECT value FROM meta WHERE key = ?";
    return one_value(db, sql, key, "read meta", out, out_len, found, err);
}

static enum cf_status meta_set(sqlite3 *db, const char *key, const char *value,
                               struct cf_error *err)
{
    static const char sql[] = "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)";
    struct stmt s;
    enum cf_status rc = stmt_open(&s, db, sql, "write meta", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, key);
    stmt_text(&s, 2, value);
    return stmt_done(&s, err);
}

/* meta_int reads a meta value written by meta_set_int (0 when absent or not a number). */
static enum cf_status meta_int(sqlite3 *db, const char *key, int64_t *out, struct cf_error *err)
{
    char text[32], *end;
    bool found;
    enum cf_status rc = meta_get(db, key, text, sizeof(text), &found, err);
    *out = 0;
    if (rc == CF_OK && found) {
        long long v = strtoll(text, &end, 10);
        *out = end != text && *end == '\0' ? (int64_t)v : 0;
    }
    return rc;
}

static enum cf_status meta_set_int(sqlite3 *db, const char *key, int64_t value,
                                   struct cf_error *err)
{
    char text[32];
    snprintf(text, sizeof(text), "%lld", (long long)value);
    return meta_set(db, key, text, err);
}

enum cf_status db_boot(sqlite3 *db, const char *boot_id, db_boot_step then, void *arg,
                       int *fenced_out, struct db_last_run *last, struct cf_error *err)
{
    char prev[128], clean[8];
    bool have_prev, have_clean;
    enum cf_status rc;
    *fenced_out = 0;
    memset(last, 0, sizeof(*last));
    if ((rc = db_exec(db, "PRAGMA synchronous=FULL", err)) != CF_OK ||
        (rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if ((rc = meta_get(db, "boot_id", prev, sizeof(prev), &have_prev, err)) != CF_OK ||
        (rc = meta_get(db, "clean_stop", clean, sizeof(clean), &have_clean, err)) != CF_OK ||
        (rc = meta_int(db, "stopped_at_ms", &last->stopped_at_ms, err)) != CF_OK ||
        (rc = meta_int(db, "stopped_boot_ms", &last->stopped_boot_ms, err)) != CF_OK) {
        goto fail;
    }
    last->clean = strcmp(clean, "1") == 0;
    last->same_boot = have_prev && *boot_id && strcmp(prev, boot_id) == 0;
    if (have_prev && strcmp(prev, boot_id) != 0 && !last->clean) {
        if ((rc = db_exec(db,
                          "UPDATE submissions SET attempt_id = 'att_fenced_' || "
                          "lower(hex(randomblob(10))), lease_expires_at = 1 "
                          "WHERE status IN ('running','terminalizing')",
                          err)) != CF_OK) {
            goto fail;
        }
        *fenced_out = sqlite3_changes(db);
    }
    if ((then && (rc = then(db, last, arg, err)) != CF_OK) ||
        (rc = meta_set(db, "boot_id", boot_id, err)) != CF_OK ||
        (rc = meta_set(db, "clean_stop", "0", err)) != CF_OK ||
        (rc = db_exec(db, "COMMIT", err)) != CF_OK) {
        goto fail;
    }
    return CF_OK;
fail:
    /* an open transaction is rolled back when the caller closes the connection */
    *fenced_out = 0;
    return rc;
}

enum cf_status db_clean_stop(sqlite3 *db, int64_t stopped_at_ms, int64_t stopped_boot_ms,
                             struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = db_exec(db, "PRAGMA synchronous=FULL", err)) != CF_OK ||
        (rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if ((rc = meta_set(db, "clean_stop", "1", err)) != CF_OK ||
        (rc = meta_set_int(db, "stopped_at_ms", stopped_at_ms, err)) != CF_OK ||
        (rc = meta_set_int(db, "stopped_boot_ms", stopped_boot_ms, err)) != CF_OK ||
        (rc = db_exec(db, "COMMIT", err)) != CF_OK) {
        return rc; /* closing the connection rolls the transaction back */
    }
    return CF_OK;
}
