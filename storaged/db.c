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

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static const char schema_sql[] =
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE conversations("
    "  conversation_id TEXT PRIMARY KEY,"
    "  agent TEXT NOT NULL,"
    "  created_at INTEGER NOT NULL,"
    "  next_pos INTEGER NOT NULL DEFAULT 0,"
    "  epoch INTEGER NOT NULL DEFAULT 0);"
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
    "  CHECK ((status = 'settled') = (outcome IS NOT NULL)));"
    "CREATE UNIQUE INDEX submissions_by_key ON submissions(agent, idempotency_key)"
    "  WHERE idempotency_key IS NOT NULL;"
    "CREATE INDEX submissions_by_conversation ON submissions(conversation_id, status, sequence);"
    "CREATE INDEX submissions_by_status ON submissions(status, sequence);"
    "CREATE INDEX submissions_by_host ON submissions(joined_into) WHERE joined_into IS NOT NULL;"
    "CREATE TABLE records" DB_RECORDS_TABLE ";"
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
    case SQLITE_IOERR:
    case SQLITE_READONLY:
    case SQLITE_CANTOPEN:
        return CF_IO;
    default:
        return CF_DB;
    }
}

enum cf_status db_step_fail(sqlite3 *db, int step_rc, const char *what, struct cf_error *err)
{
    return cf_error_set(err, db_code(step_rc), "%s: %s (%s)", what, sqlite3_errmsg(db),
                        sqlite3_errstr(step_rc));
}

enum cf_status db_fail(sqlite3 *db, const char *what, struct cf_error *err)
{
    int rc = sqlite3_extended_errcode(db);
    return cf_error_set(err, db_code(rc == SQLITE_OK ? SQLITE_ERROR : rc), "%s: %s", what,
                        sqlite3_errmsg(db));
}

enum cf_status db_exec(sqlite3 *db, const char *sql, struct cf_error *err)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        enum cf_status st =
            cf_error_set(err, db_code(rc), "%s: %s", sql, msg ? msg : sqlite3_errmsg(db));
        sqlite3_free(msg);
        return st;
    }
    return CF_OK;
}

enum cf_status db_prepare(sqlite3 *db, const char *sql, sqlite3_stmt **out, struct cf_error *err)
{
    if (sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, out, NULL) != SQLITE_OK) {
        return db_fail(db, "prepare", err);
    }
    return CF_OK;
}

/* check_version reads the stamp; *fresh is set when the database has no tables at all. A
 * failed read is an error, never taken for "no tables" (which would write a schema over it). */
static enum cf_status check_version(sqlite3 *db, const char *path, bool *fresh, bool *old,
                                    struct cf_error *err)
{
    sqlite3_stmt *st;
    int tables = 0, r;
    *fresh = false;
    *old = false;
    if (sqlite3_prepare_v2(db, "SELECT count(*) FROM sqlite_master WHERE type='table'", -1, &st,
                           NULL) != SQLITE_OK) {
        return cf_error_set(err, CF_CORRUPT, "%s is not a readable SQLite database: %s", path,
                            sqlite3_errmsg(db));
    }
    r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        tables = sqlite3_column_int(st, 0);
    } else {
        enum cf_status rc = db_step_fail(db, r, "read the schema", err);
        sqlite3_finalize(st);
        return rc;
    }
    sqlite3_finalize(st);
    if (tables == 0) {
        *fresh = true;
        return CF_OK;
    }
    if (sqlite3_prepare_v2(db, "SELECT value FROM meta WHERE key='schema_version'", -1, &st,
                           NULL) != SQLITE_OK) {
        return cf_error_set(err, CF_VERSION,
                            "%s holds tables but no cflue schema stamp (meta.schema_version); "
                            "it was not written by storaged; refusing to open it",
                            path);
    }
    enum cf_status rc = CF_OK;
    r = sqlite3_step(st);
    if (r == SQLITE_DONE) {
        rc = cf_error_set(err, CF_VERSION, "%s has no schema_version stamp; refusing to open it",
                          path);
    } else if (r != SQLITE_ROW) {
        rc = db_step_fail(db, r, "read the schema version", err);
    } else {
        const char *v = (const char *)sqlite3_column_text(st, 0);
        if (v && !strcmp(v, MIGRATE_FROM_VERSION)) {
            *old = true;
        } else if (!v || strcmp(v, DB_SCHEMA_VERSION) != 0) {
            rc = cf_error_set(err, CF_VERSION,
                              "%s was written with schema version %s; this storaged reads "
                              "version %s (and migrates version %s); refusing to open it",
                              path, v ? v : "(null)", DB_SCHEMA_VERSION, MIGRATE_FROM_VERSION);
        }
    }
    sqlite3_finalize(st);
    return rc;
}

