/* Unit tests of toold/: path normalization and confinement, per-path locks, process runs. */
#include "../check.h"

#include "buf.h"
#include "clock.h"
#include "dirpage.h"
#include "driver.h"
#include "locks.h"
#include "proc.h"
#include "walk.h"
#include "workspace.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static struct sandbox *sb;

static const char *rel(const char *path)
{
    static char out[WS_PATH_MAX];
    struct cf_error err;
    if (ws_relative(sb, path, out, sizeof(out), &err) != CF_OK) {
        snprintf(out, sizeof(out), "ERR");
    }
    return out;
}

static void test_paths(void)
{
    char abs[PATH_MAX + 16];
    CHECK_STR(rel("a/b.txt"), "a/b.txt");
    CHECK_STR(rel("./a//b/../c"), "a/c");
    CHECK_STR(rel("."), ".");
    CHECK_STR(rel("a/.."), ".");
    CHECK_STR(rel(".."), "ERR");
    CHECK_STR(rel("a/../../b"), "ERR");
    CHECK_STR(rel("/etc/passwd"), "ERR");
    CHECK_STR(rel(""), "ERR");
    snprintf(abs, sizeof(abs), "%s/x/y", sb->root);
    CHECK_STR(rel(abs), "x/y");
    snprintf(abs, sizeof(abs), "%s", sb->root);
    CHECK_STR(rel(abs), ".");
    snprintf(abs, sizeof(abs), "%sother", sb->root); /* a sibling sharing the prefix */
    CHECK_STR(rel(abs), "ERR");
}

static const char *rel_from(const char *base, const char *path)
{
    static char out[WS_PATH_MAX];
    struct cf_error err;
    if (ws_relative_from(sb, base, path, out, sizeof(out), &err) != CF_OK) {
        snprintf(out, sizeof(out), "ERR");
    }
    return out;
}

static const char *shown(const char *base, const char *rel_path)
{
    static char out[WS_PATH_MAX];
    ws_shown_path(base, rel_path, out, sizeof(out));
    return out;
}

/* a call's working directory: relative paths start there, ".." may climb to the root only */
static void test_paths_from_a_directory(void)
{
    char abs[PATH_MAX + 16];
    CHECK_STR(rel_from("pkg", "a.txt"), "pkg/a.txt");
    CHECK_STR(rel_from("pkg/sub", "../b"), "pkg/b");
    CHECK_STR(rel_from("pkg", ".."), ".");
    CHECK_STR(rel_from("pkg", "../.."), "ERR");
    CHECK_STR(rel_from(".", "x"), "x");
    CHECK_STR(rel_from(NULL, "x"), "x");
    snprintf(abs, sizeof(abs), "%s/top", sb->root);
    CHECK_STR(rel_from("pkg", abs), "top"); /* absolute paths are not moved */
    CHECK_STR(shown("pkg", "pkg/a.txt"), "a.txt");
    CHECK_STR(shown("pkg", "pkg"), ".");
    CHECK_STR(shown("pkg", "top.txt"), "../top.txt");
    CHECK_STR(shown("pkg/sub", "pkg/x/y"), "../x/y");
    CHECK_STR(shown("pkg/sub", "."), "../..");
    CHECK_STR(shown("pkg", "pkgs/a"), "../pkgs/a"); /* a sibling sharing the prefix */
    CHECK_STR(shown(".", "a/b"), "a/b");
    CHECK_STR(shown(NULL, "a/b"), "a/b");
    CHECK_STR(shown("pkg", "/abs/path"), "/abs/path");
}

