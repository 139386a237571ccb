/* call.c - unary calls and paged listings of the cflue command. */
#include "call.h"

#include "guard.h"
#include "print.h"

#include <stdio.h>

int call_unary(struct rpc_channel *ch, const char *service, const char *method,
               const ProtobufCMessage *req, const ProtobufCMessageDescriptor *desc,
               int64_t timeout_ms, ProtobufCMessage **resp)
{
    char path[128];
    struct rpc_status st;
    snprintf(path, sizeof(path), "/%s/%s", service, method);
    if (!rpc_unary(ch, path, req, desc, guard_timeout_ms(timeout_ms), resp, &st)) {
        return guard_fail(&st);
    }
    return 0;
}

int call_pages(struct rpc_channel *ch, const char *service, const char *method,
               const ProtobufCMessage *req, char **page_token,
               const ProtobufCMessageDescriptor *desc, int64_t timeout_ms, call_show_fn show,
               void *ctx)
{
    ProtobufCMessage *prev = NULL; /* the page whose next_page_token req carries */
    int rc = 0;
    for (bool first = true;; first = false) {
        ProtobufCMessage *resp = NULL;
        if ((rc = call_unary(ch, service, method, req, desc, timeout_ms, &resp))) {
            break;
        }
        if (prev) {
            protobuf_c_message_free_unpacked(prev, NULL);
        }
        prev = resp;
        const char *next = show(ctx, resp, first);
        if (!print_output_ok(stdout)) {
            rc = 1; /* no one reads the rest, or it cannot be written: stop asking for it */
            break;
        }
        if (!next || !*next) {
            break;
        }
        *page_token = (char *)next;
    }
    if (prev) {
        protobuf_c_message_free_unpacked(prev, NULL);
    }
    return rc;
}
