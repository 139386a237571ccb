/* backup.h - a consistent copy of the database while storaged serves (Store.Backup).
 *
 * backup_take copies the database with SQLite's online backup in one step: one read
 * transaction on a connection of its own, so it sees one committed state and writers go on
 * meanwhile (WAL). The copy is a file beside the database, named <db>.backup-<pid>-<n>, that
 * the caller streams and removes; backup_sweep removes those a killed storaged left.
 */
#ifndef CFLUE_STORAGED_BACKUP_H
#define CFLUE_STORAGED_BACKUP_H

#include "status.h"

#include <stddef.h>
#include <stdint.h>

#define BACKUP_CHUNK_BYTES (1 << 20) /* the most of the copy one BackupChunk carries */

/* What backup_take made. */
struct backup_copy {
    char path[4096];         /* the copy's file */
    int64_t size;            /* its size in bytes */
    char schema_version[16]; /* meta.schema_version of the copy */
};

/* backup_take copies the database at db_path into a new file beside it (out->path). On failure
 * nothing is left behind: CF_IO (the disk), CF_UNAVAILABLE (the database stayed busy), or what
 * db_code says of SQLite's error, with a message naming the step. */
CF_MUST_CHECK enum cf_status backup_take(const char *db_path, struct backup_copy *out,
                                         struct cf_error *err);

/* backup_sweep removes the copies beside db_path that no live storaged is sending (left by a
 * storaged that was killed mid-backup); returns how many it removed. Call before serving: a
 * copy named with the caller's own pid is taken for a dead one's. */
int backup_sweep(const char *db_path);

#endif
