/* drive.c - driving one claimed submission, as a small state machine.
 *
 * Everything that matters is a record in the conversation's stream, written through storaged
 * under the attempt's fence; agentd keeps nothing else. Record ids are deterministic per
 * submission and turn (input:<sub>, assistant:<sub>:<turn>, tool:<sub>:<turn>:<call>), so a
 * later attempt recognizes what an earlier one finished and never repeats it: the input is
 * appended once; a turn whose assistant_message exists is not asked again; a tool call whose
 * tool_result exists is not run again, and one without a result when an attempt resumes gets
 * the outcome-unknown result; a stream cut off mid-message leaves only assistant_delta
 * records, which are for watchers: the turn is simply asked again.
 *
 * The states (enum drive_state), each a function that returns the next:
 *
 *   START --> LOAD_WAIT --> INPUT --> PROMPT(_WAIT) --> JOIN --> MODEL(_WAIT) --> TOOLS(_WAIT)
 *                                          |                      | ^         --> JOIN ...
 *                                          |                      v |     (no calls: JOIN)
 *                                          +----------------> COMPACT(_WAIT)
 *                                                    (size, overflow, or a Compact request)
 *   any state --> SETTLE --> SETTLE_WAIT --> DONE   (or straight to DONE: no outcome to record,
 *                                                     or one recorded on a rarer path)
 *
 *  - START: the agent and the attempt budget (checked before anything that can fail), the
 *    conversation's reading started (none when the claim saw it empty);
 *  - LOAD_WAIT: parked on its pages, read once into the record log; then an earlier
 *    attempt's half-joins settled and its finished answer recognized (takeover);
 *  - INPUT: the input written (pending: stored beside the first model call, or with its
 *    answer, by the Append or Settle that stamps it applied, installing the budgets),
 *    unresolved calls repaired;
 *  - PROMPT(_WAIT): the tool set listed and the sandbox looked at in one Sandbox.Glance (the
 *    drive parked meanwhile), the system prompt frozen (a sandboxed agent never reaches the
 *    model without its tool set, nor a prompt composed from a partial environment); a
 *    sandbox whose replica is out of DNS and not answering is waited for here (replica_wait);
 *  - JOIN: queued messages join; with nothing new and no calls run, the work is finished;
 *  - MODEL: the turn's context built from the log (compacting first when it is too large),
 *    the model asked, its answer recorded; COMPACT when it overflowed (once per drive);
 *  - COMPACT(_WAIT): the older part's summary asked of the model (the drive parked meanwhile),
 *    then recorded with a recomposed system prompt;
 *  - TOOLS(_WAIT): the answer's calls run as one batch (the drive parked meanwhile), results
 *    recorded as they arrive;
 *  - SETTLE(_WAIT): the outcome recorded (the drive parked on the Settle), or the drive ends
 *    stopped or interrupted (settle.c).
 *
 * A drive is stepped by the engine (engine.c) on one of its few threads. A model call does
 * not hold that thread: MODEL starts it on the model I/O loop and the drive parks in
 * MODEL_WAIT (d->parked) until the call's end (or an abort, or a retry's backoff timer) posts
 * it back; model_done then takes the answer. A tool batch does not hold it either: TOOLS starts
 * the batch and the drive parks in TOOLS_WAIT, posted by each result and by the batch's end.
 * Nor does a compaction's summary (COMPACT_WAIT), the conversation's pages (LOAD_WAIT) or the
 * first turn's Glance to toold (PROMPT_WAIT). Appends do not hold it either: the
 * first turn's input, an answer's calls before they run, tool results as they arrive and a
 * batch's last results beside the next model call (or with its answer, when it comes within
 * --hold-writes-ms) go out as one Append at a time per drive (dstore_stored,
 * dstore_write_behind, dstore_write_behind_held), and a drive that must wait parks until the
 * Append's end posts it. The Settle of an outcome goes out the same way. The other Store
 * calls (reading the conversation, joins, compaction, settlements on the rarer paths) block the
 * engine thread for their (short) duration, and only once no call is in flight. A drive ends in one
 * of three ways (enum drive_end): settled; stopped (lease lost or shutdown: whoever holds the work
 * next continues it); interrupted (storaged or toold failed past the retry window; the first
 * failure is kept in d->fault and the work is claimed again later, each attempt counting against
 * max_attempts).
 *
 * Tracing: a drive carries its submission's trace (Submission.traceparent, kept by storaged
 * since the Submit) with a span id of its own, so every attempt, on whatever agentd takes the
 * work over, logs the same trace id. The engine makes it the thread's current trace while it
 * steps the drive (trace.h): the lines logged, the Store, toold and tool-server calls, the
 * model's and MCP servers' requests started then all carry it. Callbacks on the loops only
 * post the drive, so no other drive's lines can pick it up.
 */
#include "drive.h"
#include "clock.h"
#include "engine.h"
#include "failpoint.h"
#include "log.h"
#include "mem.h"
#include "pbtime.h"
#include "placement.h"
#include "settled_here.h"
#include "stats.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPLICA_WAIT_POLL_MS 1000   /* a drive waiting for its replica looks again this often */
#define REPLICA_BACK_GRACE_MS 10000 /* and has it answer within this long of its return */

/* ---------- the drive's flags ---------- */

bool drive_stopped(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool s = d->act->abort_requested || d->act->lease_lost || d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    return s;
}

