/* service.c - Tools (List, Execute, ExecuteBatch) and Sandbox RPC handlers.
 *
 * Execute runs on a thread of its own (a bash call may take minutes). Problems with what the
 * model asked become error results; gRPC errors are kept for calls that never ran: a bad
 * sandbox name, an undecodable request, a server shutting down.
 *
 * The lines a call logs carry the trace of its `traceparent` (the server sets it around the
 * handler; ExecuteBatch's threads, one per call, set the batch's).
 */
#include "service.h"

#include "clock.h"
#include "dirpage.h"
#include "driver.h"
#include "failpoint.h"
#include "ids.h"
#include "locks.h"
#include "log.h"
#include "mem.h"
#include "metrics.h"
#include "page_token.h"
#include "pbtime.h"
#include "proc.h"
#include "proto_limits.h"
#include "thread.h"
#include "trace.h"
#include "utf8.h"

#include "cflue/v1/sandbox.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SANDBOX_FILE_MAX (64 << 20)
#define EXEC_OUTPUT_MAX (8 << 20)

struct toold {
    struct workspaces *ws;
    const struct toold_config *cfg;
};

static struct toold server_state;

/* ---------- Tools ---------- */

#define TOOL_SPECS_MAX 8

/* The tool set as ToolSpecs (Tools.List, and Glance when asked). */
struct tool_specs {
    Cflue__V1__ToolSpec specs[TOOL_SPECS_MAX];
    Cflue__V1__ToolSpec *ptrs[TOOL_SPECS_MAX];
    char *schemas[TOOL_SPECS_MAX];
    size_t n;
};

static void tool_specs_fill(struct tool_specs *ts)
{
    int n;
    const struct tool_def *defs = tool_all(&n);
    ts->n = 0;
    for (int i = 0; i < n && i < TOOL_SPECS_MAX; i++, ts->n++) {
        cflue__v1__tool_spec__init(&ts->specs[i]);
        ts->specs[i].name = (char *)defs[i].name;
        ts->specs[i].description = (char *)defs[i].description;
        ts->schemas[i] = tool_schema_json(&defs[i]);
        ts->specs[i].parameters_json = ts->schemas[i];
        ts->ptrs[i] = &ts->specs[i];
    }
}

static void tool_specs_cleanup(struct tool_specs *ts)
{
    for (size_t i = 0; i < ts->n; i++) {
        free(ts->schemas[i]);
    }
    ts->n = 0;
}

/* open_cwd resolves a request's working directory (ToolCall.cwd, GlanceRequest.cwd) into rel,
 * relative to the root ("." for an empty cwd), and checks that it is a directory of the
 * sandbox; the host path goes to host when host is not NULL. */
static enum cf_status open_cwd(struct sandbox *sb, const char *cwd, char *rel, size_t rel_len,
                               char *host, size_t host_len, struct cf_error *err)
{
    int fd = -1;
    enum cf_status rc = CF_OK;
    snprintf(rel, rel_len, ".");
    if (*cwd && (rc = ws_relative(sb, cwd, rel, rel_len, err)) == CF_OK &&
        (rc = ws_open(sb, rel, O_PATH | O_DIRECTORY, 0, cwd, &fd, err)) == CF_OK) {
        close(fd);
    }
    if (rc == CF_OK && host) {
        ws_host_path(sb, rel, host, host_len);
    }
    return rc;
}

static void on_list(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ListToolsRequest *req = (const void *)msg;
    struct sandbox *sb = NULL;
    struct cf_error err;
    char rel[WS_PATH_MAX], wd[PATH_MAX] = "";
    if (*req->sandbox &&
        (workspaces_get(server_state.ws, req->sandbox, &sb, &err) != CF_OK ||
         open_cwd(sb, req->cwd, rel, sizeof(rel), wd, sizeof(wd), &err) != CF_OK)) {
        rpc_call_fail_error(c, &err);
        return;
    }
    struct tool_specs ts;
    tool_specs_fill(&ts);
    Cflue__V1__ListToolsResponse resp = CFLUE__V1__LIST_TOOLS_RESPONSE__INIT;
    resp.tools = ts.ptrs;
    resp.n_tools = ts.n;
    resp.working_directory = wd;
    resp.cwd_applied = sb && *req->cwd;
    rpc_call_reply(c, &resp.base);
    tool_specs_cleanup(&ts);
}

/* dur_ms is a valid duration (pbdur_check) in whole milliseconds, rounded up so that a set
 * duration under 1 ms is not read as unset. */
static int64_t dur_ms(const Google__Protobuf__Duration *d)
{
    return pbdur_ms(d) + (d->nanos % 1000000 != 0);
}

/* call_gone: the client went away. Server shutdown is not a reason to stop a tool call: the
 * shutdown grace period lets it finish, and after it the call is cancelled (and then gone). */
static bool call_gone(void *arg)
{
    return arg && rpc_call_client_gone(arg);
}

/* run_call executes one ToolCall into res (with gRPC-level problems in *err). A batch passes
 * the per-path turn it reserved in ticket_key/ticket; a call that ends without using it still
 * waits for and passes its turn, so later calls on the path are not stranded. */
/* toold's Prometheus series (metrics.h), made by toold_register. */
static struct {
    struct metric *calls, *seconds, *truncated, *limits;
} stats;

/* count_call adds one finished tool call to the cflue_toold_* series (tool: a known tool's
 * name, or "unknown"). */
static void count_call(const char *tool, const struct tool_result *res, int64_t ms)
{
    metrics_add(stats.calls, METRICS_LABELS(tool, res->is_error ? "true" : "false"), 1);
    metrics_observe(stats.seconds, METRICS_LABELS(tool), (double)ms / 1000.0);
    if (res->trunc.truncated) {
        metrics_add(stats.truncated, METRICS_LABELS(tool), 1);
    }
    const char *limit = json_string_value(json_object_get(res->details, "limit"));
    if (limit) {
        metrics_add(stats.limits, METRICS_LABELS(limit), 1);
    }
}

/* command_limits is what sb's commands may use under the caller's limits m (NULL: sb's own):
 * each of sb's bounds tightened, never loosened. A negative value is CF_INVALID naming it. */
