/* api.c - cflue.v1.Agent: the public API.
 *
 * Submit validates against the agents this process serves and admits through storaged; it
 * answers only after storaged committed, and no thread waits meanwhile (the Admit is an
 * event-driven call; at most SUBMITS_IN_FLIGHT_MAX at once). Watch and GetSubmission read storaged
 * (watch.c: no thread per watcher, one shared storaged Follow per watched conversation); Abort
 * records the durable intent in storaged and stops the submission at once when it runs here (other
 * processes see the intent within a second through their abort polling). Compact admits a
 * submission of kind SUBMISSION_KIND_COMPACT and waits for it to settle.
 *
 * Authentication (agentd --tokens, tokens.h): every method first finds the caller's principal
 * from its bearer token (UNAUTHENTICATED without a known one), then checks what it names: the
 * agent against the token's `agents` (Submit, Compact: PERMISSION_DENIED, AGENT_NOT_ALLOWED;
 * ListAgents lists only those), the conversation's principal as storaged recorded it (its
 * durable record, never a cache here: a conversation id may be chosen by any caller) against
 * the caller's (PERMISSION_DENIED, NOT_CONVERSATION_OWNER; an admin token passes). Submit's
 * ownership check is storaged's own, in the Admit's transaction (AdmitRequest.principal), so
 * two agentds cannot race one conversation id into two principals' hands; the other methods
 * read the conversation (or the submission, which carries its conversation's principal) before
 * acting. Without --tokens none of this runs and nothing costs a call more.
 *
 * Tracing: the server runs each handler with the trace the call's `traceparent` carried
 * (rpc_server.c), so its lines and Store calls carry it. Submit and Compact give the
 * submission they admit that trace, or a new one when the call carried none usable
 * (submission_trace); storaged keeps it (AdmitRequest.traceparent) and every drive of the
 * submission carries it on. A bad traceparent never fails a call.
 *
 * Errors carry an ErrorInfo reason: UNKNOWN_AGENT, RESERVED_METADATA_KEY, NOTHING_TO_COMPACT,
 * COMPACTION_FAILED, INVALID_PAGE_TOKEN, AGENT_NOT_ALLOWED, NOT_CONVERSATION_OWNER here; an
 * error storaged answered keeps storaged's reason (store_call).
 */
#include "agentd.h"
#include "clients.h"
#include "clock.h"
#include "engine.h"
#include "errinfo.h"
#include "guard.h"
#include "log.h"
#include "mem.h"
#include "metadata.h"
#include "tokens.h"
#include "trace.h"
#include "watch.h"

#include "cflue/v1/agent.pb-c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* store_timeout: how long a Store call made for call c may take. */
static int64_t store_timeout(struct rpc_call *c)
{
    return store_timeout_within(rpc_call_remaining_ms(c));
}

static void fail_err(struct rpc_call *c, const struct cf_error *err)
{
    rpc_call_fail_error(c, err);
}

/* unknown_agent fails a call naming an agent this agentd does not serve. */
static void unknown_agent(struct rpc_call *c, const char *name)
{
    struct cf_error e;
    cf_error_setr(&e, CF_NOT_FOUND, "UNKNOWN_AGENT", "no agent named '%s' (see ListAgents)", name);
    fail_err(c, &e);
}

/* caller authenticates the call (tokens.h): true with *p its principal (empty without
 * --tokens); else the call is failed UNAUTHENTICATED and false returned. The token is read into
 * a buffer wiped after use, and never logged or repeated. */
static bool caller(struct rpc_call *c, const char *method, struct principal *p)
{
    struct cf_error err;
    char auth[TOKENS_AUTHORIZATION_MAX + 1];
    memset(p, 0, sizeof(*p));
    if (!tokens_enabled()) {
        return true;
    }
    bool has = rpc_call_metadata(c, "authorization", auth, sizeof(auth));
    enum cf_status rc = tokens_authenticate(has ? auth : NULL, p, &err);
    explicit_bzero(auth, sizeof(auth));
    if (rc != CF_OK) {
        log_info("auth_refused", "method=%s why=%s", method, has ? "unknown_token" : "no_token");
        fail_err(c, &err);
        return false;
    }
    return true;
}

/* owner_allows: p may act on a conversation of principal owner (tokens_owns); else the call is
 * failed PERMISSION_DENIED (NOT_CONVERSATION_OWNER, naming neither principal). what and id
 * name the object asked for ("conversation", its id). */
