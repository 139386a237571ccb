/* Tests of common/rpc over real loopback gRPC: the server layer and the client helpers. */
#include "../check.h"

#include "clock.h"
#include "rpc.h"

#include "cflue/v1/store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Get: "ok" answers a submission echoing the id, "slow" answers after 500 ms (worker pool),
 * anything else fails NOT_FOUND with a message. */
static void on_get(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GetRequest *req = (const void *)msg;
    Cflue__V1__Submission resp = CFLUE__V1__SUBMISSION__INIT;
    if (!strcmp(req->submission_id, "slow")) {
        clock_sleep_ms(500);
    }
    if (!strcmp(req->submission_id, "ok") || !strcmp(req->submission_id, "slow")) {
        resp.submission_id = req->submission_id;
        resp.attempt_count = 7;
        rpc_call_reply(c, &resp.base);
        return;
    }
    rpc_call_fail(c, CF_NOT_FOUND, "no submission '%s'", req->submission_id);
}

static int stream_sent;
static bool stream_saw_cancel;

/* Follow: sends after_offset+1 records; a negative count streams until cancelled. */
static void on_follow(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__FollowRequest *req = (const void *)msg;
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    int n = (int)req->after_offset;
    for (int i = 0; n < 0 || i < n; i++) {
        rec.offset = i;
        rec.type = "t";
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

static struct rpc_server *start(const char *addr, int *port)
{
    struct rpc_server_opts o = {.workers = 2, .max_message_bytes = 1 << 20};
    struct rpc_server *s = rpc_server_new(&o);
    struct cf_error err;
    rpc_server_add_method(s, "/cflue.v1.Store/Get", &cflue__v1__get_request__descriptor, on_get,
                          NULL, RPC_POOL);
    rpc_server_add_method(s, "/cflue.v1.Store/Follow", &cflue__v1__follow_request__descriptor,
                          on_follow, NULL, RPC_THREAD);
    CHECK(rpc_server_listen(s, addr, port, &err) == CF_OK);
    rpc_server_start(s);
    return s;
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

    /* the deadline passes while the handler sleeps */
    CHECK(!get(ch, "slow", 100, &st, &count));
    CHECK(st.code == GRPC_STATUS_DEADLINE_EXCEEDED);

    /* streams: all messages in order, then OK; an error status after the messages */
    CHECK(read_stream(ch, 500, "", &st) == 500 && st.code == GRPC_STATUS_OK);
    CHECK(read_stream(ch, 3, "fail", &st) == 3 && st.code == GRPC_STATUS_ABORTED);
    CHECK_STR(st.details, "stopped after the records");

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

int main(void)
{
    char sock[128], listen_addr[160];
    rpc_global_init();
    snprintf(sock, sizeof(sock), "/tmp/cflue-test-rpc-%d.sock", (int)getpid());
    snprintf(listen_addr, sizeof(listen_addr), "unix:%s", sock);
    test_basic("127.0.0.1:0");
    test_basic(listen_addr);
    unlink(sock);
    test_cancel_and_shutdown();
    rpc_global_shutdown();
    return check_done("test_rpc");
}
