/* clients.c - typed-enough wrappers over rpc_unary for storaged. */
#include "clients.h"

#include <stdio.h>

enum cf_status status_from_grpc(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return CF_OK;
    case GRPC_STATUS_INVALID_ARGUMENT:
        return CF_INVALID;
    case GRPC_STATUS_NOT_FOUND:
        return CF_NOT_FOUND;
    case GRPC_STATUS_ALREADY_EXISTS:
        return CF_EXISTS;
    case GRPC_STATUS_FAILED_PRECONDITION:
        return CF_STALE;
    case GRPC_STATUS_OUT_OF_RANGE:
        return CF_RANGE;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return CF_BUSY;
    case GRPC_STATUS_CANCELLED:
        return CF_CANCELLED;
    case GRPC_STATUS_UNAVAILABLE:
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return CF_UNAVAILABLE;
    case GRPC_STATUS_UNIMPLEMENTED:
        return CF_UNIMPLEMENTED;
    default:
        return CF_INTERNAL;
    }
}

enum cf_status store_call(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                          ProtobufCMessage **resp_out, struct cf_error *err)
{
    char path[128];
    struct rpc_status st;
    snprintf(path, sizeof(path), "/cflue.v1.Store/%s", method);
    if (rpc_unary(ch, path, req, resp_desc, timeout_ms, resp_out, &st)) {
        return CF_OK;
    }
    return cf_error_set(err, status_from_grpc(st.code), "storaged %s: %s", method,
                        st.details[0] ? st.details : "call failed");
}
