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

enum cf_status file_read_regular(const char *path, size_t max, bool nofollow, char **data,
                                 size_t *len, struct cf_error *err)
{
    *data = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | (nofollow ? O_NOFOLLOW : 0));
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
            free(buf);
            return fail_errno(e, path, err);
        }
        got += (size_t)r;
        if (r == 0 || got > max) {
            break;
        }
        if (got == cap) {
            cap = cap * 2 < max + 1 ? cap * 2 : max + 1;
            buf = mem_realloc(buf, cap + 1);
        }
    }
    close(fd);
    if (got > max) {
        free(buf);
        return cf_error_set(err, CF_TOOBIG, "%s: larger than %zu bytes", path, max);
    }
    buf[got] = '\0';
    *data = buf;
    *len = got;
    return CF_OK;
}
