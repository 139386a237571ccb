/* rpc_server.c - the server side of the gRPC layer.
 *
 * Method: every call's events come on the process's event loop (rpc_loop.h), whose one thread
 * also carries the client's event-driven calls. Each registered method keeps
 * SLOTS_PER_METHOD request slots posted; a few generic slots catch unknown methods and answer
 * UNIMPLEMENTED. A call's state (struct rpc_call) holds three tags: new-call, close and
 * send. It is reference counted: one reference for the RECV_CLOSE_ON_SERVER op, one for the
 * handler until it finishes the call, one per send batch in flight. Only one send batch is
 * in flight per call; further messages wait in a small queue (backpressure above
 * SEND_BACKLOG) and the final status rides on the last batch. Shutdown waits for the core's
 * shutdown tag and then for our own count of live calls, because the core's notification
 * does not cover calls a handler still holds.
 *
 * Admission: the loop never decodes a large request and never waits. A new RPC_POOL call
 * joins a bounded FIFO (max_queue calls, max_queue_bytes of undecoded request bytes) or is
 * refused at once with RESOURCE_EXHAUSTED; a worker takes it, drops it with
 * DEADLINE_EXCEEDED if its deadline passed while it waited (or CANCELLED if the client left),
 * and only then decodes the request and runs the handler. RPC_THREAD calls are decoded on
 * their own thread. RPC_INLINE calls (health checks among them) run on the loop when their
 * request is small (INLINE_DECODE_MAX), so they keep being answered while the queue is full;
 * a larger one goes through the queue like a pool call. Workers are woken one per job.
 *
 * Event-driven streams (RPC_ASYNC): admitted like pool calls, and charged RPC_ASYNC_CALL_BYTES
 * each against max_stream_memory (refused with RESOURCE_EXHAUSTED past it). The handler attaches
 * an owner (rpc_async_ops) and returns; the call then holds no thread. Pushes never block: the
 * per-call queue reports "full" at RPC_ASYNC_QUEUE_MSGS / _BYTES and the owner pauses until
 * drained (half empty). The close op (client cancel, deadline, lost connection) and a failed
 * send deliver ended(RPC_END_CLIENT); shutdown delivers ended(RPC_END_SHUTDOWN) to every attached
 * call at once. Owner callbacks run without our locks, while the callback's path holds a
 * reference; release runs from call_free, before the call stops counting as live, so shutdown
 * returns only after every owner let go. rpc_server_post gives owners the worker pool.
 */
#include "rpc.h"

#include "clock.h"
#include "errinfo.h"
#include "log.h"
#include "mem.h"
#include "metrics.h"
#include "pbcheck.h"
#include "rpc_loop.h"
#include "thread.h"
#include "trace.h"

#include "grpc/health/v1/health.pb-c.h"

#include <errno.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SLOTS_PER_METHOD 8
#define GENERIC_SLOTS 2
#define SEND_BACKLOG 16
#define MAX_METHODS 48
#define INLINE_DECODE_MAX (64 << 10) /* larger RPC_INLINE requests are decoded on a worker */
#define DEFAULT_QUEUE 256
#define DEFAULT_QUEUE_BYTES (64 << 20)
#define STREAM_SPARES_MAX 8          /* finished stream threads kept for the next stream */
#define STREAM_SPARE_LINGER_MS 10000 /* how long a spare stream thread waits for one */
#define HEALTH_STOP_LINGER_MS 150    /* a health Watch stays open after its NOT_SERVING */
#define PING_MIN_MS 5000             /* pings closer than this, with nothing sent, are strikes */

enum tag_kind { TAG_NEW_CALL, TAG_NEW_GENERIC, TAG_CLOSE, TAG_SEND, TAG_SHUTDOWN };

struct tag {
    struct rpc_loop_tag base; /* first: the loop calls base.on_event (on_event) */
    enum tag_kind kind;
    void *owner;
};

struct method {
    char *path;
    char *service;
    const ProtobufCMessageDescriptor *req_desc;
    rpc_handler_fn fn;
    void *user;
    enum rpc_mode mode;
    void *handle;
    bool lenient_strings;       /* bad text fields are reported to the handler, not refused */
    atomic_uint_fast64_t calls; /* calls received (rpc_server_method_calls) */
};

struct pending_send {
    grpc_byte_buffer *bb;
    struct pending_send *next;
};

struct rpc_call {
    struct rpc_server *srv;
    struct method *m; /* NULL for a generic (unknown-method) slot */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
    ProtobufCMessage *req;
    struct tag t_new, t_close, t_send;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    int cancelled; /* written by the core when the close op completes */
    bool closed;   /* the close op completed */
    bool dead;     /* no more sends possible */
    bool finished; /* the handler finished the call */
    bool sending;  /* a send batch is in flight */
    bool md_sent;
    bool status_pending;
    bool status_sent;
    grpc_status_code status_code;
    grpc_slice status_details;
    bool has_details;
    grpc_metadata status_trailer; /* errors: google.rpc.Status with an ErrorInfo */
    bool has_trailer;
    struct pending_send *q_head, *q_tail;
    int q_len;
    grpc_byte_buffer *inflight;
    bool live;                    /* counted in srv->live_calls */
    int64_t started_us;           /* monotonic: when the call arrived (for its latency) */
    char *input_problem;          /* lenient methods: what pbcheck found, or NULL */
    struct rpc_call *next_queued; /* the server's pending-call queue */
    size_t queued_bytes;          /* undecoded request bytes counted in srv->queue_bytes */
    size_t q_bytes;               /* bytes of the messages in q_head..q_tail */
    /* RPC_ASYNC */
    bool async_counted;              /* charged against max_stream_memory */
    const struct rpc_async_ops *ops; /* attached by rpc_call_async, or NULL */
    void *ops_arg;
    bool ended_sent;                  /* ops->ended was delivered (or is being) */
    bool want_drain;                  /* rpc_call_push reported full */
    struct rpc_call *a_prev, *a_next; /* the server's list of attached async calls */
};

struct rpc_server {
    struct rpc_server_opts opts;
    struct metric *handled, *latency; /* cflue_rpc_server_* (metrics.h) */
    grpc_server *server;
    grpc_completion_queue *cq; /* the event loop's (rpc_loop.h), from rpc_server_start */
    struct method methods[MAX_METHODS];
    int n_methods;
    pthread_t *workers;
    int n_workers; /* threads started */
    int slots_out; /* request slots posted whose tag has not come back (under mu) */
    struct tag t_shutdown;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* live calls, shutdown */
    pthread_cond_t work_cv; /* a job was queued, or workers must quit */
    bool started;
    bool stopping;
    bool shutdown_done;
    bool stopped;
    bool serving;
    bool ready; /* what the daemon needs is there (rpc_server_set_ready) */
    int live_calls;
    int threads_running;                      /* RPC_THREAD handlers running */
    int threads_alive;                        /* stream threads: running a handler or spare */
    int threads_spare;                        /* stream threads waiting for a call */
    struct rpc_call *spare_head, *spare_tail; /* calls handed to spare threads */
    int spare_queued;
    pthread_cond_t spare_cv; /* a call was handed over, or spares must quit */
    bool spares_quit;
    struct rpc_call *queue_head, *queue_tail; /* calls waiting for a worker */
    int queue_len;
    size_t queue_bytes;
    bool workers_quit;
    int64_t rejected, expired; /* calls refused because the queue was full; dropped late */
    int64_t last_reject_log_ms;
    struct rpc_work *work_head, *work_tail; /* rpc_server_post jobs */
    int async_calls;                        /* open RPC_ASYNC calls (charged) */
    struct rpc_call *async_head;            /* attached async calls */
    bool log_stats; /* CFLUE_RPC_STATS=1: log each method's call count at shutdown */
    grpc_server_credentials *creds; /* rpc_server_set_credentials: TLS; NULL: plaintext */
};

