/* rpc_client.c - blocking unary and server-streaming calls, event-driven unary calls and
 * server streams, and the protobuf-c codec.
 *
 * Each blocking call gets its own pluck completion queue, created and drained with the call;
 * the event-driven ones share one completion queue and its thread (see below). Channels
 * are shared between threads; calls on one channel multiplex over one HTTP/2 connection.
 *
 * Reconnection: the core's defaults back off up to two minutes between connection attempts,
 * so a peer that returns after a few outages would go unused for a long time. Channels are
 * created with a bounded backoff (first retry after RECONNECT_INITIAL_MS, never more than
 * RECONNECT_MAX_MS apart), and a call that finds the channel in TRANSIENT_FAILURE, or that
 * fails UNAVAILABLE, resets the backoff so the next attempt starts at once (at most one reset
 * per RESET_INTERVAL_MS per channel, so a tight retry loop cannot turn into a connect storm).
 *
 * Every call in flight is linked into its channel so rpc_channel_cancel_all can end them from
 * another thread (the CLI's signal and deadline watchdog).
 *
 * Trace context: a call started while the calling thread has a current trace (trace.h) sends
 * `traceparent` with the trace's id and flags and a new parent-id (the call's own span), and
 * the trace's `tracestate`; the call keeps the slices until it is freed.
 *
 * A peer that is lost silently: see KEEPALIVE below, and the probe that keeps it working on
 * a connection whose calls send nothing for minutes (a long tool call).
 */
#include "rpc.h"

#include "errinfo.h"
#include "rpc_loop.h"

#include "clock.h"
#include "log.h"
#include "mem.h"
#include "thread.h"
#include "tls.h"
#include "trace.h"

#include "grpc/health/v1/health.pb-c.h"

#include <dlfcn.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RECONNECT_INITIAL_MS 100
#define RECONNECT_MAX_MS 1000
#define CONNECT_TIMEOUT_MS 1000 /* GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: a connect attempt's floor */
#define RESET_INTERVAL_MS 100
/* KEEPALIVE: a connection with a call in flight is pinged (HTTP/2 PING) after
 * rpc_keepalive_ms() (10 s) without word from the peer, and dropped when the ping goes
 * unanswered as long again: a peer that hangs, or whose host is gone without a reset (packets
 * dropped), fails the calls on it within 20 s, and the next call connects again (to what the
 * address names now) instead of waiting for TCP to give up (about 15 minutes, or never on a
 * connection with nothing to send).
 *
 * gRPC's client sends at most two pings until it writes data again, and a server counts the
 * pings that come while it writes nothing as abuse beyond a rate (gRPC's default policy: one
 * per 5 minutes) and then drops the connection. So a call that sends and receives nothing for
 * longer than two pings (a tool call running for minutes) would be left unguarded, and a
 * connection whose server writes nothing for long could be dropped for its pings. The PROBE
 * keeps both sides writing within every server's policy: when a channel has calls in flight
 * and, for rpc_keepalive_ms(), no call started on it or nothing came back on it (heard), the
 * client loop makes one grpc.health.v1 Check on it. Its request and answer are the writes
 * that let the next pings go out and clear the server's count (any answer will do,
 * UNIMPLEMENTED too; what it says is not used: a peer that answers pings is alive, and one
 * that does not is dropped by the pings). The probe takes the channel's current connection:
 * a silent call left on an older one (the server sent GOAWAY, say) keeps only gRPC's two
 * pings. */
#define KEEPALIVE_DEFAULT_MS 10000
#define KEEPALIVE_MIN_MS 1000
#define KEEPALIVE_MAX_MS 3600000
#define PROBE_TICKS 4  /* the loop looks for channels to probe KEEPALIVE / PROBE_TICKS apart */
#define PROBE_BATCH 64 /* probes started per look at most (the rest at the next) */

/* One call in flight on a channel, linked while it may block. */
struct live_call {
    grpc_call *call;
    bool probe; /* the channel's PROBE: not counted as busy */
    struct live_call *prev, *next;
};

struct rpc_channel {
    grpc_channel *ch;
    char target[128]; /* for the logs */
    pthread_mutex_t mu;
    _Atomic int refs;        /* the owner's (until rpc_channel_free), each event-driven call's */
    struct live_call *calls; /* in flight, for rpc_channel_cancel_all */
    bool cancelled;          /* rpc_channel_cancel_all was called */
    char cancel_why[128];
    _Atomic int64_t last_reset_ms;
    /* the PROBE, under mu: calls in flight (the probe not counted), whether a probe is */
    int busy;
    bool probing;
    _Atomic int64_t last_start_ms;             /* when a call last started on it */
    _Atomic int64_t last_heard_ms;             /* when its peer last answered on it (heard) */
    struct rpc_channel *open_prev, *open_next; /* in g_open until rpc_channel_free */
    /* request metadata sent with every call (rpc_channel_add_metadata) */
    grpc_metadata md[RPC_CHANNEL_METADATA_MAX];
    size_t n_md;
};

