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

#include "json_write.h"
#include "mem.h"

#include <stdlib.h>
#include <string.h>

/* image_blocks writes an image block (base64 source) for each of m's images. */
static void image_blocks(struct jw *w, const struct llm_message *m)
{
    for (size_t k = 0; k < m->n_images; k++) {
        jw_object(w);
        jw_key_string(w, "type", "image");
        jw_key(w, "source");
        jw_object(w);
        jw_key_string(w, "type", "base64");
        jw_key_string(w, "media_type", m->images[k].mime_type);
        jw_key_string(w, "data", m->images[k].base64);
        jw_end(w);
        jw_end(w);
    }
}

/* result_block writes tool result m as a tool_result block: its text as the content, or, with
 * images, a content array of a text block and the images' blocks. */
static void result_block(struct jw *w, const struct llm_message *m)
{
    const char *text = m->text && *m->text ? m->text : "(empty)";
    jw_object(w);
    jw_key_string(w, "type", "tool_result");
    jw_key_string(w, "tool_use_id", m->tool_call_id);
    jw_key(w, "content");
    if (m->n_images) {
        jw_array(w);
        llm_text_part(w, text);
        image_blocks(w, m);
        jw_end(w);
    } else {
        jw_string(w, text);
    }
    jw_key(w, "is_error");
    jw_bool(w, m->is_error);
    jw_end(w);
}

/* assistant_message writes assistant message m: its text, then its calls as tool_use blocks
 * (arguments that are not a JSON object become {}). */
static void assistant_message(struct jw *w, const struct llm_message *m)
{
    bool has_text = m->text && *m->text;
    jw_object(w);
    jw_key_string(w, "role", "assistant");
    jw_key(w, "content");
    jw_array(w);
    if (has_text) {
        llm_text_part(w, m->text);
    }
    for (size_t k = 0; k < m->n_calls; k++) {
        json_t *input = json_loads(m->calls[k].arguments_json, 0, NULL);
        if (!json_is_object(input)) {
            json_decref(input);
            input = json_object();
        }
        jw_object(w);
        jw_key_string(w, "type", "tool_use");
        jw_key_string(w, "id", m->calls[k].id);
        jw_key_string(w, "name", m->calls[k].name);
        jw_key(w, "input");
        jw_json(w, input);
        jw_end(w);
        json_decref(input);
    }
    if (!has_text && !m->n_calls) {
        llm_text_part(w, "(no text)");
    }
    jw_end(w);
    jw_end(w);
}

