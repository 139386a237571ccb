/* call.h - the cflue command's unary calls and paged listings, bounded by its guard. */
#ifndef CFLUE_CLI_CALL_H
#define CFLUE_CLI_CALL_H

#include "rpc.h"

#include <stdbool.h>
#include <stdint.h>

/* call_unary calls /SERVICE/METHOD ("cflue.v1.Store", "Get") on ch within
 * guard_timeout_ms(timeout_ms). Returns 0 with *resp set (the caller frees it), or prints the
 * failure (guard_fail) and returns 1. */
int call_unary(struct rpc_channel *ch, const char *service, const char *method,
               const ProtobufCMessage *req, const ProtobufCMessageDescriptor *desc,
               int64_t timeout_ms, ProtobufCMessage **resp);

/* call_show_fn shows one page of a listing (first: it is the first page) and returns the
 * page's next_page_token; "" or NULL ends the listing. The page stays alive until the next
 * one has arrived. */
typedef const char *(*call_show_fn)(void *ctx, const ProtobufCMessage *page, bool first);

/* call_pages calls METHOD with req as call_unary does, shows the page, and calls again with
 * *page_token (a field of req) set to the page's next token until show returns none. Returns
 * 0, or 1 once a call failed (printed; the pages before it were shown) or a page could not be
 * written to stdout (print_output_ok: the reader went away, the disk is full). */
int call_pages(struct rpc_channel *ch, const char *service, const char *method,
               const ProtobufCMessage *req, char **page_token,
               const ProtobufCMessageDescriptor *desc, int64_t timeout_ms, call_show_fn show,
               void *ctx);

#endif