static void post_slot(struct rpc_server *s, struct method *m);
void rpc_server_set_ready(struct rpc_server *s, bool ready)
{
    pthread_mutex_lock(&s->mu);
    s->ready = ready;
    pthread_cond_broadcast(&s->cv); /* health watchers */
    pthread_mutex_unlock(&s->mu);
}

static bool wait_until(struct rpc_server *s, bool (*cond)(struct rpc_server *), int ms);
static void post_generic(struct rpc_server *s);

/* ---------- call lifetime ---------- */

static void on_event(struct rpc_loop_tag *lt, bool ok);

static struct rpc_call *call_new(struct rpc_server *s, struct method *m)
{
    struct rpc_call *c = mem_alloc(sizeof(*c));
    c->srv = s;
    c->m = m;
    c->t_new = (struct tag){{on_event}, m ? TAG_NEW_CALL : TAG_NEW_GENERIC, c};
    c->t_close = (struct tag){{on_event}, TAG_CLOSE, c};
    c->t_send = (struct tag){{on_event}, TAG_SEND, c};
    grpc_metadata_array_init(&c->md);
    if (!m) {
        grpc_call_details_init(&c->details);
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    return c;
}

static void call_free(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    while (c->q_head) {
        struct pending_send *p = c->q_head;
        c->q_head = p->next;
        grpc_byte_buffer_destroy(p->bb);
        free(p);
    }
    if (c->has_details) {
        grpc_slice_unref(c->status_details);
    }
    if (c->has_trailer) {
        grpc_slice_unref(c->status_trailer.value);
    }
    if (c->payload) {
        grpc_byte_buffer_destroy(c->payload);
    }
    if (c->req) {
        protobuf_c_message_free_unpacked(c->req, NULL);
    }
    free(c->input_problem);
    if (c->call) {
        grpc_call_unref(c->call);
    }
    grpc_metadata_array_destroy(&c->md);
    if (!c->m) {
        grpc_call_details_destroy(&c->details);
    }
    bool live = c->live;
    const struct rpc_async_ops *ops = c->ops;
    void *ops_arg = c->ops_arg;
    if (live || c->async_counted || ops) {
        pthread_mutex_lock(&s->mu);
        if (ops) {
            if (c->a_prev) {
                c->a_prev->a_next = c->a_next;
            } else {
                s->async_head = c->a_next;
            }
            if (c->a_next) {
                c->a_next->a_prev = c->a_prev;
            }
        }
        if (c->async_counted) {
            s->async_calls--;
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* only now: until it left the async list above, end_async_calls could still lock c->mu */
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    if (ops && ops->release) {
        ops->release(ops_arg);
    }
    if (live) {
        /* after release: once no call is live, shutdown returns and the owner's world goes */
        pthread_mutex_lock(&s->mu);
        s->live_calls--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

static void call_unref(struct rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left == 0) {
        call_free(c);
    }
}

/* pump starts the next send batch if none is in flight. Called with c->mu held. */
static void pump(struct rpc_call *c)
{
    grpc_op ops[3];
    size_t n = 0;

    if (c->sending || c->status_sent) {
        return;
    }
    if (c->dead) {
        while (c->q_head) {
            struct pending_send *p = c->q_head;
            c->q_head = p->next;
            grpc_byte_buffer_destroy(p->bb);
            free(p);
        }
        c->q_tail = NULL;
        c->q_len = 0;
        c->q_bytes = 0;
        pthread_cond_broadcast(&c->cv);
        return;
    }
    if (!c->q_head && !c->status_pending) {
        return;
    }
    memset(ops, 0, sizeof(ops));
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->md_sent = true;
    }
    if (c->q_head) {
        struct pending_send *p = c->q_head;
        c->q_head = p->next;
        if (!c->q_head) {
            c->q_tail = NULL;
        }
        c->q_len--;
        c->q_bytes -= grpc_byte_buffer_length(p->bb);
        c->inflight = p->bb;
        free(p);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->inflight;
        n++;
    }
    if (!c->q_head && c->status_pending) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = c->status_code;
        ops[n].data.send_status_from_server.status_details =
            c->has_details ? &c->status_details : NULL;
        ops[n].data.send_status_from_server.trailing_metadata_count = c->has_trailer ? 1 : 0;
        ops[n].data.send_status_from_server.trailing_metadata =
            c->has_trailer ? &c->status_trailer : NULL;
        n++;
        c->status_pending = false;
        c->status_sent = true;
    }
    c->sending = true;
    c->refs++;
    thread_handoff_release(&c->t_send);
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL);
    if (e != GRPC_CALL_OK) {
        log_error("rpc_send_failed", "code=%d", (int)e);
        c->sending = false;
        c->refs--;
        c->dead = true;
        if (c->inflight) {
            grpc_byte_buffer_destroy(c->inflight);
            c->inflight = NULL;
        }
    }
    pthread_cond_broadcast(&c->cv);
}

/* take_ended decides, with c->mu held, whether ops->ended is to be delivered now: the call
 * has an owner that has not finished it, and was not told before. */
static bool take_ended(struct rpc_call *c)
{
    if (!c->ops || c->ended_sent || c->finished) {
        return false;
    }
    c->ended_sent = true;
    return true;
}

static void on_send_done(struct rpc_call *c, int success)
{
    bool drained = false, ended = false;
    pthread_mutex_lock(&c->mu);
    c->sending = false;
    if (c->inflight) {
        grpc_byte_buffer_destroy(c->inflight);
        c->inflight = NULL;
    }
    if (!success) {
        c->dead = true;
        ended = take_ended(c);
    }
    pump(c);
    if (c->want_drain && !c->dead && c->q_len <= RPC_ASYNC_QUEUE_MSGS / 2 &&
        c->q_bytes <= RPC_ASYNC_QUEUE_BYTES / 2) {
        c->want_drain = false;
        drained = !c->finished && c->ops && c->ops->drained;
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (ended) {
        c->ops->ended(c->ops_arg, RPC_END_CLIENT);
    }
    if (drained) {
        c->ops->drained(c->ops_arg);
    }
    call_unref(c);
}

static void on_close(struct rpc_call *c)
{
    bool ended = false;
    pthread_mutex_lock(&c->mu);
    c->closed = true;
    if (c->cancelled) {
        c->dead = true;
        pump(c);
        ended = take_ended(c);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (ended) {
        c->ops->ended(c->ops_arg, RPC_END_CLIENT);
    }
    call_unref(c);
}

/* ---------- handler side ---------- */

static void enqueue_locked(struct rpc_call *c, grpc_byte_buffer *bb)
{
    struct pending_send *p = mem_alloc(sizeof(*p));
    p->bb = bb;
    if (c->q_tail) {
        c->q_tail->next = p;
    } else {
        c->q_head = p;
    }
    c->q_tail = p;
    c->q_len++;
    c->q_bytes += grpc_byte_buffer_length(bb);
}

/* observe_call counts a finished call in cflue_rpc_server_handled_total and its latency. */
static void observe_call(const struct rpc_call *c, grpc_status_code code)
{
    struct rpc_server *s = c->srv;
    const char *method = c->m ? c->m->path : "unknown";
    metrics_add(s->handled, METRICS_LABELS(method, errinfo_default_reason(code)), 1);
    if (c->started_us) {
        metrics_observe(s->latency, METRICS_LABELS(method),
                        (double)(clock_mono_us() - c->started_us) / 1e6);
    }
}

/* finish_locked queues the call's status; an error status also gets its ErrorInfo trailer
 * (reason NULL or "": the one named after the code). */
static void finish_locked(struct rpc_call *c, grpc_status_code code, const char *details,
                          const char *reason)
{
    observe_call(c, code);
    c->finished = true;
    c->status_pending = true;
    c->status_code = code;
    if (details && *details) {
        c->status_details = grpc_slice_from_copied_string(details);
        c->has_details = true;
    }
    if (code != GRPC_STATUS_OK) {
        c->status_trailer.key = grpc_slice_from_static_string(ERRINFO_TRAILER_KEY);
        c->status_trailer.value = errinfo_pack(code, details, reason);
        c->has_trailer = true;
    }
    pump(c);
}

void rpc_call_reply(struct rpc_call *c, const ProtobufCMessage *resp)
{
    grpc_byte_buffer *bb = rpc_pack(resp);
    pthread_mutex_lock(&c->mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        log_error("rpc_double_finish", "method=%s", c->m ? c->m->path : "?");
        return;
    }
    if (c->dead) {
        grpc_byte_buffer_destroy(bb);
    } else {
        enqueue_locked(c, bb);
    }
    finish_locked(c, GRPC_STATUS_OK, NULL, NULL);
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

bool rpc_call_send(struct rpc_call *c, const ProtobufCMessage *msg)
{
    grpc_byte_buffer *bb = rpc_pack(msg);
    int64_t stall = c->srv->opts.stall_ms, until = clock_mono_ms() + stall;
    pthread_mutex_lock(&c->mu);
    int queued = c->q_len;
    while (!c->dead && !c->finished && c->q_len >= SEND_BACKLOG) {
        int64_t now = clock_mono_ms();
        if (c->q_len < queued) {
            until = now + stall; /* the client took some: it is reading, however slowly */
        }
        queued = c->q_len;
        if (now >= until) {
            log_warn("rpc_stream_stalled", "method=%s stall_ms=%lld", c->m->path, (long long)stall);
            grpc_call_cancel_with_status(c->call, GRPC_STATUS_DEADLINE_EXCEEDED,
                                         "the client read nothing for too long", NULL);
            c->dead = true;
            break;
        }
        struct timespec ts;
        clock_deadline(&ts, until - now);
        clock_cond_wait(&c->cv, &c->mu, &ts);
    }
    if (c->dead || c->finished) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        return false;
    }
    enqueue_locked(c, bb);
    pump(c);
    pthread_mutex_unlock(&c->mu);
    return true;
}

/* push queues bb (taken) on c: rpc_call_push's result. */
static int push(struct rpc_call *c, grpc_byte_buffer *bb)
{
    pthread_mutex_lock(&c->mu);
    if (c->dead || c->finished) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        return -1;
    }
    enqueue_locked(c, bb);
    pump(c);
    bool full = c->q_len >= RPC_ASYNC_QUEUE_MSGS || c->q_bytes >= RPC_ASYNC_QUEUE_BYTES;
    if (full) {
        c->want_drain = true;
    }
    pthread_mutex_unlock(&c->mu);
    return full ? 0 : 1;
}

int rpc_call_push(struct rpc_call *c, const ProtobufCMessage *msg)
{
    return push(c, rpc_pack(msg));
}

int rpc_call_push_packed(struct rpc_call *c, grpc_byte_buffer *packed)
{
    return push(c, grpc_byte_buffer_copy(packed));
}

bool rpc_call_async(struct rpc_call *c, const struct rpc_async_ops *ops, void *arg)
{
    struct rpc_server *s = c->srv;
    bool ok;
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&c->mu);
    ok = !s->stopping && !c->dead && !(c->closed && c->cancelled) && !c->finished && !c->ops;
    if (ok) {
        c->ops = ops;
        c->ops_arg = arg;
        c->a_prev = NULL;
        c->a_next = s->async_head;
        if (s->async_head) {
            s->async_head->a_prev = c;
        }
        s->async_head = c;
    }
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&s->mu);
    return ok;
}

