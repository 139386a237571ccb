/* tool_servers.c - an agent's own tool servers: the cflue.v1.Tools addresses its definition
 * lists under `tools:` (agents.h), beside the sandbox's toold.
 *
 * Every drive asks each server for its tools (Tools.List, alongside the sandbox's Glance; the
 * calls hold no thread) and joins them to the tool set after the framework's, in the order the
 * definition lists the servers. A name the framework reserves, or one a tool listed before
 * already has, fails the submission with a message naming both sources: the model must never
 * see two tools by one name. A server that cannot be listed leaves its tools out of that
 * drive, and a `resources` signal before the first turn tells the model so; one that fails
 * while a call runs gives the call an error result (tool_batch.c) and, once per drive, a
 * signal that it is gone. Nothing a tool server does fails the submission on its own.
 *
 * At start-up (tool_servers_check) the servers that answer are listed once and checked the
 * same way, so a clash is a start-up error rather than the first submission's failure.
 */
#include "agentd.h"
#include "buf.h"
#include "drive.h"
#include "log.h"
#include "mem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LIST_TIMEOUT_MS 5000  /* a drive's Tools.List of one server */
#define CHECK_TIMEOUT_MS 3000 /* start-up's, per server */
#define REASON_MAX 300        /* characters of a server's failure told to the model */

void servers_init(struct drive *d)
{
    memset(&d->servers, 0, sizeof(d->servers));
}

void servers_cleanup(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    for (size_t k = 0; k < s->n; k++) {
        dcall_cleanup(&s->list[k]);
        if (s->answers[k]) {
            protobuf_c_message_free_unpacked(s->answers[k], NULL);
        }
        free(s->down[k]);
    }
    free(s->list);
    free(s->answers);
    free(s->down);
    free(s->told);
    memset(s, 0, sizeof(*s));
}

void servers_list_start(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    size_t n = d->agent->n_tool_servers;
    if (!n || s->n) {
        return;
    }
    s->n = n;
    s->list = mem_alloc(sizeof(*s->list) * n);
    s->answers = mem_alloc(sizeof(*s->answers) * n);
    s->down = mem_alloc(sizeof(*s->down) * n);
    s->told = mem_alloc(sizeof(*s->told) * n);
    for (size_t k = 0; k < n; k++) {
        const char *addr = d->agent->tool_servers[k];
        dcall_init(&s->list[k], d);
        s->answers[k] = NULL;
        s->down[k] = NULL;
        s->told[k] = false;
        struct rpc_channel *ch = tools_channel_at(addr);
        if (!ch) {
            s->down[k] =
                mem_asprintf("this agentd reaches at most %d tool servers", TOOLS_CHANNELS_MAX);
            continue;
        }
        Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
        rq.sandbox = d->workspace;
        dcall_start(&s->list[k], ch, "/cflue.v1.Tools/List", &rq.base,
                    &cflue__v1__list_tools_response__descriptor, LIST_TIMEOUT_MS);
    }
}

bool servers_list_take(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    bool over = true;
    for (size_t k = 0; k < s->n; k++) {
        struct rpc_status st;
        ProtobufCMessage *resp;
        if (!s->list[k].in_flight) {
            continue;
        }
        if (!dcall_take(&s->list[k], &st, &resp)) {
            over = false;
        } else if (st.code == GRPC_STATUS_OK) {
            s->answers[k] = resp;
        } else {
            s->down[k] = mem_asprintf("%.*s (grpc status %d)", REASON_MAX,
                                      st.details[0] ? st.details : "no answer", (int)st.code);
            char q[400];
            log_warn("tool_server_unlisted", "submission=%s server=%s why=%s",
                     d->sub->submission_id, d->agent->tool_servers[k],
                     log_quote(q, sizeof(q), s->down[k]));
        }
    }
    return over;
}

/* describe names where a tool comes from, for a clash's message. */
static const char *describe(char *out, size_t n, const char *source, const char *sandbox_addr)
{
    if (!source) {
        snprintf(out, n, "the framework");
    } else if (sandbox_addr && !strcmp(source, sandbox_addr)) {
        snprintf(out, n, "the sandbox's toold at %s", source);
    } else {
        snprintf(out, n, "the tool server at %s", source);
    }
    return out;
}