grpc_byte_buffer *rpc_pack(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

ProtobufCMessage *rpc_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb)) {
        return NULL;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    grpc_byte_buffer_reader_destroy(&r);
    return m;
}

void rpc_block_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGPIPE);
    sigaddset(&set, SIGHUP); /* taken by daemon_wait_for_stop_or_hup, else ignored */
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

/* quiet_lock_order_checks turns off abseil's lock-order checks under gRPC. Debian builds abseil
 * without NDEBUG, which leaves them on: every absl::Mutex lock in gRPC then records the order of
 * the locks its thread holds in one process-wide graph (about 3% of the daemons' CPU in a
 * profile), and an order it takes for a cycle aborts the process. gRPC's release builds run
 * without them. absl::SetMutexDeadlockDetectionMode is C++, so it is looked up by its name in
 * Debian 12's abseil; with another abseil the name is missing and nothing changes. */
static void quiet_lock_order_checks(void)
{
    void *sym = dlsym(RTLD_DEFAULT,
                      "_ZN4absl7debian329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE");
    if (sym) {
        void (*set_mode)(int);
        memcpy(&set_mode, &sym, sizeof(set_mode));
        set_mode(0); /* absl::OnDeadlockCycle::kIgnore */
    }
}

/* loop_cq is the event loop's queue for a client call, starting the loop if need be. A process
 * that cannot start its thread stops, as it would out of memory (crash-only). */
static grpc_completion_queue *loop_cq(void)
{
    struct cf_error err;
    if (rpc_loop_start(&err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_error("rpc_loop_thread", "msg=\"cannot start the gRPC event loop\" err=%s",
                  log_quote(q, sizeof(q), err.msg));
        abort();
    }
    return rpc_loop_cq();
}

static int64_t probe_look(void);
static void probes_start(void);

void rpc_global_init(void)
{
    rpc_block_signals();
    log_capture_grpc();
    quiet_lock_order_checks();
    grpc_init();
    probes_start();
    rpc_loop_set_tick(probe_look);
}

static void probes_stop(void);

void rpc_global_shutdown(void)
{
    probes_stop();
    rpc_loop_stop();
    grpc_shutdown_blocking();
    tls_client_clear();
}

static _Atomic int keepalive_ms = KEEPALIVE_DEFAULT_MS;

void rpc_set_keepalive_ms(int ms)
{
    atomic_store(&keepalive_ms, ms < KEEPALIVE_MIN_MS   ? KEEPALIVE_MIN_MS
                                : ms > KEEPALIVE_MAX_MS ? KEEPALIVE_MAX_MS
                                                        : ms);
}

int rpc_keepalive_ms(void)
{
    return atomic_load(&keepalive_ms);
}

/* The channels whose owner has not freed them yet, which the PROBE looks through. Lock order:
 * g_open.mu before a channel's mu. */
static struct {
    pthread_mutex_t mu;
    struct rpc_channel *head;
} g_open = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct rpc_channel *channel_ref(struct rpc_channel *ch)
{
    atomic_fetch_add(&ch->refs, 1);
    return ch;
}

static void channel_unref(struct rpc_channel *ch)
{
    if (atomic_fetch_sub(&ch->refs, 1) != 1) {
        return;
    }
    for (size_t i = 0; i < ch->n_md; i++) {
        grpc_slice_unref(ch->md[i].key);
        grpc_slice_unref(ch->md[i].value); /* may hold a secret: gone with the channel */
    }
    pthread_mutex_destroy(&ch->mu);
    free(ch);
}

static grpc_arg int_arg(char *key, int value)
{
    grpc_arg a;
    memset(&a, 0, sizeof(a));
    a.type = GRPC_ARG_INTEGER;
    a.key = key;
    a.value.integer = value;
    return a;
}

struct rpc_channel *rpc_channel_new(const char *target, int max_message_bytes)
{
    struct rpc_channel *c = mem_alloc(sizeof(*c));
    grpc_channel_credentials *creds = tls_channel_credentials();
    int max = max_message_bytes > 0 ? max_message_bytes : 16 << 20;
    grpc_arg args[] = {
        int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max),
        int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max),
        int_arg(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, RECONNECT_INITIAL_MS),
        int_arg(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, CONNECT_TIMEOUT_MS),
        int_arg(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RECONNECT_MAX_MS),
        int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, rpc_keepalive_ms()),
        int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, rpc_keepalive_ms()),
    };
    grpc_channel_args ca = {sizeof(args) / sizeof(args[0]), args};
    c->ch = grpc_channel_create(target, creds, &ca);
    grpc_channel_credentials_release(creds);
    snprintf(c->target, sizeof(c->target), "%s", target);
    pthread_mutex_init(&c->mu, NULL);
    atomic_init(&c->refs, 1);
    atomic_init(&c->last_start_ms, clock_mono_ms());
    atomic_init(&c->last_heard_ms, clock_mono_ms());
    (void)loop_cq(); /* the PROBE runs there */
    pthread_mutex_lock(&g_open.mu);
    c->open_next = g_open.head;
    if (g_open.head) {
        g_open.head->open_prev = c;
    }
    g_open.head = c;
    pthread_mutex_unlock(&g_open.mu);
    return c;
}

