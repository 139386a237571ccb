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

#include "json_write.h"
#include "mem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* image_parts writes an image_url part (a data URL) for each of m's images. */
static void image_parts(struct jw *w, const struct llm_message *m)
{
    for (size_t k = 0; k < m->n_images; k++) {
        char *url = mem_asprintf("data:%s;base64,%s", m->images[k].mime_type, m->images[k].base64);
        jw_object(w);
        jw_key_string(w, "type", "image_url");
        jw_key(w, "image_url");
        jw_object(w);
        jw_key_string(w, "url", url);
        jw_end(w);
        jw_end(w);
        free(url);
    }
}

/* results_images writes the user message that shows the images of tool results msgs[0..n) (a
 * turn's, each a role "tool" message already: those carry text only), when any has one. */
static void results_images(struct jw *w, const struct llm_message *msgs, size_t n)
{
    size_t first = 0;
    while (first < n && !msgs[first].n_images) {
        first++;
    }
    if (first == n) {
        return;
    }
    jw_object(w);
    jw_key_string(w, "role", "user");
    jw_key(w, "content");
    jw_array(w);
    llm_text_part(w, "Images returned by the tool calls above:");
    for (size_t i = first; i < n; i++) {
        if (!msgs[i].n_images) {
            continue;
        }
        char *label = mem_asprintf("From %s (call %s):", msgs[i].tool_name ? msgs[i].tool_name : "",
                                   msgs[i].tool_call_id ? msgs[i].tool_call_id : "");
        llm_text_part(w, label);
        free(label);
        image_parts(w, &msgs[i]);
    }
    jw_end(w);
    jw_end(w);
}

/* assistant_message writes assistant message m: its text and its calls, their arguments as
 * the model wrote them. Without text its content is null when it has calls, and a stand-in
 * when it has none (an empty answer: the API refuses it content both null and empty). */
static void assistant_message(struct jw *w, const struct llm_message *m)
{
    jw_object(w);
    jw_key_string(w, "role", "assistant");
    jw_key(w, "content");
    if (m->text && *m->text) {
        jw_string(w, m->text);
    } else if (m->n_calls) {
        jw_null(w);
    } else {
        jw_string(w, "(no text)");
    }
    if (m->n_calls) {
        jw_key(w, "tool_calls");
        jw_array(w);
        for (size_t k = 0; k < m->n_calls; k++) {
            jw_object(w);
            jw_key_string(w, "id", m->calls[k].id);
            jw_key_string(w, "type", "function");
            jw_key(w, "function");
            jw_object(w);
            jw_key_string(w, "name", m->calls[k].name);
            jw_key_string(w, "arguments", m->calls[k].arguments_json);
            jw_end(w);
            jw_end(w);
        }
        jw_end(w);
    }
    jw_end(w);
}

/* message writes message i of req, and after a turn's last tool result the user message with
 * the images of the turn's results. */
static void message(struct jw *w, const struct llm_request *req, size_t i)
{
    const struct llm_message *m = &req->messages[i];
    if (m->role == LLM_ASSISTANT) {
        assistant_message(w, m);
        return;
    }
    jw_object(w);
    jw_key_string(w, "role", m->role == LLM_TOOL_RESULT ? "tool" : "user");
    if (m->role == LLM_TOOL_RESULT) {
        jw_key_string(w, "tool_call_id", m->tool_call_id);
    }
    jw_key(w, "content");
    if (m->role == LLM_USER && m->n_images) {
        jw_array(w);
        llm_text_part(w, m->text ? m->text : "");
        image_parts(w, m);
        jw_end(w);
    } else {
        jw_string(w, m->text);
    }
    jw_end(w);
    /* after the turn's last result, so that the tool messages stay together right after
     * their assistant message */
    if (m->role == LLM_TOOL_RESULT && (i + 1 == req->n_messages || m[1].role != LLM_TOOL_RESULT)) {
        size_t first = i;
        while (first > 0 && req->messages[first - 1].role == LLM_TOOL_RESULT) {
            first--;
        }
        results_images(w, &req->messages[first], i + 1 - first);
    }
}

char *openai_build(const struct llm_request *req, size_t *len_out)
{
    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_object(&w);
    jw_key_string(&w, "model", req->model);
    jw_key(&w, "messages");
    jw_array(&w);
    if (req->system && *req->system) {
        jw_object(&w);
        jw_key_string(&w, "role", "system");
        jw_key_string(&w, "content", req->system);
        jw_end(&w);
    }
    for (size_t i = 0; i < req->n_messages; i++) {
        message(&w, req, i);
    }
    jw_end(&w);
    jw_key(&w, "max_tokens");
    jw_int(&w, req->max_tokens);
    jw_key(&w, "stream");
    jw_bool(&w, req->stream);
    if (req->stream) {
        jw_key(&w, "stream_options");
        jw_object(&w);
        jw_key(&w, "include_usage");
        jw_bool(&w, true);
        jw_end(&w);
    }
    if (req->n_tools) {
        jw_key(&w, "tools");
        jw_array(&w);
        for (size_t i = 0; i < req->n_tools; i++) {
            jw_object(&w);
            jw_key_string(&w, "type", "function");
            jw_key(&w, "function");
            jw_object(&w);
            jw_key_string(&w, "name", req->tools[i].name);
            jw_key_string(&w, "description", req->tools[i].description);
            jw_key(&w, "parameters");
            llm_schema_write(&w, &req->tools[i]);
            jw_end(&w);
            jw_end(&w);
        }
        jw_end(&w);
    }
    jw_end(&w);
    return jw_take(&w, len_out);
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
    enum cf_status rc = CF_OK;
    if (buf_append_str(&out->text, text ? text : "") != CF_OK) {
        rc = cf_error_set(err, CF_TOOBIG, "the model's text passed %d bytes", PROVIDER_TEXT_MAX);
    }
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(msg, "tool_calls"), i, c)
    {
        json_t *f = json_object_get(c, "function");
        if (rc == CF_OK) {
            rc = llm_add_call(out, json_string_value(json_object_get(c, "id")),
                              json_string_value(json_object_get(f, "name")),
                              json_string_value(json_object_get(f, "arguments")), err);
        }
    }
    if (rc != CF_OK) {
        json_decref(j);
        return rc;
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
        out->stream_ended = true;
        return CF_OK;
    }
    json_t *j = llm_event_json("OpenAI", data, err);
    if (!j) {
        return CF_INVALID;
    }
    enum cf_status rc = CF_OK;
    json_t *e = json_object_get(j, "error");
    if (json_is_object(e)) { /* (some servers send "error": null in every chunk) */
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
        while (out->n_calls <= idx && rc == CF_OK) {
            rc = llm_add_call(out, "", "", "{}", err);
        }
        const char *id = json_string_value(json_object_get(tc, "id"));
        const char *name = json_string_value(json_object_get(f, "name"));
        if (rc != CF_OK || (rc = llm_call_field("id", id, err)) != CF_OK ||
            (rc = llm_call_field("name", name, err)) != CF_OK) {
            break;
        }
        if (id && *id) {
            free(out->calls[idx].id);
            out->calls[idx].id = mem_strdup(id);
        }
        if (name && *name) {
            free(out->calls[idx].name);
            out->calls[idx].name = mem_strdup(name);
        }
        enum cf_status arc =
            llm_args_delta(out, args_of(s, idx), json_object_get(f, "arguments"), err);
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
