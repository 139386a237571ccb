/* print.c - readable ledger output. */
#include "print.h"

#include "pbtime.h"
#include "record_kind.h"

#include <string.h>
#include <time.h>

const char *print_status_name(Cflue__V1__SubmissionStatus st)
{
    static const char *names[] = {"unspecified", "queued",  "running", "terminalizing",
                                  "settled",     "joining", "joined"};
    return (int)st >= 0 && (int)st <= 6 ? names[st] : "unknown";
}

const char *print_outcome_name(Cflue__V1__Outcome o)
{
    static const char *names[] = {"-", "completed", "failed", "aborted"};
    return (int)o >= 0 && (int)o <= 3 ? names[o] : "unknown";
}

const char *print_trigger_name(Cflue__V1__CompactionTrigger t)
{
    static const char *names[] = {"unspecified", "threshold", "overflow", "request"};
    return (int)t >= 0 && (int)t <= 3 ? names[t] : "unknown";
}

static const char *kind_name(Cflue__V1__SubmissionKind k)
{
    return k == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT ? "compact" : "message";
}

static const char *source_name(Cflue__V1__Source s)
{
    static const char *names[] = {"prompt", "prompt", "dispatch", "channel", "schedule"};
    return (int)s >= 0 && (int)s <= 4 ? names[s] : "unknown";
}

static void when(FILE *out, const char *label, const Google__Protobuf__Timestamp *ts)
{
    int64_t ms = pbtime_ms(ts);
    if (!ts) {
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
    fprintf(out, "%-16s %s\n", "kind", kind_name(s->kind));
    fprintf(out, "%-16s %s\n", "source", source_name(s->source));
    fprintf(out, "%-16s %s\n", "status", print_status_name(s->status));
    fprintf(out, "%-16s %s\n", "outcome", print_outcome_name(s->outcome));
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
    if (s->usage && (s->usage->input_tokens || s->usage->output_tokens)) {
        fprintf(out, "%-16s %lld in, %lld out, $%.4f\n", "usage", (long long)s->usage->input_tokens,
                (long long)s->usage->output_tokens, s->usage->cost_usd);
    }
    if (*s->idempotency_key) {
        fprintf(out, "%-16s %s\n", "idempotency key", s->idempotency_key);
    }
    if (*s->traceparent) {
        fprintf(out, "%-16s %s\n", "trace", s->traceparent);
    }
    for (size_t i = 0; i < s->n_metadata; i++) {
        fprintf(out, "%-16s %s=%s\n", "metadata", s->metadata[i]->key, s->metadata[i]->value);
    }
    when(out, "created", s->create_time);
    when(out, "started", s->start_time);
    when(out, "input applied", s->input_apply_time);
    when(out, "lease expires", s->lease_expire_time);
    when(out, "deadline", s->deadline);
    when(out, "abort requested", s->abort_request_time);
    when(out, "settled", s->settle_time);
    if (s->message) {
        fprintf(out, "%-16s %s\n", "text", s->message->text);
        for (size_t i = 0; i < s->message->n_attachments; i++) {
            fprintf(out, "%-16s %s (%s, %zu bytes)\n", "attachment",
                    s->message->attachments[i]->name, s->message->attachments[i]->mime_type,
                    s->message->attachments[i]->data.len);
        }
    }
}

int print_result_head(FILE *out, const char *text)
{
    const char *nl = strchr(text, '\n');
    size_t head = nl ? (size_t)(nl - text) : strlen(text);
    int lines = 0;
    for (const char *p = nl; p && *p; p++) {
        lines += *p == '\n';
    }
    /* a trailing newline ends the last line; it starts none */
    if (lines && text[strlen(text) - 1] == '\n') {
        lines--;
    }
    bool cut = head > PRINT_RESULT_MAX;
    fprintf(out, "%.*s%s", (int)(cut ? PRINT_RESULT_MAX : head), text, cut || lines ? " ..." : "");
    return lines;
}

/* one_line writes text with its newlines shown as "\n", so that a record stays on its line */
static void one_line(FILE *out, const char *text)
{
    for (const char *p = text; *p; p++) {
        if (*p == '\n') {
            fputs("\\n", out);
        } else {
            fputc(*p, out);
        }
    }
}

void print_record(FILE *out, const Cflue__V1__Record *r)
{
    fprintf(out, "%lld %s %s", (long long)r->offset, record_kind_name(r->body_case),
            *r->submission_id ? r->submission_id : "-");
    switch (r->body_case) {
    case CFLUE__V1__RECORD__BODY_USER_MESSAGE:
        fputc(' ', out);
        one_line(out, r->user_message->text);
        for (size_t i = 0; i < r->user_message->n_attachments; i++) {
            const Cflue__V1__AttachmentRef *a = r->user_message->attachments[i];
            fprintf(out, " [attachment %s %s %lld bytes]", a->name, a->mime_type,
                    (long long)a->size_bytes);
        }
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT:
        fprintf(out, " (%zu bytes) ", strlen(r->system_prompt->text));
        one_line(out, r->system_prompt->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA:
        fprintf(out, " turn %d: ", r->assistant_delta->turn);
        one_line(out, r->assistant_delta->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE: {
        const Cflue__V1__AssistantMessage *m = r->assistant_message;
        fprintf(out, " turn %d, %s, stop %s", m->turn, *m->model ? m->model : "-",
                *m->stop_reason ? m->stop_reason : "-");
        if (m->usage) {
            fprintf(out, ", %lld in, %lld out", (long long)m->usage->input_tokens,
                    (long long)m->usage->output_tokens);
        }
        fputs(": ", out);
        one_line(out, m->text);
        fputc('\n', out);
        for (size_t i = 0; i < m->n_tool_calls; i++) {
            fprintf(out, "    -> %s %s (%s)\n", m->tool_calls[i]->name,
                    m->tool_calls[i]->arguments_json, m->tool_calls[i]->id);
        }
        break;
    }
    case CFLUE__V1__RECORD__BODY_TOOL_RESULT: {
        const Cflue__V1__ToolCallResult *t = r->tool_result;
        fprintf(out, " turn %d #%d %s (%s)%s%s%s: ", t->turn, t->index, t->name, t->tool_call_id,
                t->is_error ? " error" : "", t->outcome_unknown ? " outcome-unknown" : "",
                t->truncation && t->truncation->truncated ? " truncated" : "");
        int more = print_result_head(out, t->text);
        if (more) {
            fprintf(out, " (%d more lines)", more);
        }
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        fprintf(out, " %s: ", r->signal->kind);
        one_line(out, r->signal->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_COMPACTION: {
        const Cflue__V1__Compaction *c = r->compaction;
        fprintf(out,
                " %s, %lld -> %lld tokens, kept from offset %lld: ", print_trigger_name(c->trigger),
                (long long)c->tokens_before, (long long)c->tokens_after,
                (long long)c->first_kept_offset);
        one_line(out, c->summary);
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED: {
        const Cflue__V1__SubmissionSettled *s = r->submission_settled;
        fprintf(out, " %s", print_outcome_name(s->outcome));
        if (*s->answered_by) {
            fprintf(out, " (answered by %s)", s->answered_by);
        }
        if (*s->error) {
            fputs(": ", out);
            one_line(out, s->error);
        }
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_TASK_STARTED: {
        const Cflue__V1__TaskStarted *t = r->task_started;
        fprintf(out, " turn %d #%d (%s): %s at depth %d, submission %s in conversation %s\n",
                t->turn, t->index, t->tool_call_id, t->agent, t->depth, t->child_submission_id,
                t->child_conversation_id);
        break;
    }
    default:
        fputc('\n', out);
        break;
    }
}
