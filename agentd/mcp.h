/* mcp.h - a client of MCP servers over the streamable HTTP transport (an agent's mcp:).
 *
 * An operation lists a server's tools (every page of tools/list) or calls one tool
 * (tools/call), setting up the server's session first when there is none (initialize, then
 * notifications/initialized), and again once when the server says the session is gone
 * (HTTP 404). Every request is one HTTP POST on the model I/O loop (model_io.h): nothing
 * waits on a thread. Answers come as JSON or as a text/event-stream whose event carrying the
 * response ends the transfer. Sessions (their Mcp-Session-Id and protocol version) are kept
 * per URL and headers for the process's life. An operation carries the trace of the thread
 * that started it (trace.h) on each of its POSTs: traceparent (a new parent-id each) and
 * tracestate.
 *
 * Bounds: a response of at most MCP_RESPONSE_MAX bytes; at most MCP_PAGES_MAX pages and
 * MCP_TOOLS_MAX tools in a listing; a call's text at most MCP_TEXT_MAX bytes (cut with a note);
 * its images as image.h bounds a tool result's (others are described in the text instead).
 */
#ifndef CFLUE_AGENTD_MCP_H
#define CFLUE_AGENTD_MCP_H

#include "agents.h"
#include "buf.h"
#include "image.h"

#include "cflue/v1/common.pb-c.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#define MCP_PROTOCOL_VERSION "2025-06-18" /* the version asked for at initialize */
#define MCP_RESPONSE_MAX (16 << 20)
#define MCP_PAGES_MAX 32
#define MCP_TOOLS_MAX 256
#define MCP_TEXT_MAX 51200

struct mcp_op;

/* done(arg) is called once, on the model I/O loop, when the operation is over (it must not
 * block; engine_post is fine). */
typedef void (*mcp_done_fn)(void *arg);

/* mcp_list_start starts listing server m's tools; m must outlive the operation. Never NULL:
 * an operation that cannot start is over at once (done is called, maybe before this
 * returns). timeout_ms bounds the whole operation. */
struct mcp_op *mcp_list_start(const struct agent_mcp *m, int64_t timeout_ms, mcp_done_fn done,
                              void *arg);
/* mcp_call_start starts calling m's tool `tool` with arguments_json (a JSON object; anything
 * else is answered at once with an error result, and nothing is sent). As mcp_list_start. */
struct mcp_op *mcp_call_start(const struct agent_mcp *m, const char *tool,
                              const char *arguments_json, int64_t timeout_ms, mcp_done_fn done,
                              void *arg);
/* mcp_op_done: the operation is over (thread-safe; its results may be read from then on). */
bool mcp_op_done(struct mcp_op *op);
/* mcp_op_cancel ends the operation soon (done follows). Thread-safe, idempotent. */
void mcp_op_cancel(struct mcp_op *op);
/* mcp_op_failure: why the server could not be used (unreachable, an HTTP error, an answer that
 * is not MCP, cancelled), or NULL when it answered. */
const char *mcp_op_failure(const struct mcp_op *op);
/* mcp_op_tools: a listing's tools, a JSON array of the server's tool objects (borrowed: valid
 * until mcp_op_free). */
json_t *mcp_op_tools(const struct mcp_op *op);
/* mcp_op_text / mcp_op_is_error: a call's result as the model reads it (an MCP error answer
 * and a result with isError are error results). */
const char *mcp_op_text(const struct mcp_op *op);
bool mcp_op_is_error(const struct mcp_op *op);
/* mcp_op_images: a call's images (mcp_result_read), *n of them; borrowed: valid until
 * mcp_op_free. */
Cflue__V1__Attachment **mcp_op_images(struct mcp_op *op, size_t *n);
/* mcp_op_free frees an operation that is over (NULL is fine). */
void mcp_op_free(struct mcp_op *op);

/* What the model is shown of a tools/call result. */
struct mcp_result {
    struct buf text; /* at most MCP_TEXT_MAX bytes, and a note when cut */
    bool is_error;   /* the result's isError */
    /* its image content, decoded: names "image-<n>" in names[], mime types image_type()'s
     * static strings, data owned here; ptrs[] point at images[] (an Attachment list) */
    Cflue__V1__Attachment images[IMAGE_RESULT_MAX];
    Cflue__V1__Attachment *ptrs[IMAGE_RESULT_MAX];
    char names[IMAGE_RESULT_MAX][16];
    size_t n_images;
    size_t image_bytes; /* their data together */
};

/* mcp_result_init prepares an empty result; mcp_result_cleanup frees what it holds (and may
 * be called again, or after init alone). */
void mcp_result_init(struct mcp_result *r);
void mcp_result_cleanup(struct mcp_result *r);

/* mcp_result_read maps a tools/call result into r (fresh from mcp_result_init): its text
 * content in order; each image item with a type image.h allows, valid base64 and room left
 * under image.h's bounds becomes one of r's images, with a line in the text saying it is
 * shown after it; any other image item, and each audio item and binary resource, a line
 * saying what it was and why it cannot be shown; a resource's text; a resource link's URI;
 * with no content, the structured content as JSON. The text is cut at a character boundary
 * with a note past MCP_TEXT_MAX bytes. r->is_error is the result's isError. Never fails:
 * whatever the server sent is described. */
void mcp_result_read(struct mcp_result *r, json_t *result);

#endif
