/* provider.h - one model call, whatever the provider.
 *
 * The turn loop builds a provider-neutral request (system prompt, messages, tools); each
 * provider module turns it into its wire format (Anthropic Messages, OpenAI Chat
 * Completions) and parses the answers; provider.c sends it through model_io (one event loop,
 * connections kept alive), streams text deltas to a callback as they arrive, and fills a
 * neutral response: text, tool calls, stop reason, usage. Errors are classified as
 * retryable (rate limit, overload, 5xx, network, timeout) or not, with retry-after honoured.
 *
 * Two ways to call: llm_start (asynchronous: the caller gets a completion callback on the
 * model I/O loop, for a drive stepped by events) and llm_complete (blocks the calling thread
 * until the answer, with callbacks on that thread).
 */
#ifndef CFLUE_AGENTD_PROVIDER_H
#define CFLUE_AGENTD_PROVIDER_H

#include "buf.h"
#include "status.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

/* An answer at most: a whole body, or a streamed answer's text and tool call arguments
 * together (its framing, the events' JSON, is not counted: a stream of small deltas carries
 * several times its content) */
#define PROVIDER_RESPONSE_MAX (16 << 20)
#define PROVIDER_TEXT_MAX (4 << 20)
#define PROVIDER_STALL_MS 60000 /* the default silence after which a stream is given up */
/* A streamed answer's content blocks (Anthropic) or tool calls (OpenAI) at most: an index
 * past it is refused as a bad answer, never dropped */
#define PROVIDER_STREAM_PARTS_MAX 4096

struct llm_tool {
    const char *name;
    const char *description;
    const char *schema_json;
    char *schema_text; /* llm_schema_text(schema_json), owned by whoever filled it, or NULL:
                        * then each request reads schema_json through llm_schema_text */
};

struct llm_call {
    char *id;
    char *name;
    char *arguments_json; /* as the model produced it (may be invalid JSON) */
};

enum llm_role { LLM_USER, LLM_ASSISTANT, LLM_TOOL_RESULT };

struct llm_image {
    const char *mime_type; /* image/png, image/jpeg, image/gif, image/webp */
    const char *base64;
};

struct llm_message {
    enum llm_role role;
    const char *text;               /* user / assistant text, or the tool result text */
    const struct llm_image *images; /* after the text: a user's images, a tool result's */
    size_t n_images;
    const struct llm_call *calls; /* assistant tool calls */
    size_t n_calls;
    const char *tool_call_id; /* tool result */
    const char *tool_name;    /* tool result */
    bool is_error;            /* tool result */
};

struct llm_request {
    const char *provider; /* "anthropic" or "openai" */
    const char *model;
    const char *system;
    const struct llm_message *messages;
    size_t n_messages;
    const struct llm_tool *tools;
    size_t n_tools;
    int64_t max_tokens;
    bool stream;
    int64_t timeout_ms; /* the whole call, if shorter than the endpoint's timeout (0: none):
                         * the time left of the work's limit (a call it ends is CF_DEADLINE) */
};

struct llm_response {
    struct buf text;
    struct llm_call *calls;
    size_t n_calls;
    char stop_reason[32]; /* "end_turn", "tool_use", "max_tokens", ... as the provider said */
    size_t args_bytes;    /* a streamed answer's tool call arguments so far, all calls */
    bool stream_ended;    /* the stream's last event came (message_stop, [DONE]): the answer
                           * is whole, whatever happens to the connection after it */
    int64_t input_tokens, output_tokens;
    /* on failure */
    int http_status;
    bool retryable;
    bool context_overflow;
    int64_t retry_after_ms;
};

struct llm_events {
    void (*on_text)(void *ctx, const char *p, size_t n);
    bool (*cancelled)(void *ctx);
    void *ctx;
};

/* llm_done_fn gets the end of an llm_start call: rc as llm_complete returns it, err its
 * reason (valid during the call only). */
typedef void (*llm_done_fn)(void *ctx, enum cf_status rc, const struct cf_error *err);

struct provider_endpoint {
    const char *base_url; /* e.g. https://api.anthropic.com */
    const char *api_key;
    int64_t timeout_ms;
    /* a streamed answer silent this long is a network failure (0: the default, 60 s); a
     * whole answer (no stream) sends nothing until it is written, so only timeout_ms and the
     * submission's time left bound it */
    int64_t stall_ms;
};

