/* print.c - readable ledger output. */
#include "print.h"

#include <time.h>

static const char *status_text(Cflue__V1__SubmissionStatus st)
{
    static const char *names[] = {"unspecified", "queued",  "running", "terminalizing",
                                  "settled",     "joining", "joined"};
    return (int)st >= 0 && (int)st <= 6 ? names[st] : "unknown";
}

static const char *outcome_text(Cflue__V1__Outcome o)
{
    static const char *names[] = {"-", "completed", "failed", "aborted"};
    return (int)o >= 0 && (int)o <= 3 ? names[o] : "unknown";
}

static void when(FILE *out, const char *label, int64_t ms)
{
    if (!ms) {
        return;
    }
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    char buf[32];
    gmtime_r(&t, &tm);
    strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
    fprintf(out, "%-16s %s.%03dZ\n", label, buf, (int)(ms % 1000));
}

void print_submission(FILE *out, const Cflue__V1__Submission *s)
{
    fprintf(out, "%-16s %s\n", "submission", s->submission_id);
    fprintf(out, "%-16s %s\n", "conversation", s->conversation_id);
    fprintf(out, "%-16s %s\n", "agent", s->agent);
    fprintf(out, "%-16s %s\n", "status", status_text(s->status));
    fprintf(out, "%-16s %s\n", "outcome", outcome_text(s->outcome));
    if (*s->error) {
        fprintf(out, "%-16s %s\n", "error", s->error);
    }
    fprintf(out, "%-16s %d of %d\n", "attempts", s->attempt_count, s->max_attempts);
    if (*s->attempt_id) {
        fprintf(out, "%-16s %s (epoch %lld, owner %s)\n", "attempt", s->attempt_id,
                (long long)s->epoch, *s->owner_id ? s->owner_id : "-");
    }
    if (*s->joined_into) {
        fprintf(out, "%-16s %s\n", "joined into", s->joined_into);
    }
    if (*s->answered_by) {
        fprintf(out, "%-16s %s\n", "answered by", s->answered_by);
    }
    if (s->input_tokens || s->output_tokens) {
        fprintf(out, "%-16s %lld in, %lld out, $%.4f\n", "usage", (long long)s->input_tokens,
                (long long)s->output_tokens, s->cost_usd);
    }
    if (*s->idempotency_key) {
        fprintf(out, "%-16s %s\n", "idempotency key", s->idempotency_key);
    }
    when(out, "accepted", s->accepted_at_ms);
    when(out, "started", s->started_at_ms);
    when(out, "lease expires", s->lease_expires_at_ms);
    when(out, "timeout", s->timeout_at_ms);
    when(out, "abort requested", s->abort_requested_at_ms);
    when(out, "settled", s->settled_at_ms);
    if (s->message) {
        fprintf(out, "%-16s %s\n", "text", s->message->text);
        for (size_t i = 0; i < s->message->n_attachments; i++) {
            fprintf(out, "%-16s %s (%s, %zu bytes)\n", "attachment",
                    s->message->attachments[i]->name, s->message->attachments[i]->mime_type,
                    s->message->attachments[i]->data.len);
        }
    }
}

void print_record(FILE *out, const Cflue__V1__Record *r)
{
    fprintf(out, "%lld %s %s %s\n", (long long)r->offset, r->type,
            *r->submission_id ? r->submission_id : "-", r->body_json);
}
