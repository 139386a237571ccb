/* compaction.c - replacing the older part of a conversation with a summary.
 *
 * When the next request would not leave the reserve free in the model's context window (or
 * the provider said the context overflowed, or someone asked with Compact), the older part of
 * the conversation is replaced by a summary the model writes. The most recent
 * keep_recent_tokens stay verbatim; the cut falls only before a user or assistant message, so
 * a tool call never loses its result. A kept part larger than a request has room for moves the
 * cut later, down to the newest turn (context_choose_cut): one oversized turn must not leave
 * every later compaction with nothing older to summarize. What is still too large is
 * shortened in the request only (compaction_fit: a turn's request and the summary's). The
 * summary and the offset of the first kept record go into a `compaction` record
 * (compaction:<sub>:<n>); the system prompt is composed again (`system_prompt`
 * system:<n + 1>). The record log then drops what the context no longer needs (rlog_trim).
 */
#include "catalog.h"
#include "drive.h"
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEEP_RECENT_DEFAULT 8000

#define SUMMARY_SYSTEM "You write faithful, compact summaries of agent work."
#define SUMMARY_ASK                                                                                \
    "Write a summary of that conversation for your own later use; it will replace those "          \
    "messages. Keep: the user's goals and requests, decisions made and why, facts learned, "       \
    "files read or changed and their current state, commands run and their results, and what "     \
    "is still open. Be complete but brief. Answer with the summary only."

#define SUMMARY_TOKENS_EXPECTED 2000 /* a summary's size, as the cut leaves room for it */
#define TRANSCRIPT_SPARE_TOKENS 256  /* the summary request's ask and tags */

static int64_t reserve_tokens(const struct agent_def *a, const struct model_info *mi)
{
    if (a->reserve_tokens) {
        return a->reserve_tokens;
    }
    if (mi->context_window < 60000) {
        return mi->context_window / 3;
    }
    return mi->max_output_tokens < 20000 ? mi->max_output_tokens : 20000;
}

/* room is what a request may take of the model's context, its output budget aside: the window
 * less the reserve the threshold keeps free and the output every request asks for. */
static int64_t room(const struct drive *d)
{
    struct model_info mi = catalog_lookup(d->model);
    return mi.context_window - reserve_tokens(d->agent, &mi) - model_output_tokens(d->model);
}

bool compaction_needed(const struct drive *d, int64_t tokens)
{
    return tokens > room(d);
}

/* fit makes the request of system, c and the tools fit budget (context_fit), logging it. */
static void fit(struct drive *d, struct context *c, const char *system, const struct llm_tool *ts,
                size_t n_tools, int64_t budget)
{
    int64_t before = context_tokens(system, c, ts, n_tools);
    if (before <= budget) {
        return;
    }
    size_t cut = context_fit(c, system, ts, n_tools, budget);
    log_info("context_fitted",
             "submission=%s tokens_before=%lld tokens_after=%lld room=%lld parts_cut=%zu",
             d->sub->submission_id, (long long)before,
             (long long)context_tokens(system, c, ts, n_tools), (long long)budget, cut);
}

void compaction_fit(struct drive *d, struct context *c, const char *system, bool tools)
{
    int64_t budget = d->fit_tightened ? room(d) / 2 : room(d);
    fit(d, c, system, tools ? d->tools.tools : NULL, tools ? d->tools.n : 0, budget);
}

/* trigger_name names why a compaction ran, for the log. */
static const char *trigger_name(Cflue__V1__CompactionTrigger t)
{
    switch (t) {
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_THRESHOLD:
        return "threshold";
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW:
        return "overflow";
    case CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_REQUEST:
        return "requested";
    default:
        return "unspecified";
    }
}

/* kept_budget is the most a compaction keeps verbatim: the room less the system prompt and the
 * tools, and less the summary it writes (SUMMARY_TOKENS_EXPECTED, or the output a call may ask
 * for when that is less) while that leaves any (a window the prompt and tools all but fill
 * has no room for a summary either way; compacting what fits would only lose it). */
static int64_t kept_budget(const struct drive *d)
{
    int64_t out = model_output_tokens(d->model);
    int64_t summary = out < SUMMARY_TOKENS_EXPECTED ? out : SUMMARY_TOKENS_EXPECTED;
    int64_t left = room(d) - context_tokens(d->system_text, NULL, d->tools.tools, d->tools.n);
    return left - summary > 0 ? left - summary : left;
}

/* find_cut returns the offset of the first kept record (-1: nothing older than the kept part
 * to compact) and the kept part's tokens in *tail (with -1: those of everything in force);
 * *over says whether that is more than a request has room for beside the prompt and tools. */
static int64_t find_cut(struct drive *d, int64_t *tail, bool *over)
{
    const Cflue__V1__Record *last = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_COMPACTION);
    struct context_cut_rule rule = {
        .first = last ? last->compaction->first_kept_offset : -1,
        .keep = d->agent->keep_recent_tokens ? d->agent->keep_recent_tokens : KEEP_RECENT_DEFAULT,
        .budget = kept_budget(d),
        .forced = d->trigger == CFLUE__V1__COMPACTION_TRIGGER__COMPACTION_TRIGGER_OVERFLOW};
    int64_t cut = context_choose_cut(d->log.recs, d->log.n, &rule, tail);
    *over = *tail > rule.budget;
    return cut;
}

/* Where a compaction stands after compaction_start (d->compacting.phase). */
enum compact_phase {
    COMPACTING_SUMMARY, /* the summary call in flight */
    COMPACTING_PROMPT,  /* the sandbox asked for the recomposed prompt */
    COMPACTING_STORE,   /* both records written, in one Append */
};

