/* proc.h - running a command with a deadline, its output in arrival order, nothing leaked.
 *
 * The command runs in a new session (its own process group) with stdin from /dev/null and
 * stdout and stderr on one pipe, so output arrives in the order it was written. Output is
 * handed to a callback chunk by chunk; proc keeps none of it. At the deadline, or when the
 * caller cancels, the whole group gets SIGTERM and, 2 s later, SIGKILL. When the command's
 * main process exits, whatever it left running in its group is killed, so a background job
 * cannot hold the call open, and the main process is always reaped.
 */
#ifndef CFLUE_TOOLD_PROC_H
#define CFLUE_TOOLD_PROC_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROC_ARGV_MAX 64

struct proc_spec {
    const char **argv;      /* argv[0] is looked up in PATH */
    const char *cwd;        /* host path */
    char **envp;            /* full environment */
    int64_t timeout_ms;     /* <= 0: none */
    const void *stdin_data; /* NULL: /dev/null */
    size_t stdin_len;
    /* on_output receives each chunk as it arrives; returning false kills the group */
    bool (*on_output)(void *ctx, const char *p, size_t n);
    /* on_stderr, when set, receives stderr separately (else stderr shares on_output's pipe) */
    bool (*on_stderr)(void *ctx, const char *p, size_t n);
    void *ctx;
    /* cancelled is polled every 100 ms; true kills the group (NULL: never) */
    bool (*cancelled)(void *ctx);
};

struct proc_result {
    int exit_code; /* the command's code; 124 on timeout; 128+N when killed by signal N */
    bool timed_out;
    bool cancelled;
    int64_t duration_ms;
};

/* proc_run runs the command to completion. CF_UNAVAILABLE when it cannot be started (the
 * message says why); every command that started yields CF_OK with its result. */
enum cf_status proc_run(const struct proc_spec *spec, struct proc_result *out,
                        struct cf_error *err);

/* proc_base_env builds the environment commands get: a fixed allow-list from toold's own
 * environment (PATH HOME USER LOGNAME LANG LC_ALL LC_CTYPE TZ TERM TMPDIR), then extra
 * "KEY=VALUE" entries (which override). Free with proc_env_free. */
char **proc_base_env(const char *const *extra, size_t n_extra);

/* proc_env_free frees an environment from proc_base_env (NULL is fine). */
void proc_env_free(char **envp);

#endif
