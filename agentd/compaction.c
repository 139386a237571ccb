/* compaction.c - replacing the older part of a conversation with a summary.
 *
 * When the next request would not leave the reserve free in the model's context window (or
 * the provider said the context overflowed, or someone asked with Compact), the older part of
 * the conversation is replaced by a summary the model writes. The most recent
 * keep_recent_tokens stay verbatim; the cut falls only before a user or assistant message, so
 * a tool call never loses its result. The summary and the offset of the first kept record go
 * into a `compaction` record (compaction:<sub>:<n>); the system prompt is composed again
 * (`system_prompt` system:<n + 1>). The record log then drops what the context no longer
 * needs (rlog_trim).
 */
#include "catalog.h"
#include "drive.h"
#include "log.h"
#include "record_kind.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEEP_RECENT_DEFAULT 8000

#define SUMMARY_SYSTEM "You write faithful, compact summaries of agent work."
#define SUMMARY_ASK                                                                                \
    "Write a summary of the conversation above for your own later use; it will replace those "     \
    "messages. Keep: the user's goals and requests, decisions made and why, facts learned, "       \
    "files read or changed and their current state, commands run and their results, and what "     \
    "is still open. Be complete but brief. Answer with the summary only."

static int64_t estimate_tokens(const char *system, const struct context *c,
                               const struct toolset *ts)
{
    size_t chars = strlen(system ? system : "");
    for (size_t i = 0; i < c->n; i++) {
        chars += strlen(c->msgs[i].text ? c->msgs[i].text : "") + 16;
        for (size_t k = 0; k < c->msgs[i].n_calls; k++) {
            chars += strlen(c->msgs[i].calls[k].arguments_json) + strlen(c->msgs[i].calls[k].name);
        }
    }
    for (size_t i = 0; ts && i < ts->n; i++) {
        chars += strlen(ts->tools[i].description) + strlen(ts->tools[i].schema_json);
    }
    return (int64_t)(chars / 4);
}

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

bool compaction_needed(struct drive *d, const struct context *c)
{
    struct model_info mi = catalog_lookup(d->model);
    return estimate_tokens(d->system_text, c, &d->tools) + model_output_tokens(d->model) >
           mi.context_window - reserve_tokens(d->agent, &mi);
}

static bool is_message_start(const Cflue__V1__Record *r)
{
    return r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE ||
           r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE;
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

/* record_chars estimates how much of the model's context a record takes: its body's encoded
 * size (text dominates it); deltas take none (the context never holds them). */
static int64_t record_chars(const Cflue__V1__Record *r)
{
    const ProtobufCMessage *body = record_body(r);
    if (!body || r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA) {
        return 0;
    }
    return (int64_t)protobuf_c_message_get_packed_size(body);
}

/* find_cut returns the offset of the first kept record (-1: nothing older than the kept tail
 * to compact) and the kept tail's tokens in *tail. */
static int64_t find_cut(struct drive *d, int64_t *tail)
{
    const struct record_log *log = &d->log;
    const Cflue__V1__Record *last = rlog_latest(log, CFLUE__V1__RECORD__BODY_COMPACTION);
    int64_t keep =
        d->agent->keep_recent_tokens ? d->agent->keep_recent_tokens : KEEP_RECENT_DEFAULT;
    int64_t first = last ? last->compaction->first_kept_offset : -1, cut = -1;
    *tail = 0;
    /* walk back from the end until keep tokens are behind us, then to a message start */
    for (size_t i = log->n; i-- > 0;) {
        const Cflue__V1__Record *r = log->recs[i];
        if (r->offset < first) {
            break;
        }
        *tail += record_chars(r) / 4;
        if (*tail >= keep && is_message_start(r)) {
            cut = r->offset;
            break;
        }
    }
    bool older = false;
    for (size_t i = 0; cut >= 0 && i < log->n; i++) {
        const Cflue__V1__Record *r = log->recs[i];
        older = older || (r->offset >= first && r->offset < cut && is_message_start(r));
    }
    return older ? cut : -1;
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
    int64_t cut = find_cut(d, &d->compacting.tail);
    if (cut < 0) {
        log_info("compaction_skipped", "submission=%s reason=%s", d->sub->submission_id,
                 trigger_name(d->trigger));
        *over = COMPACT_NOTHING;
        return false;
    }
    struct context ctx = {0};
    dstore_build_context(d, &ctx, cut);
    if (d->fault.code != CF_OK) {
        context_free(&ctx);
        return false;
    }
    d->compacting.cut = cut;
    d->compacting.before = estimate_tokens(d->system_text, &ctx, &d->tools);
    struct llm_message *ask = context_push(&ctx);
    ask->role = LLM_USER;
    ask->text = SUMMARY_ASK;
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
