/* validate.c - request checks for the Store service. */
#include "validate.h"

#include "ids.h"
#include "image.h"
#include "mem.h"
#include "pbtime.h"
#include "record_kind.h"
#include "trace.h"
#include "utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static enum cf_status name(const char *field, const char *v, bool required, struct cf_error *err)
{
    if (!*v) {
        return required ? cf_error_set(err, CF_INVALID, "%s is required", field) : CF_OK;
    }
    if (!ids_valid_name(v, VALIDATE_NAME_MAX)) {
        return cf_error_set(err, CF_INVALID,
                            "%s must be 1 to %d characters of A-Z a-z 0-9 . _ - (not . or ..)",
                            field, VALIDATE_NAME_MAX);
    }
    return CF_OK;
}

static enum cf_status text(const char *field, const char *v, size_t max, struct cf_error *err)
{
    size_t n = strlen(v), bad;
    if (n > max) {
        return cf_error_set(err, CF_INVALID, "%s is %zu bytes; the limit is %zu", field, n, max);
    }
    if (!utf8_valid(v, n, &bad)) {
        return cf_error_set(err, CF_INVALID, "%s is not valid UTF-8 (byte %zu)", field, bad);
    }
    return CF_OK;
}

static enum cf_status fence(const char *field, const Cflue__V1__Fence *f, bool need_attempt,
                            struct cf_error *err)
{
    enum cf_status rc;
    char sub[64];
    if (!f) {
        return cf_error_set(err, CF_INVALID, "%s is required", field);
    }
    snprintf(sub, sizeof(sub), "%s.submission_id", field);
    if ((rc = name(sub, f->submission_id, true, err)) != CF_OK) {
        return rc;
    }
    snprintf(sub, sizeof(sub), "%s.attempt_id", field);
    return name(sub, f->attempt_id, need_attempt, err);
}

/* trace_context checks AdmitRequest.traceparent and .tracestate: none, or a version-00
 * traceparent in its one spelling (trace.h's rules) with, optionally, a tracestate of at most
 * TRACE_STATE_MAX printable ASCII characters. */
static enum cf_status trace_context(const Cflue__V1__AdmitRequest *r, struct cf_error *err)
{
    struct trace_ctx t;
    struct cf_error why;
    if (!*r->traceparent) {
        return *r->tracestate ? cf_error_set(err, CF_INVALID, "tracestate needs a traceparent")
                              : CF_OK;
    }
    if (strlen(r->traceparent) != TRACE_PARENT_SIZE - 1 || strncmp(r->traceparent, "00-", 3) ||
        trace_parse(&t, r->traceparent, NULL, &why) != CF_OK) {
        return cf_error_set(err, CF_INVALID,
                            "traceparent must be a W3C version-00 traceparent: \"00-\", 32 "
                            "lowercase hex digits (not all 0), \"-\", 16 (not all 0), \"-\", 2");
    }
    size_t n = strlen(r->tracestate);
    if (n > TRACE_STATE_MAX) {
        return cf_error_set(err, CF_INVALID, "tracestate is %zu characters; the limit is %d", n,
                            TRACE_STATE_MAX);
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)r->tracestate[i];
        if (c < 0x20 || c > 0x7e) {
            return cf_error_set(err, CF_INVALID,
                                "tracestate holds a byte that is not printable ASCII (byte %zu)",
                                i);
        }
    }
    return CF_OK;
}

