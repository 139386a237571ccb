/* workspace.h - sandboxes: named workspaces under toold's root, and confined file access.
 *
 * A sandbox name (1..128 of [A-Za-z0-9._-], not "." or "..") maps to the directory
 * ROOT/NAME, created on first use. Every path a caller gives is resolved against that
 * directory: relative paths join it, absolute paths must lie inside it. With confinement on
 * (the default) every file operation opens its path with openat2(RESOLVE_BENEATH) from the
 * workspace's directory descriptor, so neither "..", nor an absolute path, nor a symbolic link
 * anywhere along the path can reach outside; such an attempt is an error, never a read or a
 * write outside.
 */
#ifndef CFLUE_TOOLD_WORKSPACE_H
#define CFLUE_TOOLD_WORKSPACE_H

#include "proc.h"
#include "status.h"

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

struct driver;
struct lock_table;

struct sandbox {
    char name[129];
    char root[PATH_MAX]; /* absolute, symlink-free path of the workspace directory */
    int root_fd;         /* O_PATH descriptor of root; the number never changes (see
                          * workspaces_get: a removed workspace is reopened onto it) */
    bool confine;
    const struct driver *driver;
    struct lock_table *locks; /* per-path write/edit locks */
    pthread_mutex_t mu;
    int rg_state;              /* 0 unknown, 1 present, -1 absent: probed once */
    struct proc_limits limits; /* what each of its commands may use (driver_run adds the rest) */
    int64_t disk_size;         /* the workspace's size as its last command left it (-1: not
                                * measured); under mu */
};

struct workspaces;

/* workspaces_new prepares the registry over root (created if missing). CF_IO when root cannot
 * be created or opened. */
CF_MUST_CHECK enum cf_status workspaces_new(const char *root, bool confine,
                                            const struct driver *driver, struct workspaces **out,
                                            struct cf_error *err);

/* workspaces_set_limits sets the limits every sandbox created from now on gives its commands
 * (only the bounds of l are taken: cpu_ms, memory_bytes, procs, file_bytes, disk_bytes). Call
 * before serving. */
void workspaces_set_limits(struct workspaces *w, const struct proc_limits *l);

/* workspaces_free closes every sandbox (NULL is fine). */
void workspaces_free(struct workspaces *w);

/* workspaces_get returns the sandbox for name, creating its directory on first use. The
 * sandbox lives as long as the registry. CF_INVALID (reason INVALID_SANDBOX_NAME) for a bad name;
 * CF_BUSY (TOO_MANY_SANDBOXES) past the limit. A workspace whose
 * directory a command removed (`rm -rf "$PWD"`, or toold's whole root) is created again and
 * reopened here, so the next call finds an empty workspace instead of a dead one. */
CF_MUST_CHECK enum cf_status workspaces_get(struct workspaces *w, const char *name,
                                            struct sandbox **out, struct cf_error *err);

#define WS_PATH_MAX 4096

/* ws_relative turns a caller's path into a normalized path relative to the sandbox root
 * ("." for the root itself). CF_INVALID for an empty path, and (reason PATH_OUTSIDE_SANDBOX)
 * for a path outside the sandbox when confined. */
CF_MUST_CHECK enum cf_status ws_relative(const struct sandbox *sb, const char *path, char *out,
                                         size_t out_len, struct cf_error *err);

/* ws_relative_from is ws_relative with relative paths taken from base, a directory relative to
 * the root as ws_relative writes it (NULL, "" or ".": the root itself); ".." may climb above
 * base but never above the root. */
CF_MUST_CHECK enum cf_status ws_relative_from(const struct sandbox *sb, const char *base,
                                              const char *path, char *out, size_t out_len,
                                              struct cf_error *err);

/* ws_shown_path writes rel (relative to the root) as a path relative to base (NULL or ".":
 * the root): "a/b" from base "a" is "b", from "c" it is "../a/b"; an absolute rel stays. */
void ws_shown_path(const char *base, const char *rel, char *out, size_t out_len);

/* ws_host_path writes the absolute host path of a relative path into out. */
void ws_host_path(const struct sandbox *sb, const char *rel, char *out, size_t out_len);

/* ws_open opens rel (from ws_relative) with open(2) flags, confined beneath the root. The
 * error message names shown_path, the path as the caller wrote it. */
CF_MUST_CHECK enum cf_status ws_open(const struct sandbox *sb, const char *rel, int flags,
                                     mode_t mode, const char *shown_path, int *fd_out,
                                     struct cf_error *err);

/* ws_open_regular opens rel for reading when it is a regular file, without side effects on
 * anything else: the path is opened with O_PATH (confined like ws_open), checked with fstat,
 * and only then reopened for reading (through /proc/self/fd), so a FIFO, socket or device is
 * never opened for I/O and cannot block the caller. *st_out holds the file's status whenever
 * it could be taken (also on CF_INVALID, so callers can word a directory error their way).
 * CF_INVALID naming shown_path for a directory (IS_A_DIRECTORY) or a special file
 * (NOT_A_REGULAR_FILE). */
CF_MUST_CHECK enum cf_status ws_open_regular(const struct sandbox *sb, const char *rel,
                                             const char *shown_path, int *fd_out,
                                             struct stat *st_out, struct cf_error *err);

/* ws_open_regular_at is ws_open_regular for name in the directory dirfd, never following a
 * symbolic link (for walks). With name "", dirfd is itself an O_PATH descriptor of the file
 * (already confined; not closed here), and that file is checked and reopened. */
CF_MUST_CHECK enum cf_status ws_open_regular_at(int dirfd, const char *name, const char *shown_path,
                                                int *fd_out, struct stat *st_out,
                                                struct cf_error *err);

/* ws_open_parent opens the directory containing rel (creating missing directories when
 * create_parents) and stores the final component in base_out. */
CF_MUST_CHECK enum cf_status ws_open_parent(const struct sandbox *sb, const char *rel,
                                            bool create_parents, const char *shown_path,
                                            int *dirfd_out, char *base_out, size_t base_len,
                                            struct cf_error *err);

/* ws_write_file replaces rel atomically with data (a temporary file in the same directory,
 * then rename), creating missing parent directories; keeps the mode of an existing file, or
 * uses mode (0: 0644) for a new one. */
CF_MUST_CHECK enum cf_status ws_write_file(const struct sandbox *sb, const char *rel,
                                           const void *data, size_t len, mode_t mode,
                                           const char *shown_path, struct cf_error *err);

/* ws_errno_error turns an errno from an operation on shown_path into a status, a message and
 * an ErrorInfo reason a client can branch on: PATH_OUTSIDE_SANDBOX (EXDEV, ELOOP),
 * IS_A_DIRECTORY, NOT_A_DIRECTORY, PERMISSION_DENIED, DIRECTORY_NOT_EMPTY (CF_PRECONDITION),
 * NO_SPACE_LEFT; NOT_FOUND and ALREADY_EXISTS are the codes' own. */
CF_MUST_CHECK enum cf_status ws_errno_error(int e, const char *op, const char *shown_path,
                                            struct cf_error *err);

#endif
