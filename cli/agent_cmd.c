/* agent_cmd.c - cflue submit, watch, status, abort, agents: the Agent API from a terminal.
 *
 * submit streams the answer as the model writes it (assistant_delta records), shows each tool
 * call and a short view of its result, and exits when the submission settles:
 * 0 completed, 1 failed, 3 aborted (2 is a usage error). watch shows any conversation the
 * same way; conversation and agents page through their lists to the end; compact runs
 * Agent.Compact. Records are typed (common.proto Record.body): each is shown by its case.
 * Every call carries the bearer token of --token, --token-file, CFLUE_TOKEN or
 * CFLUE_TOKEN_FILE when one is given (token.h), and the W3C trace context of the environment's
 * TRACEPARENT and TRACESTATE when set (the convention of tools that run a command inside a
 * trace): a Submit's work then joins that trace.
 */
#include "agent_cmd.h"

#include "call.h"
#include "flags.h"
#include "guard.h"
#include "print.h"
#include "rpc.h"
#include "token.h"
#include "trace.h"

#include "cflue/v1/agent.pb-c.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AGENT_TIMEOUT_MS 15000 /* one unary call to agentd */

static bool tty;

/* trace_attach makes every call on ch send the trace of TRACEPARENT and TRACESTATE from the
 * environment, normalized (gRPC refuses a header value with a tab or a byte outside ASCII, which
 * the raw variables may hold). A TRACEPARENT that does not parse is named on stderr and not
 * sent: agentd then starts a trace of its own. */
static void trace_attach(struct rpc_channel *ch)
{
    const char *tp = getenv("TRACEPARENT"), *ts = getenv("TRACESTATE");
    if (!tp || !*tp) {
        return;
    }
    struct trace_ctx t;
    struct cf_error err = {0};
    if (trace_parse(&t, tp, ts, &err) != CF_OK) {
        fprintf(stderr, "cflue: TRACEPARENT ignored: %s\n", err.msg);
        return;
    }
    char header[TRACE_PARENT_SIZE];
    trace_format(&t, header);
    if (rpc_channel_add_metadata(ch, "traceparent", header) && t.state[0]) {
        (void)rpc_channel_add_metadata(ch, "tracestate", t.state);
    }
}

static const char *dim(void)
{
    return tty ? "\033[2m" : "";
}

static const char *reset(void)
{
    return tty ? "\033[0m" : "";
}

struct view {
    const char *submission_id; /* the submission whose settlement ends the watch, or NULL */
    size_t streamed;           /* bytes of the current turn's text printed from deltas */
    bool mid_line;
    Cflue__V1__Outcome outcome; /* UNSPECIFIED until settled */
    struct rpc_channel *ch;     /* where a subagent's conversation is watched from */
    bool follow;                /* the watch stays open: subagents are followed live */
    int depth;                  /* how deep in subagents this view is (0: the conversation asked) */
};

/* indent writes the view's indent when a line starts, so a subagent's activity shows nested
 * under the call that delegated it. */
static void indent(struct view *v)
{
    for (int i = 0; !v->mid_line && i < v->depth; i++) {
        fputs(tty ? "\033[2m  | \033[0m" : "  | ", stdout);
    }
}

/* put writes s (model, tool or user text as much as cflue's own) through print_text, so that
 * nothing in it reaches the terminal as a control, with the view's indent at each line. */
static void put(struct view *v, const char *s)
{
    while (*s) {
        size_t n = strcspn(s, "\n");
        if (n) {
            indent(v);
            print_text(stdout, s, n, 0);
            v->mid_line = true;
            s += n;
        }
        if (*s == '\n') {
            indent(v);
            fputc('\n', stdout);
            v->mid_line = false;
            s++;
        }
    }
}

/* style writes one of cflue's own escape sequences (dim(), reset(): "" when stdout is not a
 * terminal), the only ones that reach stdout. */
static void style(struct view *v, const char *esc)
{
    if (*esc) {
        indent(v);
        fputs(esc, stdout);
        v->mid_line = true;
    }
}

/* note writes one dimmed line (cflue's commentary on the conversation), formatted as printf
 * does; its text through put. */
