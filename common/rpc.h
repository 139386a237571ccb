/* rpc.h - a small layer over the gRPC C core with protobuf-c messages.
 *
 * Server: register a handler per method, listen on TCP or unix: addresses, start. A handler
 * receives the decoded request and a call handle; it replies now or later, from any thread,
 * with rpc_call_reply (unary), or rpc_call_send then rpc_call_finish (server streaming), or
 * rpc_call_fail. Every call is finished exactly once. Requests that cannot be decoded get
 * INVALID_ARGUMENT, unknown methods UNIMPLEMENTED, oversized messages RESOURCE_EXHAUSTED
 * (from the core). rpc_server_shutdown stops accepting calls, waits for live calls up to a
 * grace period, cancels the rest and waits for every handler to finish its call.
 *
 * Every server also serves grpc.health.v1.Health (Check and Watch).
 *
 * Client: rpc_unary and rpc_stream_* make blocking calls on a shared channel.
 */
#ifndef CFLUE_RPC_H
#define CFLUE_RPC_H

#include "status.h"

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stdint.h>

struct rpc_server;
struct rpc_call;

/* Where a handler runs. */
enum rpc_mode {
    RPC_INLINE, /* on the event loop (rpc_loop.h): must not block (no disk, no blocking call) */
    RPC_POOL,   /* on the server's worker pool: may block briefly (a database read) */
    RPC_THREAD, /* on a thread of its own: may block for the life of the call (streams) */
    RPC_ASYNC,  /* event-driven stream: the handler runs on the worker pool, registers the call
                 * with its feeder (rpc_call_async) and returns; no thread is held while the
                 * stream is idle. Bounded by max_stream_memory. */
};

typedef void (*rpc_handler_fn)(struct rpc_call *call, const ProtobufCMessage *req, void *user);

/* Admission control: an RPC_POOL call (or an RPC_INLINE call whose request is over 64 KiB)
 * waits in a FIFO for a worker. When max_queue calls are waiting, or the undecoded requests
 * waiting add up to max_queue_bytes (one call is always let in), a new call is refused at
 * once with RESOURCE_EXHAUSTED ("server busy ... retry later"). A worker drops a call whose
 * deadline passed while it waited (DEADLINE_EXCEEDED) or whose client left (CANCELLED)
 * without running its handler. Requests are decoded on the worker (or the call's own thread),
 * never on the event loop, except small RPC_INLINE requests such as health checks, which are
 * therefore answered while the queue is full. RPC_THREAD calls beyond max_threads, or whose
 * thread cannot start, get RESOURCE_EXHAUSTED. RPC_ASYNC calls wait for a worker in the same
 * FIFO, bounded by max_queue_bytes but not by max_queue (a burst of streams opening at once is
 * served in order), and are refused with RESOURCE_EXHAUSTED while the open RPC_ASYNC calls,
 * each charged RPC_ASYNC_CALL_BYTES, would exceed max_stream_memory. */
struct rpc_server_opts {
    int workers;               /* RPC_POOL threads; 0: 8 */
    int max_threads;           /* concurrent RPC_THREAD handlers; 0: 256 */
    int max_message_bytes;     /* receive and send limit; 0: 16 MiB */
    int max_queue;             /* calls waiting for a worker; 0: 256 */
    int max_queue_bytes;       /* undecoded request bytes waiting for a worker; 0: 64 MiB */
    int64_t max_stream_memory; /* bytes for open RPC_ASYNC calls; 0: RPC_STREAM_MEMORY_DEFAULT */
    int64_t stall_ms; /* a blocking stream (rpc_call_send) whose client takes nothing for this
                       * long is cancelled (DEADLINE_EXCEEDED); 0: RPC_STALL_MS_DEFAULT */
};

#define RPC_STALL_MS_DEFAULT 60000

/* What one open RPC_ASYNC call is charged against max_stream_memory: an idle stream's state in
 * the gRPC core (call arena, HTTP/2 stream) and ours, measured at about 10 KiB, rounded up. A
 * call's queued messages are bounded separately (RPC_ASYNC_QUEUE_MSGS, RPC_ASYNC_QUEUE_BYTES). */