bool rpc_channel_add_metadata(struct rpc_channel *ch, const char *key, const char *value)
{
    if (ch->n_md == RPC_CHANNEL_METADATA_MAX) {
        return false;
    }
    grpc_metadata *m = &ch->md[ch->n_md++];
    memset(m, 0, sizeof(*m));
    m->key = grpc_slice_from_copied_string(key);
    m->value = grpc_slice_from_copied_string(value);
    return true;
}

/* cancel_probe cancels ch's probe if one is in flight; under ch->mu. */
static void cancel_probe(struct rpc_channel *ch)
{
    for (struct live_call *lc = ch->calls; lc; lc = lc->next) {
        if (lc->probe) {
            grpc_call_cancel(lc->call, NULL);
        }
    }
}

void rpc_channel_free(struct rpc_channel *ch)
{
    if (!ch) {
        return;
    }
    pthread_mutex_lock(&g_open.mu);
    if (ch->open_prev) {
        ch->open_prev->open_next = ch->open_next;
    } else {
        g_open.head = ch->open_next;
    }
    if (ch->open_next) {
        ch->open_next->open_prev = ch->open_prev;
    }
    pthread_mutex_lock(&ch->mu);
    cancel_probe(ch); /* its end lets go of the last reference */
    pthread_mutex_unlock(&ch->mu);
    pthread_mutex_unlock(&g_open.mu);
    grpc_channel_destroy(ch->ch); /* calls still ending keep the core's channel */
    channel_unref(ch);
}

/* reset_backoff makes the channel's next connection attempt start now, at most once per
 * RESET_INTERVAL_MS. */
static void reset_backoff(struct rpc_channel *ch)
{
    int64_t now = clock_mono_ms();
    int64_t last = atomic_load(&ch->last_reset_ms);
    if (now - last >= RESET_INTERVAL_MS &&
        atomic_compare_exchange_strong(&ch->last_reset_ms, &last, now)) {
        grpc_channel_reset_connect_backoff(ch->ch);
    }
}

/* call_begin links a new call into its channel, or returns false (the call must not start)
 * when the channel was cancelled. A call (not a probe) that finds the channel failing asks for
 * a fresh connect. */
static bool call_begin(struct rpc_channel *ch, struct live_call *lc, grpc_call *call, bool probe)
{
    lc->call = call;
    lc->probe = probe;
    lc->prev = NULL;
    pthread_mutex_lock(&ch->mu);
    if (ch->cancelled) {
        pthread_mutex_unlock(&ch->mu);
        return false;
    }
    lc->next = ch->calls;
    if (ch->calls) {
        ch->calls->prev = lc;
    }
    ch->calls = lc;
    ch->busy += !lc->probe;
    pthread_mutex_unlock(&ch->mu);
    atomic_store(&ch->last_start_ms, clock_mono_ms());
    if (!probe &&
        grpc_channel_check_connectivity_state(ch->ch, 0) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
        reset_backoff(ch); /* a probe's channel may be closed by the time it ends: none */
    }
    return true;
}

/* heard notes word from ch's peer for the PROBE: a message, or a call's end with a status
 * the peer may have sent (not one the local core makes for a lost connection, a deadline or a
 * cancel). */
static void heard(struct rpc_channel *ch, grpc_status_code code)
{
    if (code != GRPC_STATUS_UNAVAILABLE && code != GRPC_STATUS_DEADLINE_EXCEEDED &&
        code != GRPC_STATUS_CANCELLED) {
        atomic_store(&ch->last_heard_ms, clock_mono_ms());
    }
}

/* call_end unlinks a call; afterwards rpc_channel_cancel_all no longer touches it. */
static void call_end(struct rpc_channel *ch, struct live_call *lc, grpc_status_code code)
{
    pthread_mutex_lock(&ch->mu);
    if (lc->prev) {
        lc->prev->next = lc->next;
    } else {
        ch->calls = lc->next;
    }
    if (lc->next) {
        lc->next->prev = lc->prev;
    }
    ch->busy -= !lc->probe;
    pthread_mutex_unlock(&ch->mu);
    heard(ch, code);
    /* not for a probe: its channel may be closed by now (the probe holds only our struct) */
    if (code == GRPC_STATUS_UNAVAILABLE && !lc->probe) {
        reset_backoff(ch);
    }
}

static void set_cancelled_status(struct rpc_channel *ch, struct rpc_status *st)
{
    pthread_mutex_lock(&ch->mu);
    st->code = GRPC_STATUS_CANCELLED;
    snprintf(st->details, sizeof(st->details), "%s", ch->cancel_why);
    snprintf(st->reason, sizeof(st->reason), "%s", errinfo_default_reason(st->code));
    pthread_mutex_unlock(&ch->mu);
}

