/* daemon.h - what every cflue daemon does the same way around its server.
 *
 * A daemon's main reads as its table of contents (toold/main.c is the shortest):
 *
 *   - struct daemon d = DAEMON_INIT(name, usage, default listen address), the daemon's own
 *     options in a struct beside it, and one option table naming both (DAEMON_OPT_* for the
 *     shared ones), in the order --help shows them;
 *   - daemon_configure: flags, CFLUE_* variables, --help, log level, failpoints;
 *   - what it opens before serving, then rpc_server_new and its services' registration;
 *   - daemon_serve: listen, start, port file;
 *   - daemon_wait_for_stop: SIGINT or SIGTERM;
 *   - daemon_stop_serving: health NOT_SERVING, grace, cancel, free; then what it opened.
 *
 * Every server serves grpc.health.v1.Health (rpc.h); the options every daemon shares (listen,
 * port-file, grace-ms, max-queue, log-level, TLS) live in struct daemon, each daemon's own in its
 * main.c, all in one option table (config.h) in the order --help shows them.
 */
#ifndef CFLUE_DAEMON_H
#define CFLUE_DAEMON_H

#include "config.h"
#include "rpc.h"
#include "status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct daemon {
    const char *name;  /* "toold": the log's daemon name and the prefix of its messages */
    const char *usage; /* what --help prints above the options */
    /* the options every daemon takes (defaults from DAEMON_INIT) */
    const char *listen, *port_file, *log_level;
    long long grace_ms, max_queue;
    long long max_stream_mib;  /* streams served without a thread (RPC_ASYNC): memory bound */
    long long stream_stall_ms; /* a blocking stream's client taking nothing: cut after this */
    /* set by daemon_serve */
    struct rpc_server *server;
    int port; /* the bound TCP port (0 for a unix socket) */
    /* TLS (DAEMON_OPTS_TLS, DAEMON_OPTS_PEER_TLS): PEM file paths, "" for none */
    const char *tls_cert, *tls_key, *tls_client_ca; /* the listener's; client CA: mTLS */
    const char *peer_ca, *peer_cert, *peer_key;     /* the channels to peers (tls_client_load) */
    const char *metrics_listen;                     /* --metrics-listen: "" for none */
    struct metrics_http *metrics;                   /* set by daemon_serve */
    int metrics_port;                               /* its bound port */
};

#define DAEMON_INIT(name, usage, listen)                                                           \
    {                                                                                              \
        (name), (usage), (listen), "", "info", 5000, 256, 256, RPC_STALL_MS_DEFAULT, NULL, 0, "",  \
            "", "", "", "", "", "", NULL, 0                                                        \
    }

/* The log levels --log-level takes (log.h), for a choices list. */
extern const char *const daemon_log_levels[];

/* Option table entries for the shared options; help is the daemon's own wording. */
#define DAEMON_OPT_LISTEN(d, help) CONFIG_OPT_STRING("listen", &(d)->listen, help)
#define DAEMON_OPT_PORT_FILE(d, help) CONFIG_OPT_STRING("port-file", &(d)->port_file, help)
#define DAEMON_OPT_GRACE_MS(d, help) CONFIG_OPT_INT("grace-ms", &(d)->grace_ms, 0, 600000, help)
#define DAEMON_OPT_MAX_QUEUE(d, help) CONFIG_OPT_INT("max-queue", &(d)->max_queue, 1, 100000, help)
#define DAEMON_OPT_MAX_STREAM_MEMORY(d)                                                            \
    CONFIG_OPT_INT("max-stream-memory", &(d)->max_stream_mib, 1, 65536,                            \
                   "MiB for open streams, 16 KiB each (256: 16,384 streams); more are refused "    \
                   "RESOURCE_EXHAUSTED")
#define DAEMON_OPT_STREAM_STALL_MS(d)                                                              \
    CONFIG_OPT_INT("stream-stall-ms", &(d)->stream_stall_ms, 100, 86400000,                        \
                   "a stream whose client takes nothing for this long is cut (DEADLINE_EXCEEDED)")
#define DAEMON_OPT_LOG_LEVEL(d)                                                                    \
    CONFIG_OPT_CHOICE("log-level", &(d)->log_level, daemon_log_levels, "debug, info, warn or error")

/* The listener's TLS, for every daemon: --tls-cert and --tls-key (both or neither) make it
 * serve TLS only; --tls-client-ca also requires each client to present a certificate that CA
 * signed (mTLS). SIGHUP reads the files again (tls.h). */
