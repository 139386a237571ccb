/* print.c - readable ledger output. */
#include "print.h"

#include "pbtime.h"
#include "record_kind.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <time.h>

/* utf8_len returns the length of the valid UTF-8 sequence at p (at most n bytes: the bytes
 * left), 0 when p does not start one (a stray continuation byte, an overlong form, a
 * surrogate, a code point above U+10FFFF, or a sequence cut short) */
static size_t utf8_len(const unsigned char *p, size_t n)
{
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF; /* the range of the second byte */
    if (p[0] < 0x80) {
        return 1;
    } else if (p[0] >= 0xC2 && p[0] <= 0xDF) {
        len = 2;
    } else if (p[0] >= 0xE0 && p[0] <= 0xEF) {
        len = 3;
        lo = p[0] == 0xE0 ? 0xA0 : 0x80;
        hi = p[0] == 0xED ? 0x9F : 0xBF;
    } else if (p[0] >= 0xF0 && p[0] <= 0xF4) {
        len = 4;
        lo = p[0] == 0xF0 ? 0x90 : 0x80;
        hi = p[0] == 0xF4 ? 0x8F : 0xBF;
    } else {
        return 0;
    }
    if (n < len || p[1] < lo || p[1] > hi) {
        return 0;
    }
    for (size_t i = 2; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) {
            return 0;
        }
    }
    return len;
}

void print_text(FILE *out, const char *text, size_t len, unsigned flags)
{
    const unsigned char *p = (const unsigned char *)text, *end = p + len;
    while (p < end) {
        size_t n = utf8_len(p, (size_t)(end - p));
        if (n == 1 && *p == '\n') {
            fputs(flags & PRINT_ONE_LINE ? "\\n" : "\n", out);
        } else if (n == 1 && (*p == '\t' || (*p >= 0x20 && *p != 0x7F))) {
            fputc(*p, out);
        } else if (n == 1 || n == 0) {
            /* a C0 control, DEL, or a byte that is not text */
            fprintf(out, "\\x%02x", *p);
            n = 1;
        } else if (n == 2 && p[0] == 0xC2 && p[1] <= 0x9F) {
            /* a C1 control: U+0080..U+009F (CSI is U+009B) */
            fprintf(out, "\\u%04x", (unsigned)p[1]);
        } else {
            fwrite(p, 1, n, out);
        }
        p += n;
    }
}

/* sigpipe_pending reports whether a write hit a pipe without a reader: SIGPIPE is blocked in
 * cflue (rpc_global_init), so the write failed with EPIPE and the signal stays pending. */
static bool sigpipe_pending(void)
{
    sigset_t set;
    return sigpending(&set) == 0 && sigismember(&set, SIGPIPE) == 1;
}

bool print_output_ok(FILE *out)
{
    static bool failed;
    errno = 0;
    if (fflush(out) == 0 && !ferror(out)) {
        return true;
    }
    /* errno is the flush's; a write that failed earlier may have left it unset */
    int e = errno;
    if (!failed && e != EPIPE && !sigpipe_pending()) {
        fprintf(stderr, "cflue: cannot write the output: %s\n", e ? strerror(e) : "write error");
    }
    failed = true;
    return false;
}

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

/* str writes a string of a record or submission on the current line (print_text) */
static void str(FILE *out, const char *s)
{
    print_text(out, s, strlen(s), PRINT_ONE_LINE);
}

/* field writes one "label value" line of a submission, the value through print_text */
static void field(FILE *out, const char *label, const char *value)
{
    fprintf(out, "%-16s ", label);
    str(out, value);
    fputc('\n', out);
}