static void test_confined_io(void)
{
    struct cf_error err;
    int fd;
    CHECK(ws_write_file(sb, "deep/dir/f.txt", "abc", 3, 0, "deep/dir/f.txt", &err) == CF_OK);
    CHECK(ws_open(sb, "deep/dir/f.txt", O_RDONLY, 0, "f", &fd, &err) == CF_OK);
    char buf[8] = {0};
    CHECK(read(fd, buf, sizeof(buf)) == 3 && !strcmp(buf, "abc"));
    close(fd);
    char link[PATH_MAX + 16];
    snprintf(link, sizeof(link), "%s/escape", sb->root);
    CHECK(symlink("/", link) == 0);
    CHECK(ws_open(sb, "escape/etc/passwd", O_RDONLY, 0, "escape/etc/passwd", &fd, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "outside the sandbox") != NULL);
    char target[64], through[96];
    snprintf(target, sizeof(target), "/tmp/cflue-escape-%d", (int)getpid());
    snprintf(through, sizeof(through), "escape%s", target);
    CHECK(ws_write_file(sb, through, "x", 1, 0, "p", &err) != CF_OK);
    CHECK(access(target, F_OK) != 0);
    unlink(target);
    CHECK(ws_open(sb, "missing", O_RDONLY, 0, "missing", &fd, &err) == CF_NOT_FOUND);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* dirpage: pages cut at names make the sorted listing, whatever readdir's order; memory holds
 * one page; names added or removed between pages never repeat or skip the others */
struct walked {
    char names[64][WS_PATH_MAX];
    int n;
};

static bool walked_visit(void *ctx, const char *rel_path, int dirfd, const char *name)
{
    (void)dirfd;
    (void)name;
    struct walked *w = ctx;
    if (w->n < 64) {
        snprintf(w->names[w->n++], WS_PATH_MAX, "%s", rel_path);
    }
    return true;
}

static bool walked_has(const struct walked *w, const char *path)
{
    for (int i = 0; i < w->n; i++) {
        if (!strcmp(w->names[i], path)) {
            return true;
        }
    }
    return false;
}

static void put_file(const char *rel_path, const char *text)
{
    char path[PATH_MAX + WS_PATH_MAX];
    snprintf(path, sizeof(path), "%s/%s", sb->root, rel_path);
    for (char *p = path + strlen(sb->root) + 1; (p = strchr(p, '/')); p++) {
        *p = '\0';
        (void)mkdir(path, 0755);
        *p = '/';
    }
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Ignore rules with a "**" segment: any number of directories between, a trailing one everything
 * inside, runs of them one; a hostile line of thousands of "**" segments over a deep tree
 * is matched in bounded time and stack (it overflowed the stack, one recursion a "**", and
 * took exponential time short of that). */
static void test_walk_double_star(void)
{
    char deep[WS_PATH_MAX] = "ws/deep";
    for (int i = 0; i < 40; i++) {
        strcat(deep, "/d");
    }
    strcat(deep, "/leaf.txt");
    put_file("ws/a/b", "x");
    put_file("ws/a/x/y/b", "x");
    put_file("ws/a/bb", "x");
    put_file("ws/keep/one", "x");
    put_file("ws/keep/sub/two", "x");
    put_file("ws/m/n/o/p", "x");
    put_file(deep, "x");
    struct buf hostile;
    buf_init(&hostile, 1 << 20);
    for (int i = 0; i < 3000; i++) {
        CHECK(buf_append_str(&hostile, "**/") == CF_OK);
    }
    CHECK(buf_append_str(&hostile, "zzz\n") == CF_OK);
    for (int i = 0; i < 30; i++) {
        CHECK(buf_append_str(&hostile, "d/**/") == CF_OK);
    }
    CHECK(buf_append_str(&hostile, "nomatch\na/**/b\nkeep/**\nm/**/**/**/p\n") == CF_OK);
    put_file("ws/.gitignore", buf_cstr(&hostile));
    buf_cleanup(&hostile);
    struct walked w = {0};
    struct walk_opts o = {.gitignore = true, .visit = walked_visit, .ctx = &w};
    struct cf_error err;
    int64_t t0 = clock_mono_ms();
    CHECK(walk_tree(sb, "ws", "ws", &o, &err) == CF_OK);
    CHECK(clock_mono_ms() - t0 < 5000);
    CHECK(!walked_has(&w, "ws/a/b"));     /* a, any directories, b: none between */
    CHECK(!walked_has(&w, "ws/a/x/y/b")); /* two between */
    CHECK(walked_has(&w, "ws/a/bb"));
    CHECK(!walked_has(&w, "ws/keep/one")); /* keep and a trailing double star */
    CHECK(!walked_has(&w, "ws/keep/sub/two"));
    CHECK(!walked_has(&w, "ws/m/n/o/p")); /* a run of "**" is one */
    CHECK(walked_has(&w, deep + 0));
    CHECK(walked_has(&w, "ws/.gitignore"));
}

static int g_fsync_errno; /* set: the next fsync fails with it, once */

int __real_fsync(int fd);
int __wrap_fsync(int fd);
int __wrap_fsync(int fd)
{
    if (g_fsync_errno) {
        errno = g_fsync_errno;
        g_fsync_errno = 0;
        return -1;
    }
    return __real_fsync(fd);
}

static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d && (e = readdir(d));) {
        n += e->d_name[0] != '.';
    }
    if (d) {
        closedir(d);
    }
    return n;
}

