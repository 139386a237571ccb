/* model_call.c - one model call of a drive: retries with backoff, streamed deltas for
 * watchers, and the complete answer recorded as the turn's assistant_message.
 *
 * A call is asynchronous (model_call_start / model_call_poll): it runs on the model I/O loop
 * while the drive is parked and holds no thread; a turn's call and a compaction's summary
 * alike. The loop's callbacks only note what happened under d->mw.mu and post the drive to
 * the engine (engine_post); the rest (sending deltas as the drive's Store call in flight,
 * deciding on a retry) happens when an engine thread steps the drive. A retry's backoff is an
 * engine timer (engine_post_at), not a sleep.
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
#include "engine.h"
#include "log.h"
#include "mem.h"
#include "stats.h"
#include "thread.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DELTA_FLUSH_MS 250
#define DELTA_TIMEOUT_MS 2000
#define MODEL_RETRIES 3

/* flush_delta sends the streamed text so far to watchers as the drive's call in flight (no
 * thread waits for it): one quick try, no retry, no fault (the assistant_message that follows
 * is what counts). While another call is in flight the text waits for the next flush. Ids
 * carry the attempt, so a turn asked again never collides with the deltas of an earlier
 * attempt. Deltas stay out of the log. */
static void flush_delta(struct drive *d)
{
    if (!d->delta.len || !dstore_writes_done(d) || dstore_release_held(d, true)) {
        return; /* the text waits for the next flush (held records go first, in order) */
    }
    char id[512];
    snprintf(id, sizeof(id), "delta:%s:%d:%s:%d", d->sub->submission_id, d->turn,
             d->fence.attempt_id, d->delta_seq);
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT, *recs[1] = {&rec};
    Cflue__V1__AssistantDelta body = CFLUE__V1__ASSISTANT_DELTA__INIT;
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&d->delta);
    body.restart = d->delta_restart;
    rec.id = id;
    rec.submission_id = (char *)d->sub->submission_id;
    rec.body_case = CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA;
    rec.assistant_delta = &body;
    req.fence = &d->fence;
    req.records = recs;
    req.n_records = 1;
    if (dstore_send_delta(d, &req.base, DELTA_TIMEOUT_MS)) {
        d->delta_seq++;
        d->delta_restart = false;
        buf_reset(&d->delta);
        d->delta_flushed_ms = clock_mono_ms();
    }
}

int64_t model_output_tokens(const char *model)
{
    struct model_info mi = catalog_lookup(model);
    return mi.max_output_tokens < 16384 ? mi.max_output_tokens : 16384;
}

/* backoff_ms is how long to wait before try `attempt` + 1: what the provider asked
 * (retry-after), else a doubling wait, with jitter. */
static int64_t backoff_ms(int attempt, const struct llm_response *out)
{
    int64_t wait = out->retry_after_ms > 0 ? out->retry_after_ms : (500LL << attempt);
    return wait + thread_jitter_ms(250);
}

/* request is the model request of drive d for system, c and the tools. */
static struct llm_request request(struct drive *d, const char *system, const struct context *c,
                                  const struct llm_tool *tools, size_t n_tools)
{
    return (struct llm_request){.provider = d->provider,
                                .model = d->model_id,
                                .system = system,
                                .messages = c->msgs,
                                .n_messages = c->n,
                                .tools = tools,
                                .n_tools = n_tools,
                                .max_tokens = model_output_tokens(d->model),
                                .stream = g_agentd.stream};
}

static const struct provider_endpoint *endpoint(struct drive *d)
{
    return !strcmp(d->provider, "anthropic") ? &g_agentd.anthropic : &g_agentd.openai;
}

/* ---------- the asynchronous call of a turn ---------- */

#define PENDING_MAX (1 << 20) /* streamed text held for the next flush; more is dropped */

void model_call_init(struct drive *d)
{
    pthread_mutex_init(&d->mw.mu, NULL);
    buf_init(&d->mw.pending, PENDING_MAX);
}

void model_call_cleanup(struct drive *d)
{
    context_free(&d->mw.ctx);
    buf_cleanup(&d->mw.pending);
    pthread_mutex_destroy(&d->mw.mu);
}

/* async_text (on the model I/O loop) keeps streamed text for the drive, posting the drive
 * when a flush is due. Never blocks: the Append happens on an engine thread. */
