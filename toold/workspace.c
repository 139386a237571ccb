/* workspace.c - the sandbox registry and confined file access. */
#include "workspace.h"

#include "ids.h"
#include "locks.h"
#include "log.h"
#include "mem.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_SANDBOXES 4096

struct workspaces {
    char root[PATH_MAX];
    bool confine;
    const struct driver *driver;
    struct proc_limits limits;
    pthread_mutex_t mu;
    struct sandbox *items[MAX_SANDBOXES];
    int n;
};

/* open_by_components opens a normalized relative path one component at a time, refusing a
 * symbolic link anywhere along it (ELOOP). Used where openat2 is missing (kernels before 5.6,
 * valgrind): stricter than RESOLVE_BENEATH, which allows links that stay inside. */
static int open_by_components(int dirfd, const char *path, int flags, mode_t mode)
{
    char copy[WS_PATH_MAX];
    snprintf(copy, sizeof(copy), "%s", path);
    char *last = strrchr(copy, '/');
    int cur = dirfd;
    if (last) {
        *last = '\0';
        char *save = NULL;
        for (char *seg = strtok_r(copy, "/", &save); seg; seg = strtok_r(NULL, "/", &save)) {
            int next = openat(cur, seg, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            int e = errno;
            if (cur != dirfd) {
                close(cur);
            }
            if (next < 0) {
                errno = e == ENOTDIR ? ELOOP : e;
                return -1;
            }
            cur = next;
        }
    }
    const char *name = last ? last + 1 : copy;
    int fd = openat(cur, name, flags | O_NOFOLLOW | O_CLOEXEC, mode);
    int e = errno;
    if (cur != dirfd) {
        close(cur);
    }
    errno = e;
    return fd;
}

static int openat2_missing; /* set once openat2 answered ENOSYS */

static int open_beneath(int dirfd, const char *path, int flags, mode_t mode)
{
    if (!__atomic_load_n(&openat2_missing, __ATOMIC_RELAXED)) {
        struct open_how how = {.flags = (uint64_t)flags | O_CLOEXEC,
                               .mode = (flags & O_CREAT) ? mode : 0,
                               .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
        int fd = (int)syscall(SYS_openat2, dirfd, path, &how, sizeof(how));
        if (fd >= 0 || errno != ENOSYS) {
            return fd;
        }
        __atomic_store_n(&openat2_missing, 1, __ATOMIC_RELAXED);
    }
    return open_by_components(dirfd, path, flags, mode);
}

enum cf_status ws_errno_error(int e, const char *op, const char *shown_path, struct cf_error *err)
{
    switch (e) {
    case ENOENT:
        return cf_error_set(err, CF_NOT_FOUND, "%s: no such file or directory", shown_path);
    case EXDEV:
    case ELOOP:
        return cf_error_setr(err, CF_INVALID, "PATH_OUTSIDE_SANDBOX",
                             "%s leads outside the sandbox (through '..' or a symbolic link); "
                             "only paths inside the workspace can be used",
                             shown_path);
    case EISDIR:
        return cf_error_setr(err, CF_INVALID, "IS_A_DIRECTORY", "%s is a directory, not a file",
                             shown_path);
    case ENOTDIR:
        return cf_error_setr(err, CF_INVALID, "NOT_A_DIRECTORY",
                             "%s: the path or a component of it is not a directory", shown_path);
    case EACCES:
    case EPERM:
        return cf_error_setr(err, CF_INVALID, "PERMISSION_DENIED", "%s: permission denied",
                             shown_path);
    case EEXIST:
        return cf_error_set(err, CF_EXISTS, "%s already exists", shown_path);
    case ENOTEMPTY:
        return cf_error_setr(err, CF_PRECONDITION, "DIRECTORY_NOT_EMPTY",
                             "%s is a directory that is not empty", shown_path);
    case ENOSPC:
    case EDQUOT:
        return cf_error_setr(err, CF_IO, "NO_SPACE_LEFT", "%s: no space left on the device",
                             shown_path);
    case ENAMETOOLONG:
        return cf_error_set(err, CF_INVALID, "%s: the path is too long", shown_path);
    default:
        return cf_error_set(err, CF_IO, "%s failed on %s: %s", op, shown_path, strerror(e));
    }
}

enum cf_status ws_relative(const struct sandbox *sb, const char *path, char *out, size_t out_len,
                           struct cf_error *err)
{
    return ws_relative_from(sb, NULL, path, out, out_len, err);
}

enum cf_status ws_relative_from(const struct sandbox *sb, const char *base, const char *path,
                                char *out, size_t out_len, struct cf_error *err)
{
    char tmp[WS_PATH_MAX], joined[WS_PATH_MAX];
    const char *p = path;
    size_t root_len = strlen(sb->root);

    if (!*path) {
        return cf_error_set(err, CF_INVALID, "the path is empty");
    }
    if (strlen(path) >= sizeof(tmp)) {
        return cf_error_set(err, CF_INVALID, "the path is longer than %d bytes", WS_PATH_MAX - 1);
    }
    if (path[0] == '/') {
        if (!strncmp(path, sb->root, root_len) && (path[root_len] == '/' || !path[root_len])) {
            p = path + root_len;
        } else if (sb->confine) {
            return cf_error_setr(err, CF_INVALID, "PATH_OUTSIDE_SANDBOX",
                                 "%s is outside the sandbox; use a path inside %s or relative "
                                 "to it",
                                 path, sb->root);
        } else {
            p = path; /* unconfined: absolute host paths pass */
        }
    }
    if (path[0] != '/' && base && *base && strcmp(base, ".")) {
        /* relative to the call's working directory, itself relative to the root */
        if ((size_t)snprintf(joined, sizeof(joined), "%s/%s", base, path) >= sizeof(joined)) {
            return cf_error_set(err, CF_INVALID, "the path is longer than %d bytes",
                                WS_PATH_MAX - 1);
        }
        p = joined;
    }
    /* normalize: drop empty and "." segments, pop on ".." */
    size_t o = 0;
    strcpy(tmp, p);
    char *save = NULL;
    out[0] = '\0';
    for (char *seg = strtok_r(tmp, "/", &save); seg; seg = strtok_r(NULL, "/", &save)) {
        if (!strcmp(seg, ".")) {
            continue;
        }
        if (!strcmp(seg, "..")) {
            if (o == 0) {
                return cf_error_setr(err, CF_INVALID, "PATH_OUTSIDE_SANDBOX",
                                     "%s leads outside the sandbox through '..'; only paths "
                                     "inside the workspace can be used",
                                     path);
            }
            while (o > 0 && out[o - 1] != '/') {
                o--;
            }
            if (o > 0) {
                o--;
            }
            out[o] = '\0';
            continue;
        }
        size_t n = strlen(seg);
        if (o + n + 2 > out_len) {
            return cf_error_set(err, CF_INVALID, "the path is too long");
        }
        if (o) {
            out[o++] = '/';
        }
        memcpy(out + o, seg, n);
        o += n;
        out[o] = '\0';
    }
    if (!sb->confine && path[0] == '/' && p == path) {
        /* unconfined absolute path outside the root: keep it absolute */
        if (o + 2 > out_len) {
            return cf_error_set(err, CF_INVALID, "the path is too long");
        }
        memmove(out + 1, out, o + 1);
        out[0] = '/';
        return CF_OK;
    }
    if (o == 0) {
        snprintf(out, out_len, ".");
    }
    return CF_OK;
}

void ws_shown_path(const char *base, const char *rel, char *out, size_t out_len)
{
    if (!base || !*base || !strcmp(base, ".") || rel[0] == '/') {
        snprintf(out, out_len, "%s", rel);
        return;
    }
    const char *b = base, *r = strcmp(rel, ".") ? rel : "";
    while (*b) { /* skip the leading segments both share */
        size_t n = strcspn(b, "/");
        if (strncmp(b, r, n) != 0 || (r[n] != '/' && r[n] != '\0')) {
            break;
        }
        b += n + (b[n] == '/');
        r += n + (r[n] == '/');
    }
    size_t o = 0;
    out[0] = '\0';
    while (*b && o + 4 < out_len) { /* one ".." for each segment of base left */
        memcpy(out + o, "../", 4);
        o += 3;
        b += strcspn(b, "/");
        b += *b == '/';
    }
    snprintf(out + o, out_len - o, "%s", r);
    size_t len = strlen(out);
    if (len > 1 && out[len - 1] == '/') {
        out[len - 1] = '\0'; /* "../.." rather than "../../" */
    } else if (!len) {
        snprintf(out, out_len, ".");
    }
}

void ws_host_path(const struct sandbox *sb, const char *rel, char *out, size_t out_len)
{
    if (rel[0] == '/') {
        snprintf(out, out_len, "%s", rel);
    } else if (!strcmp(rel, ".")) {
        snprintf(out, out_len, "%s", sb->root);
    } else {
        snprintf(out, out_len, "%s/%s", sb->root, rel);
    }
}

enum cf_status ws_open(const struct sandbox *sb, const char *rel, int flags, mode_t mode,
                       const char *shown_path, int *fd_out, struct cf_error *err)
{
    int fd;
    if (rel[0] == '/') { /* only when unconfined */
        fd = open(rel, flags | O_CLOEXEC, mode);
    } else if (sb->confine) {
        fd = open_beneath(sb->root_fd, rel, flags, mode);
    } else {
        fd = openat(sb->root_fd, rel, flags | O_CLOEXEC, mode);
    }
    if (fd < 0) {
        return ws_errno_error(errno, "open", shown_path, err);
    }
    *fd_out = fd;
    return CF_OK;
}

/* finish_regular checks the O_PATH descriptor pfd (closed here) and reopens it for reading. */
static enum cf_status finish_regular(int pfd, const char *shown_path, int *fd_out, struct stat *st,
                                     struct cf_error *err)
{
    char proc[64];
    if (fstat(pfd, st) != 0) {
        int e = errno;
        close(pfd);
        return ws_errno_error(e, "stat", shown_path, err);
    }
    if (S_ISDIR(st->st_mode)) {
        close(pfd);
        return cf_error_setr(err, CF_INVALID, "IS_A_DIRECTORY", "%s is a directory, not a file",
                             shown_path);
    }
    if (!S_ISREG(st->st_mode)) {
        close(pfd);
        return cf_error_setr(err, CF_INVALID, "NOT_A_REGULAR_FILE",
                             "%s is not a regular file (it is a %s); only regular files can be "
                             "read",
                             shown_path,
                             S_ISFIFO(st->st_mode)   ? "FIFO"
                             : S_ISSOCK(st->st_mode) ? "socket"
                             : S_ISLNK(st->st_mode)  ? "symbolic link"
                                                     : "device");
    }
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", pfd);
    int fd = open(proc, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    int e = errno;
    close(pfd);
    if (fd < 0) {
        return ws_errno_error(e, "open", shown_path, err);
    }
    struct stat again;
    if (fstat(fd, &again) != 0 || again.st_dev != st->st_dev || again.st_ino != st->st_ino) {
        close(fd);
        return cf_error_set(err, CF_IO, "%s changed while it was being opened; try again",
                            shown_path);
    }
    *st = again;
    *fd_out = fd;
    return CF_OK;
}

enum cf_status ws_open_regular(const struct sandbox *sb, const char *rel, const char *shown_path,
                               int *fd_out, struct stat *st_out, struct cf_error *err)
{
    int pfd;
    memset(st_out, 0, sizeof(*st_out));
    enum cf_status rc = ws_open(sb, rel, O_PATH, 0, shown_path, &pfd, err);
    if (rc != CF_OK) {
        return rc;
    }
    return finish_regular(pfd, shown_path, fd_out, st_out, err);
}

enum cf_status ws_open_regular_at(int dirfd, const char *name, const char *shown_path, int *fd_out,
                                  struct stat *st_out, struct cf_error *err)
{
    memset(st_out, 0, sizeof(*st_out));
    int pfd = *name ? openat(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC)
                    : fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
    if (pfd < 0) {
        return ws_errno_error(errno, "open", shown_path, err);
    }
    return finish_regular(pfd, shown_path, fd_out, st_out, err);
}

enum cf_status ws_open_parent(const struct sandbox *sb, const char *rel, bool create_parents,
                              const char *shown_path, int *dirfd_out, char *base_out,
                              size_t base_len, struct cf_error *err)
{
    char dir[WS_PATH_MAX];
    enum cf_status rc;
    const char *slash = strrchr(rel, '/');
    if (!strcmp(rel, ".")) {
        return cf_error_set(err, CF_INVALID, "%s is the workspace directory itself", shown_path);
    }
    if (slash) {
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - rel), rel);
        snprintf(base_out, base_len, "%s", slash + 1);
        if (!*dir) {
            snprintf(dir, sizeof(dir), "/");
        }
    } else {
        snprintf(dir, sizeof(dir), ".");
        snprintf(base_out, base_len, "%s", rel);
    }
    rc = ws_open(sb, dir, O_PATH | O_DIRECTORY, 0, shown_path, dirfd_out, err);
    if (rc != CF_NOT_FOUND || !create_parents) {
        return rc;
    }
    /* create each missing directory, one component at a time, each confined */
    char partial[WS_PATH_MAX] = "";
    char copy[WS_PATH_MAX];
    char *save = NULL;
    snprintf(copy, sizeof(copy), "%s", dir);
    for (char *seg = strtok_r(copy, "/", &save); seg; seg = strtok_r(NULL, "/", &save)) {
        int pfd;
        size_t n = strlen(partial);
        if (n) {
            snprintf(partial + n, sizeof(partial) - n, "/%s", seg);
        } else {
            snprintf(partial, sizeof(partial), "%s%s", rel[0] == '/' ? "/" : "", seg);
        }
        char parent[WS_PATH_MAX], base[NAME_MAX + 1];
        const char *ps = strrchr(partial, '/');
        snprintf(parent, sizeof(parent), "%.*s", ps ? (int)(ps - partial) : 1, ps ? partial : ".");
        if (ps && ps == partial) {
            snprintf(parent, sizeof(parent), "/");
        }
        int base_n = snprintf(base, sizeof(base), "%s", ps ? ps + 1 : partial);
        if (base_n < 0 || (size_t)base_n >= sizeof(base)) {
            return ws_errno_error(ENAMETOOLONG, "mkdir", shown_path, err);
        }
        if ((rc = ws_open(sb, parent, O_PATH | O_DIRECTORY, 0, shown_path, &pfd, err)) != CF_OK) {
            return rc;
        }
        if (mkdirat(pfd, base, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            close(pfd);
            return ws_errno_error(e, "mkdir", shown_path, err);
        }
        close(pfd);
    }
    return ws_open(sb, dir, O_PATH | O_DIRECTORY, 0, shown_path, dirfd_out, err);
}

/* resolve_link turns rel, a symbolic link, into the path (relative to the root) of the file
 * it leads to; an error when that is outside the sandbox or missing. */
static enum cf_status resolve_link(const struct sandbox *sb, const char *rel,
                                   const char *shown_path, char *out, size_t out_len,
                                   struct cf_error *err)
{
    int fd;
    char proc[64], real[PATH_MAX];
    enum cf_status rc = ws_open(sb, rel, O_PATH, 0, shown_path, &fd, err);
    if (rc != CF_OK) {
        return rc;
    }
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(proc, real, sizeof(real) - 1);
    close(fd);
    size_t root_len = strlen(sb->root);
    if (n <= 0 || (size_t)n <= root_len + 1 || strncmp(real, sb->root, root_len) != 0 ||
        real[root_len] != '/') {
        return cf_error_setr(err, CF_INVALID, "PATH_OUTSIDE_SANDBOX",
                             "%s is a symbolic link that leads outside the sandbox", shown_path);
    }
    real[n] = '\0';
    snprintf(out, out_len, "%s", real + root_len + 1);
    return CF_OK;
}

enum cf_status ws_write_file(const struct sandbox *sb, const char *rel, const void *data,
                             size_t len, mode_t mode, const char *shown_path, struct cf_error *err)
{
    int dirfd, fd = -1;
    char base[NAME_MAX + 1], tmp[NAME_MAX + 1], target[WS_PATH_MAX];
    enum cf_status rc;
    struct stat st;

    for (int hops = 0;; hops++) {
        if ((rc = ws_open_parent(sb, rel, true, shown_path, &dirfd, base, sizeof(base), err)) !=
            CF_OK) {
            return rc;
        }
        if (!sb->confine || fstatat(dirfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISLNK(st.st_mode)) {
            break;
        }
        /* writing through a link replaces the file it leads to, never the link itself */
        close(dirfd);
        if (hops == 8) {
            return cf_error_set(err, CF_INVALID, "%s: too many levels of symbolic links",
                                shown_path);
        }
        if ((rc = resolve_link(sb, rel, shown_path, target, sizeof(target), err)) != CF_OK) {
            return rc;
        }
        rel = target;
    }
    if (fstatat(dirfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(st.st_mode)) {
            close(dirfd);
            return cf_error_setr(err, CF_INVALID, "IS_A_DIRECTORY", "%s is a directory, not a file",
                                 shown_path);
        }
        if (S_ISREG(st.st_mode)) {
            mode = st.st_mode & 0777; /* a set-user-ID bit a command set does not survive */
        }
    }
    if (!mode) {
        mode = 0644;
    }
    for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
        unsigned r = 0;
        if (getrandom(&r, sizeof(r), 0) < 0) {
            r = (unsigned)attempt;
        }
        snprintf(tmp, sizeof(tmp), ".%.200s.cflue-%08x.tmp", base, r);
        fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
        if (fd < 0 && errno != EEXIST) {
            break;
        }
    }
    if (fd < 0) {
        int e = errno;
        close(dirfd);
        return ws_errno_error(e, "create", shown_path, err);
    }
    fchmod(fd, mode); /* umask must not narrow an existing file's mode */
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            int e = errno;
            close(fd);
            unlinkat(dirfd, tmp, 0);
            close(dirfd);
            return ws_errno_error(e, "write", shown_path, err);
        }
        p += w;
        left -= (size_t)w;
    }
    /* closed whether the sync worked or not: an open descriptor of the unlinked copy would
     * hold its blocks (a full disk stays full) until toold exits */
    int synced = fsync(fd) == 0 ? 0 : errno;
    int closed = close(fd) == 0 ? 0 : errno;
    if (synced || closed) {
        unlinkat(dirfd, tmp, 0);
        close(dirfd);
        return ws_errno_error(synced ? synced : closed, "write", shown_path, err);
    }
    if (renameat(dirfd, tmp, dirfd, base) != 0) {
        int e = errno;
        unlinkat(dirfd, tmp, 0);
        close(dirfd);
        return ws_errno_error(e, "rename", shown_path, err);
    }
    close(dirfd);
    return CF_OK;
}

