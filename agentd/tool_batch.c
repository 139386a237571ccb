/* tool_batch.c - the sandbox's tools for a drive: the tool set (Tools.List) and one model
 * turn's calls run as a single Tools.ExecuteBatch, each result recorded as it arrives.
 *
 * The batch holds no thread: it is an event-driven client stream (rpc_astream) whose results
 * and end post the drive, parked in DRIVE_TOOLS_WAIT meanwhile; the engine thread stepping it
 * records each result (written behind: one Append in flight at a time, never waited for here;
 * the next turn waits until every result is stored) and then asks for the next. An abort, a lost
 * lease or shutdown posts the drive, which cancels the stream (toold kills the commands) and waits
 * for its end.
 *
 * toold itself failing (unreachable, overloaded, a batch broken off) is a fault: the drive
 * ends interrupted, and the calls left without a result get the outcome-unknown result when
 * the work resumes (settle.c). toold refusing a batch as a bad request is an answer: the model
 * hears why each call did not run.
 */
#include "clients.h"
#include "drive.h"
#include "engine.h"
#include "failpoint.h"
#include "mem.h"
#include "pbtime.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOOLS_TIMEOUT_MS 10000 /* Tools.List */

struct rpc_channel *tools_channel(struct drive *d)
{
    static struct {
        char *addr;
        struct rpc_channel *ch;
    } cache[32];
    static int n;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    const char *addr = d->tools_addr;
    struct rpc_channel *ch = NULL;
    if (!addr) {
        return NULL;
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n && !ch; i++) {
        if (!strcmp(cache[i].addr, addr)) {
            ch = cache[i].ch;
        }
    }
    if (!ch && n < 32) {
        cache[n].addr = mem_strdup(addr);
        ch = cache[n++].ch = rpc_channel_new(addr, 64 << 20);
    }
    pthread_mutex_unlock(&mu);
    return ch;
}

/* FAILED_PRECONDITION is an answer (the sandbox's state does not allow the call: not a
 * directory, say); ABORTED from toold (no fence is involved) is a conflict that trying again
 * later may clear, so it is a failure, recorded as CF_UNAVAILABLE rather than as a lost lease. */
bool tools_failed(struct drive *d, const char *what, const struct rpc_status *st)
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
    default: {
        struct cf_error e;
        enum cf_status code =
            st->code == GRPC_STATUS_ABORTED ? CF_UNAVAILABLE : status_from_grpc(st->code);
        cf_error_set(&e, code, "toold at %s: %s (grpc status %d, reason %s)", d->tools_addr,
                     st->details[0] ? st->details : "call failed", (int)st->code,
                     st->reason[0] ? st->reason : "none");
        drive_fault(d, what, &e);
        return true;
    }
    }
}

void tools_no_channel(struct drive *d)
{
    if (d->tools_addr) {
        struct cf_error e;
        cf_error_set(&e, CF_BUSY,
                     "no channel to toold at %s: this agentd reaches at most 32 tool servers",
                     d->tools_addr);
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
    ts->n = n;
    ts->tools = mem_alloc(sizeof(*ts->tools) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        ts->tools[i].name = specs[i]->name;
        ts->tools[i].description = specs[i]->description;
        ts->tools[i].schema_json = specs[i]->parameters_json;
        ts->tools[i].schema = NULL;
        ts->tools[i].schema = llm_tool_schema(&ts->tools[i]); /* once, not per turn */
    }
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
    if (rpc_unary(ch, "/cflue.v1.Tools/List", &rq.base, &cflue__v1__list_tools_response__descriptor,
                  TOOLS_TIMEOUT_MS, &resp, &st)) {
        const Cflue__V1__ListToolsResponse *list = (const void *)resp;
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
        json_decref(d->tools.tools[i].schema);
    }
    free(d->tools.tools);
    memset(&d->tools, 0, sizeof(d->tools));
}

void tools_record_result(struct drive *d, int index, const char *call_id, const char *name,
                         const char *text, bool is_error, const Cflue__V1__Truncation *t,
                         bool outcome_unknown)
{
    char id[512];
    Cflue__V1__ToolCallResult body = CFLUE__V1__TOOL_CALL_RESULT__INIT;
    context_tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, call_id);
    body.turn = d->turn;
    body.index = index;
    body.tool_call_id = (char *)call_id;
    body.name = (char *)name;
    body.text = (char *)text;
    body.is_error = is_error;
    body.truncation = t && t->truncated ? (Cflue__V1__Truncation *)t : NULL;
    body.outcome_unknown = outcome_unknown;
    (void)dstore_defer_one(d, id, d->sub->submission_id, &body.base);
}

