/* proc.c - process groups, deadlines and output pumping. */
#include "proc.h"

#include "clock.h"
#include "mem.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define PIPE_AFTER_EXIT_MS 250 /* how long toold reads pipes once the runner is gone */
#define RUNNER_START_MS 10000  /* the runner reports the start within this */
#define RUNNER_SLACK_MS 1000   /* after the kill grace, before toold kills the runner */

static const char *env_allow[] = {"PATH",   "HOME",     "USER", "LOGNAME", "LANG",
                                  "LC_ALL", "LC_CTYPE", "TZ",   "TERM",    "TMPDIR"};

char **proc_base_env(const char *const *extra, size_t n_extra)
{
    size_t cap = sizeof(env_allow) / sizeof(env_allow[0]) + n_extra + 2, n = 0;
    char **env = mem_alloc(sizeof(char *) * cap);
    for (size_t i = 0; i < sizeof(env_allow) / sizeof(env_allow[0]); i++) {
        const char *v = getenv(env_allow[i]);
        if (!v && !strcmp(env_allow[i], "PATH")) {
            v = "/usr/local/bin:/usr/bin:/bin";
        }
        if (!v) {
            continue;
        }
        size_t len = strlen(env_allow[i]) + strlen(v) + 2;
        env[n] = mem_alloc(len);
        snprintf(env[n++], len, "%s=%s", env_allow[i], v);
    }
    for (size_t i = 0; i < n_extra; i++) {
        const char *eq = strchr(extra[i], '=');
        size_t klen = eq ? (size_t)(eq - extra[i]) : strlen(extra[i]);
        size_t k;
        for (k = 0; k < n; k++) {
            if (!strncmp(env[k], extra[i], klen) && env[k][klen] == '=') {
                break;
            }
        }
        if (k < n) {
            free(env[k]);
        } else {
            n++;
        }
        env[k] = mem_strdup(extra[i]);
    }
    env[n] = NULL;
    return env;
}

void proc_env_free(char **envp)
{
    if (!envp) {
        return;
    }
    for (char **p = envp; *p; p++) {
        free(*p);
    }
    free(envp);
}

static char runner_exe[PATH_MAX];

void proc_set_runner(const char *exe)
{
    snprintf(runner_exe, sizeof(runner_exe), "%s", exe ? exe : "");
}

/* ---------- toold's side ---------- */

static void kill_group(pid_t pgid, int sig)
{
    if (pgid > 0) {
        kill(-pgid, sig);
    }
}

/* read_report waits (bounded) for the runner's start report. */
static bool read_report(int fd, struct runner_report *rep)
{
    size_t got = 0;
    int64_t until = clock_mono_ms() + RUNNER_START_MS;
    while (got < sizeof(*rep)) {
        int64_t left = until - clock_mono_ms();
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0) {
            return false;
        }
        int pr = poll(&p, 1, (int)left);
        if (pr < 0 && errno == EINTR) {
            continue;
        }
        if (pr <= 0) {
            return false;
        }
        ssize_t r = read(fd, (char *)rep + got, sizeof(*rep) - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return false;
        }
        got += (size_t)r;
    }
    return true;
}

/* One command's run, from its pipes to its status. */
struct run {
    const struct proc_spec *spec;
    struct proc_result *out;
    bool runner;                      /* under the runner (runner_exe set) */
    int out_fd[2], err_fd[2];         /* stdout (and stderr unless on_stderr); stderr apart */
    int in_fd[2], null_fd, rep_fd[2]; /* stdin: a pipe of stdin_data, or /dev/null; the report */
    pid_t pid;                        /* the spawned process: the runner, or the command */
    pid_t group;                      /* the command's process group */
    int64_t start, deadline;          /* monotonic */
    /* the pump */
    size_t in_sent; /* of stdin_data, written to the command's stdin so far */
    bool exited, out_open, err_open, killing;
    int64_t kill_at, drain_until;
    int status;
};

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* open_pipes makes the output pipes, stdin (a pipe when there is input, else /dev/null) and,
 * under the runner, its report pipe (its write end away from fds 0..3 so the dup2 order in the
 * child is safe). */
