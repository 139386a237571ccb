/* runner.c - the process a command runs under (see the method in proc.h).
 *
 * Single-threaded and small: it is built both into toold (run as `toold --proc-runner`) and as
 * the standalone toold-runner program, which starts in a fraction of the time toold's own
 * binary with its gRPC libraries needs. It uses libc only.
 */
#include "runner.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2) /* Linux's value; not in every C library's headers */
#endif

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *proc_limit_name(enum proc_limit l)
{
    switch (l) {
    case PROC_LIMIT_CPU:
        return "cpu";
    case PROC_LIMIT_MEMORY:
        return "memory";
    case PROC_LIMIT_PROCS:
        return "processes";
    case PROC_LIMIT_FILE:
        return "file_size";
    case PROC_LIMIT_DISK:
        return "disk";
    case PROC_LIMIT_NONE:
        break;
    }
    return "";
}

/* tighter is want's bound where it sets one tighter than have's (0: no bound). */
static int64_t tighter(int64_t have, int64_t want)
{
    return want > 0 && (have <= 0 || want < have) ? want : have;
}

void proc_limits_tighten(struct proc_limits *l, const struct proc_limits *want)
{
    l->cpu_ms = tighter(l->cpu_ms, want->cpu_ms);
    l->memory_bytes = tighter(l->memory_bytes, want->memory_bytes);
    l->procs = tighter(l->procs, want->procs);
    l->file_bytes = tighter(l->file_bytes, want->file_bytes);
    l->disk_bytes = tighter(l->disk_bytes, want->disk_bytes);
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

/* ---------- limits: set before the command starts, watched while it runs ---------- */

#define WATCH_PIDS_MAX 16384 /* processes one look follows; more is past any process limit */
#define DISK_DEPTH_MAX 256   /* directory levels one walk of the workspace goes down */
/* The walk before a command starts (its workspace's size unknown, or over the bound as last
 * estimated) stops after this long, well within the time toold gives the runner to report
 * the start (proc.c, RUNNER_START_MS): a workspace too large to walk in it is counted from
 * what the walk saw, its growth from there, where every command once failed to start */
#define DISK_START_WALK_MS 4000
#define DISK_FULL_WALK_MS                                                                          \
    2000 /* the most between walks not asked for by statvfs, unless a                              \
          * walk takes over 5% of it (then 20 times the walk's time) */

struct watch {
    struct proc_limits lim;
    int64_t next_tree, next_disk, next_full_walk;
    int64_t walk_ms;   /* how long the last walk of the workspace took */
    int64_t fs_used0;  /* bytes in use on the workspace's filesystem at the start */
    int64_t disk_base; /* the larger of the bound and the size at the start */
    bool start_cut;    /* the walk at the start ran out of time: the size at the start is
                        * taken from the first whole walk, made at the first look */
    long ticks_per_s;
    pid_t pids[WATCH_PIDS_MAX];
    enum proc_limit hit;
    int64_t used;
    bool after_exit;
};

static int64_t parse_i64(const char *v)
{
    char *end;
    long long x = strtoll(v, &end, 10);
    return *end || x < 0 ? 0 : (int64_t)x;
}

/* watch_parse reads the KEY=VALUE arguments before "--" (runner.h); returns the index of "--",
 * or -1 when one is not understood. */
static int watch_parse(struct watch *w, int argc, char **argv, int from)
{
    int i;
    for (i = from; i < argc && strcmp(argv[i], "--") != 0; i++) {
        const char *eq = strchr(argv[i], '=');
        const char *v = eq ? eq + 1 : "";
        size_t k = eq ? (size_t)(eq - argv[i]) : 0;
#define KEY(name) (k == sizeof(name) - 1 && !strncmp(argv[i], name, k))
        if (KEY("cpu_ms")) {
            w->lim.cpu_ms = parse_i64(v);
        } else if (KEY("memory_bytes")) {
            w->lim.memory_bytes = parse_i64(v);
        } else if (KEY("procs")) {
            w->lim.procs = parse_i64(v);
        } else if (KEY("file_bytes")) {
            w->lim.file_bytes = parse_i64(v);
        } else if (KEY("disk_bytes")) {
            w->lim.disk_bytes = parse_i64(v);
        } else if (KEY("disk_known")) {
            w->lim.disk_known = strcmp(v, "-1") ? parse_i64(v) : -1;
        } else if (KEY("disk_dir")) {
            w->lim.disk_dir = v;
        } else if (KEY("launcher_procs")) {
            w->lim.launcher_procs = (int)parse_i64(v);
        } else {
            return -1;
        }
#undef KEY
    }
    return i < argc ? i : -1;
}

static void set_rlimit(int resource, rlim_t soft, rlim_t hard)
{
    struct rlimit r = {soft, hard};
    setrlimit(resource, &r);
}

/* apply_limits runs in the command's process before exec: the kernel's part of the limits. */
static void apply_limits(const struct proc_limits *l)
{
    set_rlimit(RLIMIT_CORE, 0, 0); /* no core files in the workspace */
    if (l->cpu_ms > 0) {
        /* a backstop per process: the watch stops the whole tree at the bound itself */
        rlim_t s = (rlim_t)((l->cpu_ms + 999) / 1000 + 1);
        set_rlimit(RLIMIT_CPU, s, s + 1);
    }
    if (l->memory_bytes > 0) {
        rlim_t m = (rlim_t)l->memory_bytes * 4 + ((rlim_t)256 << 20);
        set_rlimit(RLIMIT_DATA, m, m);
    }
    if (l->file_bytes > 0) {
        set_rlimit(RLIMIT_FSIZE, (rlim_t)l->file_bytes, (rlim_t)l->file_bytes);
    }
}

/* read_small reads a /proc file into buf (NUL-terminated); false when it cannot. */
static bool read_small(const char *path, char *buf, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return false;
    }
    ssize_t n = read(fd, buf, len - 1);
    close(fd);
    if (n <= 0) {
        return false;
    }
    buf[n] = '\0';
    return true;
}

