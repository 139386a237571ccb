/* main.c - the cflue command-line client.
 *
 *   cflue health ADDR [SERVICE]
 *   cflue store get SUBMISSION [--store ADDR]
 *   cflue store admit --agent NAME [--conversation ID] [--key KEY] TEXT [--store ADDR]
 *   cflue store list [--conversation ID] [--store ADDR]
 *   cflue store read CONVERSATION [--after N] [--follow] [--store ADDR]
 *   cflue store backup FILE [--store ADDR]
 *   (and the Agent API commands of agent_cmd.c: submit, watch, status, abort, agents,
 *   conversation, compact)
 *   cflue tool ADDR NAME JSON [--sandbox NAME] [--timeout-ms N]
 *   cflue token hash | new       (token.c: the sha256 of a bearer token, or a new one)
 *
 * Every command takes --ca, --cert and --cert-key (TLS: tls_flags.h) and --deadline-ms N (or
 * CFLUE_DEADLINE_MS), and ends promptly on SIGINT or SIGTERM (guard.h).
 *
 * Listing commands page through the server's page tokens to the end. A server error prints
 * as "cflue: MESSAGE [REASON] (gRPC status N)", REASON the ErrorInfo reason.
 *
 * Text from models, tools, users and servers goes through print_text (print.h): its control
 * characters are shown, never sent to the terminal.
 *
 * Output is checked as it is written (after each page or streamed record, and at the end): when
 * it cannot be written the command stops, cancelling its call, and exits 1, with a message on
 * stderr unless the reader just went away (EPIPE, `| head`), which ends it quietly.
 *
 * Exit codes: 0 success, 1 the server answered with an error or the output could not be
 * written, 2 usage error, 3 aborted
 * (submit), 4 the deadline passed, 130/143 SIGINT/SIGTERM.
 */
#include "agent_cmd.h"
#include "call.h"
#include "flags.h"
#include "guard.h"
#include "log.h"
#include "pbtime.h"
#include "print.h"
#include "rpc.h"
#include "store_backup.h"
#include "tls_flags.h"
#include "token.h"

#include "cflue/v1/store.pb-c.h"
#include "cflue/v1/tools.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TIMEOUT_MS 10000       /* a store call */
#define HEALTH_TIMEOUT_MS 5000 /* a health check */
#define TOOL_MARGIN_MS 10000   /* a tool call: its own timeout plus this */
#define TOOL_DEFAULT_MS 600000 /* a tool call without a timeout */
#define TOOL_MAX_MS 86400000LL /* the longest --timeout-ms: a day */

