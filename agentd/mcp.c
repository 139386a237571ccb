/* mcp.c - MCP servers over streamable HTTP: sessions, tools/list and tools/call (mcp.h).
 *
 * An operation is a small state machine stepped on the model I/O loop: INIT (initialize,
 * unless the server's session is set up already), NOTIFY (notifications/initialized), WORK
 * (tools/list page by page, or the one tools/call). Each step is one POST whose on_done starts
 * the next, so the whole operation holds no thread. The session found or made is shared with
 * later operations on the same server; one that the server no longer knows (HTTP 404 to a
 * request that carried it) is dropped and set up again, once per operation.
 *
 * An operation keeps the trace of the thread that started it (a drive's): each of its POSTs
 * sends `traceparent` (a new parent-id per request) and `tracestate`.
 */
#include "mcp.h"

#include "base64.h"
#include "clock.h"
#include "mem.h"
#include "model_io.h"
#include "sse.h"
#include "trace.h"
#include "utf8.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define SESSIONS_MAX 64
#define SESSION_ID_MAX 256
#define PROTOCOL_MAX 31

/* One server's session, shared by the operations on it (under g_sessions.mu). */
struct session {
    char *key; /* the URL, then each header line, '\n'-separated */
    char id[SESSION_ID_MAX + 1];
    char protocol[PROTOCOL_MAX + 1];
    bool ready;
    uint64_t generation; /* bumped when the session is set up or dropped */
};

static struct {
    pthread_mutex_t mu;
    struct session at[SESSIONS_MAX];
    int n;
} g_sessions = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* JSON-RPC request ids, unique in the process: operations share sessions, and a server routes
 * answers by id within a session. */
static atomic_llong g_request_ids;

enum phase { PH_INIT, PH_NOTIFY, PH_WORK };

struct mcp_op {
    const struct agent_mcp *m;
    int slot; /* its session in g_sessions (-1: past SESSIONS_MAX, not shared) */
    bool call;
    char *tool;
    json_t *args;
    int64_t deadline_ms; /* monotonic */
    mcp_done_fn done;
    void *arg;
    /* the model I/O loop's, one step at a time */
    enum phase phase;
    bool retried; /* the session was set up again once */
    char session_id[SESSION_ID_MAX + 1];
    char protocol[PROTOCOL_MAX + 1];
    uint64_t generation;
    json_int_t want_id; /* the id of the request in flight (0: a notification) */
    char *cursor;
    int pages;
    struct buf body; /* a JSON answer's bytes */
    struct sse sse;  /* an event-stream answer */
    bool stream;
    char new_session[SESSION_ID_MAX + 1]; /* Mcp-Session-Id of the answer */
    json_t *response;                     /* the JSON-RPC response to the request in flight */
    /* results */
    json_t *tools;
    struct mcp_result res; /* a call's */
    bool failed;
    char failure[512];
    /* shared */
    pthread_mutex_t mu;
    bool over; /* under mu */
    atomic_bool cancel;
    _Atomic uint64_t transfer;
    struct trace_ctx trace; /* its starter's (trace_id "": none) */
};

static void step(struct mcp_op *op);

/* ---------- sessions ---------- */

static int session_slot(const struct agent_mcp *m)
{
    struct buf key;
    buf_init(&key, 64 << 10);
    buf_append_str(&key, m->url);
    for (size_t i = 0; i < m->n_headers; i++) {
        buf_printf(&key, "\n%s", m->headers[i]);
    }
    int slot = -1;
    pthread_mutex_lock(&g_sessions.mu);
    for (int i = 0; i < g_sessions.n && slot < 0; i++) {
        if (!strcmp(g_sessions.at[i].key, buf_cstr(&key))) {
            slot = i;
        }
    }
    if (slot < 0 && g_sessions.n < SESSIONS_MAX) {
        slot = g_sessions.n++;
        memset(&g_sessions.at[slot], 0, sizeof(g_sessions.at[slot]));
        g_sessions.at[slot].key = buf_take(&key);
    }
    pthread_mutex_unlock(&g_sessions.mu);
    buf_cleanup(&key);
    return slot;
}