bool servers_clash(const struct toolset *ts, const char *name, const char *source,
                   const char *sandbox_addr, char *why, size_t n)
{
    char a[320], b[320];
    if (source && task_name_reserved(name)) {
        snprintf(why, n,
                 "tool name \"%s\" is reserved by the framework, but %s offers a tool by that "
                 "name; rename that tool",
                 name, describe(a, sizeof(a), source, sandbox_addr));
        return true;
    }
    int k = toolset_find(ts, name);
    if (k >= 0) {
        snprintf(why, n, "duplicate tool name \"%s\": offered by %s and by %s; rename one of them",
                 name, describe(a, sizeof(a), ts->source[k], sandbox_addr),
                 describe(b, sizeof(b), source, sandbox_addr));
        return true;
    }
    return false;
}

/* tell_unlisted records the signal naming the servers that could not be listed. */
static void tell_unlisted(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    struct buf b;
    buf_init(&b, 16384);
    size_t n_down = 0, last = 0;
    for (size_t k = 0; k < s->n; k++) {
        if (s->down[k]) {
            n_down++;
            last = k;
        }
    }
    if (!n_down) {
        return;
    }
    if (n_down == 1) {
        buf_printf(&b,
                   "The tool server at %s cannot be reached for this message: %s. Its tools are "
                   "not available.",
                   d->agent->tool_servers[last], s->down[last]);
    } else {
        buf_append_str(&b, "These tool servers cannot be reached for this message, so their "
                           "tools are not available:");
        for (size_t k = 0; k < s->n; k++) {
            if (s->down[k]) {
                buf_printf(&b, "\n- %s: %s", d->agent->tool_servers[k], s->down[k]);
            }
        }
    }
    char id[256];
    snprintf(id, sizeof(id), "signal:%s:e%lld:servers", d->sub->submission_id,
             (long long)d->fence.epoch);
    Cflue__V1__Signal sig = CFLUE__V1__SIGNAL__INIT;
    sig.kind = "resources";
    sig.text = (char *)buf_cstr(&b);
    (void)dstore_defer_one(d, id, d->sub->submission_id, &sig.base);
    buf_cleanup(&b);
}

bool servers_tools_add(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    for (size_t k = 0; k < s->n; k++) {
        const Cflue__V1__ListToolsResponse *list = (const void *)s->answers[k];
        const char *addr = d->agent->tool_servers[k];
        for (size_t i = 0; list && i < list->n_tools; i++) {
            const Cflue__V1__ToolSpec *t = list->tools[i];
            if (servers_clash(&d->tools, t->name, addr, d->tools_addr, d->error,
                              sizeof(d->error))) {
                return false;
            }
            toolset_add(&d->tools, t->name, t->description, t->parameters_json, addr);
        }
    }
    tell_unlisted(d);
    return true;
}

void servers_tell_gone(struct drive *d, const char *addr, const struct rpc_status *st)
{
    struct tool_servers *s = &d->servers;
    size_t k = 0;
    while (k < s->n && strcmp(d->agent->tool_servers[k], addr)) {
        k++;
    }
    if (k == s->n || s->told[k]) {
        return;
    }
    s->told[k] = true;
    struct buf b;
    buf_init(&b, 16384);
    buf_printf(
        &b,
        "The tool server at %s stopped answering (%.*s). Calls to its tools fail until it is back:",
        addr, REASON_MAX, st->details[0] ? st->details : "no answer");
    for (size_t i = 0; i < d->tools.n; i++) {
        if (d->tools.source[i] && !strcmp(d->tools.source[i], addr)) {
            buf_printf(&b, " %s", d->tools.tools[i].name);
        }
    }
    buf_append_str(&b, ".");
    char id[256];
    snprintf(id, sizeof(id), "signal:%s:e%lld:t%d:gone:%zu", d->sub->submission_id,
             (long long)d->fence.epoch, d->turn, k);
    Cflue__V1__Signal sig = CFLUE__V1__SIGNAL__INIT;
    sig.kind = "resources";
    sig.text = (char *)buf_cstr(&b);
    (void)dstore_defer_one(d, id, d->sub->submission_id, &sig.base);
    char q[400];
    log_warn("tool_server_gone", "submission=%s server=%s why=%s", d->sub->submission_id, addr,
             log_quote(q, sizeof(q), st->details));
    buf_cleanup(&b);
}

