/* turn.c - driving one submission: input, system prompt, model turns, tool batches, joins,
 * recovery and settlement.
 *
 * Everything that matters is a record in the conversation's stream, written through storaged
 * under the attempt's fence; agentd keeps nothing else. Record ids are deterministic per
 * submission and turn (input:<sub>, assistant:<sub>:<turn>, tool:<sub>:<turn>:<call>), so a
 * later attempt recognizes what an earlier one finished and never repeats it:
 *
 *  - the input is appended once;
 *  - a turn whose assistant_message exists is not asked of the model again;
 *  - a tool call whose tool_result exists is not run again; one without a result when an
 *    attempt resumes gets an "outcome unknown" error result (the call may or may not have
 *    happened), and the model is asked to continue from there;
 *  - a stream cut off mid-message leaves only assistant_delta records, which are for
 *    watchers: the turn is simply asked again.
 *
 * Settlement is one Store.Settle: storaged writes the submission_settled record and settles
 * joined submissions with their host in the same transaction.
 */
#include "agentd.h"
#include "catalog.h"
#include "clients.h"
#include "clock.h"
#include "failpoint.h"
#include "guard.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "utf8.h"

#include "cflue/v1/sandbox.pb-c.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STORE_TIMEOUT_MS 15000
#define MAX_TURNS 200
#define DELTA_FLUSH_MS 250
#define MODEL_RETRIES 3

/* The result a tool call gets when an attempt ended before its outcome was recorded. */
#define INTERRUPTED_RESULT                                                                         \
    "{\"type\":\"interrupted\",\"message\":\"This tool call was interrupted before its "           \
    "result was recorded; whether it took effect is unknown.\"}"

struct drive {
    const Cflue__V1__Submission *sub;
    Cflue__V1__Fence fence;
    struct active *act;
    const struct agent_def *agent;
    char workspace[256];
    /* the conversation so far */
    Cflue__V1__ReadResponse **pages;
    size_t n_pages;
    int64_t cursor;
    /* streaming deltas */
    struct buf delta;
    int64_t delta_flushed_ms;
    int delta_seq;
    int turn;
    bool quiet; /* a call whose text is not shown to watchers (summaries) */
    struct cf_error err;
};

static bool stopped(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool s = d->act->abort_requested || d->act->lease_lost || d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    return s;
}

/* ---------- records ---------- */

static enum cf_status append(struct drive *d, Cflue__V1__Record **recs, size_t n)
{
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    req.fence = &d->fence;
    req.records = recs;
    req.n_records = n;
    enum cf_status rc = CF_UNAVAILABLE;
    for (int attempt = 0; attempt < 5 && rc == CF_UNAVAILABLE; attempt++) {
        if (attempt) {
            clock_sleep_ms(200 << attempt);
        }
        rc = store_call(g_agentd.store, "Append", &req.base,
                        &cflue__v1__append_response__descriptor, STORE_TIMEOUT_MS, &resp, &d->err);
    }
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    if (rc == CF_STALE) {
        pthread_mutex_lock(&g_agentd.mu);
        d->act->lease_lost = true;
        pthread_mutex_unlock(&g_agentd.mu);
    }
    return rc;
}

static enum cf_status append_one(struct drive *d, const char *id, const char *type,
                                 const char *submission_id, json_t *body)
{
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT, *recs[1] = {&rec};
    char *text = json_dumps(body, JSON_COMPACT);
    rec.id = (char *)id;
    rec.type = (char *)type;
    rec.submission_id = (char *)(submission_id ? submission_id : "");
    rec.body_json = text;
    enum cf_status rc = append(d, recs, 1);
    free(text);
    json_decref(body);
    return rc;
}

/* sync reads every record after the cursor into d->pages. */
static enum cf_status sync_records(struct drive *d)
{
    for (;;) {
        Cflue__V1__ReadRequest req = CFLUE__V1__READ_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        req.conversation_id = d->sub->conversation_id;
        req.after_offset = d->cursor;
        req.limit = 1000;
        enum cf_status rc =
            store_call(g_agentd.store, "Read", &req.base, &cflue__v1__read_response__descriptor,
                       STORE_TIMEOUT_MS, &resp, &d->err);
        if (rc != CF_OK) {
            return rc;
        }
        Cflue__V1__ReadResponse *page = (Cflue__V1__ReadResponse *)resp;
        d->cursor = page->next_offset;
        bool done = page->up_to_date;
        if (page->n_records) {
            d->pages = mem_realloc(d->pages, sizeof(void *) * (d->n_pages + 1));
            d->pages[d->n_pages++] = page;
        } else {
            protobuf_c_message_free_unpacked(resp, NULL);
        }
        if (done) {
            return CF_OK;
        }
    }
}

#define FOR_EACH_RECORD(d, r)                                                                      \
    for (size_t p_ = 0; p_ < (d)->n_pages; p_++)                                                   \
        for (size_t i_ = 0;                                                                        \
             i_ < (d)->pages[p_]->n_records && ((r) = (d)->pages[p_]->records[i_], 1); i_++)

static const Cflue__V1__Record *find_record(struct drive *d, const char *id)
{
    const Cflue__V1__Record *r;
    FOR_EACH_RECORD(d, r)
    {
        if (!strcmp(r->id, id)) {
            return r;
        }
    }
    return NULL;
}

/* ---------- settlement ---------- */