/* message checks an AdmitRequest's message: text or attachments, each attachment typed. */
static enum cf_status message(const Cflue__V1__Message *m, struct cf_error *err)
{
    enum cf_status rc;
    if (!m) {
        return cf_error_set(err, CF_INVALID, "message is required (kind MESSAGE)");
    }
    if ((rc = text("message.text", m->text, VALIDATE_TEXT_MAX, err)) != CF_OK) {
        return rc;
    }
    if (!*m->text && m->n_attachments == 0) {
        return cf_error_set(err, CF_INVALID, "message needs text or at least one attachment");
    }
    if (m->n_attachments > VALIDATE_ATTACHMENTS_MAX) {
        return cf_error_set(err, CF_INVALID, "message has %zu attachments; the limit is %d",
                            m->n_attachments, VALIDATE_ATTACHMENTS_MAX);
    }
    for (size_t i = 0; i < m->n_attachments; i++) {
        const Cflue__V1__Attachment *a = m->attachments[i];
        char f[64];
        if (!*a->mime_type) {
            return cf_error_set(err, CF_INVALID, "message.attachments[%zu].mime_type is required",
                                i);
        }
        snprintf(f, sizeof(f), "message.attachments[%zu].mime_type", i);
        if ((rc = text(f, a->mime_type, 255, err)) != CF_OK) {
            return rc;
        }
        snprintf(f, sizeof(f), "message.attachments[%zu].name", i);
        if ((rc = text(f, a->name, 1024, err)) != CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

static enum cf_status metadata(Cflue__V1__AdmitRequest__MetadataEntry *const *md, size_t n,
                               struct cf_error *err)
{
    enum cf_status rc;
    if (n > VALIDATE_METADATA_MAX) {
        return cf_error_set(err, CF_INVALID, "metadata has %zu entries; the limit is %d", n,
                            VALIDATE_METADATA_MAX);
    }
    for (size_t i = 0; i < n; i++) {
        if (!*md[i]->key) {
            return cf_error_set(err, CF_INVALID, "metadata keys must not be empty");
        }
        if (!strncmp(md[i]->key, VALIDATE_RESERVED_PREFIX, strlen(VALIDATE_RESERVED_PREFIX))) {
            return cf_error_setr(err, CF_INVALID, "RESERVED_METADATA_KEY",
                                 "metadata key '%.128s' is reserved: keys starting with \"%s\" "
                                 "belong to cflue",
                                 md[i]->key, VALIDATE_RESERVED_PREFIX);
        }
        if ((rc = text("metadata key", md[i]->key, VALIDATE_NAME_MAX, err)) != CF_OK ||
            (rc = text("metadata value", md[i]->value, VALIDATE_METADATA_VALUE_MAX, err)) !=
                CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

/* bounded checks an id that is not a name of ours (a provider's tool call id, an address): set
 * when required, at most max bytes, valid UTF-8. */
static enum cf_status bounded(const char *field, const char *v, size_t max, bool required,
                              struct cf_error *err)
{
    if (!*v) {
        return required ? cf_error_set(err, CF_INVALID, "%s is required", field) : CF_OK;
    }
    return text(field, v, max, err);
}

/* delegation checks AdmitRequest.delegation against the request it came with: a subagent's
 * submission is a message into a new conversation. That its parent exists, in the conversation
 * named, one level up, is the ledger's to check (ledger_admit). */
/* normalized_relative: p is "a/b/c" with no empty, "." or ".." segment. */
static bool normalized_relative(const char *p)
{
    while (*p) {
        size_t n = strcspn(p, "/");
        if (!n || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.') ||
            (p[n] == '/' && !p[n + 1])) {
            return false;
        }
        p += n + (p[n] == '/');
    }
    return true;
}

static enum cf_status delegation(const Cflue__V1__AdmitRequest *r, struct cf_error *err)
{
    const Cflue__V1__Delegation *d = r->delegation;
    enum cf_status rc;
    if (!d) {
        return CF_OK;
    }
    if ((rc = name("delegation.parent_submission_id", d->parent_submission_id, true, err)) !=
            CF_OK ||
        (rc = name("delegation.parent_conversation_id", d->parent_conversation_id, true, err)) !=
            CF_OK ||
        (rc = bounded("delegation.tool_call_id", d->tool_call_id, VALIDATE_TOOL_CALL_ID_MAX, true,
                      err)) != CF_OK ||
        (rc = bounded("delegation.sandbox_tools", d->sandbox_tools, VALIDATE_SANDBOX_ADDRESS_MAX,
                      false, err)) != CF_OK ||
        (rc = bounded("delegation.sandbox", d->sandbox, VALIDATE_SANDBOX_MAX, false, err)) !=
            CF_OK ||
        (rc = bounded("delegation.sandbox_placement", d->sandbox_placement,
                      VALIDATE_SANDBOX_ADDRESS_MAX, false, err)) != CF_OK ||
        (rc = bounded("delegation.model", d->model, VALIDATE_MODEL_MAX, false, err)) != CF_OK ||
        (rc = bounded("delegation.cwd", d->cwd, VALIDATE_CWD_MAX, false, err)) != CF_OK) {
        return rc;
    }
    if (*d->cwd && (!*d->sandbox || !normalized_relative(d->cwd))) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.cwd must be a normalized relative path (no leading or "
                            "trailing '/', no empty, '.' or '..' segments), and only with "
                            "delegation.sandbox");
    }
    if (d->depth < 1 || d->depth > VALIDATE_DEPTH_MAX) {
        return cf_error_set(err, CF_INVALID, "delegation.depth must be 1 to %d (got %d)",
                            VALIDATE_DEPTH_MAX, (int)d->depth);
    }
    const Cflue__V1__CommandLimits *l = d->sandbox_limits;
    if (l && (!*d->sandbox || l->memory_bytes < 0 || l->processes < 0 || l->file_size_bytes < 0 ||
              l->disk_bytes < 0)) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.sandbox_limits: only with delegation.sandbox, and none "
                            "negative");
    }
    if (l &&
        (rc = pbdur_check(l->cpu_time, "delegation.sandbox_limits.cpu_time", 0, err)) != CF_OK) {
        return rc;
    }
    if (*d->sandbox_placement && (!*d->sandbox || strncmp(d->sandbox_placement, "dns:", 4))) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.sandbox_placement: a \"dns:NAME:PORT\" name, and only "
                            "with delegation.sandbox");
    }
    if (!*d->sandbox_tools != !*d->sandbox) {
        return cf_error_set(err, CF_INVALID,
                            "delegation.sandbox and delegation.sandbox_tools go together: both "
                            "set (the parent's sandbox shared) or both empty");
    }
    if (*r->conversation_id) {
        return cf_error_set(err, CF_INVALID,
                            "conversation_id must be empty with delegation: a delegated "
                            "submission always starts a new conversation");
    }
    if (r->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT) {
        return cf_error_set(err, CF_INVALID, "kind must be MESSAGE with delegation");
    }
    return CF_OK;
}

static enum cf_status admit_claim(const Cflue__V1__ClaimRequest *c, struct cf_error *err);

enum cf_status validate_admit(const Cflue__V1__AdmitRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("agent", r->agent, true, err)) != CF_OK ||
        (rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK ||
        (rc = delegation(r, err)) != CF_OK) {
        return rc;
    }
    switch (r->kind) {
    case CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_UNSPECIFIED:
    case CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE:
        if ((rc = message(r->message, err)) != CF_OK) {
            return rc;
        }
        break;
    case CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT:
        if (!*r->conversation_id) {
            return cf_error_set(err, CF_INVALID,
                                "conversation_id is required for kind COMPACT (it compacts an "
                                "existing conversation)");
        }
        if (r->message) {
            return cf_error_set(err, CF_INVALID, "message must be absent for kind COMPACT");
        }
        break;
    default:
        return cf_error_set(err, CF_INVALID, "kind %d is not a known SubmissionKind", (int)r->kind);
    }
    if (strlen(r->idempotency_key) > VALIDATE_KEY_MAX) {
        return cf_error_set(err, CF_INVALID, "idempotency_key is longer than %d characters",
                            VALIDATE_KEY_MAX);
    }
    if ((rc = text("idempotency_key", r->idempotency_key, VALIDATE_KEY_MAX, err)) != CF_OK) {
        return rc;
    }
    if (r->source > CFLUE__V1__SOURCE__SOURCE_SCHEDULE || (int)r->source < 0) {
        return cf_error_set(err, CF_INVALID, "source %d is not a known Source", (int)r->source);
    }
    if ((rc = metadata(r->metadata, r->n_metadata, err)) != CF_OK) {
        return rc;
    }
    if (*r->principal && !ids_valid_principal(r->principal)) {
        return cf_error_set(err, CF_INVALID,
                            "principal must be 1 to %d characters of A-Z a-z 0-9 . _ @ - (or empty "
                            "without authentication)",
                            IDS_PRINCIPAL_MAX);
    }
    if (r->admin && !*r->principal) {
        return cf_error_set(err, CF_INVALID, "admin needs a principal (the admin token's name)");
    }
    if ((rc = trace_context(r, err)) != CF_OK) {
        return rc;
    }
    return admit_claim(r->claim, err);
}

