/* provider.c - the HTTP side of a model call, shared by every provider: the request (URL,
 * headers, body), streaming (SSE) and whole answers, error classification, and the two ways to
 * wait for the answer (llm_start's callback, llm_complete's condition variable). The transfer
 * itself runs on model_io's event loop, over a kept-alive connection. A call started while the
 * thread has a current trace (a drive's) sends it as `traceparent` (a new parent-id for each
 * request, so each try is a span of its own) and `tracestate`. */
#include "provider.h"

#include "clock.h"
#include "ids.h"
#include "json_write.h"
#include "log.h"
#include "mem.h"
#include "model_io.h"
#include "sse.h"
#include "trace.h"
#include "utf8.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

void llm_response_init(struct llm_response *r)
{
    memset(r, 0, sizeof(*r));
    buf_init(&r->text, PROVIDER_TEXT_MAX);
}

void llm_response_cleanup(struct llm_response *r)
{
    buf_cleanup(&r->text);
    for (size_t i = 0; i < r->n_calls; i++) {
        free(r->calls[i].id);
        free(r->calls[i].name);
        free(r->calls[i].arguments_json);
    }
    free(r->calls);
    r->calls = NULL;
    r->n_calls = 0;
}

enum cf_status llm_call_field(const char *what, const char *s, struct cf_error *err)
{
    if (s && strlen(s) > LLM_CALL_FIELD_MAX) {
        return cf_error_set(err, CF_INVALID, "the model's answer has a tool call %s of %zu bytes",
                            what, strlen(s));
    }
    return CF_OK;
}

enum cf_status llm_add_call(struct llm_response *r, const char *id, const char *name,
                            const char *args, struct cf_error *err)
{
    enum cf_status rc;
    if (r->n_calls >= PROVIDER_STREAM_PARTS_MAX) {
        return cf_error_set(err, CF_INVALID, "the model made more than %d tool calls",
                            PROVIDER_STREAM_PARTS_MAX);
    }
    if ((rc = llm_call_field("id", id, err)) != CF_OK ||
        (rc = llm_call_field("name", name, err)) != CF_OK) {
        return rc;
    }
    r->calls = mem_realloc(r->calls, sizeof(*r->calls) * (r->n_calls + 1));
    r->calls[r->n_calls].id = mem_strdup(id ? id : "");
    r->calls[r->n_calls].name = mem_strdup(name ? name : "");
    r->calls[r->n_calls].arguments_json = mem_strdup(args && *args ? args : "{}");
    r->n_calls++;
    return CF_OK;
}

/* answer_mend makes a whole answer one storaged takes and the provider can be shown again:
 * each call with an id of its own (a call without one, or repeating an earlier one's, gets a
 * new one: storaged refuses the answer otherwise, and the input held with it), the token
 * counts within 0..LLM_TOKENS_MAX. A call without a name is a bad answer (CF_INVALID, asked
 * again): no tool can be found for it. */
static enum cf_status answer_mend(struct llm_response *out, const char *who, struct cf_error *err)
{
    for (size_t i = 0; i < out->n_calls; i++) {
        struct llm_call *c = &out->calls[i];
        if (!c->name[0]) {
            out->retryable = true;
            return cf_error_set(err, CF_INVALID,
                                "the %s API answered with a tool call that has no name", who);
        }
        bool repeated = false;
        for (size_t k = 0; k < i && !repeated; k++) {
            repeated = !strcmp(out->calls[k].id, c->id);
        }
        if (!c->id[0] || repeated) {
            char id[IDS_MAX];
            ids_new(id, "call");
            free(c->id);
            c->id = mem_strdup(id);
        }
    }
    int64_t *counts[] = {&out->input_tokens, &out->output_tokens};
    for (size_t i = 0; i < 2; i++) {
        *counts[i] = *counts[i] < 0 ? 0 : *counts[i] > LLM_TOKENS_MAX ? LLM_TOKENS_MAX : *counts[i];
    }
    return CF_OK;
}

/* ---------- helpers for the provider modules ---------- */

const struct provider_wire *provider_wire_find(const char *provider)
{
    static const struct provider_wire *const wires[] = {&anthropic_wire, &openai_wire};
    for (size_t i = 0; i < sizeof(wires) / sizeof(wires[0]); i++) {
        if (provider && !strcmp(provider, wires[i]->name)) {
            return wires[i];
        }
    }
    return NULL;
}

