/* main.c - toold: the sandbox tools daemon.
 *
 * Crash-only: toold keeps no state beyond the workspace directories; a restarted toold serves
 * the same workspaces. Commands that were running when it died were in their own process
 * groups; bwrap sandboxes die with toold (--die-with-parent).
 */
#include "config.h"
#include "daemon.h"
#include "driver.h"
#include "failpoint.h"
#include "log.h"
#include "proc.h"
#include "rpc.h"
#include "service.h"
#include "tool.h"
#include "workspace.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: toold [options]\n\n"
    "Serves cflue.v1.Tools (read write edit bash grep glob) and cflue.v1.Sandbox over\n"
    "workspaces under --root, one directory per sandbox name. Also serves grpc.health.v1.";

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], PROC_RUNNER_FLAG)) {
        return proc_runner_main(argc, argv); /* a command's runner (proc.h), not the daemon */
    }
    const char *listen = "127.0.0.1:7102", *root = "workspaces", *driver_name = "local";
    const char *level = "info", *port_file = "", *grep_engine = "auto";
    long long default_timeout = 300000, max_timeout = 3600000, max_msg = 64 << 20;
    long long workers = 8, grace_ms = 5000, max_calls = 256, spill_keep = 50, max_queue = 256;
    bool no_confine = false, help;
    struct cf_error err;
    const struct config_opt opts[] = {
        {"listen", CONFIG_STRING, &listen, 0, 0, "address to serve on (host:port or unix:PATH)"},
        {"root", CONFIG_STRING, &root, 0, 0, "directory holding one workspace per sandbox"},
        {"driver", CONFIG_STRING, &driver_name, 0, 0, "how commands run: local or bwrap"},
        {"port-file", CONFIG_STRING, &port_file, 0, 0, "write the bound TCP port here"},
        {"bash-timeout-ms", CONFIG_INT, &default_timeout, 1000, 86400000,
         "bash timeout when the model gives none"},
        {"bash-max-timeout-ms", CONFIG_INT, &max_timeout, 1000, 86400000,
         "longest timeout a bash call may ask for"},
        {"grep-engine", CONFIG_STRING, &grep_engine, 0, 0, "auto, rg, pcre2 or grep"},
        {"spill-keep", CONFIG_INT, &spill_keep, 1, 100000,
         "bash full-output files kept per sandbox (oldest removed)"},
        {"no-confine", CONFIG_BOOL, &no_confine, 0, 0,
         "let paths reach outside the workspace (trusted use only)"},
        {"max-message-bytes", CONFIG_INT, &max_msg, 1 << 20, 1 << 30,
         "largest request or response"},
        {"max-calls", CONFIG_INT, &max_calls, 1, 4096, "concurrent Execute and Exec calls"},
        {"workers", CONFIG_INT, &workers, 1, 256, "threads serving Sandbox file calls"},
        {"grace-ms", CONFIG_INT, &grace_ms, 0, 600000, "how long shutdown waits for calls"},
        {"max-queue", CONFIG_INT, &max_queue, 1, 100000,
         "Sandbox calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"},
        {"log-level", CONFIG_STRING, &level, 0, 0, "debug, info, warn or error"},
    };

    log_init("toold", LOG_INFO);
    if (config_parse(opts, sizeof(opts) / sizeof(opts[0]), argc, argv, usage, &help, &err) !=
        CF_OK) {
        fprintf(stderr, "toold: %s\n", err.msg);
        return 2;
    }
    if (help) {
        return 0;
    }
    int lv = log_parse_level(level);
    const struct driver *driver = driver_find(driver_name);
    if (lv < 0 || !driver ||
        (strcmp(grep_engine, "auto") && strcmp(grep_engine, "rg") && strcmp(grep_engine, "pcre2") &&
         strcmp(grep_engine, "grep"))) {
        fprintf(stderr, "toold: %s\n",
                lv < 0    ? "--log-level must be debug, info, warn or error"
                : !driver ? "--driver must be local or bwrap"
                          : "--grep-engine must be auto, rg, pcre2 or grep");
        return 2;
    }
    log_init("toold", (enum log_level)lv);
    failpoint_init();
    /* commands run under a runner (proc.h): toold-runner next to this binary, else toold
     * itself (a binary replaced or removed since start is still reachable as /proc/self/exe) */
    char exe[PATH_MAX];
    ssize_t exe_len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    exe[exe_len > 0 ? exe_len : 0] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash && !strstr(exe, " (deleted)") && (size_t)(slash - exe) + 16 < sizeof(exe)) {
        strcpy(slash + 1, "toold-runner");
    }
    if (exe_len <= 0 || exe[0] != '/' || access(exe, X_OK) != 0) {
        snprintf(exe, sizeof(exe), "/proc/self/exe");
    }
    proc_set_runner(exe);
    struct toold_config cfg = {.bash_default_timeout_ms = default_timeout,
                               .bash_max_timeout_ms = max_timeout,
                               .grep_engine = grep_engine,
                               .spill_keep = (int)spill_keep};
    if (cfg.bash_default_timeout_ms > cfg.bash_max_timeout_ms) {
        cfg.bash_default_timeout_ms = cfg.bash_max_timeout_ms;
    }
    rpc_global_init();
    struct workspaces *ws;
    if (workspaces_new(root, !no_confine, driver, &ws, &err) != CF_OK ||
        driver_available(driver, root, &err) != CF_OK) {
        fprintf(stderr, "toold: %s\n", err.msg);
        log_error("start_failed", "driver=%s root=%s", driver_name, root);
        rpc_global_shutdown();
        return 1;
    }
    struct rpc_server_opts ro = {.workers = (int)workers,
                                 .max_threads = (int)max_calls,
                                 .max_message_bytes = (int)max_msg,
                                 .max_queue = (int)max_queue};
    struct rpc_server *srv = rpc_server_new(&ro);
    toold_register(srv, ws, &cfg);
    int port = 0;
    bool serving = rpc_server_listen(srv, listen, &port, &err) == CF_OK;
    if (!serving) {
        fprintf(stderr, "toold: %s\n", err.msg);
    } else if (rpc_server_start(srv) != CF_OK) {
        fprintf(stderr, "toold: could not start serving (threads); see the log\n");
        serving = false;
    }
    if (!serving) {
        rpc_server_free(srv);
        workspaces_free(ws);
        rpc_global_shutdown();
        return 1;
    }
    daemon_port_file(port_file, port);
    log_info("listening", "addr=%s port=%d root=%s driver=%s confine=%d", listen, port, root,
             driver_name, (int)!no_confine);
    daemon_wait_for_stop();
    rpc_server_shutdown(srv, (int)grace_ms);
    rpc_server_free(srv);
    workspaces_free(ws);
    rpc_global_shutdown();
    log_info("stopped", "code=0");
    return 0;
}