/* lease checks an optional lease_duration: unset is the server default; set, whole
 * milliseconds from VALIDATE_LEASE_MIN_MS to VALIDATE_LEASE_MAX_MS. */
static enum cf_status lease(const Google__Protobuf__Duration *d, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = pbdur_check(d, "lease_duration", VALIDATE_LEASE_MAX_MS, err)) != CF_OK) {
        return rc;
    }
    if (d && (pbdur_ms(d) < VALIDATE_LEASE_MIN_MS || d->nanos % 1000000 != 0)) {
        return cf_error_set(err, CF_INVALID,
                            "lease_duration must be whole milliseconds from %d ms to %lld ms "
                            "(or unset for the server default)",
                            VALIDATE_LEASE_MIN_MS, VALIDATE_LEASE_MAX_MS);
    }
    return CF_OK;
}

/* admit_claim checks AdmitRequest.claim: it claims the admitted submission, so it names no
 * other work (submission_id, conversation_id, reclaim_started_before stay empty) and needs its
 * owner. */
static enum cf_status admit_claim(const Cflue__V1__ClaimRequest *c, struct cf_error *err)
{
    enum cf_status rc;
    if (!c) {
        return CF_OK;
    }
    if ((rc = name("claim.owner_id", c->owner_id, true, err)) != CF_OK) {
        return rc;
    }
    if (*c->submission_id || *c->conversation_id || c->reclaim_started_before) {
        return cf_error_set(err, CF_INVALID,
                            "claim.%s must be empty: an Admit's claim takes the admitted "
                            "submission (only claim.owner_id and claim.lease_duration may be set)",
                            *c->submission_id     ? "submission_id"
                            : *c->conversation_id ? "conversation_id"
                                                  : "reclaim_started_before");
    }
    if ((rc = pbtime_check(c->owner_started_at, "claim.owner_started_at", err)) != CF_OK) {
        return rc;
    }
    return lease(c->lease_duration, err);
}

enum cf_status validate_claim(const Cflue__V1__ClaimRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("owner_id", r->owner_id, true, err)) != CF_OK ||
        (rc = name("submission_id", r->submission_id, false, err)) != CF_OK ||
        (rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK) {
        return rc;
    }
    if ((rc = lease(r->lease_duration, err)) != CF_OK) {
        return rc;
    }
    if ((rc = pbtime_check(r->owner_started_at, "owner_started_at", err)) != CF_OK) {
        return rc;
    }
    return pbtime_check(r->reclaim_started_before, "reclaim_started_before", err);
}

