/* model_io.h - every HTTP transfer to a model provider, on one event loop.
 *
 * One libcurl multi handle, driven by one thread (an epoll loop over the sockets libcurl
 * names, curl_multi_socket_action), carries the transfers of the whole agentd: each event
 * costs the same however many transfers are in flight. A transfer waiting for the
 * model costs no thread of its own, and the multi's connection cache keeps connections alive
 * across calls and turns: a call reuses an idle connection to the same host (HTTP/1.1
 * keep-alive), or shares one (HTTP/2 multiplexing, offered over TLS by ALPN); DNS answers and
 * TLS sessions are kept in a share, so even a new connection skips the lookup and the full
 * handshake.
 *
 * Bounds: at most max_transfers transfers in flight (started and not yet completed; default
 * MODEL_IO_MAX_TRANSFERS): past it a start fails with CF_BUSY naming the cap. At most
 * max_connections connections are cached (CURLMOPT_MAXCONNECTS); past it the oldest idle one
 * is closed.
 *
 * Callbacks. on_header, on_body, cancelled and on_done run on the loop thread, one at a time.
 * They must not block (no RPC, no sleep, no lock held for long, no wait on another transfer):
 * while one runs, no other transfer of the agentd moves. They may call model_io_start and
 * model_io_cancel. A thread that needs to block on a result waits for on_done on its own
 * condition variable (as llm_complete does).
 *
 * Lifecycle of a transfer: model_io_start -> (on_header | on_body)* -> on_done, exactly once,
 * whatever ends it (answer, network error, timeout, a callback's refusal, model_io_cancel,
 * the cancelled check, model_io_free). After on_done returns, model_io forgets the
 * transfer's ctx; a model_io_cancel of its id is then a no-op.
 */
#ifndef CFLUE_AGENTD_MODEL_IO_H
#define CFLUE_AGENTD_MODEL_IO_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* the default cap on transfers in flight in one model_io */
#define MODEL_IO_MAX_TRANSFERS 1024
/* the default cap on cached connections (idle or busy) */
#define MODEL_IO_MAX_CONNECTIONS 64
/* how often, at most, the loop asks the cancelled checks of the transfers in flight */
#define MODEL_IO_CANCEL_POLL_MS 20

struct model_io;

struct model_io_opts {
    int max_transfers;   /* 0: MODEL_IO_MAX_TRANSFERS (at most 65535) */
    int max_connections; /* 0: MODEL_IO_MAX_CONNECTIONS */
};

/* How a transfer ended. */
struct model_io_result {
    /* CF_OK: the HTTP exchange completed (http_status says how the server answered);
     * CF_CANCELLED: model_io_cancel, the cancelled check, or model_io_free;
     * CF_DEADLINE: timeout_ms or stall_ms passed; CF_UNAVAILABLE: the server could not be
     * reached or the connection broke; CF_INVALID: on_header or on_body returned false;
     * CF_INTERNAL: libcurl refused the transfer. err says which, in words. */
    enum cf_status status;
    struct cf_error err;
    long http_status;   /* 0 when no status line arrived */
    long connects;      /* new connections this transfer opened (0: it reused one) */
    int64_t elapsed_ms; /* from model_io_start to the end */
};

struct model_io_request {
    const char *url;
    const char *const *headers; /* "name: value" lines, copied */
    size_t n_headers;
    char *body_take; /* the POST body: taken, model_io frees it (free()) in every case */
    size_t body_len;
    int64_t timeout_ms;         /* the whole transfer; 0: none */
    int64_t connect_timeout_ms; /* 0: 10 s */
    int64_t stall_ms;           /* no byte for this long is a network failure; 0: none */

    /* On the loop thread; must not block (see above). on_header gets each header line as
     * received (status line included, CRLF included); on_body each piece of the body.
     * Returning false ends the transfer (status CF_INVALID). Either may be NULL. */
    bool (*on_header)(void *ctx, const char *line, size_t len);
    bool (*on_body)(void *ctx, const char *p, size_t len);
    /* Optional, on the loop thread, at most every MODEL_IO_CANCEL_POLL_MS: true ends the
     * transfer with CF_CANCELLED. Must be cheap (an atomic or a short lock). */
    bool (*cancelled)(void *ctx);
    /* Called once when the transfer ends, on the loop thread (never from model_io_start).
     * result is valid during the call only. Required. */
    void (*on_done)(void *ctx, const struct model_io_result *result);
    void *ctx;
};

struct model_io_stats {
    int64_t in_flight; /* transfers started and not yet done */
    int64_t started;   /* transfers ever started */
    int64_t connects;  /* connections ever opened (the rest reused one) */
};

/* model_io_new starts a model_io and its loop thread. CF_OK with *out set; CF_BUSY when the
 * thread could not start, CF_INTERNAL when libcurl could not set up (err says which; nothing
 * is left running). Free with model_io_free. */
CF_MUST_CHECK enum cf_status model_io_new(struct model_io **out, const struct model_io_opts *opts,
                                          struct cf_error *err);

/* model_io_free ends every transfer in flight (each gets on_done with CF_CANCELLED, on the loop
 * thread, before this returns), stops and joins the loop thread, closes the cached
 * connections and frees io. An on_done that starts a transfer meanwhile gets CF_CANCELLED.
 * The caller sees to it that no other thread uses io once this begins (model_io_shutdown
 * does that for the shared instance). Accepts NULL. Must not be called from an on_*
 * callback. */
void model_io_free(struct model_io *io);

/* model_io_start queues a transfer; the loop thread begins it at once. CF_OK with *out_id set
 * (never 0): on_done will be called exactly once. On failure (CF_BUSY past max_transfers,
 * CF_CANCELLED while io stops, CF_INVALID without url or on_done) on_done is never called and
 * err says why. body_take is freed in every case. Thread-safe. */
CF_MUST_CHECK enum cf_status model_io_start(struct model_io *io, const struct model_io_request *r,
                                            uint64_t *out_id, struct cf_error *err);

/* model_io_cancel ends the transfer id at once (its on_done gets CF_CANCELLED, on the loop
 * thread, shortly after; the connection it used is closed, not reused). A no-op when id has
 * already ended or is 0. Thread-safe, idempotent, never blocks on the transfer. */
void model_io_cancel(struct model_io *io, uint64_t id);

/* model_io_get_stats fills st with io's counters. Thread-safe. */
void model_io_get_stats(struct model_io *io, struct model_io_stats *st);

/* The shared model_io of the process: the one agentd uses for every model call.
 *
 * model_io_shared_start is model_io_start on it, starting it on first use (default opts);
 * CF_BUSY/CF_INTERNAL when it cannot start. model_io_shared_cancel is model_io_cancel on it
 * (a no-op when it is not running). model_io_shared_stats fills st (zeros when not running).
 * model_io_shutdown frees it as model_io_free does (transfers in flight end CF_CANCELLED);
 * a later start starts a fresh one. All thread-safe; model_io_shutdown is idempotent and must
 * not be called from an on_* callback. */
CF_MUST_CHECK enum cf_status model_io_shared_start(const struct model_io_request *r,
                                                   uint64_t *out_id, struct cf_error *err);
void model_io_shared_cancel(uint64_t id);
void model_io_shared_stats(struct model_io_stats *st);
void model_io_shutdown(void);

#endif
