/* ledger.c - submission states, fencing, joins, aborts, settlement and record streams.
 *
 * States (column `status`):
 *
 *   queued --claim--> running --settle(reserve_only)--> terminalizing --settle--> settled
 *     ^  \               |  \______________________settle______________________/^
 *     |   \  requeue     |                                                       |
 *     |    +<------------+   claim of an expired lease: same status, new attempt |
 *     |                                                                           |
 *     +--claim_joinable--> joining --finalize--> joined --(host settles)---------+
 *            revert / host settles: back to queued
 *
 * Invariants, each kept by reading and writing in one transaction:
 * - FIFO per conversation: a queued row is claimable only when no earlier row of its
 *   conversation is unsettled (queued, running, terminalizing, joining, joined). So at most one
 *   submission of a conversation runs at a time, in admission order, and a crashed running row
 *   keeps blocking its conversation until recovery settles it. The `runnable` table (db.h) holds
 *   the conversations whose head is queued; triggers keep it on every insert and status change,
 *   so Claim reads its first row instead of walking queued rows.
 * - Fencing: every claim bumps the conversation's epoch and mints a new attempt id; the row
 *   remembers both. A write on behalf of an attempt must present both and is refused
 *   (CF_STALE) when either differs, so an attempt whose lease was taken over cannot write.
 * - Exactly one outcome: `outcome` is set only with status settled (a CHECK constraint), the
 *   transition to settled happens once, and a repeated identical Settle is answered from the
 *   row. A reserved outcome (terminalizing) wins over whatever the finishing Settle asks.
 * - Joined deliveries settle with their host, each with its own settlement record; joining
 *   rows whose input never landed go back to the queue, so nothing admitted is dropped.
 * - A running row has an attempt, a lease and a start; joining and joined rows name their host
 *   (check_row asserts these on every row read).
 * - Streams are append-only; record ids are unique per conversation, which makes a resent
 *   batch idempotent and the settlement record (id "settled:<submission>") unique.
 * - Delegation: a subagent's submission (Admit with a delegation) runs in a new conversation of
 *   its own and names its parent (the `parent_submission_id` column), which exists and is one
 *   level above it, so a tree is at most VALIDATE_DEPTH_MAX levels deep. Whatever stops a parent
 *   stops its descendants in the same transaction: an abort intent on it, or its outcome failed
 *   or aborted (reserved or settled), stamps an intent on each unsettled descendant, and a child
 *   admitted under a parent already stopped carries one from its admission.
 * - Principals: a conversation's principal (the authenticated caller whose Admit created it; a
 *   subagent's conversation takes its parent's) is written once, with the conversation, and
 *   never changes; each submission row carries a copy. An Admit naming a principal goes into
 *   an existing conversation only when it is that conversation's (or the caller is an admin),
 *   checked in the Admit's own transaction, so two agentds cannot race a conversation id into
 *   two principals' hands. An Admit without a principal (authentication off) is not checked.
 * - A combined call (Admit with a claim, Append marking the input applied, Settle with records)
 *   is the separate calls' code run in one transaction, in the order the separate calls would
 *   run: its parts cannot disagree, and a refused part refuses all of it (savepoint).
 */
#include "ledger.h"

#include "db.h"
#include "ids.h"
#include "mem.h"
#include "page_token.h"
#include "pbtime.h"
#include "record_kind.h"
#include "stmt.h"
#include "validate.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUB_COLS                                                                                   \
    "sequence, submission_id, conversation_id, agent, idempotency_key, payload, status,"           \
    " outcome, error, attempt_id, epoch, owner_id, lease_expires_at, attempt_count,"               \
    " max_attempts, timeout_at, accepted_at, started_at, input_applied_at,"                        \
    " abort_requested_at, joined_into, settled_at, answered_by, reserved_outcome, admit_pos,"      \
    " input_tokens, output_tokens, cost_usd, kind, principal, traceparent, tracestate"

#define UNSETTLED "('queued','running','terminalizing','joining','joined')"

/* When the process holding a row's attempt started, as a reclaim (reclaim_started_before)
 * compares it: by that process's own clock when its claim said (owner_started_at), else the
 * attempt's start by storaged's clock (rows of schema 7, and claimers that do not say). */
#define LEDGER_CLAIMER_STARTED                                                                     \
    "(CASE WHEN owner_started_at > 0 THEN owner_started_at ELSE started_at END)"

static const char *status_names[] = {"",        "queued",  "running", "terminalizing",
                                     "settled", "joining", "joined"};
static const char *outcome_names[] = {NULL, "completed", "failed", "aborted"};

const char *ledger_status_name(Cflue__V1__SubmissionStatus st)
{
    return (int)st >= 1 && (int)st <= 6 ? status_names[st] : "unknown";
}

const char *ledger_outcome_name(Cflue__V1__Outcome o)
{
    return (int)o >= 1 && (int)o <= 3 ? outcome_names[o] : NULL;
}

static int status_from(const char *s)
{
    for (int i = 1; i <= 6; i++) {
        if (s && !strcmp(s, status_names[i])) {
            return i;
        }
    }
    return 0;
}

static int outcome_from(const char *s)
{
    for (int i = 1; i <= 3; i++) {
        if (s && !strcmp(s, outcome_names[i])) {
            return i;
        }
    }
    return 0;
}

/* ---------- statement results ---------- */

static const char *col_text(struct ledger_ctx *c, sqlite3_stmt *st, int i)
{
    const unsigned char *t = sqlite3_column_text(st, i);
    return t ? arena_memdup(c->arena, t, (size_t)sqlite3_column_bytes(st, i)) : "";
}

/* strv is a growing array of strings in the arena. */
struct strv {
    char **v;
    size_t n, cap;
};

static void strv_push(struct ledger_ctx *c, struct strv *a, const char *s)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 8;
        char **more = arena_alloc(c->arena, sizeof(char *) * cap);
        if (a->n) {
            memcpy(more, a->v, sizeof(char *) * a->n);
        }
        a->v = more;
        a->cap = cap;
    }
    a->v[a->n++] = (char *)s;
}

/* column_strings collects column 0 of every row of an open statement into *out and closes it. */
static enum cf_status column_strings(struct ledger_ctx *c, struct stmt *s, struct strv *out,
                                     struct cf_error *err)
{
    enum cf_status rc;
    bool row;
    while ((rc = stmt_step(s, &row, err)) == CF_OK && row) {
        strv_push(c, out, col_text(c, s->st, 0));
    }
    stmt_close(s);
    return rc;
}

/* ---------- payload ---------- */

static int cmp_entry(const void *a, const void *b)
{
    const Cflue__V1__AdmitRequest__MetadataEntry *x = *(void *const *)a, *y = *(void *const *)b;
    int r = strcmp(x->key, y->key);
    return r ? r : strcmp(x->value, y->value);
}

/* canonical_payload packs what identifies an admission: the request with its metadata sorted,
 * so two clients that order a map differently produce the same bytes, its kind MESSAGE
 * written as UNSPECIFIED (the two mean the same), and without its claim (a retry that claims
 * differently, or not at all, is the same admission), its admin flag or its trace context (a
 * retry comes with a trace of its own; the first one's is kept). Its principal is part of it:
 * another principal's request with the same key is never the same admission. */
static uint8_t *canonical_payload(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                                  size_t *len_out)
{
    Cflue__V1__AdmitRequest copy = *req;
    copy.claim = NULL;     /* how the caller wants it claimed is no part of what it admits */
    copy.admin = false;    /* nor the rights of the caller's token */
    copy.traceparent = ""; /* nor the trace of the call that admits it (a retry has its own) */
    copy.tracestate = "";
    if (copy.kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE) {
        copy.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_UNSPECIFIED;
    }
    if (req->n_metadata) {
        copy.metadata = arena_alloc(c->arena, sizeof(void *) * req->n_metadata);
        memcpy(copy.metadata, req->metadata, sizeof(void *) * req->n_metadata);
        qsort(copy.metadata, req->n_metadata, sizeof(void *), cmp_entry);
    }
    *len_out = protobuf_c_message_get_packed_size(&copy.base);
    uint8_t *buf = arena_alloc(c->arena, *len_out + 1);
    protobuf_c_message_pack(&copy.base, buf);
    return buf;
}

/* ---------- rows ---------- */

static void row_to_sub(struct ledger_ctx *c, sqlite3_stmt *st, Cflue__V1__Submission *out)
{
    cflue__v1__submission__init(out);
    out->sequence = sqlite3_column_int64(st, 0);
    out->submission_id = (char *)col_text(c, st, 1);
    out->conversation_id = (char *)col_text(c, st, 2);
    out->agent = (char *)col_text(c, st, 3);
    out->idempotency_key = (char *)col_text(c, st, 4);
    const void *blob = sqlite3_column_blob(st, 5);
    size_t blob_len = (size_t)sqlite3_column_bytes(st, 5);
    Cflue__V1__AdmitRequest *p = (Cflue__V1__AdmitRequest *)protobuf_c_message_unpack(
        &cflue__v1__admit_request__descriptor, arena_protobuf_allocator(c->arena), blob_len, blob);
    if (p) {
        out->message = p->message;
        out->source = p->source;
        out->delegation = p->delegation; /* kept in the payload, as admitted */
        out->n_metadata = p->n_metadata;
        if (p->n_metadata) {
            out->metadata = arena_alloc(c->arena, sizeof(void *) * p->n_metadata);
            for (size_t i = 0; i < p->n_metadata; i++) {
                Cflue__V1__Submission__MetadataEntry *e = arena_alloc(c->arena, sizeof(*e));
                cflue__v1__submission__metadata_entry__init(e);
                e->key = p->metadata[i]->key;
                e->value = p->metadata[i]->value;
                out->metadata[i] = e;
            }
        }
    }
    out->status = status_from((const char *)sqlite3_column_text(st, 6));
    out->outcome = outcome_from((const char *)sqlite3_column_text(st, 7));
    if (out->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING) {
        out->outcome = outcome_from((const char *)sqlite3_column_text(st, 23));
    }
    out->error = (char *)col_text(c, st, 8);
    out->attempt_id = (char *)col_text(c, st, 9);
    out->epoch = sqlite3_column_int64(st, 10);
    out->owner_id = (char *)col_text(c, st, 11);
    out->lease_expire_time = pbtime_in(c->arena, sqlite3_column_int64(st, 12));
    out->attempt_count = sqlite3_column_int(st, 13);
    out->max_attempts = sqlite3_column_int(st, 14);
    out->deadline = pbtime_in(c->arena, sqlite3_column_int64(st, 15));
    out->create_time = pbtime_in(c->arena, sqlite3_column_int64(st, 16));
    out->start_time = pbtime_in(c->arena, sqlite3_column_int64(st, 17));
    out->input_apply_time = pbtime_in(c->arena, sqlite3_column_int64(st, 18));
    out->abort_request_time = pbtime_in(c->arena, sqlite3_column_int64(st, 19));
    out->joined_into = (char *)col_text(c, st, 20);
    out->settle_time = pbtime_in(c->arena, sqlite3_column_int64(st, 21));
    out->answered_by = (char *)col_text(c, st, 22);
    int64_t in = sqlite3_column_int64(st, 25), outk = sqlite3_column_int64(st, 26);
    double cost = sqlite3_column_double(st, 27);
    if (in || outk || cost > 0) {
        out->usage = arena_alloc(c->arena, sizeof(*out->usage));
        cflue__v1__usage__init(out->usage);
        out->usage->input_tokens = in;
        out->usage->output_tokens = outk;
        out->usage->cost_usd = cost;
    }
    out->kind = sqlite3_column_int(st, 28) == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT
                    ? CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT
                    : CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE;
    out->principal = (char *)col_text(c, st, 29); /* NULL (none): "" */
    out->traceparent = (char *)col_text(c, st, 30);
    out->tracestate = (char *)col_text(c, st, 31);
}

/* check_row asserts the invariants of the essay on a row as read. */
static void check_row(const Cflue__V1__Submission *s)
{
    (void)s;
    assert((s->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) ==
               (s->outcome != 0) ||
           s->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING);
    assert(s->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING ||
           (*s->attempt_id && s->lease_expire_time && s->start_time));
    assert((s->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING &&
            s->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINED) ||
           *s->joined_into);
}