bool drive_abort_seen(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool a = d->act->abort_requested;
    pthread_mutex_unlock(&g_agentd.mu);
    return a;
}

void drive_mark_lease_lost(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    d->act->lease_lost = true;
    pthread_mutex_unlock(&g_agentd.mu);
}

bool drive_lost_or_down(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool b = d->act->lease_lost || d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    return b;
}

bool drive_broken(struct drive *d)
{
    return d->fault.code != CF_OK || drive_lost_or_down(d);
}

bool drive_halted(struct drive *d)
{
    return d->fault.code != CF_OK || drive_stopped(d);
}

void drive_fault(struct drive *d, const char *what, const struct cf_error *e)
{
    if (d->fault.code != CF_OK) {
        return;
    }
    char q[600];
    cf_error_set(&d->fault, e->code != CF_OK ? e->code : CF_UNAVAILABLE, "%s: %s", what, e->msg);
    log_warn("drive_fault", "submission=%s attempt=%s err=%s", d->sub->submission_id,
             d->fence.attempt_id, log_quote(q, sizeof(q), d->fault.msg));
}

int64_t drive_time_left(struct drive *d)
{
    return d->timeout_at_mono_ms ? d->timeout_at_mono_ms - clock_mono_ms() : INT64_MAX;
}

void drive_set_deadline(struct drive *d, const Cflue__V1__Submission *sub)
{
    int64_t deadline_ms = pbtime_ms(sub->deadline);
    if (deadline_ms <= 0) {
        d->timeout_at_mono_ms = 0;
        return;
    }
    int64_t left = deadline_ms - pbtime_ms(sub->start_time);
    /* always a claim's time by now; without one, this host's clock is all there is */
    if (!sub->start_time) {
        left = deadline_ms - clock_now_ms() + (clock_mono_ms() - d->claimed_mono_ms);
    }
    int64_t at = d->claimed_mono_ms + left;
    d->timeout_at_mono_ms = at != 0 ? at : -1; /* 0 means none: one that fell on it has passed */
}

bool drive_transient(enum cf_status rc)
{
    return rc == CF_UNAVAILABLE || rc == CF_BUSY;
}

/* ---------- the states ---------- */

#define TIME_LIMIT_ERROR "ran past its time limit before the work was finished"

/* ended records how the drive ended (an outcome was recorded, or it stopped short). */
static enum drive_state ended(struct drive *d, enum drive_end end)
{
    d->end = end;
    return DRIVE_DONE;
}

/* failed makes SETTLE record a failed outcome saying why. */
static enum drive_state failed(struct drive *d, const char *why)
{
    d->outcome = CFLUE__V1__OUTCOME__OUTCOME_FAILED;
    snprintf(d->error, sizeof(d->error), "%s", why);
    return DRIVE_SETTLE;
}

/* settling sends the Settle of outcome (the drive parks on it), or ends the drive at once
 * when it cannot be recorded. */
static enum drive_state settling(struct drive *d, Cflue__V1__Outcome outcome, const char *error)
{
    enum drive_end end;
    return settle_start(d, outcome, error, &end) ? DRIVE_SETTLE_WAIT : ended(d, end);
}

/* unsettled ends a drive that stopped short of an outcome: settled aborted or failed when it
 * must be (the drive parks on the Settle), else stopped or interrupted at once. */
static enum drive_state unsettled(struct drive *d)
{
    enum drive_end end;
    return settle_unsettled_start(d, &end) ? DRIVE_SETTLE_WAIT : ended(d, end);
}

static bool has_input(struct drive *d)
{
    char id[256];
    snprintf(id, sizeof(id), "input:%s", d->sub->submission_id);
    return rlog_find(&d->log, id) != NULL;
}

/* past_attempts settles work that was interrupted more often than its budget allows: its
 * finished answer if the stream (read by now) holds one, else aborted or failed. */
static enum drive_state past_attempts(struct drive *d)
{
    if (settle_answered(d)) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, NULL);
    }
    if (drive_abort_seen(d)) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    snprintf(d->error, sizeof(d->error),
             "gave up after %d attempts: the work was interrupted each time",
             d->sub->attempt_count - 1);
    return settling(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED, d->error);
}

/* pick_model sets the model d calls: its agent's, or for a subagent without one the model its
 * parent handed down (checked again here: storaged only bounds it). false, with d->error,
 * when there is none. */
static bool pick_model(struct drive *d)
{
    const Cflue__V1__Delegation *dg = d->sub->delegation;
    const char *m = d->agent->model ? d->agent->model : dg && *dg->model ? dg->model : NULL;
    struct cf_error e;
    size_t plen = 0;
    if (!m) {
        snprintf(d->error, sizeof(d->error),
                 "agent %s names no model of its own and no parent handed it one: an agent "
                 "without a model can only run as a subagent",
                 d->agent->name);
        return false;
    }
    if (agents_model_check(m, &plen, &e) != CF_OK || plen >= sizeof(d->provider)) {
        snprintf(d->error, sizeof(d->error), "the model handed down by the parent: %s",
                 plen >= sizeof(d->provider) ? "unknown provider" : e.msg);
        return false;
    }
    d->model = m;
    memcpy(d->provider, m, plen);
    d->provider[plen] = '\0';
    d->model_id = m + plen + 1;
    return true;
}