/* warn_if_shared logs a workspace root other users can reach: one toold was given (it creates
 * its own 0700, and changes no mode of a directory it is given) whose mode lets others pass, or
 * that another user owns. A command may leave a set-user-ID program of its user in its
 * workspace (a chmod of its own file), which anyone who can reach it could run as that user: a
 * warning for a root toold, whose commands' files are root's; information for an unprivileged
 * one (a pod's volume, which no other user reaches). */
static void warn_if_shared(const char *root)
{
    struct stat st;
    if (stat(root, &st) != 0 || (!(st.st_mode & 011) && st.st_uid == geteuid())) {
        return; /* none but toold's user may pass through it */
    }
    log_write(
        geteuid() == 0 ? LOG_WARN : LOG_INFO, "root_not_private",
        "root=%s mode=%04o owner=%u note=\"other users can reach the workspaces: a set-user-ID "
        "program a command leaves there runs as toold's user for them; give toold a root of its "
        "own (mode 0700)\"",
        root, st.st_mode & 07777, (unsigned)st.st_uid);
}

enum cf_status workspaces_new(const char *root, bool confine, const struct driver *driver,
                              struct workspaces **out, struct cf_error *err)
{
    struct workspaces *w = mem_alloc(sizeof(*w));
    bool made = mkdir(root, 0700) == 0;
    if (!made && errno != EEXIST) {
        free(w);
        return cf_error_set(err, CF_IO, "cannot create the workspace root %s: %s", root,
                            strerror(errno));
    }
    if (!realpath(root, w->root)) {
        free(w);
        return cf_error_set(err, CF_IO, "cannot resolve the workspace root %s: %s", root,
                            strerror(errno));
    }
    if (!made) {
        warn_if_shared(w->root);
    }
    w->confine = confine;
    w->driver = driver;
    pthread_mutex_init(&w->mu, NULL);
    *out = w;
    return CF_OK;
}

