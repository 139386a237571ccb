/* provider_openai.c - the OpenAI Chat Completions wire format (and compatible servers).
 *
 * Request: {model, messages (system first; assistant tool_calls; role "tool" results, text
 * only, so the images of one turn's results follow them in one user message; a user's images
 * as image_url parts with data URLs),
 * tools [{type: function, function: {name, description, parameters}}], max_tokens, stream,
 * stream_options.include_usage}. Streaming: "data: {chat.completion.chunk}" lines with
 * choices[0].delta.content and delta.tool_calls pieces keyed by index, finish_reason, a usage
 * chunk, then "data: [DONE]".
 */
#include "provider.h"

#include "mem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* image_parts appends an image_url part (a data URL) for each of m's images to parts. */
static void image_parts(json_t *parts, const struct llm_message *m)
{
    for (size_t k = 0; k < m->n_images; k++) {
        char *url = mem_asprintf("data:%s;base64,%s", m->images[k].mime_type, m->images[k].base64);
        json_array_append_new(
            parts, json_pack("{s:s, s:{s:s}}", "type", "image_url", "image_url", "url", url));
        free(url);
    }
}

/* results_images is the user message that shows the images of tool results msgs[0..n) (a
 * turn's, each a role "tool" message already: those carry text only), or NULL when none has
 * any. */
static json_t *results_images(const struct llm_message *msgs, size_t n)
{
    json_t *parts = NULL;
    for (size_t i = 0; i < n; i++) {
        if (!msgs[i].n_images) {
            continue;
        }
        if (!parts) {
            parts = json_pack("[{s:s, s:s}]", "type", "text", "text",
                              "Images returned by the tool calls above:");
        }
        char *label = mem_asprintf("From %s (call %s):", msgs[i].tool_name ? msgs[i].tool_name : "",
                                   msgs[i].tool_call_id ? msgs[i].tool_call_id : "");
        json_array_append_new(parts, json_pack("{s:s, s:s}", "type", "text", "text", label));
        free(label);
        image_parts(parts, &msgs[i]);
    }
    return parts ? json_pack("{s:s, s:o}", "role", "user", "content", parts) : NULL;
}

json_t *openai_build(const struct llm_request *req)
{
    json_t *msgs = json_array();
    if (req->system && *req->system) {
        json_array_append_new(msgs,
                              json_pack("{s:s, s:s}", "role", "system", "content", req->system));
    }
    for (size_t i = 0; i < req->n_messages; i++) {
        const struct llm_message *m = &req->messages[i];
        if (m->role == LLM_USER && m->n_images) {
            json_t *parts = json_array();
            json_array_append_new(
                parts, json_pack("{s:s, s:s}", "type", "text", "text", m->text ? m->text : ""));
            image_parts(parts, m);
            json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", "user", "content", parts));
        } else if (m->role == LLM_USER) {
            json_array_append_new(
                msgs, json_pack("{s:s, s:s}", "role", "user", "content", m->text ? m->text : ""));
        } else if (m->role == LLM_TOOL_RESULT) {
            json_array_append_new(msgs,
                                  json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id",
                                            m->tool_call_id, "content", m->text ? m->text : ""));
            /* after the turn's last result, so that the tool messages stay together right
             * after their assistant message */
            if (i + 1 == req->n_messages || m[1].role != LLM_TOOL_RESULT) {
                size_t first = i;
                while (first > 0 && req->messages[first - 1].role == LLM_TOOL_RESULT) {
                    first--;
                }
                json_t *shown = results_images(&req->messages[first], i + 1 - first);
                if (shown) {
                    json_array_append_new(msgs, shown);
                }
            }
        } else {
            json_t *a = json_pack("{s:s}", "role", "assistant");
            json_object_set_new(a, "content",
                                m->text && *m->text ? json_string(m->text) : json_null());
            if (m->n_calls) {
                json_t *calls = json_array();
                for (size_t k = 0; k < m->n_calls; k++) {
                    json_array_append_new(
                        calls, json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", m->calls[k].id, "type",
                                         "function", "function", "name", m->calls[k].name,
                                         "arguments", m->calls[k].arguments_json));
                }
                json_object_set_new(a, "tool_calls", calls);
            }
            json_array_append_new(msgs, a);
        }
    }
    json_t *body = json_pack("{s:s, s:o, s:I, s:b}", "model", req->model, "messages", msgs,
                             "max_tokens", (json_int_t)req->max_tokens, "stream", req->stream);
    if (req->stream) {
        json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    if (req->n_tools) {
        json_t *tools = json_array();
        for (size_t i = 0; i < req->n_tools; i++) {
            json_array_append_new(tools, json_pack("{s:s, s:{s:s, s:s, s:o}}", "type", "function",
                                                   "function", "name", req->tools[i].name,
                                                   "description", req->tools[i].description,
                                                   "parameters", llm_tool_schema(&req->tools[i])));
        }
        json_object_set_new(body, "tools", tools);
    }
    return body;
}

static void usage_from(json_t *u, struct llm_response *out)
{
    llm_usage_read(u, "prompt_tokens", "completion_tokens", out);
}

static void set_stop(struct llm_response *out, const char *finish)
{
    /* normalize to the Anthropic-style names the turn loop uses */
    const char *s = !strcmp(finish, "tool_calls") || !strcmp(finish, "function_call") ? "tool_use"
                    : !strcmp(finish, "length")                                       ? "max_tokens"
                    : !strcmp(finish, "stop")                                         ? "end_turn"
                                                                                      : finish;
    snprintf(out->stop_reason, sizeof(out->stop_reason), "%s", s);
}

