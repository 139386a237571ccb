/* task.c - the framework's `task` tool: work delegated to a subagent as a child submission.
 *
 * A `task` call never goes to a tool server. The drive admits the child with Store.Admit: a
 * new conversation of the subagent, whose message is the call's prompt, carrying a Delegation
 * (the parent submission, the call, the depth, and the parent's sandbox, which the child shares
 * unless its own definition has one). The Admit's idempotency key is made of the parent
 * submission, the turn and the call id, so an Admit tried again, or made again by a later
 * attempt after a crash, finds the same child. With room here the Admit claims the child too
 * and this agentd drives it; otherwise the claimer of any agentd takes it.
 *
 * The parent then follows the child's conversation (Store.Follow until the child is settled),
 * keeping the child's latest assistant text; the settlement gives the call's result: that text
 * when completed, the reason when failed or aborted. A task_started record in the parent's
 * stream names the child, for watchers. Nothing here holds an engine thread: the Admit and the
 * Follow post the drive, parked in DRIVE_TOOLS_WAIT beside the sandbox's batch.
 *
 * Failures. storaged failing (unreachable, restarting) is tried again with backoff for the store
 * retry window, then it is a fault: the parent ends interrupted and its next attempt asks
 * again (task_resume), finding the same child, which went on meanwhile. An abort, a lost lease or
 * shutdown stops the following at once; storaged carries the parent's abort on to its children
 * (store.proto). A call that cannot delegate (bad arguments, an undeclared subagent, the depth
 * limit) gets its result at once, for the model to read.
 *
 * The same batch carries the activate_skill calls of skills found in the sandbox: their SKILL.md
 * is read again with one Sandbox.ReadFile each (in the call's `admit` slot), so an edit made
 * since the skill was found is seen (skill_tools.c writes the result).
 */
#include "clients.h"
#include "clock.h"
#include "drive.h"
#include "engine.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "thread.h"
#include "utf8.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TASK_TOOL "task"
#define ADMIT_TIMEOUT_MS 15000
#define ANSWER_MAX 51200   /* bytes of a child's answer given to the parent's model */
#define KEY_MAX 256        /* storaged's limit on idempotency keys */
#define ATTACHMENTS_MAX 16 /* attachments one task hands its child (storaged's limit) */

/* Names only the framework may give a tool. */
static const char *const RESERVED[] = {"task", "activate_skill", "read_skill_resource", "finish",
                                       "give_up"};

static const char TASK_DESCRIPTION[] =
    "Hand a self-contained piece of work to one of your subagents. The subagent starts with a "
    "fresh context: it sees only the prompt you write, not this conversation, so say everything "
    "it needs to know. It works in the same sandbox with its own tools and returns its final "
    "answer as this call's result. Use it for independent research, exploring many files, or "
    "parts of a job that can run side by side: several task calls in one turn run at the same "
    "time. The subagents you can name are listed in your instructions.";

static const char TASK_SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"description\":{\"type\":\"string\",\"description\":\"A short label for the work, for "
    "people watching.\"},"
    "\"prompt\":{\"type\":\"string\",\"description\":\"The complete instructions for the "
    "subagent.\"},"
    "\"agent\":{\"type\":\"string\",\"minLength\":1,\"description\":\"The name of the subagent "
    "to hand the work to.\"},"
    "\"cwd\":{\"type\":\"string\",\"description\":\"Optional: a directory of your sandbox for it "
    "to "
    "work in.\"},"
    "\"attachments\":{\"type\":\"array\",\"description\":\"Files of this conversation to "
    "pass on, by name.\",\"items\":{\"type\":\"object\",\"properties\":{\"id\":{\"type\":"
    "\"string\"}},\"required\":[\"id\"]}}},"
    "\"required\":[\"prompt\",\"agent\"]}";

bool task_is_framework(const char *name)
{
    return !strcmp(name, TASK_TOOL) || !strcmp(name, "activate_skill") ||
           !strcmp(name, "read_skill_resource");
}

bool task_name_reserved(const char *name)
{
    for (size_t k = 0; k < sizeof(RESERVED) / sizeof(*RESERVED); k++) {
        if (!strcmp(name, RESERVED[k])) {
            return true;
        }
    }
    return false;
}

bool task_tools_add(struct drive *d)
{
    struct toolset *ts = &d->tools;
    for (size_t i = 0; i < ts->n; i++) {
        struct toolset before = *ts;
        before.n = i;
        if (servers_clash(&before, ts->tools[i].name, ts->source[i], d->tools_addr, d->error,
                          sizeof(d->error))) {
            return false;
        }
    }
    toolset_add(ts, TASK_TOOL, TASK_DESCRIPTION, TASK_SCHEMA, NULL);
    skill_tools_add(d, ts);
    return true;
}