/* A write whose sync fails (EIO, a full disk on NFS) is refused, leaves the file as it was,
 * and keeps no descriptor of the copy it wrote (whose blocks it would hold until exit). */
static void test_write_sync_failure(void)
{
    struct cf_error err;
    char path[PATH_MAX + 32], text[16] = "";
    CHECK(ws_write_file(sb, "synced.txt", "old", 3, 0, "synced.txt", &err) == CF_OK);
    int before = open_fds();
    g_fsync_errno = EIO;
    CHECK(ws_write_file(sb, "synced.txt", "new!", 4, 0, "synced.txt", &err) == CF_IO);
    CHECK(strstr(err.msg, "synced.txt") != NULL);
    CHECK(open_fds() == before);
    snprintf(path, sizeof(path), "%s/synced.txt", sb->root);
    FILE *f = fopen(path, "r");
    CHECK(f && fgets(text, sizeof(text), f));
    if (f) {
        fclose(f);
    }
    CHECK_STR(text, "old");
    /* and no copy is left beside it */
    DIR *d = opendir(sb->root);
    for (struct dirent *e; d && (e = readdir(d));) {
        CHECK(strstr(e->d_name, ".cflue-") == NULL);
    }
    if (d) {
        closedir(d);
    }
}

static void test_dirpage(void)
{
    enum { N = 2500 };
    char dir[PATH_MAX + 16], path[PATH_MAX + 64];
    static char names[N][16];
    char *want[N];
    struct cf_error err;
    struct dirpage p;
    snprintf(dir, sizeof(dir), "%s/pages", sb->root);
    CHECK(mkdir(dir, 0755) == 0);
    int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(dirpage_select(fd, "", 10, NULL, NULL, &p, &err) == CF_OK);
    CHECK(p.n == 0 && !p.more);
    dirpage_cleanup(&p);
    for (int i = 0; i < N; i++) {
        /* a scrambled order of creation, names of several lengths */
        snprintf(names[i], sizeof(names[i]), "%x%s", (unsigned)(i * 7919u % 10007u),
                 i % 3 ? "" : ".t");
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
        CHECK(f >= 0);
        close(f);
        want[i] = names[i];
    }
    qsort(want, N, sizeof(char *), cmp_str);
    char after[64] = "";
    size_t got = 0;
    bool ok = true;
    for (int pages = 0; pages < 100; pages++) {
        CHECK(dirpage_select(fd, after, 100, NULL, NULL, &p, &err) == CF_OK);
        for (size_t i = 0; i < p.n; i++) {
            ok = ok && got < N && !strcmp(p.names[i], want[got]);
            got++;
        }
        CHECK(p.n == 100 || !p.more);
        bool more = p.more;
        if (p.n) {
            snprintf(after, sizeof(after), "%s", p.names[p.n - 1]);
        }
        dirpage_cleanup(&p);
        if (!more) {
            break;
        }
        if (pages == 3) { /* change the directory between pages */
            snprintf(path, sizeof(path), "%s/%s", dir, want[got]); /* next not yet listed */
            CHECK(unlink(path) == 0);
            memmove(&want[got], &want[got + 1], sizeof(char *) * (N - got - 1));
            snprintf(path, sizeof(path), "%s/%s", dir, want[0]); /* one already listed */
            CHECK(unlink(path) == 0);
        }
    }
    CHECK(ok);
    CHECK(got == N - 1);
    /* the whole directory in one page, and a position past every name */
    CHECK(dirpage_select(fd, "", N, NULL, NULL, &p, &err) == CF_OK);
    CHECK(p.n == N - 2 && !p.more);
    dirpage_cleanup(&p);
    CHECK(dirpage_select(fd, "\xff", 10, NULL, NULL, &p, &err) == CF_OK);
    CHECK(p.n == 0 && !p.more);
    dirpage_cleanup(&p);
    close(fd);
}