static void settle(struct drive *d, Cflue__V1__Outcome outcome, const char *error)
{
    Cflue__V1__SettleRequest req = CFLUE__V1__SETTLE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    char cut[8192];
    req.fence = &d->fence;
    req.outcome = outcome;
    if (error) {
        snprintf(cut, sizeof(cut), "%s", error);
        cut[utf8_prefix_len(cut, strlen(cut), 8000)] = '\0';
    }
    req.error = outcome == CFLUE__V1__OUTCOME__COMPLETED ? "" : (char *)(error ? cut : "failed");
    /* usage of every turn this submission recorded, across attempts */
    sync_records(d);
    const Cflue__V1__Record *r;
    FOR_EACH_RECORD(d, r)
    {
        if (!strcmp(r->type, "assistant_message") &&
            !strcmp(r->submission_id, d->sub->submission_id)) {
            json_t *b = json_loads(r->body_json, 0, NULL);
            json_t *u = json_object_get(b, "usage");
            req.input_tokens += json_integer_value(json_object_get(u, "input_tokens"));
            req.output_tokens += json_integer_value(json_object_get(u, "output_tokens"));
            req.cost_usd += json_number_value(json_object_get(b, "cost_usd"));
            json_decref(b);
        }
    }
    failpoint_hit("agentd.settle.before");
    enum cf_status rc = CF_UNAVAILABLE;
    for (int attempt = 0; attempt < 8 && rc == CF_UNAVAILABLE; attempt++) {
        if (attempt) {
            clock_sleep_ms(250 << (attempt < 5 ? attempt : 5));
        }
        rc = store_call(g_agentd.store, "Settle", &req.base,
                        &cflue__v1__settle_response__descriptor, STORE_TIMEOUT_MS, &resp, &d->err);
    }
    char q[600];
    if (rc == CF_OK) {
        failpoint_hit("agentd.settle.after");
        Cflue__V1__SettleResponse *sr = (Cflue__V1__SettleResponse *)resp;
        log_info("settled", "submission=%s outcome=%s joined=%zu err=%s", d->sub->submission_id,
                 outcome == 1   ? "completed"
                 : outcome == 2 ? "failed"
                                : "aborted",
                 sr->n_settled_with, log_quote(q, sizeof(q), req.error));
        protobuf_c_message_free_unpacked(resp, NULL);
    } else {
        log_warn("settle_failed", "submission=%s err=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), d->err.msg));
    }
    agentd_wake();
}

/* ---------- tool results ---------- */

static void record_result(struct drive *d, int index, const char *call_id, const char *name,
                          const char *text, bool is_error, const Cflue__V1__Truncation *t)
{
    char id[512];
    snprintf(id, sizeof(id), "tool:%s:%d:%s", d->sub->submission_id, d->turn, call_id);
    json_t *body =
        json_pack("{s:i, s:i, s:s, s:s, s:s, s:b}", "turn", d->turn, "index", index, "tool_call_id",
                  call_id, "name", name, "text", text, "is_error", is_error);
    if (t && t->truncated) {
        json_object_set_new(body, "truncation",
                            json_pack("{s:b, s:I, s:I, s:I}", "truncated", 1, "total_lines",
                                      (json_int_t)t->total_lines, "total_bytes",
                                      (json_int_t)t->total_bytes, "next_offset",
                                      (json_int_t)t->next_offset));
    }
    append_one(d, id, "tool_result", d->sub->submission_id, body);
}

/* ---------- context ---------- */

struct context {
    struct llm_message *msgs;
    size_t n, cap;
    struct llm_call *calls; /* storage for assistant calls */
    char **strings;         /* storage for strings built here */
    size_t n_strings;
};

static const char *keep(struct context *c, char *s)
{
    c->strings = mem_realloc(c->strings, sizeof(char *) * (c->n_strings + 1));
    c->strings[c->n_strings++] = s;
    return s;
}

static struct llm_message *push(struct context *c)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 32;
        c->msgs = mem_realloc(c->msgs, sizeof(*c->msgs) * c->cap);
    }
    memset(&c->msgs[c->n], 0, sizeof(c->msgs[0]));
    return &c->msgs[c->n++];
}

static void context_free(struct context *c)
{
    for (size_t i = 0; i < c->n; i++) {
        if (c->msgs[i].role == LLM_ASSISTANT) {
            free((void *)c->msgs[i].calls);
        }
        free((void *)c->msgs[i].images);
    }
    for (size_t i = 0; i < c->n_strings; i++) {
        free(c->strings[i]);
    }
    free(c->strings);
    free(c->msgs);
    memset(c, 0, sizeof(*c));
}

static const char *str(json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static char *base64(const uint8_t *p, size_t n)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *out = mem_alloc(((n + 2) / 3) * 4 + 1), *o = out;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        *o++ = tab[(v >> 18) & 63];
        *o++ = tab[(v >> 12) & 63];
        *o++ = i + 1 < n ? tab[(v >> 6) & 63] : '=';
        *o++ = i + 2 < n ? tab[v & 63] : '=';
    }
    *o = '\0';
    return out;
}

#define ATTACHMENT_TEXT_MAX (64 * 1024)
#define ATTACHMENT_IMAGE_MAX (5 << 20)

/* add_attachments gives the model what a message carried: images as image blocks, text files
 * inline after the message (up to 64 KiB each), and a note for anything else. The bytes come
 * from the submission in storaged, which keeps them with the admitted message. */
static void add_attachments(struct context *c, struct llm_message *m, const char *submission_id)
{
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    struct cf_error err;
    gr.submission_id = (char *)submission_id;
    if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                   STORE_TIMEOUT_MS, &resp, &err) != CF_OK) {
        return;
    }
    const Cflue__V1__Message *msg = ((Cflue__V1__Submission *)resp)->message;
    struct buf text;
    buf_init(&text, PROVIDER_TEXT_MAX);
    buf_append_str(&text, m->text);
    struct llm_image *images = mem_alloc(sizeof(*images) * (msg ? msg->n_attachments + 1 : 1));
    size_t n_images = 0;
    for (size_t i = 0; msg && i < msg->n_attachments; i++) {
        const Cflue__V1__Attachment *a = msg->attachments[i];
        const char *mt = a->mime_type;
        bool image = !strcmp(mt, "image/png") || !strcmp(mt, "image/jpeg") ||
                     !strcmp(mt, "image/gif") || !strcmp(mt, "image/webp");
        if (image && a->data.len <= ATTACHMENT_IMAGE_MAX) {
            images[n_images].mime_type = keep(c, mem_strdup(mt));
            images[n_images].base64 = keep(c, base64(a->data.data, a->data.len));
            n_images++;
            buf_printf(&text, "\n\n[Attached image %s (%s) follows.]", a->name, mt);
        } else if (!strncmp(mt, "text/", 5) || !strcmp(mt, "application/json")) {
            size_t n = a->data.len < ATTACHMENT_TEXT_MAX ? a->data.len : ATTACHMENT_TEXT_MAX;
            buf_printf(&text, "\n\n[Attached file %s (%s, %zu bytes)%s:]\n", a->name, mt,
                       a->data.len, n < a->data.len ? ", first 64 KiB" : "");
            utf8_sanitize(&text, (const char *)a->data.data, n);
        } else {
            buf_printf(&text,
                       "\n\n[Attached file %s (%s, %zu bytes): its content cannot be shown "
                       "here.]",
                       a->name, mt, a->data.len);
        }
    }
    m->text = keep(c, buf_take(&text));
    m->images = images;
    m->n_images = n_images;
    protobuf_c_message_free_unpacked(resp, NULL);
}