static bool owner_allows(struct rpc_call *c, const struct principal *p, const char *owner,
                         const char *what, const char *id)
{
    struct cf_error e;
    if (tokens_owns(p, owner)) {
        return true;
    }
    cf_error_setr(&e, CF_PERMISSION, "NOT_CONVERSATION_OWNER", "%s '%.128s' belongs to %s", what,
                  id,
                  *owner ? "another principal"
                         : "no principal (it was made without authentication): only an admin "
                           "token may act on it");
    fail_err(c, &e);
    return false;
}

/* agent_allows: p's token may use agent (tokens_allow_agent); else the call is failed
 * PERMISSION_DENIED (AGENT_NOT_ALLOWED). */
static bool agent_allows(struct rpc_call *c, const struct principal *p, const char *agent)
{
    struct cf_error e;
    if (tokens_allow_agent(p, agent)) {
        return true;
    }
    cf_error_setr(&e, CF_PERMISSION, "AGENT_NOT_ALLOWED",
                  "the token '%s' may not use agent '%.128s' (its agents in the token file)",
                  p->name, agent);
    fail_err(c, &e);
    return false;
}

/* owns_conversation reads the conversation's principal from storaged and checks it
 * (owner_allows); false with the call failed (storaged's error, or PERMISSION_DENIED). Costs
 * nothing without authentication. Blocks for the Get: not for RPC_INLINE handlers. */
static bool owns_conversation(struct rpc_call *c, const struct principal *p,
                              const char *conversation_id)
{
    struct cf_error err;
    ProtobufCMessage *conv = NULL;
    if (!*p->name) {
        return true;
    }
    Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
    cr.conversation_id = (char *)conversation_id;
    if (store_call(g_agentd.store, "GetConversation", &cr.base,
                   &cflue__v1__conversation__descriptor, store_timeout(c), &conv, &err) != CF_OK) {
        fail_err(c, &err);
        return false;
    }
    bool ok = owner_allows(c, p, ((Cflue__V1__Conversation *)conv)->principal, "conversation",
                           conversation_id);
    protobuf_c_message_free_unpacked(conv, NULL);
    return ok;
}

/* call_over tells a stream guard that our caller went away or the server stops. */
static bool call_over(void *call)
{
    return rpc_call_cancelled(call);
}

/* submission_trace fills out with the trace of a submission admitted now: the one the call
 * carried (the caller's span its parent: the server made it the thread's current trace), else
 * a new one. */
static void submission_trace(struct trace_ctx *out)
{
    const struct trace_ctx *cur = trace_current();
    if (cur) {
        *out = *cur;
    } else {
        trace_start(out);
    }
}

/* admit_trace gives ar the thread's current trace (traceparent is its storage; ar points into
 * it and into the thread's trace, which must not change until ar is sent). */
static void admit_trace(Cflue__V1__AdmitRequest *ar, char traceparent[TRACE_PARENT_SIZE])
{
    const struct trace_ctx *t = trace_current();
    trace_format(t, traceparent);
    ar->traceparent = traceparent;
    ar->tracestate = t ? (char *)t->state : "";
}

/* Submits whose Admit is in flight (no thread holds them); past SUBMITS_IN_FLIGHT_MAX of
 * them, or --submit-memory-mib of their messages (one is always let in), a Submit is refused
 * as busy, so a flood of them cannot queue unbounded work on storaged, nor hold gigabytes
 * here while storaged is slow to answer (each holds its request and its Admit). */
#define SUBMITS_IN_FLIGHT_MAX 4096
static atomic_int submits_in_flight;
static atomic_llong submit_bytes_in_flight;

/* A Submit between its Admit's start and its answer. */
struct submit {
    struct rpc_call *c;
    const Cflue__V1__SubmitRequest *req;   /* the call's: valid until the call is answered */
    char principal[IDS_PRINCIPAL_MAX + 1]; /* the caller's ("" without --tokens) */
    struct trace_ctx trace;                /* the Submit's (submission_trace) */
    uint64_t admit_ticket;                 /* engine_claim_with_admit's (0: no claim) */
    long long bytes;                       /* its message's, in submit_bytes_in_flight */
};

/* on_admitted (rpc's client loop) answers the Submit with what its Admit did. Nothing here
 * blocks: the claimed drive is queued for the engine, the claimer woken. */
