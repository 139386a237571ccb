/* driver.c - the local and bwrap drivers (driver.h). */
#include "driver.h"

#include "mem.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <seccomp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SECCOMP_FD "4" /* where the command finds the program (driver_cmd.extra_fd) */

/* The system directories a shell needs, read-only, as they are on the host (a directory bound,
 * or a symbolic link such as /bin -> usr/bin made again); missing ones are skipped. */
static const char *const SYSTEM_DIRS[] = {"/usr",   "/bin",   "/sbin",  "/lib",
                                          "/lib32", "/lib64", "/libx32"};

/* What of /etc a command may read: how users, hosts and libraries are found, the shell's
 * profile, locales and time zones, certificates, the alternatives of Debian's commands. Not
 * shadow, gshadow, sudoers, ssh keys, machine-id or anything else of the host's. */
static const char *const ETC_ALLOWED[] = {
    "alternatives", "bash.bashrc",  "ca-certificates", "debian_version",
    "environment",  "gai.conf",     "group",           "host.conf",
    "hosts",        "inputrc",      "ld.so.cache",     "ld.so.conf",
    "ld.so.conf.d", "locale.alias", "localtime",       "magic",
    "magic.mime",   "mime.types",   "nsswitch.conf",   "os-release",
    "passwd",       "profile",      "profile.d",       "protocols",
    "python3",      "services",     "shells",          "ssl",
    "terminfo",     "timezone",     "gitconfig",       "wgetrc",
    "xattr.conf"};

/* The syscalls a sandboxed command is refused (EPERM): changing mounts, tracing or reading
 * other processes, the kernel keyring, BPF, new namespaces, modules, the clock and the machine. */
static const char *const SYSCALLS_REFUSED[] = {"mount",
                                               "umount",
                                               "umount2",
                                               "pivot_root",
                                               "chroot",
                                               "move_mount",
                                               "open_tree",
                                               "fsopen",
                                               "fsconfig",
                                               "fsmount",
                                               "fspick",
                                               "mount_setattr",
                                               "ptrace",
                                               "process_vm_readv",
                                               "process_vm_writev",
                                               "kcmp",
                                               "pidfd_getfd",
                                               "keyctl",
                                               "add_key",
                                               "request_key",
                                               "bpf",
                                               "unshare",
                                               "setns",
                                               "kexec_load",
                                               "kexec_file_load",
                                               "init_module",
                                               "finit_module",
                                               "delete_module",
                                               "reboot",
                                               "swapon",
                                               "swapoff",
                                               "perf_event_open",
                                               "userfaultfd",
                                               "open_by_handle_at",
                                               "iopl",
                                               "ioperm",
                                               "acct",
                                               "quotactl",
                                               "syslog",
                                               "uselib",
                                               "lookup_dcookie",
                                               "vhangup",
                                               "settimeofday",
                                               "clock_settime",
                                               "clock_adjtime",
                                               "adjtimex",
                                               "nfsservctl",
                                               "fanotify_init",
                                               "name_to_handle_at"};

static uint8_t *bpf; /* the compiled seccomp program (driver_init) */

enum { DRIVER_LOCAL, DRIVER_BWRAP };
static const struct driver drivers[];
static size_t bpf_len;

/* ---------- commands ---------- */

static const char *own(struct driver_cmd *c, char *s)
{
    c->owned = mem_realloc(c->owned, sizeof(*c->owned) * (c->n_owned + 1));
    c->owned[c->n_owned++] = s;
    return s;
}

static void cmd_cleanup(struct driver_cmd *c)
{
    for (size_t i = 0; i < c->n_owned; i++) {
        free(c->owned[i]);
    }
    free(c->owned);
    proc_env_free(c->envp);
    if (c->extra_fd > 0) {
        close(c->extra_fd);
    }
    memset(c, 0, sizeof(*c));
}