/* build_context turns the records into provider-neutral messages. json bodies are kept in
 * `bodies` (freed by the caller) because messages point into them. */
static int cmp_record_id(const void *a, const void *b)
{
    return strcmp((*(const Cflue__V1__Record *const *)a)->id,
                  (*(const Cflue__V1__Record *const *)b)->id);
}

/* result_of finds a tool_result record by id in the sorted index. */
static const Cflue__V1__Record *result_of(const Cflue__V1__Record **index, size_t n, const char *id)
{
    Cflue__V1__Record key = CFLUE__V1__RECORD__INIT;
    const Cflue__V1__Record *k = &key, **hit;
    key.id = (char *)id;
    hit = bsearch(&k, index, n, sizeof(*index), cmp_record_id);
    return hit ? *hit : NULL;
}

static void build_context(struct drive *d, struct context *c, json_t *bodies, int64_t before)
{
    const Cflue__V1__Record *r, *compaction = NULL, **results = NULL;
    int64_t first_kept = -1;
    size_t n_results = 0;
    /* one pass: the latest compaction, and an index of tool results by id (a conversation's
     * results are looked up once per call instead of by scanning the stream each time) */
    FOR_EACH_RECORD(d, r)
    {
        if (r->offset < before && !strcmp(r->type, "compaction")) {
            compaction = r;
        } else if (!strcmp(r->type, "tool_result")) {
            results = mem_realloc(results, sizeof(*results) * (n_results + 1));
            results[n_results++] = r;
        }
    }
    if (results) {
        qsort(results, n_results, sizeof(*results), cmp_record_id);
    }
    if (compaction) {
        /* the summary stands in for everything before the first kept record */
        json_t *b = json_loads(compaction->body_json, 0, NULL);
        json_array_append_new(bodies, b);
        first_kept = json_integer_value(json_object_get(b, "first_kept_offset"));
        char *t = NULL;
        if (asprintf(&t,
                     "<context_summary>\nThe earlier part of this conversation was compacted "
                     "into this summary:\n\n%s\n</context_summary>",
                     str(b, "summary")) < 0) {
            t = mem_strdup(str(b, "summary"));
        }
        struct llm_message *m = push(c);
        m->role = LLM_USER;
        m->text = keep(c, t);
    }
    FOR_EACH_RECORD(d, r)
    {
        if (r->offset >= before || r->offset < first_kept) {
            continue;
        }
        json_t *b = json_loads(r->body_json, 0, NULL);
        if (!b) {
            continue;
        }
        json_array_append_new(bodies, b);
        if (!strcmp(r->type, "user_message")) {
            struct llm_message *m = push(c);
            m->role = LLM_USER;
            m->text = str(b, "text");
            if (json_array_size(json_object_get(b, "attachments"))) {
                add_attachments(c, m, r->submission_id);
            }
        } else if (!strcmp(r->type, "signal")) {
            struct llm_message *m = push(c);
            char *t = NULL;
            if (asprintf(&t, "<signal type=\"%s\">\n%s\n</signal>", str(b, "type"),
                         str(b, "text")) < 0) {
                t = mem_strdup(str(b, "text"));
            }
            m->role = LLM_USER;
            m->text = keep(c, t);
        } else if (!strcmp(r->type, "assistant_message")) {
            json_t *calls = json_object_get(b, "tool_calls");
            size_t n = json_array_size(calls);
            struct llm_message *m = push(c);
            m->role = LLM_ASSISTANT;
            m->text = str(b, "text");
            struct llm_call *cs = n ? mem_alloc(sizeof(*cs) * n) : NULL;
            for (size_t k = 0; k < n; k++) {
                json_t *x = json_array_get(calls, k);
                cs[k].id = (char *)str(x, "id");
                cs[k].name = (char *)str(x, "name");
                cs[k].arguments_json = (char *)str(x, "arguments");
            }
            m->calls = cs;
            m->n_calls = n;
            /* its results, in call order, whenever they were recorded */
            for (size_t k = 0; k < n; k++) {
                char id[512];
                snprintf(id, sizeof(id), "tool:%s:%lld:%s", r->submission_id,
                         (long long)json_integer_value(json_object_get(b, "turn")), cs[k].id);
                const Cflue__V1__Record *res = result_of(results, n_results, id);
                json_t *rb = res ? json_loads(res->body_json, 0, NULL) : NULL;
                struct llm_message *t = push(c);
                t->role = LLM_TOOL_RESULT;
                t->tool_call_id = cs[k].id;
                t->tool_name = cs[k].name;
                if (rb) {
                    json_array_append_new(bodies, rb);
                    t->text = str(rb, "text");
                    t->is_error = json_is_true(json_object_get(rb, "is_error"));
                } else {
                    t->text = INTERRUPTED_RESULT;
                    t->is_error = true;
                }
            }
        }
    }
    free(results);
}

/* ---------- system prompt ---------- */

/* tools_channel returns the shared channel to the agent's toold (one per address, kept for
 * the life of the process so calls reuse the connection), or NULL without a sandbox. */
static struct rpc_channel *tools_channel(struct drive *d)
{
    static struct {
        char *addr;
        struct rpc_channel *ch;
    } cache[32];
    static int n;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    const char *addr = d->agent->sandbox_tools;
    struct rpc_channel *ch = NULL;
    if (!addr) {
        return NULL;
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n && !ch; i++) {
        if (!strcmp(cache[i].addr, addr)) {
            ch = cache[i].ch;
        }
    }
    if (!ch && n < 32) {
        cache[n].addr = mem_strdup(addr);
        ch = cache[n++].ch = rpc_channel_new(addr, 64 << 20);
    }
    pthread_mutex_unlock(&mu);
    return ch;
}