static void async_text(void *ctx, const char *p, size_t n)
{
    struct drive *d = ctx;
    if (d->quiet) {
        return;
    }
    struct model_wait *w = &d->mw;
    bool post = false;
    pthread_mutex_lock(&w->mu);
    (void)buf_append(&w->pending, p, n); /* past PENDING_MAX the courtesy copy drops text */
    if (!w->flush_posted && clock_mono_ms() - w->flushed_ms > DELTA_FLUSH_MS) {
        w->flush_posted = true;
        post = true;
    }
    pthread_mutex_unlock(&w->mu);
    if (post) {
        engine_post(d);
    }
}

/* async_done (on the model I/O loop) notes how the call ended and posts the drive. */
static void async_done(void *ctx, enum cf_status rc, const struct cf_error *err)
{
    struct drive *d = ctx;
    struct model_wait *w = &d->mw;
    pthread_mutex_lock(&w->mu);
    w->done = true;
    w->rc = rc;
    if (err && rc != CF_OK) {
        w->err = *err;
    }
    /* posted under the lock: once the drive sees `done` it may finish and be freed */
    engine_post_unlock(d, &w->mu);
}

/* set_call records the call the drive is parked on, for Abort and shutdown to cancel. */
static void set_call(struct drive *d, uint64_t id)
{
    pthread_mutex_lock(&g_agentd.mu);
    d->act->model_call = id;
    pthread_mutex_unlock(&g_agentd.mu);
}

/* try_start starts try w->attempt; a call that cannot start is done at once. */
static void try_start(struct drive *d)
{
    struct model_wait *w = &d->mw;
    llm_response_cleanup(&d->answer);
    llm_response_init(&d->answer);
    buf_reset(&d->delta);
    d->delta_restart = true; /* a try's text replaces any an earlier try streamed */
    d->delta_flushed_ms = clock_mono_ms();
    pthread_mutex_lock(&w->mu);
    buf_reset(&w->pending);
    w->done = false;
    w->rc = CF_OK;
    w->flush_posted = false;
    w->flushed_ms = d->delta_flushed_ms;
    pthread_mutex_unlock(&w->mu);
    w->in_flight = true;
    w->try_started_us = clock_mono_us();
    struct cf_error err = {0};
    enum cf_status rc;
    int64_t left = drive_time_left(d);
    uint64_t id = 0;
    if (left < DRIVE_MODEL_MIN_MS) {
        rc = cf_error_set(&err, CF_DEADLINE, "the submission reached its time limit");
    } else {
        w->req.timeout_ms = left;
        rc = llm_start(endpoint(d), &w->req, &w->ev, &d->answer, async_done, d, &id, &err);
    }
    if (rc != CF_OK) {
        pthread_mutex_lock(&w->mu);
        w->done = true;
        w->rc = rc;
        w->err = err;
        pthread_mutex_unlock(&w->mu);
        return;
    }
    set_call(d, id);
    if (drive_stopped(d)) {
        llm_cancel(id); /* an abort that came meanwhile */
    }
}

void model_call_start(struct drive *d, const char *system, struct context *ctx,
                      const struct llm_tool *tools, size_t n_tools)
{
    struct model_wait *w = &d->mw;
    context_free(&w->ctx);
    w->ctx = *ctx;
    memset(ctx, 0, sizeof(*ctx));
    w->req = request(d, system, &w->ctx, tools, n_tools);
    w->ev = (struct llm_events){.on_text = async_text, .ctx = d};
    w->attempt = 0;
    w->backing_off = false;
    try_start(d);
}

/* take_text moves the text the loop kept into d->delta, flushing it when it is due or the
 * call has ended; returns whether the call has ended, with its status and error. */