void rpc_channel_cancel_all(struct rpc_channel *ch, const char *why)
{
    pthread_mutex_lock(&ch->mu);
    if (!ch->cancelled) {
        ch->cancelled = true;
        snprintf(ch->cancel_why, sizeof(ch->cancel_why), "%s", why ? why : "cancelled");
    }
    for (struct live_call *lc = ch->calls; lc; lc = lc->next) {
        grpc_call_cancel_with_status(lc->call, GRPC_STATUS_CANCELLED, ch->cancel_why, NULL);
    }
    pthread_mutex_unlock(&ch->mu);
}

static gpr_timespec deadline_in(int64_t ms)
{
    if (ms <= 0) {
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    }
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void drain_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

/* copy_status fills st from a finished call: code, details, and the ErrorInfo reason of the
 * trailer (or, when the server sent none, the reason named after the code). */
static void copy_status(struct rpc_status *st, grpc_status_code code, grpc_slice details,
                        const grpc_metadata_array *trailer)
{
    size_t n = GRPC_SLICE_LENGTH(details);
    st->code = code;
    if (n >= sizeof(st->details)) {
        n = sizeof(st->details) - 1;
    }
    memcpy(st->details, GRPC_SLICE_START_PTR(details), n);
    st->details[n] = '\0';
    st->reason[0] = '\0';
    if (code != GRPC_STATUS_OK && !errinfo_find_reason(trailer, st->reason, sizeof(st->reason))) {
        snprintf(st->reason, sizeof(st->reason), "%s", errinfo_default_reason(code));
    }
}

/* The request metadata of one call: the channel's entries (the channel owns their slices),
 * then the calling thread's trace (slices of the call's own, from md[n_channel] on). */
struct call_md {
    grpc_metadata md[RPC_CHANNEL_METADATA_MAX + 2];
    size_t n, n_channel;
};

/* call_md_init fills m for a call on ch started now, on the calling thread. */
static void call_md_init(struct call_md *m, struct rpc_channel *ch)
{
    char parent[TRACE_PARENT_SIZE];
    memset(m, 0, sizeof(*m));
    memcpy(m->md, ch->md, sizeof(ch->md[0]) * ch->n_md);
    m->n = m->n_channel = ch->n_md;
    if (trace_outgoing(parent)) {
        m->md[m->n].key = grpc_slice_from_static_string("traceparent");
        m->md[m->n++].value = grpc_slice_from_copied_string(parent);
        const char *state = trace_current()->state;
        if (*state) {
            m->md[m->n].key = grpc_slice_from_static_string("tracestate");
            m->md[m->n++].value = grpc_slice_from_copied_string(state);
        }
    }
}

/* call_md_cleanup releases the slices m made. Idempotent. */
static void call_md_cleanup(struct call_md *m)
{
    for (size_t i = m->n_channel; i < m->n; i++) {
        grpc_slice_unref(m->md[i].value);
    }
    m->n = m->n_channel;
}

/* send_metadata fills op with the send of a call's request metadata. */
static void send_metadata(grpc_op *op, struct call_md *m)
{
    op->op = GRPC_OP_SEND_INITIAL_METADATA;
    op->data.send_initial_metadata.count = m->n;
    op->data.send_initial_metadata.metadata = m->n ? m->md : NULL;
}

/* new_call creates ch's call to method (a path, "/pkg.Service/Method") on cq. The path is
 * copied into the call: gRPC reads a static slice's bytes when it encodes the call's headers,
 * which under load is after the caller returned, and callers build paths in their own stack
 * frames (storaged then saw a stack's leftovers as the method: UNIMPLEMENTED). */
static grpc_call *new_call(struct rpc_channel *ch, grpc_completion_queue *cq, const char *method,
                           int64_t timeout_ms)
{
    grpc_slice path = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, path,
                                               NULL, deadline_in(timeout_ms), NULL);
    grpc_slice_unref(path); /* the call holds its own reference */
    return call;
}

/* request_ops fills ops[0..3]: send the call's metadata and the request, close, receive the
 * server's initial metadata into init_md. */
static void request_ops(grpc_op ops[4], struct call_md *md, grpc_byte_buffer *send,
                        grpc_metadata_array *init_md)
{
    memset(ops, 0, sizeof(grpc_op) * 4);
    send_metadata(&ops[0], md);
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = init_md;
}

bool rpc_unary(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
               ProtobufCMessage **resp_out, struct rpc_status *st)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = new_call(ch, cq, method, timeout_ms);
    grpc_metadata_array init_md, trail_md;
    grpc_byte_buffer *send = rpc_pack(req), *recv = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    int tag = 0;
    struct live_call lc;
    struct call_md md;

    *resp_out = NULL;
    if (!call_begin(ch, &lc, call, false)) {
        set_cancelled_status(ch, st);
        grpc_byte_buffer_destroy(send);
        grpc_call_unref(call);
        drain_cq(cq);
        return false;
    }
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    call_md_init(&md, ch);
    memset(ops, 0, sizeof(ops));
    request_ops(ops, &md, send, &init_md);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) == GRPC_CALL_OK) {
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    }
    call_end(ch, &lc, code);
    copy_status(st, code, details, &trail_md);
    if (code == GRPC_STATUS_OK) {
        if (!recv || !(*resp_out = rpc_unpack(resp_desc, recv))) {
            st->code = GRPC_STATUS_INTERNAL;
            snprintf(st->details, sizeof(st->details), "the response to %s did not decode as %s",
                     method, resp_desc->name);
        }
    }
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_byte_buffer_destroy(send);
    if (recv) {
        grpc_byte_buffer_destroy(recv);
    }
    grpc_call_unref(call);
    drain_cq(cq);
    call_md_cleanup(&md);
    return st->code == GRPC_STATUS_OK;
}

