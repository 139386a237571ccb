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

enum cf_status proc_run(const struct proc_spec *spec, struct proc_result *out, struct cf_error *err)
{
    int pipefd[2], errfd[2] = {-1, -1}, in_fd = -1, rep_fd[2] = {-1, -1};
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    sigset_t none, all;
    pid_t pid;
    int64_t start = clock_mono_ms();
    int64_t deadline = spec->timeout_ms > 0 ? start + spec->timeout_ms : INT64_MAX;
    int stdin_pipe[2] = {-1, -1};
    bool runner = runner_exe[0] != '\0';
    const char **argv = spec->argv;
    const char *rargv[PROC_ARGV_MAX + 8];
    char ppid[24];

    memset(out, 0, sizeof(*out));
    if (runner) {
        size_t n = 0;
        snprintf(ppid, sizeof(ppid), "%d", (int)getpid());
        rargv[n++] = runner_exe;
        rargv[n++] = PROC_RUNNER_FLAG;
        rargv[n++] = ppid;
        rargv[n++] = "--";
        for (size_t i = 0; spec->argv[i] && i < PROC_ARGV_MAX; i++) {
            rargv[n++] = spec->argv[i];
        }
        rargv[n] = NULL;
        argv = rargv;
        if (pipe2(rep_fd, O_CLOEXEC) != 0) {
            return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
        }
        /* fd 3 in the runner: keep the source away from 0..3 so the dup2 order is safe */
        int hi = fcntl(rep_fd[1], F_DUPFD_CLOEXEC, 10);
        close(rep_fd[1]);
        rep_fd[1] = hi;
        if (hi < 0) {
            close(rep_fd[0]);
            return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
        }
    }
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        if (runner) {
            close(rep_fd[0]);
            close(rep_fd[1]);
        }
        return cf_error_set(err, CF_UNAVAILABLE, "cannot create a pipe: %s", strerror(errno));
    }
    if (spec->on_stderr && pipe2(errfd, O_CLOEXEC) != 0) {
        errfd[0] = errfd[1] = -1;
    }
    if (spec->stdin_data) {
        if (pipe2(stdin_pipe, O_CLOEXEC) != 0) {
            stdin_pipe[0] = stdin_pipe[1] = -1;
        }
    }
    if (stdin_pipe[0] < 0) {
        in_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, stdin_pipe[0] >= 0 ? stdin_pipe[0] : in_fd, 0);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
    posix_spawn_file_actions_adddup2(&fa, errfd[1] >= 0 ? errfd[1] : pipefd[1], 2);
    if (runner) {
        posix_spawn_file_actions_adddup2(&fa, rep_fd[1], 3);
    }
    if (spec->cwd) {
        posix_spawn_file_actions_addchdir_np(&fa, spec->cwd);
    }
    posix_spawnattr_init(&attr);
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr,
                             POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    int rc = runner ? posix_spawn(&pid, argv[0], &fa, &attr, (char *const *)argv, spec->envp)
                    : posix_spawnp(&pid, argv[0], &fa, &attr, (char *const *)argv, spec->envp);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    close(pipefd[1]);
    if (errfd[1] >= 0) {
        close(errfd[1]);
    }
    if (in_fd >= 0) {
        close(in_fd);
    }
    if (stdin_pipe[0] >= 0) {
        close(stdin_pipe[0]);
    }
    if (runner) {
        close(rep_fd[1]);
    }
    /* the command's process group: the main process under a runner, else the spawned one */
    pid_t group = pid;
    struct runner_report rep = {0, 0};
    if (rc == 0 && runner) {
        bool got = read_report(rep_fd[0], &rep);
        if (!got || rep.err) {
            int st;
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            rc = got ? rep.err : EAGAIN;
        } else {
            group = rep.pid;
        }
    }
    if (runner) {
        close(rep_fd[0]);
    }
    if (rc != 0) {
        close(pipefd[0]);
        if (errfd[0] >= 0) {
            close(errfd[0]);
        }
        if (stdin_pipe[1] >= 0) {
            close(stdin_pipe[1]);
        }
        return cf_error_set(err, CF_UNAVAILABLE, "cannot start %s: %s", spec->argv[0],
                            strerror(rc));
    }
    if (stdin_pipe[1] >= 0) {
        /* small inputs only (bounded by the request size); a full pipe is not waited for */
        fcntl(stdin_pipe[1], F_SETFL, O_NONBLOCK);
        ssize_t w = write(stdin_pipe[1], spec->stdin_data, spec->stdin_len);
        (void)w;
        close(stdin_pipe[1]);
    }

    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    char buf[65536];
    bool exited = false, pipe_open = true, err_open = errfd[0] >= 0, killing = false;
    int64_t kill_at = 0, drain_until = 0;
    int status = 0;
    while (pipe_open || err_open || !exited) {
        int64_t now = clock_mono_ms();
        if (!killing && now >= deadline) {
            out->timed_out = true;
            killing = true;
        }
        if (!killing && spec->cancelled && spec->cancelled(spec->ctx)) {
            out->cancelled = true;
            killing = true;
        }
        if (killing && !kill_at && !exited) {
            if (runner) {
                kill(pid, SIGTERM); /* the runner stops the command and all it started */
                kill_at = now + PROC_KILL_GRACE_MS + RUNNER_SLACK_MS;
            } else {
                kill_group(pid, SIGTERM);
                kill_at = now + PROC_KILL_GRACE_MS;
            }
        }
        if (kill_at && now >= kill_at && !exited) {
            kill(pid, SIGKILL);
            kill_group(group, SIGKILL);
            kill_at = INT64_MAX;
        }
        if (exited && (pipe_open || err_open) && now >= drain_until) {
            if (runner || drain_until + PIPE_AFTER_EXIT_MS <= now) {
                break; /* whatever still holds the pipe is not waited for */
            }
            /* the main process is gone; stop whatever it left behind holding the pipe */
            kill_group(pid, SIGKILL);
        }
        struct pollfd pfd[3];
        int n = 0, out_i = -1, err_i = -1;
        if (pipe_open) {
            out_i = n;
            pfd[n++] = (struct pollfd){.fd = pipefd[0], .events = POLLIN};
        }
        if (err_open) {
            err_i = n;
            pfd[n++] = (struct pollfd){.fd = errfd[0], .events = POLLIN};
        }
        if (!exited && pidfd >= 0) {
            pfd[n++] = (struct pollfd){.fd = pidfd, .events = POLLIN};
        }
        int64_t wait_ms = 100;
        if (deadline != INT64_MAX && deadline - now < wait_ms) {
            wait_ms = deadline - now > 0 ? deadline - now : 0;
        }
        if (exited && drain_until - now < wait_ms) {
            wait_ms = drain_until > now ? drain_until - now : 10;
        }
        int pr = n ? poll(pfd, (nfds_t)n, (int)wait_ms) : (clock_sleep_ms(10), 0);
        if (pr < 0 && errno != EINTR) {
            break;
        }
        if (err_i >= 0 && pr > 0 && (pfd[err_i].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = read(errfd[0], buf, sizeof(buf));
            if (r > 0) {
                if (!spec->on_stderr(spec->ctx, buf, (size_t)r) && !killing) {
                    killing = true;
                    out->cancelled = true;
                }
            } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
                err_open = false;
            }
        }
        if (out_i >= 0 && pr > 0 && (pfd[out_i].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = read(pipefd[0], buf, sizeof(buf));
            if (r > 0) {
                if (spec->on_output && !spec->on_output(spec->ctx, buf, (size_t)r) && !killing) {
                    killing = true;
                    out->cancelled = true;
                }
            } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
                pipe_open = false;
            }
        }
        if (!exited) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) {
                exited = true;
                drain_until =
                    clock_mono_ms() + (runner ? PIPE_AFTER_EXIT_MS : PROC_DRAIN_AFTER_EXIT_MS);
            }
        }
    }
    close(pipefd[0]);
    if (errfd[0] >= 0) {
        close(errfd[0]);
    }
    if (pidfd >= 0) {
        close(pidfd);
    }
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    if (!runner) {
        kill_group(pid, SIGKILL); /* background leftovers (the runner has killed its own) */
    }
    if (out->timed_out) {
        out->exit_code = 124;
    } else if (WIFEXITED(status)) {
        out->exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
        out->exit_code = 128 + WTERMSIG(status);
    }
    out->duration_ms = clock_mono_ms() - start;
    return CF_OK;
}