static const char usage_text[] =
    "usage:\n"
    "  cflue up --agents DIR [--data DIR]  start storaged, toold and agentd on loopback\n"
    "  cflue submit --agent NAME [--conversation ID] TEXT\n"
    "                                     send a message; stream the answer and tool activity\n"
    "                                     (exit 0 completed, 1 failed, 3 aborted)\n"
    "  cflue watch CONVERSATION [--after N] [--follow]\n"
    "                                     show a conversation's records after offset N\n"
    "  cflue status SUBMISSION            show a submission\n"
    "  cflue abort SUBMISSION | --conversation ID\n"
    "  cflue agents                       list the agents agentd serves\n"
    "  cflue conversation CONVERSATION [--records]\n"
    "                                     show a conversation (and its whole history)\n"
    "  cflue compact CONVERSATION         compact a conversation's context now\n"
    "agent commands take --agentd ADDR (env CFLUE_AGENTD, default 127.0.0.1:7100) and, for an\n"
    "agentd with --tokens, the bearer token: env CFLUE_TOKEN (or CFLUE_TOKEN_FILE: a file whose\n"
    "first line is the token), --token-file FILE, or --token TOKEN (seen by ps: prefer the env);\n"
    "they send env TRACEPARENT (and TRACESTATE), when set, as the W3C trace of their calls\n"
    "  cflue token hash                   read a token on stdin, print its sha256 (token files)\n"
    "  cflue token new                    print a new random token and its sha256\n"
    "  cflue health ADDR [SERVICE]        check a daemon's gRPC health\n"
    "  cflue store get SUBMISSION         show one submission\n"
    "  cflue store admit --agent NAME [--conversation ID] [--key KEY] TEXT\n"
    "                                     admit a message (prints the submission)\n"
    "  cflue store list [--conversation ID]\n"
    "                                     list submissions in admission order\n"
    "  cflue store read CONVERSATION [--after N] [--follow]\n"
    "                                     print a conversation's records\n"
    "  cflue store backup FILE            write a consistent copy of the database to FILE (a\n"
    "                                     new file), while storaged serves\n"
    "  cflue tool ADDR NAME JSON [--sandbox NAME] [--timeout-ms N]\n"
    "                                     run one tool call on a toold and print the result\n"
    "                                     and its truncation (sandbox default: debug)\n"
    "store commands take --store ADDR (env CFLUE_STORE, default 127.0.0.1:7101)\n"
    "every command takes --ca FILE (env CFLUE_CA): TLS to the daemons, verified with that CA,\n"
    "and --cert FILE --cert-key FILE (env CFLUE_CERT, CFLUE_CERT_KEY): the client certificate\n"
    "for daemons that require one; cflue up --tls-dir DIR runs all three over TLS and mTLS\n"
    "with DIR/ca.pem, DIR/server.pem, DIR/server.key, DIR/client.pem, DIR/client.key\n"
    "every command but up takes --deadline-ms N (env CFLUE_DEADLINE_MS): the whole command\n"
    "ends within N ms (calls cancelled, exit 4). Without it one call may take 5 s (health),\n"
    "10 s (store), 15 s (agent commands), the tool's --timeout-ms + 10 s or 10 min (tool);\n"
    "submit, watch --follow and store read --follow wait until done. SIGINT/SIGTERM cancel\n"
    "the call and exit 130/143.\n"
    "text from models, tools, users and servers is printed with its control characters shown,\n"
    "never sent: ESC as \\x1b, a carriage return as \\x0d, C1 controls as \\u0080..\\u009f\n"
    "(newlines and tabs kept; valid UTF-8 unchanged), whether stdout is a terminal or not.\n"
    "output that cannot be written ends the command (its call cancelled) with exit 1: quietly\n"
    "when the reader went away (| head), with a message otherwise (a full disk).\n";

struct args {
    const char *store, *agent, *conversation, *key;
    long long after;
    bool follow;
    const char *pos[4];
    int n_pos;
};

static int usage(void)
{
    fputs(usage_text, stderr);
    return 2;
}

/* parse reads the store commands' flags and arguments into a: 0, -1 for --help or too many
 * arguments (the caller prints the usage), -2 for a flag without its value, a bad number or
 * an unknown flag (printed, naming the flag) */
static int parse(int argc, char **argv, int from, struct args *a)
{
    a->store = getenv("CFLUE_STORE") ? getenv("CFLUE_STORE") : "127.0.0.1:7101";
    a->after = -1;
    for (int i = from; i < argc; i++) {
        const char *s = argv[i];
        const char **target = NULL;
        if (!strcmp(s, "--store")) {
            target = &a->store;
        } else if (!strcmp(s, "--agent")) {
            target = &a->agent;
        } else if (!strcmp(s, "--conversation")) {
            target = &a->conversation;
        } else if (!strcmp(s, "--key")) {
            target = &a->key;
        } else if (!strcmp(s, "--follow")) {
            a->follow = true;
            continue;
        } else if (!strcmp(s, "--after")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "cflue: %s needs a value\n", s);
                return -2;
            }
            /* -1: from the start */
            if (!flags_number(s, argv[++i], -1, LLONG_MAX, &a->after)) {
                return -2;
            }
            continue;
        } else if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            return -1;
        } else if (s[0] == '-' && s[1] == '-') {
            fprintf(stderr, "cflue: unknown flag %s\n", s);
            return -2;
        } else {
            if (a->n_pos == 4) {
                return -1;
            }
            a->pos[a->n_pos++] = s;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "cflue: %s needs a value\n", s);
            return -2;
        }
        *target = argv[++i];
    }
    return 0;
}

static int fail(const struct rpc_status *st)
{
    return guard_fail(st);
}