struct rpc_stream {
    struct rpc_channel *ch;
    struct live_call lc;
    bool linked; /* lc is in ch's list */
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    bool got_md;
    bool ended;
    bool failed_early; /* never started: the channel was cancelled */
    int tag_open, tag_status, tag_read;
    struct call_md md;
};

struct rpc_stream *rpc_stream_open(struct rpc_channel *ch, const char *method,
                                   const ProtobufCMessage *req, int64_t timeout_ms)
{
    struct rpc_stream *s = mem_alloc(sizeof(*s));
    grpc_op ops[3];
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = new_call(ch, s->cq, method, timeout_ms);
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->code = GRPC_STATUS_UNKNOWN;
    s->details = grpc_empty_slice();
    s->ch = ch;
    s->linked = call_begin(ch, &s->lc, s->call, false);
    if (!s->linked) {
        struct rpc_status st;
        set_cancelled_status(ch, &st);
        grpc_slice_unref(s->details);
        s->code = st.code;
        s->details = grpc_slice_from_copied_string(st.details);
        s->ended = true;
        s->failed_early = true;
        return s;
    }
    grpc_byte_buffer *send = rpc_pack(req);
    call_md_init(&s->md, ch);
    memset(ops, 0, sizeof(ops));
    send_metadata(&ops[0], &s->md);
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    if (grpc_call_start_batch(s->call, ops, 3, &s->tag_open, NULL) == GRPC_CALL_OK) {
        grpc_completion_queue_pluck(s->cq, &s->tag_open, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    }
    grpc_byte_buffer_destroy(send);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &s->trail_md;
    ops[0].data.recv_status_on_client.status = &s->code;
    ops[0].data.recv_status_on_client.status_details = &s->details;
    grpc_call_start_batch(s->call, ops, 1, &s->tag_status, NULL);
    return s;
}

int rpc_stream_read(struct rpc_stream *s, const ProtobufCMessageDescriptor *desc,
                    ProtobufCMessage **msg_out)
{
    grpc_op ops[2];
    size_t n = 0;
    grpc_byte_buffer *bb = NULL;
    *msg_out = NULL;
    if (s->ended) {
        return 0;
    }
    memset(ops, 0, sizeof(ops));
    if (!s->got_md) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
        n++;
        s->got_md = true;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n].data.recv_message.recv_message = &bb;
    n++;
    if (grpc_call_start_batch(s->call, ops, n, &s->tag_read, NULL) != GRPC_CALL_OK) {
        s->ended = true;
        return 0;
    }
    grpc_completion_queue_pluck(s->cq, &s->tag_read, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!bb) {
        s->ended = true;
        return 0;
    }
    heard(s->ch, GRPC_STATUS_OK);
    *msg_out = rpc_unpack(desc, bb);
    grpc_byte_buffer_destroy(bb);
    return *msg_out ? 1 : -1;
}

void rpc_stream_cancel(struct rpc_stream *s)
{
    grpc_call_cancel(s->call, NULL);
}

bool rpc_stream_finish(struct rpc_stream *s, struct rpc_status *st)
{
    if (!s->ended) {
        grpc_call_cancel(s->call, NULL);
    }
    if (!s->failed_early) {
        grpc_completion_queue_pluck(s->cq, &s->tag_status, gpr_inf_future(GPR_CLOCK_REALTIME),
                                    NULL);
    }
    if (s->linked) {
        call_end(s->ch, &s->lc, s->code);
    }
    copy_status(st, s->code, s->details, &s->trail_md);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_call_unref(s->call);
    drain_cq(s->cq);
    call_md_cleanup(&s->md);
    free(s);
    return st->code == GRPC_STATUS_OK;
}

/* ---------- event-driven client streams ----------
 *
 * On the process's event loop (rpc_loop.h), started with the first channel: an rpc_astream
 * costs no thread while it waits. Each stream has three tags: the opening batch
 * (send request, close, receive initial metadata), the status, and the one read in flight;
 * the next read is started only when the owner asks (rpc_astream_next), which is the
 * backpressure. The stream ends once the status arrived and no read is in flight; then on_end
 * runs (unless the owner released it first) and the stream is freed once released too. */

enum atag_kind { ATAG_OPEN, ATAG_STATUS, ATAG_READ };

