/* prompt.c - the conversation's system prompt: composed once and frozen.
 *
 * The prompt is the agent's instructions, the project notes (AGENTS.md, else CLAUDE.md, from
 * the sandbox's working directory), its skills (declared, then found in the sandbox), the
 * subagents it may delegate to, the tool roster, today's date, the working directory and its
 * top-level listing. A drive's first step asks toold for the tool set, the skills in
 * .agents/skills, the notes and the listing in one Sandbox.Glance that holds no engine thread
 * (prompt_start, prompt_take; only the tool set and the skills when the conversation holds a
 * prompt still in force: every attempt finds the skills afresh for activate_skill). A toold without
 * Glance is read with the older blocking calls (Tools.List, ReadFile and ReadDir). A compaction
 * composes a new prompt from a Glance of the sandbox the same way (prompt_recompose_start, _take).
 * It is recorded as `system_prompt` (id system:<n>) and read back from the stream afterwards, so
 * every turn and every later attempt sees the same text; it is composed again only after a
 * compaction (system:<compactions + 1>). A prompt is frozen only when every part of it was read:
 * toold failing leaves a fault, never a partial prompt.
 */
#include "drive.h"
#include "mem.h"
#include "utf8.h"

#include "cflue/v1/sandbox.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SANDBOX_TIMEOUT_MS 10000 /* the Sandbox reads of the system prompt */
#define TOOL_LINE_MAX 300        /* bytes of a tool's description quoted in the prompt */
#define NOTES_MAX 65536
#define LISTING_MAX 200
#define SKILLS_DIR ".agents/skills" /* where skills are found in the sandbox */
#define SKILLS_MAX 64

static const char *const NOTES[] = {"AGENTS.md", "CLAUDE.md"};

/* What the prompt shows of the sandbox: the project notes and the top-level listing. */
struct sandbox_view {
    ProtobufCMessage *glance;  /* a GlanceResponse, or NULL (the older calls answered) */
    ProtobufCMessage *notes;   /* a ReadFileResponse (older calls), or NULL */
    ProtobufCMessage *listing; /* a ReadDirResponse (older calls), or NULL */
    const char *notes_name;    /* NULL: no notes */
    const uint8_t *notes_data;
    size_t notes_len;
    Cflue__V1__FileInfo **entries;
    size_t n_entries;
    bool more_entries;
    bool entries_unreadable; /* the working directory could not be listed */
};

/* view_by_calls fills v with ReadFile and ReadDir, for a toold without Glance; false (with a
 * fault) when toold failed. */
static bool view_by_calls(struct drive *d, struct rpc_channel *ch, struct sandbox_view *v)
{
    struct rpc_status st;
    for (int i = 0; i < 2 && !v->notes; i++) {
        Cflue__V1__ReadFileRequest rq = CFLUE__V1__READ_FILE_REQUEST__INIT;
        rq.sandbox = d->workspace;
        rq.path = (char *)NOTES[i];
        if (rpc_unary(ch, "/cflue.v1.Sandbox/ReadFile", &rq.base,
                      &cflue__v1__read_file_response__descriptor, SANDBOX_TIMEOUT_MS, &v->notes,
                      &st)) {
            const Cflue__V1__ReadFileResponse *f = (const void *)v->notes;
            v->notes_name = NOTES[i];
            v->notes_data = f->data.data;
            v->notes_len = f->data.len > NOTES_MAX ? NOTES_MAX : f->data.len;
        } else if (tools_failed(d, "reading the project notes failed", &st)) {
            return false;
        }
    }
    Cflue__V1__ReadDirRequest rq = CFLUE__V1__READ_DIR_REQUEST__INIT;
    rq.sandbox = d->workspace;
    rq.path = ".";
    rq.page_size = LISTING_MAX;
    if (!rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &rq.base,
                   &cflue__v1__read_dir_response__descriptor, SANDBOX_TIMEOUT_MS, &v->listing,
                   &st)) {
        v->entries_unreadable =
            st.code == GRPC_STATUS_INVALID_ARGUMENT && !strcmp(st.reason, "PERMISSION_DENIED");
        return !tools_failed(d, "listing the working directory failed", &st);
    }
    const Cflue__V1__ReadDirResponse *r = (const void *)v->listing;
    v->entries = r->entries;
    v->n_entries = r->n_entries;
    v->more_entries = *r->next_page_token != '\0';
    return true;
}