static enum cf_status open_pipes(struct run *r, struct cf_error *err)
{
    if (r->runner) {
        if (pipe2(r->rep_fd, O_CLOEXEC) != 0) {
            return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
        }
        int hi = fcntl(r->rep_fd[1], F_DUPFD_CLOEXEC, 10);
        close(r->rep_fd[1]);
        r->rep_fd[1] = hi;
        if (hi < 0) {
            close_fd(&r->rep_fd[0]);
            return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
        }
    }
    if (pipe2(r->out_fd, O_CLOEXEC) != 0) {
        r->out_fd[0] = r->out_fd[1] = -1;
        close_fd(&r->rep_fd[0]);
        close_fd(&r->rep_fd[1]);
        return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
    }
    if (r->spec->on_stderr && pipe2(r->err_fd, O_CLOEXEC) != 0) {
        r->err_fd[0] = r->err_fd[1] = -1;
    }
    if (r->spec->stdin_data && pipe2(r->in_fd, O_CLOEXEC) != 0) {
        r->in_fd[0] = r->in_fd[1] = -1;
    } else if (r->in_fd[1] >= 0) {
        fcntl(r->in_fd[1], F_SETFL, O_NONBLOCK); /* toold's end: fed as the command reads */
    }
    if (r->in_fd[0] < 0) {
        r->null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    return CF_OK;
}

#define LIMIT_ARGS 10

/* limit_argv writes the runner's KEY=VALUE arguments for l (NULL: none) into out, the numbers
 * in buf and the workspace's path allocated (*disk_dir; the caller frees it); returns how many. */
static size_t limit_argv(const struct proc_limits *l, char buf[LIMIT_ARGS][48], const char **out,
                         char **disk_dir)
{
    size_t n = 0;
    if (!l) {
        return 0;
    }
#define NUM(key, v)                                                                                \
    do {                                                                                           \
        if ((v) > 0) {                                                                             \
            snprintf(buf[n], sizeof(buf[n]), "%s=%lld", key, (long long)(v));                      \
            out[n] = buf[n];                                                                       \
            n++;                                                                                   \
        }                                                                                          \
    } while (0)
    NUM("cpu_ms", l->cpu_ms);
    NUM("memory_bytes", l->memory_bytes);
    NUM("procs", l->procs);
    NUM("file_bytes", l->file_bytes);
    NUM("launcher_procs", l->launcher_procs);
    if (l->disk_bytes > 0 && l->disk_dir) {
        NUM("disk_bytes", l->disk_bytes);
        snprintf(buf[n], sizeof(buf[n]), "disk_known=%lld", (long long)l->disk_known);
        out[n] = buf[n];
        n++;
        out[n++] = *disk_dir = mem_asprintf("disk_dir=%s", l->disk_dir);
    }
#undef NUM
    return n;
}

/* spawn starts the command (or the runner with the command after "--") in a new session with
 * default signal dispositions and an empty mask, then closes the child's ends of the pipes.
 * Returns posix_spawn's error number (0: started). */
static int spawn(struct run *r)
{
    const char **argv = r->spec->argv;
    const char *rargv[PROC_ARGV_MAX + 8 + LIMIT_ARGS];
    char ppid[24], limit_args[LIMIT_ARGS][48];
    char *disk_dir = NULL;
    if (r->runner) {
        size_t n = 0;
        snprintf(ppid, sizeof(ppid), "%d", (int)getpid());
        rargv[n++] = runner_exe;
        rargv[n++] = PROC_RUNNER_FLAG;
        rargv[n++] = ppid;
        n += limit_argv(r->spec->limits, limit_args, rargv + n, &disk_dir);
        rargv[n++] = "--";
        for (size_t i = 0; r->spec->argv[i] && i < PROC_ARGV_MAX; i++) {
            rargv[n++] = r->spec->argv[i];
        }
        rargv[n] = NULL;
        argv = rargv;
    }
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    sigset_t none, all;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, r->in_fd[0] >= 0 ? r->in_fd[0] : r->null_fd, 0);
    posix_spawn_file_actions_adddup2(&fa, r->out_fd[1], 1);
    posix_spawn_file_actions_adddup2(&fa, r->err_fd[1] >= 0 ? r->err_fd[1] : r->out_fd[1], 2);
    if (r->runner) {
        posix_spawn_file_actions_adddup2(&fa, r->rep_fd[1], 3);
    }
    if (r->spec->extra_fd > 0) {
        posix_spawn_file_actions_adddup2(&fa, r->spec->extra_fd, 4);
    }
    if (r->spec->cwd) {
        posix_spawn_file_actions_addchdir_np(&fa, r->spec->cwd);
    }
    posix_spawnattr_init(&attr);
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr,
                             POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    int rc = r->runner
                 ? posix_spawn(&r->pid, argv[0], &fa, &attr, (char *const *)argv, r->spec->envp)
                 : posix_spawnp(&r->pid, argv[0], &fa, &attr, (char *const *)argv, r->spec->envp);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    free(disk_dir);
    close_fd(&r->out_fd[1]);
    close_fd(&r->err_fd[1]);
    close_fd(&r->null_fd);
    close_fd(&r->in_fd[0]);
    close_fd(&r->rep_fd[1]);
    return rc;
}

