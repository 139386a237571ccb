/* settle.c - how a drive ends: the outcome recorded, or stopped, or interrupted.
 *
 * Settlement is one Store.Settle, an event-driven call the drive parks on (settle_start,
 * settle_poll; DRIVE_SETTLE_WAIT), the failure paths' too: it carries the records
 * still pending (the final answer, usually), and storaged writes them, the submission_settled
 * record and settles joined submissions with their host in the same transaction; the claimer is
 * woken only when the conversation has a next message to run. What the stream holds is known from
 * the record log (read when the drive started, appended through since), so settling reads nothing
 * again:
 *  - `completed` only when the log ends with this submission's assistant message asking for
 *    no tool, every call of the submission has its result and no input came after it (a
 *    Compact request excepted: it answers nothing); otherwise the attempt ends interrupted;
 *  - before a `failed` or `aborted` outcome, calls still without a result get the
 *    outcome-unknown result (repair);
 *  - a fault that trying again cannot mend (a record refused as invalid or as a conflicting
 *    id) settles failed with its reason; other faults end the drive interrupted; a lost lease
 *    or shutdown ends it stopped.
 * A takeover first settles an earlier attempt's half-finished joins (joins.c), so later
 * messages never join past them.
 */
#include "catalog.h"
#include "drive.h"
#include "failpoint.h"
#include "log.h"
#include "settled_here.h"
#include "stats.h"
#include "utf8.h"

#include <stdio.h>
#include <string.h>

#define SETTLE_ERROR_MAX 8000

enum drive_end settle_ended(struct drive *d)
{
    char q[600];
    pthread_mutex_lock(&g_agentd.mu);
    bool lost = d->act->lease_lost, down = d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    if (lost || down) {
        log_info("drive_stopped", "submission=%s reason=%s", d->sub->submission_id,
                 lost ? "lease_lost" : "shutdown");
        return DRIVE_STOPPED;
    }
    log_warn("drive_interrupted", "submission=%s attempt=%s err=%s", d->sub->submission_id,
             d->fence.attempt_id, log_quote(q, sizeof(q), d->fault.msg));
    return DRIVE_INTERRUPTED;
}

/* own_assistant returns r's assistant message when r is one of this submission's, else NULL. */
static const Cflue__V1__AssistantMessage *own_assistant(struct drive *d, const Cflue__V1__Record *r)
{
    if (r->body_case != CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE ||
        strcmp(r->submission_id, d->sub->submission_id) != 0) {
        return NULL;
    }
    return r->assistant_message;
}

/* unresolved_calls counts this submission's tool calls that have no recorded result; with
 * fix set, it records the outcome-unknown result for each (failures are faults), except, with
 * keep_tasks, the `task` calls of the latest turn: their children may still finish. */
static size_t unresolved_calls(struct drive *d, bool fix, bool keep_tasks)
{
    size_t missing = 0, last = 0;
    for (size_t i = 0; i < d->log.n; i++) {
        last = own_assistant(d, d->log.recs[i]) ? i : last;
    }
    for (size_t i = 0; i < d->log.n; i++) {
        const Cflue__V1__AssistantMessage *am = own_assistant(d, d->log.recs[i]);
        for (size_t k = 0; am && k < am->n_tool_calls && d->fault.code == CF_OK; k++) {
            const Cflue__V1__ToolCallRequest *c = am->tool_calls[k];
            char id[512];
            context_tool_result_id(id, sizeof(id), d->sub->submission_id, am->turn, c->id);
            if (rlog_find(&d->log, id)) {
                continue;
            }
            missing++;
            if (fix && !(keep_tasks && i == last && task_is_framework(c->name))) {
                /* cut off with the attempt before: its command may still be stopping */
                d->commands_cut = d->commands_cut || !task_is_framework(c->name);
                int saved = d->turn;
                d->turn = am->turn;
                tools_record_result(d, (int)k, c->id, c->name, CONTEXT_INTERRUPTED_RESULT, true,
                                    NULL, true);
                d->turn = saved;
                log_info("tool_outcome_unknown", "submission=%s call=%s", d->sub->submission_id,
                         c->id);
            }
        }
    }
    return missing;
}