char *anthropic_build(const struct llm_request *req, size_t *len_out)
{
    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_object(&w);
    jw_key_string(&w, "model", req->model);
    jw_key(&w, "max_tokens");
    jw_int(&w, req->max_tokens);
    jw_key(&w, "messages");
    jw_array(&w);
    bool in_user = false; /* a user message is open: the texts and results that follow join it */
    for (size_t i = 0; i < req->n_messages; i++) {
        const struct llm_message *m = &req->messages[i];
        if (m->role == LLM_ASSISTANT) {
            if (in_user) {
                jw_end(&w); /* its content */
                jw_end(&w);
                in_user = false;
            }
            assistant_message(&w, m);
            continue;
        }
        if (!in_user) {
            jw_object(&w);
            jw_key_string(&w, "role", "user");
            jw_key(&w, "content");
            jw_array(&w);
            in_user = true;
        }
        if (m->role == LLM_TOOL_RESULT) {
            result_block(&w, m);
        } else {
            llm_text_part(&w, m->text && *m->text ? m->text : "(empty)");
            image_blocks(&w, m);
        }
    }
    if (in_user) {
        jw_end(&w);
        jw_end(&w);
    }
    jw_end(&w); /* messages */
    jw_key(&w, "stream");
    jw_bool(&w, req->stream);
    if (req->system && *req->system) {
        jw_key_string(&w, "system", req->system);
    }
    if (req->n_tools) {
        jw_key(&w, "tools");
        jw_array(&w);
        for (size_t i = 0; i < req->n_tools; i++) {
            jw_object(&w);
            jw_key_string(&w, "name", req->tools[i].name);
            jw_key_string(&w, "description", req->tools[i].description);
            jw_key(&w, "input_schema");
            llm_schema_write(&w, &req->tools[i]);
            jw_end(&w);
        }
        jw_end(&w);
    }
    jw_end(&w);
    return jw_take(&w, len_out);
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
    enum cf_status rc = CF_OK;
    json_array_foreach(content, i, b)
    {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (type && !strcmp(type, "text")) {
            const char *t = json_string_value(json_object_get(b, "text"));
            if (buf_append_str(&out->text, t ? t : "") != CF_OK) {
                rc = cf_error_set(err, CF_TOOBIG, "the model's text passed %d bytes",
                                  PROVIDER_TEXT_MAX);
            }
        } else if (type && !strcmp(type, "tool_use")) {
            char *args = json_dumps(json_object_get(b, "input"), JSON_COMPACT | JSON_ENCODE_ANY);
            rc = llm_add_call(out, json_string_value(json_object_get(b, "id")),
                              json_string_value(json_object_get(b, "name")), args, err);
            free(args);
        }
        if (rc != CF_OK) {
            json_decref(j);
            return rc;
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
        int type; /* 0 not started, 1 text (or another kind), 2 tool_use */
        int call; /* a tool_use block's index in the answer's calls */
    } * blocks;
    size_t cap;
    int open;        /* the tool_use block whose arguments are streaming (-1: none) */
    struct buf args; /* its partial_json */
};

void *anthropic_stream_new(void)
{
    struct astream *s = mem_alloc(sizeof(*s));
    buf_init(&s->args, PROVIDER_RESPONSE_MAX);
    s->open = -1;
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

/* block_start takes the start of content block i (b): each index starts once, and a tool
 * call's block only once the one before it stopped (the API streams one block at a time; a
 * stream that does otherwise would mix their inputs). */
static enum cf_status block_start(struct astream *s, int i, json_t *b, struct llm_response *out,
                                  struct cf_error *err)
{
    const char *bt = json_string_value(json_object_get(b, "type"));
    bool tool = bt && !strcmp(bt, "tool_use");
    if (s->blocks[i].type) {
        return cf_error_set(err, CF_INVALID, "the Anthropic stream started content block %d twice",
                            i);
    }
    if (tool && s->open >= 0) {
        return cf_error_set(err, CF_INVALID,
                            "the Anthropic stream started tool call block %d before block %d "
                            "stopped",
                            i, s->open);
    }
    s->blocks[i].type = tool ? 2 : 1;
    if (!tool) {
        return CF_OK;
    }
    s->blocks[i].call = (int)out->n_calls;
    s->open = i;
    buf_reset(&s->args);
    return llm_add_call(out, json_string_value(json_object_get(b, "id")),
                        json_string_value(json_object_get(b, "name")), "{}", err);
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
        rc = block_start(s, i, json_object_get(j, "content_block"), out, err);
    } else if (!strcmp(type, "content_block_delta")) {
        json_t *d = json_object_get(j, "delta");
        const char *dt = json_string_value(json_object_get(d, "type"));
        if (dt && !strcmp(dt, "text_delta")) {
            rc = llm_text_delta(out, ev, json_object_get(d, "text"), err);
        } else if (dt && !strcmp(dt, "input_json_delta") && i == s->open) {
            rc = llm_args_delta(out, &s->args, json_object_get(d, "partial_json"), err);
        } else if (dt && !strcmp(dt, "input_json_delta") && s->blocks[i].type == 2) {
            rc = cf_error_set(err, CF_INVALID,
                              "the Anthropic stream sent tool input for block %d, a tool call "
                              "that is not the one streaming",
                              i);
        } /* (the input of a block of another kind, a server tool's, is not ours to run) */
    } else if (!strcmp(type, "content_block_stop")) {
        if (i == s->open && s->args.len) {
            struct llm_call *c = &out->calls[s->blocks[i].call];
            free(c->arguments_json);
            c->arguments_json = mem_strdup(buf_cstr(&s->args));
        }
        if (i == s->open) {
            s->open = -1;
            buf_reset(&s->args);
        }
    } else if (!strcmp(type, "message_stop")) {
        out->stream_ended = true;
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