/* owner_fences checks the owner and the fences of a Heartbeat or a Release (what: its name). */
static enum cf_status owner_fences(const char *owner_id, Cflue__V1__Fence *const *fences,
                                   size_t n_fences, const char *what, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("owner_id", owner_id, true, err)) != CF_OK) {
        return rc;
    }
    if (n_fences > VALIDATE_FENCES_MAX) {
        return cf_error_set(err, CF_INVALID, "at most %d fences per %s", VALIDATE_FENCES_MAX, what);
    }
    for (size_t i = 0; i < n_fences; i++) {
        if ((rc = fence("fences[]", fences[i], true, err)) != CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

enum cf_status validate_heartbeat(const Cflue__V1__HeartbeatRequest *r, struct cf_error *err)
{
    enum cf_status rc = lease(r->lease_duration, err);
    return rc != CF_OK ? rc : owner_fences(r->owner_id, r->fences, r->n_fences, "heartbeat", err);
}

enum cf_status validate_release(const Cflue__V1__ReleaseRequest *r, struct cf_error *err)
{
    enum cf_status rc = pbdur_check(r->expire_after, "expire_after", VALIDATE_LEASE_MAX_MS, err);
    return rc != CF_OK ? rc : owner_fences(r->owner_id, r->fences, r->n_fences, "release", err);
}

/* input_budgets checks what a MarkInputApplied installs (field names are prefixed with at). */
static enum cf_status input_budgets(const char *at, const Cflue__V1__MarkInputAppliedRequest *r,
                                    struct cf_error *err)
{
    char f[64];
    if (r->max_attempts < 0 || r->max_attempts > 1000) {
        return cf_error_set(err, CF_INVALID, "%smax_attempts must be 0 (keep) to 1000", at);
    }
    snprintf(f, sizeof(f), "%stimeout", at);
    return pbdur_check(r->timeout, f, 0, err);
}

enum cf_status validate_mark_input_applied(const Cflue__V1__MarkInputAppliedRequest *r,
                                           struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("fence", r->fence, true, err)) != CF_OK) {
        return rc;
    }
    return input_budgets("", r, err);
}

enum cf_status validate_fenced(const Cflue__V1__FencedRequest *r, struct cf_error *err)
{
    return fence("fence", r->fence, true, err);
}

enum cf_status validate_claim_joinable(const Cflue__V1__ClaimJoinableRequest *r,
                                       struct cf_error *err)
{
    if (r->limit < 0) {
        return cf_error_set(err, CF_INVALID, "limit must not be negative");
    }
    return fence("host", r->host, true, err);
}

enum cf_status validate_join(const Cflue__V1__JoinRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("host", r->host, true, err)) != CF_OK) {
        return rc;
    }
    return name("submission_id", r->submission_id, true, err);
}

enum cf_status validate_request_abort(const Cflue__V1__RequestAbortRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    switch (r->target_case) {
    case CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_CONVERSATION_ID:
        rc = name("conversation_id", r->conversation_id, true, err);
        break;
    case CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_SUBMISSION_ID:
        rc = name("submission_id", r->submission_id, true, err);
        break;
    default:
        rc = cf_error_set(err, CF_INVALID, "target is required: conversation_id or submission_id");
    }
    if (rc != CF_OK) {
        return rc;
    }
    return text("reason", r->reason, VALIDATE_ERROR_MAX, err);
}

static enum cf_status records(Cflue__V1__Record *const *recs, size_t n, struct cf_error *err);

static enum cf_status usage(const char *field, const Cflue__V1__Usage *u, struct cf_error *err)
{
    if (u &&
        (u->input_tokens < 0 || u->output_tokens < 0 || !(u->cost_usd >= 0) || u->cost_usd > 1e9)) {
        return cf_error_set(err, CF_INVALID,
                            "%s must not be negative (cost_usd at most 1e9, not NaN)", field);
    }
    return CF_OK;
}

enum cf_status validate_settle(const Cflue__V1__SettleRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("fence", r->fence, false, err)) != CF_OK) {
        return rc;
    }
    if (r->outcome < CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ||
        r->outcome > CFLUE__V1__OUTCOME__OUTCOME_ABORTED) {
        return cf_error_set(err, CF_INVALID, "outcome is required: COMPLETED, FAILED or ABORTED");
    }
    if ((rc = text("error", r->error, VALIDATE_ERROR_MAX, err)) != CF_OK) {
        return rc;
    }
    if (r->outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED && *r->error) {
        return cf_error_set(err, CF_INVALID, "error must be empty when outcome is COMPLETED");
    }
    if ((rc = usage("usage", r->usage, err)) != CF_OK) {
        return rc;
    }
    if (r->outcome != CFLUE__V1__OUTCOME__OUTCOME_COMPLETED && !*r->error) {
        return cf_error_set(err, CF_INVALID, "error is required when outcome is %s",
                            r->outcome == CFLUE__V1__OUTCOME__OUTCOME_FAILED ? "FAILED"
                                                                             : "ABORTED");
    }
    if (r->mark_input_applied) {
        if (!*r->fence->attempt_id) {
            return cf_error_set(err, CF_INVALID,
                                "mark_input_applied needs a fence with an attempt "
                                "(fence.attempt_id is required)");
        }
        if ((rc = input_budgets("mark_input_applied.", r->mark_input_applied, err)) != CF_OK) {
            return rc;
        }
    }
    if (r->n_records == 0) {
        return CF_OK;
    }
    if (!*r->fence->attempt_id) {
        return cf_error_set(err, CF_INVALID,
                            "records need a fence with an attempt (fence.attempt_id is required "
                            "when records are given)");
    }
    if (r->n_records > VALIDATE_RECORDS_MAX) {
        return cf_error_set(err, CF_INVALID, "records must hold at most %d records",
                            VALIDATE_RECORDS_MAX);
    }
    return records(r->records, r->n_records, err);
}