static enum cf_status load_sub(struct ledger_ctx *c, const char *id, Cflue__V1__Submission *out,
                               struct cf_error *err)
{
    static const char sql[] = "SELECT " SUB_COLS " FROM submissions WHERE submission_id = ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "read submission", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, id);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        row_to_sub(c, s.st, out);
        check_row(out);
    } else if (rc == CF_OK) {
        rc = cf_error_set(err, CF_NOT_FOUND, "no submission with id '%s'", id);
    }
    stmt_close(&s);
    return rc;
}

static Cflue__V1__Submission *new_sub(struct ledger_ctx *c)
{
    Cflue__V1__Submission *s = arena_alloc(c->arena, sizeof(*s));
    cflue__v1__submission__init(s);
    return s;
}

/* list_subs collects the rows of an open statement selecting SUB_COLS while their encoded size
 * stays within the page budget (ledger_page_bytes; always at least one row: an answer of them
 * must fit a gRPC message), and closes it. *cut: a row was left for another time. */
static enum cf_status list_subs(struct ledger_ctx *c, struct stmt *s,
                                Cflue__V1__Submission ***items, size_t *n, bool *cut,
                                struct cf_error *err)
{
    size_t cap = 16, used = 0, budget = (size_t)ledger_page_bytes(c->cfg);
    enum cf_status rc;
    bool row;
    *n = 0;
    *cut = false;
    *items = arena_alloc(c->arena, sizeof(void *) * cap);
    while ((rc = stmt_step(s, &row, err)) == CF_OK && row) {
        if (*n == cap) {
            Cflue__V1__Submission **more = arena_alloc(c->arena, sizeof(void *) * cap * 2);
            memcpy(more, *items, sizeof(void *) * cap);
            *items = more;
            cap *= 2;
        }
        Cflue__V1__Submission *sub = new_sub(c);
        row_to_sub(c, s->st, sub);
        size_t size = protobuf_c_message_get_packed_size(&sub->base) + 16;
        if (*n && used + size > budget) {
            *cut = true; /* the rest another time: an answer must fit a message */
            break;
        }
        used += size;
        (*items)[(*n)++] = sub;
    }
    stmt_close(s);
    return rc;
}

/* ---------- fencing ---------- */

#define ST_BIT(s) (1u << (CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_##s))

/* fenced loads the fenced row and checks attempt, epoch and status. */
static enum cf_status fenced(struct ledger_ctx *c, const Cflue__V1__Fence *f, unsigned allowed,
                             const char *need, Cflue__V1__Submission *row, struct cf_error *err)
{
    enum cf_status rc;
    if (!f || !*f->submission_id || !*f->attempt_id) {
        return cf_error_set(err, CF_INVALID, "fence with submission_id and attempt_id is required");
    }
    if ((rc = load_sub(c, f->submission_id, row, err)) != CF_OK) {
        return rc;
    }
    if (strcmp(row->attempt_id, f->attempt_id) != 0 || row->epoch != f->epoch) {
        return cf_error_set(err, CF_STALE,
                            "stale fence: attempt %s (epoch %lld) no longer holds submission %s "
                            "(current attempt '%s', epoch %lld, status %s)",
                            f->attempt_id, (long long)f->epoch, f->submission_id, row->attempt_id,
                            (long long)row->epoch, ledger_status_name(row->status));
    }
    if (!(allowed & (1u << row->status))) {
        return cf_error_set(err, CF_PRECONDITION, "submission %s is %s; this write needs it %s",
                            row->submission_id, ledger_status_name(row->status), need);
    }
    return CF_OK;
}

/* ---------- streams ---------- */

static enum cf_status conversation_head(struct ledger_ctx *c, const char *conv, int64_t *next_pos,
                                        struct cf_error *err)
{
    static const char sql[] = "SELECT next_pos FROM conversations WHERE conversation_id = ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "read conversation", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, conv);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        *next_pos = sqlite3_column_int64(s.st, 0);
    } else if (rc == CF_OK) {
        rc = cf_error_set(err, CF_NOT_FOUND, "no conversation with id '%s'", conv);
    }
    stmt_close(&s);
    return rc;
}

/* count_queued counts the QUEUED submissions of a conversation after sequence `after` (0: all
 * of them), through the index submissions_by_conversation (conversation, status, sequence). */
static enum cf_status count_queued(struct ledger_ctx *c, const char *conv, int64_t after,
                                   int32_t *out, struct cf_error *err)
{
    static const char sql[] = "SELECT count(*) FROM submissions WHERE conversation_id = ? "
                              "AND status = 'queued' AND sequence > ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "count queued submissions", err);
    *out = 0;
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, conv);
    stmt_int(&s, 2, after);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        *out = sqlite3_column_int(s.st, 0);
    }
    stmt_close(&s);
    return rc;
}

/* pack_body returns the record's body packed (protobuf-c), in the arena: the `body` column.
 * The body must be set (validate_append and the settlement path make sure). */
static uint8_t *pack_body(struct ledger_ctx *c, const Cflue__V1__Record *r, size_t *len_out)
{
    const ProtobufCMessage *body = record_body(r);
    assert(body != NULL);
    *len_out = protobuf_c_message_get_packed_size(body);
    uint8_t *buf = arena_alloc(c->arena, *len_out + 1);
    protobuf_c_message_pack(body, buf);
    return buf;
}