static enum cf_status command_limits(const struct sandbox *sb, const Cflue__V1__CommandLimits *m,
                                     struct proc_limits *out, struct cf_error *err)
{
    *out = sb->limits;
    if (!m) {
        return CF_OK;
    }
    enum cf_status rc = pbdur_check(m->cpu_time, "limits.cpu_time", 0, err);
    if (rc != CF_OK) {
        return rc;
    }
    const char *negative = m->memory_bytes < 0      ? "memory_bytes"
                           : m->processes < 0       ? "processes"
                           : m->file_size_bytes < 0 ? "file_size_bytes"
                           : m->disk_bytes < 0      ? "disk_bytes"
                                                    : NULL;
    if (negative) {
        return cf_error_set(err, CF_INVALID, "limits.%s must not be negative", negative);
    }
    struct proc_limits want = {.cpu_ms = m->cpu_time ? dur_ms(m->cpu_time) : 0,
                               .memory_bytes = m->memory_bytes,
                               .procs = m->processes,
                               .file_bytes = m->file_size_bytes,
                               .disk_bytes = m->disk_bytes};
    proc_limits_tighten(out, &want);
    return CF_OK;
}

/* A write or edit call's turn at its path within a batch (locks.h): taken in batch order
 * before any call runs, and passed on however the call ends, used or not, or every later
 * call on the path would wait for it for good. */
struct path_turn {
    struct sandbox *sb; /* the sandbox whose locks hold it (sandboxes live as long as toold) */
    char key[WS_PATH_MAX];
    uint64_t ticket;
};

/* pass_turn passes on a turn the call did not use, after the turns before it. */
static void pass_turn(const struct path_turn *t)
{
    locks_wait(t->sb->locks, t->key, t->ticket);
    locks_release(t->sb->locks, t->key);
}

/* run_call runs one call; turn (NULL: none) is its turn at its path. */
static enum cf_status run_call(const Cflue__V1__ToolCall *call, struct rpc_call *rpc,
                               const struct path_turn *turn, struct tool_result *res,
                               struct cf_error *err)
{
    struct sandbox *sb;
    enum cf_status rc = workspaces_get(server_state.ws, call->sandbox, &sb, err);
    if (rc != CF_OK) {
        if (turn) {
            pass_turn(turn); /* the workspace cannot be used now (a failed revive) */
        }
        return rc;
    }
    int64_t t0 = clock_mono_ms();
    const struct tool_def *t = tool_find(call->name);
    char cwd[WS_PATH_MAX];
    struct cf_error why;
    struct proc_limits limits;
    if (open_cwd(sb, call->cwd, cwd, sizeof(cwd), NULL, 0, &why) != CF_OK) {
        tool_fail(res, "The call did not run: its working directory cannot be used. %s", why.msg);
    } else if (command_limits(sb, call->limits, &limits, &why) != CF_OK) {
        tool_fail(res, "The call did not run: the limits it was given cannot be used: %s.",
                  why.msg);
    } else if (!t) {
        tool_fail(res,
                  "There is no tool named '%s'. The tools are read, write, edit, bash, "
                  "grep and glob.",
                  call->name);
    } else {
        json_t *args = tool_parse_args(t, call->arguments_json, res);
        if (args) {
            struct tool_ctx ctx = {.sb = sb,
                                   .cwd = cwd,
                                   .cfg = server_state.cfg,
                                   .limits = &limits,
                                   .call_id = call->call_id,
                                   .deadline_ms = call->timeout ? t0 + dur_ms(call->timeout) : 0,
                                   .cancelled = call_gone,
                                   .cancel_ctx = rpc,
                                   .has_ticket = turn != NULL,
                                   .lock_ticket = turn ? turn->ticket : 0};
            t->run(&ctx, args, res);
            json_decref(args);
            turn = ctx.ticket_used ? NULL : turn;
        }
    }
    if (turn) {
        pass_turn(turn);
    }
    failpoint_hit("toold.tool.after_run"); /* ran; its result not yet sent */
    count_call(t ? t->name : "unknown", res, clock_mono_ms() - t0);
    char q[256];
    log_info("tool.call", "sandbox=%s tool=%s call=%s error=%d truncated=%d ms=%lld", sb->name,
             log_quote(q, sizeof(q), call->name), *call->call_id ? call->call_id : "-",
             (int)res->is_error, (int)res->trunc.truncated, (long long)(clock_mono_ms() - t0));
    return CF_OK;
}

static void fill_result(Cflue__V1__ToolResult *out, struct tool_result *res, char **details)
{
    cflue__v1__tool_result__init(out);
    out->text = (char *)buf_cstr(&res->text);
    out->is_error = res->is_error;
    *details = json_dumps(res->details, JSON_COMPACT);
    out->details_json = *details ? *details : "{}";
    out->truncation = &res->trunc;
}

