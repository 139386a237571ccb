/* service.c - Store RPC handlers.
 *
 * Writes: validated on the receiving thread, then queued to the writer; the reply is sent from
 * the writer's completion callback, after COMMIT. Reads: run on the server's worker pool, each
 * inside one read transaction on a pooled reader connection, so a response is one consistent
 * snapshot. Follow: an event-driven stream (RPC_ASYNC) that holds no thread while idle. It is
 * registered in the follow hub under its conversation; when a write that appended records
 * commits, the write's completion wakes that conversation's followers (all followers when the
 * conversation cannot be told), and a pool worker reads what is new in batches of at most
 * FOLLOW_PAGE records and LEDGER_FOLLOW_BYTES bytes (always one record at least) and pushes one
 * record per message, so no message is larger than one record.
 *
 * A follower's states: IDLE (waiting for a wake), QUEUED or RUNNING (a read is scheduled or
 * under way; a wake meanwhile sets `dirty` so it reads again), PAUSED (its send queue is full:
 * it resumes from rpc's drained callback, re-reading from the last offset pushed), FINISHED.
 * The follower is freed when both the call let go of it (release) and no read is queued.
 *
 * Backup: a thread of its own (RPC_THREAD) takes the copy (backup.h), opens it and unlinks it
 * at once (so nothing is left if storaged dies), then streams it with its SHA-256.
 *
 * Tracing: the lines logged for a call carry the trace its `traceparent` gave (the server sets
 * it around the handler; the writer's completion, on the writer's thread, sets it again), or,
 * for a write that carried none (a Claim), the trace of the submission it answers with.
 */
#include "service.h"

#include "backup.h"
#include "failpoint.h"

#include "clock.h"
#include "db.h"
#include "follow_hub.h"
#include "log.h"
#include "mem.h"
#include "metrics.h"
#include "stmt.h"
#include "store_clock.h"
#include "trace.h"
#include "validate.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define READERS_MAX 32
#define FOLLOW_PAGE 200
#define WAKE_CONVERSATIONS_MAX 8 /* a write touching more wakes every follower */

struct service {
    char *db_path;
    struct writer *writer;
    const struct ledger_config *cfg;
    struct follow_hub *hub;
    struct rpc_server *srv;
    pthread_mutex_t mu;
    sqlite3 *idle[READERS_MAX];
    int n_idle;
    atomic_bool backup_running; /* one Backup at a time */
};

typedef enum cf_status (*validate_fn)(const ProtobufCMessage *req, struct cf_error *err);
typedef enum cf_status (*ledger_fn)(struct ledger_ctx *c, const ProtobufCMessage *req,
                                    ProtobufCMessage *resp, struct cf_error *err);

struct method {
    const char *name;
    const ProtobufCMessageDescriptor *req_desc;
    const ProtobufCMessageDescriptor *resp_desc;
    validate_fn validate;
    ledger_fn run;
    bool write;
    /* Commit with synchronous=FULL before answering: Admit, Settle, RequestAbort (the
     * durability statement), MarkInputApplied and FinalizeJoin (once per attempt or join; if
     * lost while the attempt survives a power loss, a delivery already answered in the host's
     * response would be queued again), and an Append with mark_input_applied (durable_for).
     * The rest commit with NORMAL: see docs/storaged.md. */
    bool durable;
};

/* ---------- reader connections ---------- */

static enum cf_status reader_take(struct service *svc, sqlite3 **out, struct cf_error *err)
{
    pthread_mutex_lock(&svc->mu);
    if (svc->n_idle > 0) {
        *out = svc->idle[--svc->n_idle];
        pthread_mutex_unlock(&svc->mu);
        return CF_OK;
    }
    pthread_mutex_unlock(&svc->mu);
    return db_open(svc->db_path, false, out, err);
}

static void reader_give(struct service *svc, sqlite3 *db)
{
    pthread_mutex_lock(&svc->mu);
    if (svc->n_idle < READERS_MAX) {
        svc->idle[svc->n_idle++] = db;
        db = NULL;
    }
    pthread_mutex_unlock(&svc->mu);
    sqlite3_close(db);
}

void service_release_memory(void *arg)
{
    struct service *svc = arg;
    pthread_mutex_lock(&svc->mu); /* a pooled connection is used by no one meanwhile */
    for (int i = 0; i < svc->n_idle; i++) {
        sqlite3_db_release_memory(svc->idle[i]);
    }
    pthread_mutex_unlock(&svc->mu);
    writer_release_memory(svc->writer);
}

/* reader_begin takes a reader connection and opens a read transaction on it, so everything
 * read until reader_end is one snapshot. */
static enum cf_status reader_begin(struct service *svc, sqlite3 **out, struct cf_error *err)
{
    enum cf_status rc = reader_take(svc, out, err);
    if (rc != CF_OK) {
        return rc;
    }
    if ((rc = stmt_run(*out, "BEGIN", err)) != CF_OK) {
        sqlite3_close(*out);
        *out = NULL;
    }
    return rc;
}

/* reader_end ends the read transaction and pools the connection again; a connection that
 * cannot end it is closed instead, so no pooled connection keeps an old snapshot. What was
 * read stays valid either way: the snapshot was consistent. */