/* defer_compaction puts the summary's `compaction` record in the log, pending. */
static void defer_compaction(struct drive *d, const struct llm_response *resp)
{
    char id[256];
    snprintf(id, sizeof(id), "compaction:%s:%d", d->sub->submission_id, d->log.compactions + 1);
    Cflue__V1__Compaction body = CFLUE__V1__COMPACTION__INIT;
    body.summary = (char *)buf_cstr(&resp->text);
    body.first_kept_offset = d->compacting.cut;
    body.tokens_before = d->compacting.before + d->compacting.tail;
    body.tokens_after = (int64_t)resp->text.len / 4 + d->compacting.tail;
    body.trigger = d->trigger;
    (void)dstore_defer_one(d, id, d->sub->submission_id, &body.base);
}

/* defer_prompt puts the recomposed prompt in the log, pending right behind its compaction (one
 * Append stores both: no stream holds the one without the other), and in force. */
static void defer_prompt(struct drive *d, char *fresh)
{
    char id[64];
    snprintf(id, sizeof(id), "system:%d", d->log.compactions + 2);
    struct narrated state;
    narrate_state(d, &state); /* the new baseline of what the model was told */
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    sp.text = fresh;
    sp.state = &state.st;
    (void)dstore_defer_one(d, id, "", &sp.base);
    narrate_cleanup(&state);
    free(d->system_text);
    d->system_text = fresh;
}

/* compacted_log says what the stored compaction did, and drops what the context no longer
 * needs. */
static void compacted_log(struct drive *d)
{
    const Cflue__V1__Record *r = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_COMPACTION);
    log_info("compacted",
             "submission=%s reason=%s first_kept=%lld tokens_before=%lld "
             "tokens_after=%lld",
             d->sub->submission_id, trigger_name(d->trigger),
             (long long)r->compaction->first_kept_offset, (long long)r->compaction->tokens_before,
             (long long)r->compaction->tokens_after);
    rlog_trim(&d->log, d->sub->submission_id);
}

bool compaction_start(struct drive *d, enum compact_result *over)
{
    *over = COMPACT_FAILED;
    if (drive_broken(d)) {
        return false; /* what was pending could not be stored: the cut needs their offsets */
    }
    bool oversized;
    int64_t cut = find_cut(d, &d->compacting.tail, &oversized);
    if (cut < 0) {
        log_info("compaction_skipped", "submission=%s reason=%s oversized=%d",
                 d->sub->submission_id, trigger_name(d->trigger), oversized);
        *over = oversized ? COMPACT_NOTHING_OVERSIZED : COMPACT_NOTHING;
        return false;
    }
    struct context ctx = {0};
    dstore_build_context(d, &ctx, cut);
    if (d->fault.code != CF_OK) {
        context_free(&ctx);
        return false;
    }
    d->compacting.cut = cut;
    d->compacting.before = context_tokens(d->system_text, &ctx, d->tools.tools, d->tools.n);
    /* fitted message by message first (each long text keeps its head and tail), with room
     * for the ask and the transcript's tags; then made one text (no calls, no images); then,
     * were it still over, fitted as one */
    fit(d, &ctx, SUMMARY_SYSTEM, NULL, 0, room(d) - TRANSCRIPT_SPARE_TOKENS);
    context_transcript(&ctx, SUMMARY_ASK);
    compaction_fit(d, &ctx, SUMMARY_SYSTEM, false);
    d->quiet = true;
    d->compacting.phase = COMPACTING_SUMMARY;
    model_call_start(d, SUMMARY_SYSTEM, &ctx, NULL, 0);
    return true;
}

/* summarized takes the summary call's end: the compaction record deferred and the sandbox
 * asked for the new prompt; false when there is no summary (COMPACT_FAILED). */
static bool summarized(struct drive *d, enum cf_status rc)
{
    d->quiet = false;
    if (rc != CF_OK || !d->answer.text.len) {
        char q[600];
        log_warn("compaction_failed", "submission=%s err=%s", d->sub->submission_id,
                 log_quote(q, sizeof(q), rc == CF_OK ? "empty summary" : d->err.msg));
        return false;
    }
    defer_compaction(d, &d->answer);
    llm_response_cleanup(&d->answer);
    llm_response_init(&d->answer);
    d->compacting.phase = COMPACTING_PROMPT;
    prompt_recompose_start(d);
    return true;
}

bool compaction_take(struct drive *d, enum compact_result *out)
{
    enum cf_status rc;
    char *fresh;
    *out = COMPACT_FAILED;
    switch (d->compacting.phase) {
    case COMPACTING_SUMMARY:
        if (!model_call_poll(d, &rc)) {
            return false;
        }
        if (!summarized(d, rc)) {
            return true;
        }
        /* fall through */
    case COMPACTING_PROMPT:
        if (!prompt_recompose_take(d, &fresh)) {
            return false;
        }
        if (!fresh) {
            rlog_drop_pending(&d->log); /* no compaction without its prompt */
            return true;
        }
        defer_prompt(d, fresh);
        d->compacting.phase = COMPACTING_STORE;
        /* fall through */
    case COMPACTING_STORE:
    default:
        if (!dstore_stored(d)) {
            return false;
        }
        if (d->fault.code == CF_OK && !drive_lost_or_down(d)) {
            *out = COMPACT_DONE;
            compacted_log(d);
        }
        return true;
    }
}