static bool record_id_ok(const char *t)
{
    size_t n = 0;
    for (; t[n]; n++) {
        if ((unsigned char)t[n] <= 0x20 || (unsigned char)t[n] >= 0x7f) {
            return false;
        }
    }
    return n <= 256;
}

static bool signal_kind_ok(const char *t)
{
    size_t n = 0;
    for (; t[n]; n++) {
        char c = t[n];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
            return false;
        }
    }
    return n >= 1 && n <= 64;
}

/* The checks of one record body. `at` names the record ("records[3]") in every message; text
 * fields are valid UTF-8 (their size is bounded by the record's, which the ledger checks). */

static enum cf_status turn(const char *at, const char *type, int32_t t, struct cf_error *err)
{
    return t >= 1 ? CF_OK
                  : cf_error_set(err, CF_INVALID, "%s.%s.turn must be 1 or more (got %d)", at, type,
                                 (int)t);
}

static enum cf_status body_text(const char *at, const char *field, const char *v,
                                struct cf_error *err)
{
    char f[96];
    snprintf(f, sizeof(f), "%s.%s", at, field);
    return text(f, v, SIZE_MAX, err);
}

static enum cf_status check_user_message(const char *at, const Cflue__V1__UserMessage *m,
                                         struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = body_text(at, "user_message.text", m->text, err)) != CF_OK) {
        return rc;
    }
    if (m->n_attachments > VALIDATE_ATTACHMENTS_MAX) {
        return cf_error_set(err, CF_INVALID, "%s.user_message has %zu attachments; the limit is %d",
                            at, m->n_attachments, VALIDATE_ATTACHMENTS_MAX);
    }
    for (size_t i = 0; i < m->n_attachments; i++) {
        const Cflue__V1__AttachmentRef *a = m->attachments[i];
        if (a->size_bytes < 0) {
            return cf_error_set(err, CF_INVALID,
                                "%s.user_message.attachments[%zu].size_bytes must not be negative",
                                at, i);
        }
        if ((rc = body_text(at, "user_message.attachments[].name", a->name, err)) != CF_OK ||
            (rc = body_text(at, "user_message.attachments[].mime_type", a->mime_type, err)) !=
                CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

static enum cf_status check_assistant_message(const char *at, const Cflue__V1__AssistantMessage *m,
                                              struct cf_error *err)
{
    enum cf_status rc;
    char f[96];
    if ((rc = turn(at, "assistant_message", m->turn, err)) != CF_OK ||
        (rc = body_text(at, "assistant_message.text", m->text, err)) != CF_OK ||
        (rc = body_text(at, "assistant_message.stop_reason", m->stop_reason, err)) != CF_OK ||
        (rc = body_text(at, "assistant_message.model", m->model, err)) != CF_OK) {
        return rc;
    }
    snprintf(f, sizeof(f), "%s.assistant_message.usage", at);
    if ((rc = usage(f, m->usage, err)) != CF_OK) {
        return rc;
    }
    for (size_t i = 0; i < m->n_tool_calls; i++) {
        const Cflue__V1__ToolCallRequest *c = m->tool_calls[i];
        if (!*c->id || !*c->name) {
            return cf_error_set(err, CF_INVALID,
                                "%s.assistant_message.tool_calls[%zu] needs an id and a name", at,
                                i);
        }
        for (size_t k = 0; k < i; k++) {
            if (!strcmp(m->tool_calls[k]->id, c->id)) {
                return cf_error_set(err, CF_INVALID,
                                    "%s.assistant_message.tool_calls[%zu].id '%.128s' repeats "
                                    "tool_calls[%zu]",
                                    at, i, c->id, k);
            }
        }
    }
    return CF_OK;
}

/* tool_images checks a tool result's images against image.h's bounds: at most
 * IMAGE_RESULT_MAX, each of a type the providers show and 1 to IMAGE_BYTES_MAX bytes, all
 * together at most IMAGE_RESULT_BYTES_MAX. */
static enum cf_status tool_images(const char *at, const Cflue__V1__ToolCallResult *t,
                                  struct cf_error *err)
{
    enum cf_status rc;
    size_t bytes = 0;
    if (t->n_images > IMAGE_RESULT_MAX) {
        return cf_error_set(err, CF_INVALID, "%s.tool_result.images: %zu images; the limit is %d",
                            at, t->n_images, IMAGE_RESULT_MAX);
    }
    for (size_t i = 0; i < t->n_images; i++) {
        const Cflue__V1__Attachment *a = t->images[i];
        char f[64];
        if (!image_type(a->mime_type)) {
            return cf_error_set(err, CF_INVALID,
                                "%s.tool_result.images[%zu].mime_type '%.64s' is not one of "
                                "image/png, image/jpeg, image/gif, image/webp",
                                at, i, a->mime_type);
        }
        if (!a->data.len || a->data.len > IMAGE_BYTES_MAX) {
            return cf_error_set(err, CF_INVALID,
                                "%s.tool_result.images[%zu].data is %zu bytes; it must be 1 to %d",
                                at, i, a->data.len, IMAGE_BYTES_MAX);
        }
        snprintf(f, sizeof(f), "tool_result.images[%zu].name", i);
        if ((rc = body_text(at, f, a->name, err)) != CF_OK) {
            return rc;
        }
        if (strlen(a->name) > IMAGE_NAME_MAX) {
            return cf_error_set(err, CF_INVALID, "%s.%s is %zu bytes; the limit is %d", at, f,
                                strlen(a->name), IMAGE_NAME_MAX);
        }
        bytes += a->data.len;
    }
    if (bytes > IMAGE_RESULT_BYTES_MAX) {
        return cf_error_set(err, CF_INVALID,
                            "%s.tool_result.images hold %zu bytes together; the limit is %d", at,
                            bytes, IMAGE_RESULT_BYTES_MAX);
    }
    return CF_OK;
}

static enum cf_status check_tool_result(const char *at, const Cflue__V1__ToolCallResult *t,
                                        struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = turn(at, "tool_result", t->turn, err)) != CF_OK ||
        (rc = body_text(at, "tool_result.text", t->text, err)) != CF_OK) {
        return rc;
    }
    if (t->index < 0) {
        return cf_error_set(err, CF_INVALID, "%s.tool_result.index must not be negative", at);
    }
    if (!*t->tool_call_id || !*t->name) {
        return cf_error_set(err, CF_INVALID, "%s.tool_result needs tool_call_id and name", at);
    }
    const Cflue__V1__Truncation *tr = t->truncation;
    if (tr && ((int)tr->by < 0 || tr->by > CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_PATHS ||
               tr->total_lines < 0 || tr->total_bytes < 0 || tr->shown_first_line < 0 ||
               tr->shown_last_line < 0 || tr->next_offset < 0)) {
        return cf_error_set(err, CF_INVALID,
                            "%s.tool_result.truncation: counts must not be negative and `by` "
                            "must be a known TruncatedBy",
                            at);
    }
    return tool_images(at, t, err);
}