/* session_take copies the server's session into op when one is set up. */
static bool session_take(struct mcp_op *op)
{
    bool ready = false;
    pthread_mutex_lock(&g_sessions.mu);
    if (op->slot >= 0 && g_sessions.at[op->slot].ready) {
        const struct session *s = &g_sessions.at[op->slot];
        memcpy(op->session_id, s->id, sizeof(op->session_id));
        memcpy(op->protocol, s->protocol, sizeof(op->protocol));
        op->generation = s->generation;
        ready = true;
    }
    pthread_mutex_unlock(&g_sessions.mu);
    return ready;
}

/* session_set keeps op's new session as the server's. */
static void session_set(struct mcp_op *op)
{
    pthread_mutex_lock(&g_sessions.mu);
    if (op->slot >= 0) {
        struct session *s = &g_sessions.at[op->slot];
        memcpy(s->id, op->session_id, sizeof(s->id));
        memcpy(s->protocol, op->protocol, sizeof(s->protocol));
        s->ready = true;
        op->generation = ++s->generation;
    }
    pthread_mutex_unlock(&g_sessions.mu);
}

/* session_drop forgets the server's session op used, unless another op replaced it already. */
static void session_drop(struct mcp_op *op)
{
    pthread_mutex_lock(&g_sessions.mu);
    if (op->slot >= 0 && g_sessions.at[op->slot].generation == op->generation) {
        g_sessions.at[op->slot].ready = false;
        g_sessions.at[op->slot].generation++;
    }
    pthread_mutex_unlock(&g_sessions.mu);
    op->session_id[0] = op->protocol[0] = '\0';
}

/* ---------- the end of an operation ---------- */

static void finish(struct mcp_op *op)
{
    pthread_mutex_lock(&op->mu);
    op->over = true;
    /* under the lock: once the owner sees `over` it may free op, so nothing here touches op
     * after the unlock */
    op->done(op->arg);
    pthread_mutex_unlock(&op->mu);
}

__attribute__((format(printf, 2, 3))) static void fail(struct mcp_op *op, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(op->failure, sizeof(op->failure), fmt, ap);
    va_end(ap);
    op->failed = true;
    finish(op);
}

/* ---------- one POST ---------- */

static bool on_event(void *ctx, const char *event, const char *data)
{
    struct mcp_op *op = ctx;
    (void)event;
    json_t *j = *data ? json_loads(data, 0, NULL) : NULL;
    json_t *id = json_object_get(j, "id");
    if (json_is_integer(id) && json_integer_value(id) == op->want_id &&
        (json_object_get(j, "result") || json_object_get(j, "error"))) {
        op->response = j;
        return false; /* the answer is in: the transfer ends here */
    }
    json_decref(j); /* a notification or a request of the server's: not ours to answer */
    return true;
}

/* header_is: line is header `name` (case-insensitive); *value its trimmed value. */
static bool header_is(const char *line, size_t len, const char *name, char *value, size_t cap)
{
    size_t n = strlen(name);
    if (len <= n || strncasecmp(line, name, n) != 0 || line[n] != ':') {
        return false;
    }
    const char *v = line + n + 1, *end = line + len;
    while (v < end && (*v == ' ' || *v == '\t')) {
        v++;
    }
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ')) {
        end--;
    }
    snprintf(value, cap, "%.*s", (int)(end - v), v);
    return true;
}

static bool on_header(void *ctx, const char *line, size_t len)
{
    struct mcp_op *op = ctx;
    char v[SESSION_ID_MAX + 2];
    if (header_is(line, len, "content-type", v, sizeof(v))) {
        op->stream = !strncasecmp(v, "text/event-stream", 17);
    } else if (header_is(line, len, "mcp-session-id", v, sizeof(v))) {
        size_t n = strlen(v);
        for (size_t i = 0; i < n; i++) {
            if (v[i] < 0x21 || v[i] > 0x7e) {
                return false; /* the spec allows visible ASCII only */
            }
        }
        if (n > SESSION_ID_MAX) {
            return false;
        }
        memcpy(op->new_session, v, n + 1);
    }
    return true;
}

static bool on_body(void *ctx, const char *p, size_t len)
{
    struct mcp_op *op = ctx;
    if (op->stream) {
        return sse_feed(&op->sse, p, len);
    }
    return buf_append(&op->body, p, len) == CF_OK;
}