static char *compose_system_prompt(struct drive *d, const Cflue__V1__ListToolsResponse *tools)
{
    struct buf b;
    char when[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof(when), "%Y-%m-%d", &tm);
    buf_init(&b, 1 << 20);
    buf_append_str(&b, d->agent->instructions);
    struct rpc_channel *ch = tools_channel(d);
    if (ch) {
        /* project notes: AGENTS.md, else CLAUDE.md, from the working directory */
        const char *notes[] = {"AGENTS.md", "CLAUDE.md"};
        for (int i = 0; i < 2; i++) {
            Cflue__V1__ReadFileRequest rq = CFLUE__V1__READ_FILE_REQUEST__INIT;
            ProtobufCMessage *resp;
            struct rpc_status st;
            rq.sandbox = d->workspace;
            rq.path = (char *)notes[i];
            if (rpc_unary(ch, "/cflue.v1.Sandbox/ReadFile", &rq.base,
                          &cflue__v1__read_file_response__descriptor, 10000, &resp, &st)) {
                Cflue__V1__ReadFileResponse *f = (Cflue__V1__ReadFileResponse *)resp;
                buf_printf(&b, "\n\n## Project notes (%s)\n\n", notes[i]);
                utf8_sanitize(&b, (const char *)f->data.data,
                              f->data.len > 65536 ? 65536 : f->data.len);
                protobuf_c_message_free_unpacked(resp, NULL);
                break;
            }
        }
    }
    if (tools && tools->n_tools) {
        buf_append_str(&b, "\n\n## Tools you can call\n");
        for (size_t i = 0; i < tools->n_tools; i++) {
            const char *desc = tools->tools[i]->description;
            const char *dot = strchr(desc, '.');
            buf_printf(&b, "\n- %s: %.*s", tools->tools[i]->name,
                       dot ? (int)(dot - desc + 1) : (int)strlen(desc), desc);
        }
    }
    buf_printf(&b, "\n\n## Environment\n\nToday's date: %s", when);
    if (ch) {
        Cflue__V1__PathRequest rq = CFLUE__V1__PATH_REQUEST__INIT;
        ProtobufCMessage *resp;
        struct rpc_status st;
        rq.sandbox = d->workspace;
        rq.path = ".";
        if (tools && *tools->working_directory) {
            buf_printf(&b, "\nWorking directory: %s", tools->working_directory);
        }
        if (rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &rq.base,
                      &cflue__v1__read_dir_response__descriptor, 10000, &resp, &st)) {
            Cflue__V1__ReadDirResponse *r = (Cflue__V1__ReadDirResponse *)resp;
            buf_append_str(&b, "\nTop-level entries of the working directory:");
            size_t shown = r->n_entries < 200 ? r->n_entries : 200;
            for (size_t i = 0; i < shown; i++) {
                buf_printf(&b, "\n  %s%s", r->entries[i]->name,
                           r->entries[i]->type == CFLUE__V1__FILE_TYPE__DIRECTORY ? "/" : "");
            }
            if (r->n_entries > shown) {
                buf_printf(&b, "\n  ... and %zu more", r->n_entries - shown);
            }
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    }
    return buf_take(&b);
}

/* ---------- model calls ---------- */

static void flush_delta(struct drive *d)
{
    if (!d->delta.len) {
        return;
    }
    char id[512];
    snprintf(id, sizeof(id), "delta:%s:%d:%d", d->sub->submission_id, d->turn, d->delta_seq++);
    append_one(
        d, id, "assistant_delta", d->sub->submission_id,
        json_pack("{s:i, s:s%}", "turn", d->turn, "text", buf_cstr(&d->delta), d->delta.len));
    buf_reset(&d->delta);
    d->delta_flushed_ms = clock_mono_ms();
}

static void on_text(void *ctx, const char *p, size_t n)
{
    struct drive *d = ctx;
    if (d->quiet) {
        return;
    }
    if (buf_append(&d->delta, p, n) != CF_OK ||
        clock_mono_ms() - d->delta_flushed_ms > DELTA_FLUSH_MS) {
        flush_delta(d);
        if (buf_append(&d->delta, p, n) != CF_OK) {
            buf_reset(&d->delta);
        }
    }
}

static bool model_cancelled(void *ctx)
{
    return stopped(ctx);
}

static enum cf_status call_model(struct drive *d, const char *system, struct context *c,
                                 const struct llm_tool *tools, size_t n_tools,
                                 struct llm_response *out)
{
    const struct agent_def *a = d->agent;
    bool anthropic = !strcmp(a->provider, "anthropic");
    struct llm_request req = {.provider = a->provider,
                              .model = a->model_id,
                              .system = system,
                              .messages = c->msgs,
                              .n_messages = c->n,
                              .tools = tools,
                              .n_tools = n_tools,
                              .max_tokens = 8192,
                              .stream = g_agentd.stream};
    struct llm_events ev = {.on_text = on_text, .cancelled = model_cancelled, .ctx = d};
    const struct provider_endpoint *ep = anthropic ? &g_agentd.anthropic : &g_agentd.openai;
    enum cf_status rc = CF_UNAVAILABLE;
    for (int attempt = 0; attempt <= MODEL_RETRIES; attempt++) {
        llm_response_cleanup(out);
        llm_response_init(out);
        buf_reset(&d->delta);
        d->delta_flushed_ms = clock_mono_ms();
        rc = llm_complete(ep, &req, &ev, out, &d->err);
        flush_delta(d);
        if (rc == CF_OK || rc == CF_CANCELLED || !out->retryable || attempt == MODEL_RETRIES) {
            break;
        }
        int64_t wait = out->retry_after_ms > 0 ? out->retry_after_ms : (500LL << attempt);
        wait += rand() % 250;
        char q[600];
        log_warn("model_retry", "submission=%s attempt=%d wait_ms=%lld err=%s",
                 d->sub->submission_id, attempt + 1, (long long)wait,
                 log_quote(q, sizeof(q), d->err.msg));
        for (int64_t slept = 0; slept < wait && !stopped(d); slept += 100) {
            clock_sleep_ms(100);
        }
        if (stopped(d)) {
            return CF_CANCELLED;
        }
    }
    return rc;
}

/* ---------- tools ---------- */

struct toolset {
    Cflue__V1__ListToolsResponse *list;
    struct llm_tool *tools;
    size_t n;
};

