/* proc.h - running a command with a deadline, its output in arrival order, nothing leaked.
 *
 * The command runs in a new session (its own process group) with stdin from /dev/null and
 * stdout and stderr on one pipe, so output arrives in the order it was written. Output is
 * handed to a callback chunk by chunk; proc keeps none of it.
 *
 * Method: the command does not run as toold's child but under a runner, toold's own binary
 * re-executed with PROC_RUNNER_FLAG (see proc_set_runner). The runner makes itself a child
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

#include "status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROC_ARGV_MAX 512

/* What one command may use (0: no bound). The runner enforces them two ways: kernel limits
 * set before the command starts (RLIMIT_CPU and RLIMIT_DATA per process, at the bound plus a
 * margin, so a single process cannot run far past them between two looks; RLIMIT_FSIZE;
 * RLIMIT_CORE 0), and a watch of the whole process tree every PROC_WATCH_MS: the processes and
 * threads alive, the CPU time they and their reaped children used, their resident private
 * memory, and, every PROC_DISK_WATCH_MS at most, the workspace's size. Past a bound the
 * command and everything it started are killed (SIGKILL) and the result names the limit
 * (proc_result.limit). RLIMIT_NPROC is not used: the kernel counts it per user across toold's
 * own threads and every other command, even in a user namespace of the command's own. */
struct proc_limits {
    int64_t cpu_ms;       /* CPU time of the command and all it started */
    int64_t memory_bytes; /* resident private memory of all its processes together */
    int64_t procs;        /* processes and threads at once; reaching it stops the command */
    int64_t file_bytes;   /* the largest file it may write (RLIMIT_FSIZE) */
    int64_t disk_bytes;   /* the workspace's size; a command that grows it past this stops */
    const char *disk_dir; /* the workspace (host path) whose size disk_bytes bounds */
    int launcher_procs;   /* processes of the driver itself, not counted (bwrap: 2) */
    int64_t disk_known;   /* the workspace's size as last measured (-1: unknown: walked first) */
};

/* proc_limits_tighten lowers each bound of l (cpu_ms, memory_bytes, procs, file_bytes,
 * disk_bytes) to want's where want sets one (> 0) that is tighter (l's 0 is no bound). */
void proc_limits_tighten(struct proc_limits *l, const struct proc_limits *want);

#define PROC_WATCH_MS 40       /* between two looks at the process tree */
#define PROC_DISK_WATCH_MS 250 /* at least this between two walks of the workspace */

/* The limit that stopped a command. */
enum proc_limit {
    PROC_LIMIT_NONE = 0,
    PROC_LIMIT_CPU,
    PROC_LIMIT_MEMORY,
    PROC_LIMIT_PROCS,
    PROC_LIMIT_FILE, /* a process was killed by SIGXFSZ (seen from the exit status only) */
    PROC_LIMIT_DISK,
};

/* proc_limit_name is the limit's name in results and logs ("cpu", "memory", "processes",
 * "file_size", "disk"; "" for none). */
const char *proc_limit_name(enum proc_limit l);

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

#define PROC_KILL_GRACE_MS 2000      /* SIGTERM to SIGKILL */
#define PROC_DRAIN_AFTER_EXIT_MS 100 /* what a finished command's background jobs get */

/* What the runner tells toold on its fd 3 once the command started (or could not start). */
struct runner_report {
    int32_t err; /* errno of the failed start, 0 when the command runs */
    int32_t pid; /* the command's main process (leader of its own process group) */
};

/* What the runner tells toold on fd 3 as it ends, after the command and all it started are
 * gone: the limit that stopped it (enum proc_limit), what was used, and the workspace's size
 * as last measured (-1: not measured), for the next command's disk check. */
struct runner_end {
    int32_t limit;
    int32_t after_exit;
    int64_t used;
    int64_t disk_size;
};

/* PROC_RUNNER_FLAG as argv[1] makes a program that calls proc_runner_main act as the runner. */
#define PROC_RUNNER_FLAG "--proc-runner"

/* proc_set_runner makes proc_run start commands under the runner found at exe (an absolute
 * path of a program whose main calls proc_runner_main when argv[1] is PROC_RUNNER_FLAG). NULL
 * or "" turns the runner off. Call once at start-up, before any proc_run. */
void proc_set_runner(const char *exe);

/* proc_runner_main is the runner's whole life (argv: exe PROC_RUNNER_FLAG parent_pid
 * [KEY=VALUE ...] -- argv of the command..., the keys those of struct proc_limits: cpu_ms,
 * memory_bytes, procs, file_bytes, disk_bytes, disk_known, disk_dir, launcher_procs);
 * returns the exit code for main to return. Only for the runner process. */
int proc_runner_main(int argc, char **argv);

/* proc_keep_fds_from_commands marks every descriptor from `from` on close-on-exec: those this
 * process was started with (a launcher's pipe left open) would otherwise reach every command.
 * toold calls it at start (from 3), the runner before it starts the command (from 5: 3 and 4
 * are its report pipe and bwrap's filter, which it hands on itself). */
void proc_keep_fds_from_commands(int from);

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
