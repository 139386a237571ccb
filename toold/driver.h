/* driver.h - how a sandbox runs commands.
 *
 * Files of every driver live in the workspace directory on toold's host and are reached
 * through workspace.c. Drivers differ in how a command runs:
 * - local: `bash -c` directly on the host, in its own process group, working directory inside
 *   the workspace.
 * - bwrap: `bash -c` inside bubblewrap: the workspace bound read-write at its own path, the
 *   rest of the system read-only, no network, a private PID namespace, dying with toold.
 */
#ifndef CFLUE_TOOLD_DRIVER_H
#define CFLUE_TOOLD_DRIVER_H

#include "proc.h"
#include "workspace.h"

struct driver {
    const char *name;
    /* build_argv fills argv (at most PROC_ARGV_MAX entries, NULL-terminated) to run command
     * with working directory cwd (a host path inside sb). Pointers may refer to the
     * arguments or to static strings. */
    void (*build_argv)(const struct sandbox *sb, const char *cwd, const char *command,
                       const char **argv);
};

/* driver_find returns the driver named name ("local", "bwrap"), or NULL. */
const struct driver *driver_find(const char *name);

/* driver_available checks that the driver can run commands on this machine (bwrap present and
 * allowed to create namespaces); CF_UNAVAILABLE with the reason otherwise. */
CF_MUST_CHECK enum cf_status driver_available(const struct driver *d, const char *root,
                                              struct cf_error *err);

#endif
