/* stmt.h - SQL statements prepared once per connection, and checked at every step.
 *
 * Every connection db_open returns carries a statement cache (stmt_cache_attach). stmt_open
 * finds the compiled statement for an SQL text there, keyed by the text's address (so pass a
 * string literal or a static array, never a buffer whose content changes: for SQL built at run
 * time use stmt_open_once), compiling it on first use; stmt_close resets it and clears its
 * bindings, so it holds no snapshot and no pointer into the caller's memory between uses. A
 * statement already in use (the same SQL opened again before its stmt_close) is compiled once
 * more for the inner use and finalized at its close, so nesting is safe.
 *
 * The cache lives as long as the connection: sqlite3_close finalizes every cached statement
 * first (an SQLITE_TRACE_CLOSE hook), so callers close connections the usual way. Statements
 * survive rollbacks and schema changes (SQLite recompiles them).
 *
 * Stepping: stmt_step reports a row or the end; any other SQLite result is an error with the
 * status db_code gives (CF_DB, CF_IO, CF_UNAVAILABLE, CF_CORRUPT), never "no more rows".
 *
 * Binding: text and blobs are bound without a copy; the caller keeps them alive until
 * stmt_close (which clears the bindings).
 */
#ifndef CFLUE_STORAGED_STMT_H
#define CFLUE_STORAGED_STMT_H

#include "status.h"

#include <sqlite3.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct stmt_slot;

/* A statement in use between stmt_open and stmt_close. */
struct stmt {
    sqlite3 *db;
    sqlite3_stmt *st;       /* for sqlite3_column_* */
    const char *what;       /* names the statement in error messages */
    struct stmt_slot *slot; /* the cache entry lent out; NULL when compiled for this use only */
};

/* stmt_cache_attach gives db an empty statement cache, freed (with its statements finalized)
 * when db is closed. db_open calls it; a connection without one compiles and finalizes each
 * statement per use. Idempotent. */
void stmt_cache_attach(sqlite3 *db);

/* stmt_cache_size returns how many statements db's cache holds (0 without a cache). For tests. */
size_t stmt_cache_size(sqlite3 *db);

/* stmt_open lends out db's compiled statement for sql (compiling and caching it on first use)
 * into *s. what names it in errors. On failure (SQL that does not compile) err names what and
 * SQLite's message, and *s needs no stmt_close. */
CF_MUST_CHECK enum cf_status stmt_open(struct stmt *s, sqlite3 *db, const char *sql,
                                       const char *what, struct cf_error *err);

/* stmt_open_once is stmt_open for SQL built at run time: compiled now, finalized at stmt_close. */
CF_MUST_CHECK enum cf_status stmt_open_once(struct stmt *s, sqlite3 *db, const char *sql,
                                            const char *what, struct cf_error *err);

/* stmt_text binds v (NULL binds ""); stmt_opt_text binds NULL for NULL or "". */
void stmt_text(struct stmt *s, int i, const char *v);
void stmt_opt_text(struct stmt *s, int i, const char *v);
void stmt_int(struct stmt *s, int i, int64_t v);
void stmt_double(struct stmt *s, int i, double v);
void stmt_blob(struct stmt *s, int i, const void *v, size_t len);
void stmt_value(struct stmt *s, int i, const sqlite3_value *v);

/* stmt_step runs s to its next row: CF_OK with *row_out true (a row to read) or false (no more
 * rows). Any other SQLite result is a status with err naming s->what; s stays open either way. */
CF_MUST_CHECK enum cf_status stmt_step(struct stmt *s, bool *row_out, struct cf_error *err);

/* stmt_done steps s once more, which must end it (SQLITE_DONE: a row there is CF_INTERNAL),
 * and closes s whatever happened. For statements without results, and RETURNING ones after
 * their row was read. */
CF_MUST_CHECK enum cf_status stmt_done(struct stmt *s, struct cf_error *err);

/* stmt_run runs one statement without results (BEGIN, COMMIT, a PRAGMA, an UPDATE without
 * parameters) through db's cache: stmt_open, then stmt_done. sql is keyed by address as for
 * stmt_open; err names sql on failure. */
CF_MUST_CHECK enum cf_status stmt_run(sqlite3 *db, const char *sql, struct cf_error *err);

/* stmt_changes returns the rows the last finished INSERT/UPDATE/DELETE on s's connection
 * changed. */
int stmt_changes(const struct stmt *s);

/* stmt_close resets s and clears its bindings (or finalizes it when it was compiled for this
 * use only). Accepts a closed or never-opened (zeroed) stmt. */
void stmt_close(struct stmt *s);

#endif