/* bind_limits sets d's limits on the sandbox's commands from the agent's definition or, for
 * a child in its parent's sandbox, the parent's (shared: NULL for its own sandbox). */
static void bind_limits(struct drive *d, const Cflue__V1__CommandLimits *shared)
{
    Cflue__V1__CommandLimits *l = &d->limits_buf;
    cflue__v1__command_limits__init(l);
    google__protobuf__duration__init(&d->limits_cpu);
    d->limits = NULL;
    if (shared) {
        l->memory_bytes = shared->memory_bytes;
        l->processes = shared->processes;
        l->file_size_bytes = shared->file_size_bytes;
        l->disk_bytes = shared->disk_bytes;
        if (shared->cpu_time) {
            d->limits_cpu.seconds = shared->cpu_time->seconds;
            d->limits_cpu.nanos = shared->cpu_time->nanos;
            l->cpu_time = &d->limits_cpu;
        }
        d->limits = l;
        return;
    }
    const struct agent_limits *a = &d->agent->sandbox_limits;
    if (!a->cpu_s && !a->memory_mib && !a->procs && !a->file_mib && !a->disk_mib) {
        return;
    }
    l->memory_bytes = a->memory_mib << 20;
    l->processes = (int32_t)a->procs;
    l->file_size_bytes = a->file_mib << 20;
    l->disk_bytes = a->disk_mib << 20;
    if (a->cpu_s) {
        d->limits_cpu.seconds = a->cpu_s;
        l->cpu_time = &d->limits_cpu;
    }
    d->limits = l;
}

/* bind sets what d takes from definitions defs: its agent and the sandbox it works in. false
 * when defs has no agent of that name (nothing is changed). */
static bool bind(struct drive *d, struct agent_defs *defs)
{
    const Cflue__V1__Delegation *dg = d->sub->delegation;
    const struct agent_def *a = agents_find(&defs->agents, d->sub->agent);
    if (!a) {
        return false;
    }
    d->agent = a;
    d->tools_addr = d->tools_spec = NULL;
    d->limits = NULL;
    d->workspace[0] = '\0';
    d->cwd[0] = '\0';
    if (d->agent->sandbox_tools) {
        const char *ws = d->agent->sandbox_workspace;
        snprintf(d->workspace, sizeof(d->workspace), "%s",
                 !ws                             ? d->agent->name
                 : !strcmp(ws, "{conversation}") ? d->sub->conversation_id
                                                 : ws);
        /* the replica holding the workspace; a dns: name with none known yet stays as it is,
         * and tools_channel refuses it (tools_no_channel says why) */
        d->tools_spec = d->agent->sandbox_tools;
        d->tools_addr = placement_pick(d->tools_spec, d->workspace, NULL);
        if (!d->tools_addr) {
            d->tools_addr = d->agent->sandbox_tools;
        }
        bind_limits(d, NULL);
    } else if (d->agent && dg && *dg->sandbox_tools) {
        /* a subagent without a sandbox of its own works in its parent's, on the parent's
         * replica; the parent's dns: name lets it wait for that replica as the parent would */
        d->tools_addr = dg->sandbox_tools;
        d->tools_spec = *dg->sandbox_placement ? dg->sandbox_placement : NULL;
        snprintf(d->workspace, sizeof(d->workspace), "%s", dg->sandbox);
        snprintf(d->cwd, sizeof(d->cwd), "%s", dg->cwd); /* scoped to a directory of it */
        if (dg->sandbox_limits) {
            bind_limits(d, dg->sandbox_limits);
        }
    }
    return true;
}

static enum drive_state step_start(struct drive *d)
{
    const Cflue__V1__Delegation *dg = d->sub->delegation;
    d->defs = defs_get();
    d->depth = dg ? dg->depth : 0;
    (void)bind(d, d->defs);     /* no agent: settled failed once the stream is read */
    (void)dstore_load_start(d); /* any settlement checks the stream: read it first */
    return DRIVE_LOAD_WAIT;
}

/* rebound takes up definitions reloaded since the drive took its own, at a turn boundary:
 * what pointed into the old ones (the tool set, the servers, the model) is let go, to be made
 * again by the prompt stage, which tells the model what changed. false when nothing was
 * reloaded, or the reload dropped this agent (the drive goes on with what it has). */
static bool rebound(struct drive *d)
{
    if (defs_generation() == d->defs->generation) {
        return false;
    }
    struct agent_defs *now = defs_get(), *old = d->defs;
    if (!agents_find(&now->agents, d->sub->agent)) {
        defs_put(now);
        return false;
    }
    tools_cleanup(d);
    servers_cleanup(d);
    servers_init(d);
    skills_free(&d->ws_skills);
    memset(&d->ws_skills, 0, sizeof(d->ws_skills));
    d->defs = now;
    (void)bind(d, now);
    d->model = NULL;
    defs_put(old);
    log_info("drive_rebound", "submission=%s turn=%d generation=%llu", d->sub->submission_id,
             d->turn, (unsigned long long)now->generation);
    return true;
}

static enum drive_state loaded(struct drive *d);