/* ---------- start-up ---------- */

/* A server's tools as listed once at start-up. */
struct listed {
    const char *addr;
    Cflue__V1__ListToolsResponse *resp; /* NULL: it did not answer */
};

/* listing returns addr's tools, listed once (NULL when it did not answer: warned about). */
static const Cflue__V1__ListToolsResponse *listing(struct listed **seen, size_t *n,
                                                   const char *addr, const char *sandbox)
{
    for (size_t i = 0; i < *n; i++) {
        if (!strcmp((*seen)[i].addr, addr)) {
            return (*seen)[i].resp;
        }
    }
    *seen = mem_realloc(*seen, sizeof(**seen) * (*n + 1));
    struct listed *l = &(*seen)[(*n)++];
    l->addr = addr;
    l->resp = NULL;
    struct rpc_channel *ch = tools_channel_at(addr);
    Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    struct rpc_status st;
    ProtobufCMessage *resp = NULL;
    rq.sandbox = (char *)sandbox;
    if (ch &&
        rpc_unary(ch, "/cflue.v1.Tools/List", &rq.base, &cflue__v1__list_tools_response__descriptor,
                  CHECK_TIMEOUT_MS, &resp, &st)) {
        l->resp = (Cflue__V1__ListToolsResponse *)resp;
    } else {
        char q[400];
        log_warn("tool_server_unchecked",
                 "server=%s why=%s note=\"not answering at start: its tools are checked when "
                 "a submission lists them\"",
                 addr, log_quote(q, sizeof(q), ch ? st.details : "too many tool servers"));
    }
    return l->resp;
}

/* check_agent checks one agent's tool set as far as its servers answer. */
static enum cf_status check_agent(const struct agent_def *a, struct listed **seen, size_t *n,
                                  struct cf_error *err)
{
    struct toolset ts = {0};
    enum cf_status rc = CF_OK;
    char why[1024];
    const char *ws = a->sandbox_workspace && strcmp(a->sandbox_workspace, "{conversation}")
                         ? a->sandbox_workspace
                         : a->name;
    for (size_t k = 0; k <= a->n_tool_servers && rc == CF_OK; k++) {
        /* the sandbox's toold first, then the agent's own servers */
        const char *addr = k ? a->tool_servers[k - 1] : a->sandbox_tools;
        const Cflue__V1__ListToolsResponse *l = addr ? listing(seen, n, addr, ws) : NULL;
        for (size_t i = 0; l && i < l->n_tools && rc == CF_OK; i++) {
            if (servers_clash(&ts, l->tools[i]->name, addr, a->sandbox_tools, why, sizeof(why))) {
                rc = cf_error_set(err, CF_INVALID, "agent %s: %s", a->name, why);
            } else {
                toolset_add(&ts, l->tools[i]->name, "", "{}", addr);
            }
        }
    }
    for (size_t i = 0; i < ts.n; i++) {
        json_decref(ts.tools[i].schema);
    }
    free(ts.tools);
    free(ts.source);
    return rc;
}

enum cf_status tool_servers_check(const struct agent_set *agents, struct cf_error *err)
{
    struct listed *seen = NULL;
    size_t n = 0;
    enum cf_status rc = CF_OK;
    for (size_t i = 0; i < agents->n && rc == CF_OK; i++) {
        if (agents->items[i].n_tool_servers) {
            rc = check_agent(&agents->items[i], &seen, &n, err);
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (seen[i].resp) {
            protobuf_c_message_free_unpacked(&seen[i].resp->base, NULL);
        }
    }
    free(seen);
    return rc;
}
