/* drive_store.c - a drive's calls to storaged: retried under the fence, appended through the
 * record log.
 *
 * The drive reads its conversation once (dstore_load_start, page by page as the call in flight;
 * not at all when the claim saw it empty) and every record it writes joins d->log: pending
 * first (dstore_defer_one), then at the offset storaged gave when the next Append or the Settle
 * carrying it is acknowledged (a deduplicated append answers the offset of the record already
 * stored). What must be durable before the drive goes on is waited for (dstore_stored): an
 * answer's tool calls before they run, a joined message's input before its join is final, a
 * compaction with its prompt; tool results are written behind (dstore_write_behind: as they
 * arrive; a batch's last ones beside the next model call, or with its answer when it comes
 * within --hold-writes-ms: dstore_write_behind_held); the input and the system prompt wait
 * for the first model call in the same way (one Append or the Settle, which also stamps the
 * input applied), the final answer for the Settle. The answers' hints are kept: an abort
 * intent, and how much is queued behind (ClaimJoinable only then). Attachments' bytes come
 * from the claim's submission or a joined delivery's (kept from ClaimJoinable), and otherwise
 * from one Store.Get per submission for the life of the drive.
 */
#include "clients.h"
#include "clock.h"
#include "drive.h"
#include "engine.h"
#include "log.h"
#include "mem.h"
#include "pbtime.h"
#include "record_kind.h"
#include "thread.h"
#include "utf8.h"

#include <stdlib.h>
#include <string.h>

#define STORE_RETRY_MIN_MS 5000 /* a Store call is retried at least this long */

bool dstore_retry_again(struct drive *d, const struct cf_error *err, int64_t first_try_ms,
                        int64_t wait_ms)
{
    if (!drive_transient(err->code) || drive_lost_or_down(d)) {
        return false;
    }
    int64_t window =
        g_agentd.lease_ms > STORE_RETRY_MIN_MS ? g_agentd.lease_ms : STORE_RETRY_MIN_MS;
    if (clock_mono_ms() - first_try_ms + wait_ms <= window) {
        return true;
    }
    return !strcmp(err->reason, "STORAGE_FULL") && drive_time_left(d) > wait_ms;
}

enum cf_status dstore_call(struct drive *d, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    int64_t start = clock_mono_ms(), wait = 100;
    for (d->store_tries = 1;; d->store_tries++) {
        *resp = NULL;
        enum cf_status rc =
            store_call(g_agentd.store, method, req, desc, STORE_TIMEOUT_MS, resp, &d->err);
        if (rc == CF_STALE) {
            drive_mark_lease_lost(d); /* ABORTED, STALE_FENCE: another attempt holds the work */
        }
        if (rc == CF_OK || !dstore_retry_again(d, &d->err, start, wait)) {
            d->store_down = d->store_down || drive_transient(rc);
            return rc;
        }
        int64_t nap = wait + thread_jitter_ms(wait / 2 + 1);
        for (int64_t slept = 0; slept < nap && !drive_lost_or_down(d); slept += 50) {
            clock_sleep_ms(50);
        }
        wait = wait * 2 < 2000 ? wait * 2 : 2000;
    }
}

/* nothing_to_read: the claim saw an empty conversation, and the fence holds it so. */
static bool nothing_to_read(const struct drive *d)
{
    return d->claim->head_offset == -1 && !d->takeover && !d->log_loaded;
}

/* read_request is the Read of the conversation's next page (after d->load_token). */
static Cflue__V1__ReadRequest read_request(const struct drive *d)
{
    Cflue__V1__ReadRequest req = CFLUE__V1__READ_REQUEST__INIT;
    req.conversation_id = d->sub->conversation_id;
    req.after_offset = -1;
    req.page_size = 1000;
    req.page_token = d->load_token ? d->load_token : "";
    return req;
}

/* add_page puts a Read page into d->log (which owns it then) and keeps the token of the next
 * one in d->load_token: true while there is a next one. */
static bool add_page(struct drive *d, ProtobufCMessage *resp)
{
    Cflue__V1__ReadResponse *page = (Cflue__V1__ReadResponse *)resp;
    free(d->load_token);
    d->load_token =
        *page->next_page_token && page->n_records ? mem_strdup(page->next_page_token) : NULL;
    rlog_add_page(&d->log, page);
    /* what no context needs goes as the pages come: a long history (compacted many times)
     * is never held whole (the same log as one trim after the last page) */
    rlog_trim(&d->log, d->sub->submission_id);
    return d->load_token != NULL;
}