static bool cancelled(void *ctx)
{
    return atomic_load(&((struct mcp_op *)ctx)->cancel);
}

static void on_done(void *ctx, const struct model_io_result *res);

/* post sends one JSON-RPC message (a request when with_id) to the server. */
static void post(struct mcp_op *op, const char *method, json_t *params, bool with_id)
{
    json_t *msg = json_pack("{s:s, s:s}", "jsonrpc", "2.0", "method", method);
    if (params) {
        json_object_set_new(msg, "params", params);
    }
    op->want_id = 0;
    if (with_id) {
        op->want_id = (json_int_t)atomic_fetch_add(&g_request_ids, 1) + 1;
        json_object_set_new(msg, "id", json_integer(op->want_id));
    }
    char *body = json_dumps(msg, JSON_COMPACT);
    json_decref(msg);
    const char *headers[AGENT_MCP_HEADERS_MAX + 8];
    char sid[SESSION_ID_MAX + 32], proto[PROTOCOL_MAX + 32];
    struct trace_http trace_lines;
    size_t n = 0;
    headers[n++] = "content-type: application/json";
    headers[n++] = "accept: application/json, text/event-stream";
    headers[n++] = "expect:";
    if (op->session_id[0]) {
        snprintf(sid, sizeof(sid), "mcp-session-id: %s", op->session_id);
        headers[n++] = sid;
    }
    if (op->protocol[0]) {
        snprintf(proto, sizeof(proto), "mcp-protocol-version: %s", op->protocol);
        headers[n++] = proto;
    }
    n += trace_http_headers(&op->trace, &trace_lines, headers + n); /* this request's span */
    for (size_t i = 0; i < op->m->n_headers; i++) {
        headers[n++] = op->m->headers[i];
    }
    buf_reset(&op->body);
    sse_cleanup(&op->sse);
    sse_init(&op->sse, MCP_RESPONSE_MAX, on_event, op);
    op->stream = false;
    op->new_session[0] = '\0';
    int64_t left = op->deadline_ms - clock_mono_ms();
    struct model_io_request rq = {.url = op->m->url,
                                  .headers = headers,
                                  .n_headers = n,
                                  .body_take = body,
                                  .body_len = strlen(body),
                                  .timeout_ms = left > 1 ? left : 1,
                                  .connect_timeout_ms = left < 5000 ? (left > 1 ? left : 1) : 5000,
                                  .on_header = on_header,
                                  .on_body = on_body,
                                  .cancelled = cancelled,
                                  .on_done = on_done,
                                  .ctx = op};
    uint64_t id;
    struct cf_error err;
    if (model_io_shared_start(&rq, &id, &err) != CF_OK) {
        fail(op, "the request could not start: %s", err.msg);
        return;
    }
    atomic_store(&op->transfer, id);
}

/* ---------- the answers ---------- */

/* error_text describes a JSON-RPC error object. */
static void error_text(json_t *e, char *out, size_t cap)
{
    const char *msg = json_string_value(json_object_get(e, "message"));
    snprintf(out, cap, "%.300s (code %lld)", msg ? msg : "no message",
             (long long)json_integer_value(json_object_get(e, "code")));
}

static void answered_initialize(struct mcp_op *op, json_t *result)
{
    const char *v = json_string_value(json_object_get(result, "protocolVersion"));
    size_t n = v ? strlen(v) : 0;
    if (!n || n > PROTOCOL_MAX ||
        strspn(v, "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-_") != n) {
        fail(op, "initialize answered no usable protocolVersion");
        return;
    }
    memcpy(op->protocol, v, n + 1);
    memcpy(op->session_id, op->new_session, sizeof(op->session_id));
    op->phase = PH_NOTIFY; /* shared once the server heard notifications/initialized */
    step(op);
}

static void answered_list(struct mcp_op *op, json_t *result)
{
    size_t i;
    json_t *t;
    json_array_foreach(json_object_get(result, "tools"), i, t)
    {
        if (json_is_object(t) && json_array_size(op->tools) < MCP_TOOLS_MAX) {
            json_array_append(op->tools, t);
        }
    }
    const char *next = json_string_value(json_object_get(result, "nextCursor"));
    free(op->cursor);
    op->cursor = next && *next && ++op->pages < MCP_PAGES_MAX ? mem_strdup(next) : NULL;
    if (op->cursor) {
        step(op);
    } else {
        finish(op);
    }
}