static enum drive_state step_load_wait(struct drive *d)
{
    switch (dstore_load_take(d)) {
    case LOAD_WAITING:
        d->parked = true; /* the page's end (or its retry timer) posts the drive */
        return DRIVE_LOAD_WAIT;
    case LOAD_FAILED:
        return unsettled(d);
    case LOAD_DONE:
        break;
    }
    d->log_loaded = true;
    if (!d->agent) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED,
                        "this agentd has no agent with that name");
    }
    if (!pick_model(d)) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED, d->error);
    }
    /* attempts first: whatever fails later, this attempt has been counted */
    if (d->sub->max_attempts && d->sub->attempt_count > d->sub->max_attempts) {
        return past_attempts(d);
    }
    if (d->takeover) {
        joins_recover_start(d);
        return DRIVE_RECOVER_WAIT;
    }
    return loaded(d);
}

/* step_recover_wait parks a takeover until an earlier attempt's half-joins are settled; then
 * its finished answer, if the stream holds one, settles it. */
static enum drive_state step_recover_wait(struct drive *d)
{
    int joined;
    if (!joins_take(d, &joined)) {
        d->parked = true;
        return DRIVE_RECOVER_WAIT;
    }
    if (drive_broken(d)) {
        return unsettled(d);
    }
    if (settle_answered(d)) {
        log_info("recovered_answer", "submission=%s", d->sub->submission_id);
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, NULL);
    }
    return loaded(d);
}

/* loaded goes on with a conversation read (and recovered): the budgets checked, the abort
 * seen before the work started. */
static enum drive_state loaded(struct drive *d)
{
    rlog_trim(&d->log, d->sub->submission_id);
    if (drive_time_left(d) <= 0) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_FAILED,
                        "the submission ran past its time limit");
    }
    d->compact_request = d->sub->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
    if (drive_abort_seen(d) && !has_input(d)) {
        /* aborted before it started: its message never enters the conversation */
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED,
                        "aborted on request before it started");
    }
    return DRIVE_INPUT;
}

static enum drive_state step_input(struct drive *d)
{
    if (!d->compact_request && !has_input(d)) {
        char id[256];
        snprintf(id, sizeof(id), "input:%s", d->sub->submission_id);
        (void)dstore_append_input(d, id, d->sub); /* pending: goes with the first model call */
    }
    d->mark_pending = true; /* stamped applied by the Append (or Settle) storing the input */
    if (!d->sub->input_apply_time && d->sub->start_time && d->agent->timeout_ms > 0) {
        /* the limit the stamp installs (storaged: this attempt's start plus the agent's limit),
         * in force before its answer: the first model call goes out beside the stamp */
        d->timeout_at_mono_ms = d->claimed_mono_ms + d->agent->timeout_ms;
    }
    if (!drive_halted(d)) {
        settle_repair(d, true);
    }
    if (drive_abort_seen(d)) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    if (drive_halted(d)) {
        return unsettled(d);
    }
    return DRIVE_PROMPT;
}

/* moved_to takes up the placement of a sandbox whose replica was given up: addr (non-NULL),
 * where it is placed now, when that is not d->tools_addr. Returns whether it moved. */
static bool moved_to(struct drive *d, const char *addr)
{
    if (addr == d->tools_addr || (d->tools_addr && !strcmp(addr, d->tools_addr))) {
        return false;
    }
    log_info("sandbox_replica_moved", "submission=%s sandbox=%s from=%s to=%s",
             d->sub->submission_id, d->workspace, d->tools_addr, addr);
    d->tools_addr = addr;
    return true;
}

/* step_prompt asks toold for the tool set and the sandbox (one Glance); a drive waiting for
 * its replica (replica_wait) asks only once the lookups find it again or it was given up. */
static enum drive_state step_prompt(struct drive *d)
{
    if (d->replica_wait_ms && !d->replica_back_ms) {
        if (drive_stopped(d)) {
            return DRIVE_SETTLE; /* aborted, lease lost or shutting down: no call to make */
        }
        bool missing = false;
        const char *addr = placement_pick(d->tools_spec, d->workspace, &missing);
        if (missing && drive_time_left(d) > 0) {
            engine_post_at(d, clock_mono_ms() + REPLICA_WAIT_POLL_MS);
            d->parked = true; /* the timer, or an abort, posts the drive */
            return DRIVE_PROMPT;
        }
        if (!missing && addr) {
            (void)moved_to(d, addr); /* given up meanwhile: the sandbox is placed elsewhere */
        }
        d->replica_back_ms = clock_mono_ms();
    }
    prompt_start(d);
    return DRIVE_PROMPT_WAIT;
}

/* replica_wait: toold could not be reached for the Glance. When the sandbox's
 * replica is out of DNS for the moment (a toold pod restarting: placement.h), the drive waits
 * for it instead of ending interrupted, on a timer and holding its lease, and asks again once
 * the lookups find it (allowing REPLICA_BACK_GRACE_MS for the reconnect): each retry of an
 * interrupted drive is a new attempt, and the attempts would run out before a replica that is
 * back within its linger. A replica given up meanwhile places the sandbox elsewhere: the drive
 * asks there at once. true: ask again (parked when waiting); false: end as before (an abort, a
 * lost lease or a shutdown, the time limit, a replica in DNS that does not answer). */
