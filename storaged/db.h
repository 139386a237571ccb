/* db.h - opening storaged's SQLite database: pragmas, schema, version check. */
#ifndef CFLUE_STORAGED_DB_H
#define CFLUE_STORAGED_DB_H

#include "status.h"

#include <sqlite3.h>
#include <stdbool.h>

#define DB_SCHEMA_VERSION "9"

/* The records table's columns (after "CREATE TABLE <name>"): a record's body is stored as its
 * oneof case (`kind`, the Record.body field number) and the body message packed by protobuf-c
 * (`body`); no JSON. Rows are keyed by SQLite's implicit rowid, in the order they were
 * written; the two unique indexes find a record by its position and by its id. (Up to version
 * 8 the table was WITHOUT ROWID, keyed by (conversation_id, pos). A b-tree of that kind keeps
 * whole rows as its keys, and SQLite reads a key longer than its page in full, overflow pages
 * and all, to compare it: every seek that met a long record, such as a page of a file, read
 * that record again.) */
#define DB_RECORDS_TABLE                                                                           \
    "(conversation_id TEXT NOT NULL,"                                                              \
    "  pos INTEGER NOT NULL,"                                                                      \
    "  record_id TEXT NOT NULL,"                                                                   \
    "  kind INTEGER NOT NULL,"                                                                     \
    "  submission_id TEXT,"                                                                        \
    "  attempt_id TEXT,"                                                                           \
    "  ts INTEGER NOT NULL,"                                                                       \
    "  body BLOB NOT NULL,"                                                                        \
    "  UNIQUE (conversation_id, pos),"                                                             \
    "  UNIQUE (conversation_id, record_id))"

/* What schema version 3 added to version 2: Claim finds work through indexes (see ledger.c).
 * `runnable` holds one row per conversation whose head (its first unsettled submission) is
 * queued, keyed by the head's sequence; triggers keep it on every insert and status change of
 * submissions, so no code path can forget it. The partial indexes find a conversation's head
 * and the expired leases without walking queued or running rows. DB_RUNNABLE_FILL computes
 * `runnable` from the submissions (the migration from version 2). */
#define DB_HEAD_OF(conv)                                                                           \
    "(SELECT min(sequence) FROM submissions WHERE conversation_id = " conv                         \
    " AND status != 'settled')"
#define DB_RUNNABLE_SCHEMA                                                                         \
    "CREATE INDEX submissions_unsettled ON submissions(conversation_id, sequence)"                 \
    "  WHERE status != 'settled';"                                                                 \
    "CREATE INDEX submissions_by_lease ON submissions(lease_expires_at)"                           \
    "  WHERE status IN ('running','terminalizing');"                                               \
    "CREATE TABLE runnable(sequence INTEGER PRIMARY KEY, conversation_id TEXT NOT NULL UNIQUE);"   \
    "CREATE TRIGGER runnable_on_admit AFTER INSERT ON submissions"                                 \
    "  WHEN NEW.status = 'queued' AND NEW.sequence = " DB_HEAD_OF(                                 \
        "NEW.conversation_id") " BEGIN"                                                            \
                               "  INSERT OR REPLACE INTO runnable(sequence, conversation_id)"      \
                               "    VALUES (NEW.sequence, NEW.conversation_id);"                   \
                               "END;"                                                              \
                               "CREATE TRIGGER runnable_on_status AFTER UPDATE OF status ON "      \
                               "submissions"                                                       \
                               "  WHEN OLD.status IS NOT NEW.status BEGIN"                         \
                               "  DELETE FROM runnable WHERE conversation_id = "                   \
                               "NEW.conversation_id;"                                              \
                               "  INSERT INTO runnable(sequence, conversation_id) SELECT "         \
                               "sequence, conversation_id"                                         \
                               "    FROM submissions WHERE sequence = " DB_HEAD_OF(                \
                                   "NEW.conversation_id") "    AND status = 'queued';"             \
                                                          "END;"
#define DB_RUNNABLE_FILL                                                                           \
    "INSERT INTO runnable(sequence, conversation_id) SELECT s.sequence, s.conversation_id"         \
    "  FROM submissions s WHERE s.status = 'queued' AND s.sequence = " DB_HEAD_OF(                 \
        "s.conversation_id") ";"