/* ---------- one call's result ---------- */

static void record(struct task_call *tc, const char *text, bool is_error)
{
    tools_record_result(tc->d, tc->index, tc->call_id, tc->skill ? "activate_skill" : TASK_TOOL,
                        text, is_error, NULL, false);
    tc->done = true;
}

/* record_settled records the result of a call whose child settled. */
static void record_settled(struct task_call *tc, const Cflue__V1__SubmissionSettled *s)
{
    struct buf b;
    buf_init(&b, ANSWER_MAX + 1024);
    bool is_error = s->outcome != CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
    if (s->outcome == CFLUE__V1__OUTCOME__OUTCOME_COMPLETED) {
        const char *a = tc->answer ? tc->answer : "";
        size_t n = strlen(a), cut = utf8_prefix_len(a, n, ANSWER_MAX);
        if (!n) {
            buf_printf(&b, "The subagent \"%s\" finished without writing an answer.", tc->agent);
        }
        buf_append(&b, a, cut);
        if (cut < n) {
            buf_printf(&b,
                       "\n\n[The subagent's answer is longer: only its first %d bytes are shown. "
                       "The whole answer is in conversation %s.]",
                       ANSWER_MAX, tc->child_conversation_id);
        }
    } else {
        buf_printf(&b, "The subagent \"%s\" %s before finishing: %s", tc->agent,
                   s->outcome == CFLUE__V1__OUTCOME__OUTCOME_ABORTED ? "was stopped" : "failed",
                   *s->error ? s->error : "no reason was given");
    }
    char *text = buf_take(&b);
    record(tc, text, is_error);
    log_info("task_settled", "submission=%s call=%s child=%s outcome=%d", tc->d->sub->submission_id,
             tc->call_id, tc->child_submission_id, (int)s->outcome);
    free(text);
}

/* ---------- the Follow of the child's conversation ---------- */

/* on_record (rpc's stream thread) hands one record to the drive and posts it; the next is asked
 * for once the drive took this one. */
static void on_record(void *arg, ProtobufCMessage *msg)
{
    struct task_call *tc = arg;
    pthread_mutex_lock(&tc->d->tasks.mu);
    tc->record = msg;
    engine_post_unlock(tc->d, &tc->d->tasks.mu);
}

static void on_follow_end(void *arg, const struct rpc_status *st)
{
    struct task_call *tc = arg;
    pthread_mutex_lock(&tc->d->tasks.mu);
    tc->follow_ended = true;
    tc->follow_st = *st;
    /* posted under the lock: once the engine thread sees the end the drive may finish and be
     * freed, so nothing here may touch tc after the unlock */
    engine_post_unlock(tc->d, &tc->d->tasks.mu);
}

static const struct rpc_astream_ops follow_ops = {.on_message = on_record, .on_end = on_follow_end};

static void follow_open(struct task_call *tc)
{
    Cflue__V1__FollowRequest fr = CFLUE__V1__FOLLOW_REQUEST__INIT;
    fr.conversation_id = tc->child_conversation_id;
    fr.after_offset = tc->offset;
    fr.until_settled = tc->child_submission_id;
    tc->follow_ended = false;
    tc->follow_released = false;
    tc->follow = rpc_astream_open(g_agentd.store, "/cflue.v1.Store/Follow", &fr.base,
                                  &cflue__v1__record__descriptor, 0, &follow_ops, tc);
}