#define RPC_ASYNC_CALL_BYTES (16 << 10)
#define RPC_STREAM_MEMORY_DEFAULT ((int64_t)256 << 20) /* 16,384 idle streams */
#define RPC_ASYNC_QUEUE_MSGS 16
#define RPC_ASYNC_QUEUE_BYTES (256 << 10)

/* rpc_server_new creates a server (not yet listening). Never NULL. */
struct rpc_server *rpc_server_new(const struct rpc_server_opts *opts);

/* rpc_server_listen binds an address ("127.0.0.1:0", "[::]:7001", "unix:/path"). Stores the
 * bound TCP port in *port_out (0 for unix sockets) when port_out is not NULL. CF_UNAVAILABLE
 * with a message when the address cannot be bound. Call before rpc_server_start. */
CF_MUST_CHECK enum cf_status rpc_server_listen(struct rpc_server *s, const char *addr,
                                               int *port_out, struct cf_error *err);

/* rpc_server_set_credentials makes the later rpc_server_listen calls serve with creds (TLS:
 * tls_server_credentials) instead of plaintext. The server takes creds (released with the
 * server; a second call releases the first). Call before rpc_server_listen. */
void rpc_server_set_credentials(struct rpc_server *s, grpc_server_credentials *creds);

/* rpc_server_add_method registers a handler for a full method path ("/cflue.v1.Store/Admit").
 * The request is decoded with req_desc. Call before rpc_server_start. */
void rpc_server_add_method(struct rpc_server *s, const char *path,
                           const ProtobufCMessageDescriptor *req_desc, rpc_handler_fn fn,
                           void *user, enum rpc_mode mode);

/* One row of a service's method table. */
struct rpc_method_def {
    const char *path; /* "/cflue.v1.Agent/Submit" */
    const ProtobufCMessageDescriptor *req_desc;
    rpc_handler_fn fn;
    enum rpc_mode mode;
};

/* rpc_server_add_methods registers every row of a method table, each with the same user
 * pointer. Call before rpc_server_start. */
void rpc_server_add_methods(struct rpc_server *s, const struct rpc_method_def *defs, size_t n,
                            void *user);

/* rpc_server_lenient_strings makes a registered method accept requests whose text fields hold
 * NUL bytes or invalid UTF-8 (refused with INVALID_ARGUMENT otherwise): the handler runs and
 * learns of the problem from rpc_call_input_problem (the decoded strings are cut at the NUL).
 * For methods that must answer such input in their own way. */
void rpc_server_lenient_strings(struct rpc_server *s, const char *path);

/* rpc_call_input_problem describes a bad text field of a lenient method's request, or NULL. */
const char *rpc_call_input_problem(struct rpc_call *c);

/* rpc_server_start starts the server's threads, then serving; health reports SERVING for ""
 * and every service name whose methods were registered. When a thread cannot start it stops
 * those it started, logs the reason (rpc_start_failed) and returns CF_BUSY: the server never
 * accepted a call and must only be freed. */
CF_MUST_CHECK enum cf_status rpc_server_start(struct rpc_server *s);

/* rpc_server_stopping reports whether shutdown has begun (for long-running handlers). */
bool rpc_server_stopping(const struct rpc_server *s);

/* Health service names besides the registered services: liveness ("" too) is SERVING while
 * the process serves; readiness (and every registered service) only while it is also ready. */
#define RPC_HEALTH_LIVENESS "liveness"
#define RPC_HEALTH_READINESS "readiness"

/* rpc_server_set_ready changes readiness (false: "readiness" and the registered services
 * answer NOT_SERVING, "" and "liveness" stay SERVING); health Watch streams are told at once.
 * A new server is ready. */
void rpc_server_set_ready(struct rpc_server *s, bool ready);

/* rpc_server_set_serving changes the health status of every service (false: NOT_SERVING);
 * health Watch streams are told at once. */
