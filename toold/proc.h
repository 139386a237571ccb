/* proc.h - running a command with a deadline, its output in arrival order, nothing leaked.
 *
 * The command runs in a new session (its own process group) with stdin from /dev/null and
 * stdout and stderr on one pipe, so output arrives in the order it was written. Output is
 * handed to a callback chunk by chunk; proc keeps none of it.
 *
 * Method: the command does not run as toold's child but under a runner (runner.h, runner.c):
 * the toold-runner program found next to toold, or toold's own binary re-executed with
 * PROC_RUNNER_FLAG when it is missing (see proc_set_runner). The runner makes itself a child
 * subreaper (prctl PR_SET_CHILD_SUBREAPER), so every descendant of the command, including one
 * that left the session with setsid and lost its parent, stays in the runner's subtree instead
 * of going to init. When the command's main process exits, the runner gives what is left
 * DRAIN_AFTER_EXIT_MS to finish, then SIGKILLs every descendant (repeatedly, as killing one
 * hands its children to the runner) and exits with the main process's status. At the deadline,
 * or when the caller cancels, toold sends the runner SIGTERM: it passes SIGTERM to the command's
 * group and to every process it adopted, and after KILL_GRACE_MS kills them all. The runner
 * also gets SIGTERM when toold dies (PR_SET_PDEATHSIG), so commands do not outlive toold.
 * Whatever happens to the command, toold stops reading its pipes a moment after the runner
 * is gone: a process that escaped (one given the pipe over a socket) cannot hold the call.
 * Without a runner (proc_set_runner never called: unit tests of other modules) the command is
 * spawned directly and only its process group is killed.
 */
#ifndef CFLUE_TOOLD_PROC_H
#define CFLUE_TOOLD_PROC_H

#include "runner.h"
#include "status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROC_ARGV_MAX 512

struct proc_spec {
    const char **argv;      /* argv[0] is looked up in PATH */
    const char *cwd;        /* host path */
    char **envp;            /* full environment */
    int extra_fd;           /* the command inherits it as fd 4 (0: none) */
    int64_t timeout_ms;     /* <= 0: none */
    int64_t deadline_ms;    /* monotonic; the earlier of it and the timeout applies (0: none) */
    const void *stdin_data; /* NULL: /dev/null */
    size_t stdin_len;
    /* on_output receives each chunk as it arrives; returning false kills the group */
    bool (*on_output)(void *ctx, const char *p, size_t n);
    /* on_stderr, when set, receives stderr separately (else stderr shares on_output's pipe) */
    bool (*on_stderr)(void *ctx, const char *p, size_t n);
    void *ctx;
    /* cancelled is polled every 100 ms; true kills the group (NULL: never) */
    bool (*cancelled)(void *ctx);
    const struct proc_limits *limits; /* NULL: none (enforced only under the runner) */
};

struct proc_result {
    int exit_code; /* the command's code; 124 on timeout; 128+N when killed by signal N */
    bool timed_out;
    bool cancelled;
    int64_t duration_ms;
    enum proc_limit limit; /* the limit that stopped it, or PROC_LIMIT_NONE */
    int64_t limit_used; /* what it had used when stopped (ms, bytes or processes; 0 if unknown) */
    bool limit_after_exit; /* disk only: found over the bound once the command had exited */
    int64_t disk_size;     /* the workspace's size as the runner last knew it (-1: unknown) */
};

/* proc_set_runner makes proc_run start commands under the runner found at exe (an absolute
 * path of a program whose main calls proc_runner_main when argv[1] is PROC_RUNNER_FLAG). NULL
 * or "" turns the runner off. Call once at start-up, before any proc_run. */
void proc_set_runner(const char *exe);

/* proc_run runs the command to completion. CF_UNAVAILABLE when it cannot be started (the
 * message says why); every command that started yields CF_OK with its result. */
CF_MUST_CHECK enum cf_status proc_run(const struct proc_spec *spec, struct proc_result *out,
                                      struct cf_error *err);

/* proc_base_env builds the environment commands get: a fixed allow-list from toold's own
 * environment (PATH HOME USER LOGNAME LANG LC_ALL LC_CTYPE TZ TERM TMPDIR), then extra
 * "KEY=VALUE" entries (which override). Free with proc_env_free. */
char **proc_base_env(const char *const *extra, size_t n_extra);

/* proc_env_free frees an environment from proc_base_env (NULL is fine). */
void proc_env_free(char **envp);

#endif
