/* daemon.c - configuration, serving, port files and stop signals of a daemon.
 *
 * Memory: glibc gives each thread that contends for malloc an arena of its own, and keeps
 * what is freed in them; a daemon with dozens of threads then holds the peak of a burst for
 * good. So malloc gets ARENA_MAX arenas (unless MALLOC_ARENA_MAX says otherwise): one, because
 * malloc_trim gives back the free top of the main arena only, never a thread arena's (each
 * daemon kept 1 to 2 MiB of freed memory resident there for good), and a second arena bought
 * no measurable CPU (each thread's malloc cache takes most calls without the arena's lock).
 * The main thread, which only waits for the stop signal, gives free memory back to the system
 * (malloc_trim) every TRIM_EVERY_S seconds: an idle daemon returns to its idle size. That trim
 * is the only one: glibc's own (an arena's free top above M_TRIM_THRESHOLD, 128 KiB by default,
 * given back with madvise at every free) cost storaged an eighth of its CPU in TLB flushes
 * under load, so the threshold is TRIM_THRESHOLD, and blocks under MMAP_THRESHOLD come from
 * the arenas rather than an mmap and munmap each (MALLOC_TRIM_THRESHOLD_ and
 * MALLOC_MMAP_THRESHOLD_ override both). */
#include "daemon.h"

#include "failpoint.h"
#include "log.h"
#include "metrics_http.h"
#include "tls.h"

#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ARENA_MAX 1
#define TRIM_EVERY_S 10
#define TRIM_THRESHOLD (16 << 20)
#define MMAP_THRESHOLD (1 << 20)

const char *const daemon_log_levels[] = {"debug", "info", "warn", "error", NULL};

/* The listener's TLS files, read by daemon_configure, served by daemon_serve, reread on SIGHUP
 * and freed by daemon_stop_serving (one daemon per process). */
static struct tls_server *g_tls;

static bool given(const char *path)
{
    return path && *path;
}

/* configure_tls reads and checks the TLS files the flags name: DAEMON_RUN, or 2 once printed
 * why not. */
static int configure_tls(struct daemon *d)
{
    struct cf_error err;
    if (given(d->tls_client_ca) && !given(d->tls_cert) && !given(d->tls_key)) {
        return daemon_say(d, 2,
                          "--tls-client-ca needs --tls-cert and --tls-key (client "
                          "certificates are asked for over TLS)");
    }
    if (given(d->tls_cert) || given(d->tls_key)) {
        struct tls_paths p = {d->tls_client_ca,  d->tls_cert,  d->tls_key,
                              "--tls-client-ca", "--tls-cert", "--tls-key"};
        if (tls_server_new(&p, &g_tls, &err) != CF_OK) {
            return daemon_say(d, 2, "%s", err.msg);
        }
    }
    if (given(d->peer_ca) || given(d->peer_cert) || given(d->peer_key)) {
        struct tls_paths p = {d->peer_ca,  d->peer_cert,  d->peer_key,
                              "--peer-ca", "--peer-cert", "--peer-key"};
        if (tls_client_load(&p, &err) != CF_OK) {
            return daemon_say(d, 2, "%s", err.msg);
        }
    }
    return DAEMON_RUN;
}

int daemon_say(const struct daemon *d, int code, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", d->name);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return code;
}