/* What schema version 4 added to version 3: the indexes of List's owner_id and abort_requested
 * filters. submissions_by_owner holds the rows an attempt ever held (owner_id is set by a claim)
 * in sequence order per owner; submissions_abort_requested holds the few rows with an abort
 * intent. Both are partial, so queued rows without an intent cost them nothing. */
#define DB_LIST_INDEXES                                                                            \
    "CREATE INDEX submissions_by_owner ON submissions(owner_id, sequence)"                         \
    "  WHERE owner_id IS NOT NULL;"                                                                \
    "CREATE INDEX submissions_abort_requested ON submissions(sequence)"                            \
    "  WHERE abort_requested_at IS NOT NULL;"

/* What schema version 5 added to version 4: subagent delegation. A submission admitted with
 * AdmitRequest.delegation names its parent in `parent_submission_id` (NULL for every other
 * submission, so rows of earlier versions need nothing); the partial index finds a parent's
 * children, which an abort intent on the parent, or the parent settling failed or aborted,
 * stamps in the same transaction (ledger.c, "abort"). DB_PARENT_COLUMN is the column as the
 * fresh schema declares it and the migration adds it. */
#define DB_PARENT_COLUMN "parent_submission_id TEXT"
#define DB_PARENT_INDEX                                                                            \
    "CREATE INDEX submissions_by_parent ON submissions(parent_submission_id)"                      \
    "  WHERE parent_submission_id IS NOT NULL;"

/* What schema version 6 added to version 5: the principal (the authenticated caller, see
 * AdmitRequest.principal) owning each conversation, in `conversations.principal`, and a copy
 * of it on each of the conversation's submissions (`submissions.principal`, so a Get answers
 * whose it is without a second read; a conversation's principal never changes). NULL (no
 * principal) in every row of earlier versions, which were written without authentication. */
#define DB_PRINCIPAL_COLUMN "principal TEXT"

/* What schema version 7 added to version 6: each submission's W3C trace context as admitted
 * (AdmitRequest.traceparent and .tracestate; NULL: none), kept outside the idempotency
 * payload. NULL in every row of earlier versions, admitted before storaged kept them. */
#define DB_TRACEPARENT_COLUMN "traceparent TEXT"
#define DB_TRACESTATE_COLUMN "tracestate TEXT"

/* What schema version 8 added to version 7: the start of the process that claimed each
 * submission's current attempt, by that process's clock (ClaimRequest.owner_started_at, ms;
 * 0: not given), which a reclaim compares with its own start instead of started_at, a time
 * of storaged's clock. 0 in every row of earlier versions. */
#define DB_OWNER_STARTED_COLUMN "owner_started_at INTEGER NOT NULL DEFAULT 0"

/* db_hold takes the database file at path for this process until it exits: an exclusive
 * flock(2) on the file (created empty when missing, which SQLite reads as a new database), on a
 * descriptor never closed (closing one would also drop SQLite's locks on the file: POSIX locks
 * belong to the process). CF_PRECONDITION when another process holds it: a second storaged on
 * the same database would commit beside the first without waking its followers, and stamp a
 * clean stop into it when it stops. *held is false (CF_OK) where the file system does not lock
 * files that way: the caller goes on without. Call it before db_open. */
CF_MUST_CHECK enum cf_status db_hold(const char *path, bool *held, struct cf_error *err);

/* db_open opens path. The writer connection creates the schema on first use (WAL mode,
 * synchronous=FULL, foreign keys on), migrates a database of an earlier schema version
 * (versions 1 to 8, or one stamped MIGRATE_MOVING_STAMP: migrate.h), and refuses one written by
 * another schema version or by something other than storaged with CF_VERSION and a message saying
 * what was found. Reader connections are read-only and expect the schema to exist. On success *out
 * is an open connection with a statement cache (stmt.h) that the caller closes with sqlite3_close.
 */
CF_MUST_CHECK enum cf_status db_open(const char *path, bool writer, sqlite3 **out,
                                     struct cf_error *err);

/* db_exec runs SQL without results, compiled for this call (statements run often go through
 * stmt.h instead); on failure the status db_code gives, with SQLite's message. */