/* llm_response_init / llm_response_cleanup manage a response. */
void llm_response_init(struct llm_response *r);
void llm_response_cleanup(struct llm_response *r);

/* llm_complete makes one model call and waits for it. CF_OK with the response filled;
 * CF_CANCELLED when events->cancelled said so (asked every MODEL_IO_CANCEL_POLL_MS on the
 * calling thread; the transfer is abandoned at once) or model I/O shut down; CF_UNAVAILABLE
 * (retryable set when a retry may help) or CF_INVALID for provider errors, CF_BUSY when
 * too many calls are in flight (retryable), with the message in err. events->on_text runs on
 * the calling thread (it may block) with the text streamed so far; events may be NULL. The
 * connection is kept for the next call (model_io.h). */
CF_MUST_CHECK enum cf_status llm_complete(const struct provider_endpoint *ep,
                                          const struct llm_request *req,
                                          const struct llm_events *events, struct llm_response *out,
                                          struct cf_error *err);

/* llm_start starts one model call on the shared model I/O loop and returns at once. CF_OK
 * with *out_id set: done is called exactly once, on the loop thread, when the call ends, with
 * what llm_complete would return; out is filled on the loop thread and may be read once done
 * runs. req and ep are read during llm_start only (the body, URL and headers are copied);
 * events and out must stay valid until done. events->on_text and events->cancelled run on
 * the loop thread and must not block (model_io.h); so must done. On failure (CF_BUSY past the
 * cap on calls in flight, CF_CANCELLED while model I/O shuts down, CF_INVALID for an unknown
 * provider) done is never called; err says why and out->retryable is set for CF_BUSY. The
 * request carries the calling thread's current trace (trace.h), when it has one, as the HTTP
 * headers traceparent (a new parent-id: each request its own span) and tracestate. */
CF_MUST_CHECK enum cf_status llm_start(const struct provider_endpoint *ep,
                                       const struct llm_request *req,
                                       const struct llm_events *events, struct llm_response *out,
                                       llm_done_fn done, void *done_ctx, uint64_t *out_id,
                                       struct cf_error *err);

/* llm_cancel ends the call id at once: its done gets CF_CANCELLED shortly after, on the loop
 * thread. A no-op once the call has ended. Thread-safe, idempotent. */
void llm_cancel(uint64_t id);

/* ---------- for the provider modules ---------- */

/* A provider's wire format: where the request goes, how it is authenticated, how its body is
 * built and its answers parsed. One per provider module. */
struct provider_wire {
    const char *name;         /* as in agent definitions: "anthropic", "openai" */
    const char *path;         /* appended to the base URL (its /v1 is not repeated) */
    const char *auth_prefix;  /* the header line that carries the API key, up to the key */
    const char *extra_header; /* a fixed header line, or NULL */
    char *(*build)(const struct llm_request *req, size_t *len_out);
    enum cf_status (*parse_body)(const char *body, size_t len, struct llm_response *out,
                                 struct cf_error *err);
    enum cf_status (*parse_event)(void *state, const char *event, const char *data,
                                  const struct llm_events *ev, struct llm_response *out,
                                  struct cf_error *err);
    void *(*stream_new)(void);
    void (*stream_free)(void *state);
};

extern const struct provider_wire anthropic_wire;
extern const struct provider_wire openai_wire;

/* provider_wire_find returns the wire format of a provider name, or NULL. */
const struct provider_wire *provider_wire_find(const char *provider);

/* llm_event_json parses one streamed event's data. NULL (err says what was wrong, naming the
 * provider's stream `who`) when it is not JSON. The caller decrefs the result. */
json_t *llm_event_json(const char *who, const char *data, struct cf_error *err);

/* llm_retry_after_ms reads a Retry-After header's value: delay-seconds or an HTTP-date (as
 * of now), in ms, at most LLM_RETRY_AFTER_MAX_MS; 0 when it says nothing usable (empty,
 * negative, malformed, a date past). */
#define LLM_RETRY_AFTER_MAX_MS (24LL * 3600 * 1000)
int64_t llm_retry_after_ms(const char *value, time_t now);

