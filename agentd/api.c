/* api.c - cflue.v1.Agent: the public API.
 *
 * Submit validates against the agents this process serves and admits through storaged; it
 * returns only after storaged committed. Watch and GetSubmission read storaged; Abort records
 * the durable intent in storaged and stops the submission at once when it runs here (other
 * processes see the intent within a second through their abort polling).
 */
#include "agentd.h"
#include "clients.h"
#include "clock.h"
#include "guard.h"
#include "log.h"
#include "mem.h"

#include "cflue/v1/agent.pb-c.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STORE_TIMEOUT_MS 15000

static void fail_err(struct rpc_call *c, const struct cf_error *err)
{
    rpc_call_fail_error(c, err);
}

/* call_over tells a stream guard that our caller went away or the server stops. */
static bool call_over(void *call)
{
    return rpc_call_cancelled(call);
}

static void on_submit(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__SubmitRequest *req = (const void *)msg;
    struct cf_error err;
    if (!*req->agent) {
        rpc_call_fail(c, CF_INVALID, "agent is required");
        return;
    }
    if (!agents_find(&g_agentd.agents, req->agent)) {
        rpc_call_fail(c, CF_NOT_FOUND, "no agent named '%s' (see ListAgents)", req->agent);
        return;
    }
    if (!req->message || (!*req->message->text && !req->message->n_attachments)) {
        rpc_call_fail(c, CF_INVALID, "message needs text or at least one attachment");
        return;
    }
    Cflue__V1__AdmitRequest ar = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitRequest__MetadataEntry **md = NULL;
    ar.agent = req->agent;
    ar.conversation_id = req->conversation_id;
    ar.message = req->message;
    ar.idempotency_key = req->idempotency_key;
    ar.source = req->source;
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
    ProtobufCMessage *resp = NULL;
    enum cf_status rc =
        store_call(g_agentd.store, "Admit", &ar.base, &cflue__v1__admit_response__descriptor,
                   STORE_TIMEOUT_MS, &resp, &err);
    for (size_t i = 0; i < req->n_metadata; i++) {
        free(md[i]);
    }
    free(md);
    if (rc != CF_OK) {
        fail_err(c, &err);
        return;
    }
    Cflue__V1__AdmitResponse *r = (Cflue__V1__AdmitResponse *)resp;
    Cflue__V1__Admission out = CFLUE__V1__ADMISSION__INIT;
    out.submission_id = r->submission->submission_id;
    out.conversation_id = r->submission->conversation_id;
    out.offset = r->offset;
    out.deduplicated = r->deduplicated;
    log_info("submit", "submission=%s conversation=%s agent=%s dedup=%d", out.submission_id,
             out.conversation_id, req->agent, (int)out.deduplicated);
    rpc_call_reply(c, &out.base);
    protobuf_c_message_free_unpacked(resp, NULL);
    agentd_wake();
}