struct order {
    struct lock_table *t;
    uint64_t ticket;
    int id;
    int *log;
    int *n;
    pthread_mutex_t *mu;
};

static void *take_turn(void *arg)
{
    struct order *o = arg;
    locks_wait(o->t, "same", o->ticket);
    pthread_mutex_lock(o->mu);
    o->log[(*o->n)++] = o->id;
    pthread_mutex_unlock(o->mu);
    clock_sleep_ms(2);
    locks_release(o->t, "same");
    return NULL;
}

static void test_locks(void)
{
    struct lock_table *t = locks_new();
    int log[8], n = 0;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    struct order o[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        o[i] = (struct order){t, locks_ticket(t, "same"), i, log, &n, &mu};
    }
    for (int i = 7; i >= 0; i--) { /* start in reverse: the tickets still decide */
        pthread_create(&th[i], NULL, take_turn, &o[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
    }
    CHECK(n == 8);
    for (int i = 0; i < 8; i++) {
        CHECK(log[i] == i);
    }
    /* another key never waits */
    uint64_t k = locks_ticket(t, "other");
    locks_wait(t, "other", k);
    locks_release(t, "other");
    locks_free(t);
}

static bool collect(void *ctx, const char *p, size_t n)
{
    struct buf *b = ctx;
    buf_append(b, p, n);
    return true;
}

static void test_proc(void)
{
    struct cf_error err;
    struct proc_result r;
    struct buf out;
    char **env = proc_base_env((const char *const[]){"CFLUE_X=42"}, 1);
    const char *argv[] = {"bash", "-c", "echo out; echo err >&2; echo $CFLUE_X; exit 7", NULL};
    buf_init(&out, 4096);
    struct proc_spec spec = {.argv = argv,
                             .cwd = sb->root,
                             .envp = env,
                             .timeout_ms = 5000,
                             .on_output = collect,
                             .ctx = &out};
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.exit_code == 7 && !r.timed_out);
    CHECK_STR(buf_cstr(&out), "out\nerr\n42\n");

    /* a timeout kills the group, background children included, and keeps earlier output */
    buf_reset(&out);
    const char *argv2[] = {"bash", "-c", "echo before; sleep 30 & sleep 30", NULL};
    spec.argv = argv2;
    spec.timeout_ms = 300;
    int64_t t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.timed_out && r.exit_code == 124);
    CHECK(clock_mono_ms() - t0 < 3000);
    CHECK_STR(buf_cstr(&out), "before\n");

    /* the main process exits while a background job holds the pipe: the call still ends */
    buf_reset(&out);
    const char *argv3[] = {"bash", "-c", "sleep 30 & echo done", NULL};
    spec.argv = argv3;
    spec.timeout_ms = 10000;
    t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(!r.timed_out && r.exit_code == 0);
    CHECK(clock_mono_ms() - t0 < 3000);

    /* a program that cannot start: refused at spawn, or (under valgrind, which emulates
     * posix_spawn with fork) a child that exits 127 */
    const char *argv4[] = {"/nonexistent/cflue-binary", NULL};
    spec.argv = argv4;
    enum cf_status st = proc_run(&spec, &r, &err);
    CHECK(st == CF_UNAVAILABLE || (st == CF_OK && r.exit_code == 127));
    buf_cleanup(&out);
    proc_env_free(env);
}