static int cmd_health(int argc, char **argv)
{
    if (argc < 3) {
        return usage();
    }
    struct rpc_channel *ch = guard_channel(argv[2], 0);
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    req.service = argc > 3 ? argv[3] : "";
    int rc = 1;
    if (rpc_unary(ch, "/grpc.health.v1.Health/Check", &req.base,
                  &grpc__health__v1__health_check_response__descriptor,
                  guard_timeout_ms(HEALTH_TIMEOUT_MS), &resp, &st)) {
        int s = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
        printf("%s\n", s == 1 ? "SERVING" : s == 2 ? "NOT_SERVING" : "UNKNOWN");
        rc = s == 1 ? 0 : 1;
        protobuf_c_message_free_unpacked(resp, NULL);
    } else {
        rc = fail(&st);
    }
    guard_channel_free(ch);
    return rc;
}

static int store_call(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    return call_unary(ch, "cflue.v1.Store", method, req, desc, TIMEOUT_MS, resp);
}

static const char *show_submissions(void *ctx, const ProtobufCMessage *page, bool first)
{
    const Cflue__V1__ListResponse *r = (const Cflue__V1__ListResponse *)page;
    for (size_t i = 0; i < r->n_submissions; i++) {
        const Cflue__V1__Submission *s = r->submissions[i];
        printf("%lld %s %s %s\n", (long long)s->sequence, s->submission_id, s->conversation_id,
               s->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED
                   ? print_outcome_name(s->outcome)
                   : "unsettled");
    }
    return r->next_page_token;
}

/* store_list prints every submission (of a conversation), paging through List to the end */
static int store_list(struct rpc_channel *ch, const struct args *a)
{
    Cflue__V1__ListRequest req = CFLUE__V1__LIST_REQUEST__INIT;
    req.conversation_id = (char *)(a->conversation ? a->conversation : "");
    req.page_size = 1000;
    return call_pages(ch, "cflue.v1.Store", "List", &req.base, &req.page_token,
                      &cflue__v1__list_response__descriptor, TIMEOUT_MS, show_submissions, NULL);
}

static const char *show_records(void *ctx, const ProtobufCMessage *page, bool first)
{
    const Cflue__V1__ReadResponse *r = (const Cflue__V1__ReadResponse *)page;
    for (size_t i = 0; i < r->n_records; i++) {
        print_record(stdout, r->records[i]);
    }
    return r->next_page_token;
}

/* store_read prints a conversation's records after a->after, paging through Read to the end,
 * or with --follow streams them as they are appended (Follow) */
static int store_read(struct rpc_channel *ch, const struct args *a)
{
    if (!a->follow) {
        Cflue__V1__ReadRequest req = CFLUE__V1__READ_REQUEST__INIT;
        req.conversation_id = (char *)a->pos[0];
        req.after_offset = a->after;
        req.page_size = 1000;
        return call_pages(ch, "cflue.v1.Store", "Read", &req.base, &req.page_token,
                          &cflue__v1__read_response__descriptor, TIMEOUT_MS, show_records, NULL);
    }
    Cflue__V1__FollowRequest req = CFLUE__V1__FOLLOW_REQUEST__INIT;
    req.conversation_id = (char *)a->pos[0];
    req.after_offset = a->after;
    struct rpc_status st;
    struct rpc_stream *s =
        rpc_stream_open(ch, "/cflue.v1.Store/Follow", &req.base, guard_timeout_ms(0));
    ProtobufCMessage *m;
    bool written = true;
    while (written && rpc_stream_read(s, &cflue__v1__record__descriptor, &m) == 1) {
        print_record(stdout, (Cflue__V1__Record *)m);
        protobuf_c_message_free_unpacked(m, NULL);
        written = print_output_ok(stdout);
    }
    if (!written) {
        /* the reader went away (`| head`) or the output cannot be written: stop following */
        rpc_stream_cancel(s);
        rpc_stream_finish(s, &st);
        return 1;
    }
    return rpc_stream_finish(s, &st) ? 0 : fail(&st);
}

/* store_admit admits a message and prints the submission and its offset */
static int store_admit(struct rpc_channel *ch, const struct args *a)
{
    ProtobufCMessage *resp = NULL;
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    msg.text = (char *)a->pos[0];
    req.agent = (char *)a->agent;
    req.conversation_id = (char *)(a->conversation ? a->conversation : "");
    req.idempotency_key = (char *)(a->key ? a->key : "");
    req.message = &msg;
    int rc = store_call(ch, "Admit", &req.base, &cflue__v1__admit_response__descriptor, &resp);
    if (rc) {
        return rc;
    }
    Cflue__V1__AdmitResponse *r = (Cflue__V1__AdmitResponse *)resp;
    print_submission(stdout, r->submission);
    printf("%-16s %lld%s\n", "offset", (long long)r->offset,
           r->deduplicated ? " (deduplicated)" : "");
    protobuf_c_message_free_unpacked(resp, NULL);
    return 0;
}