/* answered takes the response to the request in flight. */
static void answered(struct mcp_op *op)
{
    json_t *r = op->response;
    op->response = NULL;
    json_t *result = json_object_get(r, "result");
    char why[400] = "";
    if (!result) {
        error_text(json_object_get(r, "error"), why, sizeof(why));
    }
    if (op->phase == PH_INIT && result) {
        answered_initialize(op, result);
    } else if (op->phase == PH_INIT) {
        fail(op, "initialize was refused: %s", why);
    } else if (op->call && result) {
        mcp_result_read(&op->res, result);
        finish(op);
    } else if (op->call) {
        /* the server is there and said no: an answer for the model */
        buf_printf(&op->res.text, "The MCP server refused this call: %s", why);
        op->res.is_error = true;
        finish(op);
    } else if (result) {
        answered_list(op, result);
    } else {
        fail(op, "tools/list was refused: %s", why);
    }
    json_decref(r);
}

/* answers_request: op's answer body is a JSON-RPC response to its request (an error the
 * server meant for that request, not a session it does not know). */
static bool answers_request(const struct mcp_op *op)
{
    json_t *j = json_loadb(op->body.data ? op->body.data : "", op->body.len, 0, NULL);
    json_t *id = json_object_get(j, "id");
    bool ours = json_is_integer(id) && json_integer_value(id) == op->want_id;
    json_decref(j);
    return ours;
}

static void on_done(void *ctx, const struct model_io_result *res)
{
    struct mcp_op *op = ctx;
    atomic_store(&op->transfer, 0);
    if (op->response) {
        answered(op); /* found in the event stream, which was ended there */
        return;
    }
    long http = res->http_status;
    if (res->status == CF_CANCELLED || atomic_load(&op->cancel)) {
        fail(op, "cancelled");
    } else if (res->status != CF_OK) {
        fail(op, "%s", res->err.msg);
    } else if ((http == 404 || (http == 400 && !answers_request(op))) && op->session_id[0] &&
               !op->retried) {
        /* the server forgot the session (404, as the specification has it; 400 without a
         * response to the request from servers that answer a session they do not know so,
         * the reference server among them, e.g. after a restart): set it up again, once */
        session_drop(op);
        op->retried = true;
        op->phase = PH_INIT;
        step(op);
    } else if (http / 100 != 2) {
        fail(op, "the server answered HTTP %ld", http);
    } else if (op->phase == PH_NOTIFY) {
        session_set(op);
        op->phase = PH_WORK;
        step(op);
    } else if (!op->stream && !(op->response = json_loadb(op->body.data ? op->body.data : "",
                                                          op->body.len, 0, NULL))) {
        fail(op, "the answer is not JSON (HTTP %ld, %zu bytes)", http, op->body.len);
    } else if (!json_is_object(op->response) ||
               json_integer_value(json_object_get(op->response, "id")) != op->want_id) {
        fail(op, "the answer holds no JSON-RPC response to the request");
    } else {
        answered(op);
    }
}

/* step sends the request the operation's phase calls for. */
static void step(struct mcp_op *op)
{
    if (atomic_load(&op->cancel)) {
        fail(op, "cancelled");
        return;
    }
    if (clock_mono_ms() >= op->deadline_ms) {
        fail(op, "no answer in time");
        return;
    }
    if (op->phase == PH_INIT && session_take(op)) {
        op->phase = PH_WORK;
    }
    switch (op->phase) {
    case PH_INIT:
        op->session_id[0] = op->protocol[0] = '\0';
        post(op, "initialize",
             json_pack("{s:s, s:{}, s:{s:s, s:s}}", "protocolVersion", MCP_PROTOCOL_VERSION,
                       "capabilities", "clientInfo", "name", "cflue", "version", "1"),
             true);
        return;
    case PH_NOTIFY:
        post(op, "notifications/initialized", NULL, false);
        return;
    case PH_WORK:
        if (op->call) {
            post(op, "tools/call", json_pack("{s:s, s:O}", "name", op->tool, "arguments", op->args),
                 true);
        } else {
            post(op, "tools/list", op->cursor ? json_pack("{s:s}", "cursor", op->cursor) : NULL,
                 true);
        }
        return;
    }
}