/* take_record keeps what a record of the child's conversation says of the child. */
static void take_record(struct task_call *tc, Cflue__V1__Record *r)
{
    tc->offset = r->offset;
    tc->first_fail_ms = 0; /* storaged answers: the retries start over */
    bool childs = !strcmp(r->submission_id, tc->child_submission_id);
    if (childs && r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE) {
        free(tc->answer);
        tc->answer = mem_strdup(r->assistant_message->text);
    } else if (childs && r->body_case == CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED && !tc->done &&
               !drive_broken(tc->d)) {
        record_settled(tc, r->submission_settled);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
}

/* ---------- retries ---------- */

/* retry_or_fault schedules the next try of what failed with rc (the Admit or the Follow) when
 * it is transient and the retry window is not over; otherwise the failure is the drive's fault.
 */
static void retry_or_fault(struct task_call *tc, const char *what, const struct cf_error *e)
{
    int64_t now = clock_mono_ms();
    if (!tc->first_fail_ms) {
        tc->first_fail_ms = now;
        tc->backoff_ms = 100;
    }
    if (dstore_retry_again(tc->d, e, tc->first_fail_ms, tc->backoff_ms)) {
        tc->retry_at_ms = now + tc->backoff_ms + thread_jitter_ms(tc->backoff_ms / 2 + 1);
        tc->backoff_ms = tc->backoff_ms * 2 < 2000 ? tc->backoff_ms * 2 : 2000;
        log_info("task_retry", "submission=%s call=%s what=%s", tc->d->sub->submission_id,
                 tc->call_id, what);
        return;
    }
    drive_fault(tc->d, what, e);
}

/* ---------- admission ---------- */

/* task_record_id names the task_started record of call call_id of d's turn (also its child's
 * idempotency key, when that short); returns snprintf's count. */
static int task_record_id(const struct drive *d, const char *call_id, char *id, size_t size)
{
    return snprintf(id, size, "task:%s:%d:%s", d->sub->submission_id, d->turn, call_id);
}

static void admit_send(struct task_call *tc)
{
    struct drive *d = tc->d;
    char key[KEY_MAX + 1];
    int n = task_record_id(d, tc->call_id, key, sizeof(key));
    if (n < 0 || n > KEY_MAX) {
        snprintf(key, sizeof(key), "task:%.128s:%d:%016" PRIx64, d->sub->submission_id, d->turn,
                 ids_hash64(tc->call_id));
    }
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    msg.text = tc->prompt;
    msg.attachments = (Cflue__V1__Attachment **)tc->atts;
    msg.n_attachments = tc->n_atts;
    Cflue__V1__Delegation dg = CFLUE__V1__DELEGATION__INIT;
    dg.parent_submission_id = d->sub->submission_id;
    dg.parent_conversation_id = d->sub->conversation_id;
    dg.tool_call_id = (char *)tc->call_id;
    dg.depth = d->depth + 1;
    dg.sandbox_tools = (char *)(d->tools_addr ? d->tools_addr : "");
    dg.sandbox = d->tools_addr ? d->workspace : "";
    dg.model = (char *)d->model;
    dg.cwd = d->tools_addr ? tc->cwd : "";
    dg.sandbox_limits = d->tools_addr ? d->limits : NULL;
    dg.sandbox_placement =
        (char *)(d->tools_addr && d->tools_spec && !strncmp(d->tools_spec, "dns:", 4)
                     ? d->tools_spec
                     : "");
    Cflue__V1__AdmitRequest ar = CFLUE__V1__ADMIT_REQUEST__INIT;
    ar.agent = tc->agent;
    ar.conversation_id = "";
    ar.message = &msg;
    ar.idempotency_key = key;
    ar.source = CFLUE__V1__SOURCE__SOURCE_DISPATCH;
    ar.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE;
    ar.delegation = &dg;
    /* the child's work is part of the parent's trace: a span of the task call's own */
    char traceparent[TRACE_PARENT_SIZE];
    struct trace_ctx child;
    trace_child(&child, drive_trace(d));
    trace_format(&child, traceparent);
    ar.traceparent = traceparent;
    ar.tracestate = child.state;
    struct engine_admit_claim claim; /* the child driven here at once when there is room */
    engine_claim_with_admit(&ar, &claim);
    tc->admit_ticket = claim.ticket;
    dcall_start(&tc->admit, g_agentd.store, "/cflue.v1.Store/Admit", &ar.base,
                &cflue__v1__admit_response__descriptor, ADMIT_TIMEOUT_MS);
}

/* admitted takes the Admit's answer: the child driven here or left to a claimer, the child named
 * in the parent's stream, then followed. */
static void admitted(struct task_call *tc, Cflue__V1__AdmitResponse *r)
{
    struct drive *d = tc->d;
    const Cflue__V1__Submission *s = r->submission;
    tc->child_submission_id = mem_strdup(s->submission_id);
    tc->child_conversation_id = mem_strdup(s->conversation_id);
    tc->first_fail_ms = 0;
    uint64_t ticket = tc->admit_ticket;
    tc->admit_ticket = 0;
    if (!engine_admitted(ticket, r)) {
        agentd_wake(); /* queued: a claimer of any agentd takes it */
    }
    log_info("task_admitted",
             "submission=%s call=%s agent=%s child=%s conversation=%s depth=%d "
             "dedup=%d",
             d->sub->submission_id, tc->call_id, tc->agent, tc->child_submission_id,
             tc->child_conversation_id, d->depth + 1, (int)r->deduplicated);
    if (drive_halted(d) || tc->done) {
        /* the drive stopped meanwhile (its next attempt finds the child), or ran out of time */
        tc->done = true;
        return;
    }
    char id[600];
    task_record_id(d, tc->call_id, id, sizeof(id));
    if (!rlog_find(&d->log, id)) {
        Cflue__V1__TaskStarted ts = CFLUE__V1__TASK_STARTED__INIT;
        ts.turn = d->turn;
        ts.index = tc->index;
        ts.tool_call_id = (char *)tc->call_id;
        ts.agent = tc->agent;
        ts.child_submission_id = tc->child_submission_id;
        ts.child_conversation_id = tc->child_conversation_id;
        ts.depth = d->depth + 1;
        (void)dstore_defer_one(d, id, d->sub->submission_id, &ts.base); /* written behind */
    }
    tc->offset = -1;
    follow_open(tc);
}

/* ---------- starting the calls ---------- */

/* roster_line writes the names of the subagents d's agent may delegate to. */
static void roster_line(struct buf *b, const struct agent_def *a)
{
    if (!a->n_subagents) {
        buf_append_str(b, "this agent has none");
    }
    for (size_t i = 0; i < a->n_subagents; i++) {
        buf_printf(b, "%s%s", i ? ", " : "", a->subagents[i]);
    }
}

/* refuse records the result of a call that cannot delegate. */
static void refuse(struct drive *d, int index, const char *call_id, const char *text, bool is_error)
{
    tools_record_result(d, index, call_id, TASK_TOOL, text, is_error, NULL, false);
}

/* check_call parses a call's arguments; NULL when it cannot delegate (its result recorded). */
static json_t *check_call(struct drive *d, int index, const struct llm_call *c)
{
    json_error_t je;
    json_t *args =
        json_loads(c->arguments_json ? c->arguments_json : "", JSON_REJECT_DUPLICATES, &je);
    json_t *prompt = json_object_get(args, "prompt"), *agent = json_object_get(args, "agent");
    char text[2048];
    if (!json_is_object(args) || !json_is_string(prompt) || !json_is_string(agent) ||
        !*json_string_value(prompt)) {
        snprintf(text, sizeof(text),
                 "The task call was not run: its arguments must be a JSON object with a non-empty "
                 "string \"prompt\" and a string \"agent\".%s%s",
                 args ? "" : " The arguments are not valid JSON: ", args ? "" : je.text);
        refuse(d, index, c->id, text, true);
        json_decref(args);
        return NULL;
    }
    const char *name = json_string_value(agent);
    char id[600];
    task_record_id(d, c->id, id, sizeof(id));
    /* a call an earlier attempt started is followed whatever the definitions say now */
    bool declared = rlog_find(&d->log, id) != NULL;
    for (size_t i = 0; i < d->agent->n_subagents; i++) {
        declared = declared || !strcmp(d->agent->subagents[i], name);
    }
    if (!declared) {
        struct buf b;
        buf_init(&b, 4096);
        buf_printf(&b, "There is no subagent named \"%.200s\" to delegate to. Subagents: ", name);
        roster_line(&b, d->agent);
        buf_append_str(&b, ".");
        char *t = buf_take(&b);
        refuse(d, index, c->id, t, true); /* an error result; no child was made */
        free(t);
        json_decref(args);
        return NULL;
    }
    if (d->depth >= TASK_DEPTH_MAX) {
        snprintf(text, sizeof(text),
                 "delegation_depth_exceeded: this agent already runs %d delegations deep, the most "
                 "allowed is %d. Do this part of the work yourself instead of delegating it.",
                 d->depth, TASK_DEPTH_MAX);
        refuse(d, index, c->id, text, true);
        json_decref(args);
        return NULL;
    }
    return args;
}

static void skill_read_start(struct drive *d, struct task_call *tc, int index, const char *call_id,
                             const struct skill *s);

/* find_attachment: the attachment named id of a message in d's conversation (the newest one
 * of that name still in the context), with its bytes; NULL when there is none. */
static const Cflue__V1__Attachment *find_attachment(struct drive *d, const char *id)
{
    for (size_t i = d->log.n; i-- > 0;) {
        const Cflue__V1__Record *r = d->log.recs[i];
        bool named = false;
        for (size_t k = 0; r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE &&
                           k < r->user_message->n_attachments && !named;
             k++) {
            named = !strcmp(r->user_message->attachments[k]->name, id);
        }
        const Cflue__V1__Message *msg = NULL;
        struct cf_error err;
        if (!named || dstore_attachments(d, r->submission_id, &msg, &err) != CF_OK) {
            continue;
        }
        for (size_t k = 0; msg && k < msg->n_attachments; k++) {
            if (!strcmp(msg->attachments[k]->name, id)) {
                return msg->attachments[k];
            }
        }
    }
    return NULL;
}

/* take_attachments resolves the call's `attachments` into tc; false (its result recorded, no
 * child made) when the list is malformed or names a file the conversation does not hold. */
static bool take_attachments(struct drive *d, struct task_call *tc, json_t *args)
{
    json_t *list = json_object_get(args, "attachments"), *it;
    size_t i;
    char text[512];
    if (!list) {
        return true;
    }
    if (!json_is_array(list) || json_array_size(list) > ATTACHMENTS_MAX) {
        snprintf(text, sizeof(text),
                 "The task was not started: attachments must be a list of at most %d objects "
                 "like {\"id\": \"name\"}.",
                 ATTACHMENTS_MAX);
        refuse(d, tc->index, tc->call_id, text, true);
        return false;
    }
    tc->atts = mem_alloc(sizeof(*tc->atts) * (json_array_size(list) + 1));
    json_array_foreach(list, i, it)
    {
        const char *id = json_string_value(json_object_get(it, "id"));
        const Cflue__V1__Attachment *a = id ? find_attachment(d, id) : NULL;
        if (!a) {
            snprintf(text, sizeof(text),
                     "The task was not started: %s%.200s%s is not a file attached to this "
                     "conversation (or it was compacted away). Name files as their attachment "
                     "notes show them.",
                     id ? "\"" : "attachment ", id ? id : "without an id", id ? "\"" : "");
            refuse(d, tc->index, tc->call_id, text, true);
            return false;
        }
        bool seen = false;
        for (size_t k = 0; k < tc->n_atts; k++) {
            seen = seen || tc->atts[k] == a;
        }
        if (!seen) {
            tc->atts[tc->n_atts++] = a;
        }
    }
    return true;
}

/* join_cwd normalizes path (relative to base, both relative to the sandbox's working directory)
 * into out: "." and empty segments dropped, ".." popping one; false when it climbs above the
 * working directory or does not fit. */
static bool join_cwd(const char *base, const char *path, char *out, size_t out_len)
{
    char in[2 * DRIVE_CWD_MAX + 2];
    size_t o = 0;
    if ((size_t)snprintf(in, sizeof(in), "%s/%s", base, path) >= sizeof(in)) {
        return false;
    }
    out[0] = '\0';
    char *save = NULL;
    for (char *seg = strtok_r(in, "/", &save); seg; seg = strtok_r(NULL, "/", &save)) {
        if (!strcmp(seg, ".")) {
            continue;
        }
        if (!strcmp(seg, "..")) {
            if (!o) {
                return false;
            }
            char *slash = strrchr(out, '/');
            o = slash ? (size_t)(slash - out) : 0;
            out[o] = '\0';
            continue;
        }
        size_t n = strlen(seg);
        if (o + n + 2 > out_len) {
            return false;
        }
        if (o) {
            out[o++] = '/';
        }
        memcpy(out + o, seg, n + 1);
        o += n;
    }
    return true;
}

/* take_cwd resolves the call's `cwd` into tc->cwd: relative to the drive's own working
 * directory, or absolute inside the sandbox; without one the child works where its parent
 * does. false (an error result recorded, no child made) when it cannot be used. */
static bool take_cwd(struct drive *d, struct task_call *tc, json_t *args)
{
    json_t *v = json_object_get(args, "cwd");
    const char *cwd = json_string_value(v), *why = NULL;
    char rel[DRIVE_CWD_MAX + 1], text[DRIVE_CWD_MAX + 512];
    const struct agent_def *child = agents_find(&d->defs->agents, tc->agent);
    if (!v || (cwd && !*cwd)) {
        tc->cwd = mem_strdup(d->cwd);
        return true;
    }
    const char *wd = d->tools.working_directory ? d->tools.working_directory : "";
    size_t wd_len = strlen(wd), own = strlen(d->cwd);
    size_t root_len = own && wd_len > own ? wd_len - own - 1 : wd_len; /* wd is root/own */
    if (!cwd || json_string_length(v) != strlen(cwd)) {
        why = "it must be a string naming a directory";
    } else if (!d->tools_addr) {
        why = "you have no sandbox, so there is no directory to hand over";
    } else if (child && child->sandbox_tools) {
        why = "that subagent works in a sandbox of its own; cwd applies only to subagents that "
              "share yours";
    } else if (cwd[0] == '/' && !(root_len && !strncmp(cwd, wd, root_len) &&
                                  (cwd[root_len] == '/' || !cwd[root_len]))) {
        why = "an absolute cwd must lie inside the sandbox";
    } else if (!join_cwd(cwd[0] == '/' ? "" : d->cwd, cwd[0] == '/' ? cwd + root_len : cwd, rel,
                         sizeof(rel))) {
        why = "it leads outside the sandbox or is too long";
    }
    if (why) {
        snprintf(text, sizeof(text),
                 "The task was not started: cwd \"%.1024s\" cannot be used: %s.", cwd ? cwd : "",
                 why);
        refuse(d, tc->index, tc->call_id, text, true);
        return false;
    }
    tc->cwd = mem_strdup(rel);
    return true;
}

bool task_start(struct drive *d, const struct llm_response *resp)
{
    struct task_wait *tw = &d->tasks;
    tw->calls = mem_alloc(sizeof(*tw->calls) * (resp->n_calls + 1));
    tw->n = 0;
    int tasks = 0; /* the answer's task calls so far, whether run before or not */
    for (size_t i = 0; i < resp->n_calls && d->fault.code == CF_OK; i++) {
        const struct llm_call *c = &resp->calls[i];
        char id[600];
        bool is_task = !strcmp(c->name, TASK_TOOL);
        tasks += is_task;
        context_tool_result_id(id, sizeof(id), d->sub->submission_id, d->turn, c->id);
        if (!task_is_framework(c->name) || rlog_find(&d->log, id)) {
            continue; /* not agentd's, or run before (a resumed turn) */
        }
        if (is_task && tasks > TASK_CALLS_MAX) {
            char text[256];
            snprintf(text, sizeof(text),
                     "The task was not started: one answer may start at most %d tasks. Start "
                     "the rest in a later turn, once these have answered.",
                     TASK_CALLS_MAX);
            refuse(d, (int)i, c->id, text, true); /* the first ones, by their order, run */
            continue;
        }
        const struct skill *in_sandbox = skill_tools_in_sandbox(d, c);
        if (in_sandbox) {
            skill_read_start(d, &tw->calls[tw->n++], (int)i, c->id, in_sandbox);
            continue;
        }
        if (skill_tool_run(d, (int)i, c)) {
            continue; /* answered at once */
        }
        json_t *args = check_call(d, (int)i, c);
        if (!args) {
            continue;
        }
        struct task_call *tc = &tw->calls[tw->n++];
        memset(tc, 0, sizeof(*tc));
        tc->d = d;
        tc->index = (int)i;
        tc->call_id = c->id;
        tc->agent = mem_strdup(json_string_value(json_object_get(args, "agent")));
        tc->prompt = mem_strdup(json_string_value(json_object_get(args, "prompt")));
        dcall_init(&tc->admit, d);
        if (!take_cwd(d, tc, args) || !take_attachments(d, tc, args)) {
            tc->done = true; /* answered: nothing is admitted */
            json_decref(args);
            continue;
        }
        json_decref(args);
        admit_send(tc);
    }
    if (!tw->n) {
        free(tw->calls);
        tw->calls = NULL;
    }
    return tw->n > 0;
}

/* skill_read_start reads again, from the sandbox, the SKILL.md of a skill found there that a
 * call activates (a Sandbox.ReadFile in tc->admit): edits made since the skill was found are
 * seen. */
static void skill_read_start(struct drive *d, struct task_call *tc, int index, const char *call_id,
                             const struct skill *s)
{
    memset(tc, 0, sizeof(*tc));
    tc->d = d;
    tc->index = index;
    tc->call_id = call_id;
    tc->skill = s;
    dcall_init(&tc->admit, d);
    Cflue__V1__ReadFileRequest rq = CFLUE__V1__READ_FILE_REQUEST__INIT;
    char *path = mem_asprintf("%s%s%s", d->cwd, d->cwd[0] ? "/" : "", s->origin);
    rq.sandbox = d->workspace;
    rq.path = path; /* the Glance named it from the drive's working directory */
    rq.max_bytes = SKILL_FILE_MAX;
    dcall_start(&tc->admit, tools_channel(d), "/cflue.v1.Sandbox/ReadFile", &rq.base,
                &cflue__v1__read_file_response__descriptor, ADMIT_TIMEOUT_MS);
    free(path);
}

/* skill_read records the activation of a skill read again from the sandbox. */
static void skill_read(struct task_call *tc, const struct rpc_status *st, ProtobufCMessage *resp)
{
    struct drive *d = tc->d;
    struct buf out;
    bool ok = false;
    if (tc->done) {
        return;
    }
    buf_init(&out, SKILL_FILE_MAX + 16384); /* the body, the paths and the words around them */
    if (st->code == GRPC_STATUS_OK) {
        const Cflue__V1__ReadFileResponse *f = (const void *)resp;
        ok = skill_tools_activated(d, tc->skill, f->data.data, f->data.len, &out);
    } else if (st->code == GRPC_STATUS_RESOURCE_EXHAUSTED &&
               (!strcmp(st->reason, "FILE_TOO_LARGE") || strstr(st->details, "larger than max"))) {
        /* the file (toold's FILE_TOO_LARGE, or, from a tool server that ignores max_bytes,
         * gRPC's bound on the answer), not toold: an answer, not a fault to try again */
        buf_printf(&out,
                   "The skill \"%s\" could not be activated: its SKILL.md (%s) is larger than "
                   "the %d bytes a skill may have.",
                   tc->skill->name, tc->skill->origin, SKILL_FILE_MAX);
    } else if (drive_halted(d) || tools_failed(d, "reading a skill from the sandbox failed", st)) {
        tc->done = true; /* the drive ends interrupted; the next attempt asks again */
        buf_cleanup(&out);
        return;
    } else {
        buf_printf(&out, "The skill \"%s\" could not be read from the sandbox (%s): %s",
                   tc->skill->name, tc->skill->origin, st->details);
    }
    char *text = buf_take(&out);
    tools_record_result(d, tc->index, tc->call_id, "activate_skill", text, !ok, NULL, false);
    tc->done = true;
    free(text);
}

/* ---------- waiting ---------- */

/* poll_admit takes the Admit's end (or, for a skill, the ReadFile's). */
static void poll_admit(struct task_call *tc)
{
    struct rpc_status st;
    ProtobufCMessage *resp;
    if (!dcall_take(&tc->admit, &st, &resp)) {
        return;
    }
    if (tc->skill) {
        skill_read(tc, &st, resp);
        if (resp) {
            protobuf_c_message_free_unpacked(resp, NULL);
        }
        return;
    }
    struct cf_error e;
    if (store_status("Admit", &st, &e) == CF_OK) {
        admitted(tc, (Cflue__V1__AdmitResponse *)resp); /* the claim, if any, even when halted */
        protobuf_c_message_free_unpacked(resp, NULL);
        return;
    }
    engine_admit_unanswered(tc->admit_ticket, e.code); /* its claim may have committed */
    tc->admit_ticket = 0;
    if (drive_halted(tc->d)) {
        tc->done = true;
    } else if (drive_transient(e.code) || e.code == CF_CANCELLED) {
        /* cancelled by storaged (a stop past its grace): it may have committed, so the same
         * Admit again, which finds the child if it did, as after a lost answer */
        if (e.code == CF_CANCELLED) {
            e.code = CF_UNAVAILABLE;
        }
        retry_or_fault(tc, "admitting a subagent's task failed", &e);
    } else {
        /* refused for good: the model hears why; nothing was admitted */
        char text[CF_ERROR_MSG_MAX + 256];
        snprintf(text, sizeof(text), "The subagent \"%s\" could not be started: %s", tc->agent,
                 e.msg);
        log_warn("task_refused", "submission=%s call=%s code=%d", tc->d->sub->submission_id,
                 tc->call_id, (int)e.code);
        record(tc, text, true);
    }
}

/* poll_follow takes what the Follow delivered, and its end. */
static void poll_follow(struct task_call *tc)
{
    struct drive *d = tc->d;
    pthread_mutex_lock(&d->tasks.mu);
    ProtobufCMessage *rec = tc->record;
    tc->record = NULL;
    bool ended = tc->follow_ended;
    struct rpc_status st = tc->follow_st;
    pthread_mutex_unlock(&d->tasks.mu);
    if (rec) {
        take_record(tc, (Cflue__V1__Record *)rec);
        if (!tc->follow_released) {
            rpc_astream_next(tc->follow);
        }
    }
    if (!ended) {
        if ((tc->done || drive_halted(d)) && !tc->follow_released) {
            tc->follow_released = true;
            rpc_astream_release(tc->follow); /* its end posts the drive */
        }
        return;
    }
    if (!tc->follow_released) {
        rpc_astream_release(tc->follow);
    }
    tc->follow = NULL;
    tc->follow_released = false;
    if (tc->done || drive_halted(d)) {
        return;
    }
    /* over without the settlement: storaged restarted or failed; follow again from here */
    struct cf_error e;
    if (store_status("Follow", &st, &e) == CF_OK) {
        cf_error_set(&e, CF_UNAVAILABLE, "the Follow of %s ended before the subagent settled",
                     tc->child_conversation_id);
    }
    retry_or_fault(tc, "following a subagent's task failed", &e);
}

/* in_flight: something of tc is still running (its Admit, its Follow, or a retry). */
static bool in_flight(const struct task_call *tc)
{
    return tc->admit.in_flight || tc->follow || (!tc->done && tc->retry_at_ms);
}

/* out_of_time gives the calls still waiting for a child an error result when the submission
 * reached its time limit (the drive then fails at its next turn; storaged aborts the children
 * when it settles). Returns the monotonic time of the limit while it is ahead, for the timer
 * (0: none, or passed). */
static int64_t out_of_time(struct drive *d, int64_t now)
{
    int64_t left = drive_time_left(d);
    if (left == INT64_MAX) {
        return 0;
    }
    for (size_t i = 0; left <= 0 && i < d->tasks.n; i++) {
        struct task_call *tc = &d->tasks.calls[i];
        if (!tc->done && !tc->skill && !drive_halted(d)) {
            record(tc, "The subagent's work was cut off: this submission reached its time limit.",
                   true);
        }
    }
    return left > 0 ? now + left : 0;
}

bool task_poll(struct drive *d)
{
    struct task_wait *tw = &d->tasks;
    if (!tw->n) {
        return true;
    }
    int64_t now = clock_mono_ms(), due = out_of_time(d, now);
    bool any = false;
    for (size_t i = 0; i < tw->n; i++) {
        struct task_call *tc = &tw->calls[i];
        if (tc->admit.in_flight) {
            poll_admit(tc);
        }
        if (tc->follow) {
            poll_follow(tc);
        }
        if (tc->retry_at_ms && (drive_halted(d) || tc->done)) {
            tc->retry_at_ms = 0;
        } else if (tc->retry_at_ms && now >= tc->retry_at_ms) {
            tc->retry_at_ms = 0;
            if (tc->child_submission_id) {
                follow_open(tc);
            } else {
                admit_send(tc);
            }
        }
        if (tc->retry_at_ms && (!due || tc->retry_at_ms < due)) {
            due = tc->retry_at_ms;
        }
        any = any || in_flight(tc);
    }
    if (due) {
        engine_post_at(d, due);
    }
    if (any) {
        return false;
    }
    task_wait_cleanup(d);
    task_wait_init(d);
    return true;
}

bool task_resume(struct drive *d)
{
    const Cflue__V1__AssistantMessage *am = NULL;
    for (size_t i = 0; i < d->log.n; i++) {
        const Cflue__V1__Record *r = d->log.recs[i];
        if (r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE &&
            !strcmp(r->submission_id, d->sub->submission_id)) {
            am = r->assistant_message;
        }
    }
    bool waiting = false;
    for (size_t k = 0; am && k < am->n_tool_calls; k++) {
        char id[600];
        context_tool_result_id(id, sizeof(id), d->sub->submission_id, am->turn,
                               am->tool_calls[k]->id);
        waiting =
            waiting || (task_is_framework(am->tool_calls[k]->name) && !rlog_find(&d->log, id));
    }
    if (!waiting) {
        return false;
    }
    llm_response_cleanup(&d->answer);
    llm_response_init(&d->answer);
    d->answer.calls = mem_alloc(sizeof(*d->answer.calls) * am->n_tool_calls);
    for (size_t k = 0; k < am->n_tool_calls; k++) {
        d->answer.calls[k].id = mem_strdup(am->tool_calls[k]->id);
        d->answer.calls[k].name = mem_strdup(am->tool_calls[k]->name);
        d->answer.calls[k].arguments_json = mem_strdup(am->tool_calls[k]->arguments_json);
    }
    d->answer.n_calls = am->n_tool_calls;
    d->turn = am->turn;
    log_info("task_resume", "submission=%s turn=%d", d->sub->submission_id, d->turn);
    return true;
}

void task_wait_init(struct drive *d)
{
    memset(&d->tasks, 0, sizeof(d->tasks));
    pthread_mutex_init(&d->tasks.mu, NULL);
}

void task_wait_cleanup(struct drive *d)
{
    struct task_wait *tw = &d->tasks;
    for (size_t i = 0; i < tw->n; i++) {
        struct task_call *tc = &tw->calls[i];
        /* poll_admit takes every Admit's end before the drive is freed, and ends its ticket;
         * one left here anyway would hold every later take-back: treated as lost */
        engine_admit_unanswered(tc->admit_ticket, CF_UNAVAILABLE);
        dcall_cleanup(&tc->admit);
        if (tc->record) {
            protobuf_c_message_free_unpacked(tc->record, NULL);
        }
        free(tc->agent);
        free(tc->prompt);
        free(tc->cwd);
        free(tc->atts);
        free(tc->child_submission_id);
        free(tc->child_conversation_id);
        free(tc->answer);
    }
    free(tw->calls);
    tw->calls = NULL;
    tw->n = 0;
    pthread_mutex_destroy(&tw->mu);
}