json_t *llm_event_json(const char *who, const char *data, struct cf_error *err)
{
    json_error_t je;
    json_t *j = json_loads(data, 0, &je);
    if (!j) {
        cf_error_set(err, CF_INVALID, "the %s stream sent invalid JSON (%s): %.80s", who, je.text,
                     data);
    }
    return j;
}

/* answer_room refuses n more bytes of a streamed answer's text or arguments past
 * PROVIDER_RESPONSE_MAX (CF_TOOBIG, err set). */
static enum cf_status answer_room(const struct llm_response *out, size_t n, struct cf_error *err)
{
    if (out->args_bytes + out->text.len + n > PROVIDER_RESPONSE_MAX) {
        return cf_error_set(err, CF_TOOBIG,
                            "the model's answer passed %d bytes (its text and tool call "
                            "arguments together)",
                            PROVIDER_RESPONSE_MAX);
    }
    return CF_OK;
}

enum cf_status llm_text_delta(struct llm_response *out, const struct llm_events *ev, json_t *piece,
                              struct cf_error *err)
{
    const char *p = json_string_value(piece);
    size_t n = json_string_length(piece);
    if (!p || !n) {
        return CF_OK;
    }
    if (answer_room(out, n, err) != CF_OK) {
        return CF_TOOBIG;
    }
    if (buf_append(&out->text, p, n) != CF_OK) {
        return cf_error_set(err, CF_TOOBIG, "the model's text passed %d bytes", PROVIDER_TEXT_MAX);
    }
    if (ev && ev->on_text) {
        ev->on_text(ev->ctx, p, n);
    }
    return CF_OK;
}

enum cf_status llm_args_delta(struct llm_response *out, struct buf *args, json_t *piece,
                              struct cf_error *err)
{
    size_t n = json_string_length(piece);
    if (!json_is_string(piece)) {
        return CF_OK;
    }
    if (answer_room(out, n, err) != CF_OK) {
        return CF_TOOBIG;
    }
    if (buf_append(args, json_string_value(piece), n) != CF_OK) {
        return cf_error_set(err, CF_TOOBIG, "a tool call's arguments passed %zu bytes", args->max);
    }
    out->args_bytes += n;
    return CF_OK;
}

void llm_schema_write(struct jw *w, const struct llm_tool *t)
{
    if (t->schema_text) {
        jw_raw(w, t->schema_text);
        return;
    }
    char *text = llm_schema_text(t->schema_json);
    jw_raw(w, text);
    free(text);
}

void llm_text_part(struct jw *w, const char *text)
{
    jw_object(w);
    jw_key_string(w, "type", "text");
    jw_key_string(w, "text", text);
    jw_end(w);
}

static struct schema_entry {
    uint64_t hash;
    char *json; /* the text asked for */
    char *text; /* its answer */
} schema_cache[LLM_SCHEMA_CACHE_MAX];
static size_t schema_next; /* the slot replaced next, once the cache is full */
static pthread_mutex_t schema_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    }
    return h;
}

char *llm_schema_text(const char *schema_json)
{
    const char *json = schema_json ? schema_json : "";
    uint64_t hash = fnv1a(json);
    char *text = NULL;
    pthread_mutex_lock(&schema_mu);
    for (size_t i = 0; i < LLM_SCHEMA_CACHE_MAX && !text && schema_cache[i].json; i++) {
        if (schema_cache[i].hash == hash && !strcmp(schema_cache[i].json, json)) {
            text = mem_strdup(schema_cache[i].text);
        }
    }
    pthread_mutex_unlock(&schema_mu);
    if (text) {
        return text;
    }
    json_t *schema = json_loads(json, 0, NULL);
    text = json_is_object(schema) ? json_dumps(schema, JSON_COMPACT) : NULL;
    json_decref(schema);
    if (!text) {
        text = mem_strdup("{}");
    }
    pthread_mutex_lock(&schema_mu);
    struct schema_entry *e = &schema_cache[schema_next];
    schema_next = (schema_next + 1) % LLM_SCHEMA_CACHE_MAX;
    free(e->json);
    free(e->text);
    *e = (struct schema_entry){hash, mem_strdup(json), mem_strdup(text)};
    pthread_mutex_unlock(&schema_mu);
    return text;
}

