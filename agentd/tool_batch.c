/* tool_batch.c - the tools a drive runs on servers: the tool set (Tools.List) and one model
 * turn's calls, run as one Tools.ExecuteBatch per server (the sandbox's toold, the agent's own
 * tool servers), each result recorded as it arrives.
 *
 * The calls hold no thread: each server's batch is an event-driven client stream
 * (rpc_astream), a lane, whose results and end post the drive, parked in DRIVE_TOOLS_WAIT
 * meanwhile; the engine thread stepping it records each result (written behind: one Append in
 * flight at a time, never waited for here; the next turn waits until every result is stored)
 * and then asks for the next. An abort, a lost lease or shutdown posts the drive, which
 * cancels the streams (toold kills the commands) and waits for their ends. A tool server
 * without ExecuteBatch (UNIMPLEMENTED, which the protocol allows) gets one Execute per call,
 * each its own lane; the server is remembered as such for the process's life.
 *
 * toold itself failing (unreachable, overloaded, a batch broken off) is a fault: the drive
 * ends interrupted, and the calls left without a result get the outcome-unknown result when
 * the work resumes (settle.c). toold refusing a batch as a bad request is an answer: the model
 * hears why each call did not run. The agent's own tool servers are not the sandbox: one that
 * fails gives its calls error results and the model a signal (servers_tell_gone), and the
 * work goes on.
 */
#include "clients.h"
#include "drive.h"
#include "engine.h"
#include "failpoint.h"
#include "image.h"
#include "log.h"
#include "mem.h"
#include "pbtime.h"
#include "proto_limits.h"
#include "stats.h"
#include "utf8.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOOLS_TIMEOUT_MS 10000 /* Tools.List */

#define CUSTOM_CALL_MS 600000 /* an own tool server's call with no time limit: 10 min */
/* An own tool server's result text shown to the model, at most (as an MCP server's): the
 * server is not trusted to bound it, and a record holds 8 MiB at most (a longer text failed
 * the submission). toold's results are bounded by the tools' contract. */
#define SERVER_TEXT_MAX MCP_TEXT_MAX

/* The channels to tool servers and which servers have no ExecuteBatch, for the process's life
 * (an agent's servers are a handful; reloads reuse them). */
static struct {
    pthread_mutex_t mu;
    struct {
        char *addr;
        struct rpc_channel *ch;
        bool no_batch;
    } at[TOOLS_CHANNELS_MAX];
    int n;
} g_channels = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* channel_slot: the slot of addr, made when new (-1 past the limit); under g_channels.mu. */
static int channel_slot(const char *addr)
{
    for (int i = 0; i < g_channels.n; i++) {
        if (!strcmp(g_channels.at[i].addr, addr)) {
            return i;
        }
    }
    if (g_channels.n == TOOLS_CHANNELS_MAX) {
        return -1;
    }
    int i = g_channels.n++;
    g_channels.at[i].addr = mem_strdup(addr);
    g_channels.at[i].ch = rpc_channel_new(addr, 64 << 20);
    g_channels.at[i].no_batch = false;
    return i;
}

struct rpc_channel *tools_channel_at(const char *addr)
{
    if (!strncmp(addr, "dns:", 4)) {
        return NULL; /* replicas behind a name with none known yet (placement.h) */
    }
    pthread_mutex_lock(&g_channels.mu);
    int i = channel_slot(addr);
    struct rpc_channel *ch = i < 0 ? NULL : g_channels.at[i].ch;
    pthread_mutex_unlock(&g_channels.mu);
    return ch;
}

/* no_batch: the server at addr answered ExecuteBatch with UNIMPLEMENTED before; with set, it
 * is remembered so. */
static bool no_batch(const char *addr, bool set)
{
    pthread_mutex_lock(&g_channels.mu);
    int i = channel_slot(addr);
    if (i >= 0 && set) {
        g_channels.at[i].no_batch = true;
    }
    bool none = i >= 0 && g_channels.at[i].no_batch;
    pthread_mutex_unlock(&g_channels.mu);
    return none;
}

