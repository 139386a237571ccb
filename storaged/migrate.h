/* migrate.h - upgrading a database written by an earlier storaged schema. */
#ifndef CFLUE_STORAGED_MIGRATE_H
#define CFLUE_STORAGED_MIGRATE_H

#include "status.h"

#include <sqlite3.h>

/* The oldest schema version migrate_from upgrades (1: records with JSON bodies). */
#define MIGRATE_OLDEST_VERSION 1

/* The stamp of a database whose records are part way through the move from version 8 to 9:
 * this storaged goes on with the move (db_open hands it to migrate_from as version 8), and a
 * storaged of version 8, which would serve the records not moved yet as the whole stream,
 * refuses it as a version it does not know. */
#define MIGRATE_MOVING_STAMP "9-moving"

/* migrate_from upgrades the database on the writer connection db from schema version `version`
 * (MIGRATE_OLDEST_VERSION up to DB_SCHEMA_VERSION - 1) to DB_SCHEMA_VERSION, one step per
 * version:
 * - 1 to 2: each record's JSON body becomes its typed body (a record of a type this version
 *   does not know becomes a Signal of kind "legacy_<type>" holding its JSON), and a submission
 *   with metadata cflue.kind=compact becomes kind COMPACT (the key removed from its stored
 *   request); the records are rewritten in version 9's layout at once;
 * - 2 to 3: the Claim indexes and the `runnable` table with its triggers (db.h), filled from
 *   the submissions;
 * - 3 to 4: the indexes of List's owner_id and abort_requested filters (DB_LIST_INDEXES);
 * - 4 to 5: the column parent_submission_id (NULL in every existing row) and its partial index
 *   (DB_PARENT_COLUMN, DB_PARENT_INDEX);
 * - 5 to 6: the column principal (NULL: none) on conversations and on submissions
 *   (DB_PRINCIPAL_COLUMN);
 * - 6 to 7: the columns traceparent and tracestate (NULL: none) on submissions
 *   (DB_TRACEPARENT_COLUMN, DB_TRACESTATE_COLUMN);
 * - 7 to 8: the column owner_started_at (0) on submissions (DB_OWNER_STARTED_COLUMN);
 * - 8 to 9: the records table keyed by rowid (DB_RECORDS_TABLE), its rows moved in steps.
 * The steps up to 8 run in one transaction: either all of them are committed or none is. The
 * move from 8 to 9 commits each step of at most 32 MiB (or 10,000 records) on its own, a row
 * always in exactly one of the two tables, the first step stamping MIGRATE_MOVING_STAMP; when
 * it stops part way, the database keeps that stamp and the next call (with version 8) goes on
 * where it stopped. On failure nothing of the failed
 * transaction is kept and the status names what could not be migrated. Logs `migrated` with
 * the time it took. path is for messages only. */
CF_MUST_CHECK enum cf_status migrate_from(sqlite3 *db, const char *path, int version,
                                          struct cf_error *err);

#endif