void llm_usage_read(json_t *usage, const char *in_key, const char *out_key,
                    struct llm_response *out)
{
    json_t *in = json_object_get(usage, in_key), *o = json_object_get(usage, out_key);
    if (json_is_integer(in)) {
        out->input_tokens = json_integer_value(in);
    }
    if (json_is_integer(o)) {
        out->output_tokens = json_integer_value(o);
    }
}

/* ---------- one call: state on the model I/O loop ---------- */

struct call {
    const struct provider_wire *wire;
    bool stream;
    const struct llm_events *ev;
    struct llm_response *out;
    llm_done_fn done;
    void *done_ctx;
    char *url;
    struct buf body; /* whole body when not streaming, or an error body */
    struct sse sse;
    void *stream_state;
    long status;
    int64_t retry_after_ms;
    enum cf_status parse_rc;
    struct cf_error parse_err;
    bool not_sse;        /* a 2xx answer to a streaming request that is not text/event-stream */
    const char *api_key; /* the endpoint's (it outlives the call), kept out of every error */
    /* a stream's progress, on the loop thread: when its headers or an event with content
     * last came (a keep-alive is none), the stall bound (--model-stall-ms), and when the
     * stream's last event came (the transfer ends at most STREAM_LINGER_MS later) */
    int64_t progress_ms, stall_ms, ended_ms;
    int64_t limit_ms; /* when the request's timeout_ms (the work's time limit) runs out, or 0 */
    bool stalled;     /* ended for want of content (KEEPALIVE_ONLY_TIMES x stall_ms) */
    bool lingered;    /* ended after the last event, the server keeping the connection */
};

/* How long a stream's transfer may go on after its last event (message_stop, [DONE]) before
 * it is ended: the server should end the response there (a kept-alive connection is only
 * kept when it does). */
#define STREAM_LINGER_MS 1000
/* A stream whose server sends keep-alives (SSE comments, Anthropic's pings) but no content
 * is given up after this many times the stall bound (libcurl's speed bound counts their bytes):
 * long enough for a provider that buffers a long tool input (pinging meanwhile) or a reasoning
 * model queued behind a proxy, short of holding a try for the whole model timeout. */
#define KEEPALIVE_ONLY_TIMES 5
/* An error answer's body kept to read its message: the rest is not needed */
#define ERROR_BODY_MAX (64 * 1024)

static void call_free(struct call *c)
{
    free(c->url);
    buf_cleanup(&c->body);
    sse_cleanup(&c->sse);
    c->wire->stream_free(c->stream_state);
    free(c);
}

int64_t llm_retry_after_ms(const char *value, time_t now)
{
    const char *v = value + strspn(value, " \t");
    char *end;
    if (*v >= '0' && *v <= '9') {
        /* delay-seconds (a fraction, which some servers send, is taken too) */
        double secs = strtod(v, &end);
        end += strspn(end, " \t\r\n");
        if (*end) {
            return 0;
        }
        return secs * 1000 < (double)LLM_RETRY_AFTER_MAX_MS ? (int64_t)(secs * 1000)
                                                            : LLM_RETRY_AFTER_MAX_MS;
    }
    time_t at = curl_getdate(v, NULL); /* an HTTP-date */
    if (at == (time_t)-1 || at <= now) {
        return 0;
    }
    int64_t ms = ((int64_t)at - (int64_t)now) * 1000;
    return ms < LLM_RETRY_AFTER_MAX_MS ? ms : LLM_RETRY_AFTER_MAX_MS;
}

static bool on_sse(void *ctx, const char *event, const char *data)
{
    struct call *c = ctx;
    if (!event || strcmp(event, "ping") != 0) {
        c->progress_ms = clock_mono_ms(); /* content (a ping is a keep-alive) */
    }
    enum cf_status rc =
        c->wire->parse_event(c->stream_state, event, data, c->ev, c->out, &c->parse_err);
    if (rc != CF_OK) {
        c->parse_rc = rc;
        return false;
    }
    if (c->out->stream_ended && !c->ended_ms) {
        c->ended_ms = clock_mono_ms();
    }
    return true;
}

