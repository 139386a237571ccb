/* migrate.h - upgrading a database written by the previous storaged schema. */
#ifndef CFLUE_STORAGED_MIGRATE_H
#define CFLUE_STORAGED_MIGRATE_H

#include "status.h"

#include <sqlite3.h>

/* The schema version migrate_v1 upgrades from (records with JSON bodies). */
#define MIGRATE_FROM_VERSION "1"

/* migrate_v1 upgrades the database on the writer connection db from schema version 1 to
 * DB_SCHEMA_VERSION in one transaction: each record's JSON body becomes its typed body (a record
 * of a type this version does not know becomes a Signal of kind "legacy_<type>" holding its
 * JSON), and a submission with metadata cflue.kind=compact becomes kind COMPACT (the key
 * removed from its stored request). Either everything is migrated and committed or nothing is:
 * on failure the transaction is rolled back, the database stays at version 1 and the status
 * names what could not be migrated. path is for messages only. */
CF_MUST_CHECK enum cf_status migrate_v1(sqlite3 *db, const char *path, struct cf_error *err);

#endif