struct rpc_channel *tools_channel(struct drive *d)
{
    return d->tools_addr ? tools_channel_at(d->tools_addr) : NULL;
}

/* FAILED_PRECONDITION is an answer (the sandbox's state does not allow the call: not a
 * directory, say); ABORTED from toold (no fence is involved) is a conflict that trying again
 * later may clear, so it is a failure, recorded as CF_UNAVAILABLE rather than as a lost lease. */
bool tools_server_down(const struct rpc_status *st)
{
    switch (st->code) {
    case GRPC_STATUS_OK:
    case GRPC_STATUS_NOT_FOUND:
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_FAILED_PRECONDITION:
    case GRPC_STATUS_PERMISSION_DENIED:
    case GRPC_STATUS_OUT_OF_RANGE:
    case GRPC_STATUS_ALREADY_EXISTS:
        return false;
    default:
        return true;
    }
}

bool tools_failed(struct drive *d, const char *what, const struct rpc_status *st)
{
    if (!tools_server_down(st)) {
        return false;
    }
    struct cf_error e;
    enum cf_status code =
        st->code == GRPC_STATUS_ABORTED ? CF_UNAVAILABLE : status_from_grpc(st->code);
    cf_error_set(&e, code, "toold at %s: %s (grpc status %d, reason %s)", d->tools_addr,
                 st->details[0] ? st->details : "call failed", (int)st->code,
                 st->reason[0] ? st->reason : "none");
    drive_fault(d, what, &e);
    return true;
}

bool tools_scope_refused(struct drive *d, bool applied)
{
    if (!d->cwd[0] || applied) {
        return false;
    }
    struct cf_error e;
    cf_error_set(&e, CF_INVALID, /* fails the submission: no retry mends it */
                 "the sandbox server at %s cannot scope a subagent to the directory %.1024s "
                 "(it does not apply a request's cwd)",
                 d->tools_addr, d->cwd);
    drive_fault(d, "looking at the sandbox failed", &e);
    return true;
}

void tools_no_channel(struct drive *d)
{
    if (d->tools_addr) {
        struct cf_error e;
        if (!strncmp(d->tools_addr, "dns:", 4)) {
            cf_error_set(&e, CF_UNAVAILABLE,
                         "no toold replica is known behind %s: its DNS lookup found none yet",
                         d->tools_addr);
        } else {
            cf_error_set(&e, CF_BUSY,
                         "no channel to toold at %s: this agentd reaches at most %d tool servers",
                         d->tools_addr, TOOLS_CHANNELS_MAX);
        }
        drive_fault(d, "listing the sandbox's tools failed", &e);
    }
}

void tools_adopt(struct drive *d, ProtobufCMessage *owner, Cflue__V1__ToolSpec **specs, size_t n,
                 const char *working_directory)
{
    struct toolset *ts = &d->tools;
    tools_cleanup(d);
    ts->owner = owner;
    ts->working_directory = working_directory;
    for (size_t i = 0; i < n; i++) {
        toolset_add(ts, specs[i]->name, specs[i]->description, specs[i]->parameters_json,
                    d->tools_addr);
    }
}

void toolset_add(struct toolset *ts, const char *name, const char *description,
                 const char *schema_json, const char *source)
{
    ts->tools = mem_realloc(ts->tools, sizeof(*ts->tools) * (ts->n + 1));
    ts->source = mem_realloc(ts->source, sizeof(*ts->source) * (ts->n + 1));
    struct llm_tool *t = &ts->tools[ts->n];
    t->name = name;
    t->description = description;
    t->schema_json = schema_json;
    t->schema_text = llm_schema_text(schema_json); /* once, not per turn */
    ts->source[ts->n++] = source;
}

int toolset_find(const struct toolset *ts, const char *name)
{
    for (size_t i = 0; i < ts->n; i++) {
        if (!strcmp(ts->tools[i].name, name)) {
            return (int)i;
        }
    }
    return -1;
}

