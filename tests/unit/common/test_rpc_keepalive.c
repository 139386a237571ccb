/* Tests of common/rpc_client's keepalive probe over real loopback gRPC: a channel whose calls
 * send nothing for several keepalive periods gets a grpc.health.v1 Check each period (the data
 * that lets gRPC's pings go on), for blocking and event-driven calls alike; so does one whose
 * calls keep starting while its server answers nothing; a channel with nothing in flight gets
 * none. Its own process: the keepalive, here 1 s, is set before the
 * first channel. */
#include "../check.h"

#include "clock.h"
#include "rpc.h"

#include "cflue/v1/store.pb-c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#define KEEPALIVE_MS 1000
#define HOLD_MS 3600 /* a silent call: more than three keepalive periods */
#define HEALTH_CHECK "/grpc.health.v1.Health/Check"

/* Hold: answers after HOLD_MS, having sent nothing before (unary and streaming alike). */
static void on_hold(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    (void)msg;
    (void)user;
    Cflue__V1__Submission resp = CFLUE__V1__SUBMISSION__INIT;
    resp.submission_id = "held";
    clock_sleep_ms(HOLD_MS);
    rpc_call_reply(c, &resp.base);
}

static void on_hold_stream(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    (void)msg;
    (void)user;
    Cflue__V1__Submission resp = CFLUE__V1__SUBMISSION__INIT;
    resp.submission_id = "held";
    clock_sleep_ms(HOLD_MS);
    if (rpc_call_send(c, &resp.base)) {
        rpc_call_finish(c, GRPC_STATUS_OK, NULL);
    } else {
        rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the client left");
    }
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int messages;
    int ended;
    grpc_status_code code;
} g_stream = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void on_message(void *arg, ProtobufCMessage *msg)
{
    (void)arg;
    protobuf_c_message_free_unpacked(msg, NULL);
    pthread_mutex_lock(&g_stream.mu);
    g_stream.messages++;
    pthread_mutex_unlock(&g_stream.mu);
}

static void on_end(void *arg, const struct rpc_status *st)
{
    (void)arg;
    pthread_mutex_lock(&g_stream.mu);
    g_stream.ended++;
    g_stream.code = st->code;
    pthread_cond_broadcast(&g_stream.cv);
    pthread_mutex_unlock(&g_stream.mu);
}

/* probes counts the probes the server received, once a probe started just before the last
 * call ended had time to arrive. */
static uint64_t probes(struct rpc_server *s)
{
    clock_sleep_ms(300);
    return rpc_server_method_calls(s, HEALTH_CHECK);
}

static void wait_streams_ended(int n)
{
    pthread_mutex_lock(&g_stream.mu);
    while (g_stream.ended < n) {
        pthread_cond_wait(&g_stream.cv, &g_stream.mu);
    }
    CHECK(g_stream.messages == n && g_stream.code == GRPC_STATUS_OK);
    pthread_mutex_unlock(&g_stream.mu);
}

int main(void)
{
    rpc_global_init();
    rpc_set_keepalive_ms(KEEPALIVE_MS);
    CHECK(rpc_keepalive_ms() == KEEPALIVE_MS);

    struct rpc_server_opts opts = {0};
    struct rpc_server *s = rpc_server_new(&opts);
    rpc_server_add_method(s, "/test.Hold/Unary", &cflue__v1__get_request__descriptor, on_hold, NULL,
                          RPC_POOL);
    rpc_server_add_method(s, "/test.Hold/Stream", &cflue__v1__get_request__descriptor,
                          on_hold_stream, NULL, RPC_THREAD);
    struct cf_error err;
    int port = 0;
    CHECK(rpc_server_listen(s, "127.0.0.1:0", &port, &err) == CF_OK);
    CHECK(rpc_server_start(s) == CF_OK);
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    struct rpc_channel *ch = rpc_channel_new(target, 0);

    /* nothing in flight: no probe, however long the channel is idle */
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    req.submission_id = "x";
    clock_sleep_ms(3 * KEEPALIVE_MS);
    CHECK(probes(s) == 0);

    /* a blocking call that is silent for HOLD_MS: one probe per keepalive period after the
     * first (the loop looks four times a period), none after it ended */
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    CHECK(rpc_unary(ch, "/test.Hold/Unary", &req.base, &cflue__v1__submission__descriptor, 0, &resp,
                    &st));
    protobuf_c_message_free_unpacked(resp, NULL);
    uint64_t after_unary = probes(s);
    CHECK(after_unary >= 2 && after_unary <= 4);
    clock_sleep_ms(2 * KEEPALIVE_MS);
    CHECK(probes(s) == after_unary);

    /* an event-driven stream silent for HOLD_MS: probed the same way */
    static const struct rpc_astream_ops ops = {.on_message = on_message, .on_end = on_end};
    struct rpc_astream *as = rpc_astream_open(ch, "/test.Hold/Stream", &req.base,
                                              &cflue__v1__submission__descriptor, 0, &ops, NULL);
    wait_streams_ended(1);
    rpc_astream_release(as);
    uint64_t after_stream = probes(s);
    CHECK(after_stream - after_unary >= 2 && after_stream - after_unary <= 4);
    clock_sleep_ms(2 * KEEPALIVE_MS);
    CHECK(probes(s) == after_stream);

    /* calls start every 400 ms, so something is always sent, but the server answers none of
     * them for HOLD_MS: probed all the same (a server counts the pings that come while it
     * writes nothing; the probe's answer is a write) */
    enum { STAGGERED = 8 };
    struct rpc_astream *more[STAGGERED];
    int64_t t0 = clock_mono_ms();
    uint64_t before_any_answer = 0;
    for (int i = 0; i < STAGGERED; i++) {
        more[i] = rpc_astream_open(ch, "/test.Hold/Stream", &req.base,
                                   &cflue__v1__submission__descriptor, 0, &ops, NULL);
        clock_sleep_ms(400);
        if (clock_mono_ms() - t0 < HOLD_MS - 200) { /* none has been answered yet */
            before_any_answer = rpc_server_method_calls(s, HEALTH_CHECK) - after_stream;
        }
    }
    CHECK(before_any_answer >= 2);
    wait_streams_ended(1 + STAGGERED);
    for (int i = 0; i < STAGGERED; i++) {
        rpc_astream_release(more[i]);
    }

    rpc_channel_free(ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
    rpc_global_shutdown();
    return check_done("test_rpc_keepalive");
}