void rpc_server_set_serving(struct rpc_server *s, bool serving);

/* rpc_server_shutdown stops the server: health turns NOT_SERVING (each health Watch is told at
 * once and ends 150 ms later, so the client reads it before the connection closes), new calls
 * are refused, live calls get grace_ms to finish, then are cancelled; returns once every call
 * is finished and every server thread joined. Idempotent. */
void rpc_server_shutdown(struct rpc_server *s, int grace_ms);

/* rpc_server_method_calls returns how many calls of a registered method (full path) the
 * server has received so far, refused and failed ones included; 0 for an unknown path.
 * Thread-safe and cheap (a relaxed atomic per method, counted when the call arrives). With
 * CFLUE_RPC_STATS=1 in the environment, rpc_server_shutdown also logs one line per method,
 * "rpc_stats method=/cflue.v1.Store/Claim calls=N" (level info). */
uint64_t rpc_server_method_calls(struct rpc_server *s, const char *path);

/* rpc_server_free releases a server after rpc_server_shutdown (NULL is fine). */
void rpc_server_free(struct rpc_server *s);

/* rpc_call_reply sends the one response of a unary call with status OK and finishes it. */
void rpc_call_reply(struct rpc_call *c, const ProtobufCMessage *resp);

/* rpc_call_send queues one message of a server stream. Blocks while too many messages are
 * queued (backpressure), at most the server's stall_ms without the client taking any: then
 * the call is cancelled (a client that stopped reading holds no handler, nor what it holds,
 * for ever). Returns false once the call is dead (cancelled, deadline, client gone, stalled):
 * the handler should stop producing and finish. */
CF_MUST_CHECK bool rpc_call_send(struct rpc_call *c, const ProtobufCMessage *msg);

/* ---- event-driven streams (RPC_ASYNC) ----
 *
 * The handler sets up its own state for the call, then hands the call to rpc_call_async and
 * returns. From then on any thread may rpc_call_push messages and rpc_call_finish the call
 * (exactly once). The server calls back, on the event loop's thread or the thread running
 * rpc_server_shutdown, never holding its locks; callbacks must not block:
 * - ended(arg, why): the call is over for the client (cancelled, deadline passed, connection
 *   lost: RPC_END_CLIENT) or the server began shutting down (RPC_END_SHUTDOWN: finish with
 *   UNAVAILABLE so the client resumes elsewhere). At most once. The owner must finish the call
 *   soon; pushes fail from then on (client) or still go out (shutdown, within the grace).
 * - drained(arg): after rpc_call_push returned 0 (queue full), the queue has emptied to half.
 * - release(arg): the call is freed (finished, and the core let go of it): the owner's state
 *   may go. Exactly once, last. It may run inside rpc_call_finish, so the caller of
 *   rpc_call_finish must not touch state that release frees after the call.
 * ended and drained may race with the owner's rpc_call_finish on another thread: the owner
 * keeps its own "finished" flag; its state stays valid until release. */
enum rpc_end { RPC_END_CLIENT, RPC_END_SHUTDOWN };

struct rpc_async_ops {
    void (*ended)(void *arg, enum rpc_end why);
    void (*drained)(void *arg);
    void (*release)(void *arg);
};

/* rpc_call_async attaches ops and arg to a call of an RPC_ASYNC method. false when the call is
 * already over for the client or the server is stopping: then nothing is attached and the
 * caller finishes the call itself (and keeps its state). */
CF_MUST_CHECK bool rpc_call_async(struct rpc_call *c, const struct rpc_async_ops *ops, void *arg);

/* rpc_call_push queues one message of a server stream without ever blocking: 1 queued, room
 * left; 0 queued, and the queue is now full (RPC_ASYNC_QUEUE_MSGS messages or
 * RPC_ASYNC_QUEUE_BYTES bytes waiting): stop producing until the drained callback; -1 the call
 * is dead or finished (the message is dropped). Usable on any streaming call. */
