/* metrics_http.c - the /metrics endpoint over libmicrohttpd (see metrics_http.h).
 *
 * libmicrohttpd is loaded (dlopen) when the first listener starts, not linked: a daemon
 * without --metrics-listen, the default, maps neither it nor the TLS libraries it links
 * (GnuTLS and its dependencies), which cost storaged and toold 2.6 MiB of resident memory each
 * and 15 ms of start-up CPU. The build names the library (CFLUE_MHD_SONAME, CMakeLists.txt). */
#include "metrics_http.h"

#include "clock.h"
#include "log.h"
#include "mem.h"
#include "metrics.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

struct metrics_http {
    struct MHD_Daemon *d;
};

/* The functions of libmicrohttpd used here, typed from its header (__typeof__ reads the
 * declaration only: nothing is linked). */
static struct {
    __typeof__(MHD_start_daemon) *start_daemon;
    __typeof__(MHD_stop_daemon) *stop_daemon;
    __typeof__(MHD_get_daemon_info) *get_daemon_info;
    __typeof__(MHD_create_response_from_buffer) *create_response_from_buffer;
    __typeof__(MHD_add_response_header) *add_response_header;
    __typeof__(MHD_queue_response) *queue_response;
    __typeof__(MHD_destroy_response) *destroy_response;
} mhd;

static pthread_once_t mhd_once = PTHREAD_ONCE_INIT;
static char mhd_error[300]; /* why it could not be loaded; "" once loaded */

/* load_mhd (once) fills mhd, or says in mhd_error why it cannot. */
static void load_mhd(void)
{
    void *lib = dlopen(CFLUE_MHD_SONAME, RTLD_NOW | RTLD_LOCAL); /* kept until exit */
    if (!lib) {
        const char *why = dlerror();
        snprintf(mhd_error, sizeof(mhd_error), "%s", why ? why : "dlopen failed");
        return;
    }
    struct {
        void **fn;
        const char *name;
    } syms[] = {
        {(void **)&mhd.start_daemon, "MHD_start_daemon"},
        {(void **)&mhd.stop_daemon, "MHD_stop_daemon"},
        {(void **)&mhd.get_daemon_info, "MHD_get_daemon_info"},
        {(void **)&mhd.create_response_from_buffer, "MHD_create_response_from_buffer"},
        {(void **)&mhd.add_response_header, "MHD_add_response_header"},
        {(void **)&mhd.queue_response, "MHD_queue_response"},
        {(void **)&mhd.destroy_response, "MHD_destroy_response"},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        if (!(*syms[i].fn = dlsym(lib, syms[i].name))) {
            snprintf(mhd_error, sizeof(mhd_error), "%s has no %s", CFLUE_MHD_SONAME, syms[i].name);
            return;
        }
    }
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned int code, const char *type,
                             char *body, size_t len, enum MHD_ResponseMemoryMode mode)
{
    struct MHD_Response *r = mhd.create_response_from_buffer(len, body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE) {
            free(body);
        }
        return MHD_NO;
    }
    mhd.add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = mhd.queue_response(conn, code, r);
    mhd.destroy_response(r);
    return ok;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **state)
{
    (void)cls;
    (void)version;
    (void)upload;
    (void)upload_len;
    (void)state;
    static char not_found[] = "only /metrics is served here\n";
    static char not_allowed[] = "only GET and HEAD\n";
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", not_allowed,
                     strlen(not_allowed), MHD_RESPMEM_PERSISTENT);
    }
    if (strcmp(url, "/metrics") != 0) {
        return reply(conn, MHD_HTTP_NOT_FOUND, "text/plain", not_found, strlen(not_found),
                     MHD_RESPMEM_PERSISTENT);
    }
    size_t len;
    char *text = metrics_render(&len);
    return reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len,
                 MHD_RESPMEM_MUST_FREE);
}

/* parse_addr reads HOST:PORT ([V6]:PORT, :PORT for every address) into ss. */
static enum cf_status parse_addr(const char *addr, struct sockaddr_storage *ss, socklen_t *len,
                                 struct cf_error *err)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || (size_t)(colon - addr) >= sizeof(host)) {
        return cf_error_set(err, CF_INVALID, "--metrics-listen '%.200s' is not HOST:PORT", addr);
    }
    snprintf(host, sizeof(host), "%.*s", (int)(colon - addr), addr);
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        memmove(host, host + 1, strlen(host) - 2);
        host[strlen(host) - 2] = '\0';
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || port < 0 || port > 65535) {
        return cf_error_set(err, CF_INVALID, "--metrics-listen '%.200s': a port from 0 to 65535",
                            addr);
    }
    struct addrinfo hints = {.ai_flags = AI_PASSIVE | AI_NUMERICSERV, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &res);
    if (rc != 0 || !res) {
        return cf_error_set(err, CF_INVALID, "--metrics-listen '%.200s': %s", addr,
                            gai_strerror(rc));
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return CF_OK;
}