struct atag {
    struct rpc_loop_tag base; /* first: the loop calls base.on_event */
    enum atag_kind kind;
    struct rpc_astream *s;
};

struct rpc_astream {
    struct rpc_channel *ch; /* a reference, for the PROBE's count of calls in flight */
    bool busy;              /* counted in ch->busy until its status came */
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    const struct rpc_astream_ops *ops;
    void *arg;
    pthread_mutex_t mu;
    struct atag t_open, t_status, t_read;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    grpc_byte_buffer *bb;
    int pending;     /* batches in flight */
    bool reading;    /* a read is in flight */
    bool got_status; /* the status batch completed */
    bool ended;      /* on_end is being or was delivered */
    bool in_end;     /* on_end is running */
    bool released;   /* the owner let go */
    bool md_asked;
    struct call_md md;
};

static bool probes_stopped; /* under g_open.mu: no probe starts any more */

/* channel_busy counts a call in or out of ch's calls in flight (the PROBE looks for those). */
static void channel_busy(struct rpc_channel *ch, int delta)
{
    pthread_mutex_lock(&ch->mu);
    ch->busy += delta;
    pthread_mutex_unlock(&ch->mu);
}

static void astream_free(struct rpc_astream *s)
{
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_slice_unref(s->details);
    grpc_call_unref(s->call);
    call_md_cleanup(&s->md);
    pthread_mutex_destroy(&s->mu);
    channel_unref(s->ch);
    free(s);
}

/* astream_settle, with s->mu held, decides what happens after a completion: returns true when
 * on_end is to be delivered now; *free_out when the stream is to be freed. */
static bool astream_settle(struct rpc_astream *s, bool *free_out)
{
    bool end = false;
    if (s->got_status && !s->reading && !s->ended) {
        s->ended = true;
        s->in_end = true;
        end = true;
    }
    *free_out = !end && s->ended && !s->in_end && s->released && s->pending == 0;
    return end;
}

/* on_acomplete is a stream tag's event on the loop. */
static void on_acomplete(struct rpc_loop_tag *lt, bool success)
{
    struct atag *t = (struct atag *)lt;
    struct rpc_astream *s = t->s;
    ProtobufCMessage *msg = NULL;
    bool deliver_msg = false, bad = false, idle = false;
    pthread_mutex_lock(&s->mu);
    s->pending--;
    switch (t->kind) {
    case ATAG_OPEN:
        break;
    case ATAG_STATUS:
        s->got_status = true;
        idle = s->busy;
        s->busy = false;
        heard(s->ch, s->code);
        break;
    case ATAG_READ:
        s->reading = false;
        if (success && s->bb) {
            heard(s->ch, GRPC_STATUS_OK);
            msg = rpc_unpack(s->desc, s->bb);
            bad = !msg;
            deliver_msg = msg && !s->released;
        }
        if (s->bb) {
            grpc_byte_buffer_destroy(s->bb);
            s->bb = NULL;
        }
        break;
    }
    pthread_mutex_unlock(&s->mu);
    if (idle) {
        channel_busy(s->ch, -1);
    }
    if (bad) {
        grpc_call_cancel_with_status(s->call, GRPC_STATUS_INTERNAL,
                                     "a stream message could not be decoded", NULL);
    }
    if (deliver_msg) {
        s->ops->on_message(s->arg, msg); /* the owner takes msg and asks for the next */
    } else if (msg) {
        protobuf_c_message_free_unpacked(msg, NULL); /* the owner released the stream */
    }
    pthread_mutex_lock(&s->mu);
    bool do_free;
    bool end = astream_settle(s, &do_free);
    pthread_mutex_unlock(&s->mu);
    if (end) {
        struct rpc_status st;
        copy_status(&st, s->code, s->details, &s->trail_md);
        s->ops->on_end(s->arg, &st);
        pthread_mutex_lock(&s->mu);
        s->in_end = false;
        do_free = s->released && s->pending == 0;
        pthread_mutex_unlock(&s->mu);
    }
    if (do_free) {
        astream_free(s);
    }
}

/* An event-driven unary call: one batch (send the request, close, receive the metadata, the
 * response and the status) whose completion on the loop decodes the response and calls done.
 * The tag is the first member, so the loop finds the call from it. */
struct rpc_acall {
    struct rpc_loop_tag tag;
    struct rpc_channel *ch;
    struct live_call lc;
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    rpc_acall_done_fn done;
    void *arg;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    grpc_byte_buffer *bb;
    char method[96];
    struct call_md md;
};