static bool replica_wait(struct drive *d)
{
    if (!d->glance_unreached || !d->tools_spec || drive_stopped(d) || drive_time_left(d) <= 0) {
        return false;
    }
    bool missing = false;
    const char *addr = placement_pick(d->tools_spec, d->workspace, &missing);
    int64_t now = clock_mono_ms();
    if (!addr) {
        return false;
    }
    if (!missing && moved_to(d, addr)) {
        d->replica_back_ms = d->replica_wait_ms ? now : 0;
        cf_error_clear(&d->fault);
        return true;
    }
    if (!missing && (!d->replica_back_ms || now - d->replica_back_ms > REPLICA_BACK_GRACE_MS)) {
        return false;
    }
    if (missing) {
        if (!d->replica_wait_ms) {
            d->replica_wait_ms = now;
            log_info("sandbox_replica_wait",
                     "submission=%s sandbox=%s replica=%s note=\"out of DNS and not answering: "
                     "waiting for it to come back or be given up\"",
                     d->sub->submission_id, d->workspace, d->tools_addr);
        }
        d->replica_back_ms = 0;
    }
    cf_error_clear(&d->fault);
    engine_post_at(d, now + REPLICA_WAIT_POLL_MS);
    d->parked = true; /* the timer, or an abort, posts the drive */
    return true;
}

static enum drive_state step_prompt_wait(struct drive *d)
{
    if (!prompt_take(d)) {
        d->parked = true; /* the call's end posts the drive */
        return DRIVE_PROMPT_WAIT;
    }
    if (!d->system_text) {
        return replica_wait(d) ? DRIVE_PROMPT : DRIVE_SETTLE;
    }
    if (d->replica_wait_ms) {
        log_info("sandbox_replica_back", "submission=%s sandbox=%s replica=%s waited_ms=%lld",
                 d->sub->submission_id, d->workspace, d->tools_addr,
                 (long long)(clock_mono_ms() - d->replica_wait_ms));
        d->replica_wait_ms = d->replica_back_ms = 0;
    }
    if (d->compact_request) {
        /* a Compact request: compact now, whatever the size, and answer nothing else */
        d->trigger = CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST;
        return DRIVE_COMPACT;
    }
    d->turn = 1; /* the next turn: one past those already recorded */
    for (size_t i = 0; i < d->log.n; i++) {
        const Cflue__V1__Record *r = d->log.recs[i];
        d->turn += r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE &&
                   !strcmp(r->submission_id, d->sub->submission_id);
    }
    /* an earlier attempt stopped while subagents worked for it: wait for them again */
    return task_resume(d) ? DRIVE_TOOLS : DRIVE_JOIN;
}

/* step_join lets queued messages join: before the first turn, and after each turn (unless
 * the drive halted). The work is finished when the last turn ran no calls and none joined. */
static enum drive_state step_join(struct drive *d)
{
    bool first = !d->joined_once;
    d->joined_once = true;
    if (!first && drive_halted(d)) {
        return DRIVE_SETTLE;
    }
    if (!first && d->more && d->rebinds < DRIVE_REBINDS_MAX && rebound(d)) {
        /* reloaded definitions: the tool set and the model again, and the changes told */
        d->rebinds++;
        if (!pick_model(d)) {
            char why[sizeof(d->error)];
            snprintf(why, sizeof(why), "%s", d->error);
            return failed(d, why);
        }
        return DRIVE_PROMPT;
    }
    if (joins_start(d)) {
        d->joining.before_first_turn = first;
        return DRIVE_JOIN_WAIT;
    }
    return first || d->more ? DRIVE_MODEL : DRIVE_SETTLE;
}

/* step_join_wait parks the drive until the joining is over. */
static enum drive_state step_join_wait(struct drive *d)
{
    int joined;
    if (!joins_take(d, &joined)) {
        d->parked = true;
        return DRIVE_JOIN_WAIT;
    }
    d->more = d->more || joined > 0;
    return d->joining.before_first_turn || d->more ? DRIVE_MODEL : DRIVE_SETTLE;
}

/* model_failed settles a model call that gave no answer: stopped, past the time limit, or the
 * provider's error. */
static enum drive_state model_failed(struct drive *d, enum cf_status rc)
{
    char why[CF_ERROR_MSG_MAX + 32];
    if (rc == CF_CANCELLED || drive_halted(d)) {
        return DRIVE_SETTLE;
    }
    if (rc == CF_DEADLINE) {
        return failed(d, TIME_LIMIT_ERROR);
    }
    snprintf(why, sizeof(why), "model call failed: %s", d->err.msg);
    return failed(d, why);
}

/* tighten_fit: after a context overflow that compaction did not mend (nothing older to
 * compact, or still too long), the estimate fell short of the provider's count for this
 * conversation: requests are fitted to half the room from now on, and the turn asked again
 * once. false when that was done already (or the drive stops): the overflow fails it. */
static bool tighten_fit(struct drive *d)
{
    if (d->fit_tightened || d->fault.code != CF_OK || drive_halted(d)) {
        return false;
    }
    d->fit_tightened = true;
    log_warn("context_fit_tightened", "submission=%s turn=%lld", d->sub->submission_id,
             (long long)d->turn);
    return true;
}

/* model_done handles the model's answer (in d->answer): recorded as the turn's assistant
 * message, then its calls run (TOOLS) or the next queued messages join (JOIN). */
