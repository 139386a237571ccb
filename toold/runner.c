/* runner.c - the process a command runs under (see the method in proc.h).
 *
 * Single-threaded and small: it is built both into toold (run as `toold --proc-runner`) and as
 * the standalone toold-runner program, which starts in a fraction of the time toold's own
 * binary with its gRPC libraries needs. It uses libc only.
 */
#include "proc.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------- the runner (a separate, single-threaded process) ---------- */

static void send_to(pid_t pid, int sig)
{
    if (pid > 1) {
        kill(-pid, sig); /* its group, when it leads one */
        kill(pid, sig);
    }
}

/* signal_scan is signal_children for kernels without /proc/PID/task/TID/children. */
static void signal_scan(int sig)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    pid_t self = getpid();
    while (d && (e = readdir(d))) {
        char path[300], stat[512];
        if (e->d_name[0] < '1' || e->d_name[0] > '9') {
            continue;
        }
        snprintf(path, sizeof(path), "/proc/%.32s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            continue;
        }
        ssize_t n = read(fd, stat, sizeof(stat) - 1);
        close(fd);
        if (n <= 0) {
            continue;
        }
        stat[n] = '\0';
        const char *rp = strrchr(stat, ')');
        int ppid = 0;
        char state;
        if (rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == self) {
            send_to((pid_t)atoi(e->d_name), sig);
        }
    }
    if (d) {
        closedir(d);
    }
}

/* signal_children sends sig to every child of the runner (adopted orphans included) and to the
 * process group each of them leads. */
static void signal_children(int sig)
{
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        signal_scan(sig);
        return;
    }
    long cur = -1;
    ssize_t r;
    while ((r = read(fd, buf, sizeof(buf))) > 0) {
        for (ssize_t i = 0; i < r; i++) {
            if (buf[i] >= '0' && buf[i] <= '9') {
                cur = (cur < 0 ? 0 : cur * 10) + (buf[i] - '0');
            } else if (cur > 0) {
                send_to((pid_t)cur, sig);
                cur = -1;
            }
        }
    }
    if (cur > 0) {
        send_to((pid_t)cur, sig);
    }
    close(fd);
}

/* kill_all SIGKILLs every descendant until the runner has no child left. Killing a process
 * hands its children to the runner (the subreaper), so each round finds the next layer. */
static void kill_all(void)
{
    for (;;) {
        signal_children(SIGKILL);
        int st;
        pid_t w = waitpid(-1, &st, 0);
        if (w < 0 && errno == ECHILD) {
            return;
        }
        if (w < 0 && errno != EINTR) {
            return;
        }
        while (waitpid(-1, &st, WNOHANG) > 0) {
        }
    }
}

int proc_runner_main(int argc, char **argv)
{
    const int report_fd = 3;
    struct runner_report rep = {0, 0};
    sigset_t set, empty;

    if (argc < 5 || strcmp(argv[1], PROC_RUNNER_FLAG) != 0 || strcmp(argv[3], "--") != 0) {
        fprintf(stderr, "usage: %s %s PARENT_PID -- COMMAND...\n", argv[0], PROC_RUNNER_FLAG);
        return 127;
    }
    fcntl(report_fd, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != (pid_t)atol(argv[2])) {
        return 127; /* toold is already gone */
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    sigemptyset(&empty);
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGQUIT);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);

    int ep[2];
    if (pipe2(ep, O_CLOEXEC) != 0) {
        rep.err = errno;
        if (write(report_fd, &rep, sizeof(rep)) < 0) {
            return 127;
        }
        return 127;
    }
    pid_t pid = fork();
    if (pid == 0) {
        sigprocmask(SIG_SETMASK, &empty, NULL);
        setsid();
        execvp(argv[4], argv + 4);
        int e = errno;
        if (write(ep[1], &e, sizeof(e)) < 0) {
            _exit(127);
        }
        _exit(127);
    }
    close(ep[1]);
    if (pid < 0) {
        rep.err = errno;
    } else {
        int e;
        ssize_t r;
        while ((r = read(ep[0], &e, sizeof(e))) < 0 && errno == EINTR) {
        }
        if (r == (ssize_t)sizeof(e)) {
            rep.err = e;
        }
        rep.pid = pid;
    }
    close(ep[0]);
    ssize_t w = write(report_fd, &rep, sizeof(rep));
    close(report_fd);
    if (rep.err || w != (ssize_t)sizeof(rep)) {
        kill_all();
        return 127;
    }
    /* the runner holds no end of the command's pipes: they close when its processes are gone */
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int fd = 0; fd < 3; fd++) {
        if (nul >= 0) {
            dup2(nul, fd);
        } else {
            close(fd);
        }
    }
    if (nul > 2) {
        close(nul);
    }

    int main_status = 0;
    bool main_done = false, stopping = false;
    int64_t stop_at = 0, drain_until = 0;
    for (;;) {
        int st;
        pid_t got;
        while ((got = waitpid(-1, &st, WNOHANG)) > 0) {
            if (got == pid) {
                main_status = st;
                main_done = true;
                drain_until = mono_ms() + PROC_DRAIN_AFTER_EXIT_MS;
            }
        }
        if (got < 0 && errno == ECHILD) {
            break; /* the command and everything it started are gone */
        }
        int64_t now = mono_ms();
        if ((main_done && now >= drain_until) || (stopping && now >= stop_at)) {
            break;
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        int sig = sigtimedwait(&set, NULL, &ts);
        if (sig > 0 && sig != SIGCHLD && !stopping) {
            stopping = true;
            stop_at = now + PROC_KILL_GRACE_MS;
            send_to(pid, SIGTERM);
            signal_children(SIGTERM);
        }
    }
    kill_all();
    if (!main_done) {
        return 128 + SIGKILL;
    }
    if (WIFEXITED(main_status)) {
        return WEXITSTATUS(main_status);
    }
    return WIFSIGNALED(main_status) ? 128 + WTERMSIG(main_status) : 127;
}
