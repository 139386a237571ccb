/* backup.c - a consistent copy of the database while storaged serves (see backup.h). */
#include "backup.h"

#include "clock.h"
#include "db.h"
#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BACKUP_BUSY_MS 10000 /* how long a busy database is waited for */

static atomic_uint copies_made;

/* remove_copy unlinks a copy and the rollback journal SQLite may have left beside it. */
static void remove_copy(const char *path)
{
    char journal[sizeof(((struct backup_copy *)0)->path) + 16];
    unlink(path);
    snprintf(journal, sizeof(journal), "%s-journal", path);
    unlink(journal);
}

/* copy_into runs the online backup of src into dst in one step (one read transaction of src),
 * waiting out a busy or locked database up to BACKUP_BUSY_MS. */
static enum cf_status copy_into(sqlite3 *src, sqlite3 *dst, struct cf_error *err)
{
    sqlite3_backup *b = sqlite3_backup_init(dst, "main", src, "main");
    if (!b) {
        return cf_error_set(err, db_code(sqlite3_errcode(dst)), "cannot start the backup: %s",
                            sqlite3_errmsg(dst));
    }
    int64_t deadline = clock_mono_ms() + BACKUP_BUSY_MS;
    int rc;
    while ((rc = sqlite3_backup_step(b, -1)) == SQLITE_BUSY || rc == SQLITE_LOCKED) {
        if (clock_mono_ms() > deadline) {
            break;
        }
        sqlite3_sleep(20);
    }
    sqlite3_backup_finish(b);
    if (rc == SQLITE_BUSY || rc == SQLITE_LOCKED) {
        return cf_error_set(err, CF_UNAVAILABLE, "the database stayed busy for %d ms",
                            BACKUP_BUSY_MS);
    }
    if (rc != SQLITE_DONE) {
        return cf_error_set(err, db_code(rc), "the backup failed: %s", sqlite3_errstr(rc));
    }
    return CF_OK;
}

/* finish_copy makes the copy one self-contained file (rollback journal, nothing beside it) and
 * reads its schema version. */
static enum cf_status finish_copy(sqlite3 *dst, struct backup_copy *out, struct cf_error *err)
{
    enum cf_status rc = db_exec(dst, "PRAGMA journal_mode=DELETE", err);
    if (rc != CF_OK) {
        return rc;
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(dst, "SELECT value FROM meta WHERE key='schema_version'", -1, &st,
                           NULL) != SQLITE_OK) {
        return cf_error_set(err, CF_CORRUPT, "the copy has no schema version: %s",
                            sqlite3_errmsg(dst));
    }
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0)) {
        snprintf(out->schema_version, sizeof(out->schema_version), "%s",
                 (const char *)sqlite3_column_text(st, 0));
    }
    sqlite3_finalize(st);
    return out->schema_version[0]
               ? CF_OK
               : cf_error_set(err, CF_CORRUPT, "the copy has no schema version stamp");
}

enum cf_status backup_take(const char *db_path, struct backup_copy *out, struct cf_error *err)
{
    memset(out, 0, sizeof(*out));
    int n = snprintf(out->path, sizeof(out->path), "%s.backup-%d-%u", db_path, (int)getpid(),
                     atomic_fetch_add(&copies_made, 1) + 1);
    if (n < 0 || (size_t)n >= sizeof(out->path)) {
        return cf_error_set(err, CF_INVALID, "the database path is too long for a backup");
    }
    sqlite3 *src = NULL, *dst = NULL;
    enum cf_status rc = db_open(db_path, false, &src, err);
    if (rc != CF_OK) {
        return rc;
    }
    int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;
    if (sqlite3_open_v2(out->path, &dst, flags, NULL) != SQLITE_OK) {
        rc = cf_error_set(err, CF_IO, "cannot create the copy %s: %s", out->path,
                          dst ? sqlite3_errmsg(dst) : "out of memory");
    }
    if (rc == CF_OK) {
        rc = copy_into(src, dst, err);
    }
    if (rc == CF_OK) {
        rc = finish_copy(dst, out, err);
    }
    sqlite3_close(src);
    if (dst && sqlite3_close(dst) != SQLITE_OK && rc == CF_OK) {
        rc = cf_error_set(err, CF_IO, "cannot close the copy %s", out->path);
    }
    struct stat stt;
    if (rc == CF_OK && stat(out->path, &stt) != 0) {
        rc = cf_error_set(err, CF_IO, "cannot stat the copy %s: %s", out->path, strerror(errno));
    }
    if (rc != CF_OK) {
        remove_copy(out->path);
        return rc;
    }
    out->size = (int64_t)stt.st_size;
    return CF_OK;
}

int backup_sweep(const char *db_path)
{
    char a[PATH_MAX], b[PATH_MAX], prefix[PATH_MAX];
    snprintf(a, sizeof(a), "%s", db_path);
    snprintf(b, sizeof(b), "%s", db_path);
    const char *dir = dirname(a);
    snprintf(prefix, sizeof(prefix), "%s.backup-", basename(b));
    DIR *d = opendir(dir);
    if (!d) {
        return 0;
    }
    int removed = 0;
    size_t plen = strlen(prefix);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, prefix, plen) != 0) {
            continue;
        }
        long pid = strtol(e->d_name + plen, NULL, 10);
        if (pid != (long)getpid() && pid > 0 && kill((pid_t)pid, 0) == 0) {
            continue; /* another live storaged's copy in the making (ours: none yet, this runs
                       * before serving; in a container storaged often has the same pid each
                       * start, so a leftover with ours is a dead one's) */
        }
        char path[PATH_MAX + 256];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (unlink(path) == 0) {
            removed++;
            log_info("backup_swept", "file=%s: a copy left by a storaged that stopped mid-backup",
                     path);
        }
    }
    closedir(d);
    return removed;
}
