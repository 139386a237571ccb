/* provider.h - one model call, whatever the provider.
 *
 * The turn loop builds a provider-neutral request (system prompt, messages, tools); each
 * provider module turns it into its wire format (Anthropic Messages, OpenAI Chat
 * Completions), sends it with libcurl, streams text deltas to a callback as they arrive, and
 * fills a neutral response: text, tool calls, stop reason, usage. Errors are classified as
 * retryable (rate limit, overload, 5xx, network, timeout) or not, with retry-after honoured.
 */
#ifndef CFLUE_AGENTD_PROVIDER_H
#define CFLUE_AGENTD_PROVIDER_H

#include "buf.h"
#include "status.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#define PROVIDER_RESPONSE_MAX (16 << 20)
#define PROVIDER_TEXT_MAX (4 << 20)

struct llm_tool {
    const char *name;
    const char *description;
    const char *schema_json;
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
    const struct llm_image *images; /* user images, after the text */
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
    int64_t timeout_ms; /* the whole call, if shorter than the endpoint's timeout (0: none) */
};

struct llm_response {
    struct buf text;
    struct llm_call *calls;
    size_t n_calls;
    char stop_reason[32]; /* "end_turn", "tool_use", "max_tokens", ... as the provider said */
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

struct provider_endpoint {
    const char *base_url; /* e.g. https://api.anthropic.com */
    const char *api_key;
    int64_t timeout_ms;
};

/* llm_response_init / llm_response_cleanup manage a response. */
void llm_response_init(struct llm_response *r);
void llm_response_cleanup(struct llm_response *r);

/* llm_complete makes one model call. CF_OK with the response filled; CF_CANCELLED when
 * events->cancelled said so (the transfer is abandoned at once); CF_UNAVAILABLE (retryable
 * set when a retry may help) or CF_INVALID for provider errors, with the message in err. */
CF_MUST_CHECK enum cf_status llm_complete(const struct provider_endpoint *ep,
                                          const struct llm_request *req,
                                          const struct llm_events *events, struct llm_response *out,
                                          struct cf_error *err);

/* Provider modules: build the request body; parse a non-streamed body or one SSE event. */
json_t *anthropic_build(const struct llm_request *req);
CF_MUST_CHECK enum cf_status anthropic_parse_body(const char *body, size_t len,
                                                  struct llm_response *out, struct cf_error *err);
CF_MUST_CHECK enum cf_status anthropic_parse_event(void *state, const char *event, const char *data,
                                                   const struct llm_events *ev,
                                                   struct llm_response *out, struct cf_error *err);
void *anthropic_stream_new(void);
void anthropic_stream_free(void *state);

json_t *openai_build(const struct llm_request *req);
CF_MUST_CHECK enum cf_status openai_parse_body(const char *body, size_t len,
                                               struct llm_response *out, struct cf_error *err);
CF_MUST_CHECK enum cf_status openai_parse_event(void *state, const char *event, const char *data,
                                                const struct llm_events *ev,
                                                struct llm_response *out, struct cf_error *err);
void *openai_stream_new(void);
void openai_stream_free(void *state);

/* llm_add_call appends a tool call to the response (copies the strings). */
void llm_add_call(struct llm_response *r, const char *id, const char *name, const char *args);

#endif