/* prepare fills the batch (d->tw) with the calls toold can run; a call naming no tool of the
 * set gets an error result at once. Each call's timeout is what is left of the submission's
 * time (at least 1 ms; unset means no limit). */
static void prepare(struct drive *d, const struct llm_response *resp)
{
    struct tool_wait *b = &d->tw;
    size_t n = resp->n_calls;
    b->calls = mem_alloc(sizeof(*b->calls) * (n + 1));
    b->ptrs = mem_alloc(sizeof(void *) * (n + 1));
    b->limits = mem_alloc(sizeof(*b->limits) * (n + 1));
    b->index = mem_alloc(sizeof(int) * (n + 1));
    b->done = mem_alloc(sizeof(bool) * (n + 1));
    memset(b->done, 0, sizeof(bool) * (n + 1));
    b->m = 0;
    int64_t left = drive_time_left(d);
    for (size_t i = 0; i < n && d->fault.code == CF_OK; i++) {
        const struct llm_call *c = &resp->calls[i];
        char id[600];
        context_tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, c->id);
        if (task_is_framework(c->name) || rlog_find(&d->log, id)) {
            continue; /* run by agentd (task.c), or run before (a resumed turn) */
        }
        bool known = false;
        for (size_t k = 0; k < d->tools.n; k++) {
            known = known || !strcmp(d->tools.tools[k].name, c->name);
        }
        if (!known) {
            char text[512];
            snprintf(text, sizeof(text), "There is no tool named '%s' here.%s", c->name,
                     d->tools.n ? " Use one of the tools listed in your instructions." : "");
            tools_record_result(d, (int)i, c->id, c->name, text, true, NULL, false);
            continue;
        }
        Cflue__V1__ToolCall *tc = &b->calls[b->m];
        cflue__v1__tool_call__init(tc);
        tc->sandbox = d->workspace;
        tc->call_id = c->id;
        tc->name = c->name;
        tc->arguments_json = c->arguments_json;
        if (left != INT64_MAX) {
            google__protobuf__duration__init(&b->limits[b->m]);
            pbdur_set(&b->limits[b->m], left > 1 ? left : 1);
            tc->timeout = &b->limits[b->m];
        }
        b->ptrs[b->m] = tc;
        b->index[b->m] = (int)i;
        b->m++;
    }
}

/* free_batch frees the batch's calls (the stream is over or never started). */
static void free_batch(struct tool_wait *b)
{
    free(b->calls);
    free(b->ptrs);
    free(b->limits);
    free(b->index);
    free(b->done);
    b->calls = NULL;
    b->ptrs = NULL;
    b->limits = NULL;
    b->index = NULL;
    b->done = NULL;
    b->m = 0;
}

/* on_result (rpc's stream thread) hands one result to the drive and posts it; the next is
 * asked for once the drive recorded this one. */
static void on_result(void *arg, ProtobufCMessage *msg)
{
    struct drive *d = arg;
    pthread_mutex_lock(&d->tw.mu);
    d->tw.result = msg;
    pthread_mutex_unlock(&d->tw.mu);
    engine_post(d);
}

static void on_batch_end(void *arg, const struct rpc_status *st)
{
    struct drive *d = arg;
    pthread_mutex_lock(&d->tw.mu);
    d->tw.ended = true;
    d->tw.st = *st;
    /* posted under the lock: once an engine thread sees `ended` the drive may finish and be
     * freed, so nothing here may touch d after the unlock */
    engine_post(d);
    pthread_mutex_unlock(&d->tw.mu);
}

static const struct rpc_astream_ops batch_ops = {.on_message = on_result, .on_end = on_batch_end};