static bool on_header(void *ctx, const char *p, size_t len)
{
    struct call *c = ctx;
    if (len > 5 && !strncmp(p, "HTTP/", 5)) {
        /* a new status line (after a 100 Continue, say) starts the headers over */
        const char *sp = memchr(p, ' ', len);
        c->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        c->not_sse = false;
        c->retry_after_ms = 0;
        c->progress_ms = clock_mono_ms(); /* the answer has begun: its content is waited for */
    } else if (len > 13 && !strncasecmp(p, "content-type:", 13)) {
        c->not_sse = !memmem(p, len, "text/event-stream", 17);
    } else if (len > 12 && !strncasecmp(p, "retry-after:", 12)) {
        char v[64];
        snprintf(v, sizeof(v), "%.*s", (int)(len - 12), p + 12);
        c->retry_after_ms = llm_retry_after_ms(v, time(NULL));
    }
    return true;
}

static bool on_body(void *ctx, const char *p, size_t len)
{
    struct call *c = ctx;
    if (c->stream && c->status >= 200 && c->status < 300 && !c->not_sse) {
        if (!sse_feed(&c->sse, p, len)) {
            if (c->parse_rc == CF_OK) {
                c->parse_rc = cf_error_set(&c->parse_err, CF_INVALID,
                                           "the provider's event stream has a line over %d bytes",
                                           PROVIDER_RESPONSE_MAX);
            }
            return false;
        }
        return true;
    }
    if (c->status < 200 || c->status >= 300) {
        /* an error's message is near its start: a long body (an HTML page) is not kept whole,
         * and its status still decides whether a retry may mend it */
        size_t room = c->body.len < ERROR_BODY_MAX ? ERROR_BODY_MAX - c->body.len : 0;
        (void)buf_append(&c->body, p, len < room ? len : room);
        return true;
    }
    if (buf_append(&c->body, p, len) != CF_OK) {
        c->parse_rc = cf_error_set(&c->parse_err, CF_TOOBIG, "the %s API's answer passed %d bytes",
                                   c->wire->name, PROVIDER_RESPONSE_MAX);
        return false;
    }
    return true;
}

/* on_cancelled ends a transfer the drive gave up, an event stream whose server sends
 * keep-alives but no content for KEEPALIVE_ONLY_TIMES x stall_ms (libcurl's speed bound counts
 * their bytes), and one whose server keeps it open past its last event. */
static bool on_cancelled(void *ctx)
{
    struct call *c = ctx;
    int64_t now = clock_mono_ms();
    if (c->ended_ms) {
        c->lingered = now - c->ended_ms >= STREAM_LINGER_MS;
        if (c->lingered) {
            return true;
        }
    } else if (c->stall_ms > 0 && c->progress_ms && c->status >= 200 && c->status < 300 &&
               !c->not_sse && now - c->progress_ms >= KEEPALIVE_ONLY_TIMES * c->stall_ms) {
        c->stalled = true;
        return true;
    }
    return c->ev && c->ev->cancelled && c->ev->cancelled(c->ev->ctx);
}

/* overflow_said: an error (its message, and its code or type when it has them) in which the
 * provider says the request is over the model's context: Anthropic's "prompt is too long" and
 * "input length and `max_tokens` exceed context limit", OpenAI's code context_length_exceeded
 * ("This model's maximum context length is ..."), llama.cpp's "exceeds the available context
 * size", Gemini's "input token count ... exceeds the maximum number of tokens"; not one that
 * only has such a word (a schema's "maximum"). */
static bool overflow_said(const char *msg, const char *code, const char *type)
{
    static const char *const said[] = {"prompt is too long", "prompt length", "context length",
                                       "context limit",      "context size",  "context window",
                                       "context_length",     "exceed_context"};
    const char *const texts[] = {msg, code ? code : "", type ? type : ""};
    for (size_t t = 0; t < 3; t++) {
        for (size_t i = 0; i < sizeof(said) / sizeof(said[0]); i++) {
            if (strcasestr(texts[t], said[i])) {
                return true;
            }
        }
    }
    /* "exceed" with "token" only of the input (not a max_tokens that passes the model's
     * output limit: compacting mends nothing there) */
    bool input =
        strcasestr(msg, "input") || strcasestr(msg, "prompt") || strcasestr(msg, "context");
    bool output = strcasestr(msg, "max_tokens") || strcasestr(msg, "max_completion_tokens") ||
                  strcasestr(msg, "output") || strcasestr(msg, "completion");
    return strcasestr(msg, "exceed") && strcasestr(msg, "token") && input && !output;
}