enum cf_status db_open(const char *path, bool writer, sqlite3 **out, struct cf_error *err)
{
    sqlite3 *db = NULL;
    enum cf_status rc;
    bool fresh, old;
    int flags = SQLITE_OPEN_NOMUTEX |
                (writer ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE : SQLITE_OPEN_READONLY);

    *out = NULL;
    if (sqlite3_open_v2(path, &db, flags, NULL) != SQLITE_OK) {
        rc = cf_error_set(err, CF_IO, "cannot open database %s: %s", path,
                          db ? sqlite3_errmsg(db) : "out of memory");
        sqlite3_close(db);
        return rc;
    }
    sqlite3_busy_timeout(db, 10000);
    sqlite3_extended_result_codes(db, 1);
    if ((rc = db_exec(db,
                      "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
                      "PRAGMA foreign_keys=ON;",
                      err)) != CF_OK) {
        goto fail;
    }
    if ((rc = check_version(db, path, &fresh, &old, err)) != CF_OK) {
        goto fail;
    }
    if (old && !writer) {
        rc =
            cf_error_set(err, CF_VERSION, "%s has schema version %s; storaged's writer migrates it",
                         path, MIGRATE_FROM_VERSION);
        goto fail;
    }
    if (old && (rc = migrate_v1(db, path, err)) != CF_OK) {
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
    sqlite3_stmt *st;
    enum cf_status rc = CF_OK;
    *found = false;
    out[0] = '\0';
    if ((rc = db_prepare(db, "SELECT value FROM meta WHERE key = ?", &st, err)) != CF_OK) {
        return rc;
    }
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        const unsigned char *v = sqlite3_column_text(st, 0);
        snprintf(out, out_len, "%s", v ? (const char *)v : "");
        *found = true;
    } else if (r != SQLITE_DONE) {
        rc = db_step_fail(db, r, "read meta", err);
    }
    sqlite3_finalize(st);
    return rc;
}

static enum cf_status meta_set(sqlite3 *db, const char *key, const char *value,
                               struct cf_error *err)
{
    sqlite3_stmt *st;
    enum cf_status rc;
    if ((rc = db_prepare(db, "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", &st, err)) !=
        CF_OK) {
        return rc;
    }
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, value, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    rc = r == SQLITE_DONE ? CF_OK : db_step_fail(db, r, "write meta", err);
    sqlite3_finalize(st);
    return rc;
}

enum cf_status db_boot(sqlite3 *db, const char *boot_id, int *fenced_out, struct cf_error *err)
{
    char prev[128], clean[8];
    bool have_prev, have_clean;
    enum cf_status rc;
    *fenced_out = 0;
    if ((rc = db_exec(db, "PRAGMA synchronous=FULL", err)) != CF_OK ||
        (rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if ((rc = meta_get(db, "boot_id", prev, sizeof(prev), &have_prev, err)) != CF_OK ||
        (rc = meta_get(db, "clean_stop", clean, sizeof(clean), &have_clean, err)) != CF_OK) {
        goto fail;
    }
    if (have_prev && strcmp(prev, boot_id) != 0 && strcmp(clean, "1") != 0) {
        if ((rc = db_exec(db,
                          "UPDATE submissions SET attempt_id = 'att_fenced_' || "
                          "lower(hex(randomblob(10))), lease_expires_at = 1 "
                          "WHERE status IN ('running','terminalizing')",
                          err)) != CF_OK) {
            goto fail;
        }
        *fenced_out = sqlite3_changes(db);
    }
    if ((rc = meta_set(db, "boot_id", boot_id, err)) != CF_OK ||
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

enum cf_status db_clean_stop(sqlite3 *db, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = db_exec(db, "PRAGMA synchronous=FULL", err)) != CF_OK ||
        (rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if ((rc = meta_set(db, "clean_stop", "1", err)) != CF_OK ||
        (rc = db_exec(db, "COMMIT", err)) != CF_OK) {
        return rc; /* closing the connection rolls the transaction back */
    }
    return CF_OK;
}