static void on_watch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__WatchRequest *req = (const void *)msg;
    struct cf_error err;
    if (!*req->conversation_id) {
        rpc_call_fail(c, CF_INVALID, "conversation_id is required");
        return;
    }
    if (!req->follow) {
        int64_t after = req->from_offset;
        for (;;) {
            Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
            ProtobufCMessage *resp = NULL;
            rq.conversation_id = req->conversation_id;
            rq.after_offset = after;
            rq.limit = 1000;
            if (store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                           STORE_TIMEOUT_MS, &resp, &err) != CF_OK) {
                fail_err(c, &err);
                return;
            }
            Cflue__V1__ReadResponse *page = (Cflue__V1__ReadResponse *)resp;
            bool alive = true;
            for (size_t i = 0; i < page->n_records && alive; i++) {
                alive = rpc_call_send(c, &page->records[i]->base);
            }
            bool done = page->up_to_date || !alive;
            after = page->next_offset;
            protobuf_c_message_free_unpacked(resp, NULL);
            if (!alive) {
                rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the watcher went away");
                return;
            }
            if (done) {
                rpc_call_finish(c, GRPC_STATUS_OK, NULL);
                return;
            }
        }
    }
    Cflue__V1__FollowRequest fr = CFLUE__V1__FOLLOW_REQUEST__INIT;
    fr.conversation_id = req->conversation_id;
    fr.after_offset = req->from_offset;
    struct rpc_stream *s = rpc_stream_open(g_agentd.store, "/cflue.v1.Store/Follow", &fr.base, 0);
    ProtobufCMessage *m;
    bool alive = true;
    struct stream_guard guard;
    struct cf_error gerr;
    bool guarded = guard_start(&guard, s, call_over, c, &gerr) == CF_OK;
    while (guarded && alive && rpc_stream_read(s, &cflue__v1__record__descriptor, &m) == 1) {
        alive = rpc_call_send(c, m);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    guard_end(&guard);
    alive = alive && !rpc_call_cancelled(c);
    if (!alive) {
        rpc_stream_cancel(s);
    }
    struct rpc_status st;
    rpc_stream_finish(s, &st);
    if (!guarded) {
        rpc_call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, gerr.msg);
    } else if (!alive) {
        rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the watcher went away");
    } else {
        rpc_call_finish(c, st.code, st.details);
    }
}

/* wait_settled blocks until the submission is settled, following its conversation's stream
 * from the current head (so no history is replayed), or until the caller goes away; returns
 * the settled submission (caller frees) or NULL with err set. */
static Cflue__V1__Submission *wait_settled(struct rpc_call *c, const char *submission_id,
                                           struct cf_error *err)
{
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    gr.submission_id = (char *)submission_id;
    for (int round = 0;; round++) {
        ProtobufCMessage *resp = NULL, *conv = NULL;
        if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                       STORE_TIMEOUT_MS, &resp, err) != CF_OK) {
            return NULL;
        }
        Cflue__V1__Submission *s = (Cflue__V1__Submission *)resp;
        if (s->status == CFLUE__V1__SUBMISSION_STATUS__SETTLED) {
            return s;
        }
        Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
        cr.conversation_id = s->conversation_id;
        if (store_call(g_agentd.store, "GetConversation", &cr.base,
                       &cflue__v1__conversation__descriptor, STORE_TIMEOUT_MS, &conv,
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
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    gr.submission_id = req->submission_id;
    if (!*req->submission_id) {
        rpc_call_fail(c, CF_INVALID, "submission_id is required");
        return;
    }
    if (req->wait) {
        Cflue__V1__Submission *settled = wait_settled(c, req->submission_id, &err);
        resp = settled ? &settled->base : NULL;
    } else if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                          STORE_TIMEOUT_MS, &resp, &err) != CF_OK) {
        resp = NULL;
    }
    if (!resp) {
        fail_err(c, &err);
        return;
    }
    rpc_call_reply(c, resp);
    protobuf_c_message_free_unpacked(resp, NULL);
}