/* status_kib reads the "Name:   N kB" line of a /proc/PID/status text (0 without it). */
static long long status_kib(const char *status, const char *name)
{
    const char *p = strstr(status, name);
    long long kib = 0;
    return p && sscanf(p + strlen(name), "%lld", &kib) == 1 ? kib : 0;
}

/* memory_of is what pid holds of its own, in bytes: its private pages (RssAnon; file pages are
 * not its own) and its proportional share of the shared memory it maps (MAP_SHARED
 * anonymous, memfd, /dev/shm and SysV segments: Pss_Shmem, from smaps_rollup, which walks the
 * page tables, so read only when it maps any: RssShmem). Shared among the command's
 * processes, each counts its part, and the group's sum is the memory once. A kernel that
 * gives no Pss_Shmem gets RssShmem counted whole. 0 when pid is gone. */
static long long memory_of(pid_t pid)
{
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    if (!read_small(path, buf, sizeof(buf))) {
        return 0;
    }
    long long anon = status_kib(buf, "\nRssAnon:"), shmem = status_kib(buf, "\nRssShmem:");
    if (shmem > 0) {
        snprintf(path, sizeof(path), "/proc/%d/smaps_rollup", (int)pid);
        if (read_small(path, buf, sizeof(buf)) && strstr(buf, "\nPss_Shmem:")) {
            shmem = status_kib(buf, "\nPss_Shmem:");
        }
    }
    return (anon + shmem) * 1024;
}

/* add_children appends the children of every thread of pid (at most max in all). */
static int add_children(pid_t pid, long threads, pid_t *out, int n, int max)
{
    char path[96], buf[8192];
    DIR *d = NULL;
    struct dirent *e;
    long tid = pid;
    if (threads > 1) {
        snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
        d = opendir(path);
    }
    for (;;) {
        if (d) {
            while ((e = readdir(d)) && (e->d_name[0] < '1' || e->d_name[0] > '9')) {
            }
            if (!e) {
                break;
            }
            tid = atol(e->d_name);
        }
        snprintf(path, sizeof(path), "/proc/%d/task/%ld/children", (int)pid, tid);
        if (read_small(path, buf, sizeof(buf))) {
            for (char *p = buf; *p && n < max;) {
                char *end;
                long c = strtol(p, &end, 10);
                if (end == p) {
                    break;
                }
                out[n++] = (pid_t)c;
                p = end;
            }
        }
        if (!d) {
            break;
        }
    }
    if (d) {
        closedir(d);
    }
    return n;
}

/* look_at_tree measures every process below the runner; sets w->hit when one of the tree's
 * limits is passed. */