static void note(struct view *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void note(struct view *v, const char *fmt, ...)
{
    char small[1024], *big = NULL;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof(small)) {
        big = malloc((size_t)n + 1);
        if (big) {
            va_start(ap, fmt);
            vsnprintf(big, (size_t)n + 1, fmt, ap);
            va_end(ap);
        }
    }
    style(v, dim());
    put(v, n < 0 ? "" : big ? big : small);
    style(v, reset());
    put(v, "\n");
    free(big);
}

static void newline(struct view *v)
{
    if (v->mid_line) {
        put(v, "\n");
    }
}

static int watch_stream(struct rpc_channel *ch, const char *conversation, int64_t after,
                        bool follow, struct view *v);

/* show_result writes the head of a tool result. */
static void show_result(struct view *v, const Cflue__V1__ToolCallResult *t)
{
    char *head = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&head, &len);
    int more = mem ? print_result_head(mem, t->text) : 0;
    if (mem) {
        fclose(mem);
    }
    newline(v);
    note(v, "  <- %s%s%s: %s", t->name, t->is_error ? " (error)" : "",
         t->outcome_unknown ? " (outcome unknown)" : "", head ? head : "");
    if (more) {
        note(v, "     (%d more lines)", more);
    }
    free(head);
}

/* show_task writes a subagent's start, then its conversation nested, until the subagent
 * settles (or, without follow, as far as it has gone). */
static void show_task(struct view *v, const Cflue__V1__TaskStarted *t)
{
    newline(v);
    note(v, "  => %s (subagent, depth %d): conversation %s", t->agent, t->depth,
         t->child_conversation_id);
    struct view child = {.submission_id = t->child_submission_id,
                         .ch = v->ch,
                         .follow = v->follow,
                         .depth = v->depth + 1};
    fflush(stdout);
    if (watch_stream(v->ch, t->child_conversation_id, -1, v->follow, &child) != 0) {
        note(v, "  (the subagent's conversation could not be watched)");
    }
    newline(&child);
}

/* show renders one record for a person; returns true when the watched submission settled. */
static bool show(struct view *v, const Cflue__V1__Record *r)
{
    bool done = false;
    switch (r->body_case) {
    case CFLUE__V1__RECORD__BODY_USER_MESSAGE:
        newline(v);
        note(v, "> %s", r->user_message->text);
        for (size_t i = 0; i < r->user_message->n_attachments; i++) {
            const Cflue__V1__AttachmentRef *a = r->user_message->attachments[i];
            note(v, "  [attachment %s, %s, %lld bytes]", a->name, a->mime_type,
                 (long long)a->size_bytes);
        }
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA: {
        const char *text = r->assistant_delta->text;
        if (r->assistant_delta->restart && v->streamed) {
            /* the text shown so far was abandoned: the answer starts over */
            newline(v);
            note(v, "[the answer started over]");
            v->streamed = 0;
        }
        put(v, text);
        v->streamed += strlen(text);
        break;
    }
    case CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE: {
        const Cflue__V1__AssistantMessage *m = r->assistant_message;
        /* deltas stream a prefix of the text (none at all for a quick answer); the message
         * holds the whole of it: print what the deltas did not */
        size_t len = strlen(m->text);
        put(v, v->streamed <= len ? m->text + v->streamed : "");
        newline(v);
        v->streamed = 0;
        for (size_t i = 0; i < m->n_tool_calls; i++) {
            note(v, "  -> %s %s", m->tool_calls[i]->name, m->tool_calls[i]->arguments_json);
        }
        break;
    }
    case CFLUE__V1__RECORD__BODY_TOOL_RESULT:
        show_result(v, r->tool_result);
        break;
    case CFLUE__V1__RECORD__BODY_TASK_STARTED:
        show_task(v, r->task_started);
        break;
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        newline(v);
        note(v, "[signal %s] %s", r->signal->kind, r->signal->text);
        break;
    case CFLUE__V1__RECORD__BODY_COMPACTION: {
        const Cflue__V1__Compaction *c = r->compaction;
        newline(v);
        note(v, "[compaction (%s): %lld -> %lld tokens, records from offset %lld kept]",
             print_trigger_name(c->trigger), (long long)c->tokens_before,
             (long long)c->tokens_after, (long long)c->first_kept_offset);
        break;
    }
    case CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED: {
        const Cflue__V1__SubmissionSettled *s = r->submission_settled;
        bool mine = v->submission_id && !strcmp(r->submission_id, v->submission_id);
        newline(v);
        if (!v->submission_id || mine) {
            note(v, "[%s %s%s%s]", r->submission_id, print_outcome_name(s->outcome),
                 *s->error ? ": " : "", s->error);
        }
        if (mine) {
            v->outcome = s->outcome;
            done = true;
        }
        break;
    }
    default: /* system prompts are for the model; bodies this build does not know are skipped */
        break;
    }
    return done; /* the caller flushes (print_output_ok) */
}