bool settle_answered(struct drive *d)
{
    const Cflue__V1__Record *last = NULL;
    bool input_after = false;
    for (size_t i = 0; i < d->log.n; i++) {
        const Cflue__V1__Record *r = d->log.recs[i];
        if (own_assistant(d, r)) {
            last = r;
            input_after = false;
        } else if (last && r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE) {
            input_after = true;
        }
    }
    return last && last->assistant_message->n_tool_calls == 0 && !input_after &&
           unresolved_calls(d, false, false) == 0;
}

void settle_repair(struct drive *d, bool keep_tasks)
{
    (void)unresolved_calls(d, true, keep_tasks);
}

/* checked makes sure the log may be trusted for outcome; false when the drive must end
 * unsettled instead. */
static bool checked(struct drive *d, Cflue__V1__Outcome outcome)
{
    bool have_records = d->log_loaded || dstore_load(d) == CF_OK;
    d->log_loaded = have_records;
    if (outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED) {
        if (!have_records) {
            return false;
        }
        if (!d->compact_request && !settle_answered(d)) {
            struct cf_error e;
            cf_error_set(&e, CF_INTERNAL,
                         "the stream does not end with a finished answer; not settling completed");
            drive_fault(d, "settle", &e);
            return false;
        }
    } else if (have_records) {
        settle_repair(d, false);
        if (d->fault.code != CF_OK) {
            return false;
        }
    } else if (drive_transient(d->fault.code)) {
        return false; /* try again when storaged answers: calls need their results */
    }
    /* records storaged cannot give at all (a damaged database) do not keep a failed or
     * aborted outcome from being recorded */
    return true;
}

/* A Settle request and what it points to. */
struct settle_req {
    Cflue__V1__SettleRequest req;
    Cflue__V1__Usage usage;
    Cflue__V1__MarkInputAppliedRequest mark;
    Google__Protobuf__Duration limit;
    char cut[8192];
};

/* settle_request builds the Settle of outcome (error: why, when not completed): the usage of
 * this submission's turns, and the records still pending (the final answer, usually). */
static void settle_request(struct drive *d, Cflue__V1__Outcome outcome, const char *error,
                           struct settle_req *s)
{
    cflue__v1__settle_request__init(&s->req);
    cflue__v1__usage__init(&s->usage);
    s->req.fence = &d->fence;
    s->req.usage = &s->usage;
    s->req.outcome = outcome;
    if (error) { /* storaged refuses an error that is not UTF-8: a provider's text may not be */
        struct buf clean;
        snprintf(s->cut, sizeof(s->cut), "%s", dstore_utf8(error, &clean));
        buf_cleanup(&clean);
        s->cut[utf8_prefix_len(s->cut, strlen(s->cut), SETTLE_ERROR_MAX)] = '\0';
    }
    s->req.error =
        outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? "" : (error ? s->cut : "failed");
    for (size_t i = 0; i < d->log.n; i++) {
        const Cflue__V1__AssistantMessage *am = own_assistant(d, d->log.recs[i]);
        if (am && am->usage) { /* each within 0..LLM_TOKENS_MAX: no sum of them overflows */
            s->usage.input_tokens += am->usage->input_tokens;
            s->usage.output_tokens += am->usage->output_tokens;
            s->usage.cost_usd += am->usage->cost_usd;
        }
    }
    if (s->usage.cost_usd > CATALOG_COST_MAX) {
        s->usage.cost_usd = CATALOG_COST_MAX;
    }
    s->req.records = rlog_pending(&d->log, &s->req.n_records);
    if (d->mark_pending && s->req.n_records) {
        /* the input held for the first answer, which ends the work (dstore_write_behind_held) */
        s->req.mark_input_applied = dstore_mark(d, &s->mark, &s->limit);
    }
}

/* settle_answered_with takes the Settle's end (rc; resp on CF_OK, freed here): the outcome
 * recorded, local waits answered; or the drive ends without it. */
