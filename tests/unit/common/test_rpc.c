/* Tests of common/rpc over real loopback gRPC: the server layer and the client helpers. */
#include "../check.h"

#include "clock.h"
#include "rpc.h"
#include "trace.h"

#include "cflue/v1/store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int handler_runs; /* "count" calls whose handler ran */
static int slow_runs;    /* "slow" calls whose handler started */
static pthread_mutex_t runs_mu = PTHREAD_MUTEX_INITIALIZER;

static int runs(void)
{
    pthread_mutex_lock(&runs_mu);
    int n = handler_runs;
    pthread_mutex_unlock(&runs_mu);
    return n;
}

static int slow_started(void)
{
    pthread_mutex_lock(&runs_mu);
    int n = slow_runs;
    pthread_mutex_unlock(&runs_mu);
    return n;
}

/* Get: "ok" answers a submission echoing the id, "slow" answers after 500 ms (worker pool),
 * "count" answers and counts its runs, anything else fails NOT_FOUND with a message. */
static void on_get(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GetRequest *req = (const void *)msg;
    Cflue__V1__Submission resp = CFLUE__V1__SUBMISSION__INIT;
    if (!strcmp(req->submission_id, "slow")) {
        pthread_mutex_lock(&runs_mu);
        slow_runs++;
        pthread_mutex_unlock(&runs_mu);
        clock_sleep_ms(500);
    }
    if (!strcmp(req->submission_id, "count")) {
        pthread_mutex_lock(&runs_mu);
        handler_runs++;
        pthread_mutex_unlock(&runs_mu);
    }
    if (!strcmp(req->submission_id, "ok") || !strcmp(req->submission_id, "slow") ||
        !strcmp(req->submission_id, "count")) {
        resp.submission_id = req->submission_id;
        resp.attempt_count = 7;
        rpc_call_reply(c, &resp.base);
        return;
    }
    if (!strcmp(req->submission_id, "md")) {
        /* echoes the request metadata "x-who" (at most 8 bytes) as the submission id */
        char who[9];
        if (!rpc_call_metadata(c, "x-who", who, sizeof(who))) {
            CHECK(!*who);
            rpc_call_fail(c, CF_NOT_FOUND, "no x-who");
            return;
        }
        resp.submission_id = who;
        rpc_call_reply(c, &resp.base);
        return;
    }
    if (!strcmp(req->submission_id, "trace")) {
        /* the handler's current trace (trace_id/span_id, "" for none) as the submission id,
         * and the raw traceparent and tracestate it received as attempt and owner ids */
        char id[64] = "", tp[128], ts[128];
        const struct trace_ctx *t = trace_current();
        if (t) {
            snprintf(id, sizeof(id), "%s/%s", t->trace_id, t->span_id);
        }
        (void)rpc_call_metadata(c, "traceparent", tp, sizeof(tp));
        (void)rpc_call_metadata(c, "tracestate", ts, sizeof(ts));
        resp.submission_id = id;
        resp.attempt_id = tp;
        resp.owner_id = ts;
        rpc_call_reply(c, &resp.base);
        return;
    }
    if (!strcmp(req->submission_id, "stale")) {
        struct cf_error err;
        cf_error_set(&err, CF_STALE, "attempt a1 no longer holds it");
        rpc_call_fail_error(c, &err);
        return;
    }
    if (!strcmp(req->submission_id, "reserved")) {
        struct cf_error err;
        cf_error_setr(&err, CF_INVALID, "RESERVED_METADATA_KEY", "metadata key cflue.x is ours");
        rpc_call_fail_error(c, &err);
        return;
    }
    rpc_call_fail(c, CF_NOT_FOUND, "no submission '%s'", req->submission_id);
}

static atomic_int stream_sent;
static atomic_bool stream_saw_cancel;

/* Follow: sends after_offset+1 records; a negative count streams until cancelled. */
static void on_follow(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__FollowRequest *req = (const void *)msg;
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    int n = (int)req->after_offset;
    for (int i = 0; n < 0 || i < n; i++) {
        Cflue__V1__SystemPrompt body = CFLUE__V1__SYSTEM_PROMPT__INIT;
        body.text = "t";
        rec.offset = i;
        rec.body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
        rec.system_prompt = &body;
        if (!rpc_call_send(c, &rec.base) || rpc_call_cancelled(c)) {
            stream_saw_cancel = true;
            rpc_call_finish(c, GRPC_STATUS_CANCELLED, "cancelled");
            return;
        }
        stream_sent = i + 1;
        if (n < 0) {
            clock_sleep_ms(5);
        }
    }
    if (!strcmp(req->until_settled, "fail")) {
        rpc_call_finish(c, GRPC_STATUS_ABORTED, "stopped after the records");
        return;
    }
    rpc_call_finish(c, GRPC_STATUS_OK, NULL);
}

/* ---- RPC_ASYNC: event-driven streams ----
 *
 * "Tail" streams (test method /test.Async/Tail, FollowRequest): after_offset N > 0 pushes N
 * records from the handler and, when the queue is full, pauses until drained (the rest is
 * pushed by a pool job); then finishes OK. N <= 0 leaves the stream idle, registered in
 * `tails` for the test to push to and finish from its own thread. ended finishes the call
 * (CANCELLED, or UNAVAILABLE on shutdown); release frees the state. */
struct tail {
    struct rpc_call *call;
    struct rpc_work work; /* continue pushing after drained */
    pthread_mutex_t mu;
    int next, total;
    bool finished;
    int slot; /* index in tails, or -1 */
};

#define TAILS_MAX 4000
static struct tail *tails[TAILS_MAX];
static pthread_mutex_t tails_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int tail_released, tail_ended_client, tail_ended_shutdown, tail_pauses, tail_drains;
static struct rpc_server *tail_server;

/* tail_finish finishes t from any thread unless it finished already; t may be freed (release)
 * once rpc_call_finish runs, so nothing touches it after. */
static void tail_finish(struct tail *t, grpc_status_code code, const char *why)
{
    pthread_mutex_lock(&t->mu);
    bool was = t->finished;
    t->finished = true;
    if (!was && t->slot >= 0) {
        pthread_mutex_lock(&tails_mu);
        tails[t->slot] = NULL;
        pthread_mutex_unlock(&tails_mu);
    }
    pthread_mutex_unlock(&t->mu);
    if (!was) {
        rpc_call_finish(t->call, code, why);
    }
}

/* pump_tail pushes until the total is sent (finish OK) or the queue is full (pause). */
static void pump_tail(struct tail *t)
{
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__SystemPrompt body = CFLUE__V1__SYSTEM_PROMPT__INIT;
    body.text = "t";
    rec.body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
    rec.system_prompt = &body;
    pthread_mutex_lock(&t->mu);
    while (!t->finished && t->next < t->total) {
        rec.offset = t->next;
        int r = rpc_call_push(t->call, &rec.base);
        if (r < 0) {
            break; /* ended will finish it */
        }
        t->next++;
        if (r == 0 && t->next < t->total) {
            tail_pauses++;
            pthread_mutex_unlock(&t->mu);
            return;
        }
    }
    bool done = !t->finished && t->next == t->total;
    if (done) {
        t->finished = true;
    }
    pthread_mutex_unlock(&t->mu);
    if (done) {
        rpc_call_finish(t->call, GRPC_STATUS_OK, NULL);
    }
}