static void on_admitted(void *arg, const struct rpc_status *st, ProtobufCMessage *resp)
{
    struct submit *s = arg;
    struct rpc_call *c = s->c;
    const Cflue__V1__SubmitRequest *req = s->req;
    char principal[IDS_PRINCIPAL_MAX + 1];
    struct trace_ctx saved;
    uint64_t ticket = s->admit_ticket;
    snprintf(principal, sizeof(principal), "%s", s->principal);
    trace_enter(&s->trace, &saved); /* on the client loop: the Submit's lines carry its trace */
    atomic_fetch_sub(&submit_bytes_in_flight, s->bytes);
    free(s);
    atomic_fetch_sub(&submits_in_flight, 1);
    struct cf_error err;
    if (store_status("Admit", st, &err) != CF_OK) {
        engine_admit_unanswered(ticket, err.code); /* its claim may have committed */
        fail_err(c, &err);
        trace_leave(&saved);
        return;
    }
    Cflue__V1__AdmitResponse *r = (Cflue__V1__AdmitResponse *)resp;
    bool claimed = r->claim && r->claim->submission;
    (void)engine_admitted(ticket, r); /* a retried Submit's earlier claim is taken back too */
    Cflue__V1__Admission out = CFLUE__V1__ADMISSION__INIT;
    out.submission_id = r->submission->submission_id;
    out.conversation_id = r->submission->conversation_id;
    out.offset = r->offset;
    out.deduplicated = r->deduplicated;
    out.traceparent = r->submission->traceparent; /* a retried Submit's: the first one's */
    log_info("submit", "submission=%s conversation=%s agent=%s dedup=%d claimed=%d principal=%s",
             out.submission_id, out.conversation_id, req->agent, (int)out.deduplicated,
             (int)claimed, *principal ? principal : "-");
    /* not claimed: it waits behind its conversation's running work (a drive here joins it or
     * its settlement wakes the claimer), or the claimer takes it when there is room */
    bool behind_here = !claimed && !out.deduplicated && agentd_note_queued(out.conversation_id);
    rpc_call_reply(c, &out.base); /* req is gone with the call from here on */
    protobuf_c_message_free_unpacked(resp, NULL);
    if (!claimed && !behind_here) {
        agentd_wake();
    }
    trace_leave(&saved);
}

/* agent_known: the definitions in force have an agent named name; *has_model says whether its
 * definition names a model. */
static bool agent_known(const char *name, bool *has_model)
{
    struct agent_defs *defs = defs_get();
    const struct agent_def *a = agents_find(&defs->agents, name);
    *has_model = a && a->model;
    defs_put(defs);
    return a != NULL;
}

/* on_submit checks the request and starts its Admit (rpc_acall_start): no thread waits for
 * storaged's commit, and concurrent Submits share its group commits. on_admitted answers. */