void tools_load(struct drive *d)
{
    struct rpc_channel *ch = tools_channel(d);
    if (!ch) {
        tools_no_channel(d);
        return;
    }
    Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    rq.sandbox = d->workspace;
    rq.cwd = d->cwd;
    if (rpc_unary(ch, "/cflue.v1.Tools/List", &rq.base, &cflue__v1__list_tools_response__descriptor,
                  TOOLS_TIMEOUT_MS, &resp, &st)) {
        const Cflue__V1__ListToolsResponse *list = (const void *)resp;
        if (tools_scope_refused(d, list->cwd_applied)) {
            protobuf_c_message_free_unpacked(resp, NULL);
            return;
        }
        tools_adopt(d, resp, list->tools, list->n_tools, list->working_directory);
    } else if (!tools_failed(d, "listing the sandbox's tools failed", &st)) {
        /* toold answered but refused: that is no tool set either */
        struct cf_error e;
        cf_error_set(&e, status_from_grpc(st.code), "toold at %s refused Tools.List: %s",
                     d->tools_addr, st.details);
        drive_fault(d, "listing the sandbox's tools failed", &e);
    }
}

void tools_cleanup(struct drive *d)
{
    if (d->tools.owner) {
        protobuf_c_message_free_unpacked(d->tools.owner, NULL);
    }
    for (size_t i = 0; d->tools.tools && i < d->tools.n; i++) {
        free(d->tools.tools[i].schema_text);
    }
    free(d->tools.tools);
    free(d->tools.source);
    memset(&d->tools, 0, sizeof(d->tools));
}

/* metric_label is the tool label a result is counted under: its name when the drive offers
 * that tool (or it is one of the sandbox's, whose results a recovery records before the tools
 * are listed), else "unknown". A name the model made up must not become a series: the
 * family's label sets are capped, and a few hundred made-up names would leave real tools
 * uncounted until agentd restarts. */
static const char *metric_label(const struct drive *d, const char *name)
{
    static const char *const sandbox[] = {"read", "write", "edit", "bash", "grep", "glob"};
    if (toolset_find(&d->tools, name) >= 0) {
        return name;
    }
    for (size_t i = 0; i < sizeof(sandbox) / sizeof(sandbox[0]); i++) {
        if (!strcmp(name, sandbox[i])) {
            return name;
        }
    }
    return "unknown";
}

/* record writes one tool result as a pending record: tools_record_result and
 * tools_record_images. */
static void record(struct drive *d, int index, const char *call_id, const char *name,
                   const char *text, bool is_error, const Cflue__V1__Truncation *t,
                   bool outcome_unknown, Cflue__V1__Attachment *const *images, size_t n_images)
{
    char id[512];
    struct buf clean, noted;
    Cflue__V1__ToolCallResult body = CFLUE__V1__TOOL_CALL_RESULT__INIT;
    Cflue__V1__Attachment *kept[IMAGE_RESULT_MAX];
    size_t bytes = 0;
    context_tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, call_id);
    stats_tool_result(metric_label(d, name), is_error, t && t->truncated);
    body.turn = d->turn;
    body.index = index;
    body.tool_call_id = (char *)call_id;
    body.name = (char *)name;
    body.text = (char *)dstore_utf8(text, &clean); /* a server's text cut mid-character */
    buf_init(&noted, strlen(body.text) + n_images * 320 + 1);
    for (size_t i = 0; i < n_images; i++) {
        const Cflue__V1__Attachment *a = images[i];
        size_t name_len = strlen(a->name);
        const char *why = image_refusal(a->mime_type, a->data.len, body.n_images, bytes);
        if (!why && (name_len > IMAGE_NAME_MAX || !utf8_valid(a->name, name_len, NULL))) {
            why = "its name is not UTF-8 of at most 255 bytes";
        }
        if (why) {
            if (!noted.len) {
                buf_append_str(&noted, body.text);
            }
            buf_printf(&noted, "\n[image %zu (%.64s, %zu bytes) is not shown: %s]", i + 1,
                       a->mime_type, a->data.len, why);
            continue;
        }
        kept[body.n_images++] = (Cflue__V1__Attachment *)a; /* packed, never changed */
        bytes += a->data.len;
    }
    if (noted.len) {
        body.text = (char *)buf_cstr(&noted);
    }
    body.images = body.n_images ? kept : NULL;
    body.is_error = is_error;
    body.truncation = t && t->truncated ? (Cflue__V1__Truncation *)t : NULL;
    body.outcome_unknown = outcome_unknown;
    (void)dstore_defer_one(d, id, d->sub->submission_id, &body.base);
    buf_cleanup(&noted);
    buf_cleanup(&clean);
}

