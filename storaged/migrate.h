/* migrate.h - upgrading a database written by an earlier storaged schema. */
#ifndef CFLUE_STORAGED_MIGRATE_H
#define CFLUE_STORAGED_MIGRATE_H

#include "status.h"

#include <sqlite3.h>

/* The oldest schema version migrate_from upgrades (1: records with JSON bodies). */
#define MIGRATE_OLDEST_VERSION 1

/* migrate_from upgrades the database on the writer connection db from schema version `version`
 * (MIGRATE_OLDEST_VERSION up to DB_SCHEMA_VERSION - 1) to DB_SCHEMA_VERSION in one transaction,
 * one step per version:
 * - 1 to 2: each record's JSON body becomes its typed body (a record of a type this version
 *   does not know becomes a Signal of kind "legacy_<type>" holding its JSON), and a submission
 *   with metadata cflue.kind=compact becomes kind COMPACT (the key removed from its stored
 *   request);
 * - 2 to 3: the Claim indexes and the `runnable` table with its triggers (db.h), filled from
 *   the submissions;
 * - 3 to 4: the indexes of List's owner_id and abort_requested filters (DB_LIST_INDEXES);
 * - 4 to 5: the column parent_submission_id (NULL in every existing row) and its partial index
 *   (DB_PARENT_COLUMN, DB_PARENT_INDEX);
 * - 5 to 6: the column principal (NULL: none) on conversations and on submissions
 *   (DB_PRINCIPAL_COLUMN);
 * - 6 to 7: the columns traceparent and tracestate (NULL: none) on submissions
 *   (DB_TRACEPARENT_COLUMN, DB_TRACESTATE_COLUMN).
 * Either everything is migrated and committed or nothing is: on failure the transaction is
 * rolled back, the database stays at its version and the status names what could not be
 * migrated. path is for messages only. */
CF_MUST_CHECK enum cf_status migrate_from(sqlite3 *db, const char *path, int version,
                                          struct cf_error *err);

#endif
