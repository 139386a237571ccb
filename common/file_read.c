/* file_read.c - a configuration file read whole, within a bound (see file_read.h). */
#include "file_read.h"

#include "mem.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static enum cf_status fail_errno(int e, const char *path, struct cf_error *err)
{
    if (e == ELOOP) {
        return cf_error_set(err, CF_INVALID, "%s: is a symbolic link", path);
    }
    return cf_error_set(err, e == ENOENT ? CF_NOT_FOUND : CF_INVALID, "%s: cannot read: %s", path,
                        strerror(e));
}

/* drop frees buf (n bytes used), wiping them first when they are secret. */
static void drop(char *buf, size_t n, bool secret)
{
    if (secret) {
        explicit_bzero(buf, n);
    }
    free(buf);
}

/* grow returns buf (n bytes used) moved to a buffer of cap bytes. A secret one is copied and
 * wiped, never left behind by realloc. */
static char *grow(char *buf, size_t n, size_t cap, bool secret)
{
    if (!secret) {
        return mem_realloc(buf, cap);
    }
    char *to = mem_alloc(cap);
    memcpy(to, buf, n);
    drop(buf, n, true);
    return to;
}

enum cf_status file_read_regular(const char *path, size_t max, unsigned flags, char **data,
                                 size_t *len, struct cf_error *err)
{
    bool secret = flags & FILE_READ_SECRET;
    *data = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC |
                            (flags & FILE_READ_NOFOLLOW ? O_NOFOLLOW : 0));
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
        }
        return fail_errno(e, path, err);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return cf_error_set(err, CF_INVALID, "%s: not a regular file", path);
    }
    if ((unsigned long long)st.st_size > max) {
        close(fd);
        return cf_error_set(err, CF_TOOBIG, "%s: larger than %zu bytes", path, max);
    }
    size_t cap = (size_t)st.st_size + 1, got = 0; /* one more: a file grown since is seen */
    char *buf = mem_alloc(cap + 1);
    for (;;) {
        ssize_t r = read(fd, buf + got, cap - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            int e = errno;
            close(fd);
            drop(buf, got, secret);
            return fail_errno(e, path, err);
        }
        got += (size_t)r;
        if (r == 0 || got > max) {
            break;
        }
        if (got == cap) {
            cap = cap * 2 < max + 1 ? cap * 2 : max + 1;
            buf = grow(buf, got, cap + 1, secret);
        }
    }
    close(fd);
    if (got > max) {
        drop(buf, got, secret);
        return cf_error_set(err, CF_TOOBIG, "%s: larger than %zu bytes", path, max);
    }
    buf[got] = '\0';
    *data = buf;
    *len = got;
    return CF_OK;
}