static void tail_work(struct rpc_work *w)
{
    struct tail *t = (struct tail *)((char *)w - offsetof(struct tail, work));
    pump_tail(t);
}

static void tail_drained(void *arg)
{
    struct tail *t = arg;
    tail_drains++;
    CHECK(rpc_server_post(tail_server, &t->work));
}

static void tail_ended(void *arg, enum rpc_end why)
{
    struct tail *t = arg;
    if (why == RPC_END_SHUTDOWN) {
        tail_ended_shutdown++;
    } else {
        tail_ended_client++;
    }
    tail_finish(t, why == RPC_END_SHUTDOWN ? GRPC_STATUS_UNAVAILABLE : GRPC_STATUS_CANCELLED,
                why == RPC_END_SHUTDOWN ? "the server is stopping; resume elsewhere"
                                        : "the stream was cancelled");
}

static void tail_release(void *arg)
{
    struct tail *t = arg;
    pthread_mutex_destroy(&t->mu);
    free(t);
    tail_released++;
}

static const struct rpc_async_ops tail_ops = {tail_ended, tail_drained, tail_release};

static void on_tail(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__FollowRequest *req = (const void *)msg;
    struct tail *t = calloc(1, sizeof(*t));
    t->call = c;
    t->work.fn = tail_work;
    t->total = req->after_offset > 0 ? (int)req->after_offset : 0;
    t->slot = -1;
    pthread_mutex_init(&t->mu, NULL);
    if (t->total == 0) {
        pthread_mutex_lock(&tails_mu);
        for (int i = 0; i < TAILS_MAX; i++) {
            if (!tails[i]) {
                tails[i] = t;
                t->slot = i;
                break;
            }
        }
        pthread_mutex_unlock(&tails_mu);
    }
    if (!rpc_call_async(c, &tail_ops, t)) {
        if (t->slot >= 0) {
            pthread_mutex_lock(&tails_mu);
            tails[t->slot] = NULL;
            pthread_mutex_unlock(&tails_mu);
        }
        rpc_call_finish(c, GRPC_STATUS_UNAVAILABLE, "not attached");
        pthread_mutex_destroy(&t->mu);
        free(t);
        return;
    }
    if (t->total > 0) {
        pump_tail(t);
    }
}

static int count_tails(void)
{
    int n = 0;
    pthread_mutex_lock(&tails_mu);
    for (int i = 0; i < TAILS_MAX; i++) {
        n += tails[i] != NULL;
    }
    pthread_mutex_unlock(&tails_mu);
    return n;
}

static bool wait_for(bool (*cond)(int), int arg, int ms)
{
    for (int i = 0; i < ms / 10 && !cond(arg); i++) {
        clock_sleep_ms(10);
    }
    return cond(arg);
}

static bool tails_are(int n)
{
    return count_tails() == n;
}

static bool released_is(int n)
{
    return tail_released == n;
}

static bool ended_shutdown_is(int n)
{
    return tail_ended_shutdown == n;
}

static int threads_now(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof(line), f)) {
        if (!strncmp(line, "Threads:", 8)) {
            n = atoi(line + 8);
        }
    }
    if (f) {
        fclose(f);
    }
    return n;
}

static struct rpc_stream *open_tail(struct rpc_channel *ch, int n, int64_t timeout_ms)
{
    Cflue__V1__FollowRequest req = CFLUE__V1__FOLLOW_REQUEST__INIT;
    req.after_offset = n;
    req.until_settled = "";
    return rpc_stream_open(ch, "/test.Async/Tail", &req.base, timeout_ms);
}

static struct rpc_server *start_async(int *port, int64_t max_stream_memory)
{
    struct rpc_server_opts o = {.workers = 2,
                                .max_message_bytes = 1 << 20,
                                .max_queue = 8192,
                                .max_stream_memory = max_stream_memory};
    struct rpc_server *s = rpc_server_new(&o);
    struct cf_error err;
    rpc_server_add_method(s, "/test.Async/Tail", &cflue__v1__follow_request__descriptor, on_tail,
                          NULL, RPC_ASYNC);
    CHECK(rpc_server_listen(s, "127.0.0.1:0", port, &err) == CF_OK);
    CHECK(rpc_server_start(s) == CF_OK);
    tail_server = s;
    return s;
}

#define IDLE_STREAMS 3000

