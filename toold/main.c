/* main.c - toold: the sandbox tools daemon.
 *
 * Crash-only: toold keeps no state beyond the workspace directories; a restarted toold serves
 * the same workspaces. Commands that were running when it died were in their own process
 * groups; bwrap sandboxes die with toold (--die-with-parent).
 */
#include "daemon.h"
#include "driver.h"
#include "failpoint.h"
#include "log.h"
#include "proc.h"
#include "ready.h"
#include "rpc.h"
#include "service.h"
#include "tool.h"
#include "workspace.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: toold [options]\n\n"
    "Serves cflue.v1.Tools (read write edit bash grep glob) and cflue.v1.Sandbox over\n"
    "workspaces under --root, one directory per sandbox name. Also serves grpc.health.v1.";

static const char *const drivers[] = {"local", "bwrap", NULL};
static const char *const grep_engines[] = {"auto", "rg", "pcre2", "grep", NULL};

/* toold's own options (the shared ones are in struct daemon) */
struct toold_opts {
    const char *root, *driver, *grep_engine;
    long long default_timeout, max_timeout, max_msg, workers, max_calls, spill_keep, spill_mib;
    long long cpu_s, memory_mib, procs, file_mib, disk_mib; /* per command; 0: none */
    bool no_confine;
};

/* runner_path finds the program commands run under (proc.h): toold-runner next to this binary,
 * else toold itself (a binary replaced or removed since start is still reachable as
 * /proc/self/exe). */
static void runner_path(char *exe, size_t exe_len)
{
    ssize_t n = readlink("/proc/self/exe", exe, exe_len - 1);
    exe[n > 0 ? n : 0] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash && !strstr(exe, " (deleted)") && (size_t)(slash - exe) + 16 < exe_len) {
        strcpy(slash + 1, "toold-runner");
    }
    if (n <= 0 || exe[0] != '/' || access(exe, X_OK) != 0) {
        snprintf(exe, exe_len, "/proc/self/exe");
    }
}

/* open_workspaces prepares the workspace registry and checks the driver can run commands;
 * prints and logs why not. */
static bool open_workspaces(const struct daemon *d, const struct toold_opts *o,
                            struct workspaces **out)
{
    struct cf_error err;
    const struct driver *driver = driver_find(o->driver);
    struct proc_limits limits = {.cpu_ms = o->cpu_s * 1000,
                                 .memory_bytes = o->memory_mib << 20,
                                 .procs = o->procs,
                                 .file_bytes = o->file_mib << 20,
                                 .disk_bytes = o->disk_mib << 20};
    if (workspaces_new(o->root, !o->no_confine, driver, out, &err) != CF_OK) {
        *out = NULL;
        goto failed;
    }
    workspaces_set_limits(*out, &limits);
    if (driver_init(driver, &err) != CF_OK || driver_available(driver, o->root, &err) != CF_OK) {
        workspaces_free(*out);
        *out = NULL;
    }
failed:
    if (!*out) {
        daemon_say(d, 1, "%s", err.msg);
        log_error("start_failed", "driver=%s root=%s", o->driver, o->root);
    }
    return *out != NULL;
}

/* log_limits says what each command may use. */
static void log_limits(const struct toold_opts *o)
{
    log_info("limits",
             "cpu_s=%lld memory_mib=%lld procs=%lld file_mib=%lld disk_mib=%lld spill_mib=%lld "
             "watch_ms=%d",
             o->cpu_s, o->memory_mib, o->procs, o->file_mib, o->disk_mib, o->spill_mib,
             PROC_WATCH_MS);
}

/* root_writable is toold's readiness: a file can be made (and removed) in its root, so new
 * workspaces and the tools' writes can be served. The probe's name holds a '~', which no
 * sandbox name may. */