CF_MUST_CHECK int rpc_call_push(struct rpc_call *c, const ProtobufCMessage *msg);

/* rpc_call_push_packed is rpc_call_push of a message already encoded (rpc_pack), so one message
 * sent to many streams is encoded once: the call queues a copy sharing packed's bytes, and the
 * caller keeps packed. */
CF_MUST_CHECK int rpc_call_push_packed(struct rpc_call *c, grpc_byte_buffer *packed);

/* rpc_server_post runs job(arg) on the server's worker pool (FIFO with the calls waiting for a
 * worker; one worker woken). For RPC_ASYNC feeders: reads that may block briefly. The work item
 * is caller-owned storage (rpc_work) that must stay valid until fn runs; each item may be
 * queued once at a time. false once the workers are stopping (after every call ended). */
struct rpc_work {
    void (*fn)(struct rpc_work *w);
    struct rpc_work *next;
};
CF_MUST_CHECK bool rpc_server_post(struct rpc_server *s, struct rpc_work *w);

/* rpc_server_async_calls returns how many RPC_ASYNC calls are open. */
int rpc_server_async_calls(struct rpc_server *s);

/* rpc_call_finish ends the call with a gRPC status and details (NULL: none). The handle is
 * invalid afterwards. Exactly once per call. */
void rpc_call_finish(struct rpc_call *c, grpc_status_code code, const char *details);