static void on_submit(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__SubmitRequest *req = (const void *)msg;
    struct cf_error err;
    struct principal p;
    if (!caller(c, "Submit", &p)) {
        return;
    }
    if (!*req->agent) {
        rpc_call_fail(c, CF_INVALID, "agent is required");
        return;
    }
    /* before UNKNOWN_AGENT: a token learns nothing of agents it may not use */
    if (!agent_allows(c, &p, req->agent)) {
        return;
    }
    bool has_model;
    if (!agent_known(req->agent, &has_model)) {
        unknown_agent(c, req->agent);
        return;
    }
    if (!has_model) {
        rpc_call_fail(c, CF_PRECONDITION,
                      "agent %.128s names no model: it runs only as a subagent, with its parent's",
                      req->agent);
        return;
    }
    if (!req->message || (!*req->message->text && !req->message->n_attachments)) {
        rpc_call_fail(c, CF_INVALID, "message needs text or at least one attachment");
        return;
    }
    if (metadata_check(req->metadata, req->n_metadata, &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    long long bytes = (long long)protobuf_c_message_get_packed_size(&req->message->base);
    long long held = atomic_fetch_add(&submit_bytes_in_flight, bytes);
    if (atomic_fetch_add(&submits_in_flight, 1) >= SUBMITS_IN_FLIGHT_MAX ||
        (held > 0 && held + bytes > g_agentd.submit_mib << 20)) {
        atomic_fetch_sub(&submits_in_flight, 1);
        atomic_fetch_sub(&submit_bytes_in_flight, bytes);
        rpc_call_fail(c, CF_BUSY,
                      "agentd busy: Submits being admitted hold %lld MiB of messages (at most "
                      "%d Submits, %lld MiB, at once); retry later",
                      held >> 20, SUBMITS_IN_FLIGHT_MAX, g_agentd.submit_mib);
        return;
    }
    Cflue__V1__AdmitRequest ar = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitRequest__MetadataEntry **md = NULL;
    ar.agent = req->agent;
    ar.conversation_id = req->conversation_id;
    ar.message = req->message;
    ar.idempotency_key = req->idempotency_key;
    ar.source = req->source;
    ar.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE;
    /* storaged records it with a new conversation and refuses it for another principal's */
    ar.principal = p.name;
    ar.admin = p.admin;
    /* the map entries have the same layout; copy them into the Admit type */
    if (req->n_metadata) {
        md = mem_alloc(sizeof(void *) * req->n_metadata);
        for (size_t i = 0; i < req->n_metadata; i++) {
            md[i] = mem_alloc(sizeof(**md));
            cflue__v1__admit_request__metadata_entry__init(md[i]);
            md[i]->key = req->metadata[i]->key;
            md[i]->value = req->metadata[i]->value;
        }
        ar.metadata = md;
        ar.n_metadata = req->n_metadata;
    }
    /* with room for a drive, the Admit claims the submission too when it can run at once:
     * no Claim call, and its drive is live here before this answers */
    struct engine_admit_claim claim;
    engine_claim_with_admit(&ar, &claim);
    struct submit *s = mem_alloc(sizeof(*s));
    size_t n_md = req->n_metadata;
    char traceparent[TRACE_PARENT_SIZE];
    struct trace_ctx saved;
    s->c = c;
    s->req = req;
    s->admit_ticket = claim.ticket;
    s->bytes = bytes;
    snprintf(s->principal, sizeof(s->principal), "%s", p.name);
    submission_trace(&s->trace);
    trace_enter(&s->trace, &saved); /* the Admit call carries it too */
    admit_trace(&ar, traceparent);
    /* the request is copied: ar and md may go at once. on_admitted may have run (and the
     * call, req with it, be gone) before this returns: s is not read after the start. */
    rpc_acall_start(g_agentd.store, "/cflue.v1.Store/Admit", &ar.base,
                    &cflue__v1__admit_response__descriptor, STORE_TIMEOUT_MS, on_admitted, s);
    trace_leave(&saved);
    for (size_t i = 0; i < n_md; i++) {
        free(md[i]);
    }
    free(md);
}

/* Watch and GetSubmission(wait) hold no thread while they wait: watch.c. */
static void on_watch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__WatchRequest *req = (const void *)msg;
    struct principal p;
    /* on the worker pool (RPC_ASYNC): the ownership check's Get may block briefly, as
     * watch_start's own first Read does */
    if (!caller(c, "Watch", &p) ||
        (*req->conversation_id && !owns_conversation(c, &p, req->conversation_id))) {
        return;
    }
    watch_start(c, req);
}

/* wait_settled (Compact's wait, on its own thread) blocks until the submission is settled,
 * following its conversation's stream from the current head (so no history is replayed), or until
 * the caller goes away; returns the settled submission (caller frees) or NULL with err set. */
static Cflue__V1__Submission *wait_settled(struct rpc_call *c, const char *submission_id,
                                           struct cf_error *err)
{
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    gr.submission_id = (char *)submission_id;
    for (int round = 0;; round++) {
        ProtobufCMessage *resp = NULL, *conv = NULL;
        if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                       store_timeout(c), &resp, err) != CF_OK) {
            return NULL;
        }
        Cflue__V1__Submission *s = (Cflue__V1__Submission *)resp;
        if (s->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
            return s;
        }
        Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
        cr.conversation_id = s->conversation_id;
        if (store_call(g_agentd.store, "GetConversation", &cr.base,
                       &cflue__v1__conversation__descriptor, store_timeout(c), &conv,
                       err) == CF_OK) {
            /* a settlement that lands between Get and here is at or before the head, and
             * Follow then ends at once */
            Cflue__V1__FollowRequest fr = CFLUE__V1__FOLLOW_REQUEST__INIT;
            fr.conversation_id = s->conversation_id;
            fr.after_offset = ((Cflue__V1__Conversation *)conv)->head_offset;
            fr.until_settled = s->submission_id;
            int64_t left = rpc_call_remaining_ms(c);
            struct rpc_stream *fs = rpc_stream_open(g_agentd.store, "/cflue.v1.Store/Follow",
                                                    &fr.base, left > 0 ? left : 0);
            ProtobufCMessage *m;
            struct stream_guard guard;
            struct cf_error gerr;
            /* unguarded, the stream is cancelled at once and this loop polls instead */
            (void)!guard_start(&guard, fs, call_over, c, &gerr);
            while (rpc_stream_read(fs, &cflue__v1__record__descriptor, &m) == 1) {
                protobuf_c_message_free_unpacked(m, NULL);
            }
            guard_end(&guard);
            struct rpc_status st;
            rpc_stream_finish(fs, &st);
            protobuf_c_message_free_unpacked(conv, NULL);
        }
        protobuf_c_message_free_unpacked(resp, NULL);
        if (rpc_call_cancelled(c) || (round > 0 && rpc_call_wait(c, 200))) {
            cf_error_set(err, CF_CANCELLED, "the caller went away or the server stops");
            return NULL;
        }
    }
}