static void look_at_tree(struct watch *w)
{
    struct rusage ru;
    int64_t cpu_ms = 0, mem = 0, tasks = 0;
    getrusage(RUSAGE_CHILDREN, &ru); /* what the processes the runner reaped used */
    cpu_ms = (int64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000 +
             (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000;
    int n = add_children(getpid(), 1, w->pids, 0, WATCH_PIDS_MAX);
    for (int i = 0; i < n; i++) {
        char path[64], buf[1024];
        unsigned long long ut = 0, st = 0;
        long long cut = 0, cst = 0, threads = 1;
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)w->pids[i]);
        const char *rp = read_small(path, buf, sizeof(buf)) ? strrchr(buf, ')') : NULL;
        if (!rp || sscanf(rp + 2,
                          "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %lld %lld %*d "
                          "%*d %lld",
                          &ut, &st, &cut, &cst, &threads) != 5) {
            continue; /* gone meanwhile */
        }
        cpu_ms += (int64_t)(ut + st + (unsigned long long)(cut + cst)) * 1000 / w->ticks_per_s;
        tasks += threads;
        mem += memory_of(w->pids[i]);
        n = add_children(w->pids[i], (long)threads, w->pids, n, WATCH_PIDS_MAX);
    }
    tasks -= w->lim.launcher_procs;
    if (w->lim.procs > 0 && (tasks >= w->lim.procs || n >= WATCH_PIDS_MAX)) {
        w->hit = PROC_LIMIT_PROCS;
        w->used = tasks;
    } else if (w->lim.memory_bytes > 0 && mem > w->lim.memory_bytes) {
        w->hit = PROC_LIMIT_MEMORY;
        w->used = mem;
    } else if (w->lim.cpu_ms > 0 && cpu_ms > w->lim.cpu_ms) {
        w->hit = PROC_LIMIT_CPU;
        w->used = cpu_ms;
    }
}

/* One walk of the workspace: the bytes allocated so far. What it cannot see is not counted:
 * a directory it cannot open or list (for an unprivileged toold, one its owner made
 * unreadable), one deeper than DISK_DEPTH_MAX, and, when its time runs out, the rest. */
struct walk {
    dev_t dev;       /* the workspace's filesystem: the walk does not leave it */
    int64_t until;   /* monotonic ms it stops at (0: none) */
    unsigned long n; /* entries seen */
    int64_t sum;
    bool out_of_time;
};

/* dir_usage adds what the directory dfd (closed here) holds to the walk, without following
 * links or leaving the filesystem. */
static void dir_usage(int dfd, int depth, struct walk *k)
{
    DIR *d = fdopendir(dfd);
    struct dirent *e;
    if (!d) {
        close(dfd);
        return;
    }
    while (!k->out_of_time && (e = readdir(d))) {
        struct stat st;
        if (k->until && ++k->n % 256 == 0 && mono_ms() >= k->until) {
            k->out_of_time = true;
            break;
        }
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
            fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_dev != k->dev) {
            continue;
        }
        k->sum += (int64_t)st.st_blocks * 512;
        if (S_ISDIR(st.st_mode) && depth < DISK_DEPTH_MAX) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0) {
                dir_usage(sub, depth + 1, k);
            }
        }
    }
    closedir(d);
}

/* workspace_size walks the workspace, for at most max_ms (0: no bound); -1 when it cannot be
 * read. *cut (when given): the time ran out (the size is a lower bound). */
