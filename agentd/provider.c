/* provider.c - the HTTP side of a model call: libcurl, streaming, cancellation, errors. */
#include "provider.h"

#include "log.h"
#include "mem.h"
#include "sse.h"

#include <curl/curl.h>
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

void llm_add_call(struct llm_response *r, const char *id, const char *name, const char *args)
{
    r->calls = mem_realloc(r->calls, sizeof(*r->calls) * (r->n_calls + 1));
    r->calls[r->n_calls].id = mem_strdup(id ? id : "");
    r->calls[r->n_calls].name = mem_strdup(name ? name : "");
    r->calls[r->n_calls].arguments_json = mem_strdup(args && *args ? args : "{}");
    r->n_calls++;
}

struct transfer {
    const struct llm_request *req;
    const struct llm_events *ev;
    struct llm_response *out;
    struct buf body; /* whole body when not streaming, or an error body */
    struct sse sse;
    void *stream_state;
    long status;
    int64_t retry_after_ms;
    enum cf_status parse_rc;
    struct cf_error parse_err;
    bool cancelled;
    bool not_sse; /* a 2xx answer to a streaming request that is not text/event-stream */
};

static bool on_sse(void *ctx, const char *event, const char *data)
{
    struct transfer *t = ctx;
    enum cf_status rc =
        !strcmp(t->req->provider, "anthropic")
            ? anthropic_parse_event(t->stream_state, event, data, t->ev, t->out, &t->parse_err)
            : openai_parse_event(t->stream_state, event, data, t->ev, t->out, &t->parse_err);
    if (rc != CF_OK) {
        t->parse_rc = rc;
        return false;
    }
    return true;
}

static size_t on_header(char *p, size_t size, size_t n, void *ctx)
{
    struct transfer *t = ctx;
    size_t len = size * n;
    if (len > 12 && !strncasecmp(p, "retry-after:", 12)) {
        double secs = atof(p + 12);
        if (secs > 0 && secs < 3600) {
            t->retry_after_ms = (int64_t)(secs * 1000);
        }
    }
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *ctx)
{
    struct transfer *t = ctx;
    size_t len = size * n;
    if (t->req->stream && t->status >= 200 && t->status < 300 && !t->not_sse) {
        if (!sse_feed(&t->sse, p, len)) {
            if (t->parse_rc == CF_OK) {
                t->parse_rc = cf_error_set(&t->parse_err, CF_INVALID,
                                           "the provider's event stream has a line over %d bytes",
                                           PROVIDER_RESPONSE_MAX);
            }
            return 0;
        }
        return len;
    }
    if (buf_append(&t->body, p, len) != CF_OK) {
        return 0;
    }
    return len;
}

static int on_progress(void *ctx, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    struct transfer *t = ctx;
    if (t->ev && t->ev->cancelled && t->ev->cancelled(t->ev->ctx)) {
        t->cancelled = true;
        return 1; /* abort the transfer now */
    }
    return 0;
}

static size_t on_header_with_status(char *p, size_t size, size_t n, void *ctx)
{
    struct transfer *t = ctx;
    if (size * n > 5 && !strncmp(p, "HTTP/", 5)) {
        const char *sp = strchr(p, ' ');
        t->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        t->not_sse = false;
    }
    if (size * n > 13 && !strncasecmp(p, "content-type:", 13)) {
        t->not_sse = !strstr(p, "text/event-stream");
    }
    return on_header(p, size, n, ctx);
}

/* classify turns an HTTP error into a status and message. */
static enum cf_status classify(struct transfer *t, struct cf_error *err)
{
    long s = t->status;
    const char *body = buf_cstr(&t->body);
    char msg[300] = "";
    json_t *j = json_loads(body, 0, NULL);
    json_t *e = j ? json_object_get(j, "error") : NULL;
    const char *m = json_string_value(json_object_get(e, "message"));
    snprintf(msg, sizeof(msg), "%s", m ? m : (t->body.len ? "(no error message)" : "(empty body)"));
    json_decref(j);
    t->out->http_status = (int)s;
    t->out->retry_after_ms = t->retry_after_ms;
    t->out->retryable = s == 408 || s == 409 || s == 429 || s >= 500;
    t->out->context_overflow =
        s == 400 && (strstr(msg, "context") || strstr(msg, "too long") || strstr(msg, "maximum"));
    if (s == 401 || s == 403) {
        return cf_error_set(err, CF_INVALID,
                            "the %s API refused the credentials (HTTP %ld): %s; check the API key",
                            t->req->provider, s, msg);
    }
    return cf_error_set(err, t->out->retryable ? CF_UNAVAILABLE : CF_INVALID,
                        "the %s API answered HTTP %ld: %s", t->req->provider, s, msg);
}