/* glance_request asks for the tool set, and with `view` for what the prompt shows of the
 * sandbox too. */
static void glance_request(struct drive *d, Cflue__V1__GlanceRequest *rq, bool view,
                           bool list_tools)
{
    cflue__v1__glance_request__init(rq);
    rq->sandbox = d->workspace;
    rq->cwd = d->cwd;
    rq->list_tools = list_tools;
    if (list_tools) {
        rq->skills_dir = SKILLS_DIR; /* found afresh by every attempt */
        rq->max_skills = SKILLS_MAX;
    }
    if (view) {
        rq->files = (char **)NOTES;
        rq->n_files = 2;
        rq->max_file_bytes = NOTES_MAX;
        rq->max_entries = LISTING_MAX;
    }
}

/* view_of_glance points v at what Glance answered (g stays the caller's). */
static void view_of_glance(struct sandbox_view *v, const Cflue__V1__GlanceResponse *g)
{
    v->notes_name = *g->file ? g->file : NULL;
    v->notes_data = g->file_data.data;
    v->notes_len = g->file_data.len > NOTES_MAX ? NOTES_MAX : g->file_data.len;
    v->entries = g->entries;
    v->n_entries = g->n_entries;
    v->more_entries = g->more_entries;
    v->entries_unreadable = g->entries_unreadable;
}

static void view_cleanup(struct sandbox_view *v)
{
    ProtobufCMessage *msgs[] = {v->glance, v->notes, v->listing};
    for (int i = 0; i < 3; i++) {
        if (msgs[i]) {
            protobuf_c_message_free_unpacked(msgs[i], NULL);
        }
    }
}

/* add_listing appends the working directory and its top-level entries. */
static void add_listing(struct buf *b, const struct sandbox_view *v, const char *working_directory)
{
    if (working_directory && *working_directory) {
        buf_printf(b, "\nWorking directory: %s", working_directory);
    }
    buf_append_str(b, "\nTop-level entries of the working directory:");
    if (v->entries_unreadable) {
        buf_append_str(b, " not shown: reading the directory was refused (permission denied)");
    }
    size_t shown = v->n_entries < LISTING_MAX ? v->n_entries : LISTING_MAX;
    for (size_t i = 0; i < shown; i++) {
        bool dir = v->entries[i]->type == CFLUE__V1__FILE_TYPE__FILE_TYPE_DIRECTORY;
        buf_printf(b, "\n  %s%s", v->entries[i]->name, dir ? "/" : "");
    }
    if (v->n_entries > shown || v->more_entries) {
        buf_append_str(b, "\n  ... and more");
    }
}

/* add_subagents appends the roster of the subagents d's agent may delegate to with `task`. */
static void add_subagents(struct buf *b, const struct drive *d)
{
    const struct agent_def *a = d->agent;
    buf_append_str(b, "\n\n## Subagents\n\n");
    if (!a->n_subagents) {
        buf_append_str(b, "No subagents are declared for you, so the task tool has no agent to "
                          "name: do not call it unless a subagent is announced later.");
        return;
    }
    buf_append_str(b, "You can hand work to these agents with the task tool, naming one of them. "
                      "This list may change during the conversation; changes are announced.\n");
    for (size_t i = 0; i < a->n_subagents; i++) {
        const struct agent_def *sa = agents_find(&d->defs->agents, a->subagents[i]);
        const char *desc = sa && sa->description ? sa->description : "";
        buf_printf(b, "\n- %s%s%s", a->subagents[i], *desc ? ": " : "", desc);
    }
}

/* compose writes the prompt of d's agent and tool set and, for a sandboxed agent, of what v
 * shows of the sandbox (NULL: no sandbox). The caller frees it. */
