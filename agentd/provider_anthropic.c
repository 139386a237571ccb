/* provider_anthropic.c - the Anthropic Messages API wire format.
 *
 * Request: {model, max_tokens, system, messages, tools, stream}. User text and tool results are
 * user-role messages (tool results as tool_result blocks, consecutive ones merged into one
 * message; a result with images has a content array: its text block, then an image block
 * each); a user's images follow its text as image blocks; assistant messages carry text and
 * tool_use blocks. Streaming events:
 * message_start, content_block_start (text | tool_use), content_block_delta (text_delta |
 * input_json_delta), content_block_stop, message_delta (stop_reason, usage), message_stop,
 * ping, error.
 */
#include "provider.h"

#include "mem.h"

#include <stdlib.h>
#include <string.h>

/* image_blocks appends an image block (base64 source) for each of m's images to content. */
static void image_blocks(json_t *content, const struct llm_message *m)
{
    for (size_t k = 0; k < m->n_images; k++) {
        json_array_append_new(content,
                              json_pack("{s:s, s:{s:s, s:s, s:s}}", "type", "image", "source",
                                        "type", "base64", "media_type", m->images[k].mime_type,
                                        "data", m->images[k].base64));
    }
}

/* result_block is tool result m as a tool_result block: its text as the content, or, with
 * images, a content array of a text block and the images' blocks. */
static json_t *result_block(const struct llm_message *m)
{
    const char *text = m->text && *m->text ? m->text : "(empty)";
    json_t *content = json_string(text);
    if (m->n_images) {
        json_decref(content);
        content = json_pack("[{s:s, s:s}]", "type", "text", "text", text);
        image_blocks(content, m);
    }
    return json_pack("{s:s, s:s, s:o, s:b}", "type", "tool_result", "tool_use_id", m->tool_call_id,
                     "content", content, "is_error", m->is_error);
}

json_t *anthropic_build(const struct llm_request *req)
{
    json_t *msgs = json_array();
    json_t *pending_user = NULL; /* the user message being filled (results are merged) */
    for (size_t i = 0; i < req->n_messages; i++) {
        const struct llm_message *m = &req->messages[i];
        if (m->role == LLM_ASSISTANT) {
            json_t *content = json_array();
            if (m->text && *m->text) {
                json_array_append_new(content,
                                      json_pack("{s:s, s:s}", "type", "text", "text", m->text));
            }
            for (size_t k = 0; k < m->n_calls; k++) {
                json_t *input = json_loads(m->calls[k].arguments_json, 0, NULL);
                if (!json_is_object(input)) {
                    json_decref(input);
                    input = json_object();
                }
                json_array_append_new(content, json_pack("{s:s, s:s, s:s, s:o}", "type", "tool_use",
                                                         "id", m->calls[k].id, "name",
                                                         m->calls[k].name, "input", input));
            }
            if (json_array_size(content) == 0) {
                json_array_append_new(content,
                                      json_pack("{s:s, s:s}", "type", "text", "text", "(no text)"));
            }
            json_array_append_new(msgs,
                                  json_pack("{s:s, s:o}", "role", "assistant", "content", content));
            pending_user = NULL;
            continue;
        }
        if (!pending_user) {
            pending_user = json_pack("{s:s, s:[]}", "role", "user", "content");
            json_array_append_new(msgs, pending_user);
        }
        json_t *content = json_object_get(pending_user, "content");
        if (m->role == LLM_TOOL_RESULT) {
            json_array_append_new(content, result_block(m));
        } else {
            json_array_append_new(content, json_pack("{s:s, s:s}", "type", "text", "text",
                                                     m->text && *m->text ? m->text : "(empty)"));
            image_blocks(content, m);
        }
    }
    json_t *body = json_pack("{s:s, s:I, s:o, s:b}", "model", req->model, "max_tokens",
                             (json_int_t)req->max_tokens, "messages", msgs, "stream", req->stream);
    if (req->system && *req->system) {
        json_object_set_new(body, "system", json_string(req->system));
    }
    if (req->n_tools) {
        json_t *tools = json_array();
        for (size_t i = 0; i < req->n_tools; i++) {
            json_array_append_new(tools,
                                  json_pack("{s:s, s:s, s:o}", "name", req->tools[i].name,
                                            "description", req->tools[i].description,
                                            "input_schema", llm_tool_schema(&req->tools[i])));
        }
        json_object_set_new(body, "tools", tools);
    }
    return body;
}

static void usage_from(json_t *u, struct llm_response *out)
{
    llm_usage_read(u, "input_tokens", "output_tokens", out);
}

enum cf_status anthropic_parse_body(const char *body, size_t len, struct llm_response *out,
                                    struct cf_error *err)
{
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    json_t *content = json_object_get(j, "content");
    if (!json_is_array(content)) {
        json_decref(j);
        out->retryable = false;
        return cf_error_set(err, CF_INVALID,
                            "the Anthropic API sent a response that is not a message: %s",
                            j ? "no content array" : je.text);
    }
    size_t i;
    json_t *b;
    json_array_foreach(content, i, b)
    {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (type && !strcmp(type, "text")) {
            const char *t = json_string_value(json_object_get(b, "text"));
            buf_append_str(&out->text, t ? t : "");
        } else if (type && !strcmp(type, "tool_use")) {
            char *args = json_dumps(json_object_get(b, "input"), JSON_COMPACT | JSON_ENCODE_ANY);
            llm_add_call(out, json_string_value(json_object_get(b, "id")),
                         json_string_value(json_object_get(b, "name")), args);
            free(args);
        }
    }
    const char *stop = json_string_value(json_object_get(j, "stop_reason"));
    snprintf(out->stop_reason, sizeof(out->stop_reason), "%s", stop ? stop : "end_turn");
    usage_from(json_object_get(j, "usage"), out);
    json_decref(j);
    return CF_OK;
}