static bool root_writable(void *arg, char *why, size_t why_len)
{
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/.cflue-ready~%d", (const char *)arg, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    bool ok = fd >= 0 && write(fd, "1", 1) == 1;
    int e = errno;
    if (fd >= 0) {
        close(fd);
        unlink(path);
    }
    if (!ok) {
        snprintf(why, why_len, "the root %s is not writable: %s", (const char *)arg, strerror(e));
    }
    return ok;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], PROC_RUNNER_FLAG)) {
        return proc_runner_main(argc, argv); /* a command's runner (proc.h), not the daemon */
    }
    proc_keep_fds_from_commands(3);
    struct daemon d = DAEMON_INIT("toold", usage, "127.0.0.1:7102");
    struct toold_opts o = {.root = "workspaces",
                           .driver = "local",
                           .grep_engine = "auto",
                           .default_timeout = 300000,
                           .max_timeout = 3600000,
                           .max_msg = 64 << 20,
                           .workers = 8,
                           .max_calls = 256,
                           .spill_keep = 50,
                           .spill_mib = 256,
                           .cpu_s = 600,
                           .memory_mib = 1024,
                           .procs = 128,
                           .file_mib = 1024,
                           .disk_mib = 1024};
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(&d, "address to serve on (host:port or unix:PATH)"),
        CONFIG_OPT_STRING("root", &o.root, "directory holding one workspace per sandbox"),
        CONFIG_OPT_CHOICE("driver", &o.driver, drivers, "how commands run: local or bwrap"),
        DAEMON_OPT_PORT_FILE(&d, "write the bound TCP port here"),
        CONFIG_OPT_INT("bash-timeout-ms", &o.default_timeout, 1000, 86400000,
                       "bash timeout when the model gives none"),
        CONFIG_OPT_INT("bash-max-timeout-ms", &o.max_timeout, 1000, 86400000,
                       "longest timeout a bash call may ask for"),
        CONFIG_OPT_CHOICE("grep-engine", &o.grep_engine, grep_engines, "auto, rg, pcre2 or grep"),
        CONFIG_OPT_INT("spill-keep", &o.spill_keep, 1, 100000,
                       "bash full-output files kept per sandbox (oldest removed)"),
        CONFIG_OPT_INT("spill-max-mib", &o.spill_mib, 1, 1 << 20,
                       "MiB of bash full-output files kept per sandbox (oldest removed)"),
        CONFIG_OPT_INT("limit-cpu-s", &o.cpu_s, 0, 1 << 24,
                       "CPU seconds a command and all it starts may use (0: no limit)"),
        CONFIG_OPT_INT("limit-memory-mib", &o.memory_mib, 0, 1 << 24,
                       "MiB of memory a command's processes may hold together (0: no limit)"),
        CONFIG_OPT_INT("limit-procs", &o.procs, 0, 1 << 22,
                       "processes and threads a command may run at once; reaching it stops "
                       "the command (0: no limit)"),
        CONFIG_OPT_INT("limit-file-mib", &o.file_mib, 0, 1 << 24,
                       "MiB the largest file a command writes may reach (0: no limit)"),
        CONFIG_OPT_INT("limit-disk-mib", &o.disk_mib, 0, 1 << 24,
                       "MiB a workspace may grow to; a command that grows it past this is "
                       "stopped (0: no limit)"),
        CONFIG_OPT_BOOL("no-confine", &o.no_confine,
                        "let paths reach outside the workspace (trusted use only)"),
        CONFIG_OPT_INT("max-message-bytes", &o.max_msg, 1 << 20, 1 << 30,
                       "largest request or response"),
        CONFIG_OPT_INT("max-calls", &o.max_calls, 1, 4096, "concurrent Execute and Exec calls"),
        CONFIG_OPT_INT("workers", &o.workers, 1, 256, "threads serving Sandbox file calls"),
        DAEMON_OPT_GRACE_MS(&d, "how long shutdown waits for calls"),
        DAEMON_OPT_MAX_QUEUE(
            &d, "Sandbox calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"),
        DAEMON_OPT_STREAM_STALL_MS(&d),
        DAEMON_OPT_LOG_LEVEL(&d),
        DAEMON_OPTS_TLS(&d),
        DAEMON_OPT_METRICS(&d),
    };
    int rc = daemon_configure(&d, opts, CONFIG_COUNT(opts), argc, argv);
    if (rc != DAEMON_RUN) {
        return rc;
    }
    char runner[PATH_MAX];
    runner_path(runner, sizeof(runner));
    proc_set_runner(runner);
    struct toold_config cfg = {.bash_default_timeout_ms = o.default_timeout,
                               .bash_max_timeout_ms = o.max_timeout,
                               .grep_engine = o.grep_engine,
                               .spill_keep = (int)o.spill_keep,
                               .spill_max_bytes = (int64_t)o.spill_mib << 20};
    if (cfg.bash_default_timeout_ms > cfg.bash_max_timeout_ms) {
        cfg.bash_default_timeout_ms = cfg.bash_max_timeout_ms;
    }

    rpc_global_init();
    struct workspaces *ws;
    if (!open_workspaces(&d, &o, &ws)) {
        rpc_global_shutdown();
        return 1;
    }
    struct rpc_server_opts ro = {.workers = (int)o.workers,
                                 .max_threads = (int)o.max_calls,
                                 .max_message_bytes = (int)o.max_msg,
                                 .max_queue = (int)d.max_queue,
                                 .stall_ms = d.stream_stall_ms};
    struct rpc_server *srv = rpc_server_new(&ro);
    toold_register(srv, ws, &cfg);
    if (!daemon_serve(&d, srv)) {
        workspaces_free(ws);
        rpc_global_shutdown();
        return 1;
    }
    log_info("listening", "addr=%s port=%d root=%s driver=%s confine=%d", d.listen, d.port, o.root,
             o.driver, (int)!o.no_confine);
    log_limits(&o);
    struct cf_error err;
    struct ready_probe *ready = ready_start(srv, "root", root_writable, (void *)o.root, &err);
    if (!ready) {
        char q[CF_ERROR_MSG_MAX + 8];
        log_warn("ready_probe_off", "err=%s note=\"readiness stays SERVING\"",
                 log_quote(q, sizeof(q), err.msg));
    }

    daemon_wait_for_stop(NULL, NULL);
    ready_stop(ready);
    daemon_stop_serving(&d);
    workspaces_free(ws);
    rpc_global_shutdown();
    log_info("stopped", "code=0");
    return 0;
}