/* read_failed faults the drive whose reading failed. */
static void read_failed(struct drive *d)
{
    free(d->load_token);
    d->load_token = NULL;
    drive_fault(d, "reading the conversation failed", &d->err);
}

/* send_read asks for the next page as the call in flight. */
static void send_read(struct drive *d)
{
    Cflue__V1__ReadRequest req = read_request(d);
    dstore_flight_send(d, "Read", &req.base, &cflue__v1__read_response__descriptor, 0);
}

bool dstore_load_start(struct drive *d)
{
    if (nothing_to_read(d)) {
        return false;
    }
    send_read(d);
    return true;
}

enum load_state dstore_load_take(struct drive *d)
{
    enum cf_status rc;
    ProtobufCMessage *resp;
    switch (dstore_flight_take(d, send_read, &rc, &resp)) {
    case FLIGHT_WAITING:
        return LOAD_WAITING;
    case FLIGHT_IDLE:
        return LOAD_DONE; /* nothing was asked: dstore_load_start answered false */
    case FLIGHT_ENDED:
        break;
    }
    if (rc != CF_OK) {
        read_failed(d);
        return LOAD_FAILED;
    }
    if (add_page(d, resp)) {
        send_read(d);
        return LOAD_WAITING;
    }
    return LOAD_DONE;
}

enum cf_status dstore_load(struct drive *d)
{
    if (nothing_to_read(d)) {
        return CF_OK;
    }
    for (;;) {
        Cflue__V1__ReadRequest req = read_request(d);
        ProtobufCMessage *resp = NULL;
        enum cf_status rc =
            dstore_call(d, "Read", &req.base, &cflue__v1__read_response__descriptor, &resp);
        if (rc != CF_OK) {
            read_failed(d);
            return rc;
        }
        if (!add_page(d, resp)) {
            return CF_OK;
        }
    }
}

/* take_hints keeps what an Append answer says beyond offsets: an abort
 * intent stamped meanwhile, and how much is queued behind (joins_absorb asks only then). */
static void take_hints(struct drive *d, bool abort_requested, int32_t queued)
{
    d->queued = queued;
    if (abort_requested && !drive_abort_seen(d)) {
        agentd_mark_abort(d->sub->submission_id);
    }
}

/* mark_applied stamps the input applied on its own (a Compact request has no input record). */
static enum cf_status mark_applied(struct drive *d, Cflue__V1__MarkInputAppliedRequest *mark)
{
    ProtobufCMessage *resp = NULL;
    mark->fence = &d->fence;
    enum cf_status rc =
        dstore_call(d, "MarkInputApplied", &mark->base, &cflue__v1__submission__descriptor, &resp);
    d->mark_pending = false;
    if (rc != CF_OK) {
        if (!drive_lost_or_down(d)) {
            drive_fault(d, "marking the input applied failed", &d->err);
        }
        return rc;
    }
    drive_set_deadline(d, (const Cflue__V1__Submission *)resp);
    protobuf_c_message_free_unpacked(resp, NULL);
    return CF_OK;
}

Cflue__V1__MarkInputAppliedRequest *dstore_mark(const struct drive *d,
                                                Cflue__V1__MarkInputAppliedRequest *mark,
                                                Google__Protobuf__Duration *limit)
{
    cflue__v1__mark_input_applied_request__init(mark);
    mark->max_attempts = d->agent->max_attempts;
    if (d->agent->timeout_ms > 0) {
        pbdur_set(limit, d->agent->timeout_ms);
        mark->timeout = limit;
    }
    return mark;
}

/* append_request fills req (and mark, limit: the caller's) with the pending records (at most
 * max and PROTO_RECORDS_MAX of them, and DSTORE_APPEND_BYTES_MAX of bytes unless one
 * record alone is more) under the
 * fence, stamping the input applied when d->mark_pending; returns how
 * many records it carries. */
static size_t append_request(struct drive *d, Cflue__V1__AppendRequest *req,
                             Cflue__V1__MarkInputAppliedRequest *mark,
                             Google__Protobuf__Duration *limit, size_t max)
{
    size_t n;
    Cflue__V1__Record **recs = rlog_pending(&d->log, &n);
    n = n < max ? n : max;
    n = n < PROTO_RECORDS_MAX ? n : PROTO_RECORDS_MAX;
    if (d->log.pending_bytes > DSTORE_APPEND_BYTES_MAX) {
        /* large results (images, long outputs) go in several Appends, each within storaged's
         * message limit; one record alone always goes (storaged bounds each record) */
        size_t bytes = protobuf_c_message_get_packed_size(&recs[0]->base);
        size_t k = 1;
        while (k < n && (bytes += protobuf_c_message_get_packed_size(&recs[k]->base)) <=
                            DSTORE_APPEND_BYTES_MAX) {
            k++;
        }
        n = k;
    }
    if (d->mark_pending) {
        req->mark_input_applied = dstore_mark(d, mark, limit);
    }
    req->fence = &d->fence;
    req->records = recs;
    req->n_records = n;
    return n;
}