enum cf_status llm_complete(const struct provider_endpoint *ep, const struct llm_request *req,
                            const struct llm_events *ev, struct llm_response *out,
                            struct cf_error *err)
{
    bool anthropic = !strcmp(req->provider, "anthropic");
    json_t *body = anthropic ? anthropic_build(req) : openai_build(req);
    char *payload = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    char url[1024], auth[1024];
    const char *base = ep->base_url;
    size_t blen = strlen(base);
    while (blen && base[blen - 1] == '/') {
        blen--;
    }
    if (anthropic) {
        snprintf(url, sizeof(url), "%.*s/v1/messages", (int)blen, base);
    } else if (blen >= 3 && !strncmp(base + blen - 3, "/v1", 3)) {
        snprintf(url, sizeof(url), "%.*s/chat/completions", (int)blen, base);
    } else {
        snprintf(url, sizeof(url), "%.*s/v1/chat/completions", (int)blen, base);
    }
    struct curl_slist *h = NULL;
    h = curl_slist_append(h, "content-type: application/json");
    if (anthropic) {
        snprintf(auth, sizeof(auth), "x-api-key: %s", ep->api_key ? ep->api_key : "");
        h = curl_slist_append(h, auth);
        h = curl_slist_append(h, "anthropic-version: 2023-06-01");
    } else {
        snprintf(auth, sizeof(auth), "authorization: Bearer %s", ep->api_key ? ep->api_key : "");
        h = curl_slist_append(h, auth);
    }
    if (req->stream) {
        h = curl_slist_append(h, "accept: text/event-stream");
    }
    struct transfer t = {.req = req, .ev = ev, .out = out};
    buf_init(&t.body, PROVIDER_RESPONSE_MAX);
    sse_init(&t.sse, PROVIDER_RESPONSE_MAX, on_sse, &t);
    t.stream_state = anthropic ? anthropic_stream_new() : openai_stream_new();

    CURL *curl = curl_easy_init();
    curl_easy_setopt(curl, CURLOPT_URL, url);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, payload);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, on_header_with_status);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &t);
    curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    int64_t timeout = ep->timeout_ms > 0 ? ep->timeout_ms : 600000;
    if (req->timeout_ms > 0 && req->timeout_ms < timeout) {
        timeout = req->timeout_ms;
    }
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, (long)timeout);
    /* a stalled stream (no byte for 60 s) is a network failure */
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(curl, CURLOPT_USERAGENT, "cflue-agentd/0.1");
    CURLcode cc = curl_easy_perform(curl);
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &t.status);
    enum cf_status rc = CF_OK;
    if (t.cancelled) {
        rc = cf_error_set(err, CF_CANCELLED, "the model call was cancelled");
    } else if (t.parse_rc != CF_OK) {
        *err = t.parse_err;
        rc = t.parse_rc;
        out->retryable = false;
    } else if (cc != CURLE_OK) {
        out->retryable = true;
        rc = cf_error_set(err, CF_UNAVAILABLE, "the %s API could not be reached at %s: %s",
                          req->provider, url, curl_easy_strerror(cc));
    } else if (t.status < 200 || t.status >= 300) {
        rc = classify(&t, err);
    } else if (req->stream && t.not_sse) {
        /* a whole JSON message is acceptable; anything else is a broken provider */
        rc = anthropic ? anthropic_parse_body(buf_cstr(&t.body), t.body.len, out, err)
                       : openai_parse_body(buf_cstr(&t.body), t.body.len, out, err);
        out->retryable = false;
    } else if (!req->stream) {
        rc = anthropic ? anthropic_parse_body(buf_cstr(&t.body), t.body.len, out, err)
                       : openai_parse_body(buf_cstr(&t.body), t.body.len, out, err);
    } else if (!out->stop_reason[0]) {
        out->retryable = true;
        rc = cf_error_set(err, CF_UNAVAILABLE,
                          "the %s stream ended before the message was complete", req->provider);
    }
    curl_easy_cleanup(curl);
    curl_slist_free_all(h);
    free(payload);
    buf_cleanup(&t.body);
    sse_cleanup(&t.sse);
    if (anthropic) {
        anthropic_stream_free(t.stream_state);
    } else {
        openai_stream_free(t.stream_state);
    }
    return rc;
}
