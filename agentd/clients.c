/* clients.c - typed-enough wrappers over rpc_unary for storaged. */
#include "clients.h"

#include <stdio.h>

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
