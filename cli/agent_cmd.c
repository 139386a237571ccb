/* agent_cmd.c - cflue submit, watch, status, abort, agents: the Agent API from a terminal.
 *
 * submit streams the answer as the model writes it (assistant_delta records), shows each tool
 * call and a short view of its result, and exits when the submission settles:
 * 0 completed, 1 failed, 3 aborted (2 is a usage error).
 */
#include "agent_cmd.h"

#include "guard.h"
#include "print.h"
#include "rpc.h"

#include "cflue/v1/agent.pb-c.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AGENT_TIMEOUT_MS 15000 /* one unary call to agentd */

static bool tty;

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
    bool streamed_turn;        /* deltas of the current turn were printed */
    bool mid_line;
    int outcome; /* 0 until settled */
    char error[1024];
};

static void newline(struct view *v)
{
    if (v->mid_line) {
        fputc('\n', stdout);
        v->mid_line = false;
    }
}

/* show renders one record for a person; returns true when the watched submission settled. */
static bool show(struct view *v, const Cflue__V1__Record *r)
{
    json_t *b = json_loads(r->body_json, 0, NULL);
    const char *t = r->type;
    bool done = false;
    if (!strcmp(t, "user_message")) {
        newline(v);
        printf("%s> %s%s\n", dim(), json_string_value(json_object_get(b, "text")), reset());
    } else if (!strcmp(t, "assistant_delta")) {
        const char *text = json_string_value(json_object_get(b, "text"));
        fputs(text ? text : "", stdout);
        v->streamed_turn = true;
        v->mid_line = text && *text && text[strlen(text) - 1] != '\n';
    } else if (!strcmp(t, "assistant_message")) {
        if (!v->streamed_turn) {
            const char *text = json_string_value(json_object_get(b, "text"));
            if (text && *text) {
                fputs(text, stdout);
                v->mid_line = true;
            }
        }
        newline(v);
        v->streamed_turn = false;
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(b, "tool_calls"), i, c)
        {
            printf("%s  -> %s %s%s\n", dim(), json_string_value(json_object_get(c, "name")),
                   json_string_value(json_object_get(c, "arguments")), reset());
        }
    } else if (!strcmp(t, "tool_result")) {
        const char *text = json_string_value(json_object_get(b, "text"));
        const char *nl = text ? strchr(text, '\n') : NULL;
        int lines = 0;
        for (const char *p = text; p && *p; p++) {
            lines += *p == '\n';
        }
        printf("%s  <- %s%s: %.*s%s%s\n", dim(), json_string_value(json_object_get(b, "name")),
               json_is_true(json_object_get(b, "is_error")) ? " (error)" : "",
               nl ? (int)(nl - text) : 200, text ? text : "", lines ? " ..." : "", reset());
        if (lines) {
            printf("%s     (%d more lines)%s\n", dim(), lines, reset());
        }
    } else if (!strcmp(t, "submission_settled")) {
        newline(v);
        const char *outcome = json_string_value(json_object_get(b, "outcome"));
        const char *error = json_string_value(json_object_get(b, "error"));
        if (!v->submission_id || !strcmp(r->submission_id, v->submission_id)) {
            printf("%s[%s %s%s%s]%s\n", dim(), r->submission_id, outcome ? outcome : "?",
                   error && *error ? ": " : "", error ? error : "", reset());
        }
        if (v->submission_id && !strcmp(r->submission_id, v->submission_id)) {
            v->outcome = outcome && !strcmp(outcome, "completed") ? 1
                         : outcome && !strcmp(outcome, "aborted") ? 3
                                                                  : 2;
            done = true;
        }
    }
    fflush(stdout);
    json_decref(b);
    return done;
}