/* await_start learns the command's process group: under the runner from its report (a runner
 * that does not report in time, or reports a failed start, is killed); else the spawned
 * process's. Returns the error number of a failed start (0: running). */
static int await_start(struct run *r)
{
    int rc = 0;
    r->group = r->pid;
    if (r->runner) {
        struct runner_report rep = {0, 0};
        bool got = read_report(r->rep_fd[0], &rep);
        if (!got || rep.err) {
            int st;
            kill(r->pid, SIGKILL);
            waitpid(r->pid, &st, 0);
            rc = got ? rep.err : EAGAIN;
        } else {
            r->group = rep.pid;
        }
        if (rc) {
            close_fd(&r->rep_fd[0]);
        }
    }
    return rc;
}

/* feed_stdin writes what the command's stdin takes of the input now (the pipe is
 * non-blocking; the pump calls again when it has room) and closes it once all is written, or
 * when the command stopped reading it (EPIPE). */
static void feed_stdin(struct run *r)
{
    while (r->in_fd[1] >= 0 && r->in_sent < r->spec->stdin_len) {
        ssize_t w = write(r->in_fd[1], (const char *)r->spec->stdin_data + r->in_sent,
                          r->spec->stdin_len - r->in_sent);
        if (w > 0) {
            r->in_sent += (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && errno == EAGAIN) {
            return;
        } else {
            break;
        }
    }
    close_fd(&r->in_fd[1]);
}

/* enforce starts stopping the command at the deadline or on cancel (the runner stops the
 * command and all it started; without one, its group gets SIGTERM), kills it once the grace
 * is over, and once it exited stops waiting for pipes something else still holds. Returns
 * false when the pump should stop reading. */
static bool enforce(struct run *r, int64_t now)
{
    if (!r->killing && !r->exited && now >= r->deadline) {
        /* (a command that exited before its deadline did not time out, however long what it
         * left holding its pipes is read after) */
        r->out->timed_out = true;
        r->killing = true;
    }
    if (!r->killing && r->spec->cancelled && r->spec->cancelled(r->spec->ctx)) {
        r->out->cancelled = true;
        r->killing = true;
    }
    if (r->killing && !r->kill_at && !r->exited) {
        if (r->runner) {
            kill(r->pid, SIGTERM);
            r->kill_at = now + PROC_KILL_GRACE_MS + RUNNER_SLACK_MS;
        } else {
            kill_group(r->pid, SIGTERM);
            r->kill_at = now + PROC_KILL_GRACE_MS;
        }
    }
    if (r->kill_at && now >= r->kill_at && !r->exited) {
        kill(r->pid, SIGKILL);
        kill_group(r->group, SIGKILL);
        r->kill_at = INT64_MAX;
    }
    if (r->exited && (r->out_open || r->err_open) && now >= r->drain_until) {
        if (r->runner || r->drain_until + PIPE_AFTER_EXIT_MS <= now) {
            return false; /* whatever still holds the pipe is not waited for */
        }
        /* the main process is gone; stop whatever it left behind holding the pipe */
        kill_group(r->pid, SIGKILL);
    }
    return true;
}

/* drain_one reads what is ready on fd into sink; a sink that refuses it cancels the command.
 * Clears *open at end of file or on an error. */
static void drain_one(struct run *r, int fd, bool (*sink)(void *, const char *, size_t), bool *open)
{
    char buf[65536];
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
        if (sink && !sink(r->spec->ctx, buf, (size_t)n) && !r->killing) {
            r->killing = true;
            r->out->cancelled = true;
        }
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        *open = false;
    }
}