static void on_abort(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__AbortRequest *req = (const void *)msg;
    struct cf_error err;
    Cflue__V1__RequestAbortRequest ar = CFLUE__V1__REQUEST_ABORT_REQUEST__INIT;
    ar.conversation_id = req->conversation_id;
    ar.submission_id = req->submission_id;
    ar.reason = "aborted on request";
    ProtobufCMessage *resp = NULL;
    if (store_call(g_agentd.store, "RequestAbort", &ar.base,
                   &cflue__v1__request_abort_response__descriptor, STORE_TIMEOUT_MS, &resp,
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
    log_info("abort", "affected=%zu", r->n_affected);
    rpc_call_reply(c, &out.base);
    protobuf_c_message_free_unpacked(resp, NULL);
    agentd_wake();
}

static void on_list_agents(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    Cflue__V1__ListAgentsResponse out = CFLUE__V1__LIST_AGENTS_RESPONSE__INIT;
    size_t n = g_agentd.agents.n;
    Cflue__V1__AgentInfo *infos = mem_alloc(sizeof(*infos) * (n + 1));
    Cflue__V1__AgentInfo **ptrs = mem_alloc(sizeof(void *) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        const struct agent_def *a = &g_agentd.agents.items[i];
        cflue__v1__agent_info__init(&infos[i]);
        infos[i].name = a->name;
        infos[i].description = a->description ? a->description : "";
        infos[i].model = a->model;
        infos[i].subagents = a->subagents;
        infos[i].n_subagents = a->n_subagents;
        infos[i].skills = a->skills;
        infos[i].n_skills = a->n_skills;
        ptrs[i] = &infos[i];
    }
    out.agents = ptrs;
    out.n_agents = n;
    rpc_call_reply(c, &out.base);
    free(infos);
    free(ptrs);
}

static void on_get_conversation(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__GetConversationRequest *req = (const void *)msg;
    struct cf_error err;
    Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
    cr.conversation_id = req->conversation_id;
    ProtobufCMessage *conv = NULL, *list = NULL, *page = NULL;
    if (store_call(g_agentd.store, "GetConversation", &cr.base,
                   &cflue__v1__conversation__descriptor, STORE_TIMEOUT_MS, &conv, &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    lr.conversation_id = req->conversation_id;
    lr.limit = 1000;
    if (store_call(g_agentd.store, "List", &lr.base, &cflue__v1__list_response__descriptor,
                   STORE_TIMEOUT_MS, &list, &err) != CF_OK) {
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
    out.submissions = ls->submissions;
    out.n_submissions = ls->n_submissions;
    if (req->include_records) {
        Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
        rq.conversation_id = req->conversation_id;
        rq.after_offset = -1;
        rq.limit = 1000;
        if (store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                       STORE_TIMEOUT_MS, &page, &err) != CF_OK) {
            protobuf_c_message_free_unpacked(conv, NULL);
            protobuf_c_message_free_unpacked(list, NULL);
            fail_err(c, &err);
            return;
        }
        /* one page: storaged bounds it by bytes; Watch delivers the rest */
        const Cflue__V1__ReadResponse *p = (const Cflue__V1__ReadResponse *)page;
        out.records = p->records;
        out.n_records = p->n_records;
        out.records_truncated = !p->up_to_date;
    }
    rpc_call_reply(c, &out.base);
    protobuf_c_message_free_unpacked(conv, NULL);
    protobuf_c_message_free_unpacked(list, NULL);
    if (page) {
        protobuf_c_message_free_unpacked(page, NULL);
    }
}

static void on_compact(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__CompactRequest *req = (const void *)msg;
    struct cf_error err;
    ProtobufCMessage *conv = NULL, *resp = NULL;
    Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
    cr.conversation_id = req->conversation_id;
    if (!*req->conversation_id) {
        rpc_call_fail(c, CF_INVALID, "conversation_id is required");
        return;
    }
    if (store_call(g_agentd.store, "GetConversation", &cr.base,
                   &cflue__v1__conversation__descriptor, STORE_TIMEOUT_MS, &conv, &err) != CF_OK) {
        fail_err(c, &err);
        return;
    }
    /* compaction runs as a submission of its own: durable, in order with the conversation's
     * other work, fenced like any turn */
    Cflue__V1__AdmitRequest ar = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__Message m = CFLUE__V1__MESSAGE__INIT;
    Cflue__V1__AdmitRequest__MetadataEntry kind = CFLUE__V1__ADMIT_REQUEST__METADATA_ENTRY__INIT;
    Cflue__V1__AdmitRequest__MetadataEntry *md[1] = {&kind};
    kind.key = "cflue.kind";
    kind.value = "compact";
    m.text = "(compact the conversation)";
    ar.agent = ((Cflue__V1__Conversation *)conv)->agent;
    ar.conversation_id = req->conversation_id;
    ar.message = &m;
    ar.metadata = md;
    ar.n_metadata = 1;
    enum cf_status rc =
        store_call(g_agentd.store, "Admit", &ar.base, &cflue__v1__admit_response__descriptor,
                   STORE_TIMEOUT_MS, &resp, &err);
    protobuf_c_message_free_unpacked(conv, NULL);
    if (rc != CF_OK) {
        fail_err(c, &err);
        return;
    }
    char sid[128];
    snprintf(sid, sizeof(sid), "%s", ((Cflue__V1__AdmitResponse *)resp)->submission->submission_id);
    protobuf_c_message_free_unpacked(resp, NULL);
    agentd_wake();
    Cflue__V1__Submission *done = wait_settled(c, sid, &err);
    if (!done) {
        fail_err(c, &err);
        return;
    }
    Cflue__V1__CompactResponse out = CFLUE__V1__COMPACT_RESPONSE__INIT;
    out.record_offset = -1;
    /* the compaction record this submission wrote, if there was anything to compact */
    Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
    rq.conversation_id = req->conversation_id;
    rq.after_offset = -1;
    rq.limit = 1000;
    for (;;) {
        ProtobufCMessage *page = NULL;
        if (store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                       STORE_TIMEOUT_MS, &page, &err) != CF_OK) {
            break;
        }
        Cflue__V1__ReadResponse *p = (Cflue__V1__ReadResponse *)page;
        for (size_t i = 0; i < p->n_records; i++) {
            if (!strcmp(p->records[i]->type, "compaction") &&
                !strcmp(p->records[i]->submission_id, sid)) {
                json_t *b = json_loads(p->records[i]->body_json, 0, NULL);
                out.tokens_before = json_integer_value(json_object_get(b, "tokens_before"));
                out.tokens_after = json_integer_value(json_object_get(b, "tokens_after"));
                out.record_offset = p->records[i]->offset;
                json_decref(b);
            }
        }
        bool more = !p->up_to_date;
        rq.after_offset = p->next_offset;
        protobuf_c_message_free_unpacked(page, NULL);
        if (!more) {
            break;
        }
    }
    bool failed = done->outcome != CFLUE__V1__OUTCOME__COMPLETED;
    char why[600];
    snprintf(why, sizeof(why), "the compaction did not complete: %s", done->error);
    protobuf_c_message_free_unpacked(&done->base, NULL);
    if (failed) {
        rpc_call_fail(c, CF_UNAVAILABLE, "%s", why);
        return;
    }
    if (out.record_offset < 0) {
        rpc_call_fail(c, CF_STALE,
                      "nothing to compact: the conversation is no longer than the recent part "
                      "that compaction keeps verbatim");
        return;
    }
    rpc_call_reply(c, &out.base);
}

void api_register(struct rpc_server *srv)
{
    rpc_server_add_method(srv, "/cflue.v1.Agent/Submit", &cflue__v1__submit_request__descriptor,
                          on_submit, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Agent/Watch", &cflue__v1__watch_request__descriptor,
                          on_watch, NULL, RPC_THREAD);
    rpc_server_add_method(srv, "/cflue.v1.Agent/GetSubmission",
                          &cflue__v1__get_submission_request__descriptor, on_get, NULL, RPC_THREAD);
    rpc_server_add_method(srv, "/cflue.v1.Agent/Abort", &cflue__v1__abort_request__descriptor,
                          on_abort, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Agent/Compact", &cflue__v1__compact_request__descriptor,
                          on_compact, NULL, RPC_THREAD);
    rpc_server_add_method(srv, "/cflue.v1.Agent/ListAgents",
                          &cflue__v1__list_agents_request__descriptor, on_list_agents, NULL,
                          RPC_INLINE);
    rpc_server_add_method(srv, "/cflue.v1.Agent/GetConversation",
                          &cflue__v1__get_conversation_request__descriptor, on_get_conversation,
                          NULL, RPC_POOL);
}