enum cf_status openai_parse_body(const char *body, size_t len, struct llm_response *out,
                                 struct cf_error *err)
{
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    if (!json_is_object(msg)) {
        json_decref(j);
        return cf_error_set(err, CF_INVALID,
                            "the OpenAI-compatible API sent a response without a message: %s",
                            j ? "no choices[0].message" : je.text);
    }
    const char *text = json_string_value(json_object_get(msg, "content"));
    buf_append_str(&out->text, text ? text : "");
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(msg, "tool_calls"), i, c)
    {
        json_t *f = json_object_get(c, "function");
        llm_add_call(out, json_string_value(json_object_get(c, "id")),
                     json_string_value(json_object_get(f, "name")),
                     json_string_value(json_object_get(f, "arguments")));
    }
    const char *finish = json_string_value(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason"));
    set_stop(out, finish ? finish : "stop");
    usage_from(json_object_get(j, "usage"), out);
    json_decref(j);
    return CF_OK;
}

/* The argument pieces of a streamed answer's tool calls, by index (grown as they come, up to
 * PROVIDER_STREAM_PARTS_MAX). */
struct ostream {
    struct buf *args;
    size_t n_args;
    bool done;
};

void *openai_stream_new(void)
{
    struct ostream *s = mem_alloc(sizeof(*s));
    memset(s, 0, sizeof(*s));
    return s;
}

void openai_stream_free(void *state)
{
    struct ostream *s = state;
    if (s) {
        for (size_t i = 0; i < s->n_args; i++) {
            buf_cleanup(&s->args[i]);
        }
        free(s->args);
        free(s);
    }
}

/* args_of: the pieces of call idx (< PROVIDER_STREAM_PARTS_MAX), made when new. */
static struct buf *args_of(struct ostream *s, size_t idx)
{
    if (idx >= s->n_args) {
        s->args = mem_realloc(s->args, sizeof(*s->args) * (idx + 1));
        for (size_t i = s->n_args; i <= idx; i++) {
            buf_init(&s->args[i], PROVIDER_RESPONSE_MAX);
        }
        s->n_args = idx + 1;
    }
    return &s->args[idx];
}

/* flush_args moves the accumulated argument pieces into the calls. */
static void flush_args(struct ostream *s, struct llm_response *out)
{
    for (size_t i = 0; i < out->n_calls && i < s->n_args; i++) {
        free(out->calls[i].arguments_json);
        out->calls[i].arguments_json = mem_strdup(s->args[i].len ? buf_cstr(&s->args[i]) : "{}");
    }
}

enum cf_status openai_parse_event(void *state, const char *event, const char *data,
                                  const struct llm_events *ev, struct llm_response *out,
                                  struct cf_error *err)
{
    struct ostream *s = state;
    if (!strcmp(data, "[DONE]")) {
        flush_args(s, out);
        if (!out->stop_reason[0]) {
            set_stop(out, out->n_calls ? "tool_calls" : "stop");
        }
        s->done = true;
        return CF_OK;
    }
    json_t *j = llm_event_json("OpenAI", data, err);
    if (!j) {
        return CF_INVALID;
    }
    enum cf_status rc = CF_OK;
    json_t *e = json_object_get(j, "error");
    if (e) {
        const char *m = json_string_value(json_object_get(e, "message"));
        out->retryable = true;
        rc = cf_error_set(err, CF_UNAVAILABLE, "the OpenAI stream reported an error: %s",
                          m ? m : "");
        json_decref(j);
        return rc;
    }
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    json_t *delta = json_object_get(choice, "delta");
    rc = llm_text_delta(out, ev, json_object_get(delta, "content"), err);
    size_t i;
    json_t *tc;
    json_array_foreach(json_object_get(delta, "tool_calls"), i, tc)
    {
        json_t *jidx = json_object_get(tc, "index");
        size_t idx = json_is_integer(jidx) ? (size_t)json_integer_value(jidx) : i;
        if (idx >= PROVIDER_STREAM_PARTS_MAX) {
            rc = cf_error_set(err, CF_INVALID, "the model made more than %d tool calls",
                              PROVIDER_STREAM_PARTS_MAX);
            break;
        }
        json_t *f = json_object_get(tc, "function");
        while (out->n_calls <= idx) {
            llm_add_call(out, "", "", "{}");
        }
        const char *id = json_string_value(json_object_get(tc, "id"));
        const char *name = json_string_value(json_object_get(f, "name"));
        if (id && *id) {
            free(out->calls[idx].id);
            out->calls[idx].id = mem_strdup(id);
        }
        if (name && *name) {
            free(out->calls[idx].name);
            out->calls[idx].name = mem_strdup(name);
        }
        enum cf_status arc = llm_args_delta(args_of(s, idx), json_object_get(f, "arguments"), err);
        if (arc != CF_OK) {
            rc = arc;
        }
    }
    const char *finish = json_string_value(json_object_get(choice, "finish_reason"));
    if (finish) {
        set_stop(out, finish);
        flush_args(s, out);
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        usage_from(u, out);
    }
    json_decref(j);
    (void)event;
    return rc;
}

const struct provider_wire openai_wire = {
    .name = "openai",
    .path = "/v1/chat/completions",
    .auth_prefix = "authorization: Bearer ",
    .extra_header = NULL,
    .build = openai_build,
    .parse_body = openai_parse_body,
    .parse_event = openai_parse_event,
    .stream_new = openai_stream_new,
    .stream_free = openai_stream_free,
};