/* pump passes the output on as it arrives until the command exited and its pipes closed (or
 * were given up on), enforcing the deadline and cancellation meanwhile. */
static void pump(struct run *r)
{
    int pidfd = (int)syscall(SYS_pidfd_open, r->pid, 0);
    r->out_open = true;
    r->err_open = r->err_fd[0] >= 0;
    while (r->out_open || r->err_open || !r->exited) {
        int64_t now = clock_mono_ms();
        if (!enforce(r, now)) {
            break;
        }
        if (r->exited) {
            close_fd(&r->in_fd[1]); /* no one is left to read it */
        }
        struct pollfd pfd[4];
        int n = 0, out_i = -1, err_i = -1, in_i = -1;
        if (r->in_fd[1] >= 0) {
            in_i = n;
            pfd[n++] = (struct pollfd){.fd = r->in_fd[1], .events = POLLOUT};
        }
        if (r->out_open) {
            out_i = n;
            pfd[n++] = (struct pollfd){.fd = r->out_fd[0], .events = POLLIN};
        }
        if (r->err_open) {
            err_i = n;
            pfd[n++] = (struct pollfd){.fd = r->err_fd[0], .events = POLLIN};
        }
        if (!r->exited && pidfd >= 0) {
            pfd[n++] = (struct pollfd){.fd = pidfd, .events = POLLIN};
        }
        int64_t wait_ms = 100;
        if (r->deadline != INT64_MAX && r->deadline - now < wait_ms) {
            wait_ms = r->deadline - now > 0 ? r->deadline - now : 0;
        }
        if (r->exited && r->drain_until - now < wait_ms) {
            wait_ms = r->drain_until > now ? r->drain_until - now : 10;
        }
        int pr = n ? poll(pfd, (nfds_t)n, (int)wait_ms) : (clock_sleep_ms(10), 0);
        if (pr < 0 && errno != EINTR) {
            break;
        }
        if (in_i >= 0 && pr > 0 && pfd[in_i].revents) {
            feed_stdin(r);
        }
        if (err_i >= 0 && pr > 0 && (pfd[err_i].revents & (POLLIN | POLLHUP | POLLERR))) {
            drain_one(r, r->err_fd[0], r->spec->on_stderr, &r->err_open);
        }
        if (out_i >= 0 && pr > 0 && (pfd[out_i].revents & (POLLIN | POLLHUP | POLLERR))) {
            drain_one(r, r->out_fd[0], r->spec->on_output, &r->out_open);
        }
        if (!r->exited && waitpid(r->pid, &r->status, WNOHANG) == r->pid) {
            r->exited = true;
            r->drain_until =
                clock_mono_ms() + (r->runner ? PIPE_AFTER_EXIT_MS : PROC_DRAIN_AFTER_EXIT_MS);
        }
    }
    if (pidfd >= 0) {
        close(pidfd);
    }
}