void tools_record_result(struct drive *d, int index, const char *call_id, const char *name,
                         const char *text, bool is_error, const Cflue__V1__Truncation *t,
                         bool outcome_unknown)
{
    record(d, index, call_id, name, text, is_error, t, outcome_unknown, NULL, 0);
}

void tools_record_images(struct drive *d, int index, const char *call_id, const char *name,
                         const char *text, bool is_error, const Cflue__V1__Truncation *t,
                         Cflue__V1__Attachment *const *images, size_t n_images)
{
    record(d, index, call_id, name, text, is_error, t, false, images, n_images);
}

/* ---------- lanes: one stream of calls per server ---------- */

/* own_server: addr is one of the agent's own tool servers, not the sandbox's toold. */
static bool own_server(const struct drive *d, const char *addr)
{
    return !d->tools_addr || strcmp(addr, d->tools_addr) != 0;
}

/* lane_new makes an empty lane, room for cap calls, for the server at addr. */
static struct tool_lane *lane_new(struct drive *d, const char *addr, size_t cap, bool single)
{
    struct tool_lane *l = mem_alloc(sizeof(*l));
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
    l->d = d;
    l->server = addr;
    l->single = single;
    l->calls = mem_alloc(sizeof(*l->calls) * (cap + 1));
    l->ptrs = mem_alloc(sizeof(void *) * (cap + 1));
    l->limits = mem_alloc(sizeof(*l->limits) * (cap + 1));
    l->index = mem_alloc(sizeof(int) * (cap + 1));
    l->done = mem_alloc(sizeof(bool) * (cap + 1));
    memset(l->done, 0, sizeof(bool) * (cap + 1));
    struct tool_wait *w = &d->tw;
    w->lanes = mem_realloc(w->lanes, sizeof(*w->lanes) * (w->n + 1));
    w->lanes[w->n++] = l;
    return l;
}