/* The blocks of a streamed answer, by index (grown as they come, up to
 * PROVIDER_STREAM_PARTS_MAX). */
struct astream {
    struct ablock {
        int type; /* 1 text, 2 tool_use */
        int call; /* a tool_use block's index in the answer's calls */
    } * blocks;
    size_t cap;
    struct buf args; /* partial_json of the open tool_use block */
};

void *anthropic_stream_new(void)
{
    struct astream *s = mem_alloc(sizeof(*s));
    buf_init(&s->args, PROVIDER_RESPONSE_MAX);
    return s;
}

void anthropic_stream_free(void *state)
{
    struct astream *s = state;
    if (s) {
        buf_cleanup(&s->args);
        free(s->blocks);
        free(s);
    }
}

/* block_room makes room for block i: false when i is no index a stream may use. */
static bool block_room(struct astream *s, int i)
{
    if (i < 0 || i >= PROVIDER_STREAM_PARTS_MAX) {
        return false;
    }
    if ((size_t)i >= s->cap) {
        size_t cap = s->cap ? s->cap : 16;
        while (cap <= (size_t)i) {
            cap *= 2;
        }
        s->blocks = mem_realloc(s->blocks, sizeof(*s->blocks) * cap);
        memset(s->blocks + s->cap, 0, sizeof(*s->blocks) * (cap - s->cap));
        s->cap = cap;
    }
    return true;
}

enum cf_status anthropic_parse_event(void *state, const char *event, const char *data,
                                     const struct llm_events *ev, struct llm_response *out,
                                     struct cf_error *err)
{
    struct astream *s = state;
    json_t *j = llm_event_json("Anthropic", data, err);
    enum cf_status rc = CF_OK;
    if (!j) {
        return CF_INVALID;
    }
    const char *type = json_string_value(json_object_get(j, "type"));
    if (!type) {
        type = event;
    }
    json_t *idx = json_object_get(j, "index");
    json_int_t at = json_is_integer(idx) ? json_integer_value(idx) : -1;
    int i = at >= 0 && at < PROVIDER_STREAM_PARTS_MAX ? (int)at : -1;
    if (!strncmp(type, "content_block_", 14) && !block_room(s, i)) {
        rc = cf_error_set(err, CF_INVALID,
                          "the Anthropic stream sent content block %lld; at most %d are taken",
                          (long long)at, PROVIDER_STREAM_PARTS_MAX);
    } else if (!strcmp(type, "message_start")) {
        usage_from(json_object_get(json_object_get(j, "message"), "usage"), out);
    } else if (!strcmp(type, "content_block_start")) {
        json_t *b = json_object_get(j, "content_block");
        const char *bt = json_string_value(json_object_get(b, "type"));
        if (bt && !strcmp(bt, "tool_use")) {
            s->blocks[i].type = 2;
            s->blocks[i].call = (int)out->n_calls;
            llm_add_call(out, json_string_value(json_object_get(b, "id")),
                         json_string_value(json_object_get(b, "name")), "{}");
            buf_reset(&s->args);
        } else {
            s->blocks[i].type = 1;
        }
    } else if (!strcmp(type, "content_block_delta")) {
        json_t *d = json_object_get(j, "delta");
        const char *dt = json_string_value(json_object_get(d, "type"));
        if (dt && !strcmp(dt, "text_delta")) {
            rc = llm_text_delta(out, ev, json_object_get(d, "text"), err);
        } else if (dt && !strcmp(dt, "input_json_delta")) {
            rc = llm_args_delta(&s->args, json_object_get(d, "partial_json"), err);
        }
    } else if (!strcmp(type, "content_block_stop")) {
        if (s->blocks[i].type == 2 && s->args.len) {
            struct llm_call *c = &out->calls[s->blocks[i].call];
            free(c->arguments_json);
            c->arguments_json = mem_strdup(buf_cstr(&s->args));
        }
        buf_reset(&s->args);
    } else if (!strcmp(type, "message_delta")) {
        const char *stop =
            json_string_value(json_object_get(json_object_get(j, "delta"), "stop_reason"));
        if (stop) {
            snprintf(out->stop_reason, sizeof(out->stop_reason), "%s", stop);
        }
        llm_usage_read(json_object_get(j, "usage"), NULL, "output_tokens", out);
    } else if (!strcmp(type, "error")) {
        json_t *e = json_object_get(j, "error");
        const char *et = json_string_value(json_object_get(e, "type"));
        const char *m = json_string_value(json_object_get(e, "message"));
        out->retryable = et && (!strcmp(et, "overloaded_error") || !strcmp(et, "api_error") ||
                                !strcmp(et, "rate_limit_error"));
        rc = cf_error_set(err, out->retryable ? CF_UNAVAILABLE : CF_INVALID,
                          "the Anthropic stream reported %s: %s", et ? et : "an error", m ? m : "");
    }
    json_decref(j);
    return rc;
}

const struct provider_wire anthropic_wire = {
    .name = "anthropic",
    .path = "/v1/messages",
    .auth_prefix = "x-api-key: ",
    .extra_header = "anthropic-version: 2023-06-01",
    .build = anthropic_build,
    .parse_body = anthropic_parse_body,
    .parse_event = anthropic_parse_event,
    .stream_new = anthropic_stream_new,
    .stream_free = anthropic_stream_free,
};
