/* db.h - opening storaged's SQLite database: pragmas, schema, version check. */
#ifndef CFLUE_STORAGED_DB_H
#define CFLUE_STORAGED_DB_H

#include "status.h"

#include <sqlite3.h>
#include <stdbool.h>

#define DB_SCHEMA_VERSION "1"

/* db_open opens path. The writer connection creates the schema on first use (WAL mode,
 * synchronous=FULL, foreign keys on) and refuses a database written by another schema version
 * or by something other than storaged with CF_VERSION and a message saying what was found.
 * Reader connections are read-only and expect the schema to exist. On success *out is an open
 * connection the caller closes with sqlite3_close. */
enum cf_status db_open(const char *path, bool writer, sqlite3 **out, struct cf_error *err);

/* db_exec runs SQL without results; CF_DB with SQLite's message on failure. */
enum cf_status db_exec(sqlite3 *db, const char *sql, struct cf_error *err);

/* db_prepare compiles one statement (cached by SQLite's prepare_v3 persistent flag). */
enum cf_status db_prepare(sqlite3 *db, const char *sql, sqlite3_stmt **out, struct cf_error *err);

/* db_fail turns the current SQLite error into CF_DB with a message naming what failed. */
enum cf_status db_fail(sqlite3 *db, const char *what, struct cf_error *err);

#endif