static char *compose(struct drive *d, const struct sandbox_view *v)
{
    struct buf b;
    char when[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof(when), "%Y-%m-%d", &tm);
    buf_init(&b, 1 << 20);
    buf_append_str(&b, d->agent->instructions);
    if (v && v->notes_name) {
        buf_printf(&b, "\n\n## Project notes (%s)\n\n", v->notes_name);
        utf8_sanitize(&b, (const char *)v->notes_data, v->notes_len);
    }
    skill_roster(&b, d);
    add_subagents(&b, d);
    if (d->tools.n) {
        buf_append_str(&b, "\n\n## Tools you can call\n");
        for (size_t i = 0; i < d->tools.n; i++) {
            /* its first sentence: the whole description goes with each model call */
            const char *desc = d->tools.tools[i].description;
            const char *dot = strchr(desc, '.');
            size_t len = dot ? (size_t)(dot - desc + 1) : strlen(desc);
            size_t keep = utf8_prefix_len(desc, len, TOOL_LINE_MAX);
            buf_printf(&b, "\n- %s: ", d->tools.tools[i].name);
            prompt_line(&b, desc, keep);
            buf_append_str(&b, keep < len ? "..." : "");
        }
    }
    buf_printf(&b, "\n\n## Environment\n\nToday's date: %s", when);
    if (v) {
        add_listing(&b, v, d->tools.working_directory);
    }
    return buf_take(&b);
}

void prompt_recompose_start(struct drive *d)
{
    struct rpc_channel *ch = tools_channel(d);
    if (ch) {
        Cflue__V1__GlanceRequest rq;
        glance_request(d, &rq, true, false);
        dcall_start(&d->prompt_call, ch, "/cflue.v1.Sandbox/Glance", &rq.base,
                    &cflue__v1__glance_response__descriptor, SANDBOX_TIMEOUT_MS);
    }
}

bool prompt_recompose_take(struct drive *d, char **text)
{
    struct sandbox_view v = {0};
    struct rpc_status st;
    bool sandboxed = d->prompt_call.in_flight, viewed = true;
    *text = NULL;
    if (sandboxed) {
        if (!dcall_take(&d->prompt_call, &st, &v.glance)) {
            return false;
        }
        if (st.code == GRPC_STATUS_OK) {
            view_of_glance(&v, (const void *)v.glance);
        } else if (st.code == GRPC_STATUS_UNIMPLEMENTED) {
            viewed = view_by_calls(d, tools_channel(d), &v); /* a toold without Glance */
        } else {
            viewed = !tools_failed(d, "looking at the sandbox failed", &st);
        }
    }
    if (viewed && d->fault.code == CF_OK) {
        *text = compose(d, sandboxed ? &v : NULL);
    }
    view_cleanup(&v);
    return true;
}

void prompt_line(struct buf *b, const char *s, size_t n)
{
    size_t from = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i == n || (unsigned char)s[i] < 0x20 || s[i] == 0x7f) {
            (void)buf_append(b, s + from, i - from);
            if (i < n) {
                (void)buf_append(b, " ", 1);
            }
            from = i + 1;
        }
    }
}

/* in_force returns the latest recorded system prompt when no compaction came after it. */
static const char *in_force(struct drive *d)
{
    const Cflue__V1__Record *sys = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT);
    const Cflue__V1__Record *comp = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_COMPACTION);
    if (sys && (!comp || sys->offset < 0 /* pending */ || sys->offset > comp->offset)) {
        return sys->system_prompt->text;
    }
    return NULL;
}

void prompt_start(struct drive *d)
{
    d->glance_unreached = false;
    servers_list_start(d);
    struct rpc_channel *ch = tools_channel(d);
    if (!ch) {
        tools_no_channel(d);
        return;
    }
    Cflue__V1__GlanceRequest rq;
    glance_request(d, &rq, !in_force(d), true);
    dcall_start(&d->prompt_call, ch, "/cflue.v1.Sandbox/Glance", &rq.base,
                &cflue__v1__glance_response__descriptor, SANDBOX_TIMEOUT_MS);
}

/* took_glance takes what prompt_start's Glance answered: the tool set into d->tools and,
 * when the prompt is to be composed, the sandbox into v. A toold whose Glance does not list
 * the tools, or has no Glance, is asked with the older blocking calls. false (with a fault)
 * when toold failed or refused. */