static int watch_stream(struct rpc_channel *ch, const char *conversation, int64_t after,
                        bool follow, struct view *v)
{
    Cflue__V1__WatchRequest req = CFLUE__V1__WATCH_REQUEST__INIT;
    req.conversation_id = (char *)conversation;
    req.after_offset = after;
    req.follow = follow;
    v->ch = ch;
    v->follow = follow;
    struct rpc_stream *s =
        rpc_stream_open(ch, "/cflue.v1.Agent/Watch", &req.base, guard_timeout_ms(0));
    ProtobufCMessage *m;
    bool done = false;
    bool written = true;
    while (!done && written && rpc_stream_read(s, &cflue__v1__record__descriptor, &m) == 1) {
        done = show(v, (Cflue__V1__Record *)m);
        protobuf_c_message_free_unpacked(m, NULL);
        written = print_output_ok(stdout);
    }
    if (done || !written) {
        rpc_stream_cancel(s);
    }
    struct rpc_status st;
    rpc_stream_finish(s, &st);
    if (!written) {
        /* the reader went away (`| head`) or the output cannot be written: stop watching */
        return 1;
    }
    if (!done && st.code != GRPC_STATUS_OK) {
        return guard_fail(&st);
    }
    return 0;
}

static const char *agentd_addr(const char *flag)
{
    return flag ? flag : getenv("CFLUE_AGENTD") ? getenv("CFLUE_AGENTD") : "127.0.0.1:7100";
}

struct opts {
    const char *agent, *conv, *pos;
    long long after;
    bool follow, records;
};

/* call makes one unary call to the Agent service; prints the error and returns false when it
 * failed. */
static bool call(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    return call_unary(ch, "cflue.v1.Agent", method, req, desc, AGENT_TIMEOUT_MS, resp) == 0;
}

static int do_submit(struct rpc_channel *ch, const struct opts *o)
{
    ProtobufCMessage *resp = NULL;
    if (!o->agent || !o->pos) {
        fprintf(stderr, "usage: cflue submit --agent NAME [--conversation ID] TEXT\n");
        return 2;
    }
    Cflue__V1__SubmitRequest req = CFLUE__V1__SUBMIT_REQUEST__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    msg.text = (char *)o->pos;
    req.agent = (char *)o->agent;
    req.conversation_id = (char *)(o->conv ? o->conv : "");
    req.message = &msg;
    if (!call(ch, "Submit", &req.base, &cflue__v1__admission__descriptor, &resp)) {
        return 1;
    }
    Cflue__V1__Admission *a = (Cflue__V1__Admission *)resp;
    const char *trace = *a->traceparent ? a->traceparent : "none";
    fprintf(stderr, "%ssubmission %s in conversation %s (trace ", dim(), a->submission_id,
            a->conversation_id);
    print_text(stderr, trace, strlen(trace), PRINT_ONE_LINE);
    fprintf(stderr, ")%s\n", reset());
    struct view v = {.submission_id = a->submission_id};
    int rc = watch_stream(ch, a->conversation_id, a->offset, true, &v);
    protobuf_c_message_free_unpacked(resp, NULL);
    if (!rc) {
        rc = v.outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? 0
             : v.outcome == CFLUE__V1__OUTCOME__OUTCOME_ABORTED ? 3
                                                                : 1;
    }
    return rc;
}