/* ---------- operations ---------- */

static struct mcp_op *op_new(const struct agent_mcp *m, int64_t timeout_ms, mcp_done_fn done,
                             void *arg)
{
    struct mcp_op *op = mem_alloc(sizeof(*op));
    memset(op, 0, sizeof(*op));
    op->m = m;
    op->slot = session_slot(m);
    op->deadline_ms = clock_mono_ms() + timeout_ms;
    op->done = done;
    op->arg = arg;
    buf_init(&op->body, MCP_RESPONSE_MAX);
    mcp_result_init(&op->res);
    sse_init(&op->sse, MCP_RESPONSE_MAX, on_event, op);
    pthread_mutex_init(&op->mu, NULL);
    atomic_init(&op->cancel, false);
    atomic_init(&op->transfer, 0);
    if (trace_current()) {
        op->trace = *trace_current();
    }
    return op;
}

struct mcp_op *mcp_list_start(const struct agent_mcp *m, int64_t timeout_ms, mcp_done_fn done,
                              void *arg)
{
    struct mcp_op *op = op_new(m, timeout_ms, done, arg);
    op->tools = json_array();
    step(op);
    return op;
}

struct mcp_op *mcp_call_start(const struct agent_mcp *m, const char *tool,
                              const char *arguments_json, int64_t timeout_ms, mcp_done_fn done,
                              void *arg)
{
    struct mcp_op *op = op_new(m, timeout_ms, done, arg);
    json_error_t e;
    op->call = true;
    op->tool = mem_strdup(tool);
    op->args = *arguments_json ? json_loads(arguments_json, 0, &e) : json_object();
    if (!json_is_object(op->args)) {
        buf_printf(&op->res.text,
                   "The arguments must be a JSON object%s%.200s; the call was not made.",
                   op->args ? "" : ": ", op->args ? "" : e.text);
        op->res.is_error = true;
        finish(op);
        return op;
    }
    step(op);
    return op;
}

bool mcp_op_done(struct mcp_op *op)
{
    pthread_mutex_lock(&op->mu);
    bool over = op->over;
    pthread_mutex_unlock(&op->mu);
    return over;
}

void mcp_op_cancel(struct mcp_op *op)
{
    atomic_store(&op->cancel, true);
    model_io_shared_cancel(atomic_load(&op->transfer));
}

const char *mcp_op_failure(const struct mcp_op *op)
{
    return op->failed ? op->failure : NULL;
}

json_t *mcp_op_tools(const struct mcp_op *op)
{
    return op->tools;
}

const char *mcp_op_text(const struct mcp_op *op)
{
    return buf_cstr(&op->res.text);
}

bool mcp_op_is_error(const struct mcp_op *op)
{
    return op->res.is_error;
}

Cflue__V1__Attachment **mcp_op_images(struct mcp_op *op, size_t *n)
{
    *n = op->res.n_images;
    return op->res.ptrs;
}

void mcp_op_free(struct mcp_op *op)
{
    if (!op) {
        return;
    }
    free(op->tool);
    free(op->cursor);
    json_decref(op->args);
    json_decref(op->tools);
    json_decref(op->response);
    buf_cleanup(&op->body);
    mcp_result_cleanup(&op->res);
    sse_cleanup(&op->sse);
    pthread_mutex_destroy(&op->mu);
    free(op);
}

/* ---------- what the model reads of a result ---------- */

void mcp_result_init(struct mcp_result *r)
{
    memset(r, 0, sizeof(*r));
    buf_init(&r->text, MCP_TEXT_MAX + 512);
}

void mcp_result_cleanup(struct mcp_result *r)
{
    for (size_t i = 0; i < r->n_images; i++) {
        free(r->images[i].data.data);
    }
    r->n_images = r->image_bytes = 0;
    buf_cleanup(&r->text);
}