int rpc_server_async_calls(struct rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->async_calls;
    pthread_mutex_unlock(&s->mu);
    return n;
}

bool rpc_server_post(struct rpc_server *s, struct rpc_work *w)
{
    pthread_mutex_lock(&s->mu);
    if (s->workers_quit) {
        pthread_mutex_unlock(&s->mu);
        return false;
    }
    w->next = NULL;
    if (s->work_tail) {
        s->work_tail->next = w;
    } else {
        s->work_head = w;
    }
    s->work_tail = w;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    return true;
}

static void finish_with_reason(struct rpc_call *c, grpc_status_code code, const char *details,
                               const char *reason)
{
    pthread_mutex_lock(&c->mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->mu);
        log_error("rpc_double_finish", "method=%s", c->m ? c->m->path : "?");
        return;
    }
    finish_locked(c, code, details, reason);
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

void rpc_call_finish(struct rpc_call *c, grpc_status_code code, const char *details)
{
    finish_with_reason(c, code, details, NULL);
}

void rpc_call_fail(struct rpc_call *c, enum cf_status st, const char *fmt, ...)
{
    char msg[CF_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    finish_with_reason(c, status_grpc_code(st), msg, status_reason(st));
}

void rpc_call_fail_error(struct rpc_call *c, const struct cf_error *err)
{
    finish_with_reason(c, status_grpc_code(err->code),
                       err->msg[0] ? err->msg : status_message(err->code), cf_error_reason(err));
}

/* call_dead reports whether the client side of the call is gone. */
static bool call_dead(struct rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    bool dead = c->dead || (c->closed && c->cancelled);
    pthread_mutex_unlock(&c->mu);
    return dead;
}

const char *rpc_call_input_problem(struct rpc_call *c)
{
    return c->input_problem;
}

void rpc_server_lenient_strings(struct rpc_server *s, const char *path)
{
    for (int i = 0; i < s->n_methods; i++) {
        if (!strcmp(s->methods[i].path, path)) {
            s->methods[i].lenient_strings = true;
        }
    }
}

bool rpc_call_client_gone(struct rpc_call *c)
{
    return call_dead(c);
}

bool rpc_call_cancelled(struct rpc_call *c)
{
    return call_dead(c) || rpc_server_stopping(c->srv);
}

bool rpc_call_wait(struct rpc_call *c, int ms)
{
    struct timespec ts;
    clock_deadline(&ts, ms);
    pthread_mutex_lock(&c->mu);
    if (!c->dead && !c->closed) {
        clock_cond_wait(&c->cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return rpc_call_cancelled(c);
}

int64_t rpc_call_remaining_ms(struct rpc_call *c)
{
    if (gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) == 0) {
        return -1;
    }
    gpr_timespec left = gpr_time_sub(c->deadline, gpr_now(c->deadline.clock_type));
    int64_t ms = gpr_time_to_millis(left);
    return ms < 0 ? 0 : ms;
}

bool rpc_call_metadata(struct rpc_call *c, const char *key, char *out, size_t out_len)
{
    for (size_t i = 0; i < c->md.count; i++) {
        grpc_slice k = c->md.metadata[i].key;
        if (GRPC_SLICE_LENGTH(k) == strlen(key) &&
            !memcmp(GRPC_SLICE_START_PTR(k), key, strlen(key))) {
            grpc_slice v = c->md.metadata[i].value;
            size_t n = GRPC_SLICE_LENGTH(v);
            if (n >= out_len || memchr(GRPC_SLICE_START_PTR(v), '\0', n)) {
                break; /* never cut short: a cut value could pass for another */
            }
            memcpy(out, GRPC_SLICE_START_PTR(v), n);
            out[n] = '\0';
            return true;
        }
    }
    if (out_len) {
        out[0] = '\0';
    }
    return false;
}

struct rpc_server *rpc_call_server(struct rpc_call *c)
{
    return c->srv;
}

/* md_join copies the values of every request metadata entry named key into out, joined by
 * ',' (how HTTP combines a header sent more than once); *count_out is how many there were.
 * false when there is none, or when they hold a NUL byte or do not fit whole. */
static bool md_join(struct rpc_call *c, const char *key, char *out, size_t out_len, int *count_out)
{
    size_t o = 0, klen = strlen(key);
    bool fits = true;
    *count_out = 0;
    for (size_t i = 0; i < c->md.count; i++) {
        grpc_slice k = c->md.metadata[i].key;
        if (GRPC_SLICE_LENGTH(k) != klen || memcmp(GRPC_SLICE_START_PTR(k), key, klen)) {
            continue;
        }
        grpc_slice v = c->md.metadata[i].value;
        size_t n = GRPC_SLICE_LENGTH(v);
        size_t sep = (*count_out)++ ? 1 : 0;
        if (!fits || o + sep + n >= out_len || memchr(GRPC_SLICE_START_PTR(v), '\0', n)) {
            fits = false;
            continue;
        }
        if (sep) {
            out[o++] = ',';
        }
        memcpy(out + o, GRPC_SLICE_START_PTR(v), n);
        o += n;
    }
    if (out_len) {
        out[fits ? o : 0] = '\0';
    }
    return fits && *count_out > 0;
}

enum cf_status rpc_call_trace(struct rpc_call *c, struct trace_ctx *out, struct cf_error *err)
{
    char parent[TRACE_PARENT_INPUT_MAX], state[TRACE_STATE_INPUT_MAX];
    int n_parent, n_state;
    bool has = md_join(c, "traceparent", parent, sizeof(parent), &n_parent);
    memset(out, 0, sizeof(*out));
    if (!n_parent) {
        return cf_error_set(err, CF_NOT_FOUND, "no traceparent");
    }
    if (n_parent > 1) {
        return cf_error_set(err, CF_INVALID, "traceparent came %d times", n_parent);
    }
    if (!has) {
        return cf_error_set(err, CF_INVALID, "traceparent is longer than %d bytes or holds NUL",
                            TRACE_PARENT_INPUT_MAX - 1);
    }
    /* a tracestate that does not fit is dropped, the trace kept */
    bool has_state = md_join(c, "tracestate", state, sizeof(state), &n_state);
    return trace_parse(out, parent, has_state ? state : NULL, err);
}

/* ---------- dispatch ---------- */

/* decode turns the call's payload into c->req. On failure the call is finished (bad request)
 * and false is returned. Runs on a worker or a call's own thread, or on the loop for small
 * RPC_INLINE requests. */
static bool decode(struct rpc_call *c)
{
    if (!c->payload) {
        rpc_call_fail(c, CF_INVALID, "the request carried no message for %s", c->m->path);
        return false;
    }
    grpc_byte_buffer_reader reader;
    grpc_slice bytes = grpc_empty_slice();
    if (grpc_byte_buffer_reader_init(&reader, c->payload)) {
        bytes = grpc_byte_buffer_reader_readall(&reader);
        grpc_byte_buffer_reader_destroy(&reader);
    }
    grpc_byte_buffer_destroy(c->payload);
    c->payload = NULL;
    struct cf_error err;
    if (pbcheck_strings(c->m->req_desc, GRPC_SLICE_START_PTR(bytes), GRPC_SLICE_LENGTH(bytes),
                        &err) != CF_OK) {
        if (!c->m->lenient_strings) {
            grpc_slice_unref(bytes);
            rpc_call_fail(c, CF_INVALID, "malformed request: %s", err.msg);
            return false;
        }
        c->input_problem = mem_strdup(err.msg);
    }
    c->req = protobuf_c_message_unpack(c->m->req_desc, NULL, GRPC_SLICE_LENGTH(bytes),
                                       GRPC_SLICE_START_PTR(bytes));
    grpc_slice_unref(bytes);
    if (!c->req) {
        rpc_call_fail(c, CF_INVALID, "malformed request: the bytes do not decode as %s",
                      c->m->req_desc->name);
        return false;
    }
    return true;
}

/* decode_and_run runs the handler with the trace the call carried (traceparent, tracestate) as
 * the thread's current one, so its log lines and the calls it makes carry it; a call without
 * a usable one runs without a trace. */
static void decode_and_run(struct rpc_call *c)
{
    struct trace_ctx t, saved;
    struct cf_error err;
    if (rpc_call_trace(c, &t, &err) != CF_OK && err.code == CF_INVALID) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_debug("trace_refused", "method=%s why=%s", c->m->path,
                  log_quote(q, sizeof(q), err.msg));
    }
    trace_enter(&t, &saved);
    if (decode(c)) {
        c->m->fn(c, c->req, c->m->user);
    }
    trace_leave(&saved);
}

/* next_stream_call waits, as a spare, for the next call handed to this thread: NULL when none
 * came within STREAM_SPARE_LINGER_MS, the spares are full or the server is stopping (the
 * thread then leaves). Called with s->mu held. */
static struct rpc_call *next_stream_call(struct rpc_server *s)
{
    if (s->spares_quit || s->threads_spare >= STREAM_SPARES_MAX) {
        return NULL;
    }
    struct timespec ts;
    clock_deadline(&ts, STREAM_SPARE_LINGER_MS);
    s->threads_spare++;
    while (!s->spare_head && !s->spares_quit) {
        if (clock_cond_wait(&s->spare_cv, &s->mu, &ts) != 0) {
            break;
        }
    }
    s->threads_spare--;
    struct rpc_call *c = s->spare_head;
    if (c) {
        s->spare_head = c->next_queued;
        if (!s->spare_head) {
            s->spare_tail = NULL;
        }
        c->next_queued = NULL;
        s->spare_queued--;
    }
    return c;
}

static void *thread_main(void *arg)
{
    struct rpc_call *c = arg;
    struct rpc_server *s = c->srv;
    while (c) {
        decode_and_run(c);
        pthread_mutex_lock(&s->mu);
        s->threads_running--;
        pthread_cond_broadcast(&s->cv);
        c = next_stream_call(s);
        if (!c) {
            s->threads_alive--;
            pthread_cond_broadcast(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

/* start_thread runs an RPC_THREAD call on a spare stream thread, or on a new one when no spare
 * is free (a new thread costs a stack and, on some machines, a good part of a short call). */
static void start_thread(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    struct cf_error err;
    pthread_mutex_lock(&s->mu);
    if (s->threads_running >= s->opts.max_threads) {
        pthread_mutex_unlock(&s->mu);
        rpc_call_fail(c, CF_BUSY, "too many concurrent streams (limit %d); retry later",
                      s->opts.max_threads);
        return;
    }
    s->threads_running++;
    if (s->spare_queued < s->threads_spare) {
        /* each spare takes one queued call before it may leave: see next_stream_call */
        c->next_queued = NULL;
        if (s->spare_tail) {
            s->spare_tail->next_queued = c;
        } else {
            s->spare_head = c;
        }
        s->spare_tail = c;
        s->spare_queued++;
        pthread_cond_signal(&s->spare_cv);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->threads_alive++;
    pthread_mutex_unlock(&s->mu);
    if (thread_start_detached("rpc-stream", 0, thread_main, c, &err) != CF_OK) {
        pthread_mutex_lock(&s->mu);
        s->threads_running--;
        s->threads_alive--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        log_warn("rpc_thread_start_failed", "method=%s", c->m->path);
        rpc_call_fail(c, CF_BUSY, "the server cannot start a thread for the call (%s); retry later",
                      err.msg);
    }
}

/* enqueue puts a call in the pending-call queue for the workers, or refuses it with
 * RESOURCE_EXHAUSTED when the queue is full (by count, or by bytes unless it is empty). Never
 * waits: runs on the loop. */
static void enqueue(struct rpc_call *c, size_t bytes)
{
    struct rpc_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    /* RPC_ASYNC calls are bounded by max_stream_memory instead of the count: a burst of
     * streams opening at once (watchers reconnecting) is admitted and served in order */
    bool counted = c->m->mode != RPC_ASYNC;
    if ((counted && s->queue_len >= s->opts.max_queue) ||
        (s->queue_len > 0 && s->queue_bytes + bytes > (size_t)s->opts.max_queue_bytes)) {
        int len = s->queue_len;
        size_t qbytes = s->queue_bytes;
        int64_t now = clock_mono_ms();
        bool log_now = now - s->last_reject_log_ms >= 1000;
        s->rejected++;
        int64_t rejected = s->rejected;
        if (log_now) {
            s->last_reject_log_ms = now;
        }
        pthread_mutex_unlock(&s->mu);
        if (log_now) {
            log_warn("rpc_queue_full",
                     "method=%s queued=%d queued_bytes=%zu limit=%d limit_bytes=%d rejected=%lld",
                     c->m->path, len, qbytes, s->opts.max_queue, s->opts.max_queue_bytes,
                     (long long)rejected);
        }
        rpc_call_fail(c, CF_BUSY, "server busy: %d calls are waiting (limit %d); retry later", len,
                      s->opts.max_queue);
        return;
    }
    c->queued_bytes = bytes;
    s->queue_len++;
    s->queue_bytes += bytes;
    if (s->queue_tail) {
        s->queue_tail->next_queued = c;
    } else {
        s->queue_head = c;
    }
    s->queue_tail = c;
    pthread_cond_signal(&s->work_cv); /* one job, one worker */
    pthread_mutex_unlock(&s->mu);
}

static bool deadline_passed(const struct rpc_call *c)
{
    return gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) != 0 &&
           gpr_time_cmp(gpr_now(c->deadline.clock_type), c->deadline) >= 0;
}

/* run_queued is a worker's turn at one call: drop it if it is already over for the client,
 * otherwise decode the request and run the handler. */
static void run_queued(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    bool late = deadline_passed(c);
    if (late || call_dead(c)) {
        pthread_mutex_lock(&s->mu);
        s->expired++;
        pthread_mutex_unlock(&s->mu);
        if (late) {
            rpc_call_finish(c, GRPC_STATUS_DEADLINE_EXCEEDED,
                            "the deadline passed while the call waited for a worker");
        } else {
            rpc_call_finish(c, GRPC_STATUS_CANCELLED,
                            "the client left while the call waited for a worker");
        }
        return;
    }
    decode_and_run(c);
}

static void *worker_main(void *arg)
{
    struct rpc_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->queue_head && !s->work_head && !s->workers_quit) {
            pthread_cond_wait(&s->work_cv, &s->mu);
        }
        struct rpc_work *w = s->work_head;
        if (w) {
            s->work_head = w->next;
            if (!s->work_head) {
                s->work_tail = NULL;
            }
            w->next = NULL;
            pthread_mutex_unlock(&s->mu);
            w->fn(w);
            continue;
        }
        struct rpc_call *c = s->queue_head;
        if (!c) {
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        s->queue_head = c->next_queued;
        if (!s->queue_head) {
            s->queue_tail = NULL;
        }
        c->next_queued = NULL;
        s->queue_len--;
        s->queue_bytes -= c->queued_bytes;
        pthread_mutex_unlock(&s->mu);
        run_queued(c);
    }
}

/* begin_call makes a call that came through a request slot live, and counts the slot back;
 * returns whether to post the slot again (not once the server is stopping: then the slot is
 * counted out, as slot_lost does). */
static bool begin_call(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    grpc_op op;
    pthread_mutex_lock(&s->mu);
    s->live_calls++;
    c->live = true;
    bool again = !s->stopping;
    if (!again) {
        s->slots_out--; /* shutdown waits for this live call anyway: no wake-up */
    }
    pthread_mutex_unlock(&s->mu);
    c->refs = 2; /* the close op and the handler */
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    thread_handoff_release(&c->t_close);
    if (grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL) != GRPC_CALL_OK) {
        c->refs = 1;
        c->closed = true;
        c->dead = true;
    }
    return again;
}

/* slot_lost counts out a request slot that will not be posted again: its tag came back failed
 * (the server shut down), or the core refused it. The last one wakes a shutdown waiting for
 * them (no_live_calls), so none reaches the loop after the server is freed. Touches nothing of
 * s after. */
static void slot_lost(struct rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    if (--s->slots_out == 0) {
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
}

/* charge_async reserves an open RPC_ASYNC call's share of max_stream_memory, or refuses the
 * call with RESOURCE_EXHAUSTED. */
static bool charge_async(struct rpc_call *c)
{
    struct rpc_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    int64_t limit = s->opts.max_stream_memory / RPC_ASYNC_CALL_BYTES;
    if ((int64_t)s->async_calls + 1 > limit) {
        int n = s->async_calls;
        int64_t now = clock_mono_ms();
        bool log_now = now - s->last_reject_log_ms >= 1000;
        if (log_now) {
            s->last_reject_log_ms = now;
        }
        pthread_mutex_unlock(&s->mu);
        if (log_now) {
            log_warn("rpc_streams_full", "method=%s open=%d limit=%lld memory=%lld", c->m->path, n,
                     (long long)limit, (long long)s->opts.max_stream_memory);
        }
        rpc_call_fail(c, CF_BUSY,
                      "too many open streams: %d (memory bound %lld bytes at %d per stream); "
                      "retry later",
                      n, (long long)s->opts.max_stream_memory, RPC_ASYNC_CALL_BYTES);
        return false;
    }
    s->async_calls++;
    c->async_counted = true;
    pthread_mutex_unlock(&s->mu);
    return true;
}

/* on_new_call runs on the loop: it reposts the slot and hands the call on without decoding
 * anything but a small RPC_INLINE request. */
static void on_new_call(struct rpc_call *c, int success)
{
    struct rpc_server *s = c->srv;
    if (!success) {
        call_free(c);
        slot_lost(s);
        return;
    }
    atomic_fetch_add_explicit(&c->m->calls, 1, memory_order_relaxed);
    c->started_us = clock_mono_us();
    if (begin_call(c)) {
        post_slot(s, c->m);
    }
    size_t bytes = c->payload ? grpc_byte_buffer_length(c->payload) : 0;
    switch (c->m->mode) {
    case RPC_INLINE:
        if (bytes <= INLINE_DECODE_MAX) {
            decode_and_run(c);
            return;
        }
        enqueue(c, bytes);
        return;
    case RPC_POOL:
        enqueue(c, bytes);
        return;
    case RPC_ASYNC:
        if (!charge_async(c)) {
            return;
        }
        enqueue(c, bytes);
        return;
    case RPC_THREAD:
        start_thread(c);
        return;
    }
}

static void on_new_generic(struct rpc_call *c, int success)
{
    struct rpc_server *s = c->srv;
    char method[256];
    if (!success) {
        call_free(c);
        slot_lost(s);
        return;
    }
    if (begin_call(c)) {
        post_generic(s);
    }
    size_t n = GRPC_SLICE_LENGTH(c->details.method);
    if (n >= sizeof(method)) {
        n = sizeof(method) - 1;
    }
    memcpy(method, GRPC_SLICE_START_PTR(c->details.method), n);
    method[n] = '\0';
    char q[300];
    log_warn("rpc_unknown_method", "method=%s", log_quote(q, sizeof(q), method));
    rpc_call_fail(c, CF_UNIMPLEMENTED, "unknown method %s", method);
}

/* on_event is a server tag's event, on the loop. */
static void on_event(struct rpc_loop_tag *lt, bool ok)
{
    struct tag *t = (struct tag *)lt;
    switch (t->kind) {
    case TAG_NEW_CALL:
        on_new_call(t->owner, ok);
        break;
    case TAG_NEW_GENERIC:
        on_new_generic(t->owner, ok);
        break;
    case TAG_CLOSE:
        on_close(t->owner);
        break;
    case TAG_SEND:
        on_send_done(t->owner, ok);
        break;
    case TAG_SHUTDOWN: {
        struct rpc_server *s = t->owner;
        pthread_mutex_lock(&s->mu);
        s->shutdown_done = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        break;
    }
    }
}

static void post_slot(struct rpc_server *s, struct method *m)
{
    struct rpc_call *c = call_new(s, m);
    thread_handoff_release(&c->t_new);
    grpc_call_error e = grpc_server_request_registered_call(
        s->server, m->handle, &c->call, &c->deadline, &c->md, &c->payload, s->cq, s->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        call_free(c);
        slot_lost(s);
    }
}

static void post_generic(struct rpc_server *s)
{
    struct rpc_call *c = call_new(s, NULL);
    thread_handoff_release(&c->t_new);
    grpc_call_error e =
        grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq, s->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        call_free(c);
        slot_lost(s);
    }
}

/* ---------- health ---------- */

/* serving_status_locked: the health of a service now (s->mu held). "" and "liveness" answer
 * whether the process serves; "readiness" and every registered service also whether it is
 * ready (rpc_server_set_ready). */
static int serving_status_locked(const struct rpc_server *s, bool liveness)
{
    return s->serving && !s->stopping && (liveness || s->ready)
               ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
               : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static bool is_liveness(const char *service)
{
    return !*service || !strcmp(service, RPC_HEALTH_LIVENESS);
}

static grpc_status_code health_status(struct rpc_server *s, const char *service, int *out)
{
    bool known = is_liveness(service) || !strcmp(service, RPC_HEALTH_READINESS);
    for (int i = 0; i < s->n_methods && !known; i++) {
        known = !strcmp(s->methods[i].service, service);
    }
    if (!known) {
        return GRPC_STATUS_NOT_FOUND;
    }
    pthread_mutex_lock(&s->mu);
    *out = serving_status_locked(s, is_liveness(service));
    pthread_mutex_unlock(&s->mu);
    return GRPC_STATUS_OK;
}

/* health_wait waits up to ms for the health of service to differ from seen:
 * rpc_server_set_serving, rpc_server_set_ready and rpc_server_shutdown wake every watcher at
 * once (s->cv). */
static void health_wait(struct rpc_server *s, const char *service, int seen, int ms)
{
    struct timespec ts;
    clock_deadline(&ts, ms);
    pthread_mutex_lock(&s->mu);
    if (serving_status_locked(s, is_liveness(service)) == seen) {
        clock_cond_wait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
}

static void health_check(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)msg;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    int st;
    if (health_status(c->srv, req->service, &st) != GRPC_STATUS_OK) {
        rpc_call_fail(c, CF_NOT_FOUND, "unknown service '%s'", req->service);
        return;
    }
    resp.status = st;
    rpc_call_reply(c, &resp.base);
}

static void health_watch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)msg;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    int st, last = -1;
    if (health_status(c->srv, req->service, &st) != GRPC_STATUS_OK) {
        resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
        if (!rpc_call_send(c, &resp.base)) {
            rpc_call_finish(c, GRPC_STATUS_OK, NULL);
            return;
        }
        last = (int)resp.status;
    }
    for (;;) {
        bool stopping = rpc_server_stopping(c->srv);
        if (last != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
            health_status(c->srv, req->service, &st);
            if (st != last) {
                resp.status = st;
                if (!rpc_call_send(c, &resp.base)) {
                    break;
                }
                last = st;
            }
        }
        if (stopping) {
            /* NOT_SERVING went out above, the moment the shutdown began. The stream stays
             * open a little longer: gRPC closes the connection right after its last stream
             * ends, and a client that writes to it before reading loses what was sent last. */
            rpc_call_wait(c, HEALTH_STOP_LINGER_MS);
            break;
        }
        if (last == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
            rpc_call_wait(c, 200);
        } else {
            health_wait(c->srv, req->service, last, 200); /* a cancel is seen within 200 ms */
        }
        if (call_dead(c)) {
            break;
        }
    }
    rpc_call_finish(c, GRPC_STATUS_OK, NULL);
}

/* ---------- lifecycle ---------- */

struct rpc_server *rpc_server_new(const struct rpc_server_opts *opts)
{
    struct rpc_server *s = mem_alloc(sizeof(*s));
    s->handled = metrics_counter("cflue_rpc_server_handled_total",
                                 "gRPC calls this server finished, by method and status code.",
                                 "method,code");
    s->latency = metrics_histogram("cflue_rpc_server_handling_seconds",
                                   "Time from a call's arrival to its status, by method.", "method",
                                   metrics_latency_buckets, metrics_latency_buckets_n);
    if (opts) {
        s->opts = *opts;
    }
    if (s->opts.workers <= 0) {
        s->opts.workers = 8;
    }
    if (s->opts.max_threads <= 0) {
        s->opts.max_threads = 256;
    }
    if (s->opts.max_message_bytes <= 0) {
        s->opts.max_message_bytes = 16 << 20;
    }
    if (s->opts.max_queue <= 0) {
        s->opts.max_queue = DEFAULT_QUEUE;
    }
    if (s->opts.max_queue_bytes <= 0) {
        s->opts.max_queue_bytes = DEFAULT_QUEUE_BYTES;
    }
    if (s->opts.stall_ms <= 0) {
        s->opts.stall_ms = RPC_STALL_MS_DEFAULT;
    }
    if (s->opts.max_stream_memory <= 0) {
        s->opts.max_stream_memory = RPC_STREAM_MEMORY_DEFAULT;
    }
    grpc_arg args[] = {
        {GRPC_ARG_INTEGER,
         GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
         {.integer = s->opts.max_message_bytes}},
        {GRPC_ARG_INTEGER,
         GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
         {.integer = s->opts.max_message_bytes}},
        /* our clients ping a connection with a call in flight every 10 s (rpc_client.c): no
         * ping that often is taken for abuse, even while the server has nothing to send */
        {GRPC_ARG_INTEGER,
         GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
         {.integer = PING_MIN_MS}},
        /* and the server pings each connection with a call in flight as the clients do, with
         * no limit of pings while it sends nothing (clients do not police pings): a client
         * lost without a reset (its host gone, a NAT or balancer that drops idle connections
         * silently) is dropped within two keepalive periods, and its calls end with it, an
         * idle Watch(follow) too, instead of holding their share of max_stream_memory for
         * good */
        {GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = rpc_keepalive_ms()}},
        {GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = rpc_keepalive_ms()}},
        {GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, {.integer = 0}},
        /* gRPC sets SO_REUSEPORT by default: a second daemon started on the same TCP port (a
         * second storaged with another database, say) would bind too and get half of the
         * connections without a word, and two servers binding port 0 can be handed the same
         * port. Without it, the second bind fails: "address in use". */
        {GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}},
    };
    grpc_channel_args ca = {sizeof(args) / sizeof(args[0]), args};
    s->server = grpc_server_create(&ca, NULL);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->spare_cv, NULL);
    s->t_shutdown = (struct tag){{on_event}, TAG_SHUTDOWN, s};
    s->serving = true;
    s->ready = true;
    const char *stats = getenv("CFLUE_RPC_STATS");
    s->log_stats = stats && !strcmp(stats, "1");
    rpc_server_add_method(s, "/grpc.health.v1.Health/Check",
                          &grpc__health__v1__health_check_request__descriptor, health_check, NULL,
                          RPC_INLINE);
    rpc_server_add_method(s, "/grpc.health.v1.Health/Watch",
                          &grpc__health__v1__health_check_request__descriptor, health_watch, NULL,
                          RPC_THREAD);
    return s;
}