/* classify turns an HTTP error answer into a status and message. */
static enum cf_status classify(struct call *c, struct cf_error *err)
{
    long s = c->status;
    const char *who = c->wire->name;
    char msg[300] = "";
    json_t *j = json_loads(buf_cstr(&c->body), 0, NULL), *e = json_object_get(j, "error");
    const char *m = json_string_value(json_object_get(e, "message"));
    m = m ? m : (c->body.len ? "(no error message)" : "(empty body)");
    snprintf(msg, sizeof(msg), "%.*s", (int)utf8_prefix_len(m, strlen(m), sizeof(msg) - 1), m);
    struct llm_response *out = c->out;
    out->http_status = (int)s;
    out->retry_after_ms = c->retry_after_ms;
    out->retryable = s == 408 || s == 409 || s == 429 || s >= 500;
    /* 413: the request is too large (bytes): compacting the context mends it too */
    out->context_overflow =
        s == 413 || (s == 400 && overflow_said(msg, json_string_value(json_object_get(e, "code")),
                                               json_string_value(json_object_get(e, "type"))));
    json_decref(j);
    if (s == 401 || s == 403) {
        return cf_error_set(err, CF_INVALID,
                            "the %s API refused the credentials (HTTP %ld): %s; check the API key",
                            who, s, msg);
    }
    return cf_error_set(err, out->retryable ? CF_UNAVAILABLE : CF_INVALID,
                        "the %s API answered HTTP %ld: %s", who, s, msg);
}

/* body_error: a 2xx body that is an error (`{"error": {...}}`, as a provider overloaded
 * answers a streaming request now and then): true, err set, retryable unless the error says
 * the request itself is wrong. */
static bool body_error(struct call *c, struct cf_error *err)
{
    json_t *j = json_loads(buf_cstr(&c->body), 0, NULL);
    json_t *e = json_object_get(j, "error");
    if (!json_is_object(e)) {
        json_decref(j);
        return false;
    }
    const char *type = json_string_value(json_object_get(e, "type"));
    const char *m = json_string_value(json_object_get(e, "message"));
    c->out->retryable = !type || !strstr(type, "invalid_request");
    cf_error_set(err, c->out->retryable ? CF_UNAVAILABLE : CF_INVALID,
                 "the %s API answered with an error: %s%s%.300s", c->wire->name, type ? type : "",
                 type && m ? ": " : "", m ? m : "");
    json_decref(j);
    return true;
}

/* verdict decides what a finished transfer means for the call. */
static enum cf_status verdict(struct call *c, const struct model_io_result *res,
                              struct cf_error *err)
{
    struct llm_response *out = c->out;
    const char *who = c->wire->name;
    if (c->stalled) {
        out->retryable = true;
        return cf_error_set(err, CF_UNAVAILABLE,
                            "the %s stream sent nothing but keep-alives for %lld ms", who,
                            (long long)(KEEPALIVE_ONLY_TIMES * c->stall_ms));
    }
    if (res->status == CF_CANCELLED && !c->lingered) {
        return cf_error_set(err, CF_CANCELLED, "the model call was cancelled (%s)", res->err.msg);
    }
    if (res->status == CF_DEADLINE && c->limit_ms && clock_mono_ms() >= c->limit_ms - 100 &&
        !out->stream_ended) {
        out->retryable = false;
        return cf_error_set(err, CF_DEADLINE, "the work's time limit came during the model call");
    }
    if (c->parse_rc != CF_OK) {
        /* the provider said what went wrong in its stream (an overload may be retried), or
         * the stream was broken, which a retry will not mend */
        *err = c->parse_err;
        out->retryable = out->retryable && c->parse_rc == CF_UNAVAILABLE;
        return c->parse_rc;
    }
    bool whole_stream =
        c->stream && !c->not_sse && out->stream_ended && c->status >= 200 && c->status < 300;
    if (res->status != CF_OK && !whole_stream) {
        /* (a connection that breaks after the stream's last event lost nothing: the answer
         * stands, rather than being asked for again) */
        out->retryable = true;
        if (c->status) {
            return cf_error_set(err, CF_UNAVAILABLE,
                                "the connection to the %s API broke during the answer: %s", who,
                                res->err.msg);
        }
        return cf_error_set(err, CF_UNAVAILABLE, "the %s API could not be reached at %s: %s", who,
                            c->url, res->err.msg);
    }
    if (c->status < 200 || c->status >= 300) {
        return classify(c, err);
    }
    if (!c->stream || c->not_sse) {
        /* to a streaming request, a whole JSON message is acceptable; anything else is a
         * broken provider, which a retry will not mend */
        if (body_error(c, err)) {
            return CF_UNAVAILABLE;
        }
        enum cf_status rc = c->wire->parse_body(buf_cstr(&c->body), c->body.len, out, err);
        if (c->stream) {
            out->retryable = false;
        }
        return rc == CF_OK ? answer_mend(out, who, err) : rc;
    }
    if (!out->stop_reason[0]) {
        out->retryable = true;
        return cf_error_set(err, CF_UNAVAILABLE,
                            "the %s stream ended before the message was complete", who);
    }
    return answer_mend(out, who, err);
}

