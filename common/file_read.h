/* file_read.h - a configuration file read whole, within a bound, without ever blocking on it.
 *
 * Definitions, skills and their supporting files are read from directories an operator (or, for
 * a sandbox, the model) writes, and certificates and keys from files an operator names: a FIFO
 * or a device among them must not hang the reader (open of a FIFO waits for a writer), and a
 * file must not grow the reader past its bound.
 */
#ifndef CFLUE_FILE_READ_H
#define CFLUE_FILE_READ_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>

/* How file_read_regular reads. */
enum file_read_flags {
    FILE_READ_NOFOLLOW = 1 << 0, /* a symbolic link at the last component is refused */
    FILE_READ_SECRET = 1 << 1,   /* key material: every buffer it leaves behind is wiped */
};

/* file_read_regular reads the regular file at path whole into a new NUL-terminated buffer
 * (*data, the caller frees it; *len bytes), at most max bytes. It opens without blocking and
 * refuses what is no regular file. flags: enum file_read_flags (with FILE_READ_SECRET the
 * caller wipes *data before freeing it). CF_OK; CF_NOT_FOUND when there is no such file;
 * CF_TOOBIG when it holds more than max bytes (even grown while read); CF_INVALID otherwise
 * (no regular file, or not readable); err says which, naming path. On failure *data is NULL. */
CF_MUST_CHECK enum cf_status file_read_regular(const char *path, size_t max, unsigned flags,
                                               char **data, size_t *len, struct cf_error *err);

#endif
