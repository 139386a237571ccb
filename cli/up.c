/* up.c - cflue up: storaged, toold and agentd on loopback, with one data directory.
 *
 *   cflue up --agents DIR [--data DIR] [--bin DIR] [--driver local|bwrap] [--tls-dir DIR]
 *            [--port-base N]
 *
 * The daemons listen on 127.0.0.1: agentd on port N (7100), storaged N+1, toold N+2. With
 * --tls-dir every daemon serves TLS with DIR/server.pem and DIR/server.key and requires client
 * certificates signed by DIR/ca.pem; agentd reaches storaged and toold with DIR/client.pem and
 * DIR/client.key, and so do up's own health checks (server.pem must name IP 127.0.0.1).
 *
 * Logs go to DATA/{storaged,toold,agentd}.log. The command waits until each daemon answers
 * its health check, prints the addresses, and stops them (SIGTERM, in reverse order) on
 * Ctrl-C or SIGTERM. Model credentials are passed through from the environment.
 */
#include "agent_cmd.h"

#include "rpc.h"
#include "tls.h"

#include "grpc/health/v1/health.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static bool healthy(const char *addr)
{
    struct rpc_channel *ch = rpc_channel_new(addr, 0);
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    req.service = "";
    bool ok = rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                        &grpc__health__v1__health_check_response__descriptor, 1000, &resp, &st) &&
              ((Grpc__Health__V1__HealthCheckResponse *)resp)->status == 1;
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    rpc_channel_free(ch);
    return ok;
}

static pid_t start(const char *bin, const char *name, const char *log, char **args)
{
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/%s/%s", bin, name, name);
    if (access(path, X_OK) != 0) {
        snprintf(path, sizeof(path), "%s/%s", bin, name);
    }
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    sigset_t none;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawnattr_init(&attr);
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    args[0] = path;
    pid_t pid = 0;
    int rc = posix_spawn(&pid, path, &fa, &attr, args, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
        fprintf(stderr, "cflue up: cannot start %s: %s\n", path, strerror(rc));
        return 0;
    }
    return pid;
}

/* wait_healthy polls a starting daemon's health for up to 15 s. A SIGINT/SIGTERM meanwhile
 * (blocked in every thread, so taken here with sigtimedwait) stops the wait: *sig_out is set. */
static bool wait_healthy(const char *name, const char *addr, pid_t pid, const char *log,
                         const sigset_t *stop, int *sig_out)
{
    for (int i = 0; i < 150; i++) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            fprintf(stderr, "cflue up: %s exited at start; see %s\n", name, log);
            return false;
        }
        if (healthy(addr)) {
            return true;
        }
        struct timespec ts = {0, 100000000L};
        int sig = sigtimedwait(stop, NULL, &ts);
        if (sig > 0) {
            fprintf(stderr, "cflue up: %s while %s was starting; stopping\n",
                    sig == SIGINT ? "SIGINT" : "SIGTERM", name);
            *sig_out = sig;
            return false;
        }
    }
    fprintf(stderr, "cflue up: %s did not become healthy at %s; see %s\n", name, addr, log);
    return false;
}

/* The files of cflue up --tls-dir DIR. */
struct tls_dir {
    char ca[PATH_MAX], server[PATH_MAX], server_key[PATH_MAX], client[PATH_MAX],
        client_key[PATH_MAX];
};

/* use_tls_dir names the files of dir and makes up's own health checks TLS, presenting the
 * client certificate. 2 after printing why a file does not check out; 0 otherwise. */
static int use_tls_dir(const char *dir, struct tls_dir *t)
{
    snprintf(t->ca, sizeof(t->ca), "%s/ca.pem", dir);
    snprintf(t->server, sizeof(t->server), "%s/server.pem", dir);
    snprintf(t->server_key, sizeof(t->server_key), "%s/server.key", dir);
    snprintf(t->client, sizeof(t->client), "%s/client.pem", dir);
    snprintf(t->client_key, sizeof(t->client_key), "%s/client.key", dir);
    struct tls_paths own = {t->ca, t->client, t->client_key, "--tls-dir", "--tls-dir", "--tls-dir"};
    struct cf_error err;
    if (tls_client_load(&own, &err) != CF_OK) {
        fprintf(stderr, "cflue up: %s\n", err.msg);
        return 2;
    }
    return 0;
}

/* ARGS_MAX bounds one daemon's command line in cflue up. */
#define ARGS_MAX 32

/* add_args appends the NULL-terminated list of strings to args (n entries so far). */
static void add_args(char **args, int *n, const char *first, ...)
{
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a && *n < ARGS_MAX - 1; a = va_arg(ap, const char *)) {
        args[(*n)++] = (char *)a;
    }
    va_end(ap);
    args[*n] = NULL;
}