/* lane_free frees a lane whose stream is over or never started. */
static void lane_free(struct tool_lane *l)
{
    if (l->result) {
        protobuf_c_message_free_unpacked(l->result, NULL);
    }
    mcp_op_free(l->op);
    free(l->calls);
    free(l->ptrs);
    free(l->limits);
    free(l->index);
    free(l->done);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

static void lanes_free(struct tool_wait *w)
{
    for (size_t i = 0; i < w->n; i++) {
        lane_free(w->lanes[i]);
    }
    free(w->lanes);
    w->lanes = NULL;
    w->n = 0;
}

/* lane_add puts call c, index `index` of the answer, in l. Its timeout is what is left of the
 * submission's time (at least 1 ms; unset means no limit), set again when the lane opens. */
static void lane_add(struct tool_lane *l, const Cflue__V1__ToolCall *c, int index)
{
    int64_t left = drive_time_left(l->d);
    Cflue__V1__ToolCall *tc = &l->calls[l->m];
    cflue__v1__tool_call__init(tc);
    tc->sandbox = c->sandbox;
    tc->call_id = c->call_id;
    tc->name = c->name;
    tc->arguments_json = c->arguments_json;
    tc->cwd = c->cwd;
    tc->limits = c->limits;
    if (left != INT64_MAX) {
        google__protobuf__duration__init(&l->limits[l->m]);
        pbdur_set(&l->limits[l->m], left > 1 ? left : 1);
        tc->timeout = &l->limits[l->m];
    }
    l->ptrs[l->m] = tc;
    l->index[l->m] = index;
    l->m++;
}

/* lane_for: the batch lane of this turn for the server at addr, made when new or when the last
 * one holds PROTO_BATCH_CALLS_MAX calls (the next batch opens when that one is over, so same-path
 * calls keep the answer's order); an own tool server known to have no ExecuteBatch gets a new
 * single-call lane each time. */
static struct tool_lane *lane_for(struct drive *d, const char *addr, size_t cap)
{
    const struct agent_mcp *m = servers_mcp(d, addr);
    if (m) {
        struct tool_lane *l = lane_new(d, addr, 1, true); /* one tools/call per call */
        l->mcp = m;
        return l;
    }
    bool single = own_server(d, addr) && no_batch(addr, false);
    struct tool_lane *last = NULL;
    for (size_t i = 0; i < d->tw.n && !single; i++) {
        if (!d->tw.lanes[i]->single && !strcmp(d->tw.lanes[i]->server, addr)) {
            last = d->tw.lanes[i];
        }
    }
    if (last && last->m < PROTO_BATCH_CALLS_MAX) {
        return last;
    }
    size_t room = cap < PROTO_BATCH_CALLS_MAX ? cap : PROTO_BATCH_CALLS_MAX;
    struct tool_lane *l = lane_new(d, addr, single ? 1 : room, single);
    l->after = last;
    return l;
}

/* prepare sorts the answer's calls into lanes, one per server; a call naming no tool of the
 * set gets an error result at once. */
static void prepare(struct drive *d, const struct llm_response *resp)
{
    for (size_t i = 0; i < resp->n_calls && d->fault.code == CF_OK; i++) {
        const struct llm_call *c = &resp->calls[i];
        char id[600];
        context_tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, c->id);
        if (task_is_framework(c->name) || rlog_find(&d->log, id)) {
            continue; /* run by agentd (task.c), or run before (a resumed turn) */
        }
        int k = toolset_find(&d->tools, c->name);
        if (k < 0 || !d->tools.source[k]) {
            char text[512];
            snprintf(text, sizeof(text), "There is no tool named '%s' here.%s", c->name,
                     d->tools.n ? " Use one of the tools listed in your instructions." : "");
            tools_record_result(d, (int)i, c->id, c->name, text, true, NULL, false);
            continue;
        }
        Cflue__V1__ToolCall tc = CFLUE__V1__TOOL_CALL__INIT;
        tc.sandbox = d->workspace;
        bool sandbox_tool = d->tools.source[k] == d->tools_addr; /* the sandbox's own tools */
        tc.cwd = sandbox_tool ? d->cwd : "";
        tc.limits = sandbox_tool ? d->limits : NULL;
        tc.call_id = c->id;
        tc.name = c->name;
        tc.arguments_json = c->arguments_json;
        lane_add(lane_for(d, d->tools.source[k], resp->n_calls), &tc, (int)i);
    }
}

/* on_result (rpc's stream thread) hands one result to the drive and posts it; the next is
 * asked for once the drive recorded this one. */
static void on_result(void *arg, ProtobufCMessage *msg)
{
    struct tool_lane *l = arg;
    pthread_mutex_lock(&l->mu);
    l->result = msg;
    pthread_mutex_unlock(&l->mu);
    engine_post(l->d);
}

static void on_lane_end(void *arg, const struct rpc_status *st)
{
    struct tool_lane *l = arg;
    pthread_mutex_lock(&l->mu);
    l->ended = true;
    l->st = *st;
    /* posted under the lock: once an engine thread sees `ended` the lane may be freed (and
     * the drive with it), so nothing here may touch l after the unlock */
    engine_post_unlock(l->d, &l->mu);
}

static const struct rpc_astream_ops lane_ops = {.on_message = on_result, .on_end = on_lane_end};

/* lane_open starts l's stream. Each call carries the submission's time left (toold stops its
 * commands there); the stream ends ENGINE_COMMANDS_GONE_MS after it for the sandbox (no
 * deadline without a limit: toold's own bound the calls), a second after it for an own
 * server, or after CUSTOM_CALL_MS without a limit. */