static void on_execute(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ToolCall *call = (const void *)msg;
    struct tool_result res;
    struct cf_error err;
    const char *problem = rpc_call_input_problem(c);
    if (problem && strncmp(problem, "arguments_json", 14) != 0) {
        /* a name that was cut short must not select another sandbox or tool */
        rpc_call_fail(c, CF_INVALID, "malformed request: %s", problem);
        return;
    }
    tool_result_init(&res);
    if (problem) {
        tool_fail(&res,
                  "The arguments are not valid JSON text: %s. Send one JSON object of "
                  "UTF-8 text.",
                  problem);
    } else if (pbdur_check(call->timeout, "timeout", 0, &err) != CF_OK ||
               run_call(call, c, NULL, &res, &err) != CF_OK) {
        tool_result_cleanup(&res);
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__ToolResult out;
    char *details;
    fill_result(&out, &res, &details);
    rpc_call_reply(c, &out.base);
    free(details);
    tool_result_cleanup(&res);
}

/* ---------- ExecuteBatch ---------- */

struct batch;

struct batch_item {
    struct batch *b;
    int index;
    const Cflue__V1__ToolCall *call;
    struct path_turn turn;
    bool has_turn;
    struct tool_result res;
    enum cf_status st;
    struct cf_error err;
    bool done, sent;
    bool started; /* thread holds a joinable handle */
    pthread_t thread;
};

struct batch {
    struct rpc_call *rpc;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct trace_ctx trace; /* the call's: each call's thread logs under it */
};

static void *batch_worker(void *arg)
{
    struct batch_item *it = arg;
    struct trace_ctx saved;
    trace_enter(&it->b->trace, &saved);
    it->st = run_call(it->call, it->b->rpc, it->has_turn ? &it->turn : NULL, &it->res, &it->err);
    trace_leave(&saved);
    pthread_mutex_lock(&it->b->mu);
    it->done = true;
    pthread_cond_broadcast(&it->b->cv);
    pthread_mutex_unlock(&it->b->mu);
    return NULL;
}

/* reserve takes the per-path turn of a write or edit call, in batch order. */
static void reserve(struct batch_item *it)
{
    const struct tool_def *t = tool_find(it->call->name);
    struct sandbox *sb;
    struct cf_error err;
    if (!t || !t->mutates ||
        workspaces_get(server_state.ws, it->call->sandbox, &sb, &err) != CF_OK) {
        return;
    }
    char cwd[WS_PATH_MAX] = ".";
    if (*it->call->cwd && ws_relative(sb, it->call->cwd, cwd, sizeof(cwd), &err) != CF_OK) {
        return; /* the call fails on its own */
    }
    json_t *args = json_loads(it->call->arguments_json, JSON_REJECT_DUPLICATES, NULL);
    const char *path = json_string_value(json_object_get(args, "path"));
    if (path &&
        ws_relative_from(sb, cwd, path, it->turn.key, sizeof(it->turn.key), &err) == CF_OK) {
        it->turn.sb = sb;
        it->turn.ticket = locks_ticket(sb->locks, it->turn.key);
        it->has_turn = true;
    }
    json_decref(args);
}

/* check_batch_call refuses, before any call of the batch runs, a call that could never run: a
 * bad sandbox name or timeout. */
static enum cf_status check_batch_call(const Cflue__V1__ToolCall *call, size_t i,
                                       struct cf_error *err)
{
    char field[64];
    snprintf(field, sizeof(field), "calls[%zu].timeout", i);
    if (!ids_valid_name(call->sandbox, 128)) {
        return cf_error_setr(err, CF_INVALID, "INVALID_SANDBOX_NAME",
                             "calls[%zu]: sandbox names are 1 to 128 characters of A-Z a-z 0-9 . "
                             "_ - (not . or ..)",
                             i);
    }
    return pbdur_check(call->timeout, field, 0, err);
}

static void on_execute_batch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ToolBatch *req = (const void *)msg;
    if (req->n_calls > PROTO_BATCH_CALLS_MAX) {
        rpc_call_fail(c, CF_INVALID, "a batch holds at most %d calls; this one has %zu",
                      PROTO_BATCH_CALLS_MAX, req->n_calls);
        return;
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        struct cf_error err;
        if (check_batch_call(req->calls[i], i, &err) != CF_OK) {
            rpc_call_fail_error(c, &err);
            return;
        }
    }
    struct batch b = {.rpc = c};
    if (trace_current()) {
        b.trace = *trace_current();
    }
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    struct batch_item *items = mem_alloc(sizeof(*items) * (req->n_calls + 1));
    for (size_t i = 0; i < req->n_calls; i++) {
        items[i].b = &b;
        items[i].index = (int)i;
        items[i].call = req->calls[i];
        tool_result_init(&items[i].res);
        reserve(&items[i]);
    }
    failpoint_hit("toold.batch.reserved"); /* the turns taken, no call started */
    for (size_t i = 0; i < req->n_calls; i++) {
        if (req->n_calls == 1) {
            batch_worker(&items[0]); /* a lone call runs on the stream's thread */
            continue;
        }
        if (thread_start(&items[i].thread, "tool-call", 0, batch_worker, &items[i],
                         &items[i].err) != CF_OK) {
            /* this call gets an error result; its per-path turn is passed on unused */
            if (items[i].has_turn) {
                pass_turn(&items[i].turn);
            }
            tool_fail(&items[i].res, "The call could not start (%s); it did not run.",
                      items[i].err.msg);
            pthread_mutex_lock(&b.mu);
            items[i].done = true;
            pthread_mutex_unlock(&b.mu);
        } else {
            items[i].started = true;
        }
    }
    size_t sent = 0;
    bool alive = true;
    while (sent < req->n_calls) {
        pthread_mutex_lock(&b.mu);
        struct batch_item *ready = NULL;
        while (!ready) {
            for (size_t i = 0; i < req->n_calls && !ready; i++) {
                if (items[i].done && !items[i].sent) {
                    ready = &items[i];
                }
            }
            if (!ready) {
                pthread_cond_wait(&b.cv, &b.mu);
            }
        }
        ready->sent = true;
        pthread_mutex_unlock(&b.mu);
        sent++;
        if (!alive) {
            continue;
        }
        Cflue__V1__BatchResult out = CFLUE__V1__BATCH_RESULT__INIT;
        Cflue__V1__ToolResult tr;
        char *details = NULL;
        if (ready->st != CF_OK) {
            tool_fail_error(&ready->res, &ready->err);
        }
        fill_result(&tr, &ready->res, &details);
        out.index = ready->index;
        out.result = &tr;
        alive = rpc_call_send(c, &out.base);
        free(details);
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        if (items[i].started) {
            pthread_join(items[i].thread, NULL);
        }
        tool_result_cleanup(&items[i].res);
    }
    free(items);
    pthread_mutex_destroy(&b.mu);
    pthread_cond_destroy(&b.cv);
    if (alive) {
        rpc_call_finish(c, GRPC_STATUS_OK, NULL);
    } else {
        rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the caller went away");
    }
}

/* ---------- Sandbox ---------- */

/* What a Sandbox handler opens its path as, before doing its work. */
enum open_as {
    OPEN_NONE,    /* resolve the path only */
    OPEN_NODE,    /* the path itself, a final symbolic link not followed (O_PATH) */
    OPEN_DIR,     /* a directory (O_PATH) */
    OPEN_REGULAR, /* a regular file, for reading (ws_open_regular) */
    OPEN_PARENT,  /* the directory holding the last component */
    OPEN_PARENTS, /* the same, creating missing directories on the way */
};

/* The path of a Sandbox request, resolved inside its sandbox and opened. */
struct target {
    struct sandbox *sb;
    const char *path;        /* as the caller wrote it, for messages */
    char rel[WS_PATH_MAX];   /* normalized, relative to the workspace */
    int fd;                  /* per open_as; -1 for OPEN_NONE */
    struct stat st;          /* OPEN_REGULAR: the file's status at open */
    char base[NAME_MAX + 1]; /* OPEN_PARENT(S): the last component; fd is its directory */
};

/* target_open is the preamble every Sandbox handler shares: find the sandbox, resolve path in
 * it and open it as `how` asks. On failure the call is failed with the precise error (reasons
 * INVALID_SANDBOX_NAME, PATH_OUTSIDE_SANDBOX, NOT_A_DIRECTORY, ...) and false returned. On
 * success the caller closes t with target_close. */