static int watch_stream(struct rpc_channel *ch, const char *conversation, int64_t from, bool follow,
                        struct view *v)
{
    Cflue__V1__WatchRequest req = CFLUE__V1__WATCH_REQUEST__INIT;
    req.conversation_id = (char *)conversation;
    req.from_offset = from;
    req.follow = follow;
    struct rpc_stream *s =
        rpc_stream_open(ch, "/cflue.v1.Agent/Watch", &req.base, guard_timeout_ms(0));
    ProtobufCMessage *m;
    bool done = false;
    while (!done && rpc_stream_read(s, &cflue__v1__record__descriptor, &m) == 1) {
        done = show(v, (Cflue__V1__Record *)m);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    if (done) {
        rpc_stream_cancel(s);
    }
    struct rpc_status st;
    rpc_stream_finish(s, &st);
    if (!done && st.code != GRPC_STATUS_OK) {
        return guard_fail(&st);
    }
    return 0;
}

static const char *agentd_addr(const char *flag)
{
    return flag ? flag : getenv("CFLUE_AGENTD") ? getenv("CFLUE_AGENTD") : "127.0.0.1:7100";
}

int cmd_agent(int argc, char **argv)
{
    const char *cmd = argv[1], *addr = NULL, *agent = NULL, *conv = NULL, *pos = NULL;
    long long from = -1;
    bool follow = false;
    tty = isatty(STDOUT_FILENO);
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--agentd") && i + 1 < argc) {
            addr = argv[++i];
        } else if (!strcmp(argv[i], "--agent") && i + 1 < argc) {
            agent = argv[++i];
        } else if (!strcmp(argv[i], "--conversation") && i + 1 < argc) {
            conv = argv[++i];
        } else if (!strcmp(argv[i], "--from") && i + 1 < argc) {
            from = strtoll(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--follow")) {
            follow = true;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            fprintf(stderr, "cflue: unknown flag %s\n", argv[i]);
            return 2;
        } else if (!pos) {
            pos = argv[i];
        } else {
            fprintf(stderr, "cflue: unexpected argument %s\n", argv[i]);
            return 2;
        }
    }
    struct rpc_channel *ch = guard_channel(agentd_addr(addr), 64 << 20);
    struct rpc_status st;
    ProtobufCMessage *resp = NULL;
    int rc = 0;
    if (!strcmp(cmd, "submit")) {
        if (!agent || !pos) {
            fprintf(stderr, "usage: cflue submit --agent NAME [--conversation ID] TEXT\n");
            guard_channel_free(ch);
            return 2;
        }
        Cflue__V1__SubmitRequest req = CFLUE__V1__SUBMIT_REQUEST__INIT;
        Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
        msg.text = (char *)pos;
        req.agent = (char *)agent;
        req.conversation_id = (char *)(conv ? conv : "");
        req.message = &msg;
        if (!rpc_unary(ch, "/cflue.v1.Agent/Submit", &req.base, &cflue__v1__admission__descriptor,
                       guard_timeout_ms(AGENT_TIMEOUT_MS), &resp, &st)) {
            guard_fail(&st);
            guard_channel_free(ch);
            return 1;
        }
        Cflue__V1__Admission *a = (Cflue__V1__Admission *)resp;
        fprintf(stderr, "%ssubmission %s in conversation %s%s\n", dim(), a->submission_id,
                a->conversation_id, reset());
        struct view v = {.submission_id = a->submission_id};
        rc = watch_stream(ch, a->conversation_id, a->offset, true, &v);
        protobuf_c_message_free_unpacked(resp, NULL);
        if (!rc) {
            rc = v.outcome == 1 ? 0 : v.outcome == 3 ? 3 : 1;
        }
    } else if (!strcmp(cmd, "watch")) {
        if (!pos) {
            fprintf(stderr, "usage: cflue watch CONVERSATION [--from N] [--follow]\n");
            guard_channel_free(ch);
            return 2;
        }
        struct view v = {0};
        rc = watch_stream(ch, pos, from, follow, &v);
    } else if (!strcmp(cmd, "status")) {
        Cflue__V1__GetSubmissionRequest req = CFLUE__V1__GET_SUBMISSION_REQUEST__INIT;
        req.submission_id = (char *)(pos ? pos : "");
        if (!rpc_unary(ch, "/cflue.v1.Agent/GetSubmission", &req.base,
                       &cflue__v1__submission__descriptor, guard_timeout_ms(AGENT_TIMEOUT_MS),
                       &resp, &st)) {
            rc = guard_fail(&st);
        } else {
            print_submission(stdout, (Cflue__V1__Submission *)resp);
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    } else if (!strcmp(cmd, "abort")) {
        Cflue__V1__AbortRequest req = CFLUE__V1__ABORT_REQUEST__INIT;
        req.conversation_id = (char *)(conv ? conv : "");
        req.submission_id = (char *)(pos ? pos : "");
        if (!rpc_unary(ch, "/cflue.v1.Agent/Abort", &req.base,
                       &cflue__v1__abort_response__descriptor, guard_timeout_ms(AGENT_TIMEOUT_MS),
                       &resp, &st)) {
            rc = guard_fail(&st);
        } else {
            Cflue__V1__AbortResponse *r = (Cflue__V1__AbortResponse *)resp;
            for (size_t i = 0; i < r->n_affected; i++) {
                printf("abort requested: %s\n", r->affected[i]);
            }
            if (!r->n_affected) {
                printf("nothing to abort: no unsettled submission matched\n");
            }
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    } else if (!strcmp(cmd, "agents")) {
        Cflue__V1__ListAgentsRequest req = CFLUE__V1__LIST_AGENTS_REQUEST__INIT;
        if (!rpc_unary(ch, "/cflue.v1.Agent/ListAgents", &req.base,
                       &cflue__v1__list_agents_response__descriptor,
                       guard_timeout_ms(AGENT_TIMEOUT_MS), &resp, &st)) {
            rc = guard_fail(&st);
        } else {
            Cflue__V1__ListAgentsResponse *r = (Cflue__V1__ListAgentsResponse *)resp;
            for (size_t i = 0; i < r->n_agents; i++) {
                printf("%-20s %-36s %s\n", r->agents[i]->name, r->agents[i]->model,
                       r->agents[i]->description);
            }
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    }
    guard_channel_free(ch);
    return rc;
}