/* store_get prints one submission */
static int store_get(struct rpc_channel *ch, const struct args *a)
{
    ProtobufCMessage *resp = NULL;
    Cflue__V1__GetRequest req = CFLUE__V1__GET_REQUEST__INIT;
    req.submission_id = (char *)a->pos[0];
    int rc = store_call(ch, "Get", &req.base, &cflue__v1__submission__descriptor, &resp);
    if (rc) {
        return rc;
    }
    print_submission(stdout, (Cflue__V1__Submission *)resp);
    protobuf_c_message_free_unpacked(resp, NULL);
    return 0;
}

/* store_backup writes a copy of the database (store_backup.c) */
static int store_backup(struct rpc_channel *ch, const struct args *a)
{
    return store_backup_run(ch, a->pos[0]);
}

static int cmd_store(int argc, char **argv)
{
    struct args a = {0};
    int parsed = argc < 3 ? -1 : parse(argc, argv, 3, &a);
    if (parsed == -2) {
        fputs("cflue: see cflue --help\n", stderr);
        return 2;
    } else if (parsed != 0) {
        return usage();
    }
    const char *sub = argv[2];
    int (*run)(struct rpc_channel *, const struct args *) = NULL;
    if (!strcmp(sub, "get") && a.n_pos == 1) {
        run = store_get;
    } else if (!strcmp(sub, "admit") && a.n_pos == 1 && a.agent) {
        run = store_admit;
    } else if (!strcmp(sub, "list") && a.n_pos == 0) {
        run = store_list;
    } else if (!strcmp(sub, "read") && a.n_pos == 1) {
        run = store_read;
    } else if (!strcmp(sub, "backup") && a.n_pos == 1) {
        run = store_backup;
    } else {
        return usage();
    }
    struct rpc_channel *ch = guard_channel(a.store, 0);
    int rc = run(ch, &a);
    guard_channel_free(ch);
    return rc;
}
static const char *truncated_by(Cflue__V1__TruncatedBy by)
{
    /* TRUNCATED_BY_UNSPECIFIED: not truncated */
    static const char *names[] = {"none", "lines", "bytes", "matches", "paths"};
    return (int)by >= 0 && (int)by <= 4 ? names[by] : "unknown";
}