static bool target_open(struct rpc_call *c, const char *sandbox, const char *path, enum open_as how,
                        struct target *t)
{
    struct cf_error err;
    enum cf_status rc;
    t->path = path;
    t->fd = -1;
    if ((rc = workspaces_get(server_state.ws, sandbox, &t->sb, &err)) == CF_OK) {
        rc = ws_relative(t->sb, path, t->rel, sizeof(t->rel), &err);
    }
    if (rc == CF_OK) {
        switch (how) {
        case OPEN_NONE:
            break;
        case OPEN_NODE:
            rc = ws_open(t->sb, t->rel, O_PATH | O_NOFOLLOW, 0, path, &t->fd, &err);
            break;
        case OPEN_DIR:
            rc = ws_open(t->sb, t->rel, O_PATH | O_DIRECTORY, 0, path, &t->fd, &err);
            if (rc == CF_INVALID && !strcmp(err.reason, "NOT_A_DIRECTORY")) {
                rc = cf_error_setr(&err, CF_INVALID, "NOT_A_DIRECTORY", "%s is not a directory",
                                   path);
            }
            break;
        case OPEN_REGULAR:
            rc = ws_open_regular(t->sb, t->rel, path, &t->fd, &t->st, &err);
            break;
        case OPEN_PARENT:
        case OPEN_PARENTS:
            rc = ws_open_parent(t->sb, t->rel, how == OPEN_PARENTS, path, &t->fd, t->base,
                                sizeof(t->base), &err);
            break;
        }
    }
    if (rc != CF_OK) {
        t->fd = -1;
        rpc_call_fail_error(c, &err);
        return false;
    }
    return true;
}

static void target_close(struct target *t)
{
    if (t->fd >= 0) {
        close(t->fd);
        t->fd = -1;
    }
}

/* fail_errno fails the call with the error errno e means for `op` on the caller's path. */
static void fail_errno(struct rpc_call *c, int e, const char *op, const char *path)
{
    struct cf_error err;
    if (ws_errno_error(e, op, path, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
    }
}

static enum cf_status file_too_large(struct cf_error *err, const char *shown, size_t max)
{
    return cf_error_setr(err, CF_TOOBIG, "FILE_TOO_LARGE",
                         "%s is over %zu bytes, the most this ReadFile returns", shown, max);
}

/* read_upto reads fd from its start in bounded steps that stop when the caller leaves, at most
 * max bytes: past that, with truncated NULL the file is too large (CF_TOOBIG), else what was
 * read is cut at max and *truncated set. The file may change meanwhile: what is returned is
 * what was read, never more than max. */
static enum cf_status read_upto(struct rpc_call *c, int fd, const char *shown, size_t max,
                                bool *truncated, uint8_t **out, size_t *len_out,
                                struct cf_error *err)
{
    size_t cap = 64 * 1024, got = 0;
    uint8_t *data = mem_alloc(cap);
    if (truncated) {
        *truncated = false;
    }
    for (;;) {
        if (got == cap) {
            cap = cap * 2 < max + 1 ? cap * 2 : max + 1;
            data = mem_realloc(data, cap);
        }
        size_t want = cap - got < (1 << 20) ? cap - got : (1 << 20);
        ssize_t r = read(fd, data + got, want);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            int e = errno;
            free(data);
            return ws_errno_error(e, "read", shown, err);
        }
        got += (size_t)r;
        if (got > max) {
            if (!truncated) {
                free(data);
                return file_too_large(err, shown, max);
            }
            *truncated = true;
            got = max;
            break;
        }
        if (r == 0) {
            break;
        }
        if (rpc_call_client_gone(c)) {
            free(data);
            return cf_error_set(err, CF_CANCELLED, "the caller went away");
        }
    }
    *out = data;
    *len_out = got;
    return CF_OK;
}

