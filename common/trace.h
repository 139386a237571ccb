/* trace.h - W3C Trace Context (https://www.w3.org/TR/trace-context/): the `traceparent` and
 * `tracestate` headers parsed and made, and the trace of the work a thread is doing now.
 *
 *   traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
 *                ^^ trace-id (32 hex)                 parent-id (16)   trace-flags
 *
 * A trace context (struct trace_ctx) is a trace id, the id of the span the work belongs to
 * and the trace flags, with the tracestate that travels with them. Each thread has a current
 * one (none at first): log_write ends every line written while it is set with
 * `trace_id=<32 hex> span_id=<16 hex>`, and the gRPC client (rpc_client.c) sends
 * `traceparent` (with a new parent-id: a span of its own for that call) and `tracestate` on
 * every call started while it is set. The gRPC server (rpc_server.c) sets it, around each
 * handler, from the call's own headers. Work that moves to another thread (a callback, a
 * queue) sets it there with trace_enter and trace_leave.
 */
#ifndef CFLUE_TRACE_H
#define CFLUE_TRACE_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>

#define TRACE_ID_HEX 32      /* characters of a trace-id */
#define TRACE_SPAN_HEX 16    /* characters of a parent-id (span id) */
#define TRACE_PARENT_SIZE 56 /* a version-00 traceparent and its NUL: 2+1+32+1+16+1+2+1 */
#define TRACE_STATE_MAX 512  /* characters of tracestate kept (the spec's minimum to propagate) */
#define TRACE_STATE_MEMBERS 32
#define TRACE_FLAG_SAMPLED 0x01
#define TRACE_FLAG_RANDOM 0x02 /* Level 2: the trace-id's right-most 7 bytes are random */
#define TRACE_FLAGS_KNOWN (TRACE_FLAG_SAMPLED | TRACE_FLAG_RANDOM)

/* The longest header values read from a peer: longer ones are refused whole, never cut. */
#define TRACE_PARENT_INPUT_MAX 256
#define TRACE_STATE_INPUT_MAX 4096

struct trace_ctx {
    char trace_id[TRACE_ID_HEX + 1]; /* lowercase hex, never all zeros; "": no trace */
    char span_id[TRACE_SPAN_HEX + 1];
    unsigned flags;                  /* TRACE_FLAGS_KNOWN bits only */
    char state[TRACE_STATE_MAX + 1]; /* tracestate, normalized ("": none) */
};

/* trace_parse reads a traceparent header value, and tracestate (NULL or "": none) with it,
 * into out: the trace id, the parent-id as span_id, the flags it knows (others are dropped, as
 * the spec asks of a forwarder). Rules of the spec: optional blanks around the value; version
 * 2 lowercase hex, not "ff"; version 00 is exactly 55 characters; a later version is at least
 * 55, parsed as 00 and anything after a '-' at position 55 ignored; ids lowercase hex, not all
 * zeros. A tracestate that breaks its grammar (keys, values, more than 32 members, a key
 * twice) is dropped and the trace kept; one longer than TRACE_STATE_MAX loses its members over
 * 128 characters, then its last ones, until it fits. CF_OK, or CF_INVALID with err saying what
 * was wrong and out cleared (no trace). Never fails for the tracestate alone. */
CF_MUST_CHECK enum cf_status trace_parse(struct trace_ctx *out, const char *traceparent,
                                         const char *tracestate, struct cf_error *err);

/* trace_start fills out with a new trace: a random trace id and span id, flags sampled, no
 * tracestate. */
void trace_start(struct trace_ctx *out);

/* trace_child fills out with parent's trace (id, flags, tracestate) and a new random span id.
 * out may be parent. */
void trace_child(struct trace_ctx *out, const struct trace_ctx *parent);

/* trace_format writes t's traceparent (version 00, t's span as parent-id) into out; "" when t
 * holds no trace. */
void trace_format(const struct trace_ctx *t, char out[TRACE_PARENT_SIZE]);

/* trace_new_span writes a random span id (16 lowercase hex, never all zeros). */
void trace_new_span(char out[TRACE_SPAN_HEX + 1]);

/* ---- the current trace of the calling thread ---- */

/* trace_current returns the calling thread's current trace, or NULL when there is none. The
 * pointer is the thread's own copy: valid on this thread until its trace changes. */
const struct trace_ctx *trace_current(void);

/* trace_enter makes a copy of t (NULL, or one holding no trace: none) the calling thread's
 * current trace, saving the one it replaces in *saved for trace_leave. */
void trace_enter(const struct trace_ctx *t, struct trace_ctx *saved);

/* trace_leave restores the trace trace_enter saved. */
void trace_leave(const struct trace_ctx *saved);

/* trace_outgoing writes the traceparent for a request leaving now under the current trace: the
 * same trace and flags, a new span id for the request. false, with out "", when the thread has
 * no current trace. Its tracestate, if any, is trace_current()->state. */
bool trace_outgoing(char out[TRACE_PARENT_SIZE]);

/* The HTTP header lines of one request leaving under a trace (trace_http_headers). */
struct trace_http {
    char parent[TRACE_PARENT_SIZE + 16];
    char state[TRACE_STATE_MAX + 16];
};

/* trace_http_headers makes the header lines of an HTTP request leaving under t (NULL: the
 * calling thread's current trace) as a span of its own: "traceparent: ..." and, when the trace
 * carries one, "tracestate: ...", written into h and appended to lines. Returns how many (0
 * without a trace, else 1 or 2). */
size_t trace_http_headers(const struct trace_ctx *t, struct trace_http *h, const char **lines);

#endif