static void on_get(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GetSubmissionRequest *req = (const void *)msg;
    struct cf_error err;
    struct principal p;
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    gr.submission_id = req->submission_id;
    if (!caller(c, "GetSubmission", &p)) {
        return;
    }
    if (!*req->submission_id) {
        rpc_call_fail(c, CF_INVALID, "submission_id is required");
        return;
    }
    if (req->wait && !*p.name) {
        watch_wait_settled(c, req->submission_id);
        return;
    }
    if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                   store_timeout(c), &resp, &err) != CF_OK) {
        resp = NULL;
    }
    if (!resp) {
        fail_err(c, &err);
        return;
    }
    /* a submission carries its conversation's principal (storaged's copy) */
    if (!owner_allows(c, &p, ((Cflue__V1__Submission *)resp)->principal, "submission",
                      req->submission_id)) {
        protobuf_c_message_free_unpacked(resp, NULL);
        return;
    }
    if (req->wait) {
        protobuf_c_message_free_unpacked(resp, NULL);
        watch_wait_settled(c, req->submission_id);
        return;
    }
    rpc_call_reply(c, resp);
    protobuf_c_message_free_unpacked(resp, NULL);
}

static void on_abort(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__AbortRequest *req = (const void *)msg;
    struct cf_error err;
    struct principal p;
    Cflue__V1__RequestAbortRequest ar = CFLUE__V1__REQUEST_ABORT_REQUEST__INIT;
    if (!caller(c, "Abort", &p)) {
        return;
    }
    switch (req->target_case) {
    case CFLUE__V1__ABORT_REQUEST__TARGET_CONVERSATION_ID:
        ar.target_case = CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_CONVERSATION_ID;
        ar.conversation_id = req->conversation_id;
        break;
    case CFLUE__V1__ABORT_REQUEST__TARGET_SUBMISSION_ID:
        ar.target_case = CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_SUBMISSION_ID;
        ar.submission_id = req->submission_id;
        break;
    default:
        rpc_call_fail(c, CF_INVALID, "target is required: conversation_id or submission_id");
        return;
    }
    ar.reason = "aborted on request";
    ProtobufCMessage *resp = NULL;
    if (*p.name && ar.target_case == CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_CONVERSATION_ID &&
        !owns_conversation(c, &p, ar.conversation_id)) {
        return;
    }
    if (*p.name && ar.target_case == CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_SUBMISSION_ID) {
        Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
        gr.submission_id = ar.submission_id;
        if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                       store_timeout(c), &resp, &err) != CF_OK) {
            fail_err(c, &err);
            return;
        }
        bool ok = owner_allows(c, &p, ((Cflue__V1__Submission *)resp)->principal, "submission",
                               ar.submission_id);
        protobuf_c_message_free_unpacked(resp, NULL);
        resp = NULL;
        if (!ok) {
            return;
        }
    }
    if (store_call(g_agentd.store, "RequestAbort", &ar.base,
                   &cflue__v1__request_abort_response__descriptor, store_timeout(c), &resp,
                   &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    Cflue__V1__RequestAbortResponse *r = (Cflue__V1__RequestAbortResponse *)resp;
    for (size_t i = 0; i < r->n_affected; i++) {
        agentd_mark_abort(r->affected[i]);
    }
    Cflue__V1__AbortResponse out = CFLUE__V1__ABORT_RESPONSE__INIT;
    out.aborted = r->n_affected > 0;
    out.affected = r->affected;
    out.n_affected = r->n_affected;
    log_info("abort", "affected=%zu principal=%s", r->n_affected, *p.name ? p.name : "-");
    rpc_call_reply(c, &out.base);
    protobuf_c_message_free_unpacked(resp, NULL);
    agentd_wake();
}

static void on_list_agents(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ListAgentsRequest *req = (const void *)msg;
    Cflue__V1__ListAgentsResponse out = CFLUE__V1__LIST_AGENTS_RESPONSE__INIT;
    char next[PAGE_TOKEN_MAX];
    size_t first, n;
    struct cf_error err;
    struct principal p;
    if (!caller(c, "ListAgents", &p)) {
        return;
    }
    struct agent_defs *defs = defs_get(); /* held until the answer is sent */
    /* the agents the token may use, paged as the whole list would be (by name): a view of
     * shallow copies, valid while defs is held */
    struct agent_set allowed = defs->agents, *set = &defs->agents;
    if (*p.name) {
        allowed.items = mem_alloc(sizeof(*allowed.items) * (defs->agents.n + 1));
        allowed.n = 0;
        for (size_t i = 0; i < defs->agents.n; i++) {
            if (tokens_allow_agent(&p, defs->agents.items[i].name)) {
                allowed.items[allowed.n++] = defs->agents.items[i];
            }
        }
        set = &allowed;
    }
    if (agents_page(set, req->page_size, req->page_token, &first, &n, next, &err) != CF_OK) {
        if (set == &allowed) {
            free(allowed.items);
        }
        defs_put(defs);
        fail_err(c, &err);
        return;
    }
    Cflue__V1__AgentInfo *infos = mem_alloc(sizeof(*infos) * (n + 1));
    Cflue__V1__AgentInfo **ptrs = mem_alloc(sizeof(void *) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        const struct agent_def *a = &set->items[first + i];
        cflue__v1__agent_info__init(&infos[i]);
        infos[i].name = a->name;
        infos[i].description = a->description ? a->description : "";
        infos[i].model = a->model ? a->model : ""; /* "": its parent's */
        infos[i].subagents = a->subagents;
        infos[i].n_subagents = a->n_subagents;
        infos[i].skills = a->skills;
        infos[i].n_skills = a->n_skills;
        ptrs[i] = &infos[i];
    }
    out.agents = ptrs;
    out.n_agents = n;
    out.next_page_token = next;
    rpc_call_reply(c, &out.base);
    free(infos);
    free(ptrs);
    if (set == &allowed) {
        free(allowed.items);
    }
    defs_put(defs);
}

static void on_get_conversation(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GetConversationRequest *req = (const void *)msg;
    struct cf_error err;
    struct principal who;
    Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
    cr.conversation_id = req->conversation_id;
    ProtobufCMessage *conv = NULL, *list = NULL, *page = NULL;
    if (!caller(c, "GetConversation", &who)) {
        return;
    }
    if (store_call(g_agentd.store, "GetConversation", &cr.base,
                   &cflue__v1__conversation__descriptor, store_timeout(c), &conv, &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    if (!owner_allows(c, &who, ((Cflue__V1__Conversation *)conv)->principal, "conversation",
                      req->conversation_id)) {
        protobuf_c_message_free_unpacked(conv, NULL);
        return;
    }
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    lr.conversation_id = req->conversation_id;
    lr.page_size = 1000;
    if (store_call(g_agentd.store, "List", &lr.base, &cflue__v1__list_response__descriptor,
                   store_timeout(c), &list, &err) != CF_OK) {
        protobuf_c_message_free_unpacked(conv, NULL);
        fail_err(c, &err);
        return;
    }
    Cflue__V1__Conversation *cv = (Cflue__V1__Conversation *)conv;
    Cflue__V1__ListResponse *ls = (Cflue__V1__ListResponse *)list;
    Cflue__V1__ConversationView out = CFLUE__V1__CONVERSATION_VIEW__INIT;
    out.conversation_id = cv->conversation_id;
    out.agent = cv->agent;
    out.head_offset = cv->head_offset;
    out.principal = cv->principal;
    out.submissions = ls->submissions;
    out.n_submissions = ls->n_submissions;
    if (req->include_records) {
        /* one page of storaged's Read: its page token (scoped to the conversation) is this
         * view's, passed through both ways */
        Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
        rq.conversation_id = req->conversation_id;
        rq.after_offset = -1;
        rq.page_size = req->page_size;
        rq.page_token = req->page_token;
        if (store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                       store_timeout(c), &page, &err) != CF_OK) {
            protobuf_c_message_free_unpacked(conv, NULL);
            protobuf_c_message_free_unpacked(list, NULL);
            fail_err(c, &err);
            return;
        }
        const Cflue__V1__ReadResponse *p = (const Cflue__V1__ReadResponse *)page;
        out.records = p->records;
        out.n_records = p->n_records;
        out.next_page_token = p->next_page_token;
    }
    rpc_call_reply(c, &out.base);
    protobuf_c_message_free_unpacked(conv, NULL);
    protobuf_c_message_free_unpacked(list, NULL);
    if (page) {
        protobuf_c_message_free_unpacked(page, NULL);
    }
}

/* find_compaction looks for the compaction record submission sid wrote, reading the
 * conversation after offset `after`; fills out's tokens and record_offset (left -1 when there
 * is none). */
static enum cf_status find_compaction(const char *conversation_id, const char *sid, int64_t after,
                                      Cflue__V1__CompactResponse *out, struct cf_error *err)
{
    for (;;) {
        Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
        ProtobufCMessage *page = NULL;
        enum cf_status rc;
        rq.conversation_id = (char *)conversation_id;
        rq.after_offset = after;
        rq.page_size = 1000;
        if ((rc =
                 store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                            STORE_TIMEOUT_MS, &page, err)) != CF_OK) {
            return rc;
        }
        Cflue__V1__ReadResponse *p = (Cflue__V1__ReadResponse *)page;
        for (size_t i = 0; i < p->n_records; i++) {
            const Cflue__V1__Record *r = p->records[i];
            if (r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION &&
                !strcmp(r->submission_id, sid)) {
                out->tokens_before = r->compaction->tokens_before;
                out->tokens_after = r->compaction->tokens_after;
                out->record_offset = r->offset;
            }
        }
        bool more = *p->next_page_token && p->n_records;
        if (p->n_records) {
            after = p->records[p->n_records - 1]->offset;
        }
        protobuf_c_message_free_unpacked(page, NULL);
        if (!more) {
            return CF_OK;
        }
    }
}

/* compact runs Compact under the trace its submission is admitted with (on_compact). */
static void compact(struct rpc_call *c, const Cflue__V1__CompactRequest *req)
{
    struct cf_error err;
    struct principal p;
    ProtobufCMessage *conv = NULL, *resp = NULL;
    Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
    cr.conversation_id = req->conversation_id;
    if (!caller(c, "Compact", &p)) {
        return;
    }
    if (!*req->conversation_id) {
        rpc_call_fail(c, CF_INVALID, "conversation_id is required");
        return;
    }
    if (store_call(g_agentd.store, "GetConversation", &cr.base,
                   &cflue__v1__conversation__descriptor, store_timeout(c), &conv, &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    const char *agent = ((Cflue__V1__Conversation *)conv)->agent;
    bool has_model;
    if (!owner_allows(c, &p, ((Cflue__V1__Conversation *)conv)->principal, "conversation",
                      req->conversation_id) ||
        !agent_allows(c, &p, agent)) {
        protobuf_c_message_free_unpacked(conv, NULL);
        return;
    }
    if (!agent_known(agent, &has_model)) {
        unknown_agent(c, agent);
        protobuf_c_message_free_unpacked(conv, NULL);
        return;
    }
    if (!has_model) {
        rpc_call_fail(c, CF_PRECONDITION,
                      "agent %.128s names no model: a compaction needs one, and only a parent's "
                      "task call hands it one",
                      agent);
        protobuf_c_message_free_unpacked(conv, NULL);
        return;
    }
    /* compaction runs as a submission of its own kind: durable, in order with the
     * conversation's other work, fenced like any turn, never joined; it carries no message */
    Cflue__V1__AdmitRequest ar = CFLUE__V1__ADMIT_REQUEST__INIT;
    ar.agent = (char *)agent;
    ar.conversation_id = req->conversation_id;
    ar.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
    ar.idempotency_key = req->idempotency_key; /* a retry waits on the same compaction */
    ar.principal = p.name; /* storaged checks the conversation's principal again */
    ar.admin = p.admin;
    char traceparent[TRACE_PARENT_SIZE];
    admit_trace(&ar, traceparent);
    enum cf_status rc =
        store_call(g_agentd.store, "Admit", &ar.base, &cflue__v1__admit_response__descriptor,
                   store_timeout(c), &resp, &err);
    protobuf_c_message_free_unpacked(conv, NULL);
    if (rc != CF_OK) {
        fail_err(c, &err);
        return;
    }
    char sid[128];
    const Cflue__V1__AdmitResponse *admitted = (const Cflue__V1__AdmitResponse *)resp;
    int64_t head = admitted->offset;
    snprintf(sid, sizeof(sid), "%s", admitted->submission->submission_id);
    protobuf_c_message_free_unpacked(resp, NULL);
    agentd_wake();
    Cflue__V1__Submission *done = wait_settled(c, sid, &err);
    if (!done) {
        fail_err(c, &err);
        return;
    }
    Cflue__V1__CompactResponse out = CFLUE__V1__COMPACT_RESPONSE__INIT;
    out.submission_id = sid;
    out.record_offset = -1;
    /* the compaction record this submission wrote (after the head it was admitted at), if
     * there was anything to compact */
    rc = find_compaction(req->conversation_id, sid, head, &out, &err);
    bool failed = done->outcome != CFLUE__V1__OUTCOME__OUTCOME_COMPLETED;
    bool oversized = !strcmp(done->error, AGENTD_NOTHING_TO_COMPACT_OVERSIZED);
    bool nothing = failed && out.record_offset < 0 &&
                   (oversized || !strcmp(done->error, AGENTD_NOTHING_TO_COMPACT));
    char why[600];
    snprintf(why, sizeof(why), "the compaction did not complete: %s", done->error);
    protobuf_c_message_free_unpacked(&done->base, NULL);
    if (nothing || (!failed && rc == CF_OK && out.record_offset < 0)) {
        cf_error_setr(&err, CF_PRECONDITION, "NOTHING_TO_COMPACT", "%s",
                      oversized ? AGENTD_NOTHING_TO_COMPACT_OVERSIZED : AGENTD_NOTHING_TO_COMPACT);
        fail_err(c, &err);
        return;
    }
    if (failed) {
        cf_error_setr(&err, CF_UNAVAILABLE, "COMPACTION_FAILED", "%s", why);
        fail_err(c, &err);
        return;
    }
    if (rc != CF_OK) {
        fail_err(c, &err);
        return;
    }
    rpc_call_reply(c, &out.base);
}

static void on_compact(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    struct trace_ctx t, saved;
    submission_trace(&t);
    trace_enter(&t, &saved); /* its lines, its Store calls and its submission carry it */
    compact(c, (const Cflue__V1__CompactRequest *)msg);
    trace_leave(&saved);
}

void api_register(struct rpc_server *srv)
{
    static const struct rpc_method_def methods[] = {
        /* Submit waits for its Admit without a thread: on_submit only starts it */
        {"/cflue.v1.Agent/Submit", &cflue__v1__submit_request__descriptor, on_submit, RPC_INLINE},
        {"/cflue.v1.Agent/Watch", &cflue__v1__watch_request__descriptor, on_watch, RPC_ASYNC},
        {"/cflue.v1.Agent/GetSubmission", &cflue__v1__get_submission_request__descriptor, on_get,
         RPC_ASYNC},
        {"/cflue.v1.Agent/Abort", &cflue__v1__abort_request__descriptor, on_abort, RPC_POOL},
        /* Compact waits for its own submission's outcome on a thread of its own */
        {"/cflue.v1.Agent/Compact", &cflue__v1__compact_request__descriptor, on_compact,
         RPC_THREAD},
        {"/cflue.v1.Agent/ListAgents", &cflue__v1__list_agents_request__descriptor, on_list_agents,
         RPC_INLINE},
        {"/cflue.v1.Agent/GetConversation", &cflue__v1__get_conversation_request__descriptor,
         on_get_conversation, RPC_POOL},
    };
    watch_init(srv);
    rpc_server_add_methods(srv, methods, sizeof(methods) / sizeof(methods[0]), NULL);
}
