/* runner.h - the runner a command starts under (proc.h tells the method), as the runner sees it:
 * the limits it enforces, what it reports to toold, and its entry point.
 *
 * libc only: the runner is also built on its own with another C library where one is installed
 * (toold/CMakeLists.txt), so this header and runner.c include nothing of the project's but this.
 */
#ifndef CFLUE_TOOLD_RUNNER_H
#define CFLUE_TOOLD_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

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

#endif