/* on_aunary_complete is an event-driven unary call's end, on the loop. */
static void on_aunary_complete(struct rpc_loop_tag *t, bool ok)
{
    (void)ok; /* the status says it */
    struct rpc_acall *a = (struct rpc_acall *)t;
    struct rpc_channel *ch = a->ch;
    struct rpc_status st;
    ProtobufCMessage *resp = NULL;
    call_end(ch, &a->lc, a->code);
    copy_status(&st, a->code, a->details, &a->trail_md);
    if (st.code == GRPC_STATUS_OK && (!a->bb || !(resp = rpc_unpack(a->desc, a->bb)))) {
        st.code = GRPC_STATUS_INTERNAL;
        snprintf(st.details, sizeof(st.details), "the response to %s did not decode as %s",
                 a->method, a->desc->name);
        snprintf(st.reason, sizeof(st.reason), "%s", errinfo_default_reason(st.code));
    }
    if (a->bb) {
        grpc_byte_buffer_destroy(a->bb);
    }
    grpc_slice_unref(a->details);
    grpc_metadata_array_destroy(&a->init_md);
    grpc_metadata_array_destroy(&a->trail_md);
    grpc_call_unref(a->call);
    call_md_cleanup(&a->md);
    rpc_acall_done_fn done = a->done;
    void *arg = a->arg;
    free(a);
    done(arg, &st, resp);
    channel_unref(ch);
}

struct rpc_astream *rpc_astream_open(struct rpc_channel *ch, const char *method,
                                     const ProtobufCMessage *req,
                                     const ProtobufCMessageDescriptor *desc, int64_t timeout_ms,
                                     const struct rpc_astream_ops *ops, void *arg)
{
    struct rpc_astream *s = mem_alloc(sizeof(*s));
    s->desc = desc;
    s->ops = ops;
    s->arg = arg;
    pthread_mutex_init(&s->mu, NULL);
    s->t_open = (struct atag){{on_acomplete}, ATAG_OPEN, s};
    s->t_status = (struct atag){{on_acomplete}, ATAG_STATUS, s};
    s->t_read = (struct atag){{on_acomplete}, ATAG_READ, s};
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->code = GRPC_STATUS_UNKNOWN;
    s->details = grpc_empty_slice();
    s->ch = channel_ref(ch);
    s->call = new_call(ch, loop_cq(), method, timeout_ms);
    atomic_store(&ch->last_start_ms, clock_mono_ms());
    grpc_byte_buffer *send = rpc_pack(req);
    grpc_op ops_[4];
    call_md_init(&s->md, ch);
    request_ops(ops_, &s->md, send, &s->init_md);
    pthread_mutex_lock(&s->mu);
    thread_handoff_release(&s->t_open); /* s is read on the loop thread through the tags */
    if (grpc_call_start_batch(s->call, ops_, 4, &s->t_open, NULL) == GRPC_CALL_OK) {
        s->pending++;
    }
    grpc_op st;
    memset(&st, 0, sizeof(st));
    st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st.data.recv_status_on_client.status = &s->code;
    st.data.recv_status_on_client.status_details = &s->details;
    st.data.recv_status_on_client.trailing_metadata = &s->trail_md;
    thread_handoff_release(&s->t_status);
    if (grpc_call_start_batch(s->call, &st, 1, &s->t_status, NULL) == GRPC_CALL_OK) {
        s->pending++;
        s->busy = true; /* until the status comes */
        channel_busy(ch, 1);
    } else {
        s->got_status = true; /* never started: end at the first read */
        s->code = GRPC_STATUS_INTERNAL;
    }
    pthread_mutex_unlock(&s->mu);
    grpc_byte_buffer_destroy(send);
    rpc_astream_next(s);
    return s;
}

void rpc_astream_next(struct rpc_astream *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->reading || s->ended || s->released) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->bb;
    thread_handoff_release(&s->t_read);
    if (grpc_call_start_batch(s->call, &op, 1, &s->t_read, NULL) == GRPC_CALL_OK) {
        s->reading = true;
        s->pending++;
    }
    pthread_mutex_unlock(&s->mu);
}