/* unix_listener_alive tells whether a process accepts connections on the unix socket of
 * addr ("unix:PATH" or "unix:///PATH"). gRPC removes the file of a unix socket before it
 * binds its own, so a second daemon started on a live socket would take the path from the
 * first, which would run on unreachable; a file no one listens on (left by a daemon that was
 * killed) is replaced as before. */
static bool unix_listener_alive(const char *addr)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    const char *path = addr + strlen("unix:");
    if (!strncmp(path, "//", 2)) {
        path += 2;
    }
    size_t len = strlen(path);
    if (len >= sizeof(sa.sun_path)) {
        return false; /* gRPC says what is wrong with it */
    }
    memcpy(sa.sun_path, path, len + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        return false;
    }
    /* EAGAIN: its backlog is full, so someone listens (and a blocking connect would wait) */
    bool alive = connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) == 0 || errno == EAGAIN;
    close(fd);
    return alive;
}

enum cf_status rpc_server_listen(struct rpc_server *s, const char *addr, int *port_out,
                                 struct cf_error *err)
{
    if (!strncmp(addr, "unix:", 5) && unix_listener_alive(addr)) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "cannot listen on '%s': another process is listening there (is a "
                            "daemon already running on it?)",
                            addr);
    }
    grpc_server_credentials *creds =
        s->creds ? s->creds : grpc_insecure_server_credentials_create();
    int port = grpc_server_add_http2_port(s->server, addr, creds);
    if (!s->creds) {
        grpc_server_credentials_release(creds);
    }
    if (port == 0) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "cannot listen on '%s' (address in use: is a daemon already "
                            "running on it?; or a bad address, or no permission)",
                            addr);
    }
    if (port_out) {
        *port_out = strncmp(addr, "unix", 4) == 0 ? 0 : port;
    }
    return CF_OK;
}