static void lane_open(struct tool_lane *l)
{
    struct drive *d = l->d;
    l->opened = true;
    int64_t left = drive_time_left(d);
    for (size_t k = 0; k < l->m && left != INT64_MAX; k++) {
        /* what is left now: a lane opened after another (a batch past PROTO_BATCH_CALLS_MAX)
         * has less than when its calls were put in */
        pbdur_set(&l->limits[k], left > 1 ? left : 1);
    }
    struct rpc_channel *ch = l->mcp ? NULL : tools_channel_at(l->server);
    if (!ch && !l->mcp) {
        l->ended = l->released = true; /* no stream: the lane ends at once */
        l->st.code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(l->st.details, sizeof(l->st.details),
                 "this agentd reaches at most %d tool servers", TOOLS_CHANNELS_MAX);
        return;
    }
    int64_t deadline = 0;
    if (own_server(d, l->server)) {
        /* a lane opened after another that took the time (a batch past PROTO_BATCH_CALLS_MAX)
         * has none left: it gets the second, not a deadline of 0, which is none at all */
        deadline = left == INT64_MAX ? CUSTOM_CALL_MS : (left > 0 ? left : 0) + 1000;
    } else if (left != INT64_MAX) {
        /* toold stops each command at the time left; a toold that is slow or hung, yet
         * answers pings, must not hold the drive past its limit */
        deadline = (left > 0 ? left : 0) + ENGINE_COMMANDS_GONE_MS;
    }
    if (l->mcp) {
        const char *tool = l->calls[0].name + strlen("mcp__") + strlen(l->mcp->name) + 2;
        l->op = mcp_call_start(l->mcp, tool, l->calls[0].arguments_json, deadline, dcall_post, d);
        return;
    }
    if (l->single) {
        l->stream = rpc_astream_open(ch, "/cflue.v1.Tools/Execute", &l->calls[0].base,
                                     &cflue__v1__tool_result__descriptor, deadline, &lane_ops, l);
        return;
    }
    Cflue__V1__ToolBatch batch = CFLUE__V1__TOOL_BATCH__INIT;
    batch.calls = l->ptrs;
    batch.n_calls = l->m;
    l->stream = rpc_astream_open(ch, "/cflue.v1.Tools/ExecuteBatch", &batch.base,
                                 &cflue__v1__batch_result__descriptor, deadline, &lane_ops, l);
}

bool tools_start(struct drive *d, const struct llm_response *resp)
{
    struct tool_wait *w = &d->tw;
    prepare(d, resp);
    if (!w->n || d->fault.code != CF_OK) {
        lanes_free(w);
        return false;
    }
    w->running = true;
    for (size_t i = 0; i < w->n; i++) {
        if (!w->lanes[i]->after) {
            lane_open(w->lanes[i]);
        }
    }
    return true;
}

/* lane_record takes one message off l's stream and records its result (unless the drive
 * cannot write). */
static void lane_record(struct drive *d, struct tool_lane *l, ProtobufCMessage *msg)
{
    const Cflue__V1__BatchResult *br = (const void *)msg;
    int at = l->single ? 0 : br->index;
    const Cflue__V1__ToolResult *r = l->single ? (const void *)msg : br->result;
    if (at >= 0 && (size_t)at < l->m && r && !l->done[at]) {
        l->done[at] = true;
        const Cflue__V1__ToolCall *c = &l->calls[at];
        failpoint_hit("agentd.tools.before_record");
        if (d->fault.code == CF_OK && !drive_lost_or_down(d)) {
            struct buf cut = {0};
            const char *text = r->text;
            const Cflue__V1__Truncation *trunc = r->truncation;
            size_t len = strlen(text);
            if (own_server(d, l->server) && len > SERVER_TEXT_MAX) {
                trunc = NULL; /* the server's said where its own text stopped, not this one */
                size_t keep = utf8_prefix_len(text, len, SERVER_TEXT_MAX);
                buf_init(&cut, keep + 128);
                buf_append(&cut, text, keep);
                buf_printf(&cut, "\n[cut: the result has %zu bytes; only the first %zu are shown]",
                           len, keep);
                text = buf_cstr(&cut);
            }
            tools_record_images(d, l->index[at], c->call_id, c->name, text, r->is_error, trunc,
                                r->images, r->n_images);
            buf_cleanup(&cut);
        }
    }
    protobuf_c_message_free_unpacked(msg, NULL);
}