/* read_end takes the runner's last word (struct runner_end), written before it exited, and
 * notes a process killed by the file size limit (SIGXFSZ, seen only in the exit status). */
static void read_end(struct run *r)
{
    struct runner_end end = {0, 0, 0, -1};
    r->out->disk_size = -1;
    if (r->rep_fd[0] >= 0) {
        fcntl(r->rep_fd[0], F_SETFL, O_NONBLOCK);
        if (read(r->rep_fd[0], &end, sizeof(end)) == (ssize_t)sizeof(end) &&
            end.limit > PROC_LIMIT_NONE && end.limit <= PROC_LIMIT_DISK) {
            r->out->limit = (enum proc_limit)end.limit;
            r->out->limit_used = end.used;
            r->out->limit_after_exit = end.after_exit != 0;
        }
        r->out->disk_size = end.disk_size;
        close_fd(&r->rep_fd[0]);
    }
    if (!r->out->limit && r->spec->limits && r->spec->limits->file_bytes > 0 &&
        ((WIFEXITED(r->status) && WEXITSTATUS(r->status) == 128 + SIGXFSZ) ||
         (WIFSIGNALED(r->status) && WTERMSIG(r->status) == SIGXFSZ))) {
        r->out->limit = PROC_LIMIT_FILE;
    }
}

/* reap makes sure nothing of the command is left and fills in its result. */
static void reap(struct run *r)
{
    close_fd(&r->in_fd[1]);
    close_fd(&r->out_fd[0]);
    close_fd(&r->err_fd[0]);
    if (!r->exited) {
        kill(r->pid, SIGKILL);
        waitpid(r->pid, &r->status, 0);
    }
    if (!r->runner) {
        kill_group(r->pid, SIGKILL); /* background leftovers (the runner has killed its own) */
    }
    read_end(r);
    if (r->out->timed_out) {
        r->out->exit_code = 124;
    } else if (WIFEXITED(r->status)) {
        r->out->exit_code = WEXITSTATUS(r->status);
    } else if (WIFSIGNALED(r->status)) {
        r->out->exit_code = 128 + WTERMSIG(r->status);
    }
    r->out->duration_ms = clock_mono_ms() - r->start;
}

enum cf_status proc_run(const struct proc_spec *spec, struct proc_result *out, struct cf_error *err)
{
    struct run r = {.spec = spec,
                    .out = out,
                    .runner = runner_exe[0] != '\0',
                    .out_fd = {-1, -1},
                    .err_fd = {-1, -1},
                    .in_fd = {-1, -1},
                    .null_fd = -1,
                    .rep_fd = {-1, -1},
                    .start = clock_mono_ms()};
    r.deadline = spec->timeout_ms > 0 ? r.start + spec->timeout_ms : INT64_MAX;
    if (spec->deadline_ms > 0 && spec->deadline_ms < r.deadline) {
        r.deadline = spec->deadline_ms;
    }
    memset(out, 0, sizeof(*out));
    enum cf_status rc = open_pipes(&r, err);
    if (rc != CF_OK) {
        return rc;
    }
    int start_err = spawn(&r);
    if (start_err == 0) {
        start_err = await_start(&r);
    }
    if (start_err != 0) {
        close_fd(&r.rep_fd[0]);
        close_fd(&r.out_fd[0]);
        close_fd(&r.err_fd[0]);
        close_fd(&r.in_fd[1]);
        return cf_error_set(err, CF_UNAVAILABLE, "cannot start %s: %s", spec->argv[0],
                            strerror(start_err));
    }
    feed_stdin(&r);
    pump(&r);
    reap(&r);
    return CF_OK;
}