/* redact replaces each occurrence of key in err's message with "[redacted]": a provider that
 * quotes the credential it refused must not have it logged or recorded. */
static void redact(struct cf_error *err, const char *key)
{
    size_t klen = key ? strlen(key) : 0;
    if (klen < 4 || !strstr(err->msg, key)) {
        return;
    }
    char out[sizeof(err->msg)];
    size_t o = 0;
    for (const char *p = err->msg; *p && o + 1 < sizeof(out);) {
        if (!strncmp(p, key, klen)) {
            o += (size_t)snprintf(out + o, sizeof(out) - o, "[redacted]");
            o = o < sizeof(out) ? o : sizeof(out) - 1;
            p += klen;
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = '\0';
    memcpy(err->msg, out, o + 1);
}

static void on_done(void *ctx, const struct model_io_result *res)
{
    struct call *c = ctx;
    struct cf_error err;
    cf_error_clear(&err);
    enum cf_status rc = verdict(c, res, &err);
    redact(&err, c->api_key);
    llm_done_fn done = c->done;
    void *done_ctx = c->done_ctx;
    call_free(c);
    done(done_ctx, rc, &err);
}

/* request_url joins the base URL and the wire's path, not repeating a /v1 the base ends
 * with (OpenAI-compatible base URLs usually carry it). */
static char *request_url(const char *base, const char *path)
{
    size_t blen = strlen(base);
    while (blen && base[blen - 1] == '/') {
        blen--;
    }
    if (blen >= 3 && !strncmp(base + blen - 3, "/v1", 3) && !strncmp(path, "/v1/", 4)) {
        path += 3;
    }
    return mem_asprintf("%.*s%s", (int)blen, base, path);
}

enum cf_status llm_start(const struct provider_endpoint *ep, const struct llm_request *req,
                         const struct llm_events *ev, struct llm_response *out, llm_done_fn done,
                         void *done_ctx, uint64_t *out_id, struct cf_error *err)
{
    const struct provider_wire *wire = provider_wire_find(req->provider);
    if (!wire) {
        return cf_error_set(err, CF_INVALID, "unknown model provider '%s'",
                            req->provider ? req->provider : "");
    }
    size_t payload_len = 0;
    char *payload = wire->build(req, &payload_len);
    if (!payload) {
        return cf_error_set(err, CF_INVALID, "the request to the %s API could not be encoded",
                            wire->name);
    }
    struct call *c = mem_alloc(sizeof(*c));
    c->wire = wire;
    c->stream = req->stream;
    c->ev = ev;
    c->out = out;
    c->done = done;
    c->done_ctx = done_ctx;
    c->url = request_url(ep->base_url, wire->path);
    c->api_key = ep->api_key;
    c->stall_ms = req->stream ? (ep->stall_ms > 0 ? ep->stall_ms : PROVIDER_STALL_MS) : 0;
    buf_init(&c->body, PROVIDER_RESPONSE_MAX);
    sse_init(&c->sse, PROVIDER_RESPONSE_MAX, on_sse, c);
    c->stream_state = wire->stream_new();

    char *auth = mem_asprintf("%s%s", wire->auth_prefix, ep->api_key ? ep->api_key : "");
    const char *headers[7];
    struct trace_http trace_lines;
    size_t n = 0;
    headers[n++] = "content-type: application/json";
    headers[n++] = auth;
    n += trace_http_headers(NULL, &trace_lines, headers + n); /* the drive's trace, a new span */
    if (wire->extra_header) {
        headers[n++] = wire->extra_header;
    }
    if (req->stream) {
        headers[n++] = "accept: text/event-stream";
    }
    headers[n++] = "expect:"; /* no 100-continue round trip before a large body */
    int64_t timeout = ep->timeout_ms > 0 ? ep->timeout_ms : 600000;
    if (req->timeout_ms > 0 && req->timeout_ms < timeout) {
        timeout = req->timeout_ms;
        c->limit_ms = clock_mono_ms() + timeout;
    }
    struct model_io_request r = {
        .url = c->url,
        .headers = headers,
        .n_headers = n,
        .body_take = payload,
        .body_len = payload_len,
        .timeout_ms = timeout,
        .connect_timeout_ms = 10000,
        .stall_ms = c->stall_ms,
        .on_header = on_header,
        .on_body = on_body,
        .cancelled = req->stream || (ev && ev->cancelled) ? on_cancelled : NULL,
        .on_done = on_done,
        .ctx = c,
    };
    enum cf_status rc = model_io_shared_start(&r, out_id, err);
    free(auth);
    if (rc != CF_OK) {
        out->retryable = rc == CF_BUSY;
        call_free(c);
    }
    return rc;
}

void llm_cancel(uint64_t id)
{
    model_io_shared_cancel(id);
}

/* ---------- llm_complete: a call the calling thread waits for ---------- */

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    enum cf_status rc;
    struct cf_error err;
    struct buf text; /* streamed text not yet passed to the caller's on_text */
};

static void waiter_text(void *ctx, const char *p, size_t n)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    /* the response's own text is capped at the same size, so this append fits */
    if (buf_append(&w->text, p, n) == CF_OK) {
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
}

static void waiter_done(void *ctx, enum cf_status rc, const struct cf_error *err)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done = true;
    w->rc = rc;
    w->err = *err;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* pass_text hands the text streamed so far to the caller's on_text, without w->mu held (it
 * may block). Called with w->mu held; returns with it held. */
