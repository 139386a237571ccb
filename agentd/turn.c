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
 * Every record is a typed body (common.proto Record.body): user_message, system_prompt,
 * assistant_delta, assistant_message (its tool_calls and usage), tool_result (ToolCallResult;
 * the outcome-unknown result has outcome_unknown set), signal, compaction. Recovery reads the
 * typed fields; nothing here parses a record as JSON.
 *
 * A submission of kind SUBMISSION_KIND_COMPACT (Agent.Compact) carries no message: its drive
 * compacts the conversation and answers nothing.
 *
 * Settlement is one Store.Settle: storaged writes the submission_settled record and settles
 * joined submissions with their host in the same transaction.
 *
 * Failure paths. A drive ends in one of three ways (enum drive_end):
 *  - settled: an outcome was recorded. `completed` only when the stream, read back, ends with
 *    this work's assistant message asking for no tool (every call has its result); `failed`
 *    for a model error, the turn cap, the time limit or too many attempts; `aborted` on an
 *    abort intent. Calls still without a result get the outcome-unknown result first.
 *  - stopped: the lease was lost or the process is stopping; whoever holds the work next
 *    continues it.
 *  - interrupted: storaged or toold failed past the retry window (the first such failure is
 *    kept in d->fault). Nothing is settled: the worker claims the submission again later
 *    (main.c, own-owner reclaim), or another agentd takes it when the lease runs out, and
 *    recovery continues from the records. Every such attempt counts against max_attempts,
 *    which is checked before anything that can fail.
 * A sandboxed agent never reaches the model without its tool set, and a system prompt is
 * frozen only when every part of it (notes, tool roster, working directory, listing) was read.
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
#include "pbtime.h"
#include "record_kind.h"
#include "thread.h"
#include "utf8.h"

#include "cflue/v1/sandbox.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STORE_TIMEOUT_MS 15000
#define STORE_RETRY_MIN_MS 5000 /* a Store call is retried at least this long */
#define TOOLS_TIMEOUT_MS 10000  /* Tools.List and the Sandbox reads of the system prompt */
#define DELTA_FLUSH_MS 250
#define MODEL_RETRIES 3
#define MODEL_MIN_MS 1000 /* a model call needs at least this much of the time limit */

/* The result a tool call gets when an attempt ended before its outcome was recorded. */
#define INTERRUPTED_RESULT                                                                         \
    "This tool call was interrupted before its result was recorded; whether it took effect is "    \
    "unknown."

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
    int turn;              /* the model turn being taken, from 1 (AssistantMessage.turn) */
    bool quiet;            /* a call whose text is not shown to watchers (summaries) */
    bool compact_request;  /* this submission asks for a compaction, not an answer */
    int64_t timeout_at_ms; /* the time limit (epoch ms, 0: none), as storaged installed it */
    struct cf_error err;
    struct cf_error fault; /* the first storaged/toold failure: the attempt ends unsettled */
    int store_tries;       /* how many tries the last store_retry took */
};

static bool stopped(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool s = d->act->abort_requested || d->act->lease_lost || d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    return s;
}

static bool abort_seen(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool a = d->act->abort_requested;
    pthread_mutex_unlock(&g_agentd.mu);
    return a;
}

static void mark_lease_lost(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    d->act->lease_lost = true;
    pthread_mutex_unlock(&g_agentd.mu);
}

/* fault records why this attempt cannot go on (the first reason wins) and logs it. */
static void fault(struct drive *d, const char *what, const struct cf_error *e)
{
    if (d->fault.code != CF_OK) {
        return;
    }
    char q[600];
    cf_error_set(&d->fault, e->code != CF_OK ? e->code : CF_UNAVAILABLE, "%s: %s", what, e->msg);
    log_warn("drive_fault", "submission=%s attempt=%s err=%s", d->sub->submission_id,
             d->fence.attempt_id, log_quote(q, sizeof(q), d->fault.msg));
}

/* lost_or_down reports whether this attempt must not write any more: its lease was lost or
 * the process is stopping (an abort alone still lets it record the aborted outcome). */
static bool lost_or_down(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool b = d->act->lease_lost || d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    return b;
}

/* broken reports whether this attempt cannot go on writing: lost_or_down, or a fault. */
static bool broken(struct drive *d)
{
    return d->fault.code != CF_OK || lost_or_down(d);
}

/* halted reports whether the drive must stop taking steps: stopped, or a fault. */
static bool halted(struct drive *d)
{
    return d->fault.code != CF_OK || stopped(d);
}

/* transient reports whether a status from storaged or toold says "try again later". */
static bool transient(enum cf_status rc)
{
    return rc == CF_UNAVAILABLE || rc == CF_BUSY;
}

/* store_retry makes one Store call, retrying transient failures with backoff and jitter for
 * as long as this attempt may still hold its lease (at least STORE_RETRY_MIN_MS), unless the
 * lease is lost or the process stops (an abort still retries: the outcome must be recorded). Every
 * method retried here is idempotent for the same request. A stale fence (CF_STALE: ABORTED,
 * reason STALE_FENCE) marks the lease lost; CF_PRECONDITION (FAILED_PRECONDITION) is an answer
 * about the request, not about the lease. The last failure is in d->err. */
static enum cf_status store_retry(struct drive *d, const char *method, const ProtobufCMessage *req,
                                  const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    int64_t start = clock_mono_ms(), wait = 100;
    int64_t window =
        g_agentd.lease_ms > STORE_RETRY_MIN_MS ? g_agentd.lease_ms : STORE_RETRY_MIN_MS;
    for (d->store_tries = 1;; d->store_tries++) {
        *resp = NULL;
        enum cf_status rc =
            store_call(g_agentd.store, method, req, desc, STORE_TIMEOUT_MS, resp, &d->err);
        if (rc == CF_STALE) {
            mark_lease_lost(d); /* ABORTED, STALE_FENCE: another attempt holds the work */
        }
        if (!transient(rc) || lost_or_down(d) || clock_mono_ms() - start + wait > window) {
            return rc;
        }
        int64_t nap = wait + thread_jitter_ms(wait / 2 + 1);
        for (int64_t slept = 0; slept < nap && !lost_or_down(d); slept += 50) {
            clock_sleep_ms(50);
        }
        wait = wait * 2 < 2000 ? wait * 2 : 2000;
    }
}

/* ---------- records ---------- */

/* append writes records under the fence. Any failure but a stale fence (lease lost) is a
 * fault: a record the drive meant to write is missing, so it must not go on as if it were
 * there. */
static enum cf_status append(struct drive *d, Cflue__V1__Record **recs, size_t n)
{
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    req.fence = &d->fence;
    req.records = recs;
    req.n_records = n;
    enum cf_status rc =
        store_retry(d, "Append", &req.base, &cflue__v1__append_response__descriptor, &resp);
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    if (rc != CF_OK && rc != CF_STALE) {
        fault(d, "recording to the conversation failed", &d->err);
    }
    return rc;
}

/* append_one appends one record whose body is the typed message `body` (a Record.body type;
 * the caller keeps it). Its result is the drive's to check through halted(): a failure is also
 * kept as d->fault. */
static enum cf_status append_one(struct drive *d, const char *id, const char *submission_id,
                                 ProtobufCMessage *body)
{
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT, *recs[1] = {&rec};
    rec.id = (char *)id;
    rec.submission_id = (char *)(submission_id ? submission_id : "");
    if (!record_set_body(&rec, body)) {
        struct cf_error e;
        cf_error_set(&e, CF_INTERNAL, "record %s: %s is no record body", id,
                     body->descriptor->name);
        fault(d, "recording to the conversation failed", &e);
        return CF_INTERNAL;
    }
    return append(d, recs, 1);
}