static enum drive_state model_done(struct drive *d, enum cf_status rc)
{
    d->model_rc = rc;
    if (rc != CF_OK && d->answer.context_overflow && !d->overflow_retried) {
        /* the provider says the context is too long: compact once, then ask again */
        d->overflow_retried = true;
        d->trigger = CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW;
        return DRIVE_COMPACT;
    }
    if (rc != CF_OK && d->answer.context_overflow && tighten_fit(d)) {
        return DRIVE_MODEL; /* compacted, still too long: once more, fitted tighter */
    }
    if (rc != CF_OK || drive_halted(d)) {
        return model_failed(d, rc);
    }
    failpoint_hit("agentd.model.after");
    if (model_record_answer(d, &d->answer) != CF_OK) {
        return DRIVE_SETTLE;
    }
    d->more = d->answer.n_calls > 0;
    if (d->more && drive_time_left(d) <= 0) {
        /* the answer came at the limit: its calls are not started at all */
        for (size_t i = 0; i < d->answer.n_calls && d->fault.code == CF_OK; i++) {
            tools_record_result(d, (int)i, d->answer.calls[i].id, d->answer.calls[i].name,
                                "This call was not run: the submission reached its time limit.",
                                true, NULL, false);
        }
        d->turn++;
        return failed(d, TIME_LIMIT_ERROR);
    }
    if (d->more) {
        return DRIVE_TOOLS;
    }
    d->turn++;
    return DRIVE_JOIN;
}

/* step_model asks the model for the next turn, compacting first when the context is too
 * large (once per turn). The turn's records not stored yet (the input and its stamp on the
 * first turn, the tool results on later ones) are written behind while the model is asked
 * (after waiting --hold-writes-ms for the answer, which goes out with them when it comes
 * sooner): an answer is only ever appended after them, so a crash between the
 * two loses the answer with them, and the stream never holds one without the other; a write
 * that fails for good cancels the call. Only a stamp with no record to carry it (a recovery
 * whose input is stored) is waited for; the time limit the stamp installs is in force already
 * (step_input). */
static enum drive_state step_model(struct drive *d)
{
    size_t pending;
    d->more = false;
    d->rebinds = 0;
    if (!drive_halted(d) && d->mark_pending && !rlog_pending(&d->log, &pending) &&
        !dstore_stored(d)) {
        d->parked = true;
        return DRIVE_MODEL;
    }
    if (drive_halted(d)) {
        return DRIVE_SETTLE;
    }
    if (d->turn > d->agent->max_turns) {
        char why[256];
        snprintf(why, sizeof(why),
                 "stopped after %lld model turns, the most this agent may take for one "
                 "message (durability.max_turns); the work is not finished",
                 (long long)d->agent->max_turns);
        return failed(d, why);
    }
    if (drive_time_left(d) < DRIVE_MODEL_MIN_MS) {
        return failed(d, TIME_LIMIT_ERROR);
    }
    struct context ctx = {0};
    dstore_build_context(d, &ctx, INT64_MAX);
    bool over =
        d->fault.code == CF_OK &&
        compaction_needed(d, context_tokens(d->system_text, &ctx, d->tools.tools, d->tools.n));
    if (over && !d->threshold_checked) {
        context_free(&ctx);
        d->threshold_checked = true;
        d->trigger = CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_THRESHOLD;
        return DRIVE_COMPACT;
    }
    d->threshold_checked = false;
    if (drive_halted(d)) {
        context_free(&ctx);
        return DRIVE_SETTLE;
    }
    if (over || d->fit_tightened) {
        compaction_fit(d, &ctx, d->system_text, true); /* what compaction could not make small */
    }
    dstore_write_behind_held(d);
    model_call_start(d, d->system_text, &ctx, d->tools.tools, d->tools.n);
    return DRIVE_MODEL_WAIT;
}

/* step_model_wait parks the drive until its model call (retries included) has finished,
 * taking the end of the records written behind meanwhile (or retrying them). */
static enum drive_state step_model_wait(struct drive *d)
{
    enum cf_status rc;
    (void)dstore_writes_done(d);
    (void)dstore_release_held(d, drive_halted(d));
    if (!model_call_poll(d, &rc)) {
        d->parked = true;
        return DRIVE_MODEL_WAIT;
    }
    d->hold_until_ms = 0; /* what is still pending goes out with the answer */
    return model_done(d, rc);
}

/* compacted goes on from a compaction that is over, by what triggered it. */
static enum drive_state compacted(struct drive *d, enum compact_result cr)
{
    switch (d->trigger) {
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST:
        if (cr == COMPACT_FAILED && d->fault.code == CF_OK && !drive_stopped(d)) {
            char why[CF_ERROR_MSG_MAX + 32];
            snprintf(why, sizeof(why), "the compaction failed: %s", d->err.msg);
            return failed(d, why);
        }
        /* the request could not be done: it says so, with no record written */
        if (cr == COMPACT_NOTHING || cr == COMPACT_NOTHING_OVERSIZED) {
            return failed(d, cr == COMPACT_NOTHING ? AGENTD_NOTHING_TO_COMPACT
                                                   : AGENTD_NOTHING_TO_COMPACT_OVERSIZED);
        }
        return DRIVE_SETTLE;
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW:
        return cr == COMPACT_DONE || (cr != COMPACT_FAILED && tighten_fit(d))
                   ? DRIVE_MODEL
                   : model_failed(d, d->model_rc);
    default:
        return DRIVE_MODEL; /* threshold: ask with what there is now */
    }
}