/* rpc_call_fail ends the call with the gRPC code of st and a printf-formatted message. */
void rpc_call_fail(struct rpc_call *c, enum cf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* rpc_call_fail_error ends the call with err's code and message. */
void rpc_call_fail_error(struct rpc_call *c, const struct cf_error *err);

/* rpc_call_cancelled reports whether the call is over for the client (cancelled, deadline
 * passed, connection lost) or the server is shutting down. */
bool rpc_call_cancelled(struct rpc_call *c);

/* rpc_call_client_gone reports whether the client side of the call is over (cancelled,
 * deadline passed, connection lost), ignoring server shutdown: for calls that should be let
 * finish within the shutdown grace period. */
bool rpc_call_client_gone(struct rpc_call *c);

/* rpc_call_wait waits up to ms milliseconds or until the call is cancelled, whichever comes
 * first; returns rpc_call_cancelled(). */
bool rpc_call_wait(struct rpc_call *c, int ms);

/* rpc_call_remaining_ms returns the milliseconds left before the client's deadline, or -1 when
 * the call has none. */
int64_t rpc_call_remaining_ms(struct rpc_call *c);

/* rpc_call_metadata copies the value of the first request metadata entry named key (lower
 * case, as gRPC delivers keys) into out, NUL-terminated. false, with out "", when there is
 * none, or when its value holds a NUL byte or is longer than out_len - 1 bytes: a value is
 * never cut short (a cut value could pass for another). Callable from any thread while the
 * call lives (the metadata is read-only once the call arrived). */
bool rpc_call_metadata(struct rpc_call *c, const char *key, char *out, size_t out_len);

/* rpc_call_trace reads the W3C trace context the call carried (request metadata
 * `traceparent`, and `tracestate`, each sent once or more, joined by ',') into out: CF_OK;
 * CF_NOT_FOUND when it carried no traceparent; CF_INVALID (err says why) when the traceparent
 * is malformed, longer than TRACE_PARENT_INPUT_MAX - 1 bytes or sent twice. out holds no trace
 * unless CF_OK; a tracestate that is malformed or too long is dropped, the trace kept
 * (trace.h). The server makes this the current trace of the thread running the call's handler
 * (trace_current), for as long as the handler runs; a handler that hands the call to another
 * thread reads it here to carry it there. Callable from any thread while the call lives. */
struct trace_ctx;
CF_MUST_CHECK enum cf_status rpc_call_trace(struct rpc_call *c, struct trace_ctx *out,
                                            struct cf_error *err);

/* rpc_call_server returns the server serving the call. */
struct rpc_server *rpc_call_server(struct rpc_call *c);

/* ---- client ---- */

struct rpc_channel;

/* The outcome of a client call as the server (or the local core) reported it. */
struct rpc_status {
    grpc_status_code code;
    char details[CF_ERROR_MSG_MAX];
    char reason[CF_ERROR_REASON_MAX]; /* the server's ErrorInfo reason; "" when none came */
};

/* rpc_channel_new connects lazily to target ("127.0.0.1:7001", "unix:/path"). Never NULL.
 * Plaintext, or TLS once tls_client_load (tls.h) was called: the server's certificate must
 * chain to its CA and name the target's host (an IP SAN for an address).
 * Reconnection is bounded: after a lost or refused connection the channel retries after
 * 100 ms, then backs off to at most 1 s between attempts (each attempt may take 1 s to
 * connect); a call that finds the channel in TRANSIENT_FAILURE, or fails UNAVAILABLE, makes
 * the next attempt start at once. So a peer that comes back is used again within about a
 * second, however long or often it was away. Calls still fail UNAVAILABLE at once while the
 * peer is down (no wait-for-ready): retrying is the caller's policy.
 * A peer lost without a reset (a hung process, a host cut off) is noticed by the connection's
 * pings within twice rpc_keepalive_ms() while a call is in flight, however long that call is
 * silent (rpc_client.c, KEEPALIVE); its calls then fail UNAVAILABLE. */
struct rpc_channel *rpc_channel_new(const char *target, int max_message_bytes);

/* rpc_set_keepalive_ms sets how long a connection with a call in flight may go without word
 * from its peer before it is pinged, and how long the ping may go unanswered before the
 * connection is dropped, for the channels and the servers made after it (a server pings its
 * clients' connections alike): 10 s unless set, clamped to 1 s .. 1 h. Call before the first
 * channel or server. rpc_keepalive_ms reads it. */
void rpc_set_keepalive_ms(int ms);
int rpc_keepalive_ms(void);

/* rpc_channel_add_metadata makes every call started on ch from now on send the request
 * metadata key: value (key in lower case; e.g. "authorization", "Bearer <token>"); both are
 * copied and released with the channel. At most RPC_CHANNEL_METADATA_MAX entries: false,
 * adding nothing, beyond. Not thread-safe: call before any call on ch starts. */
#define RPC_CHANNEL_METADATA_MAX 4
bool rpc_channel_add_metadata(struct rpc_channel *ch, const char *key, const char *value);

/* rpc_channel_free closes the channel (NULL is fine). Every call must be over (its probe, if
 * one is in flight, is cancelled and ends on its own). */
void rpc_channel_free(struct rpc_channel *ch);

/* rpc_channel_cancel_all cancels every call in flight on ch (they end CANCELLED with why as
 * details) and makes every later call on ch fail CANCELLED at once without being sent.
 * Thread-safe, for a watchdog or signal thread while other threads are blocked in calls;
 * idempotent (the first why is kept). The channel must still be freed by its owner. */
void rpc_channel_cancel_all(struct rpc_channel *ch, const char *why);

/* rpc_unary makes one blocking unary call. timeout_ms <= 0 means no deadline. On status OK,
 * *resp_out holds the decoded response (free with protobuf_c_message_free_unpacked);
 * otherwise it is NULL. Returns st->code == GRPC_STATUS_OK. */
CF_MUST_CHECK bool rpc_unary(struct rpc_channel *ch, const char *method,
                             const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             ProtobufCMessage **resp_out, struct rpc_status *st);

struct rpc_stream;

/* rpc_stream_open starts a server-streaming call. Never NULL; errors surface from
 * rpc_stream_read and rpc_stream_finish. */
struct rpc_stream *rpc_stream_open(struct rpc_channel *ch, const char *method,
                                   const ProtobufCMessage *req, int64_t timeout_ms);

/* rpc_stream_read blocks for the next message: 1 with *msg_out set (free it), 0 at the end of
 * the stream (then call rpc_stream_finish for the status), -1 if a message cannot be
 * decoded. */
CF_MUST_CHECK int rpc_stream_read(struct rpc_stream *s, const ProtobufCMessageDescriptor *desc,
                                  ProtobufCMessage **msg_out);

/* rpc_stream_cancel cancels the call from any thread; reads then end. */
void rpc_stream_cancel(struct rpc_stream *s);

/* rpc_stream_finish waits for the final status, fills st, and frees the stream. */
bool rpc_stream_finish(struct rpc_stream *s, struct rpc_status *st);

/* ---- event-driven client streams ----
 *
 * rpc_astream_open starts a server-streaming call that holds no thread: completions are
 * handled by one process-wide thread, which calls the owner back (callbacks must not block):
 * - on_message(arg, msg): one decoded message, which the owner takes (free it). No further
 *   message comes until the owner calls rpc_astream_next (that is the backpressure).
 * - on_end(arg, st): the stream is over (status from the server, or the local core: deadline,
 *   cancel, lost connection; a message that does not decode ends it INTERNAL). Exactly once,
 *   always (after a release too), and last: the owner's state must live until on_end.
 * The owner calls rpc_astream_release exactly once when done with the stream, from any thread
 * or inside on_end: it cancels the call if still running (on_end follows, CANCELLED); no
 * on_message comes after it. Streams are not linked for rpc_channel_cancel_all. */
struct rpc_astream;

struct rpc_astream_ops {
    void (*on_message)(void *arg, ProtobufCMessage *msg);
    void (*on_end)(void *arg, const struct rpc_status *st);
};

/* rpc_astream_open starts the call and its first read. Never NULL. timeout_ms <= 0: none. */
struct rpc_astream *rpc_astream_open(struct rpc_channel *ch, const char *method,
                                     const ProtobufCMessage *req,
                                     const ProtobufCMessageDescriptor *desc, int64_t timeout_ms,
                                     const struct rpc_astream_ops *ops, void *arg);

/* rpc_astream_next asks for the next message (after on_message); idempotent. */
void rpc_astream_next(struct rpc_astream *s);

/* rpc_astream_release ends the owner's use of s (NULL is fine); see above. */
void rpc_astream_release(struct rpc_astream *s);

/* ---- event-driven unary calls ----
 *
 * rpc_acall_start makes one unary call that holds no thread: on the same process-wide loop
 * thread as the streams, done(arg, st, resp) runs exactly once when the call is over, with the
 * decoded response on status OK (the callee takes it: free with
 * protobuf_c_message_free_unpacked) and NULL otherwise (a response that does not decode is
 * INTERNAL). done must not block; it may run before rpc_acall_start returns (a call that
 * cannot start, or a channel cancelled by rpc_channel_cancel_all, which cancels these calls
 * too). The request is copied: the caller may free it at once. timeout_ms <= 0: no deadline. */
typedef void (*rpc_acall_done_fn)(void *arg, const struct rpc_status *st, ProtobufCMessage *resp);

void rpc_acall_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                     rpc_acall_done_fn done, void *arg);

/* ---- codec ---- */

/* rpc_pack serializes a message into a new byte buffer (caller destroys it). */
grpc_byte_buffer *rpc_pack(const ProtobufCMessage *msg);

/* rpc_unpack decodes a byte buffer; NULL when the bytes are not a valid message. */
ProtobufCMessage *rpc_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb);

/* rpc_block_signals blocks SIGINT/SIGTERM/SIGPIPE/SIGHUP in the calling thread, so that every
 * thread it starts afterwards inherits the mask and only a sigwait takes them (daemon.h). A
 * daemon calls it (through daemon_configure) before it starts any thread. */
void rpc_block_signals(void);

/* rpc_global_init blocks the signals (rpc_block_signals), routes gRPC logs and calls
 * grpc_init. */
void rpc_global_init(void);

/* rpc_global_shutdown calls grpc_shutdown_blocking and forgets the client's TLS files
 * (tls_client_clear). */
void rpc_global_shutdown(void);

#endif