/* split runs each call of l, an own server's batch that the server does not implement, as
 * its own Execute lane (and remembers the server as one without ExecuteBatch). */
static void split(struct drive *d, struct tool_lane *l)
{
    (void)no_batch(l->server, true);
    char q[300];
    log_info("tool_server_no_batch", "server=%s note=%s", log_quote(q, sizeof(q), l->server),
             "\"no ExecuteBatch: one Execute per call\"");
    for (size_t k = 0; k < l->m; k++) {
        struct tool_lane *one = lane_new(d, l->server, 1, true);
        lane_add(one, &l->calls[k], l->index[k]);
        lane_open(one);
        l->done[k] = true; /* its result comes through the new lane */
    }
}

/* finish_lane handles a lane that ended short of results: toold failing is a fault; an own
 * server failing gives the calls left an error result and the model a signal; a server
 * refusing the calls (a bad request) gives each an error result. */
static void finish_lane(struct drive *d, struct tool_lane *l, struct rpc_status *st)
{
    size_t missing = 0;
    for (size_t k = 0; k < l->m; k++) {
        missing += !l->done[k];
    }
    if (missing && !drive_halted(d) && st->code == GRPC_STATUS_OK) {
        /* a stream that ended OK short of results is the server failing too */
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->details, sizeof(st->details), "the stream ended with results missing");
    }
    bool own = own_server(d, l->server);
    if (missing && !own && st->code == GRPC_STATUS_DEADLINE_EXCEEDED && !drive_halted(d) &&
        drive_time_left(d) <= 0) {
        /* the stream's deadline is the time limit's (lane_open): the submission fails for its
         * time, not as a toold that failed (another attempt, only to fail so) */
        for (size_t k = 0; k < l->m && d->fault.code == CF_OK; k++) {
            if (!l->done[k]) {
                tools_record_result(d, l->index[k], l->calls[k].call_id, l->calls[k].name,
                                    "The submission reached its time limit before this call "
                                    "answered; whether it took effect is unknown.",
                                    true, NULL, true);
            }
        }
        return;
    }
    if (!missing || drive_halted(d) || (!own && tools_failed(d, "the tool batch failed", st))) {
        return;
    }
    if (own && st->code == GRPC_STATUS_UNIMPLEMENTED && !l->single && missing == l->m) {
        split(d, l);
        return;
    }
    bool down = own && tools_server_down(st);
    if (down) {
        servers_tell_gone(d, l->server, st->details[0] ? st->details : "no answer");
    }
    for (size_t k = 0; k < l->m && d->fault.code == CF_OK; k++) {
        if (!l->done[k]) {
            char text[CF_ERROR_MSG_MAX + 512];
            if (down) {
                snprintf(text, sizeof(text),
                         "The tool server at %s failed before answering this call (%.300s); it "
                         "may not have run.",
                         l->server, st->details);
            } else {
                snprintf(text, sizeof(text),
                         "The tool server refused this call (%.300s); it did not run.",
                         st->details);
            }
            tools_record_result(d, l->index[k], l->calls[k].call_id, l->calls[k].name, text, true,
                                NULL, false);
        }
    }
}

/* mcp_lane_poll takes the end of l's tools/call: false while it is in flight. A server that
 * could not be used gives the call an error result and the model a signal. */
static bool mcp_lane_poll(struct drive *d, struct tool_lane *l)
{
    if (!mcp_op_done(l->op)) {
        if (drive_halted(d) && !l->released) {
            l->released = true;
            mcp_op_cancel(l->op); /* its end posts the drive */
        }
        return false;
    }
    l->over = true;
    const Cflue__V1__ToolCall *c = &l->calls[0];
    const char *why = mcp_op_failure(l->op);
    if (drive_halted(d) || d->fault.code != CF_OK) {
        return true;
    }
    if (why) {
        char text[1024];
        servers_tell_gone(d, l->server, why);
        snprintf(text, sizeof(text),
                 "The MCP server \"%s\" failed before answering this call (%.300s); it may not "
                 "have run.",
                 l->mcp->name, why);
        tools_record_result(d, l->index[0], c->call_id, c->name, text, true, NULL, false);
    } else {
        size_t n;
        Cflue__V1__Attachment **images = mcp_op_images(l->op, &n);
        tools_record_images(d, l->index[0], c->call_id, c->name, mcp_op_text(l->op),
                            mcp_op_is_error(l->op), NULL, images, n);
    }
    return true;
}

