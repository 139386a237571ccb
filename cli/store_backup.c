/* store_backup.c - cflue store backup FILE: a consistent copy of storaged's database, while it
 * serves.
 *
 * The copy streams into FILE.partial beside FILE (created new: an existing one is refused, so
 * two backups never write one file), is checked against the size and SHA-256 storaged sent,
 * made durable (fsync of the file, then of its directory) and only then renamed to FILE. A
 * stream that breaks, a mismatch or a signal leaves no FILE and removes FILE.partial.
 */
#include "store_backup.h"

#include "guard.h"

#include "cflue/v1/store.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static bool write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            return false;
        }
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* sync_dir makes the rename of a file in path's directory durable. */
static bool sync_dir(const char *path)
{
    char copy[PATH_MAX];
    snprintf(copy, sizeof(copy), "%s", path);
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    bool ok = fd >= 0 && fsync(fd) == 0;
    if (fd >= 0) {
        close(fd);
    }
    return ok;
}

/* The stream as received: what was written and its digest. */
struct received {
    int fd;
    int64_t bytes;
    EVP_MD_CTX *md;
    const Cflue__V1__BackupChunk *last; /* the closing chunk (done), once seen */
};

/* check_closing compares the closing chunk with what arrived; prints and returns false on a
 * mismatch. */
static bool check_closing(const struct received *r, const char *file)
{
    unsigned char sha[32];
    unsigned int len = 0;
    EVP_DigestFinal_ex(r->md, sha, &len);
    if (!r->last) {
        fprintf(stderr,
                "cflue: the backup stream ended before storaged said it was whole (%lld "
                "bytes received); %s was not written\n",
                (long long)r->bytes, file);
        return false;
    }
    if (r->last->size_bytes != r->bytes || r->last->sha256.len != len ||
        CRYPTO_memcmp(r->last->sha256.data, sha, len) != 0) {
        fprintf(stderr,
                "cflue: the backup arrived damaged (%lld bytes received, storaged sent %lld, "
                "or their SHA-256 differ); %s was not written\n",
                (long long)r->bytes, (long long)r->last->size_bytes, file);
        return false;
    }
    return true;
}

int store_backup_run(struct rpc_channel *ch, const char *file)
{
    char partial[PATH_MAX];
    if (snprintf(partial, sizeof(partial), "%s.partial", file) >= (int)sizeof(partial)) {
        fprintf(stderr, "cflue: backup: the path %s is too long\n", file);
        return 2;
    }
    struct stat st;
    if (stat(file, &st) == 0) {
        fprintf(stderr, "cflue: backup: %s exists already; give a new file\n", file);
        return 2;
    }
    struct received r = {.fd = open(partial, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600)};
    if (r.fd < 0) {
        fprintf(stderr, "cflue: backup: cannot create %s: %s\n", partial, strerror(errno));
        return 1;
    }
    r.md = EVP_MD_CTX_new();
    if (!r.md || EVP_DigestInit_ex(r.md, EVP_sha256(), NULL) != 1) {
        fprintf(stderr, "cflue: backup: cannot start a SHA-256\n");
        EVP_MD_CTX_free(r.md);
        close(r.fd);
        unlink(partial);
        return 1;
    }
    Cflue__V1__BackupRequest req = CFLUE__V1__BACKUP_REQUEST__INIT;
    struct rpc_stream *s =
        rpc_stream_open(ch, "/cflue.v1.Store/Backup", &req.base, guard_timeout_ms(0));
    ProtobufCMessage *m;
    ProtobufCMessage *closing = NULL;
    bool io_ok = true;
    int write_errno = 0; /* why the write failed (0: a chunk came after the last one) */
    while (io_ok && rpc_stream_read(s, &cflue__v1__backup_chunk__descriptor, &m) == 1) {
        const Cflue__V1__BackupChunk *c = (const Cflue__V1__BackupChunk *)m;
        if (closing) { /* nothing may follow the closing chunk */
            io_ok = false;
        } else if (c->data.len) {
            io_ok = write_all(r.fd, c->data.data, c->data.len);
            write_errno = io_ok ? 0 : errno;
            EVP_DigestUpdate(r.md, c->data.data, c->data.len);
            r.bytes += (int64_t)c->data.len;
        }
        if (c->done && !closing) {
            closing = m;
            r.last = c;
        } else {
            protobuf_c_message_free_unpacked(m, NULL);
        }
    }
    if (!io_ok) {
        rpc_stream_cancel(s);
    }
    struct rpc_status rs;
    bool call_ok = rpc_stream_finish(s, &rs);
    int rc = 0;
    if (!io_ok) {
        fprintf(stderr, "cflue: backup: cannot write %s: %s\n", partial,
                write_errno ? strerror(write_errno) : "a chunk came after the last one");
        rc = 1;
    } else if (!call_ok) {
        rc = guard_fail(&rs);
    } else if (!check_closing(&r, file)) {
        rc = 1;
    } else if (fsync(r.fd) != 0 || link(partial, file) != 0 || !sync_dir(file)) {
        /* link, not rename: a FILE made meanwhile by someone else is not replaced */
        fprintf(stderr, "cflue: backup: cannot put the copy at %s: %s\n", file, strerror(errno));
        rc = 1;
    } else {
        printf("backup: %s (%lld bytes, schema version %s)\n", file, (long long)r.bytes,
               r.last->schema_version);
    }
    if (closing) {
        protobuf_c_message_free_unpacked(closing, NULL);
    }
    EVP_MD_CTX_free(r.md);
    close(r.fd);
    unlink(partial);
    return rc;
}