static int cmd_tool(int argc, char **argv)
{
    const char *sandbox = "debug";
    long long timeout_ms = 0;
    const char *pos[3];
    int n_pos = 0;
    for (int i = 2; i < argc; i++) {
        bool sandbox_flag = !strcmp(argv[i], "--sandbox");
        if ((sandbox_flag || !strcmp(argv[i], "--timeout-ms")) && i + 1 >= argc) {
            fprintf(stderr, "cflue: %s needs a value\n", argv[i]);
            return 2;
        } else if (sandbox_flag) {
            sandbox = argv[++i];
        } else if (!strcmp(argv[i], "--timeout-ms")) {
            /* bounded so that adding TOOL_MARGIN_MS cannot overflow; 0: no limit from the
             * caller (docs/toold.md) */
            if (!flags_number(argv[i], argv[i + 1], 0, TOOL_MAX_MS, &timeout_ms)) {
                return 2;
            }
            i++;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            fprintf(stderr, "cflue: unknown flag %s\n", argv[i]);
            return 2;
        } else if (n_pos < 3) {
            pos[n_pos++] = argv[i];
        } else {
            return usage();
        }
    }
    if (n_pos != 3) {
        return usage();
    }
    Cflue__V1__ToolCall call = CFLUE__V1__TOOL_CALL__INIT;
    call.sandbox = (char *)sandbox;
    call.call_id = "cli";
    call.name = (char *)pos[1];
    call.arguments_json = (char *)pos[2];
    Google__Protobuf__Duration timeout = GOOGLE__PROTOBUF__DURATION__INIT;
    if (timeout_ms > 0) {
        pbdur_set(&timeout, timeout_ms);
        call.timeout = &timeout;
    }
    struct rpc_channel *ch = guard_channel(pos[0], 64 << 20);
    ProtobufCMessage *resp;
    struct rpc_status st;
    bool ok =
        rpc_unary(ch, "/cflue.v1.Tools/Execute", &call.base, &cflue__v1__tool_result__descriptor,
                  guard_timeout_ms(timeout_ms > 0 ? timeout_ms + TOOL_MARGIN_MS : TOOL_DEFAULT_MS),
                  &resp, &st);
    guard_channel_free(ch);
    if (!ok) {
        return fail(&st);
    }
    Cflue__V1__ToolResult *r = (Cflue__V1__ToolResult *)resp;
    const Cflue__V1__Truncation *t = r->truncation;
    print_text(stdout, r->text, strlen(r->text), 0);
    putchar('\n');
    fprintf(stderr, "-- %s; details ", r->is_error ? "error result" : "result");
    print_text(stderr, r->details_json, strlen(r->details_json), PRINT_ONE_LINE);
    fputc('\n', stderr);
    if (t) {
        fprintf(
            stderr,
            "-- truncation: truncated=%s by=%s total_lines=%lld total_bytes=%lld shown=%lld-%lld "
            "next_offset=%lld line_too_long=%s\n",
            t->truncated ? "yes" : "no", truncated_by(t->by), (long long)t->total_lines,
            (long long)t->total_bytes, (long long)t->shown_first_line,
            (long long)t->shown_last_line, (long long)t->next_offset,
            t->line_too_long ? "yes" : "no");
    }
    int rc = r->is_error ? 1 : 0;
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

/* take_deadline removes "--deadline-ms N" from argv and returns N; otherwise CFLUE_DEADLINE_MS
 * or 0 (none). -1 when the value is not a positive number of milliseconds. */
static long long take_deadline(int *argc, char **argv)
{
    const char *v = getenv("CFLUE_DEADLINE_MS");
    for (int i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], "--deadline-ms")) {
            if (i + 1 >= *argc) {
                return -1;
            }
            v = argv[i + 1];
            memmove(&argv[i], &argv[i + 2], sizeof(char *) * (size_t)(*argc - i - 1));
            *argc -= 2;
            break;
        }
    }
    if (!v || !*v) {
        return 0;
    }
    char *end;
    long long ms = strtoll(v, &end, 10);
    return *end || ms <= 0 ? -1 : ms;
}

int main(int argc, char **argv)
{
    int rc;
    long long deadline_ms = take_deadline(&argc, argv);
    if (tls_flags_take(&argc, argv) != 0) {
        return 2;
    }
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(usage_text, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (deadline_ms < 0) {
        fprintf(stderr, "cflue: --deadline-ms (or CFLUE_DEADLINE_MS) must be a positive number "
                        "of milliseconds\n");
        return 2;
    }
    log_init("cflue", LOG_WARN);
    rpc_global_init();
    /* up handles SIGINT/SIGTERM itself: it stops the daemons it started */
    if (strcmp(argv[1], "up") != 0 && !guard_start(deadline_ms)) {
        rpc_global_shutdown();
        return 1;
    }
    if (!strcmp(argv[1], "health")) {
        rc = cmd_health(argc, argv);
    } else if (!strcmp(argv[1], "store")) {
        rc = cmd_store(argc, argv);
    } else if (!strcmp(argv[1], "tool")) {
        rc = cmd_tool(argc, argv);
    } else if (!strcmp(argv[1], "token")) {
        rc = cmd_token(argc, argv);
    } else if (!strcmp(argv[1], "up")) {
        rc = cmd_up(argc, argv);
    } else if (!strcmp(argv[1], "submit") || !strcmp(argv[1], "watch") ||
               !strcmp(argv[1], "status") || !strcmp(argv[1], "abort") ||
               !strcmp(argv[1], "agents") || !strcmp(argv[1], "conversation") ||
               !strcmp(argv[1], "compact")) {
        rc = cmd_agent(argc, argv);
    } else {
        rc = usage();
    }
    /* output still buffered (a short listing to a file) is written now: a failure there is
     * the command's failure too (`cflue store read C > /dev/full` exits 1) */
    if (!print_output_ok(stdout) && rc == 0) {
        rc = 1;
    }
    rc = guard_exit_code(rc);
    if (guard_fired()) {
        /* cancelled calls may still hold gRPC's shutdown for a while: end now */
        fflush(stdout);
        fflush(stderr);
        _exit(rc);
    }
    rpc_global_shutdown();
    return rc;
}