const char *driver_env_refused(const char *kv)
{
    const char *eq = strchr(kv, '=');
    size_t n = eq ? (size_t)(eq - kv) : strlen(kv);
    if (!eq || !n) {
        return "an environment entry must be NAME=VALUE with a non-empty NAME";
    }
    for (size_t i = 0; i < n; i++) {
        char ch = kv[i];
        if (!(ch == '_' || (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
              (i && ch >= '0' && ch <= '9'))) {
            return "variable names are letters, digits and _, not starting with a digit";
        }
    }
    if (!strncmp(kv, "LD_", 3) || (n == 10 && !strncmp(kv, "GCONV_PATH", n)) ||
        (n == 11 && !strncmp(kv, "MALLOC_TRACE", n))) {
        return "the dynamic loader's variables (LD_*, GCONV_PATH, MALLOC_TRACE) may not be set";
    }
    return NULL;
}

/* tmp_size is the size of a command's /tmp: the smaller of its disk and memory limits (0: no
 * bound). */
static int64_t tmp_size(const struct proc_limits *l)
{
    int64_t m = l->disk_bytes;
    if (l->memory_bytes > 0 && (m <= 0 || l->memory_bytes < m)) {
        m = l->memory_bytes;
    }
    return m > 0 ? m : 0;
}

enum cf_status driver_run(const struct sandbox *sb, const struct proc_limits *limits,
                          const char *cwd, const char *command, const char *const *env,
                          size_t n_env, struct proc_spec *spec, struct proc_result *res,
                          struct cf_error *err)
{
    if (n_env > DRIVER_ENV_MAX) {
        return cf_error_set(err, CF_INVALID, "at most %d environment variables (got %zu)",
                            DRIVER_ENV_MAX, n_env);
    }
    for (size_t i = 0; i < n_env; i++) {
        const char *why = driver_env_refused(env[i]);
        if (why) {
            const char *eq = strchr(env[i], '=');
            return cf_error_set(err, CF_INVALID, "env: %.*s: %s",
                                (int)(eq && eq - env[i] < 128 ? eq - env[i] : 128), env[i], why);
        }
    }
    struct driver_cmd c;
    memset(&c, 0, sizeof(c));
    struct proc_limits lim = limits ? *limits : sb->limits;
    c.tmp_bytes = tmp_size(&lim);
    bool measured = lim.disk_bytes > 0;
    lim.disk_dir = sb->root;
    lim.disk_known = -1;
    if (measured) {
        pthread_mutex_lock((pthread_mutex_t *)&sb->mu);
        lim.disk_known = sb->disk_size;
        pthread_mutex_unlock((pthread_mutex_t *)&sb->mu);
    }
    if (sb->driver == &drivers[DRIVER_BWRAP]) {
        lim.launcher_procs = 2; /* bwrap outside, and its init inside the namespaces */
    }
    enum cf_status rc = sb->driver->prepare(sb, cwd, command, env, n_env, &c, err);
    if (rc == CF_OK) {
        spec->argv = (const char **)c.argv;
        spec->cwd = cwd;
        spec->envp = c.envp;
        spec->extra_fd = c.extra_fd;
        spec->limits = &lim;
        rc = proc_run(spec, res, err);
        spec->limits = NULL;
    }
    if (rc == CF_OK && measured && res->disk_size >= 0) {
        pthread_mutex_lock((pthread_mutex_t *)&sb->mu);
        ((struct sandbox *)sb)->disk_size = res->disk_size;
        pthread_mutex_unlock((pthread_mutex_t *)&sb->mu);
    }
    cmd_cleanup(&c);
    return rc;
}

static enum cf_status local_prepare(const struct sandbox *sb, const char *cwd, const char *command,
                                    const char *const *env, size_t n_env, struct driver_cmd *c,
                                    struct cf_error *err)
{
    (void)sb;
    (void)cwd;
    (void)err;
    c->argv[0] = "bash";
    c->argv[1] = "-c";
    c->argv[2] = command;
    c->argv[3] = NULL;
    c->envp = proc_base_env(env, n_env);
    return CF_OK;
}

/* ---------- bwrap ---------- */

/* seccomp_fd: a new descriptor holding the seccomp program, read from its start. */
static int seccomp_fd(struct cf_error *err)
{
    int fd = memfd_create("cflue-seccomp", MFD_CLOEXEC);
    size_t done = 0;
    while (fd >= 0 && done < bpf_len) {
        ssize_t n = write(fd, bpf + done, bpf_len - done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            close(fd);
            fd = -1;
            break;
        }
        done += (size_t)n;
    }
    if (fd >= 0 && fd <= 4) { /* above the descriptors proc.c moves into place (3 and 4) */
        int high = fcntl(fd, F_DUPFD_CLOEXEC, 10);
        close(fd);
        fd = high;
    }
    if (fd < 0 || lseek(fd, 0, SEEK_SET) != 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
        }
        cf_error_set(err, CF_IO, "the sandbox's seccomp program could not be passed on: %s",
                     strerror(e));
        return -1;
    }
    return fd;
}

struct args {
    struct driver_cmd *c;
    size_t n;
    bool full;
};