static enum drive_state step_compact(struct drive *d)
{
    enum compact_result over;
    if (!dstore_stored(d)) {
        d->parked = true; /* the cut is chosen by offset: what is pending needs its own */
        return DRIVE_COMPACT;
    }
    return compaction_start(d, &over) ? DRIVE_COMPACT_WAIT : compacted(d, over);
}

/* step_compact_wait parks the drive until the compaction is over: the summary call (retries
 * included), the Glance for the new prompt, and the Append of both records. */
static enum drive_state step_compact_wait(struct drive *d)
{
    enum compact_result cr;
    if (!compaction_take(d, &cr)) {
        d->parked = true;
        return DRIVE_COMPACT_WAIT;
    }
    return compacted(d, cr);
}

/* step_tools runs the answer's calls; tools_done hands the turn over to JOIN. */
static enum drive_state tools_done(struct drive *d)
{
    llm_response_cleanup(&d->answer);
    llm_response_init(&d->answer);
    d->turn++;
    return DRIVE_JOIN;
}

static enum drive_state step_tools(struct drive *d)
{
    if (!dstore_stored(d)) {
        d->parked = true; /* the calls are durable before they run */
        return DRIVE_TOOLS;
    }
    if (drive_halted(d)) {
        return DRIVE_SETTLE;
    }
    int64_t from = d->claimed_mono_ms + ENGINE_COMMANDS_GONE_MS;
    if (d->commands_cut && clock_mono_ms() < from) {
        engine_post_at(d, from); /* an earlier attempt's commands may still be stopping */
        d->parked = true;
        return DRIVE_TOOLS;
    }
    bool batch = tools_start(d, &d->answer);
    bool tasks = task_start(d, &d->answer);
    return batch || tasks ? DRIVE_TOOLS_WAIT : tools_done(d);
}

/* step_tools_wait parks the drive until the batch is over, recording results as they come:
 * written behind while others still run (watchers see them soon), the last ones with the
 * next model call (step_model). */
static enum drive_state step_tools_wait(struct drive *d)
{
    (void)dstore_writes_done(d); /* first: a write that failed halts the batch now */
    bool batch_over = !d->tw.running || tools_poll(d);
    bool tasks_over = task_poll(d);
    engine_on_children(d, batch_over && !tasks_over);
    if (!batch_over || !tasks_over) {
        if (!tasks_over || !tools_all_answered(d)) {
            dstore_write_behind(d);
        }
        d->parked = true;
        return DRIVE_TOOLS_WAIT;
    }
    return tools_done(d);
}

/* step_settle ends the drive: a lost lease or shutdown (without an abort) and faults end it
 * unsettled; an abort settles aborted; otherwise the outcome the states arrived at. */
static enum drive_state step_settle(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool aborted = d->act->abort_requested, lost = d->act->lease_lost;
    bool down = d->act->shutting_down;
    pthread_mutex_unlock(&g_agentd.mu);
    if (lost || (down && !aborted)) {
        return unsettled(d);
    }
    if (aborted) {
        return settling(d, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "aborted on request");
    }
    if (d->fault.code != CF_OK) {
        return unsettled(d);
    }
    return settling(d, d->outcome, d->error[0] ? d->error : NULL);
}

/* step_settle_wait parks the drive until its Settle is over. */
static enum drive_state step_settle_wait(struct drive *d)
{
    enum drive_end end;
    if (!settle_poll(d, &end)) {
        d->parked = true;
        return DRIVE_SETTLE_WAIT;
    }
    return ended(d, end);
}

static enum drive_state (*const steps[])(struct drive *) = {
    [DRIVE_START] = step_start,
    [DRIVE_LOAD_WAIT] = step_load_wait,
    [DRIVE_RECOVER_WAIT] = step_recover_wait,
    [DRIVE_INPUT] = step_input,
    [DRIVE_PROMPT] = step_prompt,
    [DRIVE_PROMPT_WAIT] = step_prompt_wait,
    [DRIVE_JOIN] = step_join,
    [DRIVE_JOIN_WAIT] = step_join_wait,
    [DRIVE_MODEL] = step_model,
    [DRIVE_MODEL_WAIT] = step_model_wait,
    [DRIVE_COMPACT] = step_compact,
    [DRIVE_COMPACT_WAIT] = step_compact_wait,
    [DRIVE_TOOLS] = step_tools,
    [DRIVE_TOOLS_WAIT] = step_tools_wait,
    [DRIVE_SETTLE] = step_settle,
    [DRIVE_SETTLE_WAIT] = step_settle_wait,
};

/* ---------- one drive ---------- */