static void reader_end(struct service *svc, sqlite3 *db)
{
    struct cf_error err;
    if (stmt_run(db, "COMMIT", &err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_warn("reader_end_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
        sqlite3_close(db);
        return;
    }
    reader_give(svc, db);
}

/* read_snapshot runs a read method's ledger function inside one read transaction. */
static enum cf_status read_snapshot(struct service *svc, struct arena *a, ledger_fn fn,
                                    const ProtobufCMessage *req, ProtobufCMessage *resp,
                                    struct cf_error *err)
{
    sqlite3 *db;
    enum cf_status rc = reader_begin(svc, &db, err);
    if (rc != CF_OK) {
        return rc;
    }
    struct ledger_ctx ctx = {.db = db, .arena = a, .cfg = svc->cfg, .now = store_clock_now()};
    rc = fn(&ctx, req, resp, err);
    reader_end(svc, db);
    return rc;
}

/* ---------- adapters from the generic shape to the ledger ---------- */

#define ADAPT(fn_name, call_expr, req_type, resp_type)                                             \
    static enum cf_status fn_name(struct ledger_ctx *c, const ProtobufCMessage *rq,                \
                                  ProtobufCMessage *rs, struct cf_error *err)                      \
    {                                                                                              \
        const req_type *req = (const req_type *)rq;                                                \
        resp_type *resp = (resp_type *)rs;                                                         \
        return call_expr;                                                                          \
    }

ADAPT(run_admit, ledger_admit(c, req, resp, err), Cflue__V1__AdmitRequest, Cflue__V1__AdmitResponse)
ADAPT(run_claim, ledger_claim(c, req, resp, err), Cflue__V1__ClaimRequest, Cflue__V1__ClaimResponse)
ADAPT(run_heartbeat, ledger_heartbeat(c, req, resp, err), Cflue__V1__HeartbeatRequest,
      Cflue__V1__HeartbeatResponse)
ADAPT(run_release, ledger_release(c, req, resp, err), Cflue__V1__ReleaseRequest,
      Cflue__V1__ReleaseResponse)
ADAPT(run_mark, ledger_mark_input_applied(c, req, resp, err), Cflue__V1__MarkInputAppliedRequest,
      Cflue__V1__Submission)
ADAPT(run_requeue, ledger_requeue(c, req->fence, resp, err), Cflue__V1__FencedRequest,
      Cflue__V1__Submission)
ADAPT(run_claim_joinable, ledger_claim_joinable(c, req, resp, err), Cflue__V1__ClaimJoinableRequest,
      Cflue__V1__ClaimJoinableResponse)
ADAPT(run_finalize_join, ledger_finish_join(c, req, true, resp, err), Cflue__V1__JoinRequest,
      Cflue__V1__Submission)
ADAPT(run_revert_join, ledger_finish_join(c, req, false, resp, err), Cflue__V1__JoinRequest,
      Cflue__V1__Submission)
ADAPT(run_abort, ledger_request_abort(c, req, resp, err), Cflue__V1__RequestAbortRequest,
      Cflue__V1__RequestAbortResponse)
ADAPT(run_settle, ledger_settle(c, req, resp, err), Cflue__V1__SettleRequest,
      Cflue__V1__SettleResponse)
ADAPT(run_append, ledger_append(c, req, resp, err), Cflue__V1__AppendRequest,
      Cflue__V1__AppendResponse)
ADAPT(run_get, ledger_get(c, req->submission_id, resp, err), Cflue__V1__GetRequest,
      Cflue__V1__Submission)
ADAPT(run_list, ledger_list(c, req, resp, err), Cflue__V1__ListRequest, Cflue__V1__ListResponse)
ADAPT(run_scan, ledger_scan_expired(c, req, resp, err), Cflue__V1__ScanExpiredRequest,
      Cflue__V1__ListResponse)
ADAPT(run_conversation, ledger_conversation(c, req->conversation_id, resp, err),
      Cflue__V1__ConversationRequest, Cflue__V1__Conversation)
ADAPT(run_read, ledger_read(c, req, resp, err), Cflue__V1__ReadRequest, Cflue__V1__ReadResponse)

#define V(fn) ((validate_fn)(fn))
#define D(x) &cflue__v1__##x##__descriptor

static const struct method methods[] = {
    {"Admit", D(admit_request), D(admit_response), V(validate_admit), run_admit, true, true},
    {"Claim", D(claim_request), D(claim_response), V(validate_claim), run_claim, true, false},
    {"Heartbeat", D(heartbeat_request), D(heartbeat_response), V(validate_heartbeat), run_heartbeat,
     true, false},
    {"Release", D(release_request), D(release_response), V(validate_release), run_release, true,
     false},
    {"MarkInputApplied", D(mark_input_applied_request), D(submission),
     V(validate_mark_input_applied), run_mark, true, true},
    {"Requeue", D(fenced_request), D(submission), V(validate_fenced), run_requeue, true, false},
    {"ClaimJoinable", D(claim_joinable_request), D(claim_joinable_response),
     V(validate_claim_joinable), run_claim_joinable, true, false},
    {"FinalizeJoin", D(join_request), D(submission), V(validate_join), run_finalize_join, true,
     true},
    {"RevertJoin", D(join_request), D(submission), V(validate_join), run_revert_join, true, false},
    {"RequestAbort", D(request_abort_request), D(request_abort_response), V(validate_request_abort),
     run_abort, true, true},
    {"Settle", D(settle_request), D(settle_response), V(validate_settle), run_settle, true, true},
    {"Append", D(append_request), D(append_response), V(validate_append), run_append, true, false},
    {"ScanExpired", D(scan_expired_request), D(list_response), V(validate_scan_expired), run_scan,
     false, false},
    {"Get", D(get_request), D(submission), V(validate_get), run_get, false, false},
    {"List", D(list_request), D(list_response), V(validate_list), run_list, false, false},
    {"GetConversation", D(conversation_request), D(conversation), V(validate_conversation),
     run_conversation, false, false},
    {"Read", D(read_request), D(read_response), V(validate_read), run_read, false, false},
};

/* ---------- unary calls ---------- */

struct pending {
    struct writer_job job;
    struct arena arena;
    struct rpc_call *call;
    const struct method *m;
    const ProtobufCMessage *req;
    ProtobufCMessage *resp;
    int64_t started_ms;
    struct service *svc;
    bool appended;                             /* the write appended records */
    const char *woken[WAKE_CONVERSATIONS_MAX]; /* their conversations (arena) */
    int n_woken;                               /* -1: unknown, wake every follower */
    struct trace_ctx trace; /* the call's (none: trace_id ""), for the lines the writer logs */
};

/* storaged's Prometheus series (metrics.h), made by service_register. */
static struct {
    struct metric *submissions, *claims, *settle_seconds;
} stats;

/* count_result adds a committed claim (by Claim, or with Admit) or Settle to the series. */
static void count_result(const struct pending *p)
{
    if (!strcmp(p->m->name, "Admit")) {
        const Cflue__V1__AdmitResponse *r = (const void *)p->resp;
        if (r->claim) { /* admitted and claimed in one call: a first attempt */
            metrics_add(stats.claims, METRICS_LABELS("first"), 1);
        }
    } else if (!strcmp(p->m->name, "Claim")) {
        const Cflue__V1__ClaimResponse *r = (const void *)p->resp;
        if (r->submission) {
            const char *kind = r->takeover                        ? "takeover"
                               : r->submission->attempt_count > 1 ? "retry"
                                                                  : "first";
            metrics_add(stats.claims, METRICS_LABELS(kind), 1);
        }
    } else if (!strcmp(p->m->name, "Settle")) {
        const Cflue__V1__SettleResponse *r = (const void *)p->resp;
        const Cflue__V1__Submission *s = r->submission;
        if (!r->already_settled && s && s->create_time && s->settle_time) {
            double secs = (double)(s->settle_time->seconds - s->create_time->seconds) +
                          (s->settle_time->nanos - s->create_time->nanos) / 1e9;
            metrics_observe(stats.settle_seconds, NULL, secs > 0 ? secs : 0);
        }
    }
}

/* count_submissions (at each scrape) sets cflue_store_submissions from the database: one read
 * of the submissions table, grouped by status and outcome. */
static void count_submissions(void *arg)
{
    struct service *svc = arg;
    sqlite3 *db;
    struct cf_error err;
    if (reader_begin(svc, &db, &err) != CF_OK) {
        return; /* the last values stay: a scrape during an outage still answers */
    }
    struct stmt s;
    bool row = false;
    if (stmt_open(&s, db,
                  "SELECT status, COALESCE(outcome, ''), count(*) FROM submissions "
                  "GROUP BY status, outcome",
                  "count submissions", &err) == CF_OK) {
        metrics_clear(stats.submissions);
        while (stmt_step(&s, &row, &err) == CF_OK && row) {
            metrics_set(stats.submissions,
                        METRICS_LABELS((const char *)sqlite3_column_text(s.st, 0),
                                       (const char *)sqlite3_column_text(s.st, 1)),
                        (double)sqlite3_column_int64(s.st, 2));
        }
        stmt_close(&s);
    }
    reader_end(svc, db);
}

static void log_result(const struct pending *p, enum cf_status st, const struct cf_error *err)
{
    char q[CF_ERROR_MSG_MAX + 32];
    int64_t ms = clock_mono_ms() - p->started_ms;
    if (st != CF_OK) {
        bool db_failure =
            st == CF_DB || st == CF_INTERNAL || st == CF_IO || st == CF_CORRUPT || st == CF_FULL;
        log_write(db_failure ? LOG_ERROR : LOG_INFO, "store.refused",
                  "method=%s code=%s ms=%lld err=%s", p->m->name, status_name(st), (long long)ms,
                  log_quote(q, sizeof(q), err->msg));
        return;
    }
    if (!strcmp(p->m->name, "Admit")) {
        const Cflue__V1__AdmitResponse *r = (const void *)p->resp;
        log_info("store.admit", "submission=%s conversation=%s dedup=%d claimed=%d ms=%lld",
                 r->submission->submission_id, r->submission->conversation_id, (int)r->deduplicated,
                 r->claim != NULL, (long long)ms);
    } else if (!strcmp(p->m->name, "Claim")) {
        const Cflue__V1__ClaimResponse *r = (const void *)p->resp;
        if (r->submission) {
            log_info("store.claim", "submission=%s attempt=%s epoch=%lld takeover=%d ms=%lld",
                     r->submission->submission_id, r->fence->attempt_id, (long long)r->fence->epoch,
                     (int)r->takeover, (long long)ms);
        }
    } else if (!strcmp(p->m->name, "Settle")) {
        const Cflue__V1__SettleResponse *r = (const void *)p->resp;
        log_info("store.settle", "submission=%s status=%s outcome=%s joined=%zu repeat=%d ms=%lld",
                 r->submission->submission_id, ledger_status_name(r->submission->status),
                 ledger_outcome_name(r->submission->outcome)
                     ? ledger_outcome_name(r->submission->outcome)
                     : "none",
                 r->n_settled_with, (int)r->already_settled, (long long)ms);
    } else {
        log_debug("store.ok", "method=%s ms=%lld", p->m->name, (long long)ms);
    }
}

/* wake_followers wakes the followers of what a committed write appended. */
static void wake_followers(struct pending *p)
{
    if (!p->appended) {
        return;
    }
    if (p->n_woken < 0) {
        follow_hub_wake_all(p->svc->hub);
        return;
    }
    for (int i = 0; i < p->n_woken; i++) {
        follow_hub_wake(p->svc->hub, p->woken[i]);
    }
}

/* resp_submission returns the submission an answered call names, or NULL. */
static const Cflue__V1__Submission *resp_submission(const struct pending *p)
{
    const ProtobufCMessageDescriptor *d = p->m->resp_desc;
    if (d == &cflue__v1__submission__descriptor) {
        return (const Cflue__V1__Submission *)p->resp;
    }
    if (d == &cflue__v1__admit_response__descriptor) {
        return ((const Cflue__V1__AdmitResponse *)p->resp)->submission;
    }
    if (d == &cflue__v1__claim_response__descriptor) {
        return ((const Cflue__V1__ClaimResponse *)p->resp)->submission;
    }
    if (d == &cflue__v1__settle_response__descriptor) {
        return ((const Cflue__V1__SettleResponse *)p->resp)->submission;
    }
    return NULL;
}

/* pending_trace picks the trace of a finished call's lines: the one the call carried, else,
 * for a write (a Claim: agentd's claimer knows no submission before it asks), the trace the
 * submission it answers with was admitted with. */
static void pending_trace(const struct pending *p, enum cf_status st, struct trace_ctx *out)
{
    struct cf_error ignored;
    const Cflue__V1__Submission *sub = st == CF_OK && p->m->write ? resp_submission(p) : NULL;
    if (p->trace.trace_id[0]) {
        *out = p->trace;
    } else if (!sub || !*sub->traceparent ||
               trace_parse(out, sub->traceparent, sub->tracestate, &ignored) != CF_OK) {
        memset(out, 0, sizeof(*out));
    }
}

static void complete(void *arg, enum cf_status st, const struct cf_error *err)
{
    struct pending *p = arg;
    struct trace_ctx t, saved;
    pending_trace(p, st, &t);
    trace_enter(&t, &saved); /* the writer's thread runs this for many calls in turn */
    log_result(p, st, err);
    if (st == CF_OK) {
        wake_followers(p);
        count_result(p);
    }
    if (st == CF_OK) {
        if (failpoint_armed()) {
            /* storaged.reply.<Method>: the write is committed, its answer never leaves (a
             * client sees the connection lost and may retry) */
            char point[64];
            snprintf(point, sizeof(point), "storaged.reply.%s", p->m->name);
            failpoint_hit(point);
        }
        rpc_call_reply(p->call, p->resp);
    } else {
        rpc_call_fail_error(p->call, err);
    }
    arena_cleanup(&p->arena);
    free(p);
    trace_leave(&saved);
}

static void woken_add(struct pending *p, const char *conversation_id)
{
    if (p->n_woken < 0 || !conversation_id || !*conversation_id) {
        return;
    }
    for (int i = 0; i < p->n_woken; i++) {
        if (!strcmp(p->woken[i], conversation_id)) {
            return;
        }
    }
    if (p->n_woken == WAKE_CONVERSATIONS_MAX) {
        p->n_woken = -1;
        return;
    }
    p->woken[p->n_woken++] = arena_strdup(&p->arena, conversation_id);
}

/* woken_by_submission adds the conversation of a submission, read in the write's own
 * transaction; unknown: every follower is woken. */
static void woken_by_submission(struct ledger_ctx *c, struct pending *p, const char *submission_id)
{
    Cflue__V1__Submission sub;
    struct cf_error err;
    if (!submission_id || !*submission_id || ledger_get(c, submission_id, &sub, &err) != CF_OK) {
        p->n_woken = -1;
        return;
    }
    woken_add(p, sub.conversation_id);
}

/* note_appended records which conversations a write that appended records touched, from its
 * response or request (one ledger_get for Append and RequestAbort); -1 when it cannot tell. */
static void note_appended(struct ledger_ctx *c, struct pending *p)
{
    const char *name = p->m->name;
    p->appended = true;
    if (p->m->resp_desc == &cflue__v1__submission__descriptor) {
        woken_add(p, ((const Cflue__V1__Submission *)p->resp)->conversation_id);
    } else if (!strcmp(name, "Admit")) {
        const Cflue__V1__AdmitResponse *r = (const void *)p->resp;
        woken_add(p, r->submission ? r->submission->conversation_id : NULL);
    } else if (!strcmp(name, "Claim")) {
        const Cflue__V1__ClaimResponse *r = (const void *)p->resp;
        woken_add(p, r->submission ? r->submission->conversation_id : NULL);
    } else if (!strcmp(name, "Settle")) {
        const Cflue__V1__SettleResponse *r = (const void *)p->resp;
        woken_add(p, r->submission ? r->submission->conversation_id : NULL);
        for (size_t i = 0; i < r->n_settled_with; i++) {
            woken_by_submission(c, p, r->settled_with[i]);
        }
    } else if (!strcmp(name, "Append")) {
        const Cflue__V1__AppendRequest *r = (const void *)p->req;
        woken_by_submission(c, p, r->fence ? r->fence->submission_id : NULL);
    } else if (!strcmp(name, "RequestAbort")) {
        const Cflue__V1__RequestAbortRequest *r = (const void *)p->req;
        if (r->target_case == CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_CONVERSATION_ID) {
            woken_add(p, r->conversation_id);
        } else {
            woken_by_submission(c, p, r->submission_id);
        }
    } else if (!strcmp(name, "ScanExpired")) {
        const Cflue__V1__ListResponse *r = (const void *)p->resp;
        for (size_t i = 0; i < r->n_submissions; i++) {
            woken_add(p, r->submissions[i]->conversation_id);
        }
    } else if (!strcmp(name, "ClaimJoinable")) {
        const Cflue__V1__ClaimJoinableResponse *r = (const void *)p->resp;
        for (size_t i = 0; i < r->n_submissions; i++) {
            woken_add(p, r->submissions[i]->conversation_id);
        }
    } else {
        p->n_woken = -1;
    }
    if (p->n_woken == 0) {
        p->n_woken = -1; /* appended, yet nothing named: be safe */
    }
}

static enum cf_status run_write(struct ledger_ctx *c, void *arg, struct cf_error *err)
{
    struct pending *p = arg;
    bool before = c->appended; /* the ctx is shared by the batch: learn what this job did */
    c->appended = false;
    enum cf_status st = p->m->run(c, p->req, p->resp, err);
    bool appended = c->appended;
    if (st == CF_OK && appended) {
        note_appended(c, p);
    }
    c->appended = before || appended;
    return st;
}

/* The method table is static and shared; each registration binds it to the service. */
struct binding {
    const struct method *m;
    struct service *svc;
};

/* durable_for tells whether a write commits with synchronous=FULL: its method's choice, and an
 * Append that also marks its input applied gets MarkInputApplied's durability. */
static bool durable_for(const struct method *m, const ProtobufCMessage *req)
{
    if (req->descriptor == &cflue__v1__append_request__descriptor) {
        return m->durable || ((const Cflue__V1__AppendRequest *)req)->mark_input_applied != NULL;
    }
    return m->durable;
}

static void dispatch(struct rpc_call *call, const ProtobufCMessage *req, void *user)
{
    const struct binding *b = user;
    const struct method *m = b->m;
    struct pending *p = mem_alloc(sizeof(*p));
    struct cf_error err;
    enum cf_status st;

    p->call = call;
    p->m = m;
    p->svc = b->svc;
    p->req = req;
    p->started_ms = clock_mono_ms();
    if (trace_current()) {
        p->trace = *trace_current(); /* the server set it from the call's traceparent */
    }
    arena_init(&p->arena);
    p->resp = arena_alloc(&p->arena, m->resp_desc->sizeof_message);
    protobuf_c_message_init(m->resp_desc, p->resp);
    cf_error_clear(&err);
    if ((st = m->validate(req, &err)) != CF_OK) {
        complete(p, st, &err);
        return;
    }
    if (m->write) {
        p->job.run = run_write;
        p->job.done = complete;
        p->job.arg = p;
        p->job.arena = &p->arena;
        p->job.durable = durable_for(m, req);
        writer_submit(b->svc->writer, &p->job);
        return;
    }
    if (failpoint_armed()) {
        /* storaged.read.<Method>: a slow read (it reads the store as it is after the wait) */
        char point[64];
        snprintf(point, sizeof(point), "storaged.read.%s", m->name);
        failpoint_hit(point);
    }
    st = read_snapshot(b->svc, &p->arena, m->run, req, p->resp, &err);
    complete(p, st, &err);
}

/* ---------- Follow ---------- */

enum follow_state { F_IDLE, F_QUEUED, F_RUNNING };

struct follower {
    struct service *svc;
    struct rpc_call *call;
    struct follow_waiter waiter; /* in svc->hub while the stream is open */
    struct rpc_work work;        /* a read on the worker pool */
    pthread_mutex_t mu;
    char *conversation_id;
    char settled_id[256]; /* "settled:<until_settled>", or "" */
    int64_t cursor;       /* the last offset pushed */
    enum follow_state state;
    bool dirty;    /* woken while a read was queued or running: read again */
    bool paused;   /* the send queue is full: wait for drained */
    bool finished; /* rpc_call_finish called (or about to be) */
    int refs;      /* the call (until release) and a queued or running read */
};

static void follower_unref(struct follower *f)
{
    pthread_mutex_lock(&f->mu);
    int left = --f->refs;
    pthread_mutex_unlock(&f->mu);
    if (left == 0) {
        pthread_mutex_destroy(&f->mu);
        free(f->conversation_id);
        free(f);
    }
}

/* schedule_locked queues a read unless one is queued or running (then it reads again) or the
 * stream is paused or over. With f->mu held. */
static void schedule_locked(struct follower *f)
{
    if (f->finished || f->paused) {
        return;
    }
    if (f->state != F_IDLE) {
        f->dirty = true;
        return;
    }
    f->state = F_QUEUED;
    f->refs++;
    if (!rpc_server_post(f->svc->srv, &f->work)) {
        f->state = F_IDLE;
        f->refs--; /* the call's reference remains */
    }
}

/* follow_end finishes the stream once: with err when not NULL, else with code and details. */
static void follow_end(struct follower *f, grpc_status_code code, const char *details,
                       const struct cf_error *err)
{
    pthread_mutex_lock(&f->mu);
    bool was = f->finished;
    f->finished = true;
    pthread_mutex_unlock(&f->mu);
    if (was) {
        return;
    }
    follow_hub_remove(f->svc->hub, &f->waiter);
    if (err) {
        rpc_call_fail_error(f->call, err);
    } else {
        rpc_call_finish(f->call, code, details);
    }
}

static void follow_wake(struct follow_waiter *w)
{
    struct follower *f = (struct follower *)((char *)w - offsetof(struct follower, waiter));
    pthread_mutex_lock(&f->mu);
    schedule_locked(f);
    pthread_mutex_unlock(&f->mu);
}

static void follow_drained(void *arg)
{
    struct follower *f = arg;
    pthread_mutex_lock(&f->mu);
    f->paused = false;
    schedule_locked(f);
    pthread_mutex_unlock(&f->mu);
}

static void follow_ended(void *arg, enum rpc_end why)
{
    follow_end(arg, why == RPC_END_SHUTDOWN ? GRPC_STATUS_UNAVAILABLE : GRPC_STATUS_CANCELLED,
               "the stream ended; resume from the last offset received", NULL);
}

static void follow_release(void *arg)
{
    follower_unref(arg);
}

static const struct rpc_async_ops follow_ops = {follow_ended, follow_drained, follow_release};

/* read_batch reads one batch after f's cursor and pushes it; *more_out: the batch stopped at
 * its count or byte bound. Finishes the stream on an error, at until_settled, or when the call
 * is dead. Pauses (f->paused) when the send queue fills. Returns false when the stream is over
 * or paused. */
static bool read_batch(struct follower *f, bool *more_out)
{
    struct service *svc = f->svc;
    struct cf_error err;
    struct arena a;
    sqlite3 *db;
    enum cf_status st;
    Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
    Cflue__V1__ReadResponse rs = CFLUE__V1__READ_RESPONSE__INIT;

    *more_out = false;
    cf_error_clear(&err);
    rq.conversation_id = f->conversation_id;
    pthread_mutex_lock(&f->mu);
    rq.after_offset = f->cursor;
    pthread_mutex_unlock(&f->mu);
    rq.page_size = FOLLOW_PAGE;
    arena_init(&a);
    if ((st = reader_begin(svc, &db, &err)) == CF_OK) {
        struct ledger_ctx ctx = {.db = db, .arena = &a, .cfg = svc->cfg, .now = store_clock_now()};
        int64_t budget = ledger_page_bytes(svc->cfg);
        st = ledger_read_bytes(
            &ctx, &rq, budget < LEDGER_FOLLOW_BYTES ? budget : LEDGER_FOLLOW_BYTES, &rs, &err);
        reader_end(svc, db);
    }
    if (st != CF_OK) {
        arena_cleanup(&a);
        follow_end(f, GRPC_STATUS_OK, NULL, &err);
        return false;
    }
    bool done = false, dead = false, paused = false;
    /* pushes under f->mu: drained (which takes it) then comes after paused is set */
    pthread_mutex_lock(&f->mu);
    for (size_t i = 0; i < rs.n_records && !done && !paused && !f->finished; i++) {
        int r = rpc_call_push(f->call, &rs.records[i]->base);
        if (r < 0) {
            dead = true;
            break;
        }
        f->cursor = rs.records[i]->offset;
        done = *f->settled_id && !strcmp(rs.records[i]->id, f->settled_id);
        if (r == 0) {
            paused = f->paused = true;
        }
    }
    bool over = f->finished;
    pthread_mutex_unlock(&f->mu);
    *more_out = *rs.next_page_token != 0;
    arena_cleanup(&a);
    if (done) {
        follow_end(f, GRPC_STATUS_OK, NULL, NULL);
        return false;
    }
    if (dead) {
        follow_end(f, GRPC_STATUS_CANCELLED, "the stream was cancelled", NULL);
        return false;
    }
    return !over && !paused;
}

/* follow_run reads and pushes until nothing new is left, then goes idle; runs on a worker
 * holding a reference, which it drops. */
static void follow_run(struct follower *f)
{
    pthread_mutex_lock(&f->mu);
    f->state = F_RUNNING;
    pthread_mutex_unlock(&f->mu);
    for (;;) {
        pthread_mutex_lock(&f->mu);
        f->dirty = false;
        pthread_mutex_unlock(&f->mu);
        bool more;
        if (read_batch(f, &more) && more) {
            continue;
        }
        pthread_mutex_lock(&f->mu);
        bool again = f->dirty && !f->paused && !f->finished;
        if (!again) {
            f->state = F_IDLE;
        }
        pthread_mutex_unlock(&f->mu);
        if (!again) {
            break;
        }
    }
    follower_unref(f);
}

static void follow_work(struct rpc_work *w)
{
    follow_run((struct follower *)((char *)w - offsetof(struct follower, work)));
}

static void follow(struct rpc_call *call, const ProtobufCMessage *msg, void *user)
{
    struct service *svc = user;
    const Cflue__V1__FollowRequest *req = (const void *)msg;
    struct cf_error err;
    struct arena a;
    enum cf_status st;
    char settled_id[256] = "";
    bool done = false;

    cf_error_clear(&err);
    if ((st = validate_follow(req, &err)) != CF_OK) {
        rpc_call_fail_error(call, &err);
        return;
    }
    /* Check the conversation, the offset and the submission to wait for. */
    arena_init(&a);
    Cflue__V1__ReadRequest probe = CFLUE__V1__READ_REQUEST__INIT;
    Cflue__V1__ReadResponse page = CFLUE__V1__READ_RESPONSE__INIT;
    probe.conversation_id = req->conversation_id;
    probe.after_offset = req->after_offset;
    probe.page_size = 1;
    sqlite3 *db;
    if ((st = reader_begin(svc, &db, &err)) == CF_OK) {
        struct ledger_ctx ctx = {.db = db, .arena = &a, .cfg = svc->cfg, .now = store_clock_now()};
        st = ledger_read(&ctx, &probe, &page, &err);
        if (st == CF_OK && *req->until_settled) {
            Cflue__V1__Submission sub;
            st = ledger_get(&ctx, req->until_settled, &sub, &err);
            if (st == CF_OK && strcmp(sub.conversation_id, req->conversation_id) != 0) {
                st = cf_error_set(&err, CF_INVALID,
                                  "until_settled names submission %s of another conversation",
                                  req->until_settled);
            }
            int64_t off = -1;
            if (st == CF_OK) {
                st = ledger_settlement_offset(&ctx, req->until_settled, req->conversation_id, &off,
                                              &err);
            }
            if (st == CF_OK && off >= 0 && off <= req->after_offset) {
                done = true;
            }
            snprintf(settled_id, sizeof(settled_id), "settled:%s", req->until_settled);
        }
        reader_end(svc, db);
    }
    arena_cleanup(&a);
    if (st != CF_OK) {
        rpc_call_fail_error(call, &err);
        return;
    }
    if (done) {
        rpc_call_finish(call, GRPC_STATUS_OK, NULL);
        return;
    }
    log_debug("store.follow", "conversation=%s after=%lld", req->conversation_id,
              (long long)req->after_offset);

    struct follower *f = mem_alloc(sizeof(*f));
    f->svc = svc;
    f->call = call;
    f->conversation_id = mem_strdup(req->conversation_id);
    snprintf(f->settled_id, sizeof(f->settled_id), "%s", settled_id);
    f->cursor = req->after_offset;
    f->state = F_RUNNING; /* this worker runs the first read */
    f->refs = 2;          /* the call, and this worker */
    f->work.fn = follow_work;
    f->waiter.conversation_id = f->conversation_id;
    f->waiter.wake = follow_wake;
    pthread_mutex_init(&f->mu, NULL);
    /* registered before the first read, so no commit after it goes unnoticed */
    follow_hub_add(svc->hub, &f->waiter);
    if (!rpc_call_async(call, &follow_ops, f)) {
        follow_hub_remove(svc->hub, &f->waiter);
        rpc_call_finish(call,
                        rpc_server_stopping(rpc_call_server(call)) ? GRPC_STATUS_UNAVAILABLE
                                                                   : GRPC_STATUS_CANCELLED,
                        "the stream ended; resume from the last offset received");
        f->refs = 1;
        follower_unref(f);
        return;
    }
    follow_run(f);
}

/* ---------- lifecycle ---------- */

static struct binding bindings[sizeof(methods) / sizeof(methods[0])];

struct service *service_new(const char *db_path, struct writer *w, const struct ledger_config *cfg)
{
    struct service *svc = mem_alloc(sizeof(*svc));
    svc->db_path = mem_strdup(db_path);
    svc->writer = w;
    svc->cfg = cfg;
    svc->hub = follow_hub_new();
    pthread_mutex_init(&svc->mu, NULL);
    return svc;
}

/* ---------- Backup ---------- */

/* send_copy streams the open copy fd in chunks, then the closing chunk with its size, SHA-256
 * and schema version. false when the client went away or the file could not be read (the
 * call is then finished here). */
static bool send_copy(struct rpc_call *c, int fd, const struct backup_copy *copy)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        rpc_call_fail(c, CF_NOMEM, "cannot start the SHA-256 of the copy");
        return false;
    }
    unsigned char *chunk = mem_alloc(BACKUP_CHUNK_BYTES);
    bool ok = true;
    int64_t sent = 0;
    while (ok && sent < copy->size) {
        ssize_t n = read(fd, chunk, BACKUP_CHUNK_BYTES);
        if (n <= 0) {
            rpc_call_fail(c, CF_IO, "cannot read the copy after %lld of %lld bytes: %s",
                          (long long)sent, (long long)copy->size, n < 0 ? strerror(errno) : "end");
            ok = false;
            break;
        }
        EVP_DigestUpdate(md, chunk, (size_t)n);
        failpoint_hit("storaged.backup.chunk"); /* a chunk read, about to be sent */
        Cflue__V1__BackupChunk m = CFLUE__V1__BACKUP_CHUNK__INIT;
        m.data.data = chunk;
        m.data.len = (size_t)n;
        if (!rpc_call_send(c, &m.base)) {
            rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the caller went away");
            ok = false;
        }
        sent += n;
    }
    if (ok) {
        unsigned char sha[32];
        unsigned int len = 0;
        EVP_DigestFinal_ex(md, sha, &len);
        Cflue__V1__BackupChunk m = CFLUE__V1__BACKUP_CHUNK__INIT;
        m.done = true;
        m.size_bytes = sent;
        m.sha256.data = sha;
        m.sha256.len = len;
        m.schema_version = (char *)copy->schema_version;
        ok = rpc_call_send(c, &m.base);
        rpc_call_finish(c, ok ? GRPC_STATUS_OK : GRPC_STATUS_CANCELLED,
                        ok ? NULL : "the caller went away");
    }
    EVP_MD_CTX_free(md);
    free(chunk);
    return ok;
}