void rpc_astream_release(struct rpc_astream *s)
{
    if (!s) {
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->released = true;
    bool do_free = s->ended && !s->in_end && s->pending == 0;
    /* once the lock is let go the loop may free s: keep the call alive on our own ref */
    grpc_call *call = do_free ? NULL : s->call;
    if (call) {
        grpc_call_ref(call);
    }
    pthread_mutex_unlock(&s->mu);
    if (do_free) {
        astream_free(s);
        return;
    }
    grpc_call_cancel(call, NULL); /* completions follow on the loop, which frees s */
    grpc_call_unref(call);
}

/* acall_start is rpc_acall_start; probe: the call is ch's PROBE. */
static void acall_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                        rpc_acall_done_fn done, void *arg, bool probe)
{
    struct rpc_acall *a = mem_alloc(sizeof(*a));
    memset(a, 0, sizeof(*a));
    a->tag = (struct rpc_loop_tag){on_aunary_complete};
    a->ch = channel_ref(ch);
    a->desc = resp_desc;
    a->done = done;
    a->arg = arg;
    a->code = GRPC_STATUS_UNKNOWN;
    a->details = grpc_empty_slice();
    snprintf(a->method, sizeof(a->method), "%s", method);
    grpc_metadata_array_init(&a->init_md);
    grpc_metadata_array_init(&a->trail_md);
    a->call = new_call(ch, loop_cq(), method, timeout_ms);
    grpc_byte_buffer *send = rpc_pack(req);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    call_md_init(&a->md, ch);
    request_ops(ops, &a->md, send, &a->init_md);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &a->bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &a->trail_md;
    ops[5].data.recv_status_on_client.status = &a->code;
    ops[5].data.recv_status_on_client.status_details = &a->details;
    bool started = false;
    grpc_call *call = a->call;
    if (call_begin(ch, &a->lc, call, probe)) {
        /* a is the loop's from here (read through its tag): nothing below reads it once the
         * batch started */
        thread_handoff_release(&a->tag);
        started = grpc_call_start_batch(call, ops, 6, &a->tag, NULL) == GRPC_CALL_OK;
        if (!started) {
            call_end(ch, &a->lc, GRPC_STATUS_INTERNAL);
        }
    }
    grpc_byte_buffer_destroy(send);
    if (started) {
        return; /* the loop calls done */
    }
    struct rpc_status st;
    pthread_mutex_lock(&ch->mu);
    bool cancelled = ch->cancelled;
    pthread_mutex_unlock(&ch->mu);
    if (cancelled) {
        set_cancelled_status(ch, &st);
    } else {
        st.code = GRPC_STATUS_INTERNAL;
        snprintf(st.details, sizeof(st.details), "the call to %s could not start", method);
        snprintf(st.reason, sizeof(st.reason), "%s", errinfo_default_reason(st.code));
    }
    grpc_slice_unref(a->details);
    grpc_metadata_array_destroy(&a->init_md);
    grpc_metadata_array_destroy(&a->trail_md);
    grpc_call_unref(a->call);
    call_md_cleanup(&a->md);
    free(a);
    done(arg, &st, NULL);
    channel_unref(ch);
}

void rpc_acall_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                     rpc_acall_done_fn done, void *arg)
{
    acall_start(ch, method, req, resp_desc, timeout_ms, done, arg, false);
}

/* probe_done ends a PROBE: what the peer answered does not matter (see KEEPALIVE), but a
 * probe that got no answer is logged, beside what the calls on the channel then report. */
static void probe_done(void *arg, const struct rpc_status *st, ProtobufCMessage *resp)
{
    struct rpc_channel *ch = arg;
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    if (st->code == GRPC_STATUS_DEADLINE_EXCEEDED || st->code == GRPC_STATUS_UNAVAILABLE) {
        log_info("rpc_probe",
                 "target=%s code=%d msg=\"a peer with calls in flight did not answer a "
                 "probe: the connection is dropped if its pings go unanswered too\"",
                 ch->target, (int)st->code);
    }
    pthread_mutex_lock(&ch->mu);
    ch->probing = false;
    pthread_mutex_unlock(&ch->mu);
}

/* probe_look starts the PROBE on each open channel that has calls in flight, no probe in
 * flight, and has started no call or heard nothing for rpc_keepalive_ms(); the loop's tick.
 * The probes start under g_open.mu, so a channel being freed meanwhile is not probed
 * (rpc_channel_free takes it out of g_open first). Returns when to look next (ms). */
static int64_t probe_look(void)
{
    int64_t now = clock_mono_ms();
    int keepalive = rpc_keepalive_ms();
    int started = 0;
    pthread_mutex_lock(&g_open.mu);
    for (struct rpc_channel *ch = g_open.head; ch && !probes_stopped && started < PROBE_BATCH;
         ch = ch->open_next) {
        if (now - atomic_load(&ch->last_start_ms) < keepalive &&
            now - atomic_load(&ch->last_heard_ms) < keepalive) {
            continue;
        }
        /* a channel failing to connect has no connection to look at: a probe would fail at
         * once, every look, and say nothing the calls' own failures do not */
        if (grpc_channel_check_connectivity_state(ch->ch, 0) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
            continue;
        }
        pthread_mutex_lock(&ch->mu);
        bool due = ch->busy > 0 && !ch->probing && !ch->cancelled;
        ch->probing |= due;
        pthread_mutex_unlock(&ch->mu);
        if (due) {
            Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
            acall_start(ch, "/grpc.health.v1.Health/Check", &rq.base,
                        &grpc__health__v1__health_check_response__descriptor, keepalive, probe_done,
                        ch, true);
            started++;
        }
    }
    pthread_mutex_unlock(&g_open.mu);
    return keepalive / PROBE_TICKS;
}

/* probes_start lets probe_look start probes again (after an rpc_global_shutdown). */
static void probes_start(void)
{
    pthread_mutex_lock(&g_open.mu);
    probes_stopped = false;
    pthread_mutex_unlock(&g_open.mu);
}

/* probes_stop cancels the probes in flight and starts no more (before the loop stops). */
static void probes_stop(void)
{
    pthread_mutex_lock(&g_open.mu);
    probes_stopped = true;
    for (struct rpc_channel *ch = g_open.head; ch; ch = ch->open_next) {
        pthread_mutex_lock(&ch->mu);
        cancel_probe(ch);
        pthread_mutex_unlock(&ch->mu);
    }
    pthread_mutex_unlock(&g_open.mu);
}