/* body_name checks a body's field that names something of cflue's (an agent, a submission, a
 * conversation): required, and a name as validate's own fields are. */
static enum cf_status body_name(const char *at, const char *field, const char *v,
                                struct cf_error *err)
{
    char f[96];
    snprintf(f, sizeof(f), "%s.%s", at, field);
    return name(f, v, true, err);
}

static enum cf_status check_task_started(const char *at, const Cflue__V1__TaskStarted *t,
                                         struct cf_error *err)
{
    enum cf_status rc;
    char f[96];
    if ((rc = turn(at, "task_started", t->turn, err)) != CF_OK) {
        return rc;
    }
    if (t->index < 0) {
        return cf_error_set(err, CF_INVALID, "%s.task_started.index must not be negative", at);
    }
    snprintf(f, sizeof(f), "%s.task_started.tool_call_id", at);
    if ((rc = bounded(f, t->tool_call_id, VALIDATE_TOOL_CALL_ID_MAX, true, err)) != CF_OK ||
        (rc = body_name(at, "task_started.agent", t->agent, err)) != CF_OK ||
        (rc = body_name(at, "task_started.child_submission_id", t->child_submission_id, err)) !=
            CF_OK ||
        (rc = body_name(at, "task_started.child_conversation_id", t->child_conversation_id, err)) !=
            CF_OK) {
        return rc;
    }
    if (t->depth < 1 || t->depth > VALIDATE_DEPTH_MAX) {
        return cf_error_set(err, CF_INVALID, "%s.task_started.depth must be 1 to %d (got %d)", at,
                            VALIDATE_DEPTH_MAX, (int)t->depth);
    }
    return CF_OK;
}

/* resources checks one list of a ResourceState: at most VALIDATE_RESOURCES_MAX, each named. */
static enum cf_status resources(const char *at, const char *field, Cflue__V1__Resource *const *r,
                                size_t n, struct cf_error *err)
{
    if (n > VALIDATE_RESOURCES_MAX) {
        return cf_error_set(err, CF_INVALID, "%s.state.%s: at most %d", at, field,
                            VALIDATE_RESOURCES_MAX);
    }
    for (size_t i = 0; i < n; i++) {
        if (!*r[i]->name || strlen(r[i]->name) > VALIDATE_RESOURCE_NAME_MAX ||
            strlen(r[i]->digest) > 64) {
            return cf_error_set(err, CF_INVALID,
                                "%s.state.%s[%zu]: a name of 1 to %d bytes and a digest of at "
                                "most 64",
                                at, field, i, VALIDATE_RESOURCE_NAME_MAX);
        }
    }
    return CF_OK;
}

