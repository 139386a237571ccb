/* dirpage.c - bounded selection of a directory page (see dirpage.h for the method). */
#include "dirpage.h"

#include "mem.h"
#include "workspace.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GONE_EVERY 4096 /* entries between checks that the caller is still there */

static void swap(char **h, size_t i, size_t j)
{
    char *t = h[i];
    h[i] = h[j];
    h[j] = t;
}

/* The heap keeps its largest name at h[0], so a smaller name found later replaces it. */
static void sift_up(char **h, size_t i)
{
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (strcmp(h[parent], h[i]) >= 0) {
            break;
        }
        swap(h, parent, i);
        i = parent;
    }
}

static void sift_down(char **h, size_t n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && strcmp(h[l], h[m]) > 0) {
            m = l;
        }
        if (r < n && strcmp(h[r], h[m]) > 0) {
            m = r;
        }
        if (m == i) {
            return;
        }
        swap(h, i, m);
        i = m;
    }
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

enum cf_status dirpage_select(int dirfd, const char *after, size_t limit, bool (*gone)(void *),
                              void *gone_arg, struct dirpage *out, struct cf_error *err)
{
    memset(out, 0, sizeof(*out));
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* own offset */
    if (fd < 0) {
        /* (EACCES: a directory an unprivileged toold may not read, PERMISSION_DENIED) */
        return ws_errno_error(errno, "read", "the directory", err);
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        return ws_errno_error(e, "read", "the directory", err);
    }
    size_t keep = limit + 1, n = 0, seen = 0; /* one more than a page tells whether more exist */
    char **heap = mem_alloc(sizeof(char *) * keep);
    enum cf_status rc = CF_OK;
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) {
            if (errno) {
                rc = cf_error_set(err, CF_IO, "cannot read the directory: %s", strerror(errno));
            }
            break;
        }
        if (++seen % GONE_EVERY == 0 && gone && gone(gone_arg)) {
            rc = cf_error_set(err, CF_CANCELLED, "the caller went away");
            break;
        }
        const char *name = e->d_name;
        if (!strcmp(name, ".") || !strcmp(name, "..") || strcmp(name, after) <= 0) {
            continue;
        }
        if (n < keep) {
            heap[n] = mem_strdup(name);
            sift_up(heap, n++);
        } else if (strcmp(name, heap[0]) < 0) {
            free(heap[0]);
            heap[0] = mem_strdup(name);
            sift_down(heap, n, 0);
        }
    }
    closedir(d);
    if (rc != CF_OK) {
        for (size_t i = 0; i < n; i++) {
            free(heap[i]);
        }
        free(heap);
        return rc;
    }
    qsort(heap, n, sizeof(char *), cmp_name);
    if (n > limit) {
        free(heap[--n]);
        out->more = true;
    }
    out->names = heap;
    out->n = n;
    return CF_OK;
}

void dirpage_cleanup(struct dirpage *p)
{
    for (size_t i = 0; i < p->n; i++) {
        free(p->names[i]);
    }
    free(p->names);
    memset(p, 0, sizeof(*p));
}