static void load_tools(struct drive *d, struct toolset *ts)
{
    memset(ts, 0, sizeof(*ts));
    struct rpc_channel *ch = tools_channel(d);
    if (!ch) {
        return;
    }
    Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    rq.sandbox = d->workspace;
    if (rpc_unary(ch, "/cflue.v1.Tools/List", &rq.base, &cflue__v1__list_tools_response__descriptor,
                  10000, &resp, &st)) {
        ts->list = (Cflue__V1__ListToolsResponse *)resp;
        ts->n = ts->list->n_tools;
        ts->tools = mem_alloc(sizeof(*ts->tools) * (ts->n + 1));
        for (size_t i = 0; i < ts->n; i++) {
            ts->tools[i].name = ts->list->tools[i]->name;
            ts->tools[i].description = ts->list->tools[i]->description;
            ts->tools[i].schema_json = ts->list->tools[i]->parameters_json;
        }
    } else {
        log_warn("tools_unavailable", "submission=%s addr=%s err=%d", d->sub->submission_id,
                 d->agent->sandbox_tools, (int)st.code);
    }
}

/* drive_stopped adapts stopped() for a stream guard: the batch is cancelled on abort, lost
 * lease or shutdown, and toold then kills the commands of the cancelled calls. */
static bool drive_stopped(void *d)
{
    return stopped(d);
}

/* run_tools executes the calls of one assistant message that have no result yet, through
 * toold's ExecuteBatch, recording each result as it arrives. */
static void run_tools(struct drive *d, const struct llm_response *resp, const struct toolset *ts)
{
    size_t n = resp->n_calls;
    Cflue__V1__ToolCall *calls = mem_alloc(sizeof(*calls) * (n + 1));
    Cflue__V1__ToolCall **ptrs = mem_alloc(sizeof(void *) * (n + 1));
    int *index = mem_alloc(sizeof(int) * (n + 1));
    size_t m = 0;
    int64_t remaining = d->sub->timeout_at_ms ? d->sub->timeout_at_ms - clock_now_ms() : 0;
    for (size_t i = 0; i < n; i++) {
        const struct llm_call *c = &resp->calls[i];
        bool known = false;
        for (size_t k = 0; k < ts->n; k++) {
            known = known || !strcmp(ts->tools[k].name, c->name);
        }
        if (!known) {
            char text[512];
            snprintf(text, sizeof(text), "There is no tool named '%s' here.%s", c->name,
                     ts->n ? " Use one of the tools listed in your instructions." : "");
            record_result(d, (int)i, c->id, c->name, text, true, NULL);
            continue;
        }
        cflue__v1__tool_call__init(&calls[m]);
        calls[m].sandbox = d->workspace;
        calls[m].call_id = c->id;
        calls[m].name = c->name;
        calls[m].arguments_json = c->arguments_json;
        calls[m].timeout_ms = remaining > 0 ? remaining : 0;
        ptrs[m] = &calls[m];
        index[m] = (int)i;
        m++;
    }
    if (m) {
        struct rpc_channel *ch = tools_channel(d);
        Cflue__V1__ToolBatch batch = CFLUE__V1__TOOL_BATCH__INIT;
        batch.calls = ptrs;
        batch.n_calls = m;
        struct rpc_stream *s = rpc_stream_open(ch, "/cflue.v1.Tools/ExecuteBatch", &batch.base, 0);
        bool *done = mem_alloc(sizeof(bool) * (m + 1));
        ProtobufCMessage *msg;
        struct stream_guard guard;
        guard_start(&guard, s, drive_stopped, d);
        while (rpc_stream_read(s, &cflue__v1__batch_result__descriptor, &msg) == 1) {
            Cflue__V1__BatchResult *br = (Cflue__V1__BatchResult *)msg;
            if (br->index >= 0 && (size_t)br->index < m && br->result && !done[br->index]) {
                done[br->index] = true;
                const Cflue__V1__ToolCall *c = &calls[br->index];
                failpoint_hit("agentd.tools.before_record");
                if (!stopped(d) || d->act->abort_requested) {
                    record_result(d, index[br->index], c->call_id, c->name, br->result->text,
                                  br->result->is_error, br->result->truncation);
                }
            }
            protobuf_c_message_free_unpacked(msg, NULL);
        }
        guard_end(&guard);
        struct rpc_status st;
        rpc_stream_finish(s, &st);
        for (size_t k = 0; k < m; k++) {
            if (!done[k] && !stopped(d)) {
                char text[CF_ERROR_MSG_MAX + 128];
                snprintf(text, sizeof(text),
                         "The tool server did not return a result for this call (%.300s); "
                         "whether it took effect is unknown.",
                         st.details[0] ? st.details : "connection failed");
                record_result(d, index[k], calls[k].call_id, calls[k].name, text, true, NULL);
            }
        }
        free(done);
    }
    free(calls);
    free(ptrs);
    free(index);
}

/* ---------- joins ---------- */

/* absorb_joins appends the input of queued submissions behind this one and marks them
 * joined; returns how many joined. */