void workspaces_set_limits(struct workspaces *w, const struct proc_limits *l)
{
    w->limits = (struct proc_limits){.cpu_ms = l->cpu_ms,
                                     .memory_bytes = l->memory_bytes,
                                     .procs = l->procs,
                                     .file_bytes = l->file_bytes,
                                     .disk_bytes = l->disk_bytes};
}

void workspaces_free(struct workspaces *w)
{
    if (!w) {
        return;
    }
    for (int i = 0; i < w->n; i++) {
        close(w->items[i]->root_fd);
        locks_free(w->items[i]->locks);
        pthread_mutex_destroy(&w->items[i]->mu);
        free(w->items[i]);
    }
    pthread_mutex_destroy(&w->mu);
    free(w);
}

/* make_dirs creates path and its missing parents (mode 0700: see warn_if_shared). */
static int make_dirs(const char *path)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, 0700) != 0 && errno != EEXIST) {
                return -1;
            }
            *p = '/';
        }
    }
    return mkdir(tmp, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* revive checks that the sandbox's directory is still the one root_fd holds; when a command
 * removed it (or toold's whole root), it is created again and reopened onto the same
 * descriptor number with dup3, so calls running meanwhile never see a closed or reused
 * descriptor (at worst the removed directory, and an error from it). */
static enum cf_status revive(struct sandbox *sb, struct cf_error *err)
{
    struct stat held, now;
    if (fstat(sb->root_fd, &held) == 0 && held.st_nlink > 0 && lstat(sb->root, &now) == 0 &&
        now.st_dev == held.st_dev && now.st_ino == held.st_ino) {
        return CF_OK;
    }
    enum cf_status rc = CF_OK;
    pthread_mutex_lock(&sb->mu);
    if (fstat(sb->root_fd, &held) == 0 && held.st_nlink > 0 && lstat(sb->root, &now) == 0 &&
        now.st_dev == held.st_dev && now.st_ino == held.st_ino) {
        goto done; /* another call revived it */
    }
    if (make_dirs(sb->root) != 0) {
        rc = cf_error_set(err, CF_IO, "workspace %s was removed and cannot be created again: %s",
                          sb->root, strerror(errno));
        goto done;
    }
    int fd = open(sb->root, O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        rc = cf_error_set(err, CF_IO,
                          "workspace %s was replaced by something that is not a directory: %s",
                          sb->root, strerror(errno));
        goto done;
    }
    if (dup3(fd, sb->root_fd, O_CLOEXEC) < 0) {
        rc = cf_error_set(err, CF_IO, "cannot reopen workspace %s: %s", sb->root, strerror(errno));
    } else {
        log_warn("sandbox_recreated", "sandbox=%s root=%s", sb->name, sb->root);
    }
    close(fd);
done:
    pthread_mutex_unlock(&sb->mu);
    return rc;
}

enum cf_status workspaces_get(struct workspaces *w, const char *name, struct sandbox **out,
                              struct cf_error *err)
{
    if (!ids_valid_name(name, 128)) {
        return cf_error_setr(err, CF_INVALID, "INVALID_SANDBOX_NAME",
                             "sandbox names are 1 to 128 characters of A-Z a-z 0-9 . _ - (not . "
                             "or ..)");
    }
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n; i++) {
        if (!strcmp(w->items[i]->name, name)) {
            struct sandbox *sb = w->items[i];
            pthread_mutex_unlock(&w->mu);
            enum cf_status rc = revive(sb, err);
            if (rc == CF_OK) {
                *out = sb;
            }
            return rc;
        }
    }
    enum cf_status rc = CF_OK;
    if (w->n == MAX_SANDBOXES) {
        rc = cf_error_setr(err, CF_BUSY, "TOO_MANY_SANDBOXES",
                           "this toold serves at most %d sandboxes", MAX_SANDBOXES);
        goto done;
    }
    char path[PATH_MAX];
    if (strlen(w->root) + strlen(name) + 2 > sizeof(path)) {
        rc = cf_error_set(err, CF_INVALID, "the workspace path would be too long");
        goto done;
    }
    memcpy(path, w->root, strlen(w->root));
    path[strlen(w->root)] = '/';
    strcpy(path + strlen(w->root) + 1, name);
    if (make_dirs(path) != 0) {
        rc = cf_error_set(err, CF_IO, "cannot create workspace %s: %s", path, strerror(errno));
        goto done;
    }
    int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        rc = cf_error_set(err, CF_IO, "cannot open workspace %s: %s", path, strerror(errno));
        goto done;
    }
    struct sandbox *sb = mem_alloc(sizeof(*sb));
    snprintf(sb->name, sizeof(sb->name), "%s", name);
    memcpy(sb->root, path, sizeof(sb->root));
    sb->root_fd = fd;
    sb->confine = w->confine;
    sb->driver = w->driver;
    sb->limits = w->limits;
    sb->disk_size = -1;
    sb->locks = locks_new();
    pthread_mutex_init(&sb->mu, NULL);
    w->items[w->n++] = sb;
    log_info("sandbox_created", "sandbox=%s root=%s", name, path);
    *out = sb;
done:
    pthread_mutex_unlock(&w->mu);
    return rc;
}