static bool took_glance(struct drive *d, const struct rpc_status *st, ProtobufCMessage *resp,
                        struct sandbox_view *v)
{
    if (st->code == GRPC_STATUS_OK) {
        const Cflue__V1__GlanceResponse *g = (const void *)resp;
        view_of_glance(v, g);
        if (tools_scope_refused(d, g->cwd_applied)) {
            v->glance = resp;
            return false;
        }
        if (!skill_tools_discover(d, g->skills, g->n_skills)) {
            v->glance = resp;
            d->outcome = CFLUE__V1__OUTCOME__OUTCOME_FAILED; /* no retry mends a clash */
            return false;
        }
        if (g->n_tools) {
            tools_adopt(d, resp, g->tools, g->n_tools, g->working_directory); /* keeps resp */
        } else {
            v->glance = resp;
            tools_load(d);
        }
        return !drive_halted(d);
    }
    if (st->code == GRPC_STATUS_UNIMPLEMENTED) {
        if (tools_scope_refused(d, false)) {
            return false; /* the older calls cannot scope */
        }
        tools_load(d);
        return !drive_halted(d) && (in_force(d) || view_by_calls(d, tools_channel(d), v));
    }
    if (tools_failed(d, "looking at the sandbox failed", st)) {
        /* its replica may be away for a moment: replica_wait */
        d->glance_unreached =
            st->code == GRPC_STATUS_UNAVAILABLE || st->code == GRPC_STATUS_DEADLINE_EXCEEDED;
    } else {
        /* toold answered but refused: that is no tool set either */
        struct cf_error e;
        if (d->cwd[0] &&
            (st->code == GRPC_STATUS_NOT_FOUND || st->code == GRPC_STATUS_INVALID_ARGUMENT)) {
            /* the directory the parent named is not there: no retry mends that */
            cf_error_set(&e, CF_INVALID, "the working directory %.1024s it was given: %s", d->cwd,
                         st->details);
        } else {
            cf_error_set(&e, status_from_grpc(st->code), "toold at %s refused Sandbox.Glance: %s",
                         d->tools_addr, st->details);
        }
        drive_fault(d, "looking at the sandbox failed", &e);
    }
    return false;
}

bool prompt_take(struct drive *d)
{
    struct sandbox_view v = {0};
    bool sandboxed = d->prompt_call.in_flight;
    if (!servers_list_take(d)) {
        return false; /* the agent's own tool servers are being listed */
    }
    if (sandboxed) {
        struct rpc_status st;
        ProtobufCMessage *resp;
        if (!dcall_take(&d->prompt_call, &st, &resp)) {
            return false;
        }
        if (!took_glance(d, &st, resp, &v)) {
            view_cleanup(&v);
            d->system_text = NULL;
            return true;
        }
    }
    if (!drive_halted(d) && (!task_tools_add(d) || !servers_tools_add(d))) {
        /* a tool name reserved or offered twice: no retry mends that */
        d->outcome = CFLUE__V1__OUTCOME__OUTCOME_FAILED;
        view_cleanup(&v);
        d->system_text = NULL;
        return true;
    }
    const char *text = drive_halted(d) ? NULL : in_force(d);
    if (text || drive_halted(d)) {
        free(d->system_text); /* a drive that took up reloaded definitions had one */
        d->system_text = text ? mem_strdup(text) : NULL;
        if (text) {
            narrate_changes(d); /* the prompt stays as it was: changes are told */
        }
        view_cleanup(&v);
        return true;
    }
    char *fresh = compose(d, sandboxed ? &v : NULL);
    view_cleanup(&v);
    char id[64];
    struct narrated state;
    snprintf(id, sizeof(id), "system:%d", d->log.compactions + 1);
    narrate_state(d, &state);
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    sp.text = fresh;
    sp.state = &state.st;
    (void)dstore_defer_one(d, id, "", &sp.base); /* stored with the input, before any turn */
    narrate_cleanup(&state);
    if (d->fault.code != CF_OK) {
        free(fresh);
        fresh = NULL;
    }
    d->system_text = fresh;
    return true;
}