int daemon_configure(struct daemon *d, const struct config_opt *opts, size_t n_opts, int argc,
                     char **argv)
{
    struct cf_error err;
    bool help;
    rpc_block_signals(); /* before any thread: a stop signal reaches only the waiting main */
    log_init(d->name, LOG_INFO);
    if (!getenv("MALLOC_ARENA_MAX")) {
        mallopt(M_ARENA_MAX, ARENA_MAX);
    }
    if (!getenv("MALLOC_TRIM_THRESHOLD_")) {
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
    if (!getenv("MALLOC_MMAP_THRESHOLD_")) {
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
    if (config_parse(opts, n_opts, argc, argv, d->usage, &help, &err) != CF_OK) {
        return daemon_say(d, 2, "%s", err.msg);
    }
    if (help) {
        return 0;
    }
    int lv = log_parse_level(d->log_level);
    if (lv < 0) { /* a table without DAEMON_OPT_LOG_LEVEL, or a bad default */
        return daemon_say(d, 2, "--log-level must be debug, info, warn or error");
    }
    log_init(d->name, (enum log_level)lv);
    failpoint_init();
    return configure_tls(d);
}

/* log_tls logs what the listener and the peer channels use (never a key or a file's text). */
static void log_tls(void)
{
    char what[640] = "";
    if (g_tls) {
        tls_server_describe(g_tls, what, sizeof(what));
    }
    log_info("tls", "tls=%s mtls=%s peer_tls=%s peer_cert=%s%s%s", g_tls ? "on" : "off",
             g_tls && tls_server_mtls(g_tls) ? "on" : "off", tls_client_on() ? "on" : "off",
             tls_client_has_cert() ? "on" : "off", *what ? " " : "", what);
}

bool daemon_serve(struct daemon *d, struct rpc_server *srv)
{
    struct cf_error err;
    int port = 0;
    char q[CF_ERROR_MSG_MAX + 16];
    if (d->metrics_listen && *d->metrics_listen) {
        if (metrics_http_start(d->metrics_listen, &d->metrics, &d->metrics_port, &err) != CF_OK) {
            log_error("metrics_listen_failed", "addr=%s err=%s", d->metrics_listen,
                      log_quote(q, sizeof(q), err.msg));
            daemon_say(d, 1, "%s", err.msg);
            rpc_server_free(srv);
            return false;
        }
        log_info("metrics_listening", "addr=%s port=%d path=/metrics", d->metrics_listen,
                 d->metrics_port);
    }
    if (g_tls) {
        rpc_server_set_credentials(srv, tls_server_credentials(g_tls));
    }
    if (rpc_server_listen(srv, d->listen, &port, &err) != CF_OK) {
        log_error("listen_failed", "addr=%s err=%s", d->listen, log_quote(q, sizeof(q), err.msg));
        daemon_say(d, 1, "%s", err.msg);
        rpc_server_free(srv);
        metrics_http_stop(d->metrics);
        d->metrics = NULL;
        return false;
    }
    if (rpc_server_start(srv) != CF_OK) {
        /* a process that cannot start threads cannot tear gRPC down either (its destroy waits
         * for gRPC threads that may never have started, or aborts on a server never started):
         * it stops here, as a crash would, with nothing in flight */
        daemon_say(d, 1, "could not start serving (threads); see the log");
        fflush(NULL);
        _exit(1);
    }
    d->server = srv;
    d->port = port;
    log_tls();
    daemon_port_file(d->port_file, port);
    return true;
}

void daemon_stop_serving(struct daemon *d)
{
    if (!d->server) {
        return;
    }
    rpc_server_shutdown(d->server, (int)d->grace_ms);
    rpc_server_free(d->server);
    d->server = NULL;
    tls_server_free(g_tls); /* after the server: its handshakes asked g_tls for certificates */
    g_tls = NULL;
    metrics_http_stop(d->metrics);
    d->metrics = NULL;
}

void daemon_port_file(const char *path, int port)
{
    if (!path || !*path) {
        return;
    }
    FILE *f = fopen(path, "w");
    if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0) {
        log_error("port_file_failed", "path=%s err=%d", path, errno);
    }
}

/* stop_signals makes set the signals that stop a daemon: SIGINT and SIGTERM. */
static void stop_signals(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGTERM);
}

void daemon_wait_for_stop_or_hup(void (*release)(void *arg), void (*hup)(void *arg), void *arg)
{
    sigset_t set;
    int sig;
    struct timespec every = {TRIM_EVERY_S, 0};
    stop_signals(&set);
    if (hup || g_tls || tls_client_on()) {
        sigaddset(&set, SIGHUP);
    }
    while ((sig = sigtimedwait(&set, NULL, &every)) < 0 || sig == SIGHUP) {
        if (sig == SIGHUP) {
            log_info("signal", "signal=HUP");
            if (g_tls) {
                tls_server_reload(g_tls);
            }
            tls_client_reload();
            if (hup) {
                hup(arg);
            }
        } else if (errno == EAGAIN) {
            if (release) {
                release(arg);
            }
            malloc_trim(0); /* the free memory of every arena back to the system */
        }
    }
    log_info("stopping", "signal=%s", sig == SIGTERM ? "TERM" : "INT");
}

bool daemon_stop_signal_within(int64_t ms)
{
    sigset_t set;
    stop_signals(&set);
    struct timespec wait = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    int sig = sigtimedwait(&set, NULL, &wait);
    if (sig < 0) {
        return false; /* the time passed (or EINTR: the caller asks again) */
    }
    log_info("signal", "signal=%s", sig == SIGTERM ? "TERM" : "INT");
    return true;
}

void daemon_wait_for_stop(void (*release)(void *arg), void *arg)
{
    daemon_wait_for_stop_or_hup(release, NULL, arg);
}