/* resource_state checks a SystemPrompt's or Signal's state (absent is fine). */
static enum cf_status resource_state(const char *at, const Cflue__V1__ResourceState *st,
                                     struct cf_error *err)
{
    enum cf_status rc;
    if (!st) {
        return CF_OK;
    }
    if (strlen(st->instructions_digest) > 64 || strlen(st->sandbox) > 2 * VALIDATE_SANDBOX_MAX) {
        return cf_error_set(err, CF_INVALID, "%s.state: instructions_digest or sandbox too long",
                            at);
    }
    if ((rc = resources(at, "tools", st->tools, st->n_tools, err)) != CF_OK ||
        (rc = resources(at, "skills", st->skills, st->n_skills, err)) != CF_OK) {
        return rc;
    }
    return resources(at, "subagents", st->subagents, st->n_subagents, err);
}

static enum cf_status check_body(const char *at, const Cflue__V1__Record *rec, struct cf_error *err)
{
    enum cf_status rc;
    switch (rec->body_case) {
    case CFLUE__V1__RECORD__BODY_USER_MESSAGE:
        return check_user_message(at, rec->user_message, err);
    case CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT:
        if ((rc = resource_state(at, rec->system_prompt->state, err)) != CF_OK) {
            return rc;
        }
        return body_text(at, "system_prompt.text", rec->system_prompt->text, err);
    case CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA:
        if ((rc = turn(at, "assistant_delta", rec->assistant_delta->turn, err)) != CF_OK) {
            return rc;
        }
        return body_text(at, "assistant_delta.text", rec->assistant_delta->text, err);
    case CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE:
        return check_assistant_message(at, rec->assistant_message, err);
    case CFLUE__V1__RECORD__BODY_TOOL_RESULT:
        return check_tool_result(at, rec->tool_result, err);
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        if (!signal_kind_ok(rec->signal->kind)) {
            return cf_error_set(err, CF_INVALID,
                                "%s.signal.kind must be 1 to 64 characters of a-z 0-9 _", at);
        }
        if (*rec->signal->resource && !signal_kind_ok(rec->signal->resource)) {
            return cf_error_set(err, CF_INVALID,
                                "%s.signal.resource must be empty or 1 to 64 characters of "
                                "a-z 0-9 _",
                                at);
        }
        if ((rc = resource_state(at, rec->signal->state, err)) != CF_OK) {
            return rc;
        }
        return body_text(at, "signal.text", rec->signal->text, err);
    case CFLUE__V1__RECORD__BODY_COMPACTION: {
        const Cflue__V1__Compaction *c = rec->compaction;
        if (c->first_kept_offset < 0 || c->tokens_before < 0 || c->tokens_after < 0) {
            return cf_error_set(err, CF_INVALID,
                                "%s.compaction: first_kept_offset and token counts must not be "
                                "negative",
                                at);
        }
        if (c->trigger < CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_THRESHOLD ||
            c->trigger > CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST) {
            return cf_error_set(err, CF_INVALID,
                                "%s.compaction.trigger is required: THRESHOLD, OVERFLOW or "
                                "REQUEST",
                                at);
        }
        return body_text(at, "compaction.summary", c->summary, err);
    }
    case CFLUE__V1__RECORD__BODY_TASK_STARTED:
        return check_task_started(at, rec->task_started, err);
    case CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED:
        return cf_error_setr(err, CF_INVALID, "RESERVED_RECORD_TYPE",
                             "%s: submission_settled records are written by storaged only (Settle "
                             "writes them)",
                             at);
    default:
        return cf_error_setr(err, CF_INVALID, "MISSING_RECORD_BODY",
                             "%s has no body: every record needs one of the record types "
                             "(user_message, system_prompt, ...)",
                             at);
    }
}

struct id_at {
    const char *id;
    size_t at; /* its place in the batch */
};

static int cmp_id_at(const void *a, const void *b)
{
    const struct id_at *x = a, *y = b;
    int c = strcmp(x->id, y->id);
    return c ? c : (x->at > y->at) - (x->at < y->at);
}

/* ids_unique tells whether no record of recs[0..n) repeats an earlier one's id (empty ids
 * aside), sorting a copy of the ids so that a batch of a thousand costs no million
 * comparisons (small Appends are checked on storaged's event loop). When one does, *later_out is
 * the first record that repeats an id and *earlier_out the first record with that id. */