void print_submission(FILE *out, const Cflue__V1__Submission *s)
{
    field(out, "submission", s->submission_id);
    field(out, "conversation", s->conversation_id);
    field(out, "agent", s->agent);
    fprintf(out, "%-16s %s\n", "kind", kind_name(s->kind));
    fprintf(out, "%-16s %s\n", "source", source_name(s->source));
    fprintf(out, "%-16s %s\n", "status", print_status_name(s->status));
    fprintf(out, "%-16s %s\n", "outcome", print_outcome_name(s->outcome));
    if (*s->error) {
        field(out, "error", s->error);
    }
    fprintf(out, "%-16s %d of %d\n", "attempts", s->attempt_count, s->max_attempts);
    if (*s->attempt_id) {
        fprintf(out, "%-16s ", "attempt");
        str(out, s->attempt_id);
        fprintf(out, " (epoch %lld, owner ", (long long)s->epoch);
        str(out, *s->owner_id ? s->owner_id : "-");
        fputs(")\n", out);
    }
    if (*s->joined_into) {
        field(out, "joined into", s->joined_into);
    }
    if (*s->answered_by) {
        field(out, "answered by", s->answered_by);
    }
    if (s->usage && (s->usage->input_tokens || s->usage->output_tokens)) {
        fprintf(out, "%-16s %lld in, %lld out, $%.4f\n", "usage", (long long)s->usage->input_tokens,
                (long long)s->usage->output_tokens, s->usage->cost_usd);
    }
    if (*s->idempotency_key) {
        field(out, "idempotency key", s->idempotency_key);
    }
    if (*s->traceparent) {
        field(out, "trace", s->traceparent);
    }
    for (size_t i = 0; i < s->n_metadata; i++) {
        fprintf(out, "%-16s ", "metadata");
        str(out, s->metadata[i]->key);
        fputc('=', out);
        str(out, s->metadata[i]->value);
        fputc('\n', out);
    }
    when(out, "created", s->create_time);
    when(out, "started", s->start_time);
    when(out, "input applied", s->input_apply_time);
    when(out, "lease expires", s->lease_expire_time);
    when(out, "deadline", s->deadline);
    when(out, "abort requested", s->abort_request_time);
    when(out, "settled", s->settle_time);
    if (s->message) {
        /* the text keeps its lines, as it was written */
        fprintf(out, "%-16s ", "text");
        print_text(out, s->message->text, strlen(s->message->text), 0);
        fputc('\n', out);
        for (size_t i = 0; i < s->message->n_attachments; i++) {
            fprintf(out, "%-16s ", "attachment");
            str(out, s->message->attachments[i]->name);
            fputs(" (", out);
            str(out, s->message->attachments[i]->mime_type);
            fprintf(out, ", %zu bytes)\n", s->message->attachments[i]->data.len);
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
    size_t shown = cut ? PRINT_RESULT_MAX : head;
    /* a cut inside a UTF-8 sequence would leave bytes that are not text: cut before it */
    while (cut && shown > 0 && ((unsigned char)text[shown] & 0xC0) == 0x80) {
        shown--;
    }
    print_text(out, text, shown, 0);
    fputs(cut || lines ? " ..." : "", out);
    return lines;
}

void print_record(FILE *out, const Cflue__V1__Record *r)
{
    fprintf(out, "%lld %s ", (long long)r->offset, record_kind_name(r->body_case));
    str(out, *r->submission_id ? r->submission_id : "-");
    switch (r->body_case) {
    case CFLUE__V1__RECORD__BODY_USER_MESSAGE:
        fputc(' ', out);
        str(out, r->user_message->text);
        for (size_t i = 0; i < r->user_message->n_attachments; i++) {
            const Cflue__V1__AttachmentRef *a = r->user_message->attachments[i];
            fputs(" [attachment ", out);
            str(out, a->name);
            fputc(' ', out);
            str(out, a->mime_type);
            fprintf(out, " %lld bytes]", (long long)a->size_bytes);
        }
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT:
        fprintf(out, " (%zu bytes) ", strlen(r->system_prompt->text));
        str(out, r->system_prompt->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA:
        fprintf(out, " turn %d: ", r->assistant_delta->turn);
        str(out, r->assistant_delta->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE: {
        const Cflue__V1__AssistantMessage *m = r->assistant_message;
        fprintf(out, " turn %d, ", m->turn);
        str(out, *m->model ? m->model : "-");
        fputs(", stop ", out);
        str(out, *m->stop_reason ? m->stop_reason : "-");
        if (m->usage) {
            fprintf(out, ", %lld in, %lld out", (long long)m->usage->input_tokens,
                    (long long)m->usage->output_tokens);
        }
        fputs(": ", out);
        str(out, m->text);
        fputc('\n', out);
        for (size_t i = 0; i < m->n_tool_calls; i++) {
            fputs("    -> ", out);
            str(out, m->tool_calls[i]->name);
            fputc(' ', out);
            str(out, m->tool_calls[i]->arguments_json);
            fputs(" (", out);
            str(out, m->tool_calls[i]->id);
            fputs(")\n", out);
        }
        break;
    }
    case CFLUE__V1__RECORD__BODY_TOOL_RESULT: {
        const Cflue__V1__ToolCallResult *t = r->tool_result;
        fprintf(out, " turn %d #%d ", t->turn, t->index);
        str(out, t->name);
        fputs(" (", out);
        str(out, t->tool_call_id);
        fprintf(out, ")%s%s%s: ", t->is_error ? " error" : "",
                t->outcome_unknown ? " outcome-unknown" : "",
                t->truncation && t->truncation->truncated ? " truncated" : "");
        int more = print_result_head(out, t->text);
        if (more) {
            fprintf(out, " (%d more lines)", more);
        }
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        fputc(' ', out);
        str(out, r->signal->kind);
        fputs(": ", out);
        str(out, r->signal->text);
        fputc('\n', out);
        break;
    case CFLUE__V1__RECORD__BODY_COMPACTION: {
        const Cflue__V1__Compaction *c = r->compaction;
        fprintf(out,
                " %s, %lld -> %lld tokens, kept from offset %lld: ", print_trigger_name(c->trigger),
                (long long)c->tokens_before, (long long)c->tokens_after,
                (long long)c->first_kept_offset);
        str(out, c->summary);
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED: {
        const Cflue__V1__SubmissionSettled *s = r->submission_settled;
        fprintf(out, " %s", print_outcome_name(s->outcome));
        if (*s->answered_by) {
            fputs(" (answered by ", out);
            str(out, s->answered_by);
            fputc(')', out);
        }
        if (*s->error) {
            fputs(": ", out);
            str(out, s->error);
        }
        fputc('\n', out);
        break;
    }
    case CFLUE__V1__RECORD__BODY_TASK_STARTED: {
        const Cflue__V1__TaskStarted *t = r->task_started;
        fprintf(out, " turn %d #%d (", t->turn, t->index);
        str(out, t->tool_call_id);
        fputs("): ", out);
        str(out, t->agent);
        fprintf(out, " at depth %d, submission ", t->depth);
        str(out, t->child_submission_id);
        fputs(" in conversation ", out);
        str(out, t->child_conversation_id);
        fputc('\n', out);
        break;
    }
    default:
        fputc('\n', out);
        break;
    }
}