bool tools_start(struct drive *d, const struct llm_response *resp)
{
    struct tool_wait *b = &d->tw;
    prepare(d, resp);
    if (!b->m || d->fault.code != CF_OK) {
        free_batch(b);
        return false;
    }
    Cflue__V1__ToolBatch batch = CFLUE__V1__TOOL_BATCH__INIT;
    batch.calls = b->ptrs;
    batch.n_calls = b->m;
    b->ended = false;
    b->released = false;
    b->result = NULL;
    b->running = true;
    /* no deadline of its own: each call carries the submission's time left */
    b->stream = rpc_astream_open(tools_channel(d), "/cflue.v1.Tools/ExecuteBatch", &batch.base,
                                 &cflue__v1__batch_result__descriptor, 0, &batch_ops, d);
    return true;
}

/* record takes one result off the stream and records it (unless the drive cannot write). */
static void record(struct drive *d, Cflue__V1__BatchResult *br)
{
    struct tool_wait *b = &d->tw;
    if (br->index >= 0 && (size_t)br->index < b->m && br->result && !b->done[br->index]) {
        b->done[br->index] = true;
        const Cflue__V1__ToolCall *c = &b->calls[br->index];
        failpoint_hit("agentd.tools.before_record");
        if (d->fault.code == CF_OK && !drive_lost_or_down(d)) {
            tools_record_result(d, b->index[br->index], c->call_id, c->name, br->result->text,
                                br->result->is_error, br->result->truncation, false);
        }
    }
    protobuf_c_message_free_unpacked(&br->base, NULL);
}

/* finish_batch handles a batch that ended short of results: toold failing is a fault; toold
 * refusing the batch (a bad request) gives each call without a result an error result. */
static void finish_batch(struct drive *d, struct rpc_status *st)
{
    struct tool_wait *b = &d->tw;
    bool missing = false;
    for (size_t k = 0; k < b->m; k++) {
        missing = missing || !b->done[k];
    }
    if (missing && !drive_halted(d) && st->code == GRPC_STATUS_OK) {
        /* a stream that ended OK short of results is toold failing too */
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->details, sizeof(st->details), "the batch ended with results missing");
    }
    if (!missing || drive_halted(d) || tools_failed(d, "the tool batch failed", st)) {
        return;
    }
    for (size_t k = 0; k < b->m && d->fault.code == CF_OK; k++) {
        if (!b->done[k]) {
            char text[CF_ERROR_MSG_MAX + 128];
            snprintf(text, sizeof(text),
                     "The tool server refused this call (%.300s); it did not run.", st->details);
            tools_record_result(d, b->index[k], b->calls[k].call_id, b->calls[k].name, text, true,
                                NULL, false);
        }
    }
}

bool tools_poll(struct drive *d)
{
    struct tool_wait *b = &d->tw;
    pthread_mutex_lock(&b->mu);
    ProtobufCMessage *msg = b->result;
    b->result = NULL;
    bool ended = b->ended;
    struct rpc_status st = b->st;
    pthread_mutex_unlock(&b->mu);
    if (msg) {
        record(d, (Cflue__V1__BatchResult *)msg);
        if (!b->released) {
            rpc_astream_next(b->stream);
        }
    }
    if (!ended) {
        if (drive_halted(d) && !b->released) {
            /* abort, lost lease, shutdown or a fault: toold kills the commands still running;
             * the stream's end posts the drive */
            b->released = true;
            rpc_astream_release(b->stream);
        }
        return false;
    }
    if (!b->released) {
        b->released = true;
        rpc_astream_release(b->stream);
    }
    b->stream = NULL;
    b->running = false;
    finish_batch(d, &st);
    free_batch(b);
    return true;
}

void tools_wait_init(struct drive *d)
{
    memset(&d->tw, 0, sizeof(d->tw));
    pthread_mutex_init(&d->tw.mu, NULL);
}

void tools_wait_cleanup(struct drive *d)
{
    if (d->tw.result) {
        protobuf_c_message_free_unpacked(d->tw.result, NULL);
        d->tw.result = NULL;
    }
    free_batch(&d->tw);
    pthread_mutex_destroy(&d->tw.mu);
}
