/* clients.c - typed-enough wrappers over rpc_unary for storaged. */
#include "clients.h"

#include "errinfo.h"

#include <stdio.h>
#include <string.h>

int64_t store_timeout_within(int64_t left_ms)
{
    return left_ms < 0 || left_ms > STORE_TIMEOUT_MS ? STORE_TIMEOUT_MS : left_ms < 1 ? 1 : left_ms;
}

enum cf_status store_status(const char *method, const struct rpc_status *st, struct cf_error *err)
{
    if (st->code == GRPC_STATUS_OK) {
        return CF_OK;
    }
    const char *msg = st->details[0] ? st->details : "call failed";
    /* storaged's specific reason (STALE_FENCE, IDEMPOTENCY_CONFLICT, ...) travels on with the
     * error; a reason that only names the gRPC code is left to the mapped status's default */
    if (st->reason[0] && strcmp(st->reason, errinfo_default_reason(st->code)) != 0) {
        return cf_error_setr(err, status_from_grpc(st->code), st->reason, "storaged %s: %s", method,
                             msg);
    }
    return cf_error_set(err, status_from_grpc(st->code), "storaged %s: %s", method, msg);
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
    return store_status(method, &st, err);
}