/* begin_drive takes a slot in the active table (heartbeats and abort polling see it). */
static bool begin_drive(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < ACTIVE_MAX && !d->act; i++) {
        if (!g_agentd.active[i].in_use) {
            d->act = &g_agentd.active[i];
            g_agentd.active_used = i >= g_agentd.active_used ? i + 1 : g_agentd.active_used;
            memset(d->act, 0, sizeof(*d->act));
            d->act->in_use = true;
            snprintf(d->act->submission_id, sizeof(d->act->submission_id), "%s",
                     d->sub->submission_id);
            snprintf(d->act->attempt_id, sizeof(d->act->attempt_id), "%s", d->fence.attempt_id);
            snprintf(d->act->conversation_id, sizeof(d->act->conversation_id), "%s",
                     d->sub->conversation_id);
            d->act->epoch = d->fence.epoch;
            trace_format(&d->trace, d->act->traceparent);
            d->act->abort_requested = d->sub->abort_request_time != NULL;
            d->act->shutting_down = g_agentd.stopping;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    if (d->act) {
        here_begin(d->sub->submission_id); /* GetSubmission(wait) parks here (settled_here.c) */
    }
    return d->act != NULL;
}

bool drive_lease_held(const struct drive *d, struct active *out)
{
    bool held = false;
    if (d->end == DRIVE_STOPPED && d->act) {
        pthread_mutex_lock(&g_agentd.mu);
        held = d->act->shutting_down && !d->act->lease_lost;
        *out = *d->act;
        pthread_mutex_unlock(&g_agentd.mu);
    }
    return held;
}

static void end_drive(struct drive *d)
{
    if (d->act) {
        pthread_mutex_lock(&g_agentd.mu);
        d->act->in_use = false;
        d->act->drive = NULL;
        d->act->model_call = 0;
        pthread_mutex_unlock(&g_agentd.mu);
        d->act = NULL;
        here_end(d->sub->submission_id); /* waits it did not settle go to storaged */
    }
}

bool drive_sub_trace(const Cflue__V1__Submission *s, struct trace_ctx *out)
{
    struct cf_error ignored;
    if (!s || !*s->traceparent ||
        trace_parse(out, s->traceparent, s->tracestate, &ignored) != CF_OK) {
        memset(out, 0, sizeof(*out));
        return false;
    }
    return true;
}

const struct trace_ctx *drive_trace(const struct drive *d)
{
    return &d->trace;
}

struct drive *drive_new(Cflue__V1__ClaimResponse *claim)
{
    struct drive *d = mem_alloc(sizeof(*d));
    memset(d, 0, sizeof(*d));
    d->claim = claim;
    d->sub = claim->submission;
    d->claimed_mono_ms = clock_mono_ms();
    if (drive_sub_trace(d->sub, &d->trace)) {
        trace_child(&d->trace, &d->trace); /* the same trace, a span of this drive's own */
    } else {
        trace_start(&d->trace); /* admitted without one: a trace for this drive alone */
    }
    struct trace_ctx saved;
    trace_enter(&d->trace, &saved); /* its first lines, on the claimer's or a Submit's thread */
    d->takeover = claim->takeover;
    d->fence = *claim->fence;
    drive_set_deadline(d, d->sub);
    d->queued = claim->queued_behind;
    d->outcome = CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
    rlog_init(&d->log);
    llm_response_init(&d->answer);
    buf_init(&d->delta, 64 * 1024);
    model_call_init(d);
    tools_wait_init(d);
    servers_init(d);
    task_wait_init(d);
    dcall_init(&d->sf.call, d);
    dcall_init(&d->prompt_call, d);
    d->state = DRIVE_START;
    if (!begin_drive(d)) {
        drive_free(d);
        trace_leave(&saved);
        return NULL; /* the lease expires; another claim takes it */
    }
    stats_drive(d->takeover);
    d->turn_mark_us = clock_mono_us();
    log_info("drive", "submission=%s conversation=%s attempt=%s count=%d takeover=%d",
             d->sub->submission_id, d->sub->conversation_id, d->fence.attempt_id,
             d->sub->attempt_count, (int)d->takeover);
    trace_leave(&saved);
    return d;
}

/* waits_with_writes: the states that take the end of the Store call in flight themselves
 * (the conversation's pages, joins, tool results written behind, a compaction's records, the
 * Settle). Every other state starts
 * only when none is in flight, so its blocking Store calls keep the stream's order, and the drive
 * ends only then. */
static bool waits_with_writes(enum drive_state s)
{
    return s == DRIVE_LOAD_WAIT || s == DRIVE_RECOVER_WAIT || s == DRIVE_JOIN_WAIT ||
           s == DRIVE_MODEL_WAIT || s == DRIVE_COMPACT_WAIT || s == DRIVE_TOOLS_WAIT ||
           s == DRIVE_SETTLE_WAIT;
}

bool drive_run(struct drive *d)
{
    d->parked = false;
    while (!d->parked) {
        if (!waits_with_writes(d->state) && !dstore_writes_done(d)) {
            d->parked = true; /* the Append's end or its retry timer posts the drive */
            break;
        }
        if (d->state == DRIVE_DONE) {
            return true;
        }
        d->state = steps[d->state](d);
    }
    return false;
}

enum drive_end drive_end_of(const struct drive *d)
{
    return d->end;
}

void drive_free(struct drive *d)
{
    end_drive(d);
    free(d->system_text);
    free(d->load_token);
    tools_cleanup(d);
    skills_free(&d->ws_skills);
    llm_response_cleanup(&d->answer);
    model_call_cleanup(d);
    tools_wait_cleanup(d);
    servers_cleanup(d);
    task_wait_cleanup(d);
    joins_cleanup(d);
    dstore_cleanup(d);
    dcall_cleanup(&d->sf.call);
    dcall_cleanup(&d->prompt_call);
    buf_cleanup(&d->delta);
    protobuf_c_message_free_unpacked(&d->claim->base, NULL);
    defs_put(d->defs); /* last: tools, skills and servers above point into it */
    free(d);
}