static bool ids_unique(Cflue__V1__Record *const *recs, size_t n, size_t *later_out,
                       size_t *earlier_out)
{
    struct id_at *ids = mem_alloc(sizeof(*ids) * (n ? n : 1));
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (*recs[i]->id) {
            ids[m++] = (struct id_at){recs[i]->id, i};
        }
    }
    qsort(ids, m, sizeof(*ids), cmp_id_at);
    bool unique = true;
    for (size_t k = 1, first = 0; k < m; k++) {
        if (strcmp(ids[k - 1].id, ids[k].id)) {
            first = k; /* the first of a run of equal ids, the earliest in the batch */
        } else if (unique || ids[k].at < *later_out) {
            *later_out = ids[k].at;
            *earlier_out = ids[first].at;
            unique = false;
        }
    }
    free(ids);
    return unique;
}

/* records checks a batch of records to append (AppendRequest.records, SettleRequest.records):
 * ids, reserved ids and types, bodies. The count is the caller's to check. */
static enum cf_status records(Cflue__V1__Record *const *recs, size_t n, struct cf_error *err)
{
    enum cf_status rc;
    for (size_t i = 0; i < n; i++) {
        const Cflue__V1__Record *rec = recs[i];
        char at[32];
        snprintf(at, sizeof(at), "records[%zu]", i);
        if (!record_id_ok(rec->id)) {
            return cf_error_set(err, CF_INVALID,
                                "records[%zu].id must be at most 256 printable ASCII characters "
                                "without spaces",
                                i);
        }
        if (!strncmp(rec->id, "settled:", 8)) {
            return cf_error_setr(err, CF_INVALID, "RESERVED_RECORD_ID",
                                 "records[%zu].id: ids starting with \"settled:\" are storaged's "
                                 "settlement records",
                                 i);
        }
        if ((rc = name("records[].submission_id", rec->submission_id, false, err)) != CF_OK ||
            (rc = check_body(at, rec, err)) != CF_OK) {
            return rc;
        }
    }
    size_t later = 0, earlier = 0;
    if (!ids_unique(recs, n, &later, &earlier)) {
        return cf_error_set(err, CF_INVALID, "records[%zu].id '%s' repeats records[%zu]", later,
                            recs[later]->id, earlier);
    }
    return CF_OK;
}

enum cf_status validate_append(const Cflue__V1__AppendRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("fence", r->fence, true, err)) != CF_OK) {
        return rc;
    }
    if (r->n_records == 0 || r->n_records > VALIDATE_RECORDS_MAX) {
        return cf_error_set(err, CF_INVALID, "records must hold 1 to %d records",
                            VALIDATE_RECORDS_MAX);
    }
    if (r->mark_input_applied &&
        (rc = input_budgets("mark_input_applied.", r->mark_input_applied, err)) != CF_OK) {
        return rc;
    }
    return records(r->records, r->n_records, err);
}

enum cf_status validate_get(const Cflue__V1__GetRequest *r, struct cf_error *err)
{
    return name("submission_id", r->submission_id, true, err);
}

/* page_size: 0 is the default (100); above 1000 is read as 1000 (AIP-158); negative is
 * refused. */
static enum cf_status page_size(int32_t n, struct cf_error *err)
{
    return n < 0 ? cf_error_set(err, CF_INVALID, "page_size must not be negative") : CF_OK;
}

enum cf_status validate_list(const Cflue__V1__ListRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK ||
        (rc = name("joined_into", r->joined_into, false, err)) != CF_OK ||
        (rc = name("owner_id", r->owner_id, false, err)) != CF_OK) {
        return rc;
    }
    if ((rc = page_size(r->page_size, err)) != CF_OK) {
        return rc;
    }
    for (size_t i = 0; i < r->n_statuses; i++) {
        if (r->statuses[i] < CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED ||
            r->statuses[i] > CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINED) {
            return cf_error_set(err, CF_INVALID, "statuses[%zu] is not a known status", i);
        }
    }
    if (r->n_statuses > 6) {
        return cf_error_set(err, CF_INVALID, "at most 6 statuses");
    }
    return CF_OK;
}

enum cf_status validate_conversation(const Cflue__V1__ConversationRequest *r, struct cf_error *err)
{
    return name("conversation_id", r->conversation_id, true, err);
}

static enum cf_status offset(int64_t off, struct cf_error *err)
{
    if (off < -1) {
        return cf_error_set(err, CF_INVALID, "after_offset must be -1 (from the start) or more");
    }
    return CF_OK;
}

enum cf_status validate_read(const Cflue__V1__ReadRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("conversation_id", r->conversation_id, true, err)) != CF_OK) {
        return rc;
    }
    if ((rc = page_size(r->page_size, err)) != CF_OK) {
        return rc;
    }
    return offset(r->after_offset, err);
}

enum cf_status validate_follow(const Cflue__V1__FollowRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("conversation_id", r->conversation_id, true, err)) != CF_OK ||
        (rc = name("until_settled", r->until_settled, false, err)) != CF_OK) {
        return rc;
    }
    return offset(r->after_offset, err);
}

enum cf_status validate_scan_expired(const Cflue__V1__ScanExpiredRequest *r, struct cf_error *err)
{
    return page_size(r->page_size, err);
}