static void arg(struct args *a, const char *s)
{
    if (a->n + 2 >= PROC_ARGV_MAX) {
        a->full = true;
        return;
    }
    a->c->argv[a->n++] = s;
}

static void arg3(struct args *a, const char *x, const char *y, const char *z)
{
    arg(a, x);
    arg(a, y);
    arg(a, z);
}

/* system_dirs binds the system directories, and a few files of /etc, read-only. */
static void system_dirs(struct args *a)
{
    struct stat st;
    for (size_t i = 0; i < sizeof(SYSTEM_DIRS) / sizeof(*SYSTEM_DIRS); i++) {
        const char *d = SYSTEM_DIRS[i];
        char target[PATH_MAX];
        ssize_t n;
        if (lstat(d, &st) != 0) {
            continue;
        }
        if (S_ISLNK(st.st_mode) && (n = readlink(d, target, sizeof(target) - 1)) > 0) {
            target[n] = '\0';
            arg3(a, "--symlink", own(a->c, mem_strdup(target)), d);
        } else if (S_ISDIR(st.st_mode)) {
            arg3(a, "--ro-bind", d, d);
        }
    }
    arg(a, "--tmpfs");
    arg(a, "/etc");
    for (size_t i = 0; i < sizeof(ETC_ALLOWED) / sizeof(*ETC_ALLOWED); i++) {
        const char *p = own(a->c, mem_asprintf("/etc/%s", ETC_ALLOWED[i]));
        arg3(a, "--ro-bind-try", p, p);
    }
    arg(a, "--remount-ro");
    arg(a, "/etc");
}

/* setenv_inside sets the command's environment inside the sandbox only: bwrap itself, and the
 * runner before it, start with the clean base. */
static void setenv_inside(struct args *a, const struct sandbox *sb, const char *const *env,
                          size_t n_env)
{
    char **inside = proc_base_env(env, n_env);
    arg(a, "--clearenv");
    for (char **p = inside; *p; p++) {
        char *eq = strchr(*p, '=');
        if (!eq || !strncmp(*p, "HOME=", 5) || !strncmp(*p, "TMPDIR=", 7)) {
            continue; /* set below: the host's are not there */
        }
        *eq = '\0';
        arg3(a, "--setenv", own(a->c, mem_strdup(*p)), own(a->c, mem_strdup(eq + 1)));
    }
    proc_env_free(inside);
    arg3(a, "--setenv", "HOME", sb->root);
    arg3(a, "--setenv", "TMPDIR", "/tmp");
}

static enum cf_status bwrap_prepare(const struct sandbox *sb, const char *cwd, const char *command,
                                    const char *const *env, size_t n_env, struct driver_cmd *c,
                                    struct cf_error *err)
{
    struct args a = {.c = c};
    if (!bpf) {
        return cf_error_set(err, CF_INTERNAL, "the bwrap driver was not initialized");
    }
    arg(&a, "bwrap");
    arg(&a, "--unshare-all"); /* user (with --unshare-user below), net, ipc, pid, uts, cgroup */
    arg(&a, "--unshare-user");
    arg(&a, "--disable-userns");
    arg3(&a, "--cap-drop", "ALL", "--die-with-parent");
    arg(&a, "--new-session");
    system_dirs(&a);
    arg(&a, "--dev");
    arg(&a, "/dev");
    arg(&a, "--proc");
    arg(&a, "/proc");
    /* /tmp and /dev/shm are memory: each bounded by the disk and memory limits (bwrap's /dev
     * is a tmpfs of half the host's memory, its shm directory with it) */
    const char *tmp_dirs[] = {"/tmp", "/dev/shm"};
    for (size_t i = 0; i < sizeof(tmp_dirs) / sizeof(tmp_dirs[0]); i++) {
        if (c->tmp_bytes > 0) {
            arg3(&a, "--size", own(c, mem_asprintf("%lld", (long long)c->tmp_bytes)), "--tmpfs");
        } else {
            arg(&a, "--tmpfs");
        }
        arg(&a, tmp_dirs[i]);
    }
    arg3(&a, "--bind", sb->root, sb->root);
    arg(&a, "--remount-ro"); /* the sandbox's own root: nothing but /tmp and the workspace */
    arg(&a, "/");
    arg(&a, "--chdir");
    arg(&a, cwd);
    setenv_inside(&a, sb, env, n_env);
    arg(&a, "--seccomp");
    arg(&a, SECCOMP_FD);
    arg(&a, "--");
    arg3(&a, "bash", "-c", command);
    c->argv[a.n] = NULL;
    if (a.full) {
        return cf_error_set(err, CF_INVALID, "the command's environment is too large for bwrap");
    }
    c->envp = proc_base_env(NULL, 0);
    c->extra_fd = seccomp_fd(err);
    return c->extra_fd < 0 ? (c->extra_fd = 0, err->code) : CF_OK;
}