static void backup(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    (void)msg;
    struct service *svc = user;
    if (atomic_exchange(&svc->backup_running, true)) {
        rpc_call_fail(c, CF_BUSY, "a backup is running already; ask again once it is done");
        return;
    }
    int64_t t0 = clock_mono_ms();
    struct backup_copy copy;
    struct cf_error err;
    int fd = -1;
    if (backup_take(svc->db_path, &copy, &err) == CF_OK) {
        failpoint_hit("storaged.backup.copied"); /* the copy is there, not yet unlinked */
        fd = open(copy.path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            cf_error_set(&err, CF_IO, "cannot open the copy: %s", strerror(errno));
        }
        unlink(copy.path); /* open or not, the copy goes: the open descriptor keeps it */
    }
    char q[CF_ERROR_MSG_MAX + 16];
    if (fd < 0) {
        log_error("backup_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
        rpc_call_fail_error(c, &err);
    } else {
        int64_t copied_ms = clock_mono_ms() - t0;
        bool sent = send_copy(c, fd, &copy);
        close(fd);
        log_info("backup", "bytes=%lld schema=%s copy_ms=%lld total_ms=%lld sent=%d",
                 (long long)copy.size, copy.schema_version, (long long)copied_ms,
                 (long long)(clock_mono_ms() - t0), (int)sent);
    }
    atomic_store(&svc->backup_running, false);
}

void service_register(struct service *svc, struct rpc_server *srv)
{
    char path[128];
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        bindings[i].m = &methods[i];
        bindings[i].svc = svc;
        snprintf(path, sizeof(path), "/cflue.v1.Store/%s", methods[i].name);
        /* On the event loop: writes (checked and queued for the writer thread; a request over
         * 64 KiB, such as an Append or Settle whose records may be megabytes, is decoded and
         * checked on the pool instead: see rpc.h). On the pool: every read (one may open a
         * connection or wait on a busy database, and the loop must keep answering heartbeats
         * meanwhile). */
        enum rpc_mode mode = methods[i].write ? RPC_INLINE : RPC_POOL;
        rpc_server_add_method(srv, path, methods[i].req_desc, dispatch, &bindings[i], mode);
    }
    svc->srv = srv;
    stats.submissions = metrics_gauge("cflue_store_submissions",
                                      "Submissions in the ledger, by status and outcome (read "
                                      "from the database at each scrape).",
                                      "status,outcome");
    stats.claims = metrics_counter("cflue_store_claims_total",
                                   "Submissions claimed: first attempts, retries after a requeue "
                                   "or failure, and takeovers of an expired lease.",
                                   "kind");
    stats.settle_seconds = metrics_histogram(
        "cflue_store_settle_seconds", "Time from a submission's admission to its settlement.", "",
        metrics_latency_buckets, metrics_latency_buckets_n);
    metrics_on_scrape(count_submissions, svc);
    rpc_server_add_method(srv, "/cflue.v1.Store/Follow", &cflue__v1__follow_request__descriptor,
                          follow, svc, RPC_ASYNC);
    rpc_server_add_method(srv, "/cflue.v1.Store/Backup", &cflue__v1__backup_request__descriptor,
                          backup, svc, RPC_THREAD);
}

void service_free(struct service *svc)
{
    if (!svc) {
        return;
    }
    for (int i = 0; i < svc->n_idle; i++) {
        sqlite3_close(svc->idle[i]);
    }
    follow_hub_free(svc->hub);
    pthread_mutex_destroy(&svc->mu);
    free(svc->db_path);
    free(svc);
}