/* appended takes an Append's answer: the n records it carried acknowledged at their offsets,
 * the hints kept, the budgets storaged installed when it stamped the input. */
static void appended(struct drive *d, const Cflue__V1__AppendResponse *ar, size_t n, bool mark)
{
    rlog_ack_pending(&d->log, n, ar->first_offset);
    take_hints(d, ar->abort_requested, ar->queued);
    if (mark) {
        if (ar->submission) {
            /* the budgets as now installed (the claim carried the defaults) */
            drive_set_deadline(d, ar->submission);
        }
        d->mark_pending = false;
    }
}

/* append_failed: the pending records are not in the stream and the drive must not go on as if
 * they were (a fault), unless the lease is lost (a stale fence). */
static void append_failed(struct drive *d, enum cf_status rc)
{
    rlog_drop_pending(&d->log);
    d->mark_pending = false;
    if (rc != CF_STALE) {
        drive_fault(d, "recording to the conversation failed", &d->err);
    }
}

enum cf_status dstore_flush(struct drive *d)
{
    size_t n;
    enum cf_status rc = CF_OK;
    while (rc == CF_OK && (rlog_pending(&d->log, &n) || d->mark_pending)) {
        Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
        Cflue__V1__MarkInputAppliedRequest mark = CFLUE__V1__MARK_INPUT_APPLIED_REQUEST__INIT;
        Google__Protobuf__Duration limit = GOOGLE__PROTOBUF__DURATION__INIT;
        ProtobufCMessage *resp = NULL;
        size_t sent = append_request(d, &req, &mark, &limit, SIZE_MAX);
        if (!sent) {
            return mark_applied(d, &mark);
        }
        bool marks = d->mark_pending;
        rc = dstore_call(d, "Append", &req.base, &cflue__v1__append_response__descriptor, &resp);
        if (rc == CF_OK) {
            appended(d, (const Cflue__V1__AppendResponse *)resp, sent, marks);
        } else {
            append_failed(d, rc);
        }
        if (resp) {
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    }
    return rc;
}

/* ---------- the Store call in flight ---------- */

void dstore_flight_send(struct drive *d, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *desc, size_t n_sent)
{
    struct store_flight *f = &d->sf;
    char path[64];
    f->method = method;
    f->n_sent = n_sent;
    if (!f->first_try_ms) {
        f->first_try_ms = clock_mono_ms();
        f->backoff_ms = 100;
        d->store_tries = 0;
    }
    d->store_tries++;
    snprintf(path, sizeof(path), "/cflue.v1.Store/%s", method);
    dcall_start(&f->call, g_agentd.store, path, req, desc, STORE_TIMEOUT_MS);
}

bool dstore_send_delta(struct drive *d, const ProtobufCMessage *req, int64_t timeout_ms)
{
    struct store_flight *f = &d->sf;
    if (f->call.in_flight || f->retry_at_ms) {
        return false;
    }
    f->method = "Append";
    f->n_sent = 0;
    f->courtesy = true;
    dcall_start(&f->call, g_agentd.store, "/cflue.v1.Store/Append", req,
                &cflue__v1__append_response__descriptor, timeout_ms);
    return true;
}

enum flight_state dstore_flight_take(struct drive *d, void (*resend)(struct drive *d),
                                     enum cf_status *rc, ProtobufCMessage **resp)
{
    struct store_flight *f = &d->sf;
    struct rpc_status st;
    ProtobufCMessage *got;
    *resp = NULL;
    *rc = CF_OK;
    if (!dcall_take(&f->call, &st, &got)) {
        if (f->call.in_flight) {
            return FLIGHT_WAITING;
        }
        if (!f->retry_at_ms) {
            return FLIGHT_IDLE;
        }
        if (drive_lost_or_down(d)) {
            /* whoever holds the work next makes the call again */
            f->retry_at_ms = f->first_try_ms = 0;
            *rc = cf_error_set(&d->err, CF_STALE, "storaged %s: not tried again: the drive stopped",
                               f->method);
            return FLIGHT_ENDED;
        }
        if (clock_mono_ms() < f->retry_at_ms) {
            engine_post_at(d, f->retry_at_ms); /* posted early: the timer again */
            return FLIGHT_WAITING;
        }
        f->retry_at_ms = 0;
        resend(d);
        return FLIGHT_WAITING;
    }
    if (f->courtesy) {
        struct cf_error err;
        f->courtesy = false;
        if (store_status("Append", &st, &err) == CF_STALE) {
            drive_mark_lease_lost(d); /* ABORTED, STALE_FENCE: another attempt holds the work */
        }
        if (got) {
            protobuf_c_message_free_unpacked(got, NULL);
        }
        return FLIGHT_IDLE;
    }
    *rc = store_status(f->method, &st, &d->err);
    if (*rc == CF_STALE) {
        drive_mark_lease_lost(d); /* ABORTED, STALE_FENCE: another attempt holds the work */
    }
    int64_t now = clock_mono_ms();
    if (*rc != CF_OK && dstore_retry_again(d, &d->err, f->first_try_ms, f->backoff_ms)) {
        int64_t wait = f->backoff_ms + thread_jitter_ms(f->backoff_ms / 2 + 1);
        if ((d->store_tries & (d->store_tries - 1)) == 0) {
            /* tries 1, 2, 4, 8, ...: a full disk may keep a drive retrying for long */
            char q[600];
            log_warn("store_retry", "submission=%s method=%s try=%d wait_ms=%lld err=%s",
                     d->sub->submission_id, f->method, d->store_tries, (long long)wait,
                     log_quote(q, sizeof(q), d->err.msg));
        }
        f->retry_at_ms = now + wait;
        f->backoff_ms = f->backoff_ms * 2 < 2000 ? f->backoff_ms * 2 : 2000;
        engine_post_at(d, f->retry_at_ms);
        return FLIGHT_WAITING;
    }
    d->store_down = d->store_down || drive_transient(*rc);
    f->first_try_ms = 0;
    *resp = got;
    return FLIGHT_ENDED;
}

/* send_write starts an Append of every pending record; a retry carries exactly the records
 * of the try before (that try may have been stored with its answer lost: storaged answers an
 * identical batch with its offsets, but refuses one only partly stored), and the records
 * written meanwhile follow in the next Append. */
static void send_write(struct drive *d, bool retry)
{
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    Cflue__V1__MarkInputAppliedRequest mark = CFLUE__V1__MARK_INPUT_APPLIED_REQUEST__INIT;
    Google__Protobuf__Duration limit = GOOGLE__PROTOBUF__DURATION__INIT;
    size_t n = append_request(d, &req, &mark, &limit, retry ? d->sf.n_sent : SIZE_MAX);
    d->sf.mark_sent = d->mark_pending;
    dstore_flight_send(d, "Append", &req.base, &cflue__v1__append_response__descriptor, n);
}

static void resend_write(struct drive *d)
{
    send_write(d, true);
}

bool dstore_writes_done(struct drive *d)
{
    enum cf_status rc;
    ProtobufCMessage *resp;
    switch (dstore_flight_take(d, resend_write, &rc, &resp)) {
    case FLIGHT_WAITING:
        return false;
    case FLIGHT_ENDED:
        if (rc == CF_OK) {
            appended(d, (const Cflue__V1__AppendResponse *)resp, d->sf.n_sent, d->sf.mark_sent);
            protobuf_c_message_free_unpacked(resp, NULL);
        } else {
            append_failed(d, rc);
        }
        return true;
    case FLIGHT_IDLE:
    default:
        return true;
    }
}

void dstore_write_behind(struct drive *d)
{
    size_t n;
    if (dstore_writes_done(d) && rlog_pending(&d->log, &n) && !drive_broken(d)) {
        send_write(d, false);
    }
}

void dstore_write_behind_held(struct drive *d)
{
    size_t n;
    if (!g_agentd.hold_writes_ms || !rlog_pending(&d->log, &n)) {
        dstore_write_behind(d);
        return;
    }
    d->hold_until_ms = clock_mono_ms() + g_agentd.hold_writes_ms;
    engine_post_at(d, d->hold_until_ms);
}

bool dstore_release_held(struct drive *d, bool now)
{
    size_t n;
    if (!d->hold_until_ms) {
        return false;
    }
    if (!now && clock_mono_ms() < d->hold_until_ms) {
        engine_post_at(d, d->hold_until_ms);
        return false;
    }
    d->hold_until_ms = 0;
    pthread_mutex_lock(&g_agentd.mu);
    bool lost = d->act->lease_lost;
    pthread_mutex_unlock(&g_agentd.mu);
    if (dstore_writes_done(d) && rlog_pending(&d->log, &n) && d->fault.code == CF_OK && !lost) {
        send_write(d, false);
    }
    return true;
}

bool dstore_stored(struct drive *d)
{
    size_t n;
    if (!dstore_writes_done(d)) {
        return false;
    }
    if (drive_broken(d)) {
        return true;
    }
    if (rlog_pending(&d->log, &n)) {
        send_write(d, false);
        return false;
    }
    if (d->mark_pending) {
        (void)dstore_flush(d); /* a Compact request's stamp: no record to carry it */
    }
    return true;
}

enum cf_status dstore_defer_one(struct drive *d, const char *id, const char *submission_id,
                                ProtobufCMessage *body)
{
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    rec.id = (char *)id;
    rec.submission_id = (char *)(submission_id ? submission_id : "");
    if (!record_set_body(&rec, body)) {
        struct cf_error e;
        cf_error_set(&e, CF_INTERNAL, "record %s: %s is no record body", id,
                     body->descriptor->name);
        drive_fault(d, "recording to the conversation failed", &e);
        return CF_INTERNAL;
    }
    rlog_add_pending(&d->log, &rec);
    return CF_OK;
}

void dstore_settled_hints(struct drive *d, const Cflue__V1__SettleResponse *sr)
{
    size_t n;
    (void)rlog_pending(&d->log, &n);
    if (n && sr->records_first_offset >= 0) {
        rlog_ack_pending(&d->log, n, sr->records_first_offset);
    }
    rlog_drop_pending(&d->log); /* an earlier identical Settle had stored them */
    if (sr->conversation_queued > 0) {
        agentd_wake(); /* the conversation's next message is runnable now */
    }
}

enum cf_status dstore_append_input(struct drive *d, const char *id, const Cflue__V1__Submission *s)
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
    enum cf_status rc = dstore_defer_one(d, id, s->submission_id, &body.base);
    free(refs);
    free(ptrs);
    return rc;
}