CF_MUST_CHECK enum cf_status db_exec(sqlite3 *db, const char *sql, struct cf_error *err);

/* db_code maps an SQLite result code to the status a client sees: SQLITE_BUSY and
 * SQLITE_LOCKED (the busy timeout ran out) are CF_UNAVAILABLE, so the caller retries;
 * SQLITE_CORRUPT and SQLITE_NOTADB are CF_CORRUPT (DATA_LOSS); SQLITE_FULL (the disk is full)
 * is CF_FULL (RESOURCE_EXHAUSTED, STORAGE_FULL: retried once there is room); SQLITE_IOERR,
 * SQLITE_READONLY and SQLITE_CANTOPEN are CF_IO; anything else is CF_DB. Never CF_OK. */
enum cf_status db_code(int sqlite_rc);

/* db_fail turns the connection's current SQLite error into the status db_code gives, with a
 * message naming what failed and SQLite's own message. Returns that status (never CF_OK). An
 * I/O error that is the disk filling (ENOSPC or EDQUOT under it, or the WAL index that
 * cannot grow with no errno kept) is CF_FULL, as SQLITE_FULL is (so are db_exec's
 * and db_step_fail's). */
CF_MUST_CHECK enum cf_status db_fail(sqlite3 *db, const char *what, struct cf_error *err);

/* db_step_fail is db_fail for a statement whose sqlite3_step returned step_rc, something other
 * than SQLITE_ROW or SQLITE_DONE. */
CF_MUST_CHECK enum cf_status db_step_fail(sqlite3 *db, int step_rc, const char *what,
                                          struct cf_error *err);

/* The previous run's stop, as db_boot found it (what downtime.h needs to tell how long
 * storaged was down). */
struct db_last_run {
    bool clean;              /* it stopped cleanly, stamping the two times below */
    bool same_boot;          /* on this machine's current boot (the boot ids match) */
    int64_t stopped_at_ms;   /* the store clock at the clean stop (0: not stamped) */
    int64_t stopped_boot_ms; /* CLOCK_BOOTTIME at the clean stop (0: not stamped) */
};

/* A step of the start-up that db_boot runs in its transaction, after the fencing, given what
 * the previous run left (last) and the caller's arg. A failure rolls the whole start-up back. */
typedef enum cf_status (*db_boot_step)(sqlite3 *db, const struct db_last_run *last, void *arg,
                                       struct cf_error *err);

/* db_boot runs once at start-up on the writer connection, before anything is served. It
 * detects a restart after the machine itself went down: the kernel's boot id (boot_id, e.g. from
 * /proc/sys/kernel/random/boot_id; "" when unknown) differs from the one stored by the previous
 * run and that run did not stop cleanly. Commits made with synchronous=NORMAL since the last
 * synced one may then have been lost, while the attempts that made them may still be running
 * elsewhere: every running or terminalizing submission gets a fresh attempt id and an expired
 * lease, so those attempts are fenced off (ABORTED, STALE_FENCE) and recovery continues from what
 * is durable. After a process crash on the same boot nothing was lost (the OS kept the page
 * cache) and nothing is fenced. A database without a stored boot id (first start) fences nothing.
 * Then runs then(db, last, arg) when it is set. Stores the boot id and clears the clean-stop
 * stamp, all in one transaction committed with synchronous=FULL. Sets *fenced_out to the number
 * of attempts fenced off, and *last to what the previous run left. On failure the caller closes
 * the connection (rolling back) and must not serve. */
CF_MUST_CHECK enum cf_status db_boot(sqlite3 *db, const char *boot_id, db_boot_step then, void *arg,
                                     int *fenced_out, struct db_last_run *last,
                                     struct cf_error *err);

/* db_clean_stop stamps a clean stop with its times (the store clock's and CLOCK_BOOTTIME's,
 * ms), committed with synchronous=FULL (which also syncs every earlier commit): the next start
 * fences nothing even on a new boot, and knows how long storaged was down. Call last, when no
 * more writes will come. On failure the caller closes the connection (rolling back). */
CF_MUST_CHECK enum cf_status db_clean_stop(sqlite3 *db, int64_t stopped_at_ms,
                                           int64_t stopped_boot_ms, struct cf_error *err);

#endif