/* append_input puts submission s's message into the conversation as its user_message record
 * `id` (input:<sub>): the text, and a reference to each attachment (the bytes stay with the
 * submission). */
static enum cf_status append_input(struct drive *d, const char *id, const Cflue__V1__Submission *s)
{
    const Cflue__V1__Message *msg = s->message;
    size_t n = msg ? msg->n_attachments : 0;
    Cflue__V1__UserMessage body = CFLUE__V1__USER_MESSAGE__INIT;
    Cflue__V1__AttachmentRef *refs = mem_alloc(sizeof(*refs) * (n + 1));
    Cflue__V1__AttachmentRef **ptrs = mem_alloc(sizeof(void *) * (n + 1));
    body.text = msg ? msg->text : "";
    for (size_t i = 0; i < n; i++) {
        cflue__v1__attachment_ref__init(&refs[i]);
        refs[i].name = msg->attachments[i]->name;
        refs[i].mime_type = msg->attachments[i]->mime_type;
        refs[i].size_bytes = (int64_t)msg->attachments[i]->data.len;
        ptrs[i] = &refs[i];
    }
    body.attachments = ptrs;
    body.n_attachments = n;
    enum cf_status rc = append_one(d, id, s->submission_id, &body.base);
    free(refs);
    free(ptrs);
    return rc;
}