int cmd_up(int argc, char **argv)
{
    const char *data = ".data", *agents = NULL, *bin = NULL, *driver = "local", *tls = NULL;
    long port_base = 7100;
    for (int i = 2; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--data")) {
            data = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--agents")) {
            agents = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--bin")) {
            bin = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--driver")) {
            driver = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--tls-dir")) {
            tls = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "--port-base")) {
            char *end;
            port_base = strtol(argv[++i], &end, 10);
            if (*end || port_base < 1 || port_base > 65533) {
                fprintf(stderr, "cflue up: --port-base must be a port from 1 to 65533\n");
                return 2;
            }
        } else {
            fprintf(stderr, "usage: cflue up --agents DIR [--data DIR] [--bin DIR] "
                            "[--driver local|bwrap] [--tls-dir DIR] [--port-base N]\n");
            return 2;
        }
    }
    if (!agents) {
        fprintf(stderr, "cflue up: --agents DIR is required (a directory of NAME.md files)\n");
        return 2;
    }
    struct tls_dir t;
    if (tls && use_tls_dir(tls, &t) != 0) {
        return 2;
    }
    char agentd_addr[32], store_addr[32], toold_addr[32];
    snprintf(agentd_addr, sizeof(agentd_addr), "127.0.0.1:%ld", port_base);
    snprintf(store_addr, sizeof(store_addr), "127.0.0.1:%ld", port_base + 1);
    snprintf(toold_addr, sizeof(toold_addr), "127.0.0.1:%ld", port_base + 2);
    char self[PATH_MAX], bin_buf[PATH_MAX];
    if (!bin) {
        ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        self[n > 0 ? n : 0] = '\0';
        snprintf(bin_buf, sizeof(bin_buf), "%s/..", dirname(self));
        bin = bin_buf;
    }
    mkdir(data, 0755);
    char db[PATH_MAX], ws[PATH_MAX], logs[3][PATH_MAX];
    snprintf(db, sizeof(db), "%s/store.db", data);
    snprintf(ws, sizeof(ws), "%s/workspaces", data);
    const char *names[3] = {"storaged", "toold", "agentd"};
    const char *addrs[3] = {store_addr, toold_addr, agentd_addr};
    for (int i = 0; i < 3; i++) {
        snprintf(logs[i], sizeof(logs[i]), "%s/%s.log", data, names[i]);
    }
    char *args[3][ARGS_MAX];
    int n[3] = {1, 1, 1}; /* args[i][0]: the binary's path, set by start */
    add_args(args[0], &n[0], "--listen", store_addr, "--db", db, NULL);
    add_args(args[1], &n[1], "--listen", toold_addr, "--root", ws, "--driver", driver, NULL);
    add_args(args[2], &n[2], "--listen", agentd_addr, "--store", store_addr, "--agents", agents,
             NULL);
    for (int i = 0; tls && i < 3; i++) {
        /* every daemon serves TLS and requires a client certificate from the CA */
        add_args(args[i], &n[i], "--tls-cert", t.server, "--tls-key", t.server_key,
                 "--tls-client-ca", t.ca, NULL);
    }
    if (tls) {
        add_args(args[2], &n[2], "--peer-ca", t.ca, "--peer-cert", t.client, "--peer-key",
                 t.client_key, NULL);
    }
    pid_t pids[3] = {0};
    int rc = 0, sig = 0;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    for (int i = 0; i < 3; i++) {
        pids[i] = start(bin, names[i], logs[i], args[i]);
        if (!pids[i] || !wait_healthy(names[i], addrs[i], pids[i], logs[i], &set, &sig)) {
            rc = sig ? 128 + sig : 1;
            break;
        }
        printf("%-9s %s  (log %s)\n", names[i], addrs[i], logs[i]);
    }
    if (rc == 0) {
        if (tls) {
            printf("cflue is up, over TLS with client certificates. Try: cflue --ca %s --cert %s "
                   "--cert-key %s submit --agent NAME \"your request\"   (Ctrl-C stops)\n",
                   t.ca, t.client, t.client_key);
        } else {
            printf("cflue is up. Try: cflue submit --agent NAME \"your request\"   (Ctrl-C "
                   "stops)\n");
        }
        fflush(stdout);
        sigwait(&set, &sig);
    }
    for (int i = 2; i >= 0; i--) {
        if (pids[i] > 0) {
            kill(pids[i], SIGTERM);
            waitpid(pids[i], NULL, 0);
        }
    }
    return rc;
}
