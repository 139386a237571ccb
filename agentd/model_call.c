/* model_call.c - one model call of a drive: retries with backoff, streamed deltas for
 * watchers, and the complete answer recorded as the turn's assistant_message.
 *
 * Rate limits, overload, 5xx, network errors and cut-off streams are retried up to
 * MODEL_RETRIES times (honouring retry-after); a call needs at least DRIVE_MODEL_MIN_MS of the
 * submission's time limit and is bounded by what is left. A context overflow is returned to
 * the drive, which compacts and asks again once (drive.c). Streamed text is flushed every
 * DELTA_FLUSH_MS as assistant_delta records: a courtesy to watchers, one try each, never part
 * of the context.
 */
#include "catalog.h"
#include "clients.h"
#include "clock.h"
#include "drive.h"
#include "log.h"
#include "mem.h"
#include "thread.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DELTA_FLUSH_MS 250
#define DELTA_TIMEOUT_MS 2000
#define MODEL_RETRIES 3

/* flush_delta sends the streamed text so far to watchers: one quick try, no retry, no fault
 * (the assistant_message that follows is what counts). Ids carry the attempt, so a turn asked
 * again never collides with the deltas of an earlier attempt. Deltas stay out of the log. */
static void flush_delta(struct drive *d)
{
    if (!d->delta.len) {
        return;
    }
    char id[512];
    snprintf(id, sizeof(id), "delta:%s:%d:%s:%d", d->sub->submission_id, d->turn,
             d->fence.attempt_id, d->delta_seq++);
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT, *recs[1] = {&rec};
    Cflue__V1__AssistantDelta body = CFLUE__V1__ASSISTANT_DELTA__INIT;
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&d->delta);
    rec.id = id;
    rec.submission_id = (char *)d->sub->submission_id;
    rec.body_case = CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA;
    rec.assistant_delta = &body;
    req.fence = &d->fence;
    req.records = recs;
    req.n_records = 1;
    struct cf_error err;
    if (store_call(g_agentd.store, "Append", &req.base, &cflue__v1__append_response__descriptor,
                   DELTA_TIMEOUT_MS, &resp, &err) == CF_STALE) {
        drive_mark_lease_lost(d);
    }
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    buf_reset(&d->delta);
    d->delta_flushed_ms = clock_mono_ms();
}

static void on_text(void *ctx, const char *p, size_t n)
{
    struct drive *d = ctx;
    if (d->quiet) {
        return;
    }
    if (buf_append(&d->delta, p, n) != CF_OK ||
        clock_mono_ms() - d->delta_flushed_ms > DELTA_FLUSH_MS) {
        flush_delta(d);
        if (buf_append(&d->delta, p, n) != CF_OK) {
            buf_reset(&d->delta);
        }
    }
}

static bool model_cancelled(void *ctx)
{
    return drive_stopped(ctx);
}

int64_t model_output_tokens(const struct agent_def *a)
{
    struct model_info mi = catalog_lookup(a->model);
    return mi.max_output_tokens < 16384 ? mi.max_output_tokens : 16384;
}

/* backoff waits before try `attempt` + 1; false when the drive stopped meanwhile. */
static bool backoff(struct drive *d, int attempt, const struct llm_response *out)
{
    int64_t wait = out->retry_after_ms > 0 ? out->retry_after_ms : (500LL << attempt);
    wait += thread_jitter_ms(250);
    char q[600];
    log_warn("model_retry", "submission=%s attempt=%d wait_ms=%lld err=%s", d->sub->submission_id,
             attempt + 1, (long long)wait, log_quote(q, sizeof(q), d->err.msg));
    for (int64_t slept = 0; slept < wait && !drive_stopped(d); slept += 100) {
        clock_sleep_ms(100);
    }
    return !drive_stopped(d);
}

enum cf_status model_call(struct drive *d, const char *system, const struct context *c,
                          const struct llm_tool *tools, size_t n_tools, struct llm_response *out)
{
    const struct agent_def *a = d->agent;
    bool anthropic = !strcmp(a->provider, "anthropic");
    struct llm_request req = {.provider = a->provider,
                              .model = a->model_id,
                              .system = system,
                              .messages = c->msgs,
                              .n_messages = c->n,
                              .tools = tools,
                              .n_tools = n_tools,
                              .max_tokens = model_output_tokens(a),
                              .stream = g_agentd.stream};
    struct llm_events ev = {.on_text = on_text, .cancelled = model_cancelled, .ctx = d};
    const struct provider_endpoint *ep = anthropic ? &g_agentd.anthropic : &g_agentd.openai;
    enum cf_status rc = CF_UNAVAILABLE;
    for (int attempt = 0; attempt <= MODEL_RETRIES; attempt++) {
        llm_response_cleanup(out);
        llm_response_init(out);
        buf_reset(&d->delta);
        d->delta_flushed_ms = clock_mono_ms();
        int64_t left = drive_time_left(d);
        if (left < DRIVE_MODEL_MIN_MS) {
            return cf_error_set(&d->err, CF_DEADLINE, "the submission reached its time limit");
        }
        req.timeout_ms = left;
        rc = llm_complete(ep, &req, &ev, out, &d->err);
        flush_delta(d);
        if (rc == CF_OK || rc == CF_CANCELLED || !out->retryable || attempt == MODEL_RETRIES) {
            break;
        }
        if (!backoff(d, attempt, out)) {
            return CF_CANCELLED;
        }
    }
    return rc;
}

enum cf_status model_record_answer(struct drive *d, const struct llm_response *resp)
{
    char id[256];
    struct model_info mi = catalog_lookup(d->agent->model);
    Cflue__V1__AssistantMessage body = CFLUE__V1__ASSISTANT_MESSAGE__INIT;
    Cflue__V1__Usage usage = CFLUE__V1__USAGE__INIT;
    Cflue__V1__ToolCallRequest *calls = mem_alloc(sizeof(*calls) * (resp->n_calls + 1));
    Cflue__V1__ToolCallRequest **ptrs = mem_alloc(sizeof(void *) * (resp->n_calls + 1));
    for (size_t i = 0; i < resp->n_calls; i++) {
        cflue__v1__tool_call_request__init(&calls[i]);
        calls[i].id = resp->calls[i].id;
        calls[i].name = resp->calls[i].name;
        calls[i].arguments_json = resp->calls[i].arguments_json;
        ptrs[i] = &calls[i];
    }
    usage.input_tokens = resp->input_tokens;
    usage.output_tokens = resp->output_tokens;
    usage.cost_usd = catalog_cost(&mi, resp->input_tokens, resp->output_tokens);
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&resp->text);
    body.tool_calls = ptrs;
    body.n_tool_calls = resp->n_calls;
    body.stop_reason = (char *)resp->stop_reason;
    body.model = (char *)d->agent->model;
    body.usage = &usage;
    snprintf(id, sizeof(id), "assistant:%s:%d", d->sub->submission_id, d->turn);
    enum cf_status rc = dstore_append_one(d, id, d->sub->submission_id, &body.base);
    free(calls);
    free(ptrs);
    return rc;
}
