/* driver.h - how a sandbox runs commands.
 *
 * Files of every driver live in the workspace directory on toold's host and are reached
 * through workspace.c. Drivers differ in how a command runs:
 * - local: `bash -c` directly on the host, in its own process group, working directory inside
 *   the workspace. No isolation beyond the process group: for a toold that is itself inside a
 *   sandbox (a gVisor or Kata pod, a VM).
 * - bwrap: `bash -c` inside bubblewrap, holding as root and as any other user: a new user
 *   namespace with every capability dropped and no further user namespaces, every other
 *   namespace new (network, IPC, PID, UTS, cgroup), a new session, dying with toold; a
 *   filesystem built from an allow list (the system directories a shell needs, read-only, a
 *   few files of /etc, a private /tmp and /dev, the workspace read-write at its own path, and
 *   nothing else: no /home, /root, /run, /var, no other workspace, no socket of the host); the
 *   command's environment set inside only; and a seccomp filter refusing mount, ptrace,
 *   keyctl, bpf, new namespaces and the like (EPERM).
 */
#ifndef CFLUE_TOOLD_DRIVER_H
#define CFLUE_TOOLD_DRIVER_H

#include "proc.h"
#include "workspace.h"

#define DRIVER_ENV_MAX 64 /* variables a caller may add to a command's environment */

/* A command as a driver runs it: argv and environment for proc_run, and the descriptor the
 * command inherits as fd 4 (bwrap's seccomp program). */
struct driver_cmd {
    const char *argv[PROC_ARGV_MAX];
    char **envp;       /* the environment of the process started (for bwrap: bwrap's own) */
    int extra_fd;      /* 0: none */
    int64_t tmp_bytes; /* the size of the command's private /tmp, where the driver makes one
                        * (0: no bound); set by driver_run */
    char **owned;      /* strings argv points into */
    size_t n_owned;
};

struct driver {
    const char *name;
    /* prepare fills c to run command in working directory cwd (a host path inside sb), with
     * env ("K=V", checked) over the base environment. */
    enum cf_status (*prepare)(const struct sandbox *sb, const char *cwd, const char *command,
                              const char *const *env, size_t n_env, struct driver_cmd *c,
                              struct cf_error *err);
};

/* driver_find returns the driver named name ("local", "bwrap"), or NULL. */
const struct driver *driver_find(const char *name);

/* driver_init prepares what the driver needs once per process (bwrap: its seccomp program).
 * CF_UNAVAILABLE with the reason when it cannot. */
CF_MUST_CHECK enum cf_status driver_init(const struct driver *d, struct cf_error *err);

/* driver_available checks that the driver can run commands on this machine (bwrap present and
 * allowed to create its namespaces); CF_UNAVAILABLE with the reason otherwise. */
CF_MUST_CHECK enum cf_status driver_available(const struct driver *d, const char *root,
                                              struct cf_error *err);

/* driver_env_refused names why the variable kv ("K=V") may not be set for a command (the
 * dynamic loader's variables, a name that is not one), or NULL when it may. */
const char *driver_env_refused(const char *kv);

/* driver_run runs command in sb with sb's driver, working directory cwd (a host path inside
 * sb) and env ("K=V", at most DRIVER_ENV_MAX, over the base environment; a refused one is
 * CF_INVALID naming it, and nothing runs): proc_run with spec's timeout, callbacks and stdin,
 * its argv, cwd, envp and extra_fd set here, under limits (NULL: sb's own, sb->limits). */
CF_MUST_CHECK enum cf_status driver_run(const struct sandbox *sb, const struct proc_limits *limits,
                                        const char *cwd, const char *command,
                                        const char *const *env, size_t n_env,
                                        struct proc_spec *spec, struct proc_result *res,
                                        struct cf_error *err);

#endif