static void pass_text(struct waiter *w, const struct llm_events *ev)
{
    while (w->text.len) {
        char *text = buf_take(&w->text);
        size_t n = strlen(text);
        pthread_mutex_unlock(&w->mu);
        if (ev && ev->on_text) {
            ev->on_text(ev->ctx, text, n);
        }
        free(text);
        pthread_mutex_lock(&w->mu);
    }
}

enum cf_status llm_complete(const struct provider_endpoint *ep, const struct llm_request *req,
                            const struct llm_events *ev, struct llm_response *out,
                            struct cf_error *err)
{
    struct waiter w = {.rc = CF_OK};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    buf_init(&w.text, PROVIDER_TEXT_MAX);
    struct llm_events inner = {.on_text = ev && ev->on_text ? waiter_text : NULL, .ctx = &w};
    uint64_t id = 0;
    enum cf_status rc = llm_start(ep, req, &inner, out, waiter_done, &w, &id, err);
    if (rc == CF_OK) {
        bool cancel_sent = false;
        pthread_mutex_lock(&w.mu);
        while (!w.done) {
            pass_text(&w, ev);
            if (w.done) {
                break;
            }
            bool poll = !cancel_sent && ev && ev->cancelled;
            if (poll) {
                struct timespec ts;
                clock_deadline(&ts, MODEL_IO_CANCEL_POLL_MS);
                clock_cond_wait(&w.cv, &w.mu, &ts);
            } else {
                pthread_cond_wait(&w.cv, &w.mu);
            }
            if (!w.done && poll) {
                pthread_mutex_unlock(&w.mu);
                if (ev->cancelled(ev->ctx)) {
                    llm_cancel(id);
                    cancel_sent = true;
                }
                pthread_mutex_lock(&w.mu);
            }
        }
        pass_text(&w, ev);
        pthread_mutex_unlock(&w.mu);
        rc = w.rc;
        if (err) {
            *err = w.err;
        }
    }
    buf_cleanup(&w.text);
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    return rc;
}