void rpc_server_set_credentials(struct rpc_server *s, grpc_server_credentials *creds)
{
    if (s->creds) {
        grpc_server_credentials_release(s->creds);
    }
    s->creds = creds;
}

void rpc_server_add_method(struct rpc_server *s, const char *path,
                           const ProtobufCMessageDescriptor *req_desc, rpc_handler_fn fn,
                           void *user, enum rpc_mode mode)
{
    if (s->n_methods >= MAX_METHODS) {
        log_error("rpc_too_many_methods", "path=%s", path);
        abort();
    }
    struct method *m = &s->methods[s->n_methods++];
    m->path = mem_strdup(path);
    const char *slash = strrchr(path, '/');
    m->service = mem_strndup(path + 1, (size_t)(slash - path - 1));
    m->req_desc = req_desc;
    m->fn = fn;
    m->user = user;
    m->mode = mode;
    m->handle = grpc_server_register_method(s->server, m->path, NULL,
                                            GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
}

void rpc_server_add_methods(struct rpc_server *s, const struct rpc_method_def *defs, size_t n,
                            void *user)
{
    for (size_t i = 0; i < n; i++) {
        rpc_server_add_method(s, defs[i].path, defs[i].req_desc, defs[i].fn, user, defs[i].mode);
    }
}

/* stop_threads asks the workers to quit once the queue is empty and joins every thread started
 * (the event loop is the process's: rpc_global_shutdown stops it). */
static bool no_stream_threads(struct rpc_server *s)
{
    return s->threads_alive == 0;
}

static void stop_threads(struct rpc_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->workers_quit = true;
    pthread_cond_broadcast(&s->work_cv);
    s->spares_quit = true;
    pthread_cond_broadcast(&s->spare_cv);
    pthread_mutex_unlock(&s->mu);
    wait_until(s, no_stream_threads, -1); /* detached: they touch s until they leave */
    for (int i = 0; i < s->n_workers; i++) {
        pthread_join(s->workers[i], NULL);
    }
    s->n_workers = 0;
}

enum cf_status rpc_server_start(struct rpc_server *s)
{
    struct cf_error err;
    s->workers = mem_alloc(sizeof(pthread_t) * (size_t)s->opts.workers);
    /* threads first: a server that cannot start them never accepts a call */
    for (int i = 0; i < s->opts.workers; i++) {
        if (thread_start(&s->workers[i], "rpc-worker", 0, worker_main, s, &err) != CF_OK) {
            goto fail;
        }
        s->n_workers++;
    }
    if (rpc_loop_start(&err) != CF_OK) {
        goto fail;
    }
    s->cq = rpc_loop_cq();
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    pthread_mutex_lock(&s->mu);
    s->slots_out = s->n_methods * SLOTS_PER_METHOD + GENERIC_SLOTS;
    pthread_mutex_unlock(&s->mu);
    grpc_server_start(s->server);
    for (int i = 0; i < s->n_methods; i++) {
        for (int k = 0; k < SLOTS_PER_METHOD; k++) {
            post_slot(s, &s->methods[i]);
        }
    }
    for (int k = 0; k < GENERIC_SLOTS; k++) {
        post_generic(s);
    }
    s->started = true;
    return CF_OK;

fail : {
    char q[CF_ERROR_MSG_MAX + 16];
    log_error("rpc_start_failed", "workers=%d/%d err=%s", s->n_workers, s->opts.workers,
              log_quote(q, sizeof(q), err.msg));
    stop_threads(s);
    return CF_BUSY;
}
}

bool rpc_server_stopping(const struct rpc_server *s)
{
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    bool v = s->stopping;
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
    return v;
}

void rpc_server_set_serving(struct rpc_server *s, bool serving)
{
    pthread_mutex_lock(&s->mu);
    s->serving = serving;
    pthread_cond_broadcast(&s->cv); /* health watchers */
    pthread_mutex_unlock(&s->mu);
}

static bool wait_until(struct rpc_server *s, bool (*cond)(struct rpc_server *), int ms)
{
    struct timespec ts;
    clock_deadline(&ts, ms);
    pthread_mutex_lock(&s->mu);
    while (!cond(s)) {
        if (ms < 0) {
            pthread_cond_wait(&s->cv, &s->mu);
        } else if (clock_cond_wait(&s->cv, &s->mu, &ts) != 0) {
            break;
        }
    }
    bool ok = cond(s);
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static bool is_shutdown_done(struct rpc_server *s)
{
    return s->shutdown_done;
}

/* log_stats logs one line per registered method with the calls it received (an opt-in for
 * benchmarks: CFLUE_RPC_STATS=1). */
static void log_stats(struct rpc_server *s)
{
    for (int i = 0; i < s->n_methods; i++) {
        log_info("rpc_stats", "method=%s calls=%llu", s->methods[i].path,
                 (unsigned long long)atomic_load(&s->methods[i].calls));
    }
}

uint64_t rpc_server_method_calls(struct rpc_server *s, const char *path)
{
    for (int i = 0; i < s->n_methods; i++) {
        if (!strcmp(s->methods[i].path, path)) {
            return (uint64_t)atomic_load_explicit(&s->methods[i].calls, memory_order_relaxed);
        }
    }
    return 0;
}

/* end_async_calls tells the owner of every attached RPC_ASYNC call that the server is
 * stopping (ended, RPC_END_SHUTDOWN), so idle streams finish at once instead of waiting out the
 * grace period. Each call is held by a reference while its owner is told. */
static void end_async_calls(struct rpc_server *s)
{
    size_t n = 0, cap = 0;
    struct rpc_call **picks = NULL;
    pthread_mutex_lock(&s->mu);
    for (struct rpc_call *c = s->async_head; c; c = c->a_next) {
        pthread_mutex_lock(&c->mu);
        if (c->refs > 0 && !c->ended_sent && !c->finished) {
            c->ended_sent = true;
            c->refs++;
            if (n == cap) {
                cap = cap ? cap * 2 : 64;
                picks = mem_realloc(picks, cap * sizeof(*picks));
            }
            picks[n++] = c;
        }
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        picks[i]->ops->ended(picks[i]->ops_arg, RPC_END_SHUTDOWN);
        call_unref(picks[i]);
    }
    free(picks);
}

static bool no_live_calls(struct rpc_server *s)
{
    return s->live_calls == 0 && s->threads_running == 0 && s->slots_out == 0;
}

void rpc_server_shutdown(struct rpc_server *s, int grace_ms)
{
    pthread_mutex_lock(&s->mu);
    if (s->stopped || !s->started) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->stopping = true;
    pthread_cond_broadcast(&s->cv); /* health watchers send NOT_SERVING now */
    pthread_mutex_unlock(&s->mu);

    end_async_calls(s);
    thread_handoff_release(&s->t_shutdown);

    grpc_server_shutdown_and_notify(s->server, s->cq, &s->t_shutdown);
    if (!wait_until(s, is_shutdown_done, grace_ms) || !wait_until(s, no_live_calls, grace_ms)) {
        log_warn("rpc_shutdown_cancel", "msg=\"grace period over; cancelling live calls\"");
        grpc_server_cancel_all_calls(s->server);
    }
    wait_until(s, is_shutdown_done, -1);
    wait_until(s, no_live_calls, -1);

    stop_threads(s);
    s->stopped = true;
    if (s->log_stats) {
        log_stats(s);
    }
}

void rpc_server_free(struct rpc_server *s)
{
    if (!s) {
        return;
    }
    if (s->started && !s->stopped) {
        rpc_server_shutdown(s, 0);
    }
    grpc_server_destroy(s->server);
    if (s->creds) {
        grpc_server_credentials_release(s->creds);
    }
    for (int i = 0; i < s->n_methods; i++) {
        free(s->methods[i].path);
        free(s->methods[i].service);
    }
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->spare_cv);
    free(s);
}