/* refuse_after_first takes one chunk and then refuses the rest (the caller wants no more). */
static bool refuse_after_first(void *ctx, const char *p, size_t n)
{
    struct buf *b = ctx;
    bool first = b->len == 0;
    buf_append(b, p, n);
    return first;
}

static int cancel_polls;
static struct buf stderr_seen;

static bool collect_stderr(void *ctx, const char *p, size_t n)
{
    (void)ctx;
    buf_append(&stderr_seen, p, n);
    return true;
}

static bool cancel_soon(void *ctx)
{
    (void)ctx;
    return ++cancel_polls > 2;
}

/* The steps of proc_run: input fed on stdin, stderr on its own sink, a sink that refuses
 * output and a caller that cancels both stop the command (cancelled, not timed out). */
static void test_proc_streams(void)
{
    struct cf_error err;
    struct proc_result r;
    struct buf out;
    char **env = proc_base_env(NULL, 0);
    buf_init(&out, 4096);
    buf_init(&stderr_seen, 4096);
    const char *argv[] = {"bash", "-c", "read line; echo got $line; echo oops >&2", NULL};
    struct proc_spec spec = {.argv = argv,
                             .cwd = sb->root,
                             .envp = env,
                             .timeout_ms = 5000,
                             .stdin_data = "hello\n",
                             .stdin_len = 6,
                             .on_output = collect,
                             .on_stderr = collect_stderr,
                             .ctx = &out};
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.exit_code == 0 && !r.timed_out && !r.cancelled);
    CHECK_STR(buf_cstr(&out), "got hello\n");
    CHECK_STR(buf_cstr(&stderr_seen), "oops\n");

    /* stdin without data is /dev/null: read fails at once */
    buf_reset(&out);
    spec.stdin_data = NULL;
    spec.stdin_len = 0;
    spec.on_stderr = NULL;
    const char *argv2[] = {"bash", "-c", "read line || echo eof", NULL};
    spec.argv = argv2;
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK_STR(buf_cstr(&out), "eof\n");

    /* a sink that refuses output stops a command that would run for a long time */
    buf_reset(&out);
    const char *argv3[] = {"bash", "-c", "while :; do echo y; sleep 0.05; done", NULL};
    spec.argv = argv3;
    spec.on_output = refuse_after_first;
    int64_t t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.cancelled && !r.timed_out);
    CHECK(clock_mono_ms() - t0 < 4000);

    /* a caller that goes away */
    buf_reset(&out);
    cancel_polls = 0;
    spec.on_output = collect;
    spec.cancelled = cancel_soon;
    t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.cancelled && !r.timed_out);
    CHECK(clock_mono_ms() - t0 < 4000);
    buf_cleanup(&out);
    buf_cleanup(&stderr_seen);
    proc_env_free(env);
}

/* orphan_pid is the pid the orphan wrote to pidfile, or 0 when it never ran. */
static int orphan_pid(const char *pidfile)
{
    char text[32] = "";
    FILE *f = fopen(pidfile, "r");
    if (!f) {
        return 0;
    }
    bool got = fgets(text, sizeof(text), f) != NULL;
    fclose(f);
    return got && atoi(text) > 1 ? atoi(text) : 0;
}