#define DAEMON_OPTS_TLS(d)                                                                         \
    CONFIG_OPT_STRING("tls-cert", &(d)->tls_cert,                                                  \
                      "PEM certificate chain to serve TLS with (with --tls-key; reread on "        \
                      "SIGHUP)"),                                                                  \
        CONFIG_OPT_STRING("tls-key", &(d)->tls_key,                                                \
                          "PEM private key of --tls-cert (unencrypted)"),                          \
        CONFIG_OPT_STRING("tls-client-ca", &(d)->tls_client_ca,                                    \
                          "PEM CA that must sign every client's certificate (mTLS; needs "         \
                          "--tls-cert)")

/* The channels a daemon opens to its peers: --peer-ca makes them TLS, verifying the peers'
 * certificates with that CA; --peer-cert and --peer-key (both or neither) are the client
 * certificate presented to peers that require one. */
#define DAEMON_OPTS_PEER_TLS(d)                                                                    \
    CONFIG_OPT_STRING("peer-ca", &(d)->peer_ca,                                                    \
                      "PEM CA that verifies the peers' certificates (TLS to storaged, toold and "  \
                      "tool servers)"),                                                            \
        CONFIG_OPT_STRING("peer-cert", &(d)->peer_cert,                                            \
                          "PEM client certificate presented to peers (with --peer-key; needs "     \
                          "--peer-ca)"),                                                           \
        CONFIG_OPT_STRING("peer-key", &(d)->peer_key, "PEM private key of --peer-cert")

/* --metrics-listen, for every daemon: Prometheus /metrics (metrics_http.h). */
#define DAEMON_OPT_METRICS(d)                                                                      \
    CONFIG_OPT_STRING("metrics-listen", &(d)->metrics_listen,                                      \
                      "HOST:PORT serving Prometheus metrics at /metrics over HTTP (empty: none)")

/* daemon_configure's "go on" result; any other is the exit code for main to return. */
#define DAEMON_RUN (-1)

/* daemon_configure starts logging as d->name, applies CFLUE_* environment variables and then
 * the flags to the targets of opts (config.h), sets the log level and arms the failpoints.
 * It reads and checks the TLS files the flags name (the listener's, kept for daemon_serve;
 * the peers', for every channel made from then on: tls_client_load). Returns DAEMON_RUN to go
 * on; 0 after printing --help; 2 after printing "NAME: MESSAGE" to stderr for a bad flag or
 * variable, or a TLS file that cannot be read or does not check out. Call once, first thing in
 * main. */
CF_MUST_CHECK int daemon_configure(struct daemon *d, const struct config_opt *opts, size_t n_opts,
                                   int argc, char **argv);

/* daemon_say prints "NAME: MESSAGE" (printf format) to stderr and returns code, for the exit
 * paths of main. */
int daemon_say(const struct daemon *d, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* daemon_serve takes srv (made with rpc_server_new, its services registered), binds d->listen
 * (TLS when --tls-cert was given), starts serving, logs the "tls" line (tls=on|off
 * mtls=on|off, and the peers' peer_tls, peer_cert) and writes d->port_file; d->server and
 * d->port are set. When it cannot bind it prints and logs why (listen_failed), frees srv and
 * returns false; when the server's threads cannot start (rpc_start_failed) it prints so and
 * ends the process with code 1 at once (see daemon.c). */
CF_MUST_CHECK bool daemon_serve(struct daemon *d, struct rpc_server *srv);

/* daemon_stop_serving shuts d->server down (health NOT_SERVING, new calls refused, live calls
 * get d->grace_ms and are then cancelled), waits for every handler and frees it, and then the
 * listener's TLS files. Idempotent. */
void daemon_stop_serving(struct daemon *d);

/* daemon_port_file writes the bound TCP port to path (when path is not empty), for tests and
 * supervisors that start a daemon on port 0. A failure is logged, not fatal. */
void daemon_port_file(const char *path, int port);

/* daemon_wait_for_stop blocks until SIGINT or SIGTERM (blocked in every thread by
 * rpc_global_init) and logs which one arrived; meanwhile, every 10 s, it calls release(arg)
 * (when not NULL: the daemon drops what its caches hold beyond their use) and gives the
 * process's free memory back to the system. */
void daemon_wait_for_stop(void (*release)(void *arg), void *arg);

/* daemon_stop_signal_within waits up to ms for SIGINT or SIGTERM (a second one, after
 * daemon_wait_for_stop returned): true, logged, when one arrived. */
bool daemon_stop_signal_within(int64_t ms);

/* daemon_wait_for_stop_or_hup is daemon_wait_for_stop that also takes SIGHUP: each one calls
 * hup(arg) (a daemon reloads its configuration) and goes on waiting. Without it SIGHUP, blocked
 * in every thread, is ignored, unless the daemon uses TLS: with either wait, each SIGHUP then
 * first reads the TLS files again (tls_server_reload, tls_client_reload). */
void daemon_wait_for_stop_or_hup(void (*release)(void *arg), void (*hup)(void *arg), void *arg);

#endif