/* every_address says whether ss is the any-address of its family. */
static bool every_address(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET6) {
        return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)ss)->sin6_addr);
    }
    return ((const struct sockaddr_in *)ss)->sin_addr.s_addr == htonl(INADDR_ANY);
}

/* The endpoint's bounds: a scraper needs one connection and a few hundred bytes of request.
 * The per-address share keeps one client's idle or trickling connections (a slow-loris) from
 * taking every slot; the timeout counts idleness only. */
#define HTTP_CONNECTIONS_MAX 64
#define HTTP_CONNECTIONS_PER_ADDRESS 8
#define HTTP_IDLE_TIMEOUT_S 10
#define HTTP_REQUEST_MEMORY 16384 /* a connection's request line and headers */
#define HTTP_LOG_GAP_MS 1000      /* libmicrohttpd's complaints: at most one line a second */

/* mhd_log takes libmicrohttpd's error lines into our log, at most one every HTTP_LOG_GAP_MS
 * (any client can make it complain: a closed connection, an oversized request). */
__attribute__((format(printf, 2, 0))) static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    static _Atomic int64_t last_ms;
    (void)cls;
    int64_t now = clock_mono_ms(), was = last_ms;
    if (now - was < HTTP_LOG_GAP_MS || !atomic_compare_exchange_strong(&last_ms, &was, now)) {
        return;
    }
    char msg[256], q[300];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    msg[strcspn(msg, "\r\n")] = '\0';
    log_warn("metrics_http", "msg=%s", log_quote(q, sizeof(q), msg));
}

/* start serves /metrics at sa with libmicrohttpd (family flags as MHD_USE_IPv6 or
 * MHD_USE_DUAL_STACK); NULL when it cannot bind there. MHD_USE_AUTO: epoll or poll, never
 * select(), which cannot take a descriptor past 1024 (a daemon with many gRPC connections
 * open would refuse every scrape). */
static struct MHD_Daemon *start(unsigned int family_flags, struct sockaddr *sa)
{
    return mhd.start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG | family_flags, 0, NULL,
        NULL, handle, NULL, MHD_OPTION_SOCK_ADDR, sa, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned int)HTTP_CONNECTIONS_MAX,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)HTTP_CONNECTIONS_PER_ADDRESS,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_REQUEST_MEMORY,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)HTTP_IDLE_TIMEOUT_S, MHD_OPTION_END);
}

enum cf_status metrics_http_start(const char *addr, struct metrics_http **out, int *port,
                                  struct cf_error *err)
{
    struct sockaddr_storage ss;
    socklen_t len;
    enum cf_status rc = parse_addr(addr, &ss, &len, err);
    if (rc != CF_OK) {
        return rc;
    }
    (void)pthread_once(&mhd_once, load_mhd);
    if (mhd_error[0]) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "--metrics-listen needs libmicrohttpd (%s), which cannot be loaded: "
                            "%s",
                            CFLUE_MHD_SONAME, mhd_error);
    }
    struct MHD_Daemon *d = NULL;
    uint16_t port_be = ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                : ((struct sockaddr_in *)&ss)->sin_port;
    if (every_address(&ss)) {
        /* ":PORT", "[::]:PORT" and "0.0.0.0:PORT" all mean every address of the host: IPv6
         * and IPv4 on one socket, so that an IPv6-only pod is scraped as well as an IPv4 one;
         * IPv4 alone where the host has no IPv6 */
        struct sockaddr_in6 any6 = {
            .sin6_family = AF_INET6, .sin6_port = port_be, .sin6_addr = IN6ADDR_ANY_INIT};
        d = start(MHD_USE_DUAL_STACK, (struct sockaddr *)&any6);
        if (!d) {
            log_info("metrics_ipv4_only", "addr=%s msg=\"no IPv6 socket here: IPv4 alone\"", addr);
            struct sockaddr_in any4 = {
                .sin_family = AF_INET, .sin_port = port_be, .sin_addr.s_addr = htonl(INADDR_ANY)};
            d = start(0, (struct sockaddr *)&any4);
        }
    } else {
        d = start(ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0, (struct sockaddr *)&ss);
    }
    if (!d) {
        return cf_error_set(err, CF_IO,
                            "cannot serve metrics on %s (in use, or not an address "
                            "of this host)",
                            addr);
    }
    const union MHD_DaemonInfo *info = mhd.get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    *port = info ? (int)info->port : 0;
    *out = mem_alloc(sizeof(**out));
    (*out)->d = d;
    return CF_OK;
}

void metrics_http_stop(struct metrics_http *h)
{
    if (!h) {
        return;
    }
    mhd.stop_daemon(h->d);
    free(h);
}