static int64_t workspace_size(const struct watch *w, int64_t max_ms, bool *cut)
{
    if (cut) {
        *cut = false;
    }
    struct stat st;
    int fd = open(w->lim.disk_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    struct walk k = {.dev = st.st_dev, .until = max_ms ? mono_ms() + max_ms : 0};
    dir_usage(fd, 0, &k);
    if (cut) {
        *cut = k.out_of_time;
    }
    return k.sum;
}

/* fs_used is the bytes in use on the workspace's filesystem (-1 when unknown). */
static int64_t fs_used(const struct watch *w)
{
    struct statvfs v;
    if (statvfs(w->lim.disk_dir, &v) != 0) {
        return -1;
    }
    return (int64_t)(v.f_blocks - v.f_bfree) * (int64_t)v.f_frsize;
}

/* walk_spacing is the time until the next walk not asked for by statvfs, after one that took
 * took_ms: 20 times that (walks take at most about 5% of the time), and PROC_DISK_WATCH_MS at
 * the least: a small workspace is walked at every look, since the filesystem's use moves with
 * every other writer and remover on it and so cannot clear a command alone. */
static int64_t walk_spacing(int64_t took_ms)
{
    int64_t t = took_ms * 20;
    return t < PROC_DISK_WATCH_MS ? PROC_DISK_WATCH_MS : t;
}

/* watch_disk_start learns the workspace's size when the command starts: from toold (what an
 * earlier command measured) or by a walk. */
static void watch_disk_start(struct watch *w)
{
    if (w->lim.disk_bytes <= 0 || !w->lim.disk_dir || !w->lim.disk_dir[0]) {
        w->lim.disk_bytes = 0;
        return;
    }
    w->fs_used0 = fs_used(w);
    if (w->lim.disk_known < 0 || w->lim.disk_known > w->lim.disk_bytes) {
        /* unknown, or over the bound as last estimated: walked afresh, since an estimate
         * after removals can stay high until the filesystem frees their blocks (ext4 does
         * at its next journal commit), and a stale size over the bound would let this
         * command grow the workspace up to it */
        int64_t t0 = mono_ms(), known = w->lim.disk_known;
        w->lim.disk_known = workspace_size(w, DISK_START_WALK_MS, &w->start_cut);
        w->walk_ms = mono_ms() - t0;
        if (w->start_cut && known > w->lim.disk_known) {
            w->lim.disk_known = known; /* the last estimate knew more than the part walked */
        }
    }
    if (w->lim.disk_known < 0) {
        w->lim.disk_bytes = 0; /* no workspace to measure */
        return;
    }
    w->disk_base = w->lim.disk_known > w->lim.disk_bytes ? w->lim.disk_known : w->lim.disk_bytes;
    w->next_full_walk = w->start_cut ? 0 : mono_ms() + walk_spacing(w->walk_ms);
}

/* look_at_disk checks whether the command grew the workspace past its bound: cheaply from the
 * filesystem's use (statvfs), walking the workspace only when that says it may have, and every
 * DISK_FULL_WALK_MS at the least (the filesystem's use also moves with others' writes). Keeps
 * w->lim.disk_known up to date: the last walk plus what the filesystem gained since. */
static void look_at_disk(struct watch *w, int64_t now, bool exited)
{
    int64_t used = w->fs_used0 >= 0 ? fs_used(w) : -1;
    int64_t grown = used >= 0 ? used - w->fs_used0 : 0;
    bool may_be_over = used < 0 || w->lim.disk_known + grown > w->disk_base;
    /* at the command's end a workspace that walks fast is walked anyway: the filesystem's use
     * moves with everyone's writes and removals, so a filler finished between two looks can
     * hide behind another's deletions there; a slow walk (over 5% of the full-walk period)
     * keeps to its spacing */
    bool walk_at_exit = exited && w->walk_ms * 20 <= DISK_FULL_WALK_MS;
    if (!may_be_over && !walk_at_exit && (exited || now < w->next_full_walk)) {
        return;
    }
    int64_t t0 = mono_ms();
    int64_t size = workspace_size(w, 0, NULL);
    int64_t took = mono_ms() - t0;
    w->walk_ms = took;
    /* walks of a large workspace are spaced out: at most about 5% of the time */
    w->next_full_walk = now + walk_spacing(took);
    if (took * 20 > PROC_DISK_WATCH_MS) {
        w->next_disk = now + took * 20;
    }
    if (size < 0) {
        return;
    }
    if (w->start_cut) {
        /* the first whole walk of a workspace too large to walk before the start, made at
         * the first look: its size stands for the size at the start (what the command wrote
         * meanwhile is not told apart; counted from the filesystem's use, other writers'
         * growth would stop the command, a cleanup too) */
        w->disk_base = size > w->disk_base ? size : w->disk_base;
        w->start_cut = false;
    }
    w->lim.disk_known = size; /* from here on, growth is counted from this walk */
    w->fs_used0 = used;
    if (size > w->disk_base) {
        w->hit = PROC_LIMIT_DISK;
        w->used = size;
        w->after_exit = exited;
    }
}

/* disk_estimate is the workspace's size as the runner last walked it, plus what the
 * filesystem gained since (-1: not measured). What it lost is not taken off: the filesystem's
 * use falls with everyone's removals, and an estimate brought under the bound by another
 * workspace's deletions would let the next command start from the bound instead of from a
 * workspace already past it (and stop it for what an earlier one wrote). Too high an estimate
 * costs a walk at the next start, never a stop. */
static int64_t disk_estimate(const struct watch *w)
{
    if (w->lim.disk_bytes <= 0 || w->start_cut) {
        return -1; /* (a walk cut short at the start measured part of it only) */
    }
    int64_t used = w->fs_used0 >= 0 ? fs_used(w) : -1;
    int64_t grown = used > w->fs_used0 ? used - w->fs_used0 : 0;
    return w->lim.disk_known + grown;
}

/* watch_tick looks at what the command uses when a look is due. */
static void watch_tick(struct watch *w, int64_t now)
{
    if ((w->lim.procs > 0 || w->lim.memory_bytes > 0 || w->lim.cpu_ms > 0) && now >= w->next_tree) {
        w->next_tree = now + PROC_WATCH_MS;
        look_at_tree(w);
    }
    if (!w->hit && w->lim.disk_bytes > 0 && now >= w->next_disk) {
        w->next_disk = now + PROC_DISK_WATCH_MS;
        look_at_disk(w, now, false);
    }
}

void proc_keep_fds_from_commands(int from)
{
    if (syscall(SYS_close_range, (unsigned)from, ~0U, CLOSE_RANGE_CLOEXEC) == 0) {
        return;
    }
    DIR *d = opendir("/proc/self/fd"); /* before Linux 5.11 */
    if (!d) {
        return;
    }
    for (struct dirent *e; (e = readdir(d));) {
        int fd = atoi(e->d_name);
        if (fd >= from && fd != dirfd(d)) {
            fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC);
        }
    }
    closedir(d);
}