/* insert_records appends records at the conversation's head. Ids and bodies must be set. */
static enum cf_status insert_records(struct ledger_ctx *c, const char *conv,
                                     Cflue__V1__Record *const *recs, size_t n,
                                     const char *default_sub, const char *attempt,
                                     int64_t *first_out, struct cf_error *err)
{
    static const char insert_sql[] =
        "INSERT INTO records(conversation_id, pos, record_id, kind, submission_id, attempt_id, "
        "ts, body) VALUES (?,?,?,?,?,?,?,?)";
    static const char advance_sql[] =
        "UPDATE conversations SET next_pos = next_pos + ? WHERE conversation_id = ?";
    int64_t pos;
    enum cf_status rc;
    struct stmt s;
    if ((rc = conversation_head(c, conv, &pos, err)) != CF_OK) {
        return rc;
    }
    *first_out = pos;
    for (size_t i = 0; i < n; i++) {
        const Cflue__V1__Record *r = recs[i];
        size_t len;
        const uint8_t *body = pack_body(c, r, &len);
        if ((rc = stmt_open(&s, c->db, insert_sql, "insert record", err)) != CF_OK) {
            return rc;
        }
        stmt_text(&s, 1, conv);
        stmt_int(&s, 2, pos + (int64_t)i);
        stmt_text(&s, 3, r->id);
        stmt_int(&s, 4, (int)r->body_case);
        stmt_opt_text(&s, 5, *r->submission_id ? r->submission_id : default_sub);
        stmt_opt_text(&s, 6, attempt);
        stmt_int(&s, 7, c->now);
        stmt_blob(&s, 8, body, len);
        if ((rc = stmt_done(&s, err)) != CF_OK) {
            return rc;
        }
    }
    if ((rc = stmt_open(&s, c->db, advance_sql, "advance conversation head", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, (int64_t)n);
    stmt_text(&s, 2, conv);
    c->appended = true;
    return stmt_done(&s, err);
}

/* ---------- admission ---------- */

/* call_identity packs a delegated admission's payload without what its parent's definitions
 * and placement decide (Delegation.sandbox_tools, .sandbox_placement, .sandbox, .model and
 * .sandbox_limits): NULL when it has no delegation or does not unpack. */
static uint8_t *call_identity(struct ledger_ctx *c, const uint8_t *payload, size_t len,
                              size_t *len_out)
{
    Cflue__V1__AdmitRequest *r = (Cflue__V1__AdmitRequest *)protobuf_c_message_unpack(
        &cflue__v1__admit_request__descriptor, arena_protobuf_allocator(c->arena), len, payload);
    if (!r || !r->delegation) {
        return NULL;
    }
    r->delegation->sandbox_tools = "";
    r->delegation->sandbox_placement = "";
    r->delegation->sandbox = "";
    r->delegation->model = "";
    r->delegation->sandbox_limits = NULL;
    *len_out = protobuf_c_message_get_packed_size(&r->base);
    uint8_t *buf = arena_alloc(c->arena, *len_out + 1);
    protobuf_c_message_pack(&r->base, buf);
    return buf;
}

/* same_admission: a stored payload and a request's (canonical_payload) are the same
 * admission. A delegated one is the same task call (its parent, call, agent, message and
 * working directory) whatever its parent's definitions and placement say now: its sandbox's
 * address, name and limits and its model may change between the parent's attempts (its replica
 * given up, an agentd of another version, definitions reloaded), and a retry of the call must
 * find its child, not a conflict (the child keeps what it was admitted with). */
static bool same_admission(struct ledger_ctx *c, const void *stored, size_t stored_len,
                           const uint8_t *payload, size_t payload_len)
{
    if (stored_len == payload_len && !memcmp(stored, payload, payload_len)) {
        return true;
    }
    size_t a_len = 0, b_len = 0;
    const uint8_t *a = call_identity(c, stored, stored_len, &a_len);
    const uint8_t *b = a ? call_identity(c, payload, payload_len, &b_len) : NULL;
    return b && a_len == b_len && !memcmp(a, b, a_len);
}

/* admitted_before looks the idempotency key up: *found_out tells whether it was used; then out
 * holds the earlier admission when it is the same one (same_admission), else
 * IDEMPOTENCY_CONFLICT. */
static enum cf_status admitted_before(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                                      const uint8_t *payload, size_t payload_len,
                                      Cflue__V1__AdmitResponse *out, bool *found_out,
                                      struct cf_error *err)
{
    static const char sql[] =
        "SELECT submission_id, payload, admit_pos, principal FROM submissions "
        "WHERE agent = ? AND idempotency_key = ?";
    struct stmt s;
    enum cf_status rc = stmt_open(&s, c->db, sql, "look up idempotency key", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, req->agent);
    stmt_text(&s, 2, req->idempotency_key);
    if ((rc = stmt_step(&s, found_out, err)) != CF_OK || !*found_out) {
        stmt_close(&s);
        return rc;
    }
    const char *existing = col_text(c, s.st, 0);
    bool same = same_admission(c, sqlite3_column_blob(s.st, 1),
                               (size_t)sqlite3_column_bytes(s.st, 1), payload, payload_len);
    int64_t pos = sqlite3_column_int64(s.st, 2);
    bool theirs = *req->principal && !req->admin && strcmp(col_text(c, s.st, 3), req->principal);
    stmt_close(&s);
    if (!same) {
        /* another principal's key: refused the same way, without naming their submission */
        return cf_error_setr(err, CF_EXISTS, "IDEMPOTENCY_CONFLICT",
                             "idempotency key '%s' of agent '%s' was already used for a "
                             "different submission%s%s%s",
                             req->idempotency_key, req->agent, theirs ? "" : " (",
                             theirs ? "" : existing, theirs ? "" : ")");
    }
    out->submission = new_sub(c);
    out->deduplicated = true;
    out->offset = pos;
    return load_sub(c, existing, out->submission, err);
}

/* owned_by checks that the request's principal may admit into a conversation whose principal
 * is owner: always without a principal (no authentication) or as an admin, else only as that
 * principal. The message names neither principal. */
static enum cf_status owned_by(const Cflue__V1__AdmitRequest *req, const char *owner,
                               struct cf_error *err)
{
    if (!*req->principal || req->admin || !strcmp(owner, req->principal)) {
        return CF_OK;
    }
    return cf_error_setr(err, CF_PERMISSION, "NOT_CONVERSATION_OWNER",
                         "conversation '%s' belongs to %s", req->conversation_id,
                         *owner ? "another principal"
                                : "no principal (it was created without authentication): only "
                                  "an admin token may use it");
}

/* admit_conversation finds the conversation the request names (owned by its agent, and by the
 * request's principal: owned_by) or creates it (named as asked, or a new id) with the
 * principal new_principal, into conv; *next_pos_out is its stream's next offset and
 * principal_out (IDS_PRINCIPAL_MAX + 1 bytes) its principal ("" for none). */
static enum cf_status admit_conversation(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                                         const char *new_principal, char *conv, size_t conv_len,
                                         int64_t *next_pos_out, char *principal_out,
                                         struct cf_error *err)
{
    static const char find_sql[] =
        "SELECT agent, next_pos, principal FROM conversations WHERE conversation_id = ?";
    static const char create_sql[] =
        "INSERT INTO conversations(conversation_id, agent, created_at, principal) VALUES (?,?,?,?)";
    struct stmt s;
    enum cf_status rc;
    bool row = false;
    *next_pos_out = 0;
    if (*req->conversation_id) {
        if ((rc = stmt_open(&s, c->db, find_sql, "read conversation", err)) != CF_OK) {
            return rc;
        }
        stmt_text(&s, 1, req->conversation_id);
        if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
            const char *owner = col_text(c, s.st, 0);
            *next_pos_out = sqlite3_column_int64(s.st, 1);
            snprintf(principal_out, IDS_PRINCIPAL_MAX + 1, "%s", col_text(c, s.st, 2));
            /* the principal first: another principal learns nothing of the conversation */
            rc = owned_by(req, principal_out, err);
            if (rc == CF_OK && strcmp(owner, req->agent) != 0) {
                rc = cf_error_set(err, CF_PRECONDITION,
                                  "conversation '%s' belongs to agent '%s', not '%s'",
                                  req->conversation_id, owner, req->agent);
            }
        }
        stmt_close(&s);
        if (rc != CF_OK || row) {
            snprintf(conv, conv_len, "%s", req->conversation_id);
            return rc;
        }
    }
    if (req->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT) {
        return cf_error_set(err, CF_NOT_FOUND,
                            "no conversation with id '%s' to compact (kind COMPACT needs an "
                            "existing conversation)",
                            req->conversation_id);
    }
    if (*req->conversation_id) {
        snprintf(conv, conv_len, "%s", req->conversation_id);
    } else {
        ids_new(conv, "conv");
    }
    if ((rc = stmt_open(&s, c->db, create_sql, "create conversation", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, conv);
    stmt_text(&s, 2, req->agent);
    stmt_int(&s, 3, c->now);
    stmt_opt_text(&s, 4, new_principal);
    snprintf(principal_out, IDS_PRINCIPAL_MAX + 1, "%s", new_principal);
    return stmt_done(&s, err);
}

/* admit_claim claims the submission just admitted (out->submission), as a Claim naming it
 * would: out->claim is set when it was its conversation's runnable head, else left absent (it
 * waits behind unsettled work). The Claim of the admitted row is defined below. */
static enum cf_status admit_claim(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *claim,
                                  Cflue__V1__AdmitResponse *out, struct cf_error *err)
{
    Cflue__V1__ClaimRequest req = *claim;
    Cflue__V1__ClaimResponse *got = arena_alloc(c->arena, sizeof(*got));
    enum cf_status rc;
    cflue__v1__claim_response__init(got);
    req.submission_id = out->submission->submission_id;
    if ((rc = ledger_claim(c, &req, got, err)) != CF_OK || !got->submission) {
        return rc;
    }
    /* a new row cannot hold an attempt: the claim started its first one */
    assert(!got->takeover && got->submission->attempt_count == 1);
    out->claim = got;
    /* the row as committed (RUNNING), without the message: claim.submission carries it, and a
     * large message crosses the wire once */
    Cflue__V1__Submission *row = arena_alloc(c->arena, sizeof(*row));
    *row = *got->submission;
    row->message = NULL;
    out->submission = row;
    return CF_OK;
}

/* strfmt formats into the arena (for abort reasons built from the request's text). */
static const char *strfmt(struct ledger_ctx *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static const char *strfmt(struct ledger_ctx *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *out = arena_alloc(c->arena, (size_t)(n < 0 ? 0 : n) + 1);
    va_start(ap, fmt);
    vsnprintf(out, (size_t)(n < 0 ? 0 : n) + 1, fmt, ap);
    va_end(ap);
    return out;
}

/* admit_parent reads a delegated submission's parent in this transaction: it must exist
 * (CF_NOT_FOUND), in the conversation the delegation names and one level above the child
 * (CF_INVALID otherwise: a depth that skips levels would unbound the tree). When the parent was
 * stopped already (it has an abort intent, or it is settled, whatever its outcome),
 * *abort_reason_out is the intent the child is admitted with; else NULL. *principal_out is the
 * parent conversation's principal, which the child's conversation takes: a request naming
 * another one is CF_PERMISSION. */
static enum cf_status admit_parent(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                                   const char **abort_reason_out, const char **principal_out,
                                   struct cf_error *err)
{
    const Cflue__V1__Delegation *d = req->delegation;
    Cflue__V1__Submission parent;
    enum cf_status rc = load_sub(c, d->parent_submission_id, &parent, err);
    *abort_reason_out = NULL;
    if (rc == CF_NOT_FOUND) {
        return cf_error_set(err, CF_NOT_FOUND,
                            "delegation.parent_submission_id: no submission with id '%s' (the "
                            "parent of a delegated submission must exist)",
                            d->parent_submission_id);
    }
    if (rc != CF_OK) {
        return rc;
    }
    if (strcmp(parent.conversation_id, d->parent_conversation_id) != 0) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.parent_conversation_id is '%s', but parent submission %s "
                            "is in conversation %s",
                            d->parent_conversation_id, parent.submission_id,
                            parent.conversation_id);
    }
    int32_t parent_depth = parent.delegation ? parent.delegation->depth : 0;
    if (d->depth != parent_depth + 1) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.depth is %d, but parent submission %s is at depth %d (a "
                            "child is one level below its parent)",
                            (int)d->depth, parent.submission_id, (int)parent_depth);
    }
    if (*req->principal && !req->admin && strcmp(req->principal, parent.principal) != 0) {
        return cf_error_setr(err, CF_PERMISSION, "NOT_CONVERSATION_OWNER",
                             "delegation.parent_submission_id: submission %s belongs to another "
                             "principal (a child takes its parent's)",
                             parent.submission_id);
    }
    *principal_out = parent.principal;
    if (parent.abort_request_time) {
        *abort_reason_out =
            strfmt(c, "parent submission %s has an abort intent", parent.submission_id);
    } else if (parent.status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
        *abort_reason_out = strfmt(c, "parent submission %s is already settled (%s)",
                                   parent.submission_id, outcome_names[parent.outcome]);
    }
    return CF_OK;
}

enum cf_status ledger_admit(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                            Cflue__V1__AdmitResponse *out, struct cf_error *err)
{
    static const char insert_sql[] =
        "INSERT INTO submissions(submission_id, conversation_id, agent, idempotency_key, "
        "payload, status, max_attempts, accepted_at, admit_pos, kind, parent_submission_id, "
        "abort_requested_at, abort_reason, principal, traceparent, tracestate) "
        "VALUES (?,?,?,?,?,'queued',?,?,?,?,?,NULLIF(?,0),?,?,?,?)";
    struct stmt s;
    enum cf_status rc;
    size_t payload_len;
    uint8_t *payload = canonical_payload(c, req, &payload_len);
    char conv[VALIDATE_NAME_MAX + 1], sub[IDS_MAX], principal[IDS_PRINCIPAL_MAX + 1];
    if (c->cfg->send_bytes > 0 && (int64_t)payload_len > c->cfg->send_bytes - LEDGER_ADMIT_SLACK) {
        /* admitted, it would be answered in messages larger than this storaged sends: every
         * Admit, Claim, Get and List of it would fail, and it would never settle */
        return cf_error_setr(err, CF_INVALID, "ADMISSION_TOO_LARGE",
                             "the admission is %zu bytes encoded (message, attachments, metadata); "
                             "at most %lld (--max-message-bytes %lld less %d for the rest of a "
                             "submission)",
                             payload_len, (long long)(c->cfg->send_bytes - LEDGER_ADMIT_SLACK),
                             (long long)c->cfg->send_bytes, LEDGER_ADMIT_SLACK);
    }
    int64_t next_pos = 0;
    bool found = false;
    bool compact = req->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
    const char *abort_reason = NULL;
    const char *new_principal = req->principal; /* of a conversation this Admit creates */

    /* a retried delegated Admit finds its child here, whatever became of the parent since */
    if (*req->idempotency_key &&
        ((rc = admitted_before(c, req, payload, payload_len, out, &found, err)) != CF_OK ||
         found)) {
        return rc;
    }
    if (req->delegation &&
        (rc = admit_parent(c, req, &abort_reason, &new_principal, err)) != CF_OK) {
        return rc;
    }
    /* validate_admit: a delegated submission starts a new conversation */
    assert(!req->delegation || !*req->conversation_id);
    if ((rc = admit_conversation(c, req, new_principal, conv, sizeof(conv), &next_pos, principal,
                                 err)) != CF_OK) {
        return rc;
    }
    ids_new(sub, "sub");
    if ((rc = stmt_open(&s, c->db, insert_sql, "insert submission", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, sub);
    stmt_text(&s, 2, conv);
    stmt_text(&s, 3, req->agent);
    stmt_opt_text(&s, 4, req->idempotency_key);
    stmt_blob(&s, 5, payload, payload_len);
    stmt_int(&s, 6, c->cfg->max_attempts);
    stmt_int(&s, 7, c->now);
    stmt_int(&s, 8, next_pos - 1);
    stmt_int(&s, 9,
             compact ? CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT
                     : CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE);
    stmt_opt_text(&s, 10, req->delegation ? req->delegation->parent_submission_id : NULL);
    stmt_int(&s, 11, abort_reason ? c->now : 0);
    stmt_opt_text(&s, 12, abort_reason);
    stmt_opt_text(&s, 13, principal);        /* the conversation's, never changed: Get answers it */
    stmt_opt_text(&s, 14, req->traceparent); /* kept as admitted, outside the payload */
    stmt_opt_text(&s, 15, req->tracestate);
    if ((rc = stmt_done(&s, err)) != CF_OK) {
        return rc;
    }
    out->submission = new_sub(c);
    out->offset = next_pos - 1;
    if ((rc = load_sub(c, sub, out->submission, err)) != CF_OK) {
        return rc;
    }
    assert(out->submission->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED);
    return req->claim ? admit_claim(c, req->claim, out, err) : CF_OK;
}

/* ---------- claims and leases ---------- */

/* A Claim looks at three things, each through an index, so its cost does not grow with the
 * queues (see docs/storaged.md, "Claim"):
 * - an expired lease: the partial index submissions_by_lease holds running and terminalizing
 *   rows by lease expiry; expired ones are few;
 * - the caller's own earlier attempts (reclaim_started_before, a restarted agentd's claims
 *   until the first that is no takeover): that owner's rows (submissions_by_owner, settled
 *   ones too), the running and terminalizing ones among them, of another process (another
 *   owner_started_at, or started before); a targeted reclaim (a resume) takes only those
 *   started before;
 * - a conversation whose head (first unsettled submission) is queued: the `runnable` table,
 *   kept by triggers on every insert and status change of submissions, one row per such
 *   conversation, keyed by the head's sequence, so the oldest is its first row.
 * A targeted Claim (submission_id) reads its one row and decides the same way. */

/* pick_one runs a pick statement (bound by the caller) and reads its row (sequence,
 * submission_id) into *seq and id, when it has one and it comes before *seq. Closes s. */
static enum cf_status pick_one(struct stmt *s, int64_t *seq, char *id, size_t id_len,
                               struct cf_error *err)
{
    bool row;
    enum cf_status rc = stmt_step(s, &row, err);
    if (rc == CF_OK && row && sqlite3_column_int64(s->st, 0) < *seq) {
        *seq = sqlite3_column_int64(s->st, 0);
        snprintf(id, id_len, "%s", (const char *)sqlite3_column_text(s->st, 1));
    }
    stmt_close(s);
    return rc;
}

/* pick_takeover finds the oldest running or terminalizing row the request may take over. */
static enum cf_status pick_takeover(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req,
                                    char *id, size_t id_len, struct cf_error *err)
{
    static const char expired_sql[] =
        "SELECT sequence, submission_id FROM submissions INDEXED BY submissions_by_lease "
        "WHERE status IN ('running','terminalizing') AND lease_expires_at > 0 "
        "AND lease_expires_at < ?1 AND (?2 = '' OR conversation_id = ?2) "
        "ORDER BY sequence LIMIT 1";
    /* another process's attempts: one that said another start than this claim's, whether its
     * clock read earlier or later (the clock set back between the two), or one started before */
    static const char owned_sql[] =
        "SELECT sequence, submission_id FROM submissions WHERE status IN "
        "('running','terminalizing') AND owner_id = ?1 AND (" LEDGER_CLAIMER_STARTED " < ?2 "
        "OR (owner_started_at > 0 AND owner_started_at != ?4)) "
        "AND (?3 = '' OR conversation_id = ?3) ORDER BY sequence LIMIT 1";
    struct stmt s;
    enum cf_status rc;
    int64_t seq = INT64_MAX, before = pbtime_ms(req->reclaim_started_before);
    id[0] = '\0';
    if ((rc = stmt_open(&s, c->db, expired_sql, "find expired leases", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, c->now);
    stmt_text(&s, 2, req->conversation_id);
    if ((rc = pick_one(&s, &seq, id, id_len, err)) != CF_OK || before <= 0) {
        return rc;
    }
    if ((rc = stmt_open(&s, c->db, owned_sql, "find the owner's attempts", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, req->owner_id);
    stmt_int(&s, 2, before);
    stmt_text(&s, 3, req->conversation_id);
    stmt_int(&s, 4, pbtime_ms(req->owner_started_at));
    return pick_one(&s, &seq, id, id_len, err);
}

/* pick_head finds the oldest queued head of a conversation (of req->conversation_id if set). */
static enum cf_status pick_head(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req, char *id,
                                size_t id_len, struct cf_error *err)
{
    static const char any_sql[] =
        "SELECT r.sequence, s.submission_id FROM runnable r JOIN submissions s "
        "ON s.sequence = r.sequence ORDER BY r.sequence LIMIT 1";
    static const char conv_sql[] =
        "SELECT r.sequence, s.submission_id FROM runnable r JOIN submissions s "
        "ON s.sequence = r.sequence WHERE r.conversation_id = ?1";
    struct stmt s;
    int64_t seq = INT64_MAX;
    bool by_conv = *req->conversation_id != '\0';
    enum cf_status rc =
        stmt_open(&s, c->db, by_conv ? conv_sql : any_sql, "find claimable work", err);
    id[0] = '\0';
    if (rc != CF_OK) {
        return rc;
    }
    if (by_conv) {
        stmt_text(&s, 1, req->conversation_id);
    }
    return pick_one(&s, &seq, id, id_len, err);
}

/* is_runnable tells whether sequence is its conversation's queued head. */
static enum cf_status is_runnable(struct ledger_ctx *c, int64_t sequence, bool *out,
                                  struct cf_error *err)
{
    static const char sql[] = "SELECT 1 FROM runnable WHERE sequence = ?";
    struct stmt s;
    enum cf_status rc = stmt_open(&s, c->db, sql, "find claimable work", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, sequence);
    rc = stmt_step(&s, out, err);
    stmt_close(&s);
    return rc;
}

/* claimer_started reads when the process holding submission id's attempt started (see
 * LEDGER_CLAIMER_STARTED) into *ms. */
static enum cf_status claimer_started(struct ledger_ctx *c, const char *id, int64_t *ms,
                                      struct cf_error *err)
{
    static const char sql[] =
        "SELECT " LEDGER_CLAIMER_STARTED " FROM submissions WHERE submission_id = ?";
    struct stmt s;
    bool row = false;
    enum cf_status rc = stmt_open(&s, c->db, sql, "read the claimer's start", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, id);
    rc = stmt_step(&s, &row, err);
    *ms = row ? sqlite3_column_int64(s.st, 0) : 0;
    stmt_close(&s);
    return rc;
}

/* pick_target decides a Claim of one submission (req->submission_id), as the picks above
 * would: *takeover_out when it takes over an attempt, id[0] = 0 when it cannot be claimed. */
static enum cf_status pick_target(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req,
                                  char *id, size_t id_len, bool *takeover_out, struct cf_error *err)
{
    Cflue__V1__Submission row;
    enum cf_status rc;
    bool head = false;
    int64_t before = pbtime_ms(req->reclaim_started_before);
    id[0] = '\0';
    *takeover_out = false;
    if ((rc = load_sub(c, req->submission_id, &row, err)) != CF_OK) {
        return rc;
    }
    if (*req->conversation_id && strcmp(req->conversation_id, row.conversation_id) != 0) {
        return CF_OK;
    }
    int64_t lease = pbtime_ms(row.lease_expire_time);
    switch (row.status) {
    case CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING:
    case CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING:
        *takeover_out = lease > 0 && lease < c->now;
        if (!*takeover_out && before > 0 && !strcmp(row.owner_id, req->owner_id)) {
            int64_t started = 0;
            rc = claimer_started(c, row.submission_id, &started, err);
            *takeover_out = rc == CF_OK && started < before;
        }
        break;
    case CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED:
        rc = is_runnable(c, row.sequence, &head, err);
        break;
    default:
        break;
    }
    if (*takeover_out || head) {
        snprintf(id, id_len, "%s", row.submission_id);
    }
    return rc;
}

/* start_attempt bumps the conversation's epoch and gives the row a new attempt, owner and
 * lease (a queued row starts running; a taken-over one keeps its status). */
static enum cf_status start_attempt(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req,
                                    const Cflue__V1__Submission *row, struct cf_error *err)
{
    static const char epoch_sql[] =
        "UPDATE conversations SET epoch = epoch + 1 WHERE conversation_id = ? RETURNING epoch";
    static const char claim_sql[] =
        "UPDATE submissions SET status = CASE status WHEN 'queued' THEN 'running' ELSE status "
        "END, attempt_id = ?1, epoch = ?2, owner_id = ?3, lease_expires_at = ?4, "
        "started_at = ?5, owner_started_at = ?8, attempt_count = attempt_count + 1, "
        "timeout_at = CASE timeout_at WHEN 0 THEN ?6 ELSE timeout_at END "
        "WHERE submission_id = ?7";
    int64_t lease = req->lease_duration ? pbdur_ms(req->lease_duration) : c->cfg->lease_ms;
    struct stmt s;
    bool got;
    char attempt[IDS_MAX];
    enum cf_status rc = stmt_open(&s, c->db, epoch_sql, "bump conversation epoch", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, row->conversation_id);
    if ((rc = stmt_step(&s, &got, err)) != CF_OK || !got) {
        stmt_close(&s);
        return rc != CF_OK ? rc
                           : cf_error_set(err, CF_INTERNAL, "conversation %s has no row",
                                          row->conversation_id);
    }
    int64_t epoch = sqlite3_column_int64(s.st, 0);
    if ((rc = stmt_done(&s, err)) != CF_OK) {
        return rc;
    }
    /* fencing: the conversation's epoch only grows, so every attempt's epoch is new */
    assert(epoch > row->epoch);
    ids_new(attempt, "att");
    if ((rc = stmt_open(&s, c->db, claim_sql, "claim submission", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, attempt);
    stmt_int(&s, 2, epoch);
    stmt_text(&s, 3, req->owner_id);
    stmt_int(&s, 4, c->now + lease);
    stmt_int(&s, 5, c->now);
    stmt_int(&s, 6, c->now + c->cfg->timeout_ms);
    stmt_text(&s, 7, row->submission_id);
    stmt_int(&s, 8, pbtime_ms(req->owner_started_at));
    return stmt_done(&s, err);
}

enum cf_status ledger_claim(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req,
                            Cflue__V1__ClaimResponse *out, struct cf_error *err)
{
    char id[IDS_MAX * 4];
    enum cf_status rc;
    bool takeover = false;

    if (*req->submission_id) {
        rc = pick_target(c, req, id, sizeof(id), &takeover, err);
    } else if ((rc = pick_takeover(c, req, id, sizeof(id), err)) == CF_OK) {
        takeover = id[0] != '\0';
        if (!takeover) {
            rc = pick_head(c, req, id, sizeof(id), err);
        }
    }
    if (rc != CF_OK || !id[0]) {
        return rc; /* an error, or nothing claimable */
    }
    out->takeover = takeover;
    Cflue__V1__Submission *row = new_sub(c);
    if ((rc = load_sub(c, id, row, err)) != CF_OK) {
        return rc;
    }
    /* runnable holds queued heads only; a takeover holds a running or terminalizing row */
    assert(takeover != (row->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED));
    if ((rc = start_attempt(c, req, row, err)) != CF_OK ||
        (rc = load_sub(c, id, row, err)) != CF_OK) {
        return rc;
    }
    out->submission = row;
    out->fence = arena_alloc(c->arena, sizeof(*out->fence));
    cflue__v1__fence__init(out->fence);
    out->fence->submission_id = row->submission_id;
    out->fence->attempt_id = row->attempt_id;
    out->fence->epoch = row->epoch;
    /* the claimer's hints: is there anything to read, is ClaimJoinable worth a call */
    int64_t next_pos;
    if ((rc = conversation_head(c, row->conversation_id, &next_pos, err)) != CF_OK) {
        return rc;
    }
    out->head_offset = next_pos - 1;
    return count_queued(c, row->conversation_id, row->sequence, &out->queued_behind, err);
}

/* set_leases sets the lease end of each of fences this owner still holds (running or
 * terminalizing, same attempt and epoch) to until (with shorten, only where that is earlier: a
 * lease handed back never lasts longer than it would have); their ids go to held, the others
 * to lost (arrays of n_fences, in c's arena). */
static enum cf_status set_leases(struct ledger_ctx *c, const char *owner_id,
                                 Cflue__V1__Fence *const *fences, size_t n_fences, int64_t until,
                                 bool shorten, char ***held, size_t *n_held, char ***lost,
                                 size_t *n_lost, struct cf_error *err)
{
    static const char sql[] =
        "UPDATE submissions SET lease_expires_at = CASE WHEN ?6 AND lease_expires_at < ?1 "
        "THEN lease_expires_at ELSE ?1 END WHERE submission_id = ?2 AND attempt_id = ?3 "
        "AND epoch = ?4 AND owner_id = ?5 AND status IN ('running','terminalizing')";
    struct stmt s;
    enum cf_status rc = CF_OK;
    *held = arena_alloc(c->arena, sizeof(char *) * (n_fences + 1));
    *lost = arena_alloc(c->arena, sizeof(char *) * (n_fences + 1));
    for (size_t i = 0; i < n_fences && rc == CF_OK; i++) {
        const Cflue__V1__Fence *f = fences[i];
        if ((rc = stmt_open(&s, c->db, sql, "set a lease", err)) != CF_OK) {
            break;
        }
        stmt_int(&s, 1, until);
        stmt_text(&s, 2, f->submission_id);
        stmt_text(&s, 3, f->attempt_id);
        stmt_int(&s, 4, f->epoch);
        stmt_text(&s, 5, owner_id);
        stmt_int(&s, 6, shorten);
        if ((rc = stmt_done(&s, err)) != CF_OK) {
            break;
        }
        if (sqlite3_changes(c->db) == 1) {
            (*held)[(*n_held)++] = f->submission_id;
        } else {
            (*lost)[(*n_lost)++] = f->submission_id;
        }
    }
    return rc;
}

enum cf_status ledger_heartbeat(struct ledger_ctx *c, const Cflue__V1__HeartbeatRequest *req,
                                Cflue__V1__HeartbeatResponse *out, struct cf_error *err)
{
    int64_t lease = req->lease_duration ? pbdur_ms(req->lease_duration) : c->cfg->lease_ms;
    out->lease_expire_time = pbtime_in(c->arena, c->now + lease);
    return set_leases(c, req->owner_id, req->fences, req->n_fences, c->now + lease, false,
                      &out->renewed, &out->n_renewed, &out->lost, &out->n_lost, err);
}

enum cf_status ledger_release(struct ledger_ctx *c, const Cflue__V1__ReleaseRequest *req,
                              Cflue__V1__ReleaseResponse *out, struct cf_error *err)
{
    /* unset: ran out a millisecond ago, so the next Claim takes it over (lease_expires_at <
     * now) */
    int64_t after = req->expire_after ? pbdur_ms(req->expire_after) : 0;
    int64_t until = after > 0 ? c->now + after : c->now - 1;
    return set_leases(c, req->owner_id, req->fences, req->n_fences, until, true, &out->released,
                      &out->n_released, &out->lost, &out->n_lost, err);
}

enum cf_status ledger_shift_times(struct ledger_ctx *c, int64_t step_ms, int *moved,
                                  struct cf_error *err)
{
    static const char sql[] =
        "UPDATE submissions SET "
        "lease_expires_at = CASE WHEN lease_expires_at > 1 THEN MAX(1, lease_expires_at + ?1) "
        "ELSE lease_expires_at END, "
        "timeout_at = CASE WHEN timeout_at > 0 THEN MAX(1, timeout_at + ?1) ELSE timeout_at END, "
        "started_at = CASE WHEN started_at > 0 THEN MAX(1, started_at + ?1) ELSE started_at END "
        "WHERE status IN " UNSETTLED " AND (lease_expires_at > 0 OR timeout_at > 0 OR "
        "started_at > 0)";
    struct stmt s;
    enum cf_status rc = stmt_open(&s, c->db, sql, "move times by a clock step", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, step_ms);
    if ((rc = stmt_done(&s, err)) == CF_OK) {
        *moved = sqlite3_changes(c->db);
    }
    return rc;
}

enum cf_status ledger_extend_leases(struct ledger_ctx *c, int64_t since_ms, int64_t outage_ms,
                                    int *moved, struct cf_error *err)
{
    static const char sql[] = "UPDATE submissions SET lease_expires_at = "
                              "lease_expires_at + ?1 WHERE status IN ('running','terminalizing') "
                              "AND lease_expires_at >= ?2";
    struct stmt s;
    enum cf_status rc = stmt_open(&s, c->db, sql, "extend leases over an outage", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, outage_ms);
    stmt_int(&s, 2, since_ms);
    if ((rc = stmt_done(&s, err)) == CF_OK) {
        *moved = sqlite3_changes(c->db);
    }
    return rc;
}

/* stamp_input does MarkInputApplied's work on row, read through its fence in this transaction:
 * stamps the input applied and installs req's budgets (first stamp only; req's own fence is
 * not read). The row must be running; on success it is read again after the stamp. */
static enum cf_status stamp_input(struct ledger_ctx *c,
                                  const Cflue__V1__MarkInputAppliedRequest *req,
                                  Cflue__V1__Submission *row, struct cf_error *err)
{
    static const char sql[] =
        "UPDATE submissions SET input_applied_at = COALESCE(input_applied_at, ?1), "
        "max_attempts = CASE WHEN input_applied_at IS NULL AND ?2 > 0 THEN ?2 ELSE max_attempts "
        "END, timeout_at = CASE WHEN input_applied_at IS NULL AND ?3 > 0 THEN started_at + ?3 "
        "ELSE timeout_at END WHERE submission_id = ?4";
    struct stmt s;
    enum cf_status rc;
    if (row->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING) {
        return cf_error_set(err, CF_PRECONDITION,
                            "submission %s is %s; marking its input applied needs it running",
                            row->submission_id, ledger_status_name(row->status));
    }
    if ((rc = stmt_open(&s, c->db, sql, "mark input applied", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, c->now);
    stmt_int(&s, 2, req->max_attempts);
    stmt_int(&s, 3, pbdur_ms(req->timeout));
    stmt_text(&s, 4, row->submission_id);
    if ((rc = stmt_done(&s, err)) != CF_OK) {
        return rc;
    }
    if ((rc = load_sub(c, row->submission_id, row, err)) != CF_OK) {
        return rc;
    }
    assert(row->input_apply_time != NULL); /* stamped now or by an earlier call, never moved */
    return CF_OK;
}

enum cf_status ledger_mark_input_applied(struct ledger_ctx *c,
                                         const Cflue__V1__MarkInputAppliedRequest *req,
                                         Cflue__V1__Submission *out, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fenced(c, req->fence, ST_BIT(RUNNING), "running", out, err)) != CF_OK) {
        return rc;
    }
    return stamp_input(c, req, out, err);
}

/* update_sub runs one of the row updates below, its parameters: now (?1), the submission (?2)
 * and an optional text (?3). */
static enum cf_status update_sub(struct ledger_ctx *c, const char *sql, const char *what,
                                 const char *sub, const char *text, struct cf_error *err)
{
    struct stmt s;
    enum cf_status rc = stmt_open(&s, c->db, sql, what, err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, c->now); /* ?1 is a parameter of each, used or not (?2 is) */
    stmt_text(&s, 2, sub);
    if (sqlite3_bind_parameter_count(s.st) >= 3) {
        stmt_text(&s, 3, text);
    }
    return stmt_done(&s, err);
}

static const char requeue_sql[] =
    "UPDATE submissions SET status = 'queued', attempt_id = NULL, owner_id = NULL, "
    "lease_expires_at = 0, started_at = NULL, input_applied_at = NULL "
    "WHERE submission_id = ?2";
static const char join_sql[] =
    "UPDATE submissions SET status = 'joining', joined_into = ?3 WHERE submission_id = ?2";
static const char finalize_join_sql[] =
    "UPDATE submissions SET status = 'joined', input_applied_at = COALESCE(input_applied_at, "
    "?1), answered_by = ?3 WHERE submission_id = ?2";
static const char revert_join_sql[] =
    "UPDATE submissions SET status = 'queued', joined_into = NULL, input_applied_at = NULL "
    "WHERE submission_id = ?2";

enum cf_status ledger_requeue(struct ledger_ctx *c, const Cflue__V1__Fence *fence,
                              Cflue__V1__Submission *out, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fenced(c, fence, ST_BIT(RUNNING), "running", out, err)) != CF_OK ||
        (rc = update_sub(c, requeue_sql, "requeue", fence->submission_id, NULL, err)) != CF_OK) {
        return rc;
    }
    return load_sub(c, fence->submission_id, out, err);
}

/* ---------- joins ---------- */

/* is_compact tells a Compact submission (the `kind` column). It is its own ordered work: never
 * joined into a running submission, and nothing joins it. */
static bool is_compact(const Cflue__V1__Submission *s)
{
    return s->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
}

enum cf_status ledger_claim_joinable(struct ledger_ctx *c,
                                     const Cflue__V1__ClaimJoinableRequest *req,
                                     Cflue__V1__ClaimJoinableResponse *out, struct cf_error *err)
{
    static const char sql[] = "SELECT " SUB_COLS " FROM submissions WHERE conversation_id = ? AND "
                              "status = 'queued' AND sequence > ? ORDER BY sequence LIMIT ?";
    Cflue__V1__Submission host, **rows;
    size_t n;
    struct stmt s;
    enum cf_status rc;
    if ((rc = fenced(c, req->host, ST_BIT(RUNNING), "running", &host, err)) != CF_OK ||
        (rc = stmt_open(&s, c->db, sql, "list joinable submissions", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, host.conversation_id);
    stmt_int(&s, 2, host.sequence);
    stmt_int(&s, 3, req->limit > 0 ? req->limit : -1); /* no more rows than may join */
    bool cut; /* the rest stays queued: it joins at a later turn, or runs after the host */
    if ((rc = list_subs(c, &s, &rows, &n, &cut, err)) != CF_OK) {
        return rc;
    }
    out->submissions = rows;
    if (is_compact(&host)) {
        return CF_OK; /* a compaction delivers no input: nothing joins it */
    }
    for (size_t i = 0; i < n; i++) {
        /* The run stops at the first row that cannot join (never skips it: FIFO holds). */
        if (rows[i]->abort_request_time || is_compact(rows[i]) ||
            (req->limit > 0 && i >= (size_t)req->limit)) {
            break;
        }
        if ((rc = update_sub(c, join_sql, "claim joinable", rows[i]->submission_id,
                             host.submission_id, err)) != CF_OK ||
            (rc = load_sub(c, rows[i]->submission_id, rows[i], err)) != CF_OK) {
            return rc;
        }
        out->n_submissions++;
    }
    return CF_OK;
}

enum cf_status ledger_finish_join(struct ledger_ctx *c, const Cflue__V1__JoinRequest *req,
                                  bool finalize, Cflue__V1__Submission *out, struct cf_error *err)
{
    Cflue__V1__Submission host;
    enum cf_status rc;
    if ((rc = fenced(c, req->host, ST_BIT(RUNNING), "running", &host, err)) != CF_OK ||
        (rc = load_sub(c, req->submission_id, out, err)) != CF_OK) {
        return rc;
    }
    if (out->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING ||
        strcmp(out->joined_into, host.submission_id) != 0) {
        return cf_error_set(err, CF_PRECONDITION, "submission %s is %s%s%s, not joining into %s",
                            out->submission_id, ledger_status_name(out->status),
                            *out->joined_into ? " into " : "", out->joined_into,
                            host.submission_id);
    }
    if ((rc = update_sub(c, finalize ? finalize_join_sql : revert_join_sql,
                         finalize ? "finalize join" : "revert join", req->submission_id,
                         host.submission_id, err)) != CF_OK) {
        return rc;
    }
    return load_sub(c, req->submission_id, out, err);
}

/* ---------- abort ---------- */

/* What an abort intent is stamped on: unsettled rows whose outcome is not reserved yet. */
#define ABORTABLE " AND status IN ('queued','running','joining','joined')"

/* stamp_descendants stamps an abort intent (first stamp wins: an earlier intent keeps its time
 * and reason) on the unsettled descendants of root, subagents of subagents included, found level by
 * level through submissions_by_parent. A tree is at most VALIDATE_DEPTH_MAX levels deep (see the
 * essay), which bounds the walk. As for RequestAbort's own targets, a terminalizing descendant (its
 * outcome reserved) is not stamped; the walk goes on through it, and through settled ones, to their
 * children. The stamped ids, and those stamped before, are added to *affected when it is given. */
static enum cf_status stamp_descendants(struct ledger_ctx *c, const char *root, const char *reason,
                                        struct strv *affected, struct cf_error *err)
{
    static const char children_sql[] = "SELECT submission_id, status FROM submissions "
                                       "WHERE parent_submission_id = ?1 ORDER BY sequence";
    static const char stamp_sql[] =
        "UPDATE submissions SET abort_requested_at = COALESCE(abort_requested_at, ?1), "
        "abort_reason = COALESCE(abort_reason, ?3) WHERE submission_id = ?2" ABORTABLE;
    struct strv level = {0};
    enum cf_status rc;
    strv_push(c, &level, root);
    for (int depth = 0; depth < VALIDATE_DEPTH_MAX && level.n > 0; depth++) {
        struct strv next = {0}, stamp = {0};
        for (size_t i = 0; i < level.n; i++) {
            struct stmt s;
            bool row;
            if ((rc = stmt_open(&s, c->db, children_sql, "list delegated children", err)) !=
                CF_OK) {
                return rc;
            }
            stmt_text(&s, 1, level.v[i]);
            while ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
                const char *id = col_text(c, s.st, 0);
                int st = status_from((const char *)sqlite3_column_text(s.st, 1));
                strv_push(c, &next, id);
                if (st != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING &&
                    st != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
                    strv_push(c, &stamp, id);
                }
            }
            stmt_close(&s);
            if (rc != CF_OK) {
                return rc;
            }
        }
        for (size_t i = 0; i < stamp.n; i++) {
            if ((rc = update_sub(c, stamp_sql, "stamp abort on a delegated child", stamp.v[i],
                                 reason, err)) != CF_OK) {
                return rc;
            }
            assert(sqlite3_changes(c->db) == 1); /* read abortable in this transaction */
            if (affected) {
                strv_push(c, affected, stamp.v[i]);
            }
        }
        level = next;
    }
    return CF_OK;
}

enum cf_status ledger_request_abort(struct ledger_ctx *c, const Cflue__V1__RequestAbortRequest *req,
                                    Cflue__V1__RequestAbortResponse *out, struct cf_error *err)
{
    static const char list_conv_sql[] = "SELECT submission_id FROM submissions "
                                        "WHERE conversation_id = ?1" ABORTABLE " ORDER BY sequence";
    static const char list_sub_sql[] = "SELECT submission_id FROM submissions "
                                       "WHERE submission_id = ?1" ABORTABLE " ORDER BY sequence";
#define STAMP                                                                                      \
    "UPDATE submissions SET abort_requested_at = COALESCE(abort_requested_at, ?2), "               \
    "abort_reason = COALESCE(abort_reason, ?3) WHERE "
    static const char stamp_conv_sql[] = STAMP "conversation_id = ?1" ABORTABLE;
    static const char stamp_sub_sql[] = STAMP "submission_id = ?1" ABORTABLE;
#undef STAMP
#undef ABORTABLE
    struct stmt s;
    enum cf_status rc;
    Cflue__V1__Submission one;
    int64_t head;
    struct strv affected = {0};
    bool by_conv = req->target_case == CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_CONVERSATION_ID;
    const char *key = by_conv ? req->conversation_id : req->submission_id;

    rc = by_conv ? conversation_head(c, key, &head, err) : load_sub(c, key, &one, err);
    if (rc != CF_OK || (rc = stmt_open(&s, c->db, by_conv ? list_conv_sql : list_sub_sql,
                                       "list submissions to abort", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, key);
    if ((rc = column_strings(c, &s, &affected, err)) != CF_OK) {
        return rc;
    }
    if ((rc = stmt_open(&s, c->db, by_conv ? stamp_conv_sql : stamp_sub_sql, "stamp abort", err)) !=
        CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, key);
    stmt_int(&s, 2, c->now);
    stmt_opt_text(&s, 3, req->reason);
    if ((rc = stmt_done(&s, err)) != CF_OK) {
        return rc;
    }
    /* the subagents of each target, in their own conversations, are stopped with it; one walk
     * per target names it in their reason */
    size_t n_targets = affected.n;
    for (size_t i = 0; i < n_targets; i++) {
        const char *target = affected.v[i]; /* affected grows (and moves) in the walk */
        const char *why = strfmt(c, "delegating submission %s was aborted%s%s", target,
                                 *req->reason ? ": " : "", req->reason);
        if ((rc = stamp_descendants(c, target, why, &affected, err)) != CF_OK) {
            return rc;
        }
    }
    out->affected = affected.v;
    out->n_affected = affected.n;
    return CF_OK;
}

/* ---------- settlement ---------- */

enum cf_status ledger_settlement_offset(struct ledger_ctx *c, const char *sub, const char *conv,
                                        int64_t *out, struct cf_error *err)
{
    static const char sql[] = "SELECT pos FROM records WHERE conversation_id = ? AND record_id = ?";
    struct stmt s;
    bool row;
    char rid[IDS_MAX * 4];
    enum cf_status rc = stmt_open(&s, c->db, sql, "find settlement record", err);
    *out = -1;
    if (rc != CF_OK) {
        return rc;
    }
    snprintf(rid, sizeof(rid), "settled:%s", sub);
    stmt_text(&s, 1, conv);
    stmt_text(&s, 2, rid);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        *out = sqlite3_column_int64(s.st, 0);
    }
    stmt_close(&s);
    return rc;
}

/* finish settles one row and appends its settlement record. */
static enum cf_status finish_one(struct ledger_ctx *c, const char *sub, const char *conv,
                                 int outcome, const char *error, const char *answered_by,
                                 const char *attempt, int64_t *offset_out, struct cf_error *err)
{
    static const char sql[] =
        "UPDATE submissions SET status = 'settled', outcome = ?, error = ?, settled_at = ?, "
        "lease_expires_at = 0, answered_by = ?, reserved_outcome = NULL, reserved_error = NULL "
        "WHERE submission_id = ? AND status != 'settled'";
    struct stmt s;
    enum cf_status rc;
    assert(outcome >= 1 && outcome <= 3); /* validate_settle and reserved() make sure */
    if ((rc = stmt_open(&s, c->db, sql, "settle", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, outcome_names[outcome]);
    stmt_opt_text(&s, 2, error);
    stmt_int(&s, 3, c->now);
    stmt_text(&s, 4, answered_by);
    stmt_text(&s, 5, sub);
    if ((rc = stmt_done(&s, err)) != CF_OK) {
        return rc;
    }
    /* exactly one outcome: the row was read unsettled in this transaction */
    assert(sqlite3_changes(c->db) == 1);
    Cflue__V1__SubmissionSettled body = CFLUE__V1__SUBMISSION_SETTLED__INIT;
    body.outcome = (Cflue__V1__Outcome)outcome;
    body.error = (char *)(error ? error : "");
    body.answered_by = (char *)answered_by;
    char rid[IDS_MAX * 4];
    snprintf(rid, sizeof(rid), "settled:%s", sub);
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__Record *recs[1] = {&rec};
    rec.id = rid;
    rec.submission_id = (char *)sub;
    rec.body_case = CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED;
    rec.submission_settled = &body;
    return insert_records(c, conv, recs, 1, sub, attempt, offset_out, err);
}

/* record_usage stores what the attempt reports it spent. */
static enum cf_status record_usage(struct ledger_ctx *c, const char *sub,
                                   const Cflue__V1__Usage *usage, struct cf_error *err)
{
    static const char sql[] = "UPDATE submissions SET input_tokens = ?, output_tokens = ?, "
                              "cost_usd = ? WHERE submission_id = ?";
    struct stmt s;
    enum cf_status rc;
    if (!usage || (!usage->input_tokens && !usage->output_tokens && !(usage->cost_usd > 0))) {
        return CF_OK;
    }
    if ((rc = stmt_open(&s, c->db, sql, "record usage", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, usage->input_tokens);
    stmt_int(&s, 2, usage->output_tokens);
    stmt_double(&s, 3, usage->cost_usd);
    stmt_text(&s, 4, sub);
    return stmt_done(&s, err);
}

/* stop_children stamps abort intents on the delegated descendants of sub (stamp_descendants)
 * when its outcome, reserved or final, is failed or aborted: a parent that will not complete has
 * no use for its subagents' answers. Settle runs it where the outcome is decided: at the
 * reservation (reserve_only), so the subagents stop while the parent finishes, and again at the
 * finishing settlement, which covers an outcome settled without a reservation (the second walk
 * of a reserved one changes nothing: the first stamp wins). */
static enum cf_status stop_children(struct ledger_ctx *c, const char *sub, int outcome,
                                    const char *error, struct cf_error *err)
{
    if (outcome != CFLUE__V1__OUTCOME__OUTCOME_FAILED &&
        outcome != CFLUE__V1__OUTCOME__OUTCOME_ABORTED) {
        return CF_OK;
    }
    const char *why = strfmt(c, "delegating submission %s settled %s%s%s", sub,
                             outcome_names[outcome], error ? ": " : "", error ? error : "");
    return stamp_descendants(c, sub, why, NULL, err);
}

static enum cf_status finish_with_fanout(struct ledger_ctx *c, Cflue__V1__Submission *row,
                                         int outcome, const char *error,
                                         const Cflue__V1__Usage *usage,
                                         Cflue__V1__SettleResponse *out, struct cf_error *err)
{
    static const char joined_sql[] = "SELECT submission_id FROM submissions WHERE joined_into = ? "
                                     "AND status = 'joined' ORDER BY sequence";
    static const char release_sql[] =
        "UPDATE submissions SET status = 'queued', joined_into = NULL, input_applied_at = NULL "
        "WHERE joined_into = ?2 AND status = 'joining'";
    struct stmt s;
    struct strv with = {0};
    enum cf_status rc;
    const char *attempt = *row->attempt_id ? row->attempt_id : NULL;
    if ((rc = finish_one(c, row->submission_id, row->conversation_id, outcome, error,
                         row->submission_id, attempt, &out->record_offset, err)) != CF_OK ||
        (rc = record_usage(c, row->submission_id, usage, err)) != CF_OK ||
        (rc = stmt_open(&s, c->db, joined_sql, "list joined submissions", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, row->submission_id);
    if ((rc = column_strings(c, &s, &with, err)) != CF_OK) {
        return rc;
    }
    out->settled_with = with.v;
    out->n_settled_with = with.n;
    for (size_t i = 0; i < with.n; i++) {
        int64_t off;
        if ((rc = finish_one(c, with.v[i], row->conversation_id, outcome, error, row->submission_id,
                             attempt, &off, err)) != CF_OK ||
            (rc = stop_children(c, with.v[i], outcome, error, err)) != CF_OK) {
            return rc;
        }
    }
    if ((rc = stop_children(c, row->submission_id, outcome, error, err)) != CF_OK) {
        return rc;
    }
    if ((rc = update_sub(c, release_sql, "release joining deliveries", row->submission_id, NULL,
                         err)) != CF_OK) {
        return rc;
    }
    return load_sub(c, row->submission_id, out->submission, err);
}

static enum cf_status reserved(struct ledger_ctx *c, const char *sub, int *outcome,
                               const char **error, struct cf_error *err)
{
    static const char sql[] =
        "SELECT reserved_outcome, reserved_error FROM submissions WHERE submission_id = ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "read reserved outcome", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, sub);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        *outcome = outcome_from((const char *)sqlite3_column_text(s.st, 0));
        *error = sqlite3_column_type(s.st, 1) == SQLITE_NULL ? NULL : col_text(c, s.st, 1);
        assert(*outcome != 0); /* a terminalizing row has its reserved outcome */
    } else if (rc == CF_OK) {
        rc = cf_error_set(err, CF_NOT_FOUND, "no submission with id '%s'", sub);
    }
    stmt_close(&s);
    return rc;
}

static enum cf_status check_sizes(struct ledger_ctx *c, Cflue__V1__Record *const *recs, size_t n,
                                  struct cf_error *err);
static enum cf_status append_batch(struct ledger_ctx *c, const Cflue__V1__Submission *row,
                                   Cflue__V1__Record *const *in, size_t n, int64_t *first_out,
                                   int64_t *last_out, bool *dedup_out, struct cf_error *err);

/* settle_records appends a Settle's records on behalf of row (fenced, running or terminalizing)
 * before its settlement, through Append's own path, then stamps its input applied when the
 * Settle asks (row is read again then). */
static enum cf_status settle_records(struct ledger_ctx *c, const Cflue__V1__SettleRequest *req,
                                     Cflue__V1__Submission *row, Cflue__V1__SettleResponse *out,
                                     struct cf_error *err)
{
    int64_t last;
    bool dedup;
    enum cf_status rc;
    if (req->n_records &&
        (rc = append_batch(c, row, req->records, req->n_records, &out->records_first_offset, &last,
                           &dedup, err)) != CF_OK) {
        return rc;
    }
    return req->mark_input_applied ? stamp_input(c, req->mark_input_applied, row, err) : CF_OK;
}

/* settle_row is Settle's decision on the row it names (see ledger_settle). */
static enum cf_status settle_row(struct ledger_ctx *c, const Cflue__V1__SettleRequest *req,
                                 Cflue__V1__SettleResponse *out, struct cf_error *err)
{
    static const char reserve_sql[] = "UPDATE submissions SET status = 'terminalizing', "
                                      "reserved_outcome = ?, reserved_error = ? "
                                      "WHERE submission_id = ?";
    const Cflue__V1__Fence *f = req->fence;
    Cflue__V1__Submission *row = new_sub(c);
    struct stmt s;
    enum cf_status rc;
    const char *error = *req->error ? req->error : NULL;
    int outcome = req->outcome;

    out->submission = row;
    if ((rc = load_sub(c, f->submission_id, row, err)) != CF_OK) {
        return rc;
    }
    if (row->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
        assert(row->outcome != 0); /* exactly one outcome, set with the status */
        /* the same Settle again: the same attempt's, or (a queued submission's) none */
        bool same_fence = *f->attempt_id
                              ? !strcmp(f->attempt_id, row->attempt_id) && f->epoch == row->epoch
                              : !*row->attempt_id;
        bool same =
            same_fence && (int)row->outcome == outcome && !strcmp(row->error, error ? error : "");
        if (!same && *f->attempt_id &&
            (strcmp(f->attempt_id, row->attempt_id) != 0 || f->epoch != row->epoch)) {
            return cf_error_set(err, CF_STALE,
                                "stale fence: attempt %s (epoch %lld) does not hold submission %s, "
                                "which is settled",
                                f->attempt_id, (long long)f->epoch, row->submission_id);
        }
        if (!same) {
            return cf_error_setr(err, CF_PRECONDITION, "ALREADY_SETTLED",
                                 "submission %s is already settled as %s%s%s", row->submission_id,
                                 outcome_names[row->outcome], *row->error ? ": " : "", row->error);
        }
        out->already_settled = true;
        return ledger_settlement_offset(c, row->submission_id, row->conversation_id,
                                        &out->record_offset, err);
    }
    if (!*f->attempt_id) {
        assert(req->n_records == 0); /* validate_settle: records need an attempt fence */
        if (row->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED) {
            return cf_error_set(err, CF_PRECONDITION,
                                "submission %s is %s; without an attempt only a queued "
                                "submission can be settled",
                                row->submission_id, ledger_status_name(row->status));
        }
        if (req->reserve_only) {
            return cf_error_set(err, CF_INVALID, "reserve_only needs a fence with an attempt");
        }
        return finish_with_fanout(c, row, outcome, error, req->usage, out, err);
    }
    if ((rc = fenced(c, f, ST_BIT(RUNNING) | ST_BIT(TERMINALIZING), "running or terminalizing", row,
                     err)) != CF_OK ||
        (rc = settle_records(c, req, row, out, err)) != CF_OK) {
        return rc;
    }
    if (row->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING) {
        int r_outcome = 0;
        const char *r_error = NULL;
        if ((rc = reserved(c, row->submission_id, &r_outcome, &r_error, err)) != CF_OK) {
            return rc;
        }
        if (req->reserve_only) {
            if (r_outcome != outcome) {
                return cf_error_set(err, CF_PRECONDITION,
                                    "submission %s already reserved outcome %s", row->submission_id,
                                    outcome_names[r_outcome]);
            }
            return CF_OK;
        }
        return finish_with_fanout(c, row, r_outcome, r_error, req->usage, out, err);
    }
    if (!req->reserve_only) {
        return finish_with_fanout(c, row, outcome, error, req->usage, out, err);
    }
    if ((rc = stmt_open(&s, c->db, reserve_sql, "reserve settlement", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, outcome_names[outcome]);
    stmt_opt_text(&s, 2, error);
    stmt_text(&s, 3, row->submission_id);
    if ((rc = stmt_done(&s, err)) != CF_OK ||
        (rc = stop_children(c, row->submission_id, outcome, error, err)) != CF_OK) {
        return rc;
    }
    return load_sub(c, row->submission_id, row, err);
}

enum cf_status ledger_settle(struct ledger_ctx *c, const Cflue__V1__SettleRequest *req,
                             Cflue__V1__SettleResponse *out, struct cf_error *err)
{
    enum cf_status rc;
    out->record_offset = -1;
    out->records_first_offset = -1;
    if ((rc = check_sizes(c, req->records, req->n_records, err)) != CF_OK ||
        (rc = settle_row(c, req, out, err)) != CF_OK) {
        return rc;
    }
    /* records are appended only before a settlement or reservation made or confirmed now */
    assert(!out->already_settled || out->records_first_offset == -1);
    return count_queued(c, out->submission->conversation_id, 0, &out->conversation_queued, err);
}

/* ---------- append ---------- */

/* stored_before looks the record's id up in the conversation: *pos_out is where an identical
 * record is stored (-1 when the id is new); the same id with other content is RECORD_CONFLICT. */
static enum cf_status stored_before(struct ledger_ctx *c, const char *conv,
                                    const Cflue__V1__Record *r, int64_t *pos_out,
                                    struct cf_error *err)
{
    static const char sql[] = "SELECT pos, kind, submission_id, body FROM records "
                              "WHERE conversation_id = ? AND record_id = ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "look up record id", err);
    *pos_out = -1;
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, conv);
    stmt_text(&s, 2, r->id);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        int64_t pos = sqlite3_column_int64(s.st, 0);
        const char *sub = (const char *)sqlite3_column_text(s.st, 2);
        size_t len;
        const uint8_t *body = pack_body(c, r, &len);
        bool same = sqlite3_column_int(s.st, 1) == (int)r->body_case &&
                    !strcmp(sub ? sub : "", r->submission_id) &&
                    (size_t)sqlite3_column_bytes(s.st, 3) == len &&
                    (len == 0 || !memcmp(sqlite3_column_blob(s.st, 3), body, len));
        if (same) {
            *pos_out = pos;
        } else {
            rc = cf_error_setr(err, CF_EXISTS, "RECORD_CONFLICT",
                               "record id '%s' is already stored at offset %lld with different "
                               "content",
                               r->id, (long long)pos);
        }
    }
    stmt_close(&s);
    return rc;
}

/* check_sizes refuses a record whose encoded size is over ledger_record_bytes_max. */
static enum cf_status check_sizes(struct ledger_ctx *c, Cflue__V1__Record *const *recs, size_t n,
                                  struct cf_error *err)
{
    for (size_t i = 0; i < n; i++) {
        size_t size = protobuf_c_message_get_packed_size(&recs[i]->base);
        if ((int64_t)size > ledger_record_bytes_max(c->cfg)) {
            return cf_error_set(err, CF_INVALID,
                                "records[%zu] is %zu bytes encoded; the limit per record is %lld "
                                "(so that every record fits one Read page)",
                                i, size, (long long)ledger_record_bytes_max(c->cfg));
        }
    }
    return CF_OK;
}

/* append_batch appends a validated batch (sizes checked) on behalf of row, the fenced
 * submission read in this transaction: the records name row or a submission joining or joined
 * into it; ids default to new ones. A batch stored before (every id, identical content) is
 * answered with its offsets and *dedup_out; part of it stored is RECORD_CONFLICT. Used by
 * Append and by Settle's records. */
static enum cf_status append_batch(struct ledger_ctx *c, const Cflue__V1__Submission *row,
                                   Cflue__V1__Record *const *in, size_t n, int64_t *first_out,
                                   int64_t *last_out, bool *dedup_out, struct cf_error *err)
{
    Cflue__V1__Submission other;
    enum cf_status rc;
    size_t dups = 0;
    int64_t first = INT64_MAX, last = -1;
    Cflue__V1__Record **recs = arena_alloc(c->arena, sizeof(void *) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        Cflue__V1__Record *r = arena_alloc(c->arena, sizeof(*r));
        *r = *in[i];
        recs[i] = r;
        if (!*r->submission_id) {
            r->submission_id = row->submission_id;
        } else if (strcmp(r->submission_id, row->submission_id) != 0) {
            if ((rc = load_sub(c, r->submission_id, &other, err)) != CF_OK) {
                return rc == CF_NOT_FOUND
                           ? cf_error_set(err, CF_PRECONDITION,
                                          "record %zu names submission '%s', which does not exist",
                                          i, r->submission_id)
                           : rc;
            }
            if (strcmp(other.joined_into, row->submission_id) != 0 ||
                (other.status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING &&
                 other.status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINED)) {
                return cf_error_set(err, CF_PRECONDITION,
                                    "record %zu names submission %s, which is not joined into %s",
                                    i, r->submission_id, row->submission_id);
            }
        }
        assert(record_body(r) != NULL); /* validation refused bodiless records */
        if (!*r->id) {
            char id[IDS_MAX];
            ids_new(id, "rec");
            r->id = arena_strdup(c->arena, id);
            continue;
        }
        int64_t pos = -1;
        if ((rc = stored_before(c, row->conversation_id, r, &pos, err)) != CF_OK) {
            return rc;
        }
        if (pos >= 0) {
            dups++;
            first = pos < first ? pos : first;
            last = pos > last ? pos : last;
        }
    }
    *dedup_out = dups == n;
    if (dups == n) {
        *first_out = first;
        *last_out = last;
        return CF_OK;
    }
    if (dups) {
        return cf_error_setr(err, CF_EXISTS, "RECORD_CONFLICT",
                             "%zu of the batch's %zu records are already stored; resend the "
                             "original batch unchanged or use new record ids",
                             dups, n);
    }
    if ((rc = insert_records(c, row->conversation_id, recs, n, row->submission_id, row->attempt_id,
                             first_out, err)) != CF_OK) {
        return rc;
    }
    *last_out = *first_out + (int64_t)n - 1;
    return CF_OK;
}

enum cf_status ledger_append(struct ledger_ctx *c, const Cflue__V1__AppendRequest *req,
                             Cflue__V1__AppendResponse *out, struct cf_error *err)
{
    Cflue__V1__Submission *row = new_sub(c);
    enum cf_status rc;
    bool dedup = false;
    if ((rc = check_sizes(c, req->records, req->n_records, err)) != CF_OK ||
        (rc = fenced(c, req->fence, ST_BIT(RUNNING) | ST_BIT(TERMINALIZING),
                     "running or terminalizing", row, err)) != CF_OK ||
        (rc = append_batch(c, row, req->records, req->n_records, &out->first_offset,
                           &out->last_offset, &dedup, err)) != CF_OK) {
        return rc;
    }
    out->deduplicated = dedup;
    /* after the records, also for a resent batch: MarkInputApplied's stamp is idempotent */
    if (req->mark_input_applied) {
        if ((rc = stamp_input(c, req->mark_input_applied, row, err)) != CF_OK) {
            return rc;
        }
        out->submission = row;
    }
    /* the fenced row was read in this transaction and appending never changes its intent */
    out->abort_requested = row->abort_request_time != NULL;
    return count_queued(c, row->conversation_id, 0, &out->queued, err);
}

/* ---------- reads ---------- */

enum cf_status ledger_get(struct ledger_ctx *c, const char *submission_id,
                          Cflue__V1__Submission *out, struct cf_error *err)
{
    return load_sub(c, submission_id, out, err);
}

static int cmp_status(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

/* list_scope is the page-token scope of a List: its filters in one canonical string (statuses
 * sorted and deduplicated), so a token only continues the listing it came from. */
static const char *list_scope(struct ledger_ctx *c, const Cflue__V1__ListRequest *req)
{
    int st[8], n = 0;
    char *out = arena_alloc(c->arena, 3 * VALIDATE_NAME_MAX + 64);
    for (size_t i = 0; i < req->n_statuses && n < 8; i++) {
        st[n++] = (int)req->statuses[i];
    }
    qsort(st, (size_t)n, sizeof(int), cmp_status);
    int len = snprintf(out, 3 * VALIDATE_NAME_MAX + 64, "list\n%s\n%s\n", req->conversation_id,
                       req->joined_into);
    for (int i = 0; i < n; i++) {
        if (i == 0 || st[i] != st[i - 1]) {
            len += snprintf(out + len, 8, "%d,", st[i]);
        }
    }
    /* the filters added later extend the scope only when set: earlier tokens stay valid */
    if (*req->owner_id || req->abort_requested) {
        snprintf(out + len, (size_t)(3 * VALIDATE_NAME_MAX + 64 - len), "\nowner=%s\nabort=%d",
                 req->owner_id, (int)req->abort_requested);
    }
    return out;
}

static int page_limit(int32_t page_size)
{
    return page_size > 0 ? (page_size > 1000 ? 1000 : page_size) : 100;
}

/* page_of trims rows fetched with LIMIT page + 1 to one page and makes the token of the next
 * page (the last sequence returned) when there was a row more, or list_subs cut the page at
 * its byte budget. */
static void page_of(struct ledger_ctx *c, const char *scope, int limit, bool cut,
                    Cflue__V1__ListResponse *out)
{
    out->next_page_token = "";
    if (out->n_submissions > (size_t)limit || (cut && out->n_submissions)) {
        if (out->n_submissions > (size_t)limit) {
            out->n_submissions = (size_t)limit;
        }
        out->next_page_token = arena_alloc(c->arena, PAGE_TOKEN_MAX);
        page_token_make_int(out->next_page_token, scope,
                            out->submissions[out->n_submissions - 1]->sequence);
    }
}

enum cf_status ledger_list(struct ledger_ctx *c, const Cflue__V1__ListRequest *req,
                           Cflue__V1__ListResponse *out, struct cf_error *err)
{
    char sql[1024], in[256] = "";
    struct stmt s;
    enum cf_status rc;
    int limit = page_limit(req->page_size);
    int64_t after = 0;
    const char *scope = list_scope(c, req);
    if (*req->page_token &&
        (rc = page_token_parse_int(req->page_token, scope, &after, err)) != CF_OK) {
        return rc;
    }
    for (size_t i = 0; i < req->n_statuses && i < 6; i++) {
        char part[32];
        snprintf(part, sizeof(part), "%s'%s'", i ? "," : "", ledger_status_name(req->statuses[i]));
        strncat(in, part, sizeof(in) - strlen(in) - 1);
    }
    /* owner and abort filters are written only when set, so that their partial indexes
     * (submissions_by_owner, submissions_abort_requested) can serve them; but an owner's held
     * work alone (agentd's take-back after a claim that got no answer) is found through the
     * status index: submissions_by_owner holds every row the owner ever claimed, and walking
     * it costs the owner's whole history, where the held rows of all owners are only the work
     * in flight */
    bool held_only = *req->owner_id && req->n_statuses > 0;
    for (size_t i = 0; i < req->n_statuses; i++) {
        held_only =
            held_only &&
            (req->statuses[i] == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING ||
             req->statuses[i] == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING);
    }
    snprintf(sql, sizeof(sql),
             "SELECT " SUB_COLS " FROM submissions%s WHERE sequence > ?1 "
             "AND (?2 = '' OR conversation_id = ?2) AND (?3 = '' OR joined_into = ?3) %s%s%s%s%s"
             "ORDER BY sequence LIMIT ?4",
             held_only ? " INDEXED BY submissions_by_status" : "", *in ? "AND status IN (" : "", in,
             *in ? ") " : "", *req->owner_id ? "AND owner_id = ?5 " : "",
             req->abort_requested ? "AND abort_requested_at IS NOT NULL " : "");
    /* built per status filter: compiled for this call only */
    if ((rc = stmt_open_once(&s, c->db, sql, "list submissions", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, after);
    stmt_text(&s, 2, req->conversation_id);
    stmt_text(&s, 3, req->joined_into);
    stmt_int(&s, 4, limit + 1);
    if (*req->owner_id) {
        stmt_text(&s, 5, req->owner_id);
    }
    bool cut;
    if ((rc = list_subs(c, &s, &out->submissions, &out->n_submissions, &cut, err)) != CF_OK) {
        return rc;
    }
    page_of(c, scope, limit, cut, out);
    return CF_OK;
}

enum cf_status ledger_scan_expired(struct ledger_ctx *c, const Cflue__V1__ScanExpiredRequest *req,
                                   Cflue__V1__ListResponse *out, struct cf_error *err)
{
    static const char sql[] =
        "SELECT " SUB_COLS " FROM submissions INDEXED BY submissions_by_lease WHERE status IN "
        "('running','terminalizing') AND lease_expires_at > 0 AND lease_expires_at < ? AND "
        "sequence > ? ORDER BY sequence LIMIT ?";
    struct stmt s;
    enum cf_status rc;
    int limit = page_limit(req->page_size);
    int64_t after = 0;
    if (*req->page_token &&
        (rc = page_token_parse_int(req->page_token, "scan", &after, err)) != CF_OK) {
        return rc;
    }
    if ((rc = stmt_open(&s, c->db, sql, "scan expired leases", err)) != CF_OK) {
        return rc;
    }
    stmt_int(&s, 1, c->now);
    stmt_int(&s, 2, after);
    stmt_int(&s, 3, limit + 1);
    bool cut;
    if ((rc = list_subs(c, &s, &out->submissions, &out->n_submissions, &cut, err)) != CF_OK) {
        return rc;
    }
    page_of(c, "scan", limit, cut, out);
    return CF_OK;
}

enum cf_status ledger_conversation(struct ledger_ctx *c, const char *conversation_id,
                                   Cflue__V1__Conversation *out, struct cf_error *err)
{
    static const char sql[] =
        "SELECT agent, created_at, next_pos, epoch, (SELECT count(*) FROM submissions s "
        "WHERE s.conversation_id = c.conversation_id AND s.status != 'settled'), c.principal "
        "FROM conversations c WHERE conversation_id = ?";
    struct stmt s;
    bool row;
    enum cf_status rc = stmt_open(&s, c->db, sql, "read conversation", err);
    if (rc != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, conversation_id);
    if ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        out->conversation_id = arena_strdup(c->arena, conversation_id);
        out->agent = (char *)col_text(c, s.st, 0);
        out->create_time = pbtime_in(c->arena, sqlite3_column_int64(s.st, 1));
        out->head_offset = sqlite3_column_int64(s.st, 2) - 1;
        out->epoch = sqlite3_column_int64(s.st, 3);
        out->unsettled = sqlite3_column_int(s.st, 4);
        out->principal = (char *)col_text(c, s.st, 5);
    } else if (rc == CF_OK) {
        rc = cf_error_set(err, CF_NOT_FOUND, "no conversation with id '%s'", conversation_id);
    }
    stmt_close(&s);
    return rc;
}

int64_t ledger_page_bytes(const struct ledger_config *cfg)
{
    return cfg && cfg->page_bytes > 0 ? cfg->page_bytes : LEDGER_PAGE_BYTES_MAX;
}

int64_t ledger_record_bytes_max(const struct ledger_config *cfg)
{
    return ledger_page_bytes(cfg) - LEDGER_RECORD_SLACK;
}

/* varint_len is the length of a protobuf varint holding v. */
static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* row_record builds the current row (pos, record_id, kind, submission_id, attempt_id, ts, body)
 * as a Record in the arena, its body decoded from the `body` column. *framed_out is its size
 * as a repeated field of ReadResponse, known before anything is decoded: when it exceeds
 * `room`, *out is left NULL and nothing is copied. */
static enum cf_status row_record(struct ledger_ctx *c, sqlite3_stmt *st, size_t room,
                                 Cflue__V1__Record **out, size_t *framed_out, struct cf_error *err)
{
    Cflue__V1__Record view = CFLUE__V1__RECORD__INIT;
    Google__Protobuf__Timestamp ts = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    char **fields[] = {&view.id, &view.submission_id, &view.attempt_id};
    const int cols[] = {1, 3, 4};
    *out = NULL;
    view.offset = sqlite3_column_int64(st, 0);
    for (int i = 0; i < 3; i++) {
        const unsigned char *t = sqlite3_column_text(st, cols[i]);
        *fields[i] = t ? (char *)t : "";
    }
    pbtime_set(&ts, sqlite3_column_int64(st, 5));
    view.create_time = &ts;
    int kind = sqlite3_column_int(st, 2);
    const void *blob = sqlite3_column_blob(st, 6);
    size_t blob_len = (size_t)sqlite3_column_bytes(st, 6);
    const ProtobufCMessageDescriptor *desc = record_body_descriptor(kind);
    if (!desc) {
        return cf_error_set(err, CF_CORRUPT, "record %lld has an unknown kind %d",
                            (long long)view.offset, kind);
    }
    size_t size = protobuf_c_message_get_packed_size(&view.base) +
                  varint_len((uint64_t)kind << 3 | 2) + varint_len(blob_len) + blob_len;
    *framed_out = 1 + varint_len(size) + size;
    if (*framed_out > room) {
        return CF_OK;
    }
    ProtobufCMessage *body =
        protobuf_c_message_unpack(desc, arena_protobuf_allocator(c->arena), blob_len, blob);
    if (!body) {
        return cf_error_set(err, CF_CORRUPT, "record %lld: its %s body does not decode",
                            (long long)view.offset, record_kind_name(kind));
    }
    Cflue__V1__Record *rec = arena_alloc(c->arena, sizeof(*rec));
    *rec = view;
    rec->id = arena_strdup(c->arena, view.id);
    rec->submission_id = arena_strdup(c->arena, view.submission_id);
    rec->attempt_id = arena_strdup(c->arena, view.attempt_id);
    rec->create_time = pbtime_in(c->arena, sqlite3_column_int64(st, 5));
    record_set_body(rec, body);
    *out = rec;
    return CF_OK;
}

enum cf_status ledger_read(struct ledger_ctx *c, const Cflue__V1__ReadRequest *req,
                           Cflue__V1__ReadResponse *out, struct cf_error *err)
{
    return ledger_read_bytes(c, req, ledger_page_bytes(c->cfg), out, err);
}

enum cf_status ledger_read_bytes(struct ledger_ctx *c, const Cflue__V1__ReadRequest *req,
                                 int64_t budget, Cflue__V1__ReadResponse *out, struct cf_error *err)
{
    static const char sql[] = "SELECT pos, record_id, kind, submission_id, attempt_id, ts, body "
                              "FROM records WHERE conversation_id = ? AND pos > ? ORDER BY pos "
                              "LIMIT ?";
    struct stmt s;
    bool row;
    enum cf_status rc;
    int64_t next_pos, after = req->after_offset, last;
    size_t used = 0;
    size_t first_room = c->cfg && c->cfg->send_bytes > LEDGER_RECORD_SLACK
                            ? (size_t)(c->cfg->send_bytes - LEDGER_RECORD_SLACK)
                            : SIZE_MAX;
    int limit = page_limit(req->page_size);
    if (*req->page_token &&
        (rc = page_token_parse_int(req->page_token, req->conversation_id, &after, err)) != CF_OK) {
        return rc;
    }
    if ((rc = conversation_head(c, req->conversation_id, &next_pos, err)) != CF_OK) {
        return rc;
    }
    out->head_offset = next_pos - 1;
    out->next_page_token = "";
    if (after > out->head_offset) {
        return cf_error_setr(err, CF_RANGE, "OFFSET_BEYOND_HEAD",
                             "offset %lld is beyond the head of conversation %s (%lld)",
                             (long long)after, req->conversation_id, (long long)out->head_offset);
    }
    if ((rc = stmt_open(&s, c->db, sql, "read records", err)) != CF_OK) {
        return rc;
    }
    stmt_text(&s, 1, req->conversation_id);
    stmt_int(&s, 2, after);
    stmt_int(&s, 3, limit);
    out->records = arena_alloc(c->arena, sizeof(void *) * (size_t)limit);
    last = after;
    while ((rc = stmt_step(&s, &row, err)) == CF_OK && row) {
        Cflue__V1__Record *rec;
        size_t framed = 0;
        /* the first record always goes if a message can carry it (Append bounds every record
         * by the page budget; a smaller budget, Follow's, may be passed by the first alone:
         * then nothing is left) */
        size_t room = out->n_records == 0      ? first_room
                      : used >= (size_t)budget ? 0
                                               : (size_t)budget - used;
        if ((rc = row_record(c, s.st, room, &rec, &framed, err)) != CF_OK) {
            break;
        }
        if (!rec && out->n_records == 0) {
            rc = cf_error_setr(
                err, CF_PRECONDITION, "RECORD_OVER_MESSAGE_LIMIT",
                "record %lld of conversation %s takes %zu bytes in a message, more than this "
                "storaged sends (--max-message-bytes %lld); it was stored under a larger limit: "
                "start storaged with --max-message-bytes %zu or more to read it",
                (long long)sqlite3_column_int64(s.st, 0), req->conversation_id, framed,
                (long long)c->cfg->send_bytes, framed + LEDGER_RECORD_SLACK);
            break;
        }
        if (!rec) {
            break; /* the page is full: the rest comes with the next one */
        }
        used += framed;
        out->records[out->n_records++] = rec;
        last = rec->offset;
    }
    stmt_close(&s);
    if (rc != CF_OK) {
        return rc;
    }
    if (last < out->head_offset) {
        out->next_page_token = arena_alloc(c->arena, PAGE_TOKEN_MAX);
        page_token_make_int(out->next_page_token, req->conversation_id, last);
    }
    return CF_OK;
}