static bool take_text(struct drive *d, enum cf_status *rc, struct cf_error *err)
{
    struct model_wait *w = &d->mw;
    pthread_mutex_lock(&w->mu);
    if (w->pending.len && buf_append(&d->delta, w->pending.data, w->pending.len) != CF_OK) {
        buf_reset(&d->delta); /* a courtesy copy: what does not fit is dropped */
    }
    buf_reset(&w->pending);
    w->flush_posted = false;
    bool done = w->done;
    *rc = w->rc;
    *err = w->err;
    pthread_mutex_unlock(&w->mu);
    if (done) {
        buf_reset(&d->delta); /* the assistant_message that follows holds the whole text */
    } else if (d->delta.len && clock_mono_ms() - d->delta_flushed_ms > DELTA_FLUSH_MS) {
        flush_delta(d);
        pthread_mutex_lock(&w->mu);
        w->flushed_ms = d->delta_flushed_ms;
        pthread_mutex_unlock(&w->mu);
    }
    return done;
}

static bool finished(struct drive *d, enum cf_status rc, enum cf_status *out)
{
    context_free(&d->mw.ctx);
    d->mw.in_flight = false;
    d->mw.backing_off = false;
    *out = rc;
    return true;
}

bool model_call_poll(struct drive *d, enum cf_status *out)
{
    struct model_wait *w = &d->mw;
    for (;;) {
        enum cf_status rc;
        struct cf_error err;
        if (w->backing_off) {
            if (drive_halted(d)) {
                return finished(d, CF_CANCELLED, out);
            }
            if (clock_mono_ms() < w->backoff_until) {
                engine_post_at(d, w->backoff_until); /* posted early: the timer again */
                return false;
            }
            w->backing_off = false;
            w->attempt++;
            try_start(d);
            continue;
        }
        if (!take_text(d, &rc, &err)) {
            if (drive_halted(d)) { /* stopped, or the records written behind failed */
                pthread_mutex_lock(&g_agentd.mu);
                uint64_t id = d->act->model_call;
                pthread_mutex_unlock(&g_agentd.mu);
                llm_cancel(id); /* its end posts the drive */
            }
            return false;
        }
        set_call(d, 0);
        w->in_flight = false;
        stats_model_call(d->model, rc, &d->answer, clock_mono_us() - w->try_started_us);
        if (rc != CF_OK) {
            d->err = err;
        }
        if (rc == CF_OK || rc == CF_CANCELLED || !d->answer.retryable ||
            w->attempt == MODEL_RETRIES) {
            return finished(d, rc, out);
        }
        int64_t wait = backoff_ms(w->attempt, &d->answer), left = drive_time_left(d);
        if (left != INT64_MAX && wait > left - DRIVE_MODEL_MIN_MS) {
            /* the next try could not start before the time limit: the call ends now, not
             * after a wait that holds the lease for nothing */
            size_t n = strlen(d->err.msg);
            snprintf(d->err.msg + n, sizeof(d->err.msg) - n,
                     "; the next try would start %lld ms from now, past the submission's time "
                     "limit (%lld ms left)",
                     (long long)wait, (long long)(left > 0 ? left : 0));
            return finished(d, rc, out);
        }
        char q[600];
        log_warn("model_retry", "submission=%s attempt=%d wait_ms=%lld err=%s",
                 d->sub->submission_id, w->attempt + 1, (long long)wait,
                 log_quote(q, sizeof(q), d->err.msg));
        w->backing_off = true;
        w->backoff_until = clock_mono_ms() + wait;
        engine_post_at(d, w->backoff_until);
        return false;
    }
}

enum cf_status model_record_answer(struct drive *d, const struct llm_response *resp)
{
    char id[256];
    struct model_info mi = catalog_lookup(d->model);
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
    stats_usage(d->model, resp->input_tokens, resp->output_tokens, usage.cost_usd);
    int64_t now = clock_mono_us();
    if (d->turn_mark_us) {
        stats_turn(now - d->turn_mark_us);
    }
    d->turn_mark_us = now;
    body.turn = d->turn;
    body.text = (char *)buf_cstr(&resp->text);
    body.tool_calls = ptrs;
    body.n_tool_calls = resp->n_calls;
    body.stop_reason = (char *)resp->stop_reason;
    body.model = (char *)d->model;
    body.usage = &usage;
    snprintf(id, sizeof(id), "assistant:%s:%d", d->sub->submission_id, d->turn);
    /* pending: calls are made durable before they run (DRIVE_TOOLS waits for that: a later
     * attempt must know they started); a final answer waits for the Settle that carries it */
    enum cf_status rc = dstore_defer_one(d, id, d->sub->submission_id, &body.base);
    free(calls);
    free(ptrs);
    return rc;
}