/* send_end tells toold how the command ended (struct runner_end) and closes fd 3. */
static void send_end(int fd, const struct watch *w)
{
    struct runner_end end = {(int32_t)w->hit, w->after_exit, w->used, disk_estimate(w)};
    ssize_t n = write(fd, &end, sizeof(end));
    (void)n;
    close(fd);
}

/* start_command vforks and execs cmd (under lim, in a session of its own, with the signal
 * mask empty) and reports to toold on report_fd its pid or why it did not start. Returns the
 * pid, or -1 when it did not start or the report could not be sent (what it started is then
 * killed). */
static pid_t start_command(char **cmd, const struct proc_limits *lim, const sigset_t *empty,
                           int report_fd)
{
    struct runner_report rep = {0, 0};
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) != 0) {
        rep.err = errno;
        if (write(report_fd, &rep, sizeof(rep)) < 0) {
            return -1;
        }
        return -1;
    }
    /* vfork: the child shares this process's memory until the exec, so neither copies its page
     * tables nor makes the runner copy every page it writes afterwards (a tenth of a command's
     * start on the reference VM). The child only makes system calls, writes the exec's errno to
     * the pipe, and _exits. */
    pid_t pid = vfork();
    if (pid == 0) {
        setsid(); /* first: a terminal's stop signal must not reach it while the runner waits */
        sigprocmask(SIG_SETMASK, empty, NULL);
        apply_limits(lim);
        execvp(cmd[0], cmd);
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
    ssize_t sent = write(report_fd, &rep, sizeof(rep));
    if (rep.err || sent != (ssize_t)sizeof(rep)) {
        close(report_fd);
        kill_all();
        return -1;
    }
    return pid;
}

/* drop_stdio points fds 0-2 at /dev/null: the runner holds no end of the command's pipes, so
 * they close when its processes are gone. */
static void drop_stdio(void)
{
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
}

int proc_runner_main(int argc, char **argv)
{
    const int report_fd = 3;
    sigset_t set, empty;
    static struct watch w; /* one per runner process */
    w.lim.disk_known = -1;
    int dashes = argc >= 4 ? watch_parse(&w, argc, argv, 3) : -1;

    if (argc < 5 || strcmp(argv[1], PROC_RUNNER_FLAG) != 0 || dashes < 0 || dashes + 1 >= argc) {
        fprintf(stderr, "usage: %s %s PARENT_PID [KEY=VALUE...] -- COMMAND...\n", argv[0],
                PROC_RUNNER_FLAG);
        return 127;
    }
    char **cmd = argv + dashes + 1;
    w.ticks_per_s = sysconf(_SC_CLK_TCK) > 0 ? sysconf(_SC_CLK_TCK) : 100;
    fcntl(report_fd, F_SETFD, FD_CLOEXEC);
    proc_keep_fds_from_commands(5); /* 4, bwrap's filter, is its to pass on */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != (pid_t)atol(argv[2])) {
        return 127; /* toold is already gone */
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    watch_disk_start(&w);
    sigemptyset(&empty);
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGQUIT);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);

    pid_t pid = start_command(cmd, &w.lim, &empty, report_fd);
    if (pid < 0) {
        return 127;
    }
    drop_stdio();

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
        if (!stopping) {
            watch_tick(&w, now);
            if (w.hit) {
                break; /* past a limit: everything is killed at once */
            }
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
    if (!w.hit && !stopping && w.lim.disk_bytes > 0) {
        look_at_disk(&w, mono_ms(), true); /* a fast filler is over before any look */
    }
    send_end(report_fd, &w);
    if (!main_done || (w.hit && !w.after_exit)) {
        return 128 + SIGKILL;
    }
    if (WIFEXITED(main_status)) {
        return WEXITSTATUS(main_status);
    }
    return WIFSIGNALED(main_status) ? 128 + WTERMSIG(main_status) : 127;
}