/* llm_text_delta appends a piece of the model's text to out and passes it to ev->on_text.
 * CF_TOOBIG (err set, nothing passed on) past PROVIDER_TEXT_MAX, or when the answer's text and
 * arguments together pass PROVIDER_RESPONSE_MAX. */
CF_MUST_CHECK enum cf_status llm_text_delta(struct llm_response *out, const struct llm_events *ev,
                                            json_t *piece, struct cf_error *err);

/* llm_args_delta appends a piece of a streamed tool call's arguments to args, one of out's
 * calls. CF_TOOBIG (err set) when the answer's text and arguments together pass
 * PROVIDER_RESPONSE_MAX. */
CF_MUST_CHECK enum cf_status llm_args_delta(struct llm_response *out, struct buf *args,
                                            json_t *piece, struct cf_error *err);

/* llm_schema_text returns a tool's parameter schema (JSON text, NULL read as "") as compact
 * JSON text of an object, which the caller frees: schema_json re-encoded, or {} when it is not
 * a JSON object. Each text is parsed once: the last LLM_SCHEMA_CACHE_MAX texts seen are kept
 * with their answers, so the tool set every drive lists costs a lookup. Thread-safe. */
#define LLM_SCHEMA_CACHE_MAX 128
char *llm_schema_text(const char *schema_json);

/* llm_usage_read copies the integer fields in_key and out_key of a usage object into out's
 * token counts; absent fields (or a NULL key) leave them unchanged. */
void llm_usage_read(json_t *usage, const char *in_key, const char *out_key,
                    struct llm_response *out);

struct jw;

/* llm_schema_write writes t's parameter schema: its schema_text, or llm_schema_text's. */
void llm_schema_write(struct jw *w, const struct llm_tool *t);

/* llm_text_part writes {"type":"text","text":text}: a text content block (Anthropic) or part
 * (OpenAI). */
void llm_text_part(struct jw *w, const char *text);

/* Provider modules: write the request body (the caller frees it; its length in *len_out; NULL
 * when it cannot be written); parse a non-streamed body or one SSE event. */
char *anthropic_build(const struct llm_request *req, size_t *len_out);
CF_MUST_CHECK enum cf_status anthropic_parse_body(const char *body, size_t len,
                                                  struct llm_response *out, struct cf_error *err);
CF_MUST_CHECK enum cf_status anthropic_parse_event(void *state, const char *event, const char *data,
                                                   const struct llm_events *ev,
                                                   struct llm_response *out, struct cf_error *err);
void *anthropic_stream_new(void);
void anthropic_stream_free(void *state);

char *openai_build(const struct llm_request *req, size_t *len_out);
CF_MUST_CHECK enum cf_status openai_parse_body(const char *body, size_t len,
                                               struct llm_response *out, struct cf_error *err);
CF_MUST_CHECK enum cf_status openai_parse_event(void *state, const char *event, const char *data,
                                                const struct llm_events *ev,
                                                struct llm_response *out, struct cf_error *err);
void *openai_stream_new(void);
void openai_stream_free(void *state);

/* A tool call's id or name the model sends at most (longer: a bad answer, not kept) */
#define LLM_CALL_FIELD_MAX 256
/* Tokens one answer may report for its input or output: a provider's larger or negative
 * figure is taken as this or 0 (storaged refuses a negative one, and the sum over a
 * submission must not overflow) */
#define LLM_TOKENS_MAX 1000000000LL

/* llm_add_call appends a tool call to the response (copies the strings; NULL as ""). A bad
 * answer (CF_INVALID, err set, nothing appended) when the response holds
 * PROVIDER_STREAM_PARTS_MAX calls already or id or name is over LLM_CALL_FIELD_MAX bytes. */
CF_MUST_CHECK enum cf_status llm_add_call(struct llm_response *r, const char *id, const char *name,
                                          const char *args, struct cf_error *err);

/* llm_call_field checks a tool call's id or name as the model sent it (what, "id" or "name",
 * names it in the error): CF_INVALID past LLM_CALL_FIELD_MAX bytes. */
CF_MUST_CHECK enum cf_status llm_call_field(const char *what, const char *s, struct cf_error *err);

#endif