static void test_async_streams(void)
{
    int port;
    char target[64];
    struct rpc_status st;
    ProtobufCMessage *m;
    struct rpc_server *s = start_async(&port, 0);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);

    /* backpressure: 3000 records through a queue of 16; the client reads late */
    tail_pauses = tail_drains = 0;
    struct rpc_stream *bs = open_tail(ch, 3000, 20000);
    clock_sleep_ms(200);
    int got = 0;
    while (rpc_stream_read(bs, &cflue__v1__record__descriptor, &m) == 1) {
        CHECK(((Cflue__V1__Record *)m)->offset == got);
        got++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_stream_finish(bs, &st);
    CHECK(got == 3000 && st.code == GRPC_STATUS_OK);
    /* every pause was ended by a drain; a push that filled the queue with the last record
     * (no pause: nothing was left to send) may get a drain of its own too */
    CHECK(tail_pauses > 0 && tail_drains >= tail_pauses && tail_drains <= tail_pauses + 1);
    fprintf(stderr, "async backpressure: %d pauses, %d drains\n", (int)tail_pauses,
            (int)tail_drains);
    CHECK(wait_for(released_is, 1, 2000));

    /* sends from another thread into idle streams, then finish from that thread */
    struct rpc_stream *is[3];
    for (int i = 0; i < 3; i++) {
        is[i] = open_tail(ch, 0, 10000);
    }
    CHECK(wait_for(tails_are, 3, 2000));
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__SystemPrompt body = CFLUE__V1__SYSTEM_PROMPT__INIT;
    body.text = "pushed";
    rec.body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
    rec.system_prompt = &body;
    rec.offset = 41;
    pthread_mutex_lock(&tails_mu);
    for (int i = 0; i < TAILS_MAX; i++) {
        if (tails[i]) {
            CHECK(rpc_call_push(tails[i]->call, &rec.base) == 1);
        }
    }
    pthread_mutex_unlock(&tails_mu);
    for (int i = 0; i < 3; i++) {
        CHECK(rpc_stream_read(is[i], &cflue__v1__record__descriptor, &m) == 1);
        CHECK(m && ((Cflue__V1__Record *)m)->offset == 41);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    struct tail *picked[3];
    int np = 0;
    pthread_mutex_lock(&tails_mu);
    for (int i = 0; i < TAILS_MAX && np < 3; i++) {
        if (tails[i]) {
            picked[np++] = tails[i];
        }
    }
    pthread_mutex_unlock(&tails_mu);
    CHECK(np == 3);
    for (int i = 0; i < np; i++) {
        tail_finish(picked[i], GRPC_STATUS_OK, NULL);
    }
    for (int i = 0; i < 3; i++) {
        CHECK(rpc_stream_read(is[i], &cflue__v1__record__descriptor, &m) == 0);
        CHECK(rpc_stream_finish(is[i], &st) && st.code == GRPC_STATUS_OK);
    }
    CHECK(wait_for(released_is, 4, 2000));

    /* the client cancels an idle stream: ended(CLIENT) reaches the owner, which finishes */
    tail_ended_client = 0;
    struct rpc_stream *cs = open_tail(ch, 0, 10000);
    CHECK(wait_for(tails_are, 1, 2000));
    rpc_stream_cancel(cs);
    rpc_stream_finish(cs, &st);
    CHECK(st.code == GRPC_STATUS_CANCELLED);
    CHECK(wait_for(released_is, 5, 2000));
    CHECK(tail_ended_client == 1 && count_tails() == 0);

    /* the deadline passes on an idle stream: the same */
    int64_t t0 = clock_mono_ms();
    struct rpc_stream *ds = open_tail(ch, 0, 300);
    CHECK(rpc_stream_read(ds, &cflue__v1__record__descriptor, &m) == 0);
    rpc_stream_finish(ds, &st);
    CHECK(st.code == GRPC_STATUS_DEADLINE_EXCEEDED);
    CHECK(clock_mono_ms() - t0 < 2000);
    CHECK(wait_for(released_is, 6, 2000));
    CHECK(tail_ended_client == 2 && count_tails() == 0);

    /* thousands of idle streams cost no thread; shutdown ends them all at once (UNAVAILABLE) */
    int threads0 = threads_now();
    struct rpc_stream **many = malloc(sizeof(*many) * IDLE_STREAMS);
    for (int i = 0; i < IDLE_STREAMS; i++) {
        many[i] = open_tail(ch, 0, 60000);
    }
    CHECK(wait_for(tails_are, IDLE_STREAMS, 20000));
    CHECK(rpc_server_async_calls(s) == IDLE_STREAMS);
    int threads1 = threads_now();
    fprintf(stderr, "async: %d idle streams, threads %d -> %d\n", IDLE_STREAMS, threads0, threads1);
    CHECK(threads1 - threads0 <= 4);
    tail_ended_shutdown = 0;
    t0 = clock_mono_ms();
    rpc_server_shutdown(s, 10000);
    int64_t took = clock_mono_ms() - t0;
    fprintf(stderr, "async: shutdown with %d idle streams took %lld ms\n", IDLE_STREAMS,
            (long long)took);
    CHECK(took < 5000);
    /* under load a few ends can still be on their way when shutdown returns (seen once in CI
     * with ctest -j2: see the stop's note); they must all come */
    CHECK(wait_for(ended_shutdown_is, IDLE_STREAMS, 5000));
    CHECK(wait_for(released_is, 6 + IDLE_STREAMS, 5000));
    int unavailable = 0;
    for (int i = 0; i < IDLE_STREAMS; i++) {
        while (rpc_stream_read(many[i], &cflue__v1__record__descriptor, &m) == 1) {
            protobuf_c_message_free_unpacked(m, NULL);
        }
        rpc_stream_finish(many[i], &st);
        unavailable += st.code == GRPC_STATUS_UNAVAILABLE;
    }
    CHECK(unavailable == IDLE_STREAMS);
    free(many);
    rpc_server_free(s);
    rpc_channel_free(ch);
}

/* The memory bound: with room for 4 streams, the fifth is refused RESOURCE_EXHAUSTED, and a
 * stream fits again once one ended. */
static void test_async_limit(void)
{
    int port;
    char target[64];
    struct rpc_status st;
    ProtobufCMessage *m;
    int released0 = tail_released;
    struct rpc_server *s = start_async(&port, 4 * RPC_ASYNC_CALL_BYTES);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    struct rpc_stream *open4[4];
    for (int i = 0; i < 4; i++) {
        open4[i] = open_tail(ch, 0, 10000);
    }
    CHECK(wait_for(tails_are, 4, 2000));
    struct rpc_stream *fifth = open_tail(ch, 0, 10000);
    CHECK(rpc_stream_read(fifth, &cflue__v1__record__descriptor, &m) == 0);
    rpc_stream_finish(fifth, &st);
    CHECK(st.code == GRPC_STATUS_RESOURCE_EXHAUSTED);
    CHECK(strstr(st.details, "too many open streams") != NULL);
    rpc_stream_cancel(open4[0]);
    rpc_stream_finish(open4[0], &st);
    CHECK(wait_for(released_is, released0 + 1, 2000));
    open4[0] = open_tail(ch, 0, 10000);
    CHECK(wait_for(tails_are, 4, 2000));
    rpc_server_shutdown(s, 1000);
    for (int i = 0; i < 4; i++) {
        CHECK(rpc_stream_read(open4[i], &cflue__v1__record__descriptor, &m) == 0);
        rpc_stream_finish(open4[i], &st);
        CHECK(st.code == GRPC_STATUS_UNAVAILABLE);
    }
    rpc_server_free(s);
    rpc_channel_free(ch);
}

static struct rpc_server *start_opts(const char *addr, int *port, struct rpc_server_opts o)
{
    struct rpc_server *s = rpc_server_new(&o);
    struct cf_error err;
    rpc_server_add_method(s, "/cflue.v1.Store/Get", &cflue__v1__get_request__descriptor, on_get,
                          NULL, RPC_POOL);
    rpc_server_add_method(s, "/cflue.v1.Store/Follow", &cflue__v1__follow_request__descriptor,
                          on_follow, NULL, RPC_THREAD);
    CHECK(rpc_server_listen(s, addr, port, &err) == CF_OK);
    CHECK(rpc_server_start(s) == CF_OK);
    return s;
}

static struct rpc_server *start(const char *addr, int *port)
{
    struct rpc_server_opts o = {.workers = 2, .max_message_bytes = 1 << 20};
    return start_opts(addr, port, o);
}

static bool get(struct rpc_channel *ch, const char *id, int64_t timeout, struct rpc_status *st,
                int *count_out)
{
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp;
    req.submission_id = (char *)id;
    bool ok = rpc_unary(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        timeout, &resp, st);
    if (ok) {
        *count_out = ((Cflue__V1__Submission *)resp)->attempt_count;
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    return ok;
}

static int read_stream(struct rpc_channel *ch, int n, const char *mode, struct rpc_status *st)
{
    Cflue__V1__FollowRequest req = CFLUE__V1__FOLLOW_REQUEST__INIT;
    req.after_offset = n;
    req.until_settled = (char *)mode;
    struct rpc_stream *s = rpc_stream_open(ch, "/cflue.v1.Store/Follow", &req.base, 5000);
    ProtobufCMessage *m;
    int got = 0;
    while (rpc_stream_read(s, &cflue__v1__record__descriptor, &m) == 1) {
        CHECK(((Cflue__V1__Record *)m)->offset == got);
        got++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_stream_finish(s, st);
    return got;
}

static void test_basic(const char *listen_addr)
{
    int port = 0, count = 0;
    struct rpc_status st;
    char target[256];
    struct rpc_server *s = start(listen_addr, &port);
    if (port) {
        snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    } else {
        snprintf(target, sizeof(target), "%s", listen_addr);
    }
    struct rpc_channel *ch = rpc_channel_new(target, 0);

    CHECK(get(ch, "ok", 5000, &st, &count) && count == 7);
    CHECK(!get(ch, "missing", 5000, &st, &count));
    CHECK(st.code == GRPC_STATUS_NOT_FOUND);
    CHECK_STR(st.details, "no submission 'missing'");
    CHECK_STR(st.reason, "NOT_FOUND");

    /* every error carries an ErrorInfo: the code's reason, or the specific one given */
    CHECK(!get(ch, "stale", 5000, &st, &count));
    CHECK(st.code == GRPC_STATUS_ABORTED);
    CHECK_STR(st.reason, "STALE_FENCE");
    CHECK(status_from_grpc(st.code) == CF_STALE);
    CHECK(!get(ch, "reserved", 5000, &st, &count));
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR(st.reason, "RESERVED_METADATA_KEY");
    CHECK_STR(st.details, "metadata key cflue.x is ours");

    /* the deadline passes while the handler sleeps */
    CHECK(!get(ch, "slow", 100, &st, &count));
    CHECK(st.code == GRPC_STATUS_DEADLINE_EXCEEDED);

    /* streams: all messages in order, then OK; an error status after the messages */
    CHECK(read_stream(ch, 500, "", &st) == 500 && st.code == GRPC_STATUS_OK);
    CHECK(read_stream(ch, 3, "fail", &st) == 3 && st.code == GRPC_STATUS_ABORTED);
    CHECK_STR(st.details, "stopped after the records");
    CHECK_STR(st.reason, "ABORTED"); /* rpc_call_finish: the reason named after the code */

    /* unknown method */
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp;
    CHECK(!rpc_unary(ch, "/cflue.v1.Store/Nope", &req.base, &cflue__v1__submission__descriptor,
                     2000, &resp, &st));
    CHECK(st.code == GRPC_STATUS_UNIMPLEMENTED);

    /* health */
    Grpc__Health__V1__HealthCheckRequest h = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    h.service = "cflue.v1.Store";
    CHECK(rpc_unary(ch, "/grpc.health.v1.Health/Check", &h.base,
                    &grpc__health__v1__health_check_response__descriptor, 2000, &resp, &st));
    CHECK(((Grpc__Health__V1__HealthCheckResponse *)resp)->status == 1);
    protobuf_c_message_free_unpacked(resp, NULL);
    h.service = "no.such.Service";
    CHECK(!rpc_unary(ch, "/grpc.health.v1.Health/Check", &h.base,
                     &grpc__health__v1__health_check_response__descriptor, 2000, &resp, &st));
    CHECK(st.code == GRPC_STATUS_NOT_FOUND);

    /* a request over the server's 1 MiB limit */
    char *big = malloc(2 << 20);
    memset(big, 'x', (2 << 20) - 1);
    big[(2 << 20) - 1] = '\0';
    CHECK(!get(ch, big, 5000, &st, &count));
    CHECK(st.code == GRPC_STATUS_RESOURCE_EXHAUSTED);
    free(big);
    CHECK(get(ch, "ok", 5000, &st, &count)); /* still serving */

    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

/* who_is makes the "md" Get on ch: the x-who metadata the server saw, or "" when none. */
static void who_is(struct rpc_channel *ch, const char *want)
{
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    req.submission_id = "md";
    bool ok = rpc_unary(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        5000, &resp, &st);
    CHECK(ok == (*want != '\0'));
    if (ok) {
        CHECK_STR(((Cflue__V1__Submission *)resp)->submission_id, want);
        protobuf_c_message_free_unpacked(resp, NULL);
    }
}

/* Channel metadata reaches the handler (rpc_call_metadata), whole or not at all. */
static void test_metadata(void)
{
    int port = 0;
    char target[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *plain = rpc_channel_new(target, 0), *alice = rpc_channel_new(target, 0),
                       *longer = rpc_channel_new(target, 0);
    CHECK(rpc_channel_add_metadata(alice, "x-who", "alice"));
    CHECK(rpc_channel_add_metadata(longer, "x-who", "alice-and-more")); /* over 8 bytes */
    for (int i = 1; i < RPC_CHANNEL_METADATA_MAX; i++) {
        CHECK(rpc_channel_add_metadata(plain, "x-other", "v"));
    }
    CHECK(rpc_channel_add_metadata(plain, "x-other", "v"));
    CHECK(!rpc_channel_add_metadata(plain, "x-who", "full")); /* the table is full */
    who_is(plain, "");
    who_is(alice, "alice");
    who_is(longer, ""); /* never cut short */
    /* (streams send it the same way: cflue submit's Watch in test_agentd_auth) */
    rpc_channel_free(plain);
    rpc_channel_free(alice);
    rpc_channel_free(longer);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

/* traced makes the "trace" Get on ch (blocking, or event-driven with async) and returns what
 * the handler saw: its current trace "trace_id/span_id" ("" none), the traceparent and
 * tracestate received. */
struct seen {
    char current[64], parent[128], state[128];
};

static struct seen traced(struct rpc_channel *ch, bool async);

/* A call made with the thread's current trace carries it (a new parent-id each time, the
 * tracestate as is), and the handler runs with it as its own current trace; a call made
 * without one carries none; a malformed or doubled traceparent is no trace. */
static void test_trace_propagation(void)
{
    int port = 0;
    char target[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    struct seen w = traced(ch, false);
    CHECK_STR(w.current, "");
    CHECK_STR(w.parent, "");
    struct trace_ctx t, saved;
    struct cf_error err;
    const char *tid = "4bf92f3577b34da6a3ce929d0e0e4736";
    CHECK(trace_parse(&t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                      "rojo=1,congo=2", &err) == CF_OK);
    trace_enter(&t, &saved);
    for (int async = 0; async < 2; async++) {
        struct seen a = traced(ch, async), b = traced(ch, async);
        CHECK(!strncmp(a.parent, "00-", 3) && !strncmp(a.parent + 3, tid, 32));
        CHECK(strlen(a.parent) == 55 && !strcmp(a.parent + 52, "-01"));
        CHECK(strncmp(a.parent + 36, "00f067aa0ba902b7", 16) != 0); /* a span of the call's */
        CHECK(strcmp(a.parent, b.parent) != 0);                     /* ... each call its own */
        /* the handler's current trace: the trace, the caller's call span as its span id */
        CHECK(!strncmp(a.current, tid, 32) && a.current[32] == '/');
        CHECK(!strncmp(a.current + 33, a.parent + 36, 16));
        CHECK_STR(a.state, "rojo=1,congo=2");
    }
    trace_leave(&saved);
    w = traced(ch, true);
    CHECK_STR(w.current, "");
    rpc_channel_free(ch);
    /* a traceparent sent by hand: a malformed one is no trace; one that is fine is taken */
    ch = rpc_channel_new(target, 0);
    CHECK(rpc_channel_add_metadata(ch, "traceparent",
                                   "00-4BF92F3577B34DA6A3CE929D0E0E4736-"
                                   "00f067aa0ba902b7-01"));
    w = traced(ch, false);
    CHECK_STR(w.current, "");
    rpc_channel_free(ch);
    ch = rpc_channel_new(target, 0);
    CHECK(rpc_channel_add_metadata(ch, "traceparent",
                                   "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    w = traced(ch, false);
    CHECK_STR(w.current, "4bf92f3577b34da6a3ce929d0e0e4736/00f067aa0ba902b7");
    /* ... and the same with a current trace too: two traceparents, so none */
    trace_enter(&t, &saved);
    w = traced(ch, false);
    CHECK_STR(w.current, "");
    trace_leave(&saved);
    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

struct cancel_arg {
    struct rpc_stream *s;
};

static void *cancel_later(void *p)
{
    struct cancel_arg *a = p;
    clock_sleep_ms(100);
    rpc_stream_cancel(a->s);
    return NULL;
}

static void test_cancel_and_shutdown(void)
{
    int port;
    char target[64];
    struct rpc_status st;
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);

    /* the client cancels an endless stream: the handler notices and stops */
    Cflue__V1__FollowRequest req = CFLUE__V1__FOLLOW_REQUEST__INIT;
    req.after_offset = -1;
    req.until_settled = "";
    stream_saw_cancel = false;
    struct cancel_arg a = {rpc_stream_open(ch, "/cflue.v1.Store/Follow", &req.base, 10000)};
    pthread_t t;
    pthread_create(&t, NULL, cancel_later, &a);
    ProtobufCMessage *m;
    int got = 0;
    while (rpc_stream_read(a.s, &cflue__v1__record__descriptor, &m) == 1) {
        protobuf_c_message_free_unpacked(m, NULL);
        got++;
    }
    pthread_join(t, NULL);
    rpc_stream_finish(a.s, &st);
    CHECK(st.code == GRPC_STATUS_CANCELLED);
    CHECK(got > 0);
    for (int i = 0; i < 100 && !stream_saw_cancel; i++) {
        clock_sleep_ms(10);
    }
    CHECK(stream_saw_cancel);

    /* shutdown with a live endless stream: the handler sees the stop and finishes */
    a.s = rpc_stream_open(ch, "/cflue.v1.Store/Follow", &req.base, 10000);
    CHECK(rpc_stream_read(a.s, &cflue__v1__record__descriptor, &m) == 1);
    protobuf_c_message_free_unpacked(m, NULL);
    int64_t t0 = clock_mono_ms();
    rpc_server_shutdown(s, 500);
    CHECK(clock_mono_ms() - t0 < 3000);
    while (rpc_stream_read(a.s, &cflue__v1__record__descriptor, &m) == 1) {
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_stream_finish(a.s, &st);
    CHECK(st.code != GRPC_STATUS_OK);
    rpc_server_free(s);

    /* calls to a stopped server fail UNAVAILABLE */
    int count;
    CHECK(!get(ch, "ok", 1000, &st, &count));
    CHECK(st.code == GRPC_STATUS_UNAVAILABLE || st.code == GRPC_STATUS_DEADLINE_EXCEEDED);
    rpc_channel_free(ch);
}

static bool health(struct rpc_channel *ch, int64_t timeout_ms)
{
    Grpc__Health__V1__HealthCheckRequest h = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    h.service = "";
    if (!rpc_unary(ch, "/grpc.health.v1.Health/Check", &h.base,
                   &grpc__health__v1__health_check_response__descriptor, timeout_ms, &resp, &st)) {
        return false;
    }
    bool serving = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status == 1;
    protobuf_c_message_free_unpacked(resp, NULL);
    return serving;
}

#define FLOOD 40

struct flood_call {
    struct rpc_channel *ch;
    const char *id;
    int64_t timeout_ms;
    struct rpc_status st;
    bool ok;
    int64_t took_ms;
};

static void *flood_one(void *p)
{
    struct flood_call *f = p;
    int count;
    int64_t t0 = clock_mono_ms();
    f->ok = get(f->ch, f->id, f->timeout_ms, &f->st, &count);
    f->took_ms = clock_mono_ms() - t0;
    return NULL;
}

/* Admission control: with one worker and room for four waiting calls, a flood of 40 slow calls
 * gets RESOURCE_EXHAUSTED at once for all but the five admitted; health checks are answered
 * during the flood, and the admitted calls are served. (The old unbounded queue took every
 * call and let them time out.) */
static void test_admission_flood(void)
{
    int port;
    char target[64];
    struct rpc_server_opts o = {.workers = 1, .max_queue = 4, .max_message_bytes = 1 << 20};
    struct rpc_server *s = start_opts("127.0.0.1:0", &port, o);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    CHECK(health(ch, 2000)); /* connected before the flood */

    static struct flood_call calls[FLOOD];
    pthread_t th[FLOOD];
    for (int i = 0; i < FLOOD; i++) {
        calls[i] = (struct flood_call){.ch = ch, .id = "slow", .timeout_ms = 10000};
        CHECK(pthread_create(&th[i], NULL, flood_one, &calls[i]) == 0);
    }
    clock_sleep_ms(200);
    /* valgrind (CFLUE_SLOW) and ThreadSanitizer (CFLUE_TSAN, beside two other tests) slow the
     * answers and the refusals, not the sleeps */
    bool slowed = getenv("CFLUE_SLOW") || getenv("CFLUE_TSAN");
    /* health is answered during the flood, promptly */
    for (int i = 0; i < 5; i++) {
        int64_t t0 = clock_mono_ms();
        CHECK(health(ch, 1000));
        CHECK(clock_mono_ms() - t0 < (slowed ? 900 : 500));
        clock_sleep_ms(20);
    }
    int ok = 0, busy = 0, other = 0;
    int64_t slowest_busy = 0;
    for (int i = 0; i < FLOOD; i++) {
        pthread_join(th[i], NULL);
        if (calls[i].ok) {
            ok++;
        } else if (calls[i].st.code == GRPC_STATUS_RESOURCE_EXHAUSTED) {
            busy++;
            slowest_busy = calls[i].took_ms > slowest_busy ? calls[i].took_ms : slowest_busy;
        } else {
            other++;
            fprintf(stderr, "flood call %d: status %d %s\n", i, (int)calls[i].st.code,
                    calls[i].st.details);
        }
    }
    fprintf(stderr, "flood: %d served, %d refused (slowest refusal %lld ms), %d other\n", ok, busy,
            (long long)slowest_busy, other);
    /* the four the queue holds; and the worker's own when it took the first before the fifth
     * arrived (under load the flood can fill the queue first: four served, then) */
    CHECK(ok >= 4);
    CHECK(busy >= 30); /* the rest refused ... */
    CHECK(other == 0);
    /* ... quickly, not after the queue drained (2.5 s: five 500 ms calls on one worker) */
    CHECK(slowest_busy < (slowed ? 2000 : 1000));
    int count;
    struct rpc_status st;
    CHECK(get(ch, "ok", 2000, &st, &count)); /* served once the flood is over */

    /* A call whose deadline passes while it waits in the queue is dropped, not run. */
    struct flood_call slow = {.ch = ch, .id = "slow", .timeout_ms = 5000};
    pthread_t t;
    int before = runs();
    CHECK(pthread_create(&t, NULL, flood_one, &slow) == 0);
    clock_sleep_ms(100); /* the worker is busy with it */
    CHECK(!get(ch, "count", 100, &st, &count));
    CHECK(st.code == GRPC_STATUS_DEADLINE_EXCEEDED);
    pthread_join(t, NULL);
    CHECK(slow.ok);
    clock_sleep_ms(100);
    CHECK(runs() == before); /* the handler never ran for the expired call */
    CHECK(get(ch, "count", 2000, &st, &count));
    CHECK(runs() == before + 1);

    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

/* call_for calls "ok" every 50 ms for up to ms milliseconds (each call with a 300 ms deadline);
 * returns the milliseconds until the first success, or -1 when every call failed. */
static int64_t call_for(struct rpc_channel *ch, int64_t ms, bool stop_on_success)
{
    int64_t t0 = clock_mono_ms(), first = -1;
    while (clock_mono_ms() - t0 < ms) {
        struct rpc_status st;
        int count;
        if (get(ch, "ok", 300, &st, &count)) {
            if (first < 0) {
                first = clock_mono_ms() - t0;
            }
            if (stop_on_success) {
                break;
            }
        }
        clock_sleep_ms(50);
    }
    return first;
}

/* Defect 8: a peer that returns after repeated outages is used again within about a second.
 * With gRPC's default reconnect backoff (1 s growing by 1.6x, +-20%, to 120 s) the attempts of
 * a 12 s outage fall near 1, 2.6, 5.2, 9.3 and 15.8 s: the client that kept calling found the
 * returned server only seconds later. */
static void test_reconnect_after_outages(void)
{
    int port, again;
    char target[64], addr[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    CHECK(call_for(ch, 2000, true) >= 0);

    /* outage of 3 s, back for 300 ms, outage of 12 s: the client calls and fails throughout */
    rpc_server_shutdown(s, 0);
    rpc_server_free(s);
    CHECK(call_for(ch, 3000, false) < 0);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    s = start(addr, &again);
    CHECK(again == port);
    int64_t blip = call_for(ch, 300, false);
    rpc_server_shutdown(s, 0);
    rpc_server_free(s);
    CHECK(call_for(ch, 12000, false) < 0);

    s = start(addr, &again);
    CHECK(again == port);
    int64_t back = call_for(ch, 10000, true);
    fprintf(stderr, "reconnect: served %lld ms into the 300 ms return; %lld ms after the last\n",
            (long long)blip, (long long)back);
    CHECK(back >= 0 && back <= 1500);
    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

/* ---- event-driven client streams (rpc_astream) ---- */

struct areader {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct rpc_astream *s;
    int got;
    bool in_order;
    bool ended;
    struct rpc_status st;
    int hold_at; /* stop asking for more after this many (backpressure), or -1 */
};

static void ar_message(void *arg, ProtobufCMessage *msg)
{
    struct areader *r = arg;
    pthread_mutex_lock(&r->mu);
    r->in_order = r->in_order && ((Cflue__V1__Record *)msg)->offset == r->got;
    r->got++;
    bool more = r->hold_at < 0 || r->got < r->hold_at;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    protobuf_c_message_free_unpacked(msg, NULL);
    if (more) {
        rpc_astream_next(r->s);
    }
}

static void ar_end(void *arg, const struct rpc_status *st)
{
    struct areader *r = arg;
    pthread_mutex_lock(&r->mu);
    r->st = *st;
    r->ended = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static const struct rpc_astream_ops ar_ops = {ar_message, ar_end};

static void ar_open(struct areader *r, struct rpc_channel *ch, const char *method, int n,
                    const char *mode, int64_t timeout_ms, int hold_at)
{
    memset(r, 0, sizeof(*r));
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->in_order = true;
    r->hold_at = hold_at;
    Cflue__V1__FollowRequest req = CFLUE__V1__FOLLOW_REQUEST__INIT;
    req.after_offset = n;
    req.until_settled = (char *)mode;
    pthread_mutex_lock(&r->mu); /* callbacks wait until r->s is set */
    r->s = rpc_astream_open(ch, method, &req.base, &cflue__v1__record__descriptor, timeout_ms,
                            &ar_ops, r);
    pthread_mutex_unlock(&r->mu);
}

static bool ar_wait(struct areader *r, int got, int ms)
{
    struct timespec ts;
    clock_deadline(&ts, ms);
    pthread_mutex_lock(&r->mu);
    while (!r->ended && (got < 0 || r->got < got)) {
        if (clock_cond_wait(&r->cv, &r->mu, &ts) != 0) {
            break;
        }
    }
    bool ok = got < 0 ? r->ended : r->got >= got;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static void ar_done(struct areader *r)
{
    CHECK(ar_wait(r, -1, 5000));
    rpc_astream_release(r->s);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
}

static void test_async_client(void)
{
    int port;
    char target[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    struct areader r;
    int threads0 = threads_now();

    /* all messages in order, then OK; an error status after the messages */
    ar_open(&r, ch, "/cflue.v1.Store/Follow", 500, "", 5000, -1);
    CHECK(ar_wait(&r, -1, 5000));
    CHECK(r.got == 500 && r.in_order && r.st.code == GRPC_STATUS_OK);
    ar_done(&r);
    ar_open(&r, ch, "/cflue.v1.Store/Follow", 3, "fail", 5000, -1);
    CHECK(ar_wait(&r, -1, 5000));
    CHECK(r.got == 3 && r.st.code == GRPC_STATUS_ABORTED);
    CHECK_STR(r.st.details, "stopped after the records");
    ar_done(&r);

    /* backpressure: the owner stops asking at 10; nothing more arrives until it asks */
    ar_open(&r, ch, "/cflue.v1.Store/Follow", 100, "", 5000, 10);
    CHECK(ar_wait(&r, 10, 5000));
    clock_sleep_ms(200);
    CHECK(r.got == 10 && !r.ended);
    pthread_mutex_lock(&r.mu);
    r.hold_at = -1;
    pthread_mutex_unlock(&r.mu);
    rpc_astream_next(r.s);
    CHECK(ar_wait(&r, -1, 5000));
    CHECK(r.got == 100 && r.in_order && r.st.code == GRPC_STATUS_OK);
    ar_done(&r);

    /* release mid-stream: on_end follows, CANCELLED; the server's handler sees the cancel */
    stream_saw_cancel = false;
    ar_open(&r, ch, "/cflue.v1.Store/Follow", -1, "", 10000, -1);
    CHECK(ar_wait(&r, 5, 5000));
    rpc_astream_release(r.s);
    CHECK(ar_wait(&r, -1, 5000));
    CHECK(r.st.code == GRPC_STATUS_CANCELLED);
    for (int i = 0; i < 100 && !stream_saw_cancel; i++) {
        clock_sleep_ms(10);
    }
    CHECK(stream_saw_cancel);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);

    /* the deadline passes */
    ar_open(&r, ch, "/cflue.v1.Store/Follow", -1, "", 200, 1);
    CHECK(ar_wait(&r, -1, 5000));
    CHECK(r.st.code == GRPC_STATUS_DEADLINE_EXCEEDED);
    ar_done(&r);

    /* 1,000 idle client streams to an RPC_ASYNC server: no thread on either side */
    int aport;
    char atarget[64];
    int released0 = tail_released;
    struct rpc_server *as = start_async(&aport, 0);
    snprintf(atarget, sizeof(atarget), "127.0.0.1:%d", aport);
    struct rpc_channel *ach = rpc_channel_new(atarget, 0);
    int threads1 = threads_now();
    struct areader *many = calloc(1000, sizeof(*many));
    for (int i = 0; i < 1000; i++) {
        ar_open(&many[i], ach, "/test.Async/Tail", 0, "", 30000, -1);
    }
    CHECK(wait_for(tails_are, 1000, 10000));
    int threads2 = threads_now();
    fprintf(stderr, "astream: 1000 idle client streams: threads %d -> %d\n", threads1, threads2);
    CHECK(threads2 - threads1 <= 1);
    for (int i = 0; i < 1000; i++) {
        rpc_astream_release(many[i].s);
        CHECK(ar_wait(&many[i], -1, 5000));
        CHECK(many[i].st.code == GRPC_STATUS_CANCELLED);
        pthread_mutex_destroy(&many[i].mu);
        pthread_cond_destroy(&many[i].cv);
    }
    free(many);
    CHECK(wait_for(released_is, released0 + 1000, 5000));
    rpc_channel_free(ach);
    rpc_server_shutdown(as, 1000);
    rpc_server_free(as);
    (void)threads0;

    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

/* ---- event-driven unary calls (rpc_acall_start) ---- */

struct acaller {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ended; /* how often done ran */
    struct rpc_status st;
    ProtobufCMessage *resp;
};

static void ac_done(void *arg, const struct rpc_status *st, ProtobufCMessage *resp)
{
    struct acaller *a = arg;
    pthread_mutex_lock(&a->mu);
    a->st = *st;
    a->resp = resp;
    a->ended++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void ac_init(struct acaller *a)
{
    memset(a, 0, sizeof(*a));
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
}

/* ac_wait waits (up to 5 s) for the call's end. */
static void ac_wait(struct acaller *a)
{
    struct timespec ts;
    clock_deadline(&ts, 5000);
    pthread_mutex_lock(&a->mu);
    while (!a->ended && clock_cond_wait(&a->cv, &a->mu, &ts) == 0) {
    }
    pthread_mutex_unlock(&a->mu);
}

/* ac_call makes one Get (answered as `desc`) through rpc_acall_start and waits for its end. */
static void ac_call_as(struct acaller *a, struct rpc_channel *ch, const char *id,
                       const ProtobufCMessageDescriptor *desc, int64_t timeout_ms)
{
    ac_init(a);
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    req.submission_id = (char *)id;
    rpc_acall_start(ch, "/cflue.v1.Store/Get", &req.base, desc, timeout_ms, ac_done, a);
    ac_wait(a);
}

static void ac_call(struct acaller *a, struct rpc_channel *ch, const char *id, int64_t timeout_ms)
{
    ac_call_as(a, ch, id, &cflue__v1__submission__descriptor, timeout_ms);
}

static void ac_free(struct acaller *a)
{
    if (a->resp) {
        protobuf_c_message_free_unpacked(a->resp, NULL);
    }
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
}

/* The method path is the caller's only while the call starts: agentd builds paths in a stack
 * buffer ("/cflue.v1.Store/%s") that an event-driven call outlives. gRPC reads a path given as
 * a static slice when it encodes the call's headers: on an idle connection inside the start,
 * under load later (the channel still connecting, its connection busy writing another call's
 * large message, a slow machine). A buffer overwritten by then must not be what the server sees
 * (storaged once saw "\x17": UNIMPLEMENTED, and an attempt lost). The late read does not happen
 * on every run of this test; it always does when the buffer changes between the call's creation
 * and its start, which the client does in one function. */
static void test_method_path_copied(void)
{
    enum { ROUNDS = 10 };
    int port;
    char target[64], path[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    struct acaller *big = calloc(ROUNDS, sizeof(*big)), *small = calloc(ROUNDS, sizeof(*small));
    size_t big_len = 512 << 10;
    char *big_id = malloc(big_len + 1);
    memset(big_id, 'b', big_len);
    big_id[big_len] = '\0';
    for (int i = 0; i < ROUNDS; i++) {
        Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
        ac_init(&big[i]);
        ac_init(&small[i]);
        req.submission_id = big_id; /* answered NOT_FOUND, after 512 KB went out */
        rpc_acall_start(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        5000, ac_done, &big[i]);
        req.submission_id = "ok";
        snprintf(path, sizeof(path), "/cflue.v1.Store/%s", "Get");
        rpc_acall_start(ch, path, &req.base, &cflue__v1__submission__descriptor, 5000, ac_done,
                        &small[i]);
        memset(path, 0x17, sizeof(path));
    }
    for (int i = 0; i < ROUNDS; i++) {
        ac_wait(&big[i]);
        ac_wait(&small[i]);
        CHECK(big[i].ended == 1 && big[i].st.code == GRPC_STATUS_NOT_FOUND);
        CHECK(small[i].ended == 1 && small[i].st.code == GRPC_STATUS_OK && small[i].resp);
        ac_free(&big[i]);
        ac_free(&small[i]);
    }
    free(big);
    free(small);
    free(big_id);
    rpc_channel_free(ch);

    /* a channel not connected yet: connects on its first call; a stream the same way */
    for (int round = 0; round < 3; round++) {
        struct acaller a;
        struct areader r;
        ch = rpc_channel_new(target, 0);
        ac_init(&a);
        Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
        req.submission_id = "ok";
        snprintf(path, sizeof(path), "/cflue.v1.Store/%s", "Get");
        rpc_acall_start(ch, path, &req.base, &cflue__v1__submission__descriptor, 5000, ac_done, &a);
        memset(path, 0x17, sizeof(path));
        ac_wait(&a);
        CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_OK && a.resp);
        ac_free(&a);
        rpc_channel_free(ch);
        ch = rpc_channel_new(target, 0);
        snprintf(path, sizeof(path), "/cflue.v1.Store/%s", "Follow");
        ar_open(&r, ch, path, 5, "", 5000, -1);
        memset(path, 0x17, sizeof(path));
        CHECK(ar_wait(&r, -1, 5000));
        CHECK(r.got == 5 && r.st.code == GRPC_STATUS_OK);
        ar_done(&r);
        rpc_channel_free(ch);
    }
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
}

static void test_async_unary(void)
{
    int port;
    char target[64];
    struct rpc_server *s = start("127.0.0.1:0", &port);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);
    struct acaller a;

    /* an answer: decoded, the caller's */
    ac_call(&a, ch, "ok", 5000);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_OK && a.resp);
    CHECK(a.resp && !strcmp(((Cflue__V1__Submission *)a.resp)->submission_id, "ok"));
    CHECK(a.resp && ((Cflue__V1__Submission *)a.resp)->attempt_count == 7);
    ac_free(&a);
    /* an error: code, message and ErrorInfo reason, no response */
    ac_call(&a, ch, "stale", 5000);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_ABORTED && !a.resp);
    CHECK_STR(a.st.reason, "STALE_FENCE");
    ac_free(&a);
    ac_call(&a, ch, "nothing", 5000);
    CHECK(a.st.code == GRPC_STATUS_NOT_FOUND && strstr(a.st.details, "no submission 'nothing'"));
    ac_free(&a);
    /* the deadline passes while the handler works */
    ac_call(&a, ch, "slow", 100);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_DEADLINE_EXCEEDED && !a.resp);
    ac_free(&a);
    /* a response that does not decode as the type asked for is INTERNAL */
    ac_call_as(&a, ch, "ok", &cflue__v1__append_request__descriptor, 5000);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_INTERNAL && !a.resp);
    CHECK(strstr(a.st.details, "did not decode") != NULL);
    ac_free(&a);
    /* many at once, no thread each */
    int threads1 = threads_now();
    struct acaller *many = calloc(200, sizeof(*many));
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    req.submission_id = "ok";
    for (int i = 0; i < 200; i++) {
        ac_init(&many[i]);
        rpc_acall_start(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        5000, ac_done, &many[i]);
    }
    CHECK(threads_now() - threads1 <= 1);
    for (int i = 0; i < 200; i++) {
        ac_wait(&many[i]);
        CHECK(many[i].ended == 1 && many[i].st.code == GRPC_STATUS_OK);
        ac_free(&many[i]);
    }
    free(many);
    /* a peer that is gone: UNAVAILABLE, at once */
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
    int64_t t0 = clock_mono_ms();
    ac_call(&a, ch, "ok", 5000);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_UNAVAILABLE && !a.resp);
    CHECK(clock_mono_ms() - t0 < 3000);
    ac_free(&a);
    /* a cancelled channel ends calls CANCELLED without sending them */
    rpc_channel_cancel_all(ch, "stopping");
    ac_call(&a, ch, "ok", 5000);
    CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_CANCELLED);
    CHECK_STR(a.st.details, "stopping");
    ac_free(&a);
    rpc_channel_free(ch);
}

/* threads_named counts this process's threads named `name` (/proc/self/task/N/comm). */
static int threads_named(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char path[300], comm[32] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", e->d_name);
        FILE *f = e->d_name[0] != '.' ? fopen(path, "r") : NULL;
        if (f && fgets(comm, sizeof(comm), f)) {
            comm[strcspn(comm, "\n")] = '\0';
            n += !strcmp(comm, name);
        }
        if (f) {
            fclose(f);
        }
    }
    if (d) {
        closedir(d);
    }
    return n;
}

/* One event loop carries every server's events and the event-driven client's: one rpc-loop
 * thread however many servers and channels come and go, no thread polling beside it. A server
 * freed right after its shutdown, with a call in flight, leaves nothing of its own on the
 * loop's queue (its request slots came back first: ASan sees any that would come later). */
static void test_one_loop(void)
{
    CHECK(threads_named("rpc-loop") == 1); /* the earlier tests started it */
    for (int round = 0; round < 20; round++) {
        int port;
        char target[64];
        struct rpc_server *s = start("127.0.0.1:0", &port);
        snprintf(target, sizeof(target), "127.0.0.1:%d", port);
        struct rpc_channel *ch = rpc_channel_new(target, 0);
        struct acaller a, slow;
        ac_call(&a, ch, "ok", 5000);
        CHECK(a.ended == 1 && a.st.code == GRPC_STATUS_OK);
        ac_free(&a);
        ac_init(&slow);
        Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
        req.submission_id = "slow"; /* answered after 500 ms */
        int slow0 = slow_started();
        rpc_acall_start(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        5000, ac_done, &slow);
        for (int64_t until = clock_mono_ms() + 5000;
             slow_started() == slow0 && clock_mono_ms() < until;) {
            clock_sleep_ms(5); /* until its handler runs */
        }
        CHECK(slow_started() > slow0);
        rpc_server_shutdown(s, round % 2 ? 0 : 1000); /* cancelled, or answered in the grace */
        rpc_server_free(s);
        ac_wait(&slow);
        CHECK(slow.ended == 1);
        CHECK((slow.st.code == GRPC_STATUS_OK) == (round % 2 == 0));
        ac_free(&slow);
        rpc_channel_free(ch);
    }
    CHECK(threads_named("rpc-loop") == 1);
    CHECK(threads_named("rpc-poller") == 0 && threads_named("rpc-client") == 0);
}

static struct seen traced(struct rpc_channel *ch, bool async)
{
    struct seen out;
    memset(&out, 0, sizeof(out));
    Cflue__V1__Submission *sub = NULL;
    struct acaller a;
    if (async) {
        ac_call(&a, ch, "trace", 5000);
        CHECK(a.st.code == GRPC_STATUS_OK);
        sub = (Cflue__V1__Submission *)a.resp;
    } else {
        Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        struct rpc_status st;
        req.submission_id = "trace";
        CHECK(rpc_unary(ch, "/cflue.v1.Store/Get", &req.base, &cflue__v1__submission__descriptor,
                        5000, &resp, &st));
        sub = (Cflue__V1__Submission *)resp;
    }
    if (sub) {
        snprintf(out.current, sizeof(out.current), "%s", sub->submission_id);
        snprintf(out.parent, sizeof(out.parent), "%s", sub->attempt_id);
        snprintf(out.state, sizeof(out.state), "%s", sub->owner_id);
    }
    if (async) {
        ac_free(&a);
    } else if (sub) {
        protobuf_c_message_free_unpacked(&sub->base, NULL);
    }
    return out;
}

int main(void)
{
    char sock[128], listen_addr[160];
    rpc_global_init();
    snprintf(sock, sizeof(sock), "/tmp/cflue-test-rpc-%d.sock", (int)getpid());
    snprintf(listen_addr, sizeof(listen_addr), "unix:%s", sock);
    test_basic("127.0.0.1:0");
    test_basic(listen_addr);
    unlink(sock);
    test_metadata();
    test_trace_propagation();
    test_cancel_and_shutdown();
    test_admission_flood();
    test_async_streams();
    test_async_limit();
    test_async_client();
    test_async_unary();
    test_one_loop();
    test_method_path_copied();
    test_reconnect_after_outages();
    rpc_global_shutdown();
    return check_done("test_rpc");
}
