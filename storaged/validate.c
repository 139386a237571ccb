/* validate.c - request checks for the Store service. */
#include "validate.h"

#include "ids.h"
#include "utf8.h"

#include <jansson.h>
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

enum cf_status validate_admit(const Cflue__V1__AdmitRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("agent", r->agent, true, err)) != CF_OK ||
        (rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK) {
        return rc;
    }
    if (!r->message) {
        return cf_error_set(err, CF_INVALID, "message is required");
    }
    if ((rc = text("message.text", r->message->text, VALIDATE_TEXT_MAX, err)) != CF_OK) {
        return rc;
    }
    if (!*r->message->text && r->message->n_attachments == 0) {
        return cf_error_set(err, CF_INVALID, "message needs text or at least one attachment");
    }
    if (r->message->n_attachments > VALIDATE_ATTACHMENTS_MAX) {
        return cf_error_set(err, CF_INVALID, "message has %zu attachments; the limit is %d",
                            r->message->n_attachments, VALIDATE_ATTACHMENTS_MAX);
    }
    for (size_t i = 0; i < r->message->n_attachments; i++) {
        const Cflue__V1__Attachment *a = r->message->attachments[i];
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
    if (r->n_metadata > VALIDATE_METADATA_MAX) {
        return cf_error_set(err, CF_INVALID, "metadata has %zu entries; the limit is %d",
                            r->n_metadata, VALIDATE_METADATA_MAX);
    }
    for (size_t i = 0; i < r->n_metadata; i++) {
        if (!*r->metadata[i]->key) {
            return cf_error_set(err, CF_INVALID, "metadata keys must not be empty");
        }
        if ((rc = text("metadata key", r->metadata[i]->key, VALIDATE_NAME_MAX, err)) != CF_OK ||
            (rc = text("metadata value", r->metadata[i]->value, VALIDATE_METADATA_VALUE_MAX,
                       err)) != CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

enum cf_status validate_claim(const Cflue__V1__ClaimRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("owner_id", r->owner_id, true, err)) != CF_OK ||
        (rc = name("submission_id", r->submission_id, false, err)) != CF_OK ||
        (rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK) {
        return rc;
    }
    if (r->lease_ms < 0 || r->lease_ms > VALIDATE_LEASE_MAX_MS) {
        return cf_error_set(err, CF_INVALID, "lease_ms must be 0 (default) to %lld",
                            VALIDATE_LEASE_MAX_MS);
    }
    if (r->reclaim_started_before_ms < 0) {
        return cf_error_set(err, CF_INVALID, "reclaim_started_before_ms must not be negative");
    }
    return CF_OK;
}

enum cf_status validate_heartbeat(const Cflue__V1__HeartbeatRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("owner_id", r->owner_id, true, err)) != CF_OK) {
        return rc;
    }
    if (r->lease_ms < 0 || r->lease_ms > VALIDATE_LEASE_MAX_MS) {
        return cf_error_set(err, CF_INVALID, "lease_ms must be 0 (default) to %lld",
                            VALIDATE_LEASE_MAX_MS);
    }
    if (r->n_fences > VALIDATE_FENCES_MAX) {
        return cf_error_set(err, CF_INVALID, "at most %d fences per heartbeat",
                            VALIDATE_FENCES_MAX);
    }
    for (size_t i = 0; i < r->n_fences; i++) {
        if ((rc = fence("fences[]", r->fences[i], true, err)) != CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}

enum cf_status validate_mark_input_applied(const Cflue__V1__MarkInputAppliedRequest *r,
                                           struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("fence", r->fence, true, err)) != CF_OK) {
        return rc;
    }
    if (r->max_attempts < 0 || r->max_attempts > 1000) {
        return cf_error_set(err, CF_INVALID, "max_attempts must be 0 (keep) to 1000");
    }
    if (r->timeout_ms < 0) {
        return cf_error_set(err, CF_INVALID, "timeout_ms must not be negative");
    }
    return CF_OK;
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
    if (!*r->conversation_id == !*r->submission_id) {
        return cf_error_set(err, CF_INVALID,
                            "exactly one of conversation_id and submission_id is required");
    }
    if ((rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK ||
        (rc = name("submission_id", r->submission_id, false, err)) != CF_OK) {
        return rc;
    }
    return text("reason", r->reason, VALIDATE_ERROR_MAX, err);
}

enum cf_status validate_settle(const Cflue__V1__SettleRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = fence("fence", r->fence, false, err)) != CF_OK) {
        return rc;
    }
    if (r->outcome < CFLUE__V1__OUTCOME__COMPLETED || r->outcome > CFLUE__V1__OUTCOME__ABORTED) {
        return cf_error_set(err, CF_INVALID, "outcome is required: COMPLETED, FAILED or ABORTED");
    }
    if ((rc = text("error", r->error, VALIDATE_ERROR_MAX, err)) != CF_OK) {
        return rc;
    }
    if (r->outcome == CFLUE__V1__OUTCOME__COMPLETED && *r->error) {
        return cf_error_set(err, CF_INVALID, "error must be empty when outcome is COMPLETED");
    }
    if (r->input_tokens < 0 || r->output_tokens < 0 || !(r->cost_usd >= 0) || r->cost_usd > 1e9) {
        return cf_error_set(err, CF_INVALID, "usage must not be negative");
    }
    if (r->outcome != CFLUE__V1__OUTCOME__COMPLETED && !*r->error) {
        return cf_error_set(err, CF_INVALID, "error is required when outcome is %s",
                            r->outcome == CFLUE__V1__OUTCOME__FAILED ? "FAILED" : "ABORTED");
    }
    return CF_OK;
}