/* orphan_killed: the orphan ran (wrote its pid) and is gone now. */
static bool orphan_killed(const char *pidfile)
{
    int pid = orphan_pid(pidfile);
    return pid > 1 && kill(pid, 0) != 0;
}

/* A child that leaves the session (setsid) keeps the output pipe open; it must neither hold
 * the call past the command's end or deadline nor be left running (defect 5). */
static void test_proc_setsid(void)
{
    struct cf_error err;
    struct proc_result r;
    struct buf out;
    char **env = proc_base_env(NULL, 0);
    char pidfile[PATH_MAX + 16], cmd[PATH_MAX * 2];
    snprintf(pidfile, sizeof(pidfile), "%s/orphan.pid", sb->root);
    buf_init(&out, 4096);
    const char *argv[] = {"bash", "-c", cmd, NULL};
    struct proc_spec spec = {.argv = argv,
                             .cwd = sb->root,
                             .envp = env,
                             .timeout_ms = 10000,
                             .on_output = collect,
                             .ctx = &out};

    snprintf(cmd, sizeof(cmd), "setsid sh -c 'echo $$ > %s; exec sleep 300' & echo hi", pidfile);
    int64_t t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(!r.timed_out && r.exit_code == 0);
    CHECK(clock_mono_ms() - t0 < 3000);
    CHECK_STR(buf_cstr(&out), "hi\n");
    CHECK(orphan_killed(pidfile));

    /* an orphan from a subshell, and a deadline that passes while the main process runs */
    unlink(pidfile);
    buf_reset(&out);
    snprintf(cmd, sizeof(cmd), "(setsid sh -c 'echo $$ > %s; exec sleep 300' &) ; sleep 5",
             pidfile);
    spec.timeout_ms = 1000;
    t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.timed_out && r.exit_code == 124);
    CHECK(clock_mono_ms() - t0 < 4000);
    CHECK(orphan_killed(pidfile));

    /* a process that ignores SIGTERM is killed after the grace */
    buf_reset(&out);
    snprintf(cmd, sizeof(cmd),
             "(setsid sh -c 'trap \"\" TERM; echo $$ > %s; sleep 300' &); "
             "sleep 5",
             pidfile);
    t0 = clock_mono_ms();
    CHECK(proc_run(&spec, &r, &err) == CF_OK);
    CHECK(r.timed_out && r.exit_code == 124);
    CHECK(clock_mono_ms() - t0 < 6000);
    CHECK(orphan_killed(pidfile));
    buf_cleanup(&out);
    proc_env_free(env);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], PROC_RUNNER_FLAG)) {
        return proc_runner_main(argc, argv);
    }
    char root[] = "/tmp/cflue-test-toold-XXXXXX";
    struct workspaces *ws;
    struct cf_error err;
    CHECK(mkdtemp(root) != NULL);
    CHECK(workspaces_new(root, true, driver_find("local"), &ws, &err) == CF_OK);
    CHECK(workspaces_get(ws, "sb1", &sb, &err) == CF_OK);
    CHECK(workspaces_get(ws, "../x", &sb, &err) == CF_INVALID);
    CHECK(workspaces_get(ws, "sb1", &sb, &err) == CF_OK);
    test_paths();
    test_paths_from_a_directory();
    test_confined_io();
    test_dirpage();
    test_walk_double_star();
    test_write_sync_failure();
    test_locks();
    test_proc();
    test_proc_streams();
    /* this test binary is the runner too; by its real path (under valgrind, /proc/self/exe
     * given to exec would start valgrind's tool, while readlink names the client) */
    char self[PATH_MAX];
    ssize_t self_len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    CHECK(self_len > 0);
    self[self_len > 0 ? self_len : 0] = '\0';
    proc_set_runner(self);
    test_proc();
    test_proc_streams();
    test_proc_setsid();
    workspaces_free(ws);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    CHECK(system(cmd) == 0);
    return check_done("test_toold");
}