static int do_abort(struct rpc_channel *ch, const struct opts *o)
{
    ProtobufCMessage *resp = NULL;
    Cflue__V1__AbortRequest req = CFLUE__V1__ABORT_REQUEST__INIT;
    if (!o->pos == !o->conv) {
        fprintf(stderr, "usage: cflue abort SUBMISSION | --conversation ID\n");
        return 2;
    }
    if (o->conv) {
        req.target_case = CFLUE__V1__ABORT_REQUEST__TARGET_CONVERSATION_ID;
        req.conversation_id = (char *)o->conv;
    } else {
        req.target_case = CFLUE__V1__ABORT_REQUEST__TARGET_SUBMISSION_ID;
        req.submission_id = (char *)o->pos;
    }
    if (!call(ch, "Abort", &req.base, &cflue__v1__abort_response__descriptor, &resp)) {
        return 1;
    }
    Cflue__V1__AbortResponse *r = (Cflue__V1__AbortResponse *)resp;
    for (size_t i = 0; i < r->n_affected; i++) {
        printf("abort requested: %s\n", r->affected[i]);
    }
    if (!r->n_affected) {
        printf("nothing to abort: no unsettled submission matched\n");
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return 0;
}

static const char *show_agents(void *ctx, const ProtobufCMessage *page, bool first)
{
    const Cflue__V1__ListAgentsResponse *r = (const Cflue__V1__ListAgentsResponse *)page;
    for (size_t i = 0; i < r->n_agents; i++) {
        const Cflue__V1__AgentInfo *a = r->agents[i];
        printf("%-20s ", a->name); /* a name is [A-Za-z0-9._-] (agents.c) */
        print_text(stdout, a->model, strlen(a->model), PRINT_ONE_LINE);
        printf("%*s ", strlen(a->model) < 36 ? (int)(36 - strlen(a->model)) : 0, "");
        print_text(stdout, a->description, strlen(a->description), PRINT_ONE_LINE);
        putchar('\n');
    }
    return r->next_page_token;
}

/* do_agents prints every agent, paging through ListAgents to the end */
static int do_agents(struct rpc_channel *ch)
{
    Cflue__V1__ListAgentsRequest req = CFLUE__V1__LIST_AGENTS_REQUEST__INIT;
    return call_pages(ch, "cflue.v1.Agent", "ListAgents", &req.base, &req.page_token,
                      &cflue__v1__list_agents_response__descriptor, AGENT_TIMEOUT_MS, show_agents,
                      NULL);
}

/* show_conversation prints the summary (first page) and the page's records; more pages only
 * with --records */
static const char *show_conversation(void *ctx, const ProtobufCMessage *page, bool first)
{
    const struct opts *o = ctx;
    const Cflue__V1__ConversationView *r = (const Cflue__V1__ConversationView *)page;
    if (first) {
        printf("%-16s %s\n%-16s %s\n%-16s %lld\n", "conversation", r->conversation_id, "agent",
               r->agent, "head offset", (long long)r->head_offset);
        for (size_t i = 0; i < r->n_submissions; i++) {
            const Cflue__V1__Submission *s = r->submissions[i];
            printf("%-16s %s %s %s\n", "submission", s->submission_id, print_status_name(s->status),
                   print_outcome_name(s->outcome));
        }
    }
    for (size_t i = 0; i < r->n_records; i++) {
        print_record(stdout, r->records[i]);
    }
    return o->records ? r->next_page_token : NULL;
}

/* do_conversation prints a conversation's summary and, with --records, its whole history,
 * paging through GetConversation to the end */
static int do_conversation(struct rpc_channel *ch, const struct opts *o)
{
    if (!o->pos) {
        fprintf(stderr, "usage: cflue conversation CONVERSATION [--records]\n");
        return 2;
    }
    Cflue__V1__GetConversationRequest req = CFLUE__V1__GET_CONVERSATION_REQUEST__INIT;
    req.conversation_id = (char *)o->pos;
    req.include_records = o->records;
    return call_pages(ch, "cflue.v1.Agent", "GetConversation", &req.base, &req.page_token,
                      &cflue__v1__conversation_view__descriptor, AGENT_TIMEOUT_MS,
                      show_conversation, (void *)o);
}

static int do_compact(struct rpc_channel *ch, const struct opts *o)
{
    ProtobufCMessage *resp = NULL;
    if (!o->pos) {
        fprintf(stderr, "usage: cflue compact CONVERSATION\n");
        return 2;
    }
    Cflue__V1__CompactRequest req = CFLUE__V1__COMPACT_REQUEST__INIT;
    req.conversation_id = (char *)o->pos;
    if (!call(ch, "Compact", &req.base, &cflue__v1__compact_response__descriptor, &resp)) {
        return 1;
    }
    Cflue__V1__CompactResponse *r = (Cflue__V1__CompactResponse *)resp;
    printf("compacted by %s: %lld -> %lld tokens (compaction record at offset %lld)\n",
           r->submission_id, (long long)r->tokens_before, (long long)r->tokens_after,
           (long long)r->record_offset);
    protobuf_c_message_free_unpacked(resp, NULL);
    return 0;
}

int cmd_agent(int argc, char **argv)
{
    const char *cmd = argv[1], *addr = NULL, *token = NULL, *token_file = NULL, *after = NULL;
    struct opts o = {.after = -1};
    tty = isatty(STDOUT_FILENO);
    for (int i = 2; i < argc; i++) {
        const char **value = NULL; /* where a flag that takes a value puts it */
        if (!strcmp(argv[i], "--agentd")) {
            value = &addr;
        } else if (!strcmp(argv[i], "--token")) {
            value = &token;
        } else if (!strcmp(argv[i], "--token-file")) {
            value = &token_file;
        } else if (!strcmp(argv[i], "--agent")) {
            value = &o.agent;
        } else if (!strcmp(argv[i], "--conversation")) {
            value = &o.conv;
        } else if (!strcmp(argv[i], "--after") || !strcmp(argv[i], "--from")) {
            value = &after;
        }
        if (value && i + 1 >= argc) {
            fprintf(stderr, "cflue: %s needs a value\n", argv[i]);
            return 2;
        } else if (value == &after) {
            /* -1: from the start */
            if (!flags_number(argv[i], argv[i + 1], -1, LLONG_MAX, &o.after)) {
                return 2;
            }
            i++;
        } else if (value) {
            *value = argv[++i];
        } else if (!strcmp(argv[i], "--follow")) {
            o.follow = true;
        } else if (!strcmp(argv[i], "--records")) {
            o.records = true;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            fprintf(stderr, "cflue: unknown flag %s\n", argv[i]);
            return 2;
        } else if (!o.pos) {
            o.pos = argv[i];
        } else {
            fprintf(stderr, "cflue: unexpected argument %s\n", argv[i]);
            return 2;
        }
    }
    if (!strcmp(cmd, "status") && !o.pos) {
        fprintf(stderr, "usage: cflue status SUBMISSION\n");
        return 2;
    }
    struct rpc_channel *ch = guard_channel(agentd_addr(addr), 64 << 20);
    ProtobufCMessage *resp = NULL;
    int rc = token_attach(ch, token, token_file); /* before any call on ch */
    if (rc) {
        guard_channel_free(ch);
        return rc;
    }
    trace_attach(ch);
    if (!strcmp(cmd, "submit")) {
        rc = do_submit(ch, &o);
    } else if (!strcmp(cmd, "watch")) {
        if (!o.pos) {
            fprintf(stderr, "usage: cflue watch CONVERSATION [--after N] [--follow]\n");
            rc = 2;
        } else {
            struct view v = {0};
            rc = watch_stream(ch, o.pos, o.after, o.follow, &v);
        }
    } else if (!strcmp(cmd, "status")) {
        Cflue__V1__GetSubmissionRequest req = CFLUE__V1__GET_SUBMISSION_REQUEST__INIT;
        req.submission_id = (char *)o.pos;
        if (!call(ch, "GetSubmission", &req.base, &cflue__v1__submission__descriptor, &resp)) {
            rc = 1;
        } else {
            print_submission(stdout, (Cflue__V1__Submission *)resp);
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    } else if (!strcmp(cmd, "abort")) {
        rc = do_abort(ch, &o);
    } else if (!strcmp(cmd, "agents")) {
        rc = do_agents(ch);
    } else if (!strcmp(cmd, "conversation")) {
        rc = do_conversation(ch, &o);
    } else if (!strcmp(cmd, "compact")) {
        rc = do_compact(ch, &o);
    }
    guard_channel_free(ch);
    return rc;
}