/* take_image makes image item c one of r's images, or describes in out why it cannot be. */
static void take_image(struct mcp_result *r, json_t *c, struct buf *out)
{
    const char *mime = json_string_value(json_object_get(c, "mimeType"));
    const char *data = json_string_value(json_object_get(c, "data"));
    size_t len = data ? strlen(data) : 0, n = 0;
    uint8_t *bytes = NULL;
    const char *why = image_type(mime) ? NULL : image_refusal(mime, 0, 0, 0);
    if (!why) {
        enum cf_status rc = base64_decode(data ? data : "", len, IMAGE_BYTES_MAX, &bytes, &n);
        why = rc == CF_INVALID  ? "its data is not valid base64"
              : rc == CF_TOOBIG ? image_refusal(mime, (size_t)IMAGE_BYTES_MAX + 1, 0, 0)
                                : image_refusal(mime, n, r->n_images, r->image_bytes);
    }
    if (why) {
        free(bytes);
        buf_printf(out, "[image content (%.64s, about %zu bytes) that cannot be shown: %s]",
                   mime ? mime : "of no stated type", len / 4 * 3, why);
        return;
    }
    size_t k = r->n_images++;
    Cflue__V1__Attachment *a = &r->images[k];
    cflue__v1__attachment__init(a);
    snprintf(r->names[k], sizeof(r->names[k]), "image-%zu", k + 1);
    a->name = r->names[k];
    a->mime_type = (char *)image_type(mime);
    a->data.data = bytes;
    a->data.len = n;
    r->ptrs[k] = a;
    r->image_bytes += n;
    buf_printf(out, "[%s (%s, %zu bytes) is shown after this text]", a->name, a->mime_type, n);
}

/* describe_content appends one content item. */
static void describe_content(struct mcp_result *r, json_t *c, struct buf *out)
{
    const char *type = json_string_value(json_object_get(c, "type"));
    const char *mime = json_string_value(json_object_get(c, "mimeType"));
    type = type ? type : "";
    if (!strcmp(type, "text")) {
        const char *t = json_string_value(json_object_get(c, "text"));
        buf_append_str(out, t ? t : "");
    } else if (!strcmp(type, "image")) {
        take_image(r, c, out);
    } else if (!strcmp(type, "audio")) {
        const char *data = json_string_value(json_object_get(c, "data"));
        buf_printf(out, "[audio content: %.64s, about %zu bytes; it cannot be shown here]",
                   mime ? mime : "of no stated type", data ? strlen(data) / 4 * 3 : 0);
    } else if (!strcmp(type, "resource")) {
        json_t *res = json_object_get(c, "resource");
        const char *uri = json_string_value(json_object_get(res, "uri"));
        const char *text = json_string_value(json_object_get(res, "text"));
        if (text) {
            buf_printf(out, "[resource %s]\n%s", uri ? uri : "", text);
        } else {
            buf_printf(out, "[resource %s: binary content; it cannot be shown here]",
                       uri ? uri : "");
        }
    } else if (!strcmp(type, "resource_link")) {
        const char *uri = json_string_value(json_object_get(c, "uri"));
        const char *name = json_string_value(json_object_get(c, "name"));
        buf_printf(out, "[resource link: %s%s%s]", uri ? uri : "", name ? " " : "",
                   name ? name : "");
    } else {
        buf_printf(out, "[content of type \"%.40s\"; it cannot be shown here]", type);
    }
}

void mcp_result_read(struct mcp_result *r, json_t *result)
{
    struct buf all;
    buf_init(&all, MCP_RESPONSE_MAX);
    size_t i;
    json_t *c;
    r->is_error = json_is_true(json_object_get(result, "isError"));
    json_array_foreach(json_object_get(result, "content"), i, c)
    {
        if (i) {
            buf_append_str(&all, "\n");
        }
        describe_content(r, c, &all);
    }
    if (!all.len) {
        json_t *s = json_object_get(result, "structuredContent");
        char *dump = s ? json_dumps(s, JSON_COMPACT) : NULL;
        buf_append_str(&all, dump ? dump : "(the tool returned no content)");
        free(dump);
    }
    size_t keep = utf8_prefix_len(all.data, all.len, MCP_TEXT_MAX);
    buf_append(&r->text, all.data, keep);
    if (keep < all.len) {
        buf_printf(&r->text, "\n[cut: the result has %zu bytes; only the first %zu are shown]",
                   all.len, keep);
    }
    buf_cleanup(&all);
}