/* lane_poll records what arrived on l and returns true once its end is taken. */
static bool lane_poll(struct drive *d, struct tool_lane *l)
{
    if (l->mcp) {
        return mcp_lane_poll(d, l);
    }
    pthread_mutex_lock(&l->mu);
    ProtobufCMessage *msg = l->result;
    l->result = NULL;
    bool ended = l->ended;
    struct rpc_status st = l->st;
    pthread_mutex_unlock(&l->mu);
    if (msg) {
        lane_record(d, l, msg);
        if (!l->released) {
            rpc_astream_next(l->stream);
        }
    }
    if (!ended) {
        if (drive_halted(d) && !l->released) {
            /* abort, lost lease, shutdown or a fault: the servers stop the calls still running
             * (toold kills the commands); the stream's end posts the drive */
            l->released = true;
            rpc_astream_release(l->stream);
        }
        return false;
    }
    if (!l->released) {
        l->released = true;
        rpc_astream_release(l->stream);
    }
    l->stream = NULL;
    l->over = true;
    finish_lane(d, l, &st);
    return true;
}

/* lane_waits opens a lane not yet opened once the batch before it is over and its results are
 * stored; true while it still waits. Storing them goes through the attempt's fence: an attempt
 * whose lease another took meanwhile (its process stopped past the lease) learns it there,
 * before it runs anything more. A drive that stops opens no more: such a lane is over, its
 * calls never run. */
static bool lane_waits(struct drive *d, struct tool_lane *l)
{
    if (l->opened) {
        return false;
    }
    if (l->after && !l->after->over) {
        return true;
    }
    if (l->after && !dstore_stored(d)) {
        return true; /* the write's end posts the drive */
    }
    if (drive_halted(d) || d->fault.code != CF_OK) {
        l->over = true;
        return false;
    }
    if (drive_time_left(d) <= 0) {
        /* the batch before took the time: these calls are not sent at all */
        for (size_t k = 0; k < l->m && d->fault.code == CF_OK; k++) {
            l->done[k] = true;
            tools_record_result(d, l->index[k], l->calls[k].call_id, l->calls[k].name,
                                "This call was not run: the submission reached its time limit.",
                                true, NULL, false);
        }
        l->over = true;
        return false;
    }
    lane_open(l);
    return false;
}

bool tools_poll(struct drive *d)
{
    struct tool_wait *w = &d->tw;
    bool over = true;
    for (size_t i = 0; i < w->n; i++) { /* a lane split adds lanes: they are polled too */
        struct tool_lane *l = w->lanes[i];
        if (lane_waits(d, l) || (!l->over && !lane_poll(d, l))) {
            over = false;
        }
    }
    for (size_t i = 0; over && i < w->n; i++) {
        over = w->lanes[i]->over; /* a split's lanes, added after they were passed */
    }
    if (over) {
        lanes_free(w);
        w->running = false;
    }
    return over;
}

bool tools_all_answered(const struct drive *d)
{
    const struct tool_wait *w = &d->tw;
    for (size_t i = 0; i < w->n; i++) {
        const struct tool_lane *l = w->lanes[i];
        if (l->over) {
            continue;
        }
        if (l->mcp) {
            return false; /* its one result is recorded with its end */
        }
        for (size_t k = 0; k < l->m; k++) {
            if (!l->done[k]) {
                return false;
            }
        }
    }
    return true;
}

void tools_wait_init(struct drive *d)
{
    memset(&d->tw, 0, sizeof(d->tw));
}

void tools_wait_cleanup(struct drive *d)
{
    lanes_free(&d->tw);
}