static int absorb_joins(struct drive *d)
{
    Cflue__V1__ClaimJoinableRequest req = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    req.host = &d->fence;
    if (store_call(g_agentd.store, "ClaimJoinable", &req.base,
                   &cflue__v1__claim_joinable_response__descriptor, STORE_TIMEOUT_MS, &resp,
                   &d->err) != CF_OK) {
        return 0;
    }
    Cflue__V1__ClaimJoinableResponse *r = (Cflue__V1__ClaimJoinableResponse *)resp;
    int joined = 0;
    for (size_t i = 0; i < r->n_submissions; i++) {
        const Cflue__V1__Submission *s = r->submissions[i];
        char id[256];
        snprintf(id, sizeof(id), "input:%s", s->submission_id);
        if (append_one(d, id, "user_message", s->submission_id,
                       json_pack("{s:s}", "text", s->message ? s->message->text : "")) != CF_OK) {
            break;
        }
        Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
        ProtobufCMessage *jresp = NULL;
        jr.host = &d->fence;
        jr.submission_id = s->submission_id;
        if (store_call(g_agentd.store, "FinalizeJoin", &jr.base, &cflue__v1__submission__descriptor,
                       STORE_TIMEOUT_MS, &jresp, &d->err) == CF_OK) {
            joined++;
            log_info("joined", "submission=%s host=%s", s->submission_id, d->sub->submission_id);
            protobuf_c_message_free_unpacked(jresp, NULL);
        }
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return joined;
}

/* ---------- compaction ----------
 *
 * When the next request would not leave the reserve free in the model's context window (or
 * the provider said the context overflowed, or someone asked with Compact), the older part of
 * the conversation is replaced by a summary the model writes. The most recent
 * keep_recent_tokens stay verbatim; the cut falls only before a user or assistant message, so
 * a tool call never loses its result. The summary and the offset of the first kept record go
 * into a `compaction` record; the system prompt is composed again (`system_prompt` record). */

static int64_t estimate_tokens(const char *system, const struct context *c,
                               const struct toolset *ts)
{
    size_t chars = strlen(system ? system : "");
    for (size_t i = 0; i < c->n; i++) {
        chars += strlen(c->msgs[i].text ? c->msgs[i].text : "") + 16;
        for (size_t k = 0; k < c->msgs[i].n_calls; k++) {
            chars += strlen(c->msgs[i].calls[k].arguments_json) + strlen(c->msgs[i].calls[k].name);
        }
    }
    for (size_t i = 0; ts && i < ts->n; i++) {
        chars += strlen(ts->tools[i].description) + strlen(ts->tools[i].schema_json);
    }
    return (int64_t)(chars / 4);
}

static int64_t reserve_tokens(const struct agent_def *a, const struct model_info *mi)
{
    if (a->reserve_tokens) {
        return a->reserve_tokens;
    }
    if (mi->context_window < 60000) {
        return mi->context_window / 3;
    }
    return mi->max_output_tokens < 20000 ? mi->max_output_tokens : 20000;
}

static bool over_threshold(struct drive *d, const char *system, const struct context *c,
                           const struct toolset *ts)
{
    struct model_info mi = catalog_lookup(d->agent->model);
    int64_t out = mi.max_output_tokens < 16384 ? mi.max_output_tokens : 16384;
    return estimate_tokens(system, c, ts) + out > mi.context_window - reserve_tokens(d->agent, &mi);
}

static bool is_message_start(const Cflue__V1__Record *r)
{
    return !strcmp(r->type, "user_message") || !strcmp(r->type, "assistant_message");
}

/* compact summarizes what comes before the cut; returns true when a compaction was recorded.
 * *system_text is replaced by the recomposed system prompt. */
static bool compact(struct drive *d, char **system_text, struct toolset *ts, const char *reason)
{
    const Cflue__V1__Record *r, *last_compaction = NULL;
    int64_t keep = d->agent->keep_recent_tokens ? d->agent->keep_recent_tokens : 8000;
    int64_t first = -1, cut = -1, tail = 0;
    FOR_EACH_RECORD(d, r)
    {
        if (!strcmp(r->type, "compaction")) {
            last_compaction = r;
        }
    }
    if (last_compaction) {
        json_t *b = json_loads(last_compaction->body_json, 0, NULL);
        first = json_integer_value(json_object_get(b, "first_kept_offset"));
        json_decref(b);
    }
    /* walk back from the end until keep tokens are behind us, then to a message start */
    for (size_t p = d->n_pages; p-- > 0 && cut < 0;) {
        for (size_t i = d->pages[p]->n_records; i-- > 0;) {
            r = d->pages[p]->records[i];
            if (r->offset < first) {
                break;
            }
            if (strcmp(r->type, "assistant_delta") != 0) {
                tail += (int64_t)strlen(r->body_json) / 4;
            }
            if (tail >= keep && is_message_start(r)) {
                cut = r->offset;
                break;
            }
        }
    }
    /* nothing older than the kept tail, or only the kept tail itself */
    if (cut < 0) {
        log_info("compaction_skipped", "submission=%s reason=%s", d->sub->submission_id, reason);
        return false;
    }
    bool older = false;
    FOR_EACH_RECORD(d, r)
    {
        older = older || (r->offset >= first && r->offset < cut && is_message_start(r));
    }
    if (!older) {
        log_info("compaction_skipped", "submission=%s reason=%s", d->sub->submission_id, reason);
        return false;
    }
    struct context ctx = {0};
    json_t *bodies = json_array();
    build_context(d, &ctx, bodies, cut);
    int64_t before = estimate_tokens(*system_text, &ctx, ts);
    struct llm_message *ask = push(&ctx);
    ask->role = LLM_USER;
    ask->text = "Write a summary of the conversation above for your own later use; it will "
                "replace those messages. Keep: the user's goals and requests, decisions made and "
                "why, facts learned, files read or changed and their current state, commands "
                "run and their results, and what is still open. Be complete but brief. Answer "
                "with the summary only.";
    struct llm_response resp;
    llm_response_init(&resp);
    d->quiet = true;
    enum cf_status rc =
        call_model(d, "You write faithful, compact summaries of agent work.", &ctx, NULL, 0, &resp);
    d->quiet = false;
    context_free(&ctx);
    json_decref(bodies);
    if (rc != CF_OK || !resp.text.len) {
        char q[600];
        log_warn("compaction_failed", "submission=%s err=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), rc == CF_OK ? "empty summary" : d->err.msg));
        llm_response_cleanup(&resp);
        return false;
    }
    char id[256];
    int n = 1;
    FOR_EACH_RECORD(d, r)
    {
        n += !strcmp(r->type, "compaction");
    }
    snprintf(id, sizeof(id), "compaction:%s:%d", d->sub->submission_id, n);
    int64_t after = (int64_t)resp.text.len / 4 + tail;
    append_one(d, id, "compaction", d->sub->submission_id,
               json_pack("{s:s%, s:I, s:I, s:I, s:s}", "summary", buf_cstr(&resp.text),
                         resp.text.len, "first_kept_offset", (json_int_t)cut, "tokens_before",
                         (json_int_t)(before + tail), "tokens_after", (json_int_t)after, "reason",
                         reason));
    llm_response_cleanup(&resp);
    /* the system prompt is composed again after a compaction */
    char *fresh = compose_system_prompt(d, ts->list);
    snprintf(id, sizeof(id), "system:%d", n + 1);
    append_one(d, id, "system_prompt", "", json_pack("{s:s}", "text", fresh));
    free(*system_text);
    *system_text = fresh;
    log_info("compacted",
             "submission=%s reason=%s first_kept=%lld tokens_before=%lld "
             "tokens_after=%lld",
             d->sub->submission_id, reason, (long long)cut, (long long)(before + tail),
             (long long)after);
    sync_records(d);
    return true;
}

/* ---------- the drive ---------- */

static const Cflue__V1__Record *last_assistant(struct drive *d)
{
    const Cflue__V1__Record *r, *last = NULL;
    FOR_EACH_RECORD(d, r)
    {
        if (!strcmp(r->type, "assistant_message") &&
            !strcmp(r->submission_id, d->sub->submission_id)) {
            last = r;
        }
    }
    return last;
}

/* answered reports whether an earlier attempt already finished the work: the submission's
 * last assistant message asked for no tools and no input arrived after it. Such work settles
 * completed, whatever the budgets say: a finished answer is never thrown away. */
static bool answered(struct drive *d)
{
    const Cflue__V1__Record *r, *last = last_assistant(d);
    bool after = false, done = false;
    if (!last) {
        return false;
    }
    json_t *b = json_loads(last->body_json, 0, NULL);
    done = json_array_size(json_object_get(b, "tool_calls")) == 0;
    json_decref(b);
    FOR_EACH_RECORD(d, r)
    {
        if (r == last) {
            after = true;
        } else if (after && !strcmp(r->type, "user_message")) {
            done = false;
        }
    }
    return done;
}

/* repair gives every unresolved call of the last assistant message a recorded outcome. */
static void repair(struct drive *d, const Cflue__V1__Record *last)
{
    json_t *b = json_loads(last->body_json, 0, NULL);
    json_t *calls = json_object_get(b, "tool_calls");
    int turn = (int)json_integer_value(json_object_get(b, "turn"));
    for (size_t k = 0; k < json_array_size(calls); k++) {
        json_t *c = json_array_get(calls, k);
        char id[512];
        snprintf(id, sizeof(id), "tool:%s:%d:%s", d->sub->submission_id, turn, str(c, "id"));
        if (!find_record(d, id)) {
            int saved = d->turn;
            d->turn = turn;
            record_result(d, (int)k, str(c, "id"), str(c, "name"), INTERRUPTED_RESULT, true, NULL);
            d->turn = saved;
            log_info("tool_outcome_unknown", "submission=%s call=%s", d->sub->submission_id,
                     str(c, "id"));
        }
    }
    json_decref(b);
}

static void finish(struct drive *d)
{
    for (size_t i = 0; i < d->n_pages; i++) {
        protobuf_c_message_free_unpacked(&d->pages[i]->base, NULL);
    }
    free(d->pages);
    buf_cleanup(&d->delta);
}

void turn_drive(const Cflue__V1__ClaimResponse *claim)
{
    struct drive d = {.sub = claim->submission, .cursor = -1};
    char q[600];
    d.fence = *claim->fence;
    buf_init(&d.delta, 64 * 1024);
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < ACTIVE_MAX && !d.act; i++) {
        if (!g_agentd.active[i].in_use) {
            d.act = &g_agentd.active[i];
            memset(d.act, 0, sizeof(*d.act));
            d.act->in_use = true;
            snprintf(d.act->submission_id, sizeof(d.act->submission_id), "%s",
                     d.sub->submission_id);
            snprintf(d.act->attempt_id, sizeof(d.act->attempt_id), "%s", d.fence.attempt_id);
            d.act->epoch = d.fence.epoch;
            d.act->abort_requested = d.sub->abort_requested_at_ms != 0;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    if (!d.act) {
        finish(&d);
        return; /* lease expires; another worker or process takes it */
    }
    log_info("drive", "submission=%s conversation=%s attempt=%s count=%d takeover=%d",
             d.sub->submission_id, d.sub->conversation_id, d.fence.attempt_id, d.sub->attempt_count,
             (int)claim->takeover);
    d.agent = agents_find(&g_agentd.agents, d.sub->agent);
    if (!d.agent) {
        settle(&d, CFLUE__V1__OUTCOME__FAILED, "this agentd has no agent with that name");
        goto out;
    }
    snprintf(d.workspace, sizeof(d.workspace), "%s",
             d.agent->sandbox_workspace ? d.agent->sandbox_workspace : d.agent->name);
    if (d.agent->sandbox_workspace && !strcmp(d.agent->sandbox_workspace, "{conversation}")) {
        snprintf(d.workspace, sizeof(d.workspace), "%s", d.sub->conversation_id);
    }
    if (sync_records(&d) != CF_OK) {
        log_warn("read_failed", "submission=%s err=%s", d.sub->submission_id,
                 log_quote(q, sizeof(q), d.err.msg));
        goto out;
    }
    if (claim->takeover && answered(&d)) {
        log_info("recovered_answer", "submission=%s", d.sub->submission_id);
        settle(&d, CFLUE__V1__OUTCOME__COMPLETED, NULL);
        goto out;
    }
    if (d.sub->max_attempts && d.sub->attempt_count > d.sub->max_attempts) {
        const Cflue__V1__Record *last = last_assistant(&d);
        if (last) {
            repair(&d, last);
        }
        snprintf(q, sizeof(q), "gave up after %d attempts: the work was interrupted each time",
                 d.sub->attempt_count - 1);
        settle(&d, CFLUE__V1__OUTCOME__FAILED, q);
        goto out;
    }
    if (d.sub->timeout_at_ms && clock_now_ms() >= d.sub->timeout_at_ms) {
        settle(&d, CFLUE__V1__OUTCOME__FAILED, "the submission ran past its time limit");
        goto out;
    }
    bool compact_request = false;
    for (size_t i = 0; i < d.sub->n_metadata; i++) {
        compact_request = compact_request || (!strcmp(d.sub->metadata[i]->key, "cflue.kind") &&
                                              !strcmp(d.sub->metadata[i]->value, "compact"));
    }
    char input_id[256];
    snprintf(input_id, sizeof(input_id), "input:%s", d.sub->submission_id);
    if (d.act->abort_requested && !find_record(&d, input_id)) {
        /* aborted before it started: its message never enters the conversation */
        settle(&d, CFLUE__V1__OUTCOME__ABORTED, "aborted on request before it started");
        goto out;
    }
    if (!compact_request && !find_record(&d, input_id)) {
        json_t *body = json_pack("{s:s}", "text", d.sub->message ? d.sub->message->text : "");
        if (d.sub->message && d.sub->message->n_attachments) {
            json_t *atts = json_array();
            for (size_t i = 0; i < d.sub->message->n_attachments; i++) {
                json_array_append_new(
                    atts, json_pack("{s:s, s:s, s:I}", "name", d.sub->message->attachments[i]->name,
                                    "mime_type", d.sub->message->attachments[i]->mime_type, "bytes",
                                    (json_int_t)d.sub->message->attachments[i]->data.len));
            }
            json_object_set_new(body, "attachments", atts);
        }
        if (append_one(&d, input_id, "user_message", d.sub->submission_id, body) != CF_OK) {
            goto out;
        }
    }
    {
        Cflue__V1__MarkInputAppliedRequest mr = CFLUE__V1__MARK_INPUT_APPLIED_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        mr.fence = &d.fence;
        mr.max_attempts = d.agent->max_attempts;
        mr.timeout_ms = d.agent->timeout_ms;
        if (store_call(g_agentd.store, "MarkInputApplied", &mr.base,
                       &cflue__v1__submission__descriptor, STORE_TIMEOUT_MS, &resp,
                       &d.err) != CF_OK) {
            goto out;
        }
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    const Cflue__V1__Record *last = last_assistant(&d);
    if (last) {
        repair(&d, last);
    }
    if (d.act->abort_requested) {
        settle(&d, CFLUE__V1__OUTCOME__ABORTED, "aborted on request");
        goto out;
    }

    struct toolset ts;
    load_tools(&d, &ts);
    /* the system prompt is frozen: composed once per conversation (and after each
     * compaction), then read back */
    const Cflue__V1__Record *sys = NULL, *sr;
    FOR_EACH_RECORD(&d, sr)
    {
        if (!strcmp(sr->type, "system_prompt")) {
            sys = sr;
        }
    }
    char *system_text = NULL;
    if (!sys) {
        system_text = compose_system_prompt(&d, ts.list);
        append_one(&d, "system:1", "system_prompt", "", json_pack("{s:s}", "text", system_text));
    } else {
        json_t *b = json_loads(sys->body_json, 0, NULL);
        system_text = mem_strdup(str(b, "text"));
        json_decref(b);
    }
    if (!compact_request) {
        absorb_joins(&d);
    }
    {
        const Cflue__V1__Record *r;
        d.turn = 0;
        FOR_EACH_RECORD(&d, r)
        {
            if (!strcmp(r->type, "assistant_message") &&
                !strcmp(r->submission_id, d.sub->submission_id)) {
                d.turn++;
            }
        }
    }
    Cflue__V1__Outcome outcome = CFLUE__V1__OUTCOME__COMPLETED;
    char error[1024] = "";
    bool overflow_retried = false;
    if (compact_request) {
        /* a Compact request: compact now, whatever the size, and answer nothing else */
        compact(&d, &system_text, &ts, "requested");
        settle(&d, CFLUE__V1__OUTCOME__COMPLETED, NULL);
        goto done;
    }
    for (int guard = 0; guard < MAX_TURNS; guard++) {
        if (stopped(&d) || sync_records(&d) != CF_OK) {
            break;
        }
        struct context ctx = {0};
        json_t *bodies = json_array();
        build_context(&d, &ctx, bodies, INT64_MAX);
        if (over_threshold(&d, system_text, &ctx, &ts)) {
            context_free(&ctx);
            json_decref(bodies);
            compact(&d, &system_text, &ts, "threshold");
            ctx = (struct context){0};
            bodies = json_array();
            build_context(&d, &ctx, bodies, INT64_MAX);
        }
        struct llm_response resp;
        llm_response_init(&resp);
        enum cf_status rc = call_model(&d, system_text, &ctx, ts.tools, ts.n, &resp);
        context_free(&ctx);
        json_decref(bodies);
        if (rc != CF_OK && resp.context_overflow && !overflow_retried) {
            /* the provider says the context is too long: compact once, then ask again */
            overflow_retried = true;
            llm_response_cleanup(&resp);
            if (compact(&d, &system_text, &ts, "overflow")) {
                guard--;
                continue;
            }
            llm_response_init(&resp);
        }
        if (rc == CF_CANCELLED || stopped(&d)) {
            llm_response_cleanup(&resp);
            break;
        }
        if (rc != CF_OK) {
            outcome = CFLUE__V1__OUTCOME__FAILED;
            snprintf(error, sizeof(error), "model call failed: %s", d.err.msg);
            llm_response_cleanup(&resp);
            break;
        }
        failpoint_hit("agentd.model.after");
        json_t *calls = json_array();
        for (size_t i = 0; i < resp.n_calls; i++) {
            json_array_append_new(calls, json_pack("{s:s, s:s, s:s}", "id", resp.calls[i].id,
                                                   "name", resp.calls[i].name, "arguments",
                                                   resp.calls[i].arguments_json));
        }
        char id[256];
        snprintf(id, sizeof(id), "assistant:%s:%d", d.sub->submission_id, d.turn);
        struct model_info mi = catalog_lookup(d.agent->model);
        json_t *body = json_pack("{s:i, s:s, s:o, s:s, s:s, s:{s:I, s:I}, s:f}", "turn", d.turn,
                                 "text", buf_cstr(&resp.text), "tool_calls", calls, "stop_reason",
                                 resp.stop_reason, "model", d.agent->model, "usage", "input_tokens",
                                 (json_int_t)resp.input_tokens, "output_tokens",
                                 (json_int_t)resp.output_tokens, "cost_usd",
                                 catalog_cost(&mi, resp.input_tokens, resp.output_tokens));
        if (append_one(&d, id, "assistant_message", d.sub->submission_id, body) != CF_OK) {
            llm_response_cleanup(&resp);
            break;
        }
        bool more = resp.n_calls > 0;
        if (more) {
            run_tools(&d, &resp, &ts);
        }
        llm_response_cleanup(&resp);
        d.turn++;
        if (stopped(&d)) {
            break;
        }
        if (absorb_joins(&d) > 0) {
            more = true;
        }
        if (!more) {
            break;
        }
    }
    pthread_mutex_lock(&g_agentd.mu);
    bool aborted = d.act->abort_requested, lost = d.act->lease_lost, down = d.act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    if (lost || (down && !aborted)) {
        log_info("drive_stopped", "submission=%s reason=%s", d.sub->submission_id,
                 lost ? "lease_lost" : "shutdown");
    } else if (aborted) {
        sync_records(&d);
        const Cflue__V1__Record *l = last_assistant(&d);
        if (l) {
            repair(&d, l);
        }
        settle(&d, CFLUE__V1__OUTCOME__ABORTED, "aborted on request");
    } else {
        settle(&d, outcome, error[0] ? error : NULL);
    }
done:
    free(system_text);
    if (ts.list) {
        protobuf_c_message_free_unpacked(&ts.list->base, NULL);
    }
    free(ts.tools);
out:
    pthread_mutex_lock(&g_agentd.mu);
    d.act->in_use = false;
    pthread_mutex_unlock(&g_agentd.mu);
    finish(&d);
}