static enum drive_end settle_answered_with(struct drive *d, enum cf_status rc,
                                           ProtobufCMessage *resp, Cflue__V1__Outcome outcome,
                                           const char *error)
{
    char q[600];
    if (rc != CF_OK) {
        rlog_drop_pending(&d->log);
        log_warn("settle_failed", "submission=%s err=%s reason=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), d->err.msg), cf_error_reason(&d->err));
        if (rc == CF_PRECONDITION) {
            /* settled already with another outcome, or no longer this attempt's to settle:
             * nothing this attempt can write any more */
            drive_mark_lease_lost(d);
        } else if (rc != CF_STALE) {
            drive_fault(d, "settling failed", &d->err);
        }
        return settle_ended(d);
    }
    failpoint_hit("agentd.settle.after");
    Cflue__V1__SettleResponse *sr = (Cflue__V1__SettleResponse *)resp;
    dstore_settled_hints(d, sr);
    const char *name = outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? "completed"
                       : outcome == CFLUE__V1__OUTCOME__OUTCOME_FAILED  ? "failed"
                                                                        : "aborted";
    stats_settled(name, sr->n_settled_with);
    log_info(
        "settled", "submission=%s outcome=%s joined=%zu err=%s", d->sub->submission_id, name,
        sr->n_settled_with,
        log_quote(q, sizeof(q), outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED ? "" : error));
    if (sr->submission) {
        here_settled(sr->submission, sr->settled_with, sr->n_settled_with); /* local waits */
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return DRIVE_SETTLED;
}

/* send_settle sends the Settle of d->settling as the drive's Store call in flight. */
static void send_settle(struct drive *d)
{
    struct settle_req s;
    settle_request(d, d->settling, d->settling_error, &s);
    dstore_flight_send(d, "Settle", &s.req.base, &cflue__v1__settle_response__descriptor,
                       s.req.n_records);
}

bool settle_start(struct drive *d, Cflue__V1__Outcome outcome, const char *error,
                  enum drive_end *end)
{
    if (!checked(d, outcome)) {
        *end = settle_ended(d);
        return false;
    }
    d->settling = outcome;
    d->settling_error = error;
    if ((d->log.pending_bytes > DSTORE_APPEND_BYTES_MAX || d->log.n_pending > PROTO_RECORDS_MAX) &&
        dstore_flush(d) != CF_OK) {
        /* too much for the Settle to carry (a failure path with large results unwritten):
         * appended first, a rare blocking call; a failed one is a fault like any Append's */
        *end = settle_ended(d);
        return false;
    }
    failpoint_hit("agentd.settle.before");
    pthread_mutex_lock(&g_agentd.mu);
    d->act->settle_sent = true;
    pthread_mutex_unlock(&g_agentd.mu);
    send_settle(d);
    return true;
}

bool settle_poll(struct drive *d, enum drive_end *end)
{
    enum cf_status rc;
    ProtobufCMessage *resp;
    switch (dstore_flight_take(d, send_settle, &rc, &resp)) {
    case FLIGHT_WAITING:
        return false;
    case FLIGHT_ENDED:
        *end = settle_answered_with(d, rc, resp, d->settling,
                                    d->settling_error ? d->settling_error : "failed");
        return true;
    case FLIGHT_IDLE:
    default:
        /* nothing in flight: only a drive that never sent its Settle gets here */
        *end = settle_ended(d);
        return true;
    }
}

bool settle_unsettled_start(struct drive *d, enum drive_end *end)
{
    enum cf_status code = d->fault.code;
    if (drive_lost_or_down(d)) {
        *end = settle_ended(d);
        return false;
    }
    if (drive_abort_seen(d)) {
        /* the abort is what counts now (a store failure comes back here on the next try) */
        cf_error_clear(&d->fault);
        return settle_start(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request", end);
    }
    if (code != CF_INVALID && code != CF_EXISTS) {
        if (!d->store_down) {
            /* interrupted (toold failed, say) with storaged answering: what the drive wrote is
             * stored first (the input stamped applied, budgets installed), so the next
             * attempt builds on it and counts against the agent's own max_attempts */
            (void)dstore_flush(d);
        }
        *end = settle_ended(d);
        return false;
    }
    snprintf(d->error, sizeof(d->error), "cannot go on: %s", d->fault.msg);
    cf_error_clear(&d->fault);
    return settle_start(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED, d->error, end);
}
