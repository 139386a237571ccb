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
#include "placement.h"
#include "utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LIST_TIMEOUT_MS 5000  /* a drive's Tools.List of one server */
#define CHECK_TIMEOUT_MS 3000 /* start-up's, per server */
#define REASON_MAX 300        /* characters of a server's failure told to the model */

/* What a drive offers of its servers' tools (docs/tool-servers.md). Every description and
 * schema goes out with each model call, and a provider refuses a whole request with more than
 * 128 tools (OpenAI's bound): past these a server's tool is left out, or its description cut. */
#define TOOLS_OFFERED_MAX 128         /* tools in a model call, the framework's included */
#define SERVER_DESCRIPTION_MAX 8192   /* bytes of a server tool's description */
#define SERVER_SCHEMA_MAX (64 * 1024) /* bytes of a server tool's parameter schema */

void servers_init(struct drive *d)
{
    memset(&d->servers, 0, sizeof(d->servers));
}

void servers_cleanup(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    for (size_t k = 0; k < s->n; k++) {
        struct tool_source *t = &s->at[k];
        if (!t->mcp) {
            dcall_cleanup(&t->list);
        }
        if (t->answer) {
            protobuf_c_message_free_unpacked(t->answer, NULL);
        }
        mcp_op_free(t->op);
        free(t->down);
    }
    for (size_t i = 0; i < s->n_owned; i++) {
        free(s->owned[i]);
    }
    free(s->owned);
    free(s->at);
    memset(s, 0, sizeof(*s));
}

/* list_start starts the listing of one Tools server. */
static void list_start(struct drive *d, struct tool_source *t)
{
    dcall_init(&t->list, d);
    struct rpc_channel *ch = tools_channel_at(t->source);
    if (!ch) {
        t->down = mem_asprintf("this agentd reaches at most %d tool servers", TOOLS_CHANNELS_MAX);
        return;
    }
    Cflue__V1__ListToolsRequest rq = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    rq.sandbox = d->workspace;
    dcall_start(&t->list, ch, "/cflue.v1.Tools/List", &rq.base,
                &cflue__v1__list_tools_response__descriptor, LIST_TIMEOUT_MS);
}

void servers_list_start(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    const struct agent_def *a = d->agent;
    if (s->n || !(a->n_tool_servers + a->n_mcp)) {
        return;
    }
    s->at = mem_alloc(sizeof(*s->at) * (a->n_tool_servers + a->n_mcp));
    memset(s->at, 0, sizeof(*s->at) * (a->n_tool_servers + a->n_mcp));
    for (size_t k = 0; k < a->n_tool_servers + a->n_mcp; k++) {
        struct tool_source *t = &s->at[s->n++];
        if (k < a->n_tool_servers) {
            t->source = a->tool_servers[k];
            list_start(d, t);
        } else {
            t->mcp = &a->mcp[k - a->n_tool_servers];
            t->source = t->mcp->source;
            t->op = mcp_list_start(t->mcp, LIST_TIMEOUT_MS, dcall_post, d);
        }
    }
}

/* list_take takes the end of t's listing: false while it is in flight. */
static bool list_take(struct drive *d, struct tool_source *t)
{
    struct rpc_status st;
    ProtobufCMessage *resp;
    if (t->mcp) {
        if (!mcp_op_done(t->op)) {
            return false;
        }
        const char *why = mcp_op_failure(t->op);
        t->down = why ? mem_strdup(why) : NULL;
    } else if (!t->list.in_flight) {
        /* never started: down says why */
    } else if (!dcall_take(&t->list, &st, &resp)) {
        return false;
    } else if (st.code == GRPC_STATUS_OK) {
        t->answer = resp;
    } else {
        t->down = mem_asprintf("%.*s (grpc status %d)", REASON_MAX,
                               st.details[0] ? st.details : "no answer", (int)st.code);
    }
    if (t->down) {
        char q[400];
        log_warn("tool_server_unlisted", "submission=%s server=%s why=%s", d->sub->submission_id,
                 t->source, log_quote(q, sizeof(q), t->down));
    }
    return true;
}

bool servers_list_take(struct drive *d)
{
    bool over = true;
    for (size_t k = 0; k < d->servers.n; k++) {
        struct tool_source *t = &d->servers.at[k];
        if (!t->listed) {
            t->listed = list_take(d, t);
            over = over && t->listed;
        }
    }
    return over;
}

const struct agent_mcp *servers_mcp(const struct drive *d, const char *source)
{
    for (size_t k = 0; k < d->agent->n_mcp; k++) {
        if (!strcmp(d->agent->mcp[k].source, source)) {
            return &d->agent->mcp[k];
        }
    }
    return NULL;
}

