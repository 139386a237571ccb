/* rpc_client.c - blocking unary and server-streaming calls, and the protobuf-c codec.
 *
 * Each call gets its own pluck completion queue, created and drained with the call. Channels
 * are shared between threads; calls on one channel multiplex over one HTTP/2 connection.
 */
#include "rpc.h"

#include "log.h"
#include "mem.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct rpc_channel {
    grpc_channel *ch;
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

void rpc_global_init(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    log_capture_grpc();
    grpc_init();
}

void rpc_global_shutdown(void)
{
    grpc_shutdown_blocking();
}

struct rpc_channel *rpc_channel_new(const char *target, int max_message_bytes)
{
    struct rpc_channel *c = mem_alloc(sizeof(*c));
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_arg args[2];
    int max = max_message_bytes > 0 ? max_message_bytes : 16 << 20;
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = max;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = max;
    grpc_channel_args ca = {2, args};
    c->ch = grpc_channel_create(target, creds, &ca);
    grpc_channel_credentials_release(creds);
    return c;
}

void rpc_channel_free(struct rpc_channel *ch)
{
    if (ch) {
        grpc_channel_destroy(ch->ch);
        free(ch);
    }
}

static gpr_timespec deadline_in(int64_t ms)
{
    if (ms <= 0) {
        return gpr_inf_future(GPR_CLOCK_REALTIME);
    }
    return gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void drain_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

static void copy_status(struct rpc_status *st, grpc_status_code code, grpc_slice details)
{
    size_t n = GRPC_SLICE_LENGTH(details);
    st->code = code;
    if (n >= sizeof(st->details)) {
        n = sizeof(st->details) - 1;
    }
    memcpy(st->details, GRPC_SLICE_START_PTR(details), n);
    st->details[n] = '\0';
}

bool rpc_unary(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
               ProtobufCMessage **resp_out, struct rpc_status *st)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_slice mslice = grpc_slice_from_static_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, mslice,
                                               NULL, deadline_in(timeout_ms), NULL);
    grpc_metadata_array init_md, trail_md;
    grpc_byte_buffer *send = rpc_pack(req), *recv = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    int tag = 0;

    *resp_out = NULL;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) == GRPC_CALL_OK) {
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    }
    copy_status(st, code, details);
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
    return st->code == GRPC_STATUS_OK;
}

struct rpc_stream {
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    bool got_md;
    bool ended;
    int tag_open, tag_status, tag_read;
};

struct rpc_stream *rpc_stream_open(struct rpc_channel *ch, const char *method,
                                   const ProtobufCMessage *req, int64_t timeout_ms)
{
    struct rpc_stream *s = mem_alloc(sizeof(*s));
    grpc_op ops[3];
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq,
                                       grpc_slice_from_static_string(method), NULL,
                                       deadline_in(timeout_ms), NULL);
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->code = GRPC_STATUS_UNKNOWN;
    s->details = grpc_empty_slice();
    grpc_byte_buffer *send = rpc_pack(req);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
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
    grpc_completion_queue_pluck(s->cq, &s->tag_status, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    copy_status(st, s->code, s->details);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    grpc_call_unref(s->call);
    drain_cq(s->cq);
    free(s);
    return st->code == GRPC_STATUS_OK;
}