/* sync_records reads every record after the cursor into d->pages. A failure is a fault. */
static enum cf_status sync_records(struct drive *d)
{
    for (;;) {
        Cflue__V1__ReadRequest req = CFLUE__V1__READ_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        req.conversation_id = d->sub->conversation_id;
        req.after_offset = d->cursor;
        req.page_size = 1000;
        enum cf_status rc =
            store_retry(d, "Read", &req.base, &cflue__v1__read_response__descriptor, &resp);
        if (rc != CF_OK) {
            fault(d, "reading the conversation failed", &d->err);
            return rc;
        }
        Cflue__V1__ReadResponse *page = (Cflue__V1__ReadResponse *)resp;
        /* the next page starts after the last record of this one (an empty next_page_token
         * says there is none yet) */
        bool done = !*page->next_page_token || !page->n_records;
        if (page->n_records) {
            d->cursor = page->records[page->n_records - 1]->offset;
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

/* own_assistant returns r's assistant message when r is one of this submission's, else NULL. */
static const Cflue__V1__AssistantMessage *own_assistant(struct drive *d, const Cflue__V1__Record *r)
{
    if (r->body_case != CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE ||
        strcmp(r->submission_id, d->sub->submission_id) != 0) {
        return NULL;
    }
    return r->assistant_message;
}

/* tool_result_id writes the deterministic id of the result of call `call_id` of turn `turn`. */
static void tool_result_id(char *out, size_t out_len, const char *submission_id, int turn,
                           const char *call_id)
{
    snprintf(out, out_len, "tool:%s:%d:%s", submission_id, turn, call_id);
}

/* ---------- settlement ---------- */

static bool answered(struct drive *d);
static void repair(struct drive *d);

/* drive_ended names how a drive ended when it did not settle: lease lost or shutdown (stopped)
 * or a fault (interrupted). */
static enum drive_end drive_ended(struct drive *d)
{
    char q[600];
    pthread_mutex_lock(&g_agentd.mu);
    bool lost = d->act->lease_lost, down = d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    if (lost || down) {
        log_info("drive_stopped", "submission=%s reason=%s", d->sub->submission_id,
                 lost ? "lease_lost" : "shutdown");
        return DRIVE_STOPPED;
    }
    log_warn("drive_interrupted", "submission=%s attempt=%s err=%s", d->sub->submission_id,
             d->fence.attempt_id, log_quote(q, sizeof(q), d->fault.msg));
    return DRIVE_INTERRUPTED;
}

/* settle records the outcome, with the usage of every turn this submission recorded across
 * attempts. Before a failed or aborted outcome, calls still without a result get the
 * outcome-unknown result. `completed` is recorded only when the stream, read back, shows the
 * finished answer (a Compact request excepted: it answers nothing); otherwise the attempt
 * ends interrupted and recovery continues the work. */
static enum drive_end settle(struct drive *d, Cflue__V1__Outcome outcome, const char *error)
{
    Cflue__V1__SettleRequest req = CFLUE__V1__SETTLE_REQUEST__INIT;
    Cflue__V1__Usage usage = CFLUE__V1__USAGE__INIT;
    ProtobufCMessage *resp = NULL;
    char cut[8192], q[600];
    req.fence = &d->fence;
    req.usage = &usage;
    req.outcome = outcome;
    if (error) {
        snprintf(cut, sizeof(cut), "%s", error);
        cut[utf8_prefix_len(cut, strlen(cut), 8000)] = '\0';
    }
    req.error =
        outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? "" : (char *)(error ? cut : "failed");
    bool have_records = sync_records(d) == CF_OK;
    if (outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED) {
        if (!have_records) {
            return drive_ended(d);
        }
        if (!d->compact_request && !answered(d)) {
            struct cf_error e;
            cf_error_set(&e, CF_INTERNAL,
                         "the stream does not end with a finished answer; not settling completed");
            fault(d, "settle", &e);
            return drive_ended(d);
        }
    } else if (have_records) {
        repair(d);
        if (d->fault.code != CF_OK) {
            return drive_ended(d);
        }
    } else if (transient(d->fault.code)) {
        return drive_ended(d); /* try again when storaged answers: calls need their results */
    }
    /* records storaged cannot give at all (a damaged database) do not keep a failed or
     * aborted outcome from being recorded */
    const Cflue__V1__Record *r;
    FOR_EACH_RECORD(d, r)
    {
        const Cflue__V1__AssistantMessage *am = own_assistant(d, r);
        if (am && am->usage) {
            usage.input_tokens += am->usage->input_tokens;
            usage.output_tokens += am->usage->output_tokens;
            usage.cost_usd += am->usage->cost_usd;
        }
    }
    failpoint_hit("agentd.settle.before");
    enum cf_status rc =
        store_retry(d, "Settle", &req.base, &cflue__v1__settle_response__descriptor, &resp);
    agentd_wake();
    if (rc != CF_OK) {
        log_warn("settle_failed", "submission=%s err=%s reason=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), d->err.msg), cf_error_reason(&d->err));
        if (rc == CF_PRECONDITION) {
            /* settled already with another outcome, or no longer this attempt's to settle:
             * nothing this attempt can write any more */
            mark_lease_lost(d);
        } else if (rc != CF_STALE) {
            fault(d, "settling failed", &d->err);
        }
        return drive_ended(d);
    }
    failpoint_hit("agentd.settle.after");
    Cflue__V1__SettleResponse *sr = (Cflue__V1__SettleResponse *)resp;
    log_info("settled", "submission=%s outcome=%s joined=%zu err=%s", d->sub->submission_id,
             outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? "completed"
             : outcome == CFLUE__V1__OUTCOME__OUTCOME_FAILED  ? "failed"
                                                              : "aborted",
             sr->n_settled_with, log_quote(q, sizeof(q), req.error));
    protobuf_c_message_free_unpacked(resp, NULL);
    return DRIVE_SETTLED;
}

/* ---------- tool results ---------- */

/* record_result appends a tool call's result (a ToolCallResult of the current turn); t, when
 * truncated, is recorded with it. outcome_unknown marks the result a call gets when it was cut
 * off before its outcome was recorded. A failure is a fault (see append). */
static void record_result(struct drive *d, int index, const char *call_id, const char *name,
                          const char *text, bool is_error, const Cflue__V1__Truncation *t,
                          bool outcome_unknown)
{
    char id[512];
    Cflue__V1__ToolCallResult body = CFLUE__V1__TOOL_CALL_RESULT__INIT;
    tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, call_id);
    body.turn = d->turn;
    body.index = index;
    body.tool_call_id = (char *)call_id;
    body.name = (char *)name;
    body.text = (char *)text;
    body.is_error = is_error;
    body.truncation = t && t->truncated ? (Cflue__V1__Truncation *)t : NULL;
    body.outcome_unknown = outcome_unknown;
    append_one(d, id, d->sub->submission_id, &body.base);
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
static void add_attachments(struct drive *d, struct context *c, struct llm_message *m,
                            const char *submission_id)
{
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    gr.submission_id = (char *)submission_id;
    if (store_retry(d, "Get", &gr.base, &cflue__v1__submission__descriptor, &resp) != CF_OK) {
        /* the model must not see the message without what it carried */
        fault(d, "reading a message's attachments failed", &d->err);
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

/* build_context turns the records before offset `before` into provider-neutral messages. The
 * messages point into the records' typed bodies (d->pages), which outlive the context. */
static void build_context(struct drive *d, struct context *c, int64_t before)
{
    const Cflue__V1__Record *r, *compaction = NULL, **results = NULL;
    int64_t first_kept = -1;
    size_t n_results = 0;
    /* one pass: the latest compaction, and an index of tool results by id (a conversation's
     * results are looked up once per call instead of by scanning the stream each time) */
    FOR_EACH_RECORD(d, r)
    {
        if (r->offset < before && r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION) {
            compaction = r;
        } else if (r->body_case == CFLUE__V1__RECORD__BODY_TOOL_RESULT) {
            results = mem_realloc(results, sizeof(*results) * (n_results + 1));
            results[n_results++] = r;
        }
    }
    if (results) {
        qsort(results, n_results, sizeof(*results), cmp_record_id);
    }
    if (compaction) {
        /* the summary stands in for everything before the first kept record */
        first_kept = compaction->compaction->first_kept_offset;
        char *t = mem_asprintf("<context_summary>\nThe earlier part of this conversation was "
                               "compacted into this summary:\n\n%s\n</context_summary>",
                               compaction->compaction->summary);
        struct llm_message *m = push(c);
        m->role = LLM_USER;
        m->text = keep(c, t);
    }
    FOR_EACH_RECORD(d, r)
    {
        if (r->offset >= before || r->offset < first_kept) {
            continue;
        }
        if (r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE) {
            struct llm_message *m = push(c);
            m->role = LLM_USER;
            m->text = r->user_message->text;
            if (r->user_message->n_attachments) {
                add_attachments(d, c, m, r->submission_id);
            }
        } else if (r->body_case == CFLUE__V1__RECORD__BODY_SIGNAL) {
            struct llm_message *m = push(c);
            char *t = mem_asprintf("<signal type=\"%s\">\n%s\n</signal>", r->signal->kind,
                                   r->signal->text);
            m->role = LLM_USER;
            m->text = keep(c, t);
        } else if (r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE) {
            const Cflue__V1__AssistantMessage *am = r->assistant_message;
            size_t n = am->n_tool_calls;
            struct llm_message *m = push(c);
            m->role = LLM_ASSISTANT;
            m->text = am->text;
            struct llm_call *cs = n ? mem_alloc(sizeof(*cs) * n) : NULL;
            for (size_t k = 0; k < n; k++) {
                cs[k].id = am->tool_calls[k]->id;
                cs[k].name = am->tool_calls[k]->name;
                cs[k].arguments_json = am->tool_calls[k]->arguments_json;
            }
            m->calls = cs;
            m->n_calls = n;
            /* its results, in call order, whenever they were recorded */
            for (size_t k = 0; k < n; k++) {
                char id[512];
                tool_result_id(id, sizeof(id), r->submission_id, am->turn, cs[k].id);
                const Cflue__V1__Record *res = result_of(results, n_results, id);
                struct llm_message *t = push(c);
                t->role = LLM_TOOL_RESULT;
                t->tool_call_id = cs[k].id;
                t->tool_name = cs[k].name;
                if (res) {
                    t->text = res->tool_result->text;
                    t->is_error = res->tool_result->is_error;
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

/* toold_failed reports whether a Tools/Sandbox call's status means toold itself failed (down,
 * overloaded, timed out, broken) rather than answering about the sandbox's files. Such a
 * failure is a fault: the drive ends interrupted and is resumed later. FAILED_PRECONDITION is
 * an answer (the sandbox's state does not allow the call: not a directory, say); ABORTED from
 * toold (no fence is involved) is a conflict that trying again later may clear, so it is a
 * failure, recorded as CF_UNAVAILABLE rather than as a lost lease. */
static bool toold_failed(struct drive *d, const char *what, const struct rpc_status *st)
{
    switch (st->code) {
    case GRPC_STATUS_OK:
    case GRPC_STATUS_NOT_FOUND:
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_FAILED_PRECONDITION:
    case GRPC_STATUS_PERMISSION_DENIED:
    case GRPC_STATUS_OUT_OF_RANGE:
    case GRPC_STATUS_ALREADY_EXISTS:
        return false;
    default: {
        struct cf_error e;
        enum cf_status code =
            st->code == GRPC_STATUS_ABORTED ? CF_UNAVAILABLE : status_from_grpc(st->code);
        cf_error_set(&e, code, "toold at %s: %s (grpc status %d, reason %s)",
                     d->agent->sandbox_tools, st->details[0] ? st->details : "call failed",
                     (int)st->code, st->reason[0] ? st->reason : "none");
        fault(d, what, &e);
        return true;
    }
    }
}

/* compose_system_prompt composes the frozen system prompt: instructions, project notes, tool
 * roster, date, working directory and top-level listing. Returns NULL (with a fault) when
 * toold could not be read: no prompt is ever frozen from a partial environment. */
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
                          &cflue__v1__read_file_response__descriptor, TOOLS_TIMEOUT_MS, &resp,
                          &st)) {
                Cflue__V1__ReadFileResponse *f = (Cflue__V1__ReadFileResponse *)resp;
                buf_printf(&b, "\n\n## Project notes (%s)\n\n", notes[i]);
                utf8_sanitize(&b, (const char *)f->data.data,
                              f->data.len > 65536 ? 65536 : f->data.len);
                protobuf_c_message_free_unpacked(resp, NULL);
                break;
            }
            if (toold_failed(d, "reading the project notes failed", &st)) {
                buf_cleanup(&b);
                return NULL;
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
        Cflue__V1__ReadDirRequest rq = CFLUE__V1__READ_DIR_REQUEST__INIT;
        ProtobufCMessage *resp;
        struct rpc_status st;
        rq.sandbox = d->workspace;
        rq.path = ".";
        rq.page_size = 200;
        if (tools && *tools->working_directory) {
            buf_printf(&b, "\nWorking directory: %s", tools->working_directory);
        }
        if (rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &rq.base,
                      &cflue__v1__read_dir_response__descriptor, TOOLS_TIMEOUT_MS, &resp, &st)) {
            Cflue__V1__ReadDirResponse *r = (Cflue__V1__ReadDirResponse *)resp;
            buf_append_str(&b, "\nTop-level entries of the working directory:");
            size_t shown = r->n_entries < 200 ? r->n_entries : 200;
            for (size_t i = 0; i < shown; i++) {
                buf_printf(&b, "\n  %s%s", r->entries[i]->name,
                           r->entries[i]->type == CFLUE__V1__FILE_TYPE__FILE_TYPE_DIRECTORY ? "/"
                                                                                            : "");
            }
            if (r->n_entries > shown || *r->next_page_token) {
                buf_append_str(&b, "\n  ... and more");
            }
            protobuf_c_message_free_unpacked(resp, NULL);
        } else if (toold_failed(d, "listing the working directory failed", &st)) {
            buf_cleanup(&b);
            return NULL;
        }
    }
    return buf_take(&b);
}

/* ---------- model calls ---------- */

/* flush_delta sends the streamed text so far to watchers. Deltas are a courtesy, not part of
 * the conversation: one quick try, no retry, no fault (the assistant_message that follows is
 * what counts). Ids carry the attempt, so a turn asked again never collides with the deltas
 * of an earlier attempt. */
static void flush_delta(struct drive *d)
{
    if (!d->delta.len) {
        return;
    }
    char id[512];
    snprintf(id, sizeof(id), "delta:%s:%d:%s:%d", d->sub->submission_id, d->turn,
             d->fence.attempt_id, d->delta_seq++);
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT, *recs[1] = {&rec};
    Cflue__V1__AssistantDelta body = CFLUE__V1__ASSISTANT_DELTA__INIT;
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&d->delta);
    rec.id = id;
    rec.submission_id = (char *)d->sub->submission_id;
    rec.body_case = CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA;
    rec.assistant_delta = &body;
    req.fence = &d->fence;
    req.records = recs;
    req.n_records = 1;
    struct cf_error err;
    if (store_call(g_agentd.store, "Append", &req.base, &cflue__v1__append_response__descriptor,
                   2000, &resp, &err) == CF_STALE) {
        mark_lease_lost(d);
    }
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
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

/* output_tokens is the output budget of every request to the agent's model: what the request
 * asks for (max_tokens) and what the compaction threshold counts are the same number. */
static int64_t output_tokens(const struct agent_def *a)
{
    struct model_info mi = catalog_lookup(a->model);
    return mi.max_output_tokens < 16384 ? mi.max_output_tokens : 16384;
}

/* time_left returns the milliseconds left before the submission's time limit, or INT64_MAX
 * when it has none. */
static int64_t time_left(struct drive *d)
{
    return d->timeout_at_ms ? d->timeout_at_ms - clock_now_ms() : INT64_MAX;
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
                              .max_tokens = output_tokens(a),
                              .stream = g_agentd.stream};
    struct llm_events ev = {.on_text = on_text, .cancelled = model_cancelled, .ctx = d};
    const struct provider_endpoint *ep = anthropic ? &g_agentd.anthropic : &g_agentd.openai;
    enum cf_status rc = CF_UNAVAILABLE;
    for (int attempt = 0; attempt <= MODEL_RETRIES; attempt++) {
        llm_response_cleanup(out);
        llm_response_init(out);
        buf_reset(&d->delta);
        d->delta_flushed_ms = clock_mono_ms();
        int64_t left = time_left(d);
        if (left < MODEL_MIN_MS) {
            return cf_error_set(&d->err, CF_DEADLINE, "the submission reached its time limit");
        }
        req.timeout_ms = left;
        rc = llm_complete(ep, &req, &ev, out, &d->err);
        flush_delta(d);
        if (rc == CF_OK || rc == CF_CANCELLED || !out->retryable || attempt == MODEL_RETRIES) {
            break;
        }
        int64_t wait = out->retry_after_ms > 0 ? out->retry_after_ms : (500LL << attempt);
        wait += thread_jitter_ms(250);
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

/* load_tools lists the sandbox's tools. A sandboxed agent whose toold cannot be reached gets a
 * fault, never an empty tool set. */
static void load_tools(struct drive *d, struct toolset *ts)
{
    memset(ts, 0, sizeof(*ts));
    struct rpc_channel *ch = tools_channel(d);
    if (!ch) {
        if (d->agent->sandbox_tools) {
            struct cf_error e;
            cf_error_set(&e, CF_BUSY,
                         "no channel to toold at %s: this agentd reaches at most "
                         "32 tool servers",
                         d->agent->sandbox_tools);
            fault(d, "listing the sandbox's tools failed", &e);
        }
        return;
    }
    Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    rq.sandbox = d->workspace;
    if (rpc_unary(ch, "/cflue.v1.Tools/List", &rq.base, &cflue__v1__list_tools_response__descriptor,
                  TOOLS_TIMEOUT_MS, &resp, &st)) {
        ts->list = (Cflue__V1__ListToolsResponse *)resp;
        ts->n = ts->list->n_tools;
        ts->tools = mem_alloc(sizeof(*ts->tools) * (ts->n + 1));
        for (size_t i = 0; i < ts->n; i++) {
            ts->tools[i].name = ts->list->tools[i]->name;
            ts->tools[i].description = ts->list->tools[i]->description;
            ts->tools[i].schema_json = ts->list->tools[i]->parameters_json;
        }
    } else if (!toold_failed(d, "listing the sandbox's tools failed", &st)) {
        /* toold answered but refused: that is no tool set either */
        struct cf_error e;
        cf_error_set(&e, status_from_grpc(st.code), "toold at %s refused Tools.List: %s",
                     d->agent->sandbox_tools, st.details);
        fault(d, "listing the sandbox's tools failed", &e);
    }
}

/* drive_halted adapts halted() for a stream guard: the batch is cancelled on abort, lost
 * lease, shutdown or a fault, and toold then kills the commands of the cancelled calls. */
static bool drive_halted(void *d)
{
    return halted(d);
}

/* run_tools executes the calls of one assistant message, through toold's ExecuteBatch,
 * recording each result as it arrives. toold failing mid-batch is a fault: the calls left
 * without a result get the outcome-unknown result when the work resumes. Each call's
 * timeout is what is left of the submission's time (the caller made sure some is left; at
 * least 1 ms is sent; unset means no limit). */
static void run_tools(struct drive *d, const struct llm_response *resp, const struct toolset *ts)
{
    size_t n = resp->n_calls;
    Cflue__V1__ToolCall *calls = mem_alloc(sizeof(*calls) * (n + 1));
    Cflue__V1__ToolCall **ptrs = mem_alloc(sizeof(void *) * (n + 1));
    Google__Protobuf__Duration *limits = mem_alloc(sizeof(*limits) * (n + 1));
    int *index = mem_alloc(sizeof(int) * (n + 1));
    size_t m = 0;
    int64_t left = time_left(d);
    for (size_t i = 0; i < n && d->fault.code == CF_OK; i++) {
        const struct llm_call *c = &resp->calls[i];
        bool known = false;
        for (size_t k = 0; k < ts->n; k++) {
            known = known || !strcmp(ts->tools[k].name, c->name);
        }
        if (!known) {
            char text[512];
            snprintf(text, sizeof(text), "There is no tool named '%s' here.%s", c->name,
                     ts->n ? " Use one of the tools listed in your instructions." : "");
            record_result(d, (int)i, c->id, c->name, text, true, NULL, false);
            continue;
        }
        cflue__v1__tool_call__init(&calls[m]);
        calls[m].sandbox = d->workspace;
        calls[m].call_id = c->id;
        calls[m].name = c->name;
        calls[m].arguments_json = c->arguments_json;
        if (left != INT64_MAX) {
            google__protobuf__duration__init(&limits[m]);
            pbdur_set(&limits[m], left > 1 ? left : 1);
            calls[m].timeout = &limits[m];
        }
        ptrs[m] = &calls[m];
        index[m] = (int)i;
        m++;
    }
    if (m && d->fault.code == CF_OK) {
        struct rpc_channel *ch = tools_channel(d);
        Cflue__V1__ToolBatch batch = CFLUE__V1__TOOL_BATCH__INIT;
        batch.calls = ptrs;
        batch.n_calls = m;
        struct rpc_stream *s = rpc_stream_open(ch, "/cflue.v1.Tools/ExecuteBatch", &batch.base, 0);
        bool *done = mem_alloc(sizeof(bool) * (m + 1));
        ProtobufCMessage *msg;
        struct stream_guard guard;
        struct cf_error gerr;
        if (guard_start(&guard, s, drive_halted, d, &gerr) != CF_OK) {
            fault(d, "the tool batch could not be watched", &gerr);
        }
        while (rpc_stream_read(s, &cflue__v1__batch_result__descriptor, &msg) == 1) {
            Cflue__V1__BatchResult *br = (Cflue__V1__BatchResult *)msg;
            if (br->index >= 0 && (size_t)br->index < m && br->result && !done[br->index]) {
                done[br->index] = true;
                const Cflue__V1__ToolCall *c = &calls[br->index];
                failpoint_hit("agentd.tools.before_record");
                if (d->fault.code == CF_OK && !lost_or_down(d)) {
                    record_result(d, index[br->index], c->call_id, c->name, br->result->text,
                                  br->result->is_error, br->result->truncation, false);
                }
            }
            protobuf_c_message_free_unpacked(msg, NULL);
        }
        guard_end(&guard);
        struct rpc_status st;
        (void)rpc_stream_finish(s, &st); /* st says how it ended, either way */
        bool missing = false;
        for (size_t k = 0; k < m; k++) {
            missing = missing || !done[k];
        }
        if (missing && !halted(d) && st.code == GRPC_STATUS_OK) {
            /* a stream that ended OK short of results is toold failing too */
            st.code = GRPC_STATUS_INTERNAL;
            snprintf(st.details, sizeof(st.details), "the batch ended with results missing");
        }
        if (missing && !halted(d) && !toold_failed(d, "the tool batch failed", &st)) {
            /* toold refused the batch (bad request): the model hears why */
            for (size_t k = 0; k < m && d->fault.code == CF_OK; k++) {
                if (!done[k]) {
                    char text[CF_ERROR_MSG_MAX + 128];
                    snprintf(text, sizeof(text),
                             "The tool server refused this call (%.300s); it did not run.",
                             st.details);
                    record_result(d, index[k], calls[k].call_id, calls[k].name, text, true, NULL,
                                  false);
                }
            }
        }
        free(done);
    }
    free(calls);
    free(ptrs);
    free(limits);
    free(index);
}

/* ---------- joins ---------- */

/* list_joining lists the deliveries JOINING into this host, in admission order. A failure is
 * a fault. */
static Cflue__V1__ListResponse *list_joining(struct drive *d)
{
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    Cflue__V1__SubmissionStatus joining = CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING;
    ProtobufCMessage *resp = NULL;
    lr.conversation_id = d->sub->conversation_id;
    lr.joined_into = d->sub->submission_id;
    lr.statuses = &joining;
    lr.n_statuses = 1;
    lr.page_size = 1000;
    if (store_retry(d, "List", &lr.base, &cflue__v1__list_response__descriptor, &resp) != CF_OK) {
        if (!lost_or_down(d)) {
            fault(d, "listing joining messages failed", &d->err);
        }
        return NULL;
    }
    return (Cflue__V1__ListResponse *)resp;
}

/* absorb_joins appends the input of queued submissions behind this one and marks them
 * joined; returns how many joined. A failure is a fault (deliveries left JOINING go back to
 * the queue when this submission settles). */
static int absorb_joins(struct drive *d)
{
    Cflue__V1__ClaimJoinableRequest req = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    req.host = &d->fence;
    if (store_retry(d, "ClaimJoinable", &req.base, &cflue__v1__claim_joinable_response__descriptor,
                    &resp) != CF_OK) {
        if (!lost_or_down(d)) {
            fault(d, "claiming joinable messages failed", &d->err);
        }
        return 0;
    }
    Cflue__V1__Submission **subs = ((Cflue__V1__ClaimJoinableResponse *)resp)->submissions;
    size_t n = ((Cflue__V1__ClaimJoinableResponse *)resp)->n_submissions;
    if (d->store_tries > 1) {
        /* an earlier try may have claimed deliveries and lost the answer: they are JOINING
         * into this host too, and come first. Take the whole set, in admission order. */
        protobuf_c_message_free_unpacked(resp, NULL);
        Cflue__V1__ListResponse *l = list_joining(d);
        if (!l) {
            return 0;
        }
        resp = &l->base;
        subs = l->submissions;
        n = l->n_submissions;
    }
    int joined = 0;
    for (size_t i = 0; i < n; i++) {
        const Cflue__V1__Submission *s = subs[i];
        char id[256];
        snprintf(id, sizeof(id), "input:%s", s->submission_id);
        if (append_input(d, id, s) != CF_OK) {
            break;
        }
        Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
        ProtobufCMessage *jresp = NULL;
        jr.host = &d->fence;
        jr.submission_id = s->submission_id;
        enum cf_status rc =
            store_retry(d, "FinalizeJoin", &jr.base, &cflue__v1__submission__descriptor, &jresp);
        if (rc == CF_OK) {
            log_info("joined", "submission=%s host=%s", s->submission_id, d->sub->submission_id);
            protobuf_c_message_free_unpacked(jresp, NULL);
        } else if (rc != CF_STALE && rc != CF_PRECONDITION) {
            /* CF_STALE: this host's lease is lost (store_retry marked it); CF_PRECONDITION:
             * the delivery is no longer joining into this host */
            fault(d, "finishing a join failed", &d->err);
            break;
        }
        /* its input is in the stream either way: the model answers it now (a delivery that
         * was not finalized goes back to the queue and finds its input already there) */
        joined++;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return joined;
}

/* settle_earlier_joins finishes what an earlier attempt of this host left half-joined:
 * deliveries still JOINING into it whose input is already in the stream are finalized (the
 * model sees them now), the others go back to the queue (ClaimJoinable then takes them in
 * admission order). Without this, a takeover would join later messages past them. */
static void settle_earlier_joins(struct drive *d)
{
    Cflue__V1__ListResponse *l = list_joining(d);
    if (!l) {
        return;
    }
    for (size_t i = 0; i < l->n_submissions && !broken(d); i++) {
        const char *sid = l->submissions[i]->submission_id;
        char input_id[256];
        snprintf(input_id, sizeof(input_id), "input:%s", sid);
        bool landed = find_record(d, input_id) != NULL;
        Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
        ProtobufCMessage *jresp = NULL;
        jr.host = &d->fence;
        jr.submission_id = (char *)sid;
        enum cf_status rc = store_retry(d, landed ? "FinalizeJoin" : "RevertJoin", &jr.base,
                                        &cflue__v1__submission__descriptor, &jresp);
        if (jresp) {
            protobuf_c_message_free_unpacked(jresp, NULL);
        }
        if (rc != CF_OK && rc != CF_STALE && rc != CF_PRECONDITION) {
            fault(d, "settling a half-joined message failed", &d->err);
        } else if (rc == CF_OK) {
            log_info(landed ? "join_adopted" : "join_reverted", "submission=%s host=%s", sid,
                     d->sub->submission_id);
        }
    }
    protobuf_c_message_free_unpacked(&l->base, NULL);
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
    return estimate_tokens(system, c, ts) + output_tokens(d->agent) >
           mi.context_window - reserve_tokens(d->agent, &mi);
}

static bool is_message_start(const Cflue__V1__Record *r)
{
    return r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE ||
           r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE;
}

enum compact_result {
    COMPACT_DONE,    /* a compaction record and a recomposed system prompt were recorded */
    COMPACT_NOTHING, /* nothing older than the kept tail: nothing to do */
    COMPACT_FAILED,  /* the summary could not be had from the model (d->err), or a fault */
};

/* trigger_name names why a compaction ran, for the log. */
static const char *trigger_name(Cflue__V1__CompactionTrigger t)
{
    switch (t) {
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_THRESHOLD:
        return "threshold";
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW:
        return "overflow";
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST:
        return "requested";
    default:
        return "unspecified";
    }
}

/* record_chars estimates how much of the model's context a record takes: its body's encoded
 * size (text dominates it); deltas take none (the context never holds them). */
static int64_t record_chars(const Cflue__V1__Record *r)
{
    const ProtobufCMessage *body = record_body(r);
    if (!body || r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA) {
        return 0;
    }
    return (int64_t)protobuf_c_message_get_packed_size(body);
}

/* compact summarizes what comes before the cut. On COMPACT_DONE, *system_text is replaced by
 * the recomposed system prompt. */
static enum compact_result compact(struct drive *d, char **system_text, struct toolset *ts,
                                   Cflue__V1__CompactionTrigger trigger)
{
    const char *reason = trigger_name(trigger);
    const Cflue__V1__Record *r, *last_compaction = NULL;
    int64_t keep = d->agent->keep_recent_tokens ? d->agent->keep_recent_tokens : 8000;
    int64_t first = -1, cut = -1, tail = 0;
    FOR_EACH_RECORD(d, r)
    {
        if (r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION) {
            last_compaction = r;
        }
    }
    if (last_compaction) {
        first = last_compaction->compaction->first_kept_offset;
    }
    /* walk back from the end until keep tokens are behind us, then to a message start */
    for (size_t p = d->n_pages; p-- > 0 && cut < 0;) {
        for (size_t i = d->pages[p]->n_records; i-- > 0;) {
            r = d->pages[p]->records[i];
            if (r->offset < first) {
                break;
            }
            tail += record_chars(r) / 4;
            if (tail >= keep && is_message_start(r)) {
                cut = r->offset;
                break;
            }
        }
    }
    /* nothing older than the kept tail, or only the kept tail itself */
    if (cut < 0) {
        log_info("compaction_skipped", "submission=%s reason=%s", d->sub->submission_id, reason);
        return COMPACT_NOTHING;
    }
    bool older = false;
    FOR_EACH_RECORD(d, r)
    {
        older = older || (r->offset >= first && r->offset < cut && is_message_start(r));
    }
    if (!older) {
        log_info("compaction_skipped", "submission=%s reason=%s", d->sub->submission_id, reason);
        return COMPACT_NOTHING;
    }
    struct context ctx = {0};
    build_context(d, &ctx, cut);
    if (d->fault.code != CF_OK) {
        context_free(&ctx);
        return COMPACT_FAILED;
    }
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
    if (rc != CF_OK || !resp.text.len) {
        char q[600];
        log_warn("compaction_failed", "submission=%s err=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), rc == CF_OK ? "empty summary" : d->err.msg));
        llm_response_cleanup(&resp);
        return COMPACT_FAILED;
    }
    char id[256];
    int n = 1;
    FOR_EACH_RECORD(d, r)
    {
        n += r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION;
    }
    snprintf(id, sizeof(id), "compaction:%s:%d", d->sub->submission_id, n);
    int64_t after = (int64_t)resp.text.len / 4 + tail;
    Cflue__V1__Compaction body = CFLUE__V1__COMPACTION__INIT;
    body.summary = (char *)buf_cstr(&resp.text);
    body.first_kept_offset = cut;
    body.tokens_before = before + tail;
    body.tokens_after = after;
    body.trigger = trigger;
    append_one(d, id, d->sub->submission_id, &body.base);
    llm_response_cleanup(&resp);
    if (d->fault.code != CF_OK) {
        return COMPACT_FAILED;
    }
    /* the system prompt is composed again after a compaction (a fault here leaves the
     * compaction without its prompt; the next attempt composes it, see frozen_system_prompt) */
    char *fresh = compose_system_prompt(d, ts->list);
    if (!fresh) {
        return COMPACT_FAILED;
    }
    snprintf(id, sizeof(id), "system:%d", n + 1);
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    sp.text = fresh;
    append_one(d, id, "", &sp.base);
    free(*system_text);
    *system_text = fresh;
    log_info("compacted",
             "submission=%s reason=%s first_kept=%lld tokens_before=%lld "
             "tokens_after=%lld",
             d->sub->submission_id, reason, (long long)cut, (long long)(before + tail),
             (long long)after);
    sync_records(d);
    return d->fault.code == CF_OK ? COMPACT_DONE : COMPACT_FAILED;
}

/* ---------- the drive ---------- */

static const Cflue__V1__Record *last_assistant(struct drive *d)
{
    const Cflue__V1__Record *r, *last = NULL;
    FOR_EACH_RECORD(d, r)
    {
        if (own_assistant(d, r)) {
            last = r;
        }
    }
    return last;
}

/* unresolved_calls counts this submission's tool calls that have no recorded result; with
 * fix set, it records the outcome-unknown result for each (failures are faults). */
static size_t unresolved_calls(struct drive *d, bool fix)
{
    const Cflue__V1__Record *r;
    size_t missing = 0;
    FOR_EACH_RECORD(d, r)
    {
        const Cflue__V1__AssistantMessage *am = own_assistant(d, r);
        for (size_t k = 0; am && k < am->n_tool_calls && d->fault.code == CF_OK; k++) {
            const Cflue__V1__ToolCallRequest *c = am->tool_calls[k];
            char id[512];
            tool_result_id(id, sizeof(id), d->sub->submission_id, am->turn, c->id);
            if (find_record(d, id)) {
                continue;
            }
            missing++;
            if (fix) {
                int saved = d->turn;
                d->turn = am->turn;
                record_result(d, (int)k, c->id, c->name, INTERRUPTED_RESULT, true, NULL, true);
                d->turn = saved;
                log_info("tool_outcome_unknown", "submission=%s call=%s", d->sub->submission_id,
                         c->id);
            }
        }
    }
    return missing;
}

/* answered reports whether the work is finished, as the stream shows it: the submission's last
 * assistant message asked for no tools, every call before it has its result, and no input
 * arrived after it. Such work settles completed, whatever the budgets say: a finished answer
 * is never thrown away. */
static bool answered(struct drive *d)
{
    const Cflue__V1__Record *r, *last = last_assistant(d);
    bool after = false, done = false;
    if (!last) {
        return false;
    }
    done = last->assistant_message->n_tool_calls == 0;
    FOR_EACH_RECORD(d, r)
    {
        if (r == last) {
            after = true;
        } else if (after && r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE) {
            done = false;
        }
    }
    return done && unresolved_calls(d, false) == 0;
}

/* repair gives every call of this submission still without a result the outcome-unknown
 * result (the call may or may not have happened). Failures are faults. */
static void repair(struct drive *d)
{
    unresolved_calls(d, true);
}

static void finish(struct drive *d)
{
    for (size_t i = 0; i < d->n_pages; i++) {
        protobuf_c_message_free_unpacked(&d->pages[i]->base, NULL);
    }
    free(d->pages);
    buf_cleanup(&d->delta);
}

/* begin_drive takes a slot in the active table (heartbeats and abort polling see it). */
static bool begin_drive(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < ACTIVE_MAX && !d->act; i++) {
        if (!g_agentd.active[i].in_use) {
            d->act = &g_agentd.active[i];
            memset(d->act, 0, sizeof(*d->act));
            d->act->in_use = true;
            snprintf(d->act->submission_id, sizeof(d->act->submission_id), "%s",
                     d->sub->submission_id);
            snprintf(d->act->attempt_id, sizeof(d->act->attempt_id), "%s", d->fence.attempt_id);
            d->act->epoch = d->fence.epoch;
            d->act->abort_requested = d->sub->abort_request_time != NULL;
            d->act->shutting_down = g_agentd.stopping;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return d->act != NULL;
}

/* mark_input_applied stamps the input as applied and installs the agent's budgets. */
static void mark_input_applied(struct drive *d)
{
    Cflue__V1__MarkInputAppliedRequest mr = CFLUE__V1__MARK_INPUT_APPLIED_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    mr.fence = &d->fence;
    Google__Protobuf__Duration limit = GOOGLE__PROTOBUF__DURATION__INIT;
    mr.max_attempts = d->agent->max_attempts;
    if (d->agent->timeout_ms > 0) {
        pbdur_set(&limit, d->agent->timeout_ms);
        mr.timeout = &limit;
    }
    if (store_retry(d, "MarkInputApplied", &mr.base, &cflue__v1__submission__descriptor, &resp) !=
        CF_OK) {
        if (!lost_or_down(d)) {
            fault(d, "marking the input applied failed", &d->err);
        }
        return;
    }
    /* the budgets as now installed (the claim carried the defaults) */
    const Cflue__V1__Submission *now = (const Cflue__V1__Submission *)resp;
    d->timeout_at_ms = pbtime_ms(now->deadline);
    protobuf_c_message_free_unpacked(resp, NULL);
}

/* frozen_system_prompt returns the conversation's system prompt: the latest one recorded, or
 * a new one composed and recorded when there is none yet or a compaction came after it.
 * NULL on a fault. */
static char *frozen_system_prompt(struct drive *d, const struct toolset *ts)
{
    const Cflue__V1__Record *r, *sys = NULL;
    int64_t compacted_at = -1;
    int compactions = 0;
    FOR_EACH_RECORD(d, r)
    {
        if (r->body_case == CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT) {
            sys = r;
        } else if (r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION) {
            compacted_at = r->offset;
            compactions++;
        }
    }
    if (sys && sys->offset > compacted_at) {
        return mem_strdup(sys->system_prompt->text);
    }
    char *text = compose_system_prompt(d, ts->list);
    if (!text) {
        return NULL;
    }
    char id[64];
    snprintf(id, sizeof(id), "system:%d", compactions + 1);
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    sp.text = text;
    append_one(d, id, "", &sp.base);
    if (d->fault.code != CF_OK) {
        free(text);
        return NULL;
    }
    return text;
}

/* record_answer records the model's complete answer as this turn's assistant_message
 * (assistant:<sub>:<turn>): text, tool calls, stop reason, model and usage with its cost. */
static enum cf_status record_answer(struct drive *d, const struct llm_response *resp)
{
    char id[256];
    struct model_info mi = catalog_lookup(d->agent->model);
    Cflue__V1__AssistantMessage body = CFLUE__V1__ASSISTANT_MESSAGE__INIT;
    Cflue__V1__Usage usage = CFLUE__V1__USAGE__INIT;
    Cflue__V1__ToolCallRequest *calls = mem_alloc(sizeof(*calls) * (resp->n_calls + 1));
    Cflue__V1__ToolCallRequest **ptrs = mem_alloc(sizeof(void *) * (resp->n_calls + 1));
    for (size_t i = 0; i < resp->n_calls; i++) {
        cflue__v1__tool_call_request__init(&calls[i]);
        calls[i].id = resp->calls[i].id;
        calls[i].name = resp->calls[i].name;
        calls[i].arguments_json = resp->calls[i].arguments_json;
        ptrs[i] = &calls[i];
    }
    usage.input_tokens = resp->input_tokens;
    usage.output_tokens = resp->output_tokens;
    usage.cost_usd = catalog_cost(&mi, resp->input_tokens, resp->output_tokens);
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&resp->text);
    body.tool_calls = ptrs;
    body.n_tool_calls = resp->n_calls;
    body.stop_reason = (char *)resp->stop_reason;
    body.model = (char *)d->agent->model;
    body.usage = &usage;
    snprintf(id, sizeof(id), "assistant:%s:%d", d->sub->submission_id, d->turn);
    enum cf_status rc = append_one(d, id, d->sub->submission_id, &body.base);
    free(calls);
    free(ptrs);
    return rc;
}

/* run_turns asks the model and runs its tools until it answers without a tool call and no
 * message is waiting to join. On a failed outcome, *error says why; on a fault or a stop it
 * just returns (the caller tells them apart). */
static Cflue__V1__Outcome run_turns(struct drive *d, char **system_text, struct toolset *ts,
                                    char *error, size_t error_len)
{
    bool overflow_retried = false;
    for (;;) {
        if (halted(d) || sync_records(d) != CF_OK) {
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
        if (d->turn > d->agent->max_turns) {
            snprintf(error, error_len,
                     "stopped after %lld model turns, the most this agent may take for one "
                     "message (durability.max_turns); the work is not finished",
                     (long long)d->agent->max_turns);
            return CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        }
        if (time_left(d) < MODEL_MIN_MS) {
            snprintf(error, error_len, "ran past its time limit before the work was finished");
            return CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        }
        struct context ctx = {0};
        build_context(d, &ctx, INT64_MAX);
        if (d->fault.code == CF_OK && over_threshold(d, *system_text, &ctx, ts)) {
            context_free(&ctx);
            compact(d, system_text, ts,
                    CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_THRESHOLD);
            ctx = (struct context){0};
            build_context(d, &ctx, INT64_MAX);
        }
        if (halted(d)) {
            context_free(&ctx);
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
        struct llm_response resp;
        llm_response_init(&resp);
        enum cf_status rc = call_model(d, *system_text, &ctx, ts->tools, ts->n, &resp);
        context_free(&ctx);
        if (rc != CF_OK && resp.context_overflow && !overflow_retried) {
            /* the provider says the context is too long: compact once, then ask again */
            overflow_retried = true;
            llm_response_cleanup(&resp);
            if (compact(d, system_text, ts,
                        CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW) ==
                COMPACT_DONE) {
                continue;
            }
            llm_response_init(&resp);
        }
        if (rc == CF_CANCELLED || halted(d)) {
            llm_response_cleanup(&resp);
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
        if (rc == CF_DEADLINE) {
            llm_response_cleanup(&resp);
            snprintf(error, error_len, "ran past its time limit before the work was finished");
            return CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        }
        if (rc != CF_OK) {
            snprintf(error, error_len, "model call failed: %s", d->err.msg);
            llm_response_cleanup(&resp);
            return CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        }
        failpoint_hit("agentd.model.after");
        if (record_answer(d, &resp) != CF_OK) {
            llm_response_cleanup(&resp);
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
        bool more = resp.n_calls > 0;
        if (more && time_left(d) <= 0) {
            /* the answer came at the limit: its calls are not started at all */
            for (size_t i = 0; i < resp.n_calls && d->fault.code == CF_OK; i++) {
                record_result(d, (int)i, resp.calls[i].id, resp.calls[i].name,
                              "This call was not run: the submission reached its time limit.", true,
                              NULL, false);
            }
            llm_response_cleanup(&resp);
            d->turn++;
            snprintf(error, error_len, "ran past its time limit before the work was finished");
            return CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        }
        if (more) {
            run_tools(d, &resp, ts);
        }
        llm_response_cleanup(&resp);
        d->turn++;
        if (halted(d)) {
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
        if (absorb_joins(d) > 0) {
            more = true;
        }
        if (!more) {
            return CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
        }
    }
}

/* unsettled ends a drive that stopped short of an outcome. An abort intent settles aborted.
 * A fault that trying again cannot mend (storaged refused a record as invalid, or an id as
 * taken by other content; toold refused the sandbox) settles failed with its reason instead of
 * spending every attempt on it. Anything else ends stopped or interrupted. */
static enum drive_end unsettled(struct drive *d)
{
    enum cf_status code = d->fault.code;
    if (lost_or_down(d)) {
        return drive_ended(d);
    }
    if (abort_seen(d)) {
        /* the abort is what counts now (a store failure comes back here on the next try) */
        cf_error_clear(&d->fault);
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    if (code != CF_INVALID && code != CF_EXISTS) {
        return drive_ended(d);
    }
    char why[CF_ERROR_MSG_MAX + 64];
    snprintf(why, sizeof(why), "cannot go on: %s", d->fault.msg);
    cf_error_clear(&d->fault);
    return settle(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED, why);
}

/* drive runs the claimed submission; see the essay at the top for the ways it ends. */
static enum drive_end drive(struct drive *d, bool takeover)
{
    char q[600];
    d->agent = agents_find(&g_agentd.agents, d->sub->agent);
    if (!d->agent) {
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED,
                      "this agentd has no agent with that name");
    }
    /* attempts first: whatever fails later, this attempt has been counted */
    if (d->sub->max_attempts && d->sub->attempt_count > d->sub->max_attempts) {
        if (sync_records(d) == CF_OK && answered(d)) {
            return settle(d, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, NULL);
        }
        if (abort_seen(d)) {
            return settle(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
        }
        snprintf(q, sizeof(q), "gave up after %d attempts: the work was interrupted each time",
                 d->sub->attempt_count - 1);
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED, q);
    }
    snprintf(d->workspace, sizeof(d->workspace), "%s",
             d->agent->sandbox_workspace ? d->agent->sandbox_workspace : d->agent->name);
    if (d->agent->sandbox_workspace && !strcmp(d->agent->sandbox_workspace, "{conversation}")) {
        snprintf(d->workspace, sizeof(d->workspace), "%s", d->sub->conversation_id);
    }
    if (sync_records(d) != CF_OK) {
        return unsettled(d);
    }
    if (takeover) {
        settle_earlier_joins(d);
        if (broken(d)) {
            return unsettled(d);
        }
    }
    if (takeover && answered(d)) {
        log_info("recovered_answer", "submission=%s", d->sub->submission_id);
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, NULL);
    }
    if (time_left(d) <= 0) {
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED,
                      "the submission ran past its time limit");
    }
    d->compact_request = d->sub->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
    char input_id[256];
    snprintf(input_id, sizeof(input_id), "input:%s", d->sub->submission_id);
    if (abort_seen(d) && !find_record(d, input_id)) {
        /* aborted before it started: its message never enters the conversation */
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED,
                      "aborted on request before it started");
    }
    if (!d->compact_request && !find_record(d, input_id)) {
        append_input(d, input_id, d->sub);
    }
    if (!halted(d)) {
        mark_input_applied(d);
    }
    if (!halted(d)) {
        repair(d);
    }
    if (abort_seen(d)) {
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    if (halted(d)) {
        return unsettled(d);
    }

    struct toolset ts;
    load_tools(d, &ts);
    char *system_text = halted(d) ? NULL : frozen_system_prompt(d, &ts);
    Cflue__V1__Outcome outcome = CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
    char error[1024] = "";
    if (system_text && d->compact_request) {
        /* a Compact request: compact now, whatever the size, and answer nothing else */
        enum compact_result cr = compact(d, &system_text, &ts,
                                         CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST);
        if (cr == COMPACT_FAILED && d->fault.code == CF_OK && !stopped(d)) {
            outcome = CFLUE__V1__OUTCOME__OUTCOME_FAILED;
            snprintf(error, sizeof(error), "the compaction failed: %s", d->err.msg);
        } else if (cr == COMPACT_NOTHING) {
            /* the request could not be done: it says so, with no record written */
            outcome = CFLUE__V1__OUTCOME__OUTCOME_FAILED;
            snprintf(error, sizeof(error), "%s", AGENTD_NOTHING_TO_COMPACT);
        }
    } else if (system_text) {
        absorb_joins(d);
        d->turn = 1; /* the next turn: one past those already recorded */
        const Cflue__V1__Record *r;
        FOR_EACH_RECORD(d, r)
        {
            d->turn += own_assistant(d, r) != NULL;
        }
        outcome = run_turns(d, &system_text, &ts, error, sizeof(error));
    }
    free(system_text);
    if (ts.list) {
        protobuf_c_message_free_unpacked(&ts.list->base, NULL);
    }
    free(ts.tools);

    pthread_mutex_lock(&g_agentd.mu);
    bool aborted = d->act->abort_requested, lost = d->act->lease_lost;
    bool down = d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    if (lost || (down && !aborted)) {
        return unsettled(d);
    }
    if (aborted) {
        return settle(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    if (d->fault.code != CF_OK) {
        return unsettled(d);
    }
    return settle(d, outcome, error[0] ? error : NULL);
}

enum drive_end turn_drive(const Cflue__V1__ClaimResponse *claim)
{
    struct drive d = {.sub = claim->submission, .cursor = -1};
    d.fence = *claim->fence;
    d.timeout_at_ms = pbtime_ms(d.sub->deadline);
    buf_init(&d.delta, 64 * 1024);
    if (!begin_drive(&d)) {
        finish(&d);
        return DRIVE_STOPPED; /* lease expires; another worker or process takes it */
    }
    log_info("drive", "submission=%s conversation=%s attempt=%s count=%d takeover=%d",
             d.sub->submission_id, d.sub->conversation_id, d.fence.attempt_id, d.sub->attempt_count,
             (int)claim->takeover);
    enum drive_end end = drive(&d, claim->takeover);
    pthread_mutex_lock(&g_agentd.mu);
    d.act->in_use = false;
    pthread_mutex_unlock(&g_agentd.mu);
    finish(&d);
    return end;
}