/* describe names where a tool comes from, for a clash's message. */
static const char *describe(char *out, size_t n, const char *source, const char *sandbox_addr)
{
    if (!source) {
        snprintf(out, n, "the framework");
    } else if (sandbox_addr && !strcmp(source, sandbox_addr)) {
        snprintf(out, n, "the sandbox's toold at %s", source);
    } else if (!strncmp(source, "mcp:", 4)) {
        snprintf(out, n, "the MCP server \"%s\"", source + 4);
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

/* server_name names a source in what the model reads. */
static const char *server_name(char *out, size_t n, const struct tool_source *t)
{
    if (t->mcp) {
        snprintf(out, n, "The MCP server \"%s\"", t->mcp->name);
    } else {
        snprintf(out, n, "The tool server at %s", t->source);
    }
    return out;
}

/* record_signal records a `resources` signal with text b, id signal:<sub>:e<epoch>:<what>. */
static void record_signal(struct drive *d, const char *what, struct buf *b)
{
    char id[256];
    snprintf(id, sizeof(id), "signal:%s:e%lld:%s", d->sub->submission_id, (long long)d->fence.epoch,
             what);
    struct buf clean;
    Cflue__V1__Signal sig = CFLUE__V1__SIGNAL__INIT;
    sig.kind = "resources";
    sig.resource = "tool";
    sig.text = (char *)dstore_utf8(buf_cstr(b), &clean); /* reasons cut at a byte count */
    (void)dstore_defer_one(d, id, d->sub->submission_id, &sig.base);
    buf_cleanup(&clean);
}

/* tell_unlisted records the signal naming the servers that could not be listed. */
static void tell_unlisted(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    struct buf b;
    char name[160];
    size_t n_down = 0, last = 0;
    for (size_t k = 0; k < s->n; k++) {
        if (s->at[k].down) {
            n_down++;
            last = k;
        }
    }
    if (!n_down) {
        return;
    }
    buf_init(&b, 16384);
    if (n_down == 1) {
        buf_printf(&b, "%s cannot be reached for this message: %.*s. Its tools are not available.",
                   server_name(name, sizeof(name), &s->at[last]), REASON_MAX, s->at[last].down);
    } else {
        buf_append_str(&b, "These servers cannot be reached for this message, so their tools are "
                           "not available:");
        for (size_t k = 0; k < s->n; k++) {
            if (s->at[k].down) {
                buf_printf(&b, "\n- %s: %.*s", server_name(name, sizeof(name), &s->at[k]),
                           REASON_MAX, s->at[k].down);
            }
        }
    }
    char what[32];
    snprintf(what, sizeof(what), "t%d:servers", d->turn);
    record_signal(d, what, &b);
    buf_cleanup(&b);
}

/* own keeps p (a string made for the drive's tool set) until the drive ends; returns it. */
static char *own(struct tool_servers *s, char *p)
{
    s->owned = mem_realloc(s->owned, sizeof(char *) * (s->n_owned + 1));
    s->owned[s->n_owned++] = p;
    return p;
}

/* offered_description: desc as the model is offered it: its first SERVER_DESCRIPTION_MAX bytes,
 * cut between characters with a note, as valid UTF-8 (storaged takes the system prompt, which
 * quotes it, as UTF-8 only: bytes that are not are replaced rather than stored to be refused
 * each attempt). */
static const char *offered_description(struct tool_servers *s, const char *desc)
{
    size_t len = strlen(desc), keep = utf8_prefix_len(desc, len, SERVER_DESCRIPTION_MAX);
    if (keep == len && utf8_valid(desc, len, NULL)) {
        return desc;
    }
    struct buf clean;
    buf_init(&clean, 3 * keep + 128); /* each byte replaced by at most 3, and the note */
    (void)utf8_sanitize(&clean, desc, keep);
    if (keep < len) {
        (void)buf_printf(&clean, " [the rest of this description, %zu bytes in all, is cut]", len);
    }
    return own(s, buf_take(&clean));
}

/* offer adds a server's tool to d's tool set unless its schema is too long or the set is full
 * (logged: a tool the model never sees is not missed by it, but whoever runs the agent should
 * know). */
static void offer(struct drive *d, const struct tool_source *t, const char *name, const char *desc,
                  const char *schema_json)
{
    const char *why = NULL;
    if (strlen(schema_json) > SERVER_SCHEMA_MAX) {
        why = "\"its parameter schema is over 65536 bytes\"";
    } else if (d->tools.n >= TOOLS_OFFERED_MAX) {
        why = "\"a model call offers at most 128 tools\"";
    }
    if (why) {
        log_warn("tool_skipped", "submission=%s server=%s tool=%s why=%s", d->sub->submission_id,
                 t->source, name, why);
        return;
    }
    toolset_add(&d->tools, name, offered_description(&d->servers, desc), schema_json, t->source);
}

/* tool_name_ok: a name every provider takes for a tool ([A-Za-z0-9_-]{1,64}). */
static bool tool_name_ok(const char *n)
{
    size_t len = strlen(n);
    return len && len <= 64 &&
           strspn(n, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") == len;
}

/* add_mcp_tools appends t's listed tools as mcp__<server>__<tool>. */
static bool add_mcp_tools(struct drive *d, struct tool_source *t)
{
    size_t i;
    json_t *tool;
    json_array_foreach(mcp_op_tools(t->op), i, tool)
    {
        const char *raw = json_string_value(json_object_get(tool, "name"));
        char *name = mem_asprintf("mcp__%s__%s", t->mcp->name, raw ? raw : "");
        if (!raw || !tool_name_ok(name)) {
            char q[200];
            log_warn("tool_skipped", "submission=%s server=%s tool=%s why=%s",
                     d->sub->submission_id, t->source, log_quote(q, sizeof(q), raw ? raw : ""),
                     "\"its name as mcp__<server>__<tool> is not 1 to 64 of A-Z a-z 0-9 _ -\"");
            free(name);
            continue;
        }
        int twin = toolset_find(&d->tools, name);
        if (twin >= 0 && d->tools.source[twin] && !strcmp(d->tools.source[twin], t->source)) {
            log_warn("tool_skipped", "submission=%s server=%s tool=%s why=%s",
                     d->sub->submission_id, t->source, name, "\"listed twice\"");
            free(name);
            continue; /* the server's own repeat: its first listing stands */
        }
        if (servers_clash(&d->tools, name, t->source, d->tools_addr, d->error, sizeof(d->error))) {
            free(name);
            return false;
        }
        const char *desc = json_string_value(json_object_get(tool, "description"));
        json_t *schema = json_object_get(tool, "inputSchema");
        char *schema_json = json_is_object(schema) ? json_dumps(schema, JSON_COMPACT) : NULL;
        offer(d, t, own(&d->servers, name),
              desc && *desc ? desc
                            : own(&d->servers, mem_asprintf("The %s tool of the MCP server %s.",
                                                            raw, t->mcp->name)),
              own(&d->servers, schema_json
                                   ? schema_json
                                   : mem_strdup("{\"type\":\"object\",\"properties\":{}}")));
    }
    return true;
}

bool servers_tools_add(struct drive *d)
{
    struct tool_servers *s = &d->servers;
    for (size_t k = 0; k < s->n; k++) {
        struct tool_source *t = &s->at[k];
        if (t->down) {
            continue;
        }
        if (t->mcp) {
            if (!add_mcp_tools(d, t)) {
                return false;
            }
            continue;
        }
        const Cflue__V1__ListToolsResponse *list = (const void *)t->answer;
        for (size_t i = 0; list && i < list->n_tools; i++) {
            const Cflue__V1__ToolSpec *spec = list->tools[i];
            if (!tool_name_ok(spec->name)) {
                /* a provider refuses the whole request over one such name */
                char q[200];
                log_warn("tool_skipped", "submission=%s server=%s tool=%s why=%s",
                         d->sub->submission_id, t->source, log_quote(q, sizeof(q), spec->name),
                         "\"its name is not 1 to 64 of A-Z a-z 0-9 _ -\"");
                continue;
            }
            if (servers_clash(&d->tools, spec->name, t->source, d->tools_addr, d->error,
                              sizeof(d->error))) {
                return false;
            }
            offer(d, t, spec->name, spec->description, spec->parameters_json);
        }
    }
    tell_unlisted(d);
    return true;
}

void servers_tell_gone(struct drive *d, const char *source, const char *why)
{
    struct tool_servers *s = &d->servers;
    size_t k = 0;
    while (k < s->n && strcmp(s->at[k].source, source)) {
        k++;
    }
    if (k == s->n || s->at[k].told) {
        return;
    }
    s->at[k].told = true;
    struct buf b;
    char name[160], what[64];
    buf_init(&b, 16384);
    buf_printf(&b, "%s stopped answering (%.*s). Calls to its tools fail until it is back:",
               server_name(name, sizeof(name), &s->at[k]), REASON_MAX, why);
    for (size_t i = 0; i < d->tools.n; i++) {
        if (d->tools.source[i] && !strcmp(d->tools.source[i], source)) {
            buf_printf(&b, " %s", d->tools.tools[i].name);
        }
    }
    buf_append_str(&b, ".");
    snprintf(what, sizeof(what), "t%d:gone:%zu", d->turn, k);
    record_signal(d, what, &b);
    char q[400];
    log_warn("tool_server_gone", "submission=%s server=%s why=%s", d->sub->submission_id, source,
             log_quote(q, sizeof(q), why));
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
    /* the replica of the sandbox's toold that holds ws (placement.h) */
    const char *sandbox = a->sandbox_tools ? placement_pick(a->sandbox_tools, ws, NULL) : NULL;
    for (size_t k = 0; k <= a->n_tool_servers && rc == CF_OK; k++) {
        /* the sandbox's toold first, then the agent's own servers */
        const char *addr = k ? a->tool_servers[k - 1] : sandbox;
        const Cflue__V1__ListToolsResponse *l = addr ? listing(seen, n, addr, ws) : NULL;
        for (size_t i = 0; l && i < l->n_tools && rc == CF_OK; i++) {
            if (k && !tool_name_ok(l->tools[i]->name)) {
                continue; /* left out of every tool set (servers_tools_add) */
            }
            if (servers_clash(&ts, l->tools[i]->name, addr, sandbox, why, sizeof(why))) {
                rc = cf_error_set(err, CF_INVALID, "agent %s: %s", a->name, why);
            } else {
                toolset_add(&ts, l->tools[i]->name, "", "{}", addr);
            }
        }
    }
    for (size_t i = 0; i < ts.n; i++) {
        free(ts.tools[i].schema_text);
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