void dstore_keep_submission(struct drive *d, Cflue__V1__Submission *s)
{
    d->known = mem_realloc(d->known, sizeof(*d->known) * (d->n_known + 1));
    d->known[d->n_known++] = s;
}

enum cf_status dstore_attachments(void *arg, const char *submission_id,
                                  const Cflue__V1__Message **out, struct cf_error *err)
{
    struct drive *d = arg;
    if (!strcmp(submission_id, d->sub->submission_id)) {
        *out = d->sub->message;
        return CF_OK;
    }
    for (size_t i = 0; i < d->n_known; i++) {
        if (!strcmp(d->known[i]->submission_id, submission_id)) {
            *out = d->known[i]->message;
            return CF_OK;
        }
    }
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    gr.submission_id = (char *)submission_id;
    enum cf_status rc = dstore_call(d, "Get", &gr.base, &cflue__v1__submission__descriptor, &resp);
    if (rc != CF_OK) {
        *err = d->err;
        return rc;
    }
    dstore_keep_submission(d, (Cflue__V1__Submission *)resp);
    *out = ((Cflue__V1__Submission *)resp)->message;
    return CF_OK;
}

void dstore_build_context(struct drive *d, struct context *c, int64_t before)
{
    struct context_source src = {.records = d->log.recs,
                                 .n_records = d->log.n,
                                 .before = before,
                                 .attachments = dstore_attachments,
                                 .arg = d};
    struct cf_error e;
    if (context_build(c, &src, &e) != CF_OK) {
        /* the model must not see the message without what it carried */
        drive_fault(d, "reading a message's attachments failed", &e);
    }
}

void dstore_cleanup(struct drive *d)
{
    for (size_t i = 0; i < d->n_known; i++) {
        protobuf_c_message_free_unpacked(&d->known[i]->base, NULL);
    }
    free(d->known);
    d->known = NULL;
    d->n_known = 0;
    rlog_cleanup(&d->log);
}

const char *dstore_utf8(const char *text, struct buf *scratch)
{
    size_t n = strlen(text);
    buf_init(scratch, n * 3 + 16);
    if (utf8_valid(text, n, NULL)) {
        return text;
    }
    utf8_sanitize(scratch, text, n);
    return buf_cstr(scratch);
}
