/* clients.h - agentd's calls to storaged and toold. */
#ifndef CFLUE_AGENTD_CLIENTS_H
#define CFLUE_AGENTD_CLIENTS_H

#include "rpc.h"
#include "status.h"

#include "cflue/v1/store.pb-c.h"
#include "cflue/v1/tools.pb-c.h"

#include <stdint.h>

/* STORE_TIMEOUT_MS bounds each Store call agentd makes (a caller's shorter deadline bounds the
 * calls made for it: store_timeout_within). */
#define STORE_TIMEOUT_MS 15000

/* store_timeout_within returns how long a Store call made for a caller with left_ms
 * milliseconds left of its deadline (negative: it has none) may take: STORE_TIMEOUT_MS or
 * left_ms, whichever is shorter, and at least 1 ms (a worker is not held for a caller that
 * gave up; 0 would read as no timeout). */
int64_t store_timeout_within(int64_t left_ms);

/* store_call makes one Store RPC ("Admit", "Claim", ...). On success *resp_out holds the
 * decoded response (free with protobuf_c_message_free_unpacked). On failure err carries the
 * server's message, a status mapped back from the gRPC code (status_from_grpc: ABORTED ->
 * CF_STALE, a stale fence; FAILED_PRECONDITION -> CF_PRECONDITION; NOT_FOUND -> CF_NOT_FOUND,
 * ...; UNAVAILABLE and DEADLINE_EXCEEDED -> CF_UNAVAILABLE, which callers may retry) and
 * storaged's ErrorInfo reason, so an error passed on to agentd's callers keeps it. */
CF_MUST_CHECK enum cf_status store_call(struct rpc_channel *ch, const char *method,
                                        const ProtobufCMessage *req,
                                        const ProtobufCMessageDescriptor *resp_desc,
                                        int64_t timeout_ms, ProtobufCMessage **resp_out,
                                        struct cf_error *err);

/* store_status maps the status of a finished Store call to a cf_status as store_call does
 * (err filled unless st is OK): for calls made with rpc_acall_start. */
enum cf_status store_status(const char *method, const struct rpc_status *st, struct cf_error *err);

#endif