static void on_read_file(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ReadFileRequest *req = (const void *)msg;
    struct target t;
    struct cf_error err;
    Cflue__V1__ReadFileResponse resp = CFLUE__V1__READ_FILE_RESPONSE__INIT;
    if (req->max_bytes < 0 || req->max_bytes > SANDBOX_FILE_MAX) {
        rpc_call_fail(c, CF_INVALID, "max_bytes is 0 (64 MiB) to %d", SANDBOX_FILE_MAX);
        return;
    }
    size_t max = req->max_bytes ? (size_t)req->max_bytes : SANDBOX_FILE_MAX;
    if (!target_open(c, req->sandbox, req->path, OPEN_REGULAR, &t)) {
        return;
    }
    enum cf_status rc =
        t.st.st_size > (off_t)max
            ? file_too_large(&err, req->path, max)
            : read_upto(c, t.fd, req->path, max, NULL, &resp.data.data, &resp.data.len, &err);
    target_close(&t);
    if (rc != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    rpc_call_reply(c, &resp.base);
    free(resp.data.data);
}

static void on_write_file(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__WriteFileRequest *req = (const void *)msg;
    struct target t;
    struct cf_error err;
    if (!target_open(c, req->sandbox, req->path, OPEN_NONE, &t)) {
        return;
    }
    if (req->mode > 0777) {
        rpc_call_fail(c, CF_INVALID,
                      "mode must be read, write and execute bits (at most 0777): no set-user-ID, "
                      "set-group-ID or sticky bit");
        return;
    }
    uint64_t ticket = locks_ticket(t.sb->locks, t.rel);
    locks_wait(t.sb->locks, t.rel, ticket);
    enum cf_status rc =
        ws_write_file(t.sb, t.rel, req->data.data, req->data.len, req->mode, req->path, &err);
    locks_release(t.sb->locks, t.rel);
    if (rc != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__WriteFileResponse resp = CFLUE__V1__WRITE_FILE_RESPONSE__INIT;
    resp.bytes_written = (int64_t)req->data.len;
    rpc_call_reply(c, &resp.base);
}

/* A FileInfo with the storage its fields point into. */
struct file_info {
    Cflue__V1__FileInfo fi;
    Google__Protobuf__Timestamp mtime;
    struct buf shown; /* the name with its bytes that are not UTF-8 replaced, when it has any */
};

/* file_info_fill describes name's st in f. A name that is not UTF-8 (a command may make one)
 * is shown with U+FFFD for its bad bytes: a protobuf string must be UTF-8, and one bad name
 * would make the whole answer unreadable to most clients. file_infos_free releases f. */
static void file_info_fill(struct file_info *f, const char *name, const struct stat *st)
{
    Cflue__V1__FileInfo *fi = &f->fi;
    cflue__v1__file_info__init(fi);
    fi->name = (char *)name;
    if (!utf8_valid(name, strlen(name), NULL)) {
        buf_init(&f->shown, 4 * strlen(name) + 1);
        if (utf8_sanitize(&f->shown, name, strlen(name)) == CF_OK &&
            buf_append(&f->shown, "", 1) == CF_OK) {
            fi->name = f->shown.data;
        }
    }
    fi->type = S_ISLNK(st->st_mode)   ? CFLUE__V1__FILE_TYPE__FILE_TYPE_SYMLINK
               : S_ISREG(st->st_mode) ? CFLUE__V1__FILE_TYPE__FILE_TYPE_REGULAR
               : S_ISDIR(st->st_mode) ? CFLUE__V1__FILE_TYPE__FILE_TYPE_DIRECTORY
                                      : CFLUE__V1__FILE_TYPE__FILE_TYPE_OTHER;
    fi->size = st->st_size;
    google__protobuf__timestamp__init(&f->mtime);
    f->mtime.seconds = st->st_mtim.tv_sec;
    f->mtime.nanos = (int32_t)st->st_mtim.tv_nsec;
    fi->modify_time = &f->mtime;
    fi->mode = st->st_mode & 07777;
}

static void file_infos_free(struct file_info *infos, size_t n)
{
    for (size_t i = 0; i < n && infos; i++) {
        buf_cleanup(&infos[i].shown);
    }
    free(infos);
}

static void on_stat(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__PathRequest *req = (const void *)msg;
    struct target t;
    struct stat st;
    if (!target_open(c, req->sandbox, req->path, OPEN_NODE, &t)) {
        return;
    }
    int st_rc = fstat(t.fd, &st);
    int st_errno = errno;
    target_close(&t);
    if (st_rc != 0) {
        fail_errno(c, st_errno, "stat", req->path);
        return;
    }
    struct file_info f = {.shown.data = NULL};
    const char *base = strrchr(t.rel, '/');
    file_info_fill(&f, base ? base + 1 : t.rel, &st);
    rpc_call_reply(c, &f.fi.base);
    buf_cleanup(&f.shown);
}

/* ReadDir pages: page_size 0 means READ_DIR_PAGE_DEFAULT, more than READ_DIR_PAGE_MAX is
 * coerced down (AIP-158). A page of READ_DIR_PAGE_MAX entries of 255-byte names stays near
 * 3 MB, under any client's message limit. */
#define READ_DIR_PAGE_DEFAULT 1000
#define READ_DIR_PAGE_MAX 10000

static void on_read_dir(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ReadDirRequest *req = (const void *)msg;
    struct target t;
    struct cf_error err;
    char scope[sizeof(t.sb->name) + WS_PATH_MAX + 2], after[PAGE_TOKEN_POSITION_MAX + 1] = "";
    if (req->page_size < 0) {
        rpc_call_fail(c, CF_INVALID, "page_size must not be negative");
        return;
    }
    if (!target_open(c, req->sandbox, req->path, OPEN_DIR, &t)) {
        return;
    }
    /* the token belongs to this directory: the sandbox and the path as resolved in it */
    snprintf(scope, sizeof(scope), "%s\n%s", t.sb->name, t.rel);
    if (*req->page_token && page_token_parse(req->page_token, scope, after, &err) != CF_OK) {
        target_close(&t);
        rpc_call_fail_error(c, &err);
        return;
    }
    size_t limit = req->page_size == 0                  ? READ_DIR_PAGE_DEFAULT
                   : req->page_size > READ_DIR_PAGE_MAX ? READ_DIR_PAGE_MAX
                                                        : (size_t)req->page_size;
    struct dirpage page;
    if (dirpage_select(t.fd, after, limit, call_gone, c, &page, &err) != CF_OK) {
        target_close(&t);
        rpc_call_fail_error(c, &err);
        return;
    }
    struct file_info *infos = mem_alloc(sizeof(*infos) * (page.n + 1));
    Cflue__V1__FileInfo **entries = mem_alloc(sizeof(*entries) * (page.n + 1));
    Cflue__V1__ReadDirResponse resp = CFLUE__V1__READ_DIR_RESPONSE__INIT;
    for (size_t i = 0; i < page.n; i++) {
        struct stat st;
        /* an entry removed since the pass is left out; the page's end stays where it was */
        if (fstatat(t.fd, page.names[i], &st, AT_SYMLINK_NOFOLLOW) == 0) {
            file_info_fill(&infos[resp.n_entries], page.names[i], &st);
            entries[resp.n_entries] = &infos[resp.n_entries].fi;
            resp.n_entries++;
        }
    }
    target_close(&t);
    char next[PAGE_TOKEN_MAX] = "";
    if (page.more) {
        page_token_make(next, scope, page.names[page.n - 1]);
    }
    resp.entries = entries;
    resp.next_page_token = next;
    rpc_call_reply(c, &resp.base);
    free(entries);
    file_infos_free(infos, resp.n_entries);
    dirpage_cleanup(&page);
}

/* ---------- Glance: what a system prompt shows of a sandbox ---------- */

#define GLANCE_FILES_MAX 8
#define GLANCE_FILE_DEFAULT (64 << 10)

/* glance_file reads the first of req's files that the sandbox can read into resp; a file
 * that does not exist, is no regular file or may not be read is skipped (what ReadFile would
 * answer with an error that is an answer). */
static enum cf_status glance_file(struct rpc_call *c, struct sandbox *sb, const char *cwd,
                                  const Cflue__V1__GlanceRequest *req,
                                  Cflue__V1__GlanceResponse *resp, struct cf_error *err)
{
    size_t max = req->max_file_bytes ? (size_t)req->max_file_bytes : GLANCE_FILE_DEFAULT;
    for (size_t i = 0; i < req->n_files; i++) {
        char rel[WS_PATH_MAX];
        int fd = -1;
        struct stat st;
        enum cf_status rc = ws_relative_from(sb, cwd, req->files[i], rel, sizeof(rel), err);
        if (rc == CF_OK) {
            rc = ws_open_regular(sb, rel, req->files[i], &fd, &st, err);
        }
        if (rc == CF_OK) {
            bool truncated = false;
            rc = read_upto(c, fd, req->files[i], max, &truncated, &resp->file_data.data,
                           &resp->file_data.len, err);
            resp->file_truncated = truncated; /* protobuf_c_boolean is an int */
            close(fd);
            if (rc == CF_OK) {
                resp->file = req->files[i];
            }
            return rc;
        }
        if (rc != CF_NOT_FOUND && rc != CF_INVALID && rc != CF_PRECONDITION && rc != CF_RANGE) {
            return rc; /* the sandbox failing, not an answer about this file */
        }
    }
    return CF_OK;
}

#define GLANCE_SKILLS_MAX 256
#define GLANCE_SKILL_BYTES (64 << 10)

/* The skills a Glance found (freed once answered). */
struct glance_skills {
    Cflue__V1__GlanceSkill *items;
    Cflue__V1__GlanceSkill **ptrs;
    char **paths;
    size_t n;
};

static void glance_skills_cleanup(struct glance_skills *gs)
{
    for (size_t i = 0; i < gs->n; i++) {
        free(gs->items[i].data.data);
        free(gs->items[i].dir);
        free(gs->paths[i]);
    }
    free(gs->items);
    free(gs->ptrs);
    free(gs->paths);
    memset(gs, 0, sizeof(*gs));
}

/* glance_skills reads the SKILL.md of each subdirectory of req->skills_dir (the first
 * max_skills entries by name) into gs; a directory that is missing, or not one, or that cannot
 * be listed, holds none, and an entry without a readable SKILL.md is skipped. */
static enum cf_status glance_skills(struct rpc_call *c, struct sandbox *sb, const char *cwd,
                                    const Cflue__V1__GlanceRequest *req, struct glance_skills *gs,
                                    bool *more, struct cf_error *err)
{
    char rel[WS_PATH_MAX];
    int dirfd = -1;
    struct dirpage page = {0};
    enum cf_status rc = ws_relative_from(sb, cwd, req->skills_dir, rel, sizeof(rel), err);
    if (rc == CF_OK) {
        rc = ws_open(sb, rel, O_PATH | O_DIRECTORY, 0, req->skills_dir, &dirfd, err);
    }
    if (rc != CF_OK) {
        bool none = rc == CF_NOT_FOUND || rc == CF_INVALID || rc == CF_PRECONDITION;
        return none ? CF_OK : rc;
    }
    rc = dirpage_select(dirfd, "", (size_t)req->max_skills, call_gone, c, &page, err);
    close(dirfd);
    if (rc != CF_OK) {
        return rc == CF_INVALID ? CF_OK : rc; /* one its owner made unreadable holds none */
    }
    *more = page.more;
    gs->items = mem_alloc(sizeof(*gs->items) * (page.n + 1));
    gs->ptrs = mem_alloc(sizeof(*gs->ptrs) * (page.n + 1));
    gs->paths = mem_alloc(sizeof(*gs->paths) * (page.n + 1));
    for (size_t i = 0; i < page.n && rc == CF_OK; i++) {
        if (!utf8_valid(page.names[i], strlen(page.names[i]), NULL)) {
            continue; /* no skill's name (its directory's) is other than UTF-8 */
        }
        char *path = mem_asprintf("%s/%s/SKILL.md", req->skills_dir, page.names[i]);
        char prel[WS_PATH_MAX];
        int fd = -1;
        struct stat st;
        rc = ws_relative_from(sb, cwd, path, prel, sizeof(prel), err);
        if (rc == CF_OK) {
            rc = ws_open_regular(sb, prel, path, &fd, &st, err);
        }
        Cflue__V1__GlanceSkill *k = &gs->items[gs->n];
        cflue__v1__glance_skill__init(k);
        bool truncated = false;
        if (rc == CF_OK) {
            rc = read_upto(c, fd, path, GLANCE_SKILL_BYTES, &truncated, &k->data.data, &k->data.len,
                           err);
            close(fd);
        } else if (rc == CF_NOT_FOUND || rc == CF_INVALID || rc == CF_PRECONDITION ||
                   rc == CF_RANGE) {
            free(path); /* no SKILL.md there: not a skill */
            rc = CF_OK;
            continue;
        }
        if (rc != CF_OK) {
            free(path);
            break;
        }
        k->truncated = truncated;
        k->dir = mem_strdup(page.names[i]);
        k->path = path;
        gs->paths[gs->n] = path;
        gs->ptrs[gs->n] = k;
        gs->n++;
    }
    dirpage_cleanup(&page);
    return rc;
}

static void on_glance(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GlanceRequest *req = (const void *)msg;
    struct cf_error err;
    struct sandbox *sb;
    struct dirpage page = {0};
    Cflue__V1__GlanceResponse resp = CFLUE__V1__GLANCE_RESPONSE__INIT;
    struct glance_skills gs = {0};
    bool more_skills = false;
    if (req->n_files > GLANCE_FILES_MAX || req->max_file_bytes < 0 ||
        req->max_file_bytes > SANDBOX_FILE_MAX || req->max_entries < 0 ||
        req->max_entries > READ_DIR_PAGE_MAX || req->max_skills < 0 ||
        req->max_skills > GLANCE_SKILLS_MAX) {
        rpc_call_fail(c, CF_INVALID,
                      "a glance names at most %d files, max_file_bytes 0 to %d, max_entries "
                      "0 to %d and max_skills 0 to %d",
                      GLANCE_FILES_MAX, SANDBOX_FILE_MAX, READ_DIR_PAGE_MAX, GLANCE_SKILLS_MAX);
        return;
    }
    char here[WS_PATH_MAX], wd[PATH_MAX];
    if (workspaces_get(server_state.ws, req->sandbox, &sb, &err) != CF_OK ||
        open_cwd(sb, req->cwd, here, sizeof(here), wd, sizeof(wd), &err) != CF_OK ||
        glance_file(c, sb, here, req, &resp, &err) != CF_OK ||
        (*req->skills_dir && req->max_skills > 0 &&
         glance_skills(c, sb, here, req, &gs, &more_skills, &err) != CF_OK)) {
        free(resp.file_data.data);
        glance_skills_cleanup(&gs);
        rpc_call_fail_error(c, &err);
        return;
    }
    int dirfd = -1;
    struct file_info *infos = NULL;
    Cflue__V1__FileInfo **entries = NULL;
    enum cf_status listed = CF_OK;
    if (req->max_entries > 0 &&
        ((listed = ws_open(sb, here, O_PATH | O_DIRECTORY, 0, *req->cwd ? req->cwd : ".", &dirfd,
                           &err)) != CF_OK ||
         (listed = dirpage_select(dirfd, "", (size_t)req->max_entries, call_gone, c, &page,
                                  &err)) != CF_OK)) {
        /* a working directory its owner may not list (an unprivileged toold) is told as such:
         * the prompt says so rather than the sandbox failing every submission */
        bool unreadable =
            dirfd >= 0 && listed == CF_INVALID && !strcmp(err.reason, "PERMISSION_DENIED");
        if (dirfd >= 0) {
            close(dirfd);
            dirfd = -1;
        }
        if (!unreadable) {
            free(resp.file_data.data);
            glance_skills_cleanup(&gs);
            rpc_call_fail_error(c, &err);
            return;
        }
        resp.entries_unreadable = true;
    }
    infos = mem_alloc(sizeof(*infos) * (page.n + 1));
    entries = mem_alloc(sizeof(*entries) * (page.n + 1));
    for (size_t i = 0; i < page.n; i++) {
        struct stat st;
        /* an entry removed since the pass is left out */
        if (fstatat(dirfd, page.names[i], &st, AT_SYMLINK_NOFOLLOW) == 0) {
            file_info_fill(&infos[resp.n_entries], page.names[i], &st);
            entries[resp.n_entries] = &infos[resp.n_entries].fi;
            resp.n_entries++;
        }
    }
    if (dirfd >= 0) {
        close(dirfd);
    }
    resp.entries = entries;
    resp.more_entries = page.more;
    resp.working_directory = wd;
    resp.cwd_applied = *req->cwd != '\0';
    struct tool_specs ts = {.n = 0};
    if (req->list_tools) {
        tool_specs_fill(&ts);
        resp.tools = ts.ptrs;
        resp.n_tools = ts.n;
    }
    resp.skills = gs.ptrs;
    resp.n_skills = gs.n;
    resp.more_skills = more_skills;
    rpc_call_reply(c, &resp.base);
    tool_specs_cleanup(&ts);
    glance_skills_cleanup(&gs);
    free(entries);
    file_infos_free(infos, resp.n_entries);
    free(resp.file_data.data);
    /* not `if (req->max_entries > 0)`: the reply freed the call and req with it (a
     * heap-use-after-free under ASan); an unlisted page is still {0}, which cleans up to nothing */
    dirpage_cleanup(&page);
}

static void on_mkdir(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__MkdirRequest *req = (const void *)msg;
    struct target t;
    if (!target_open(c, req->sandbox, req->path, req->parents ? OPEN_PARENTS : OPEN_PARENT, &t)) {
        return;
    }
    int r = mkdirat(t.fd, t.base, 0755);
    int e = errno;
    target_close(&t);
    if (r != 0 && !(e == EEXIST && req->parents)) {
        fail_errno(c, e, "mkdir", req->path);
        return;
    }
    Cflue__V1__MkdirResponse resp = CFLUE__V1__MKDIR_RESPONSE__INIT;
    rpc_call_reply(c, &resp.base);
}

/* Directories remove_tree holds open at once (each a descriptor and a DIR buffer): a deeper
 * one is moved up into the directory being removed and taken apart from there. */
#define REMOVE_OPEN_MAX 64

/* remove_open opens name in parent as a directory to read, never following a link. */
static DIR *remove_open(int parent, const char *name)
{
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d && fd >= 0) {
        int e = errno;
        close(fd);
        errno = e;
    }
    return d;
}

/* remove_hoist moves the directory name in dirfd into the top directory under a new name,
 * so that what is below it is reached again from there: never a descriptor per level, and
 * never ".." (which would leave the tree if a command moved it meanwhile). */
static int remove_hoist(int dirfd, const char *name, int top, unsigned *serial)
{
    char tmp[64];
    for (int tries = 0; tries < 1000; tries++) {
        snprintf(tmp, sizeof(tmp), ".cflue-rm-%u", (*serial)++);
        if (renameat2(dirfd, name, top, tmp, RENAME_NOREPLACE) == 0) {
            return 0;
        }
        if (errno != EEXIST) {
            return -1;
        }
    }
    errno = EEXIST;
    return -1;
}

/* remove_tree removes name in parent and all below it, whatever its depth, holding at most
 * REMOVE_OPEN_MAX directories open and without recursion. -1 with errno on failure. */
static int remove_tree(int parent, const char *name)
{
    if (unlinkat(parent, name, 0) == 0) {
        return 0;
    }
    if (errno != EISDIR && errno != EPERM) {
        return -1;
    }
    DIR **dirs = mem_alloc(sizeof(*dirs) * REMOVE_OPEN_MAX);
    char(*names)[NAME_MAX + 1] = mem_alloc(sizeof(*names) * REMOVE_OPEN_MAX);
    int depth = 0, rc = -1, e = 0;
    unsigned serial = 0;
    bool hoisted = false; /* moved into the top since its last pass: read it again */
    snprintf(names[0], sizeof(names[0]), "%s", name);
    if (!(dirs[depth++] = remove_open(parent, name))) {
        e = errno;
        goto out;
    }
    while (depth > 0) {
        DIR *d = dirs[depth - 1];
        errno = 0;
        struct dirent *ent = readdir(d);
        if (!ent) {
            if (errno) {
                e = errno;
                goto out;
            }
            if (depth == 1 && hoisted) {
                hoisted = false;
                rewinddir(d);
                continue;
            }
            closedir(d);
            depth--;
            int up = depth ? dirfd(dirs[depth - 1]) : parent;
            if (unlinkat(up, names[depth], AT_REMOVEDIR) != 0) {
                e = errno;
                goto out;
            }
            continue;
        }
        if (!strcmp(ent->d_name, ".") || !strcmp(ent->d_name, "..")) {
            continue;
        }
        if (unlinkat(dirfd(d), ent->d_name, 0) == 0) {
            continue;
        }
        if (errno == ENOENT) {
            continue; /* gone meanwhile */
        }
        if (errno != EISDIR && errno != EPERM) {
            e = errno;
            goto out;
        }
        if (depth == REMOVE_OPEN_MAX) {
            if (remove_hoist(dirfd(d), ent->d_name, dirfd(dirs[0]), &serial) != 0) {
                e = errno;
                goto out;
            }
            hoisted = true;
            continue;
        }
        snprintf(names[depth], sizeof(names[depth]), "%s", ent->d_name);
        if (!(dirs[depth] = remove_open(dirfd(d), ent->d_name))) {
            e = errno;
            goto out;
        }
        depth++;
    }
    rc = 0;
out:
    while (depth > 0) {
        closedir(dirs[--depth]);
    }
    free(dirs);
    free(names);
    errno = e;
    return rc;
}

static void on_remove(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__RemoveRequest *req = (const void *)msg;
    struct target t;
    if (!target_open(c, req->sandbox, req->path, OPEN_PARENT, &t)) {
        return;
    }
    int r = unlinkat(t.fd, t.base, 0);
    if (r != 0 && (errno == EISDIR || errno == EPERM)) {
        r = req->recursive ? remove_tree(t.fd, t.base) : unlinkat(t.fd, t.base, AT_REMOVEDIR);
    }
    int e = errno;
    target_close(&t);
    if (r != 0) {
        fail_errno(c, e, "remove", req->path);
        return;
    }
    Cflue__V1__RemoveResponse resp = CFLUE__V1__REMOVE_RESPONSE__INIT;
    rpc_call_reply(c, &resp.base);
}

struct exec_out {
    struct buf out, err; /* share EXEC_OUTPUT_MAX between them */
    bool overflow;
    struct rpc_call *call;
};

/* exec_gone: Exec's caller went away (its deadline passed, or it cancelled): the command is
 * stopped rather than left to run to its own timeout, holding a call's place. */
static bool exec_gone(void *arg)
{
    const struct exec_out *o = arg;
    return call_gone(o->call);
}

static bool exec_collect_to(struct exec_out *o, struct buf *b, const char *p, size_t n)
{
    if (o->out.len + o->err.len + n > EXEC_OUTPUT_MAX || buf_append(b, p, n) != CF_OK) {
        o->overflow = true;
        return false;
    }
    return true;
}

static bool exec_collect(void *arg, const char *p, size_t n)
{
    struct exec_out *o = arg;
    return exec_collect_to(o, &o->out, p, n);
}

static bool exec_collect_err(void *arg, const char *p, size_t n)
{
    struct exec_out *o = arg;
    return exec_collect_to(o, &o->err, p, n);
}

static void on_exec(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ExecRequest *req = (const void *)msg;
    char cwd[PATH_MAX + WS_PATH_MAX];
    struct target t;
    struct cf_error err;
    if (!*req->command) {
        rpc_call_fail(c, CF_INVALID, "command is required");
        return;
    }
    if (pbdur_check(req->timeout, "timeout", 0, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    if (!target_open(c, req->sandbox, *req->cwd ? req->cwd : ".", OPEN_DIR, &t)) {
        return;
    }
    target_close(&t);
    struct proc_limits limits;
    if (command_limits(t.sb, req->limits, &limits, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    ws_host_path(t.sb, t.rel, cwd, sizeof(cwd));
    const char **env = mem_alloc(sizeof(char *) * (req->n_env + 1));
    for (size_t i = 0; i < req->n_env; i++) {
        env[i] = mem_asprintf("%s=%s", req->env[i]->key, req->env[i]->value);
    }
    struct exec_out o = {.overflow = false, .call = c};
    buf_init(&o.out, EXEC_OUTPUT_MAX);
    buf_init(&o.err, EXEC_OUTPUT_MAX);
    int64_t timeout = req->timeout ? dur_ms(req->timeout) : 0;
    if (timeout == 0) {
        timeout = server_state.cfg->bash_default_timeout_ms;
    }
    struct proc_spec spec = {.timeout_ms = timeout,
                             .stdin_data = req->stdin.len ? req->stdin.data : NULL,
                             .stdin_len = req->stdin.len,
                             .on_output = exec_collect,
                             .on_stderr = exec_collect_err,
                             .cancelled = exec_gone,
                             .ctx = &o};
    struct proc_result pr;
    enum cf_status rc = driver_run(t.sb, &limits, cwd, req->command, (const char *const *)env,
                                   req->n_env, &spec, &pr, &err);
    for (size_t i = 0; i < req->n_env; i++) {
        free((char *)env[i]);
    }
    free(env);
    if (rc != CF_OK) {
        buf_cleanup(&o.out);
        buf_cleanup(&o.err);
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__ExecResponse resp = CFLUE__V1__EXEC_RESPONSE__INIT;
    resp.stdout.data = (uint8_t *)o.out.data;
    resp.stdout.len = o.out.len;
    resp.exit_code = pr.exit_code;
    resp.timed_out = pr.timed_out;
    resp.limit = (char *)proc_limit_name(pr.limit);
    if (pr.limit) {
        metrics_add(stats.limits, METRICS_LABELS(resp.limit), 1);
    }
    if (o.overflow) {
        buf_reset(&o.err);
        buf_append_str(&o.err, "[output exceeded 8 MiB in all; the command was stopped]");
    }
    resp.stderr.data = (uint8_t *)o.err.data;
    resp.stderr.len = o.err.len;
    rpc_call_reply(c, &resp.base);
    buf_cleanup(&o.out);
    buf_cleanup(&o.err);
}

void toold_register(struct rpc_server *srv, struct workspaces *ws, const struct toold_config *cfg)
{
    server_state.ws = ws;
    server_state.cfg = cfg;
    stats.calls = metrics_counter("cflue_toold_tool_calls_total",
                                  "Tool calls run, by tool and whether the result is an error.",
                                  "tool,error");
    stats.seconds = metrics_histogram("cflue_toold_tool_call_seconds", "Tool calls' run time.",
                                      "tool", metrics_latency_buckets, metrics_latency_buckets_n);
    stats.truncated = metrics_counter("cflue_toold_tool_truncations_total",
                                      "Tool results cut to the page limits, by tool.", "tool");
    stats.limits =
        metrics_counter("cflue_toold_limit_stops_total",
                        "Commands stopped by one of their limits, by the limit.", "limit");
    /* commands (Execute, ExecuteBatch, Exec) may run for minutes: a thread each */
    static const struct rpc_method_def methods[] = {
        {"/cflue.v1.Tools/List", &cflue__v1__list_tools_request__descriptor, on_list, RPC_POOL},
        {"/cflue.v1.Tools/Execute", &cflue__v1__tool_call__descriptor, on_execute, RPC_THREAD},
        {"/cflue.v1.Tools/ExecuteBatch", &cflue__v1__tool_batch__descriptor, on_execute_batch,
         RPC_THREAD},
        {"/cflue.v1.Sandbox/ReadFile", &cflue__v1__read_file_request__descriptor, on_read_file,
         RPC_POOL},
        {"/cflue.v1.Sandbox/WriteFile", &cflue__v1__write_file_request__descriptor, on_write_file,
         RPC_POOL},
        {"/cflue.v1.Sandbox/Stat", &cflue__v1__path_request__descriptor, on_stat, RPC_POOL},
        {"/cflue.v1.Sandbox/ReadDir", &cflue__v1__read_dir_request__descriptor, on_read_dir,
         RPC_POOL},
        {"/cflue.v1.Sandbox/Mkdir", &cflue__v1__mkdir_request__descriptor, on_mkdir, RPC_POOL},
        {"/cflue.v1.Sandbox/Remove", &cflue__v1__remove_request__descriptor, on_remove, RPC_POOL},
        {"/cflue.v1.Sandbox/Exec", &cflue__v1__exec_request__descriptor, on_exec, RPC_THREAD},
        {"/cflue.v1.Sandbox/Glance", &cflue__v1__glance_request__descriptor, on_glance, RPC_POOL},
    };
    rpc_server_add_methods(srv, methods, sizeof(methods) / sizeof(methods[0]), NULL);
    rpc_server_lenient_strings(srv, "/cflue.v1.Tools/Execute");
}