/* build_bpf compiles the seccomp program: everything allowed except SYSCALLS_REFUSED, clone
 * with a new namespace's flag, clone3 (ENOSYS: glibc falls back to clone, whose flags the
 * filter can read) and TIOCSTI (typing into a terminal); syscalls of another architecture
 * kill the process (libseccomp's default). */
static enum cf_status build_bpf(struct cf_error *err)
{
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    int rc = ctx ? 0 : -ENOMEM;
    const uint64_t ns_flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET |
                              CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP;
    for (size_t i = 0; rc == 0 && i < sizeof(SYSCALLS_REFUSED) / sizeof(*SYSCALLS_REFUSED); i++) {
        int nr = seccomp_syscall_resolve_name(SYSCALLS_REFUSED[i]);
        if (nr != __NR_SCMP_ERROR) {
            rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), nr, 0);
        }
    }
    for (int bit = 0; rc == 0 && bit < 64; bit++) { /* clone with any namespace flag */
        uint64_t flag = (uint64_t)1 << bit;
        if (ns_flags & flag) {
            rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                                  SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag));
        }
    }
    if (rc == 0) {
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0);
    }
    if (rc == 0) {
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                              SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCSTI));
    }
    int fd = rc == 0 ? memfd_create("cflue-seccomp-build", MFD_CLOEXEC) : -1;
    if (rc == 0 && fd < 0) {
        rc = -errno;
    }
    if (rc == 0) {
        rc = seccomp_export_bpf(ctx, fd);
    }
    off_t len = rc == 0 ? lseek(fd, 0, SEEK_END) : -1;
    if (rc == 0 && len > 0) {
        bpf = mem_alloc((size_t)len);
        bpf_len = (size_t)len;
        if (pread(fd, bpf, bpf_len, 0) != len) {
            rc = -EIO;
        }
    } else if (rc == 0) {
        rc = -EIO;
    }
    if (fd >= 0) {
        close(fd);
    }
    seccomp_release(ctx);
    if (rc != 0) {
        free(bpf);
        bpf = NULL;
        return cf_error_set(err, CF_UNAVAILABLE, "the sandbox's seccomp program: %s",
                            strerror(-rc));
    }
    return CF_OK;
}

/* ---------- the table ---------- */

static const struct driver drivers[] = {
    [DRIVER_LOCAL] = {"local", local_prepare},
    [DRIVER_BWRAP] = {"bwrap", bwrap_prepare},
};

const struct driver *driver_find(const char *name)
{
    for (size_t i = 0; i < sizeof(drivers) / sizeof(drivers[0]); i++) {
        if (!strcmp(drivers[i].name, name)) {
            return &drivers[i];
        }
    }
    return NULL;
}

enum cf_status driver_init(const struct driver *d, struct cf_error *err)
{
    if (strcmp(d->name, "bwrap") != 0 || bpf) {
        return CF_OK;
    }
    return build_bpf(err);
}

static bool collect(void *ctx, const char *p, size_t n)
{
    char *msg = ctx;
    size_t have = strlen(msg);
    if (have + 1 < 256) {
        snprintf(msg + have, 256 - have, "%.*s", (int)n, p);
    }
    return true;
}

enum cf_status driver_available(const struct driver *d, const char *root, struct cf_error *err)
{
    if (strcmp(d->name, "bwrap") != 0) {
        return CF_OK;
    }
    struct sandbox probe = {.root_fd = -1, .driver = d};
    snprintf(probe.root, sizeof(probe.root), "%s", root);
    char output[256] = "";
    struct proc_spec spec = {.timeout_ms = 10000, .on_output = collect, .ctx = output};
    struct proc_result res;
    enum cf_status rc = driver_run(&probe, NULL, root, "true", NULL, 0, &spec, &res, err);
    if (rc != CF_OK) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "the bwrap driver needs bubblewrap (apt-get install bubblewrap): %s",
                            err->msg);
    }
    if (res.exit_code != 0) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "bubblewrap cannot create a sandbox here (exit %d): %s", res.exit_code,
                            output);
    }
    return CF_OK;
}