static bool record_type_ok(const char *t)
{
    size_t n = 0;
    for (; t[n]; n++) {
        char c = t[n];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
              c == '-')) {
            return false;
        }
    }
    return n >= 1 && n <= 64;
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
    for (size_t i = 0; i < r->n_records; i++) {
        const Cflue__V1__Record *rec = r->records[i];
        if (!record_type_ok(rec->type)) {
            return cf_error_set(err, CF_INVALID,
                                "records[%zu].type is required: 1 to 64 characters of a-z 0-9 "
                                "_ . -",
                                i);
        }
        if (!record_id_ok(rec->id)) {
            return cf_error_set(err, CF_INVALID,
                                "records[%zu].id must be at most 256 printable ASCII characters "
                                "without spaces",
                                i);
        }
        for (size_t k = 0; k < i && *rec->id; k++) {
            if (!strcmp(r->records[k]->id, rec->id)) {
                return cf_error_set(err, CF_INVALID, "records[%zu].id '%s' repeats records[%zu]", i,
                                    rec->id, k);
            }
        }
        if ((rc = name("records[].submission_id", rec->submission_id, false, err)) != CF_OK) {
            return rc;
        }
        if (*rec->body_json) {
            json_error_t jerr;
            json_t *j = json_loads(rec->body_json, JSON_REJECT_DUPLICATES, &jerr);
            bool object = j && json_is_object(j);
            json_decref(j);
            if (!object) {
                return cf_error_set(err, CF_INVALID,
                                    "records[%zu].body_json must be a JSON object%s%s", i,
                                    j ? "" : ": ", j ? "" : jerr.text);
            }
        }
    }
    return CF_OK;
}

enum cf_status validate_get(const Cflue__V1__GetRequest *r, struct cf_error *err)
{
    return name("submission_id", r->submission_id, true, err);
}

enum cf_status validate_list(const Cflue__V1__ListRequest *r, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = name("conversation_id", r->conversation_id, false, err)) != CF_OK ||
        (rc = name("joined_into", r->joined_into, false, err)) != CF_OK) {
        return rc;
    }
    if (r->limit < 0) {
        return cf_error_set(err, CF_INVALID, "limit must not be negative");
    }
    for (size_t i = 0; i < r->n_statuses; i++) {
        if (r->statuses[i] < CFLUE__V1__SUBMISSION_STATUS__QUEUED ||
            r->statuses[i] > CFLUE__V1__SUBMISSION_STATUS__JOINED) {
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
    if (r->limit < 0) {
        return cf_error_set(err, CF_INVALID, "limit must not be negative");
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
    if (r->limit < 0 || r->limit > 1000) {
        return cf_error_set(err, CF_INVALID, "limit must be 0 (100) to 1000");
    }
    return CF_OK;
}
