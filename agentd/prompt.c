/* prompt.c - the conversation's system prompt: composed once and frozen.
 *
 * The prompt is the agent's instructions, the project notes (AGENTS.md, else CLAUDE.md, from
 * the sandbox's working directory), the tool roster, today's date, the working directory and
 * its top-level listing. It is recorded as `system_prompt` (id system:<n>) and read back from
 * the stream afterwards, so every turn and every later attempt sees the same text; it is
 * composed again only after a compaction (system:<compactions + 1>). A prompt is frozen only
 * when every part of it was read: toold failing leaves a fault, never a partial prompt.
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
#define NOTES_MAX 65536
#define LISTING_MAX 200

/* add_notes appends the project notes; false (with a fault) when toold failed. */
static bool add_notes(struct drive *d, struct rpc_channel *ch, struct buf *b)
{
    const char *notes[] = {"AGENTS.md", "CLAUDE.md"};
    for (int i = 0; i < 2; i++) {
        Cflue__V1__ReadFileRequest rq = CFLUE__V1__READ_FILE_REQUEST__INIT;
        ProtobufCMessage *resp;
        struct rpc_status st;
        rq.sandbox = d->workspace;
        rq.path = (char *)notes[i];
        if (rpc_unary(ch, "/cflue.v1.Sandbox/ReadFile", &rq.base,
                      &cflue__v1__read_file_response__descriptor, SANDBOX_TIMEOUT_MS, &resp, &st)) {
            Cflue__V1__ReadFileResponse *f = (Cflue__V1__ReadFileResponse *)resp;
            buf_printf(b, "\n\n## Project notes (%s)\n\n", notes[i]);
            utf8_sanitize(b, (const char *)f->data.data,
                          f->data.len > NOTES_MAX ? NOTES_MAX : f->data.len);
            protobuf_c_message_free_unpacked(resp, NULL);
            return true;
        }
        if (tools_failed(d, "reading the project notes failed", &st)) {
            return false;
        }
    }
    return true;
}

/* add_listing appends the working directory and its top-level entries; false (with a fault)
 * when toold failed. */
static bool add_listing(struct drive *d, struct rpc_channel *ch, struct buf *b,
                        const Cflue__V1__ListToolsResponse *tools)
{
    Cflue__V1__ReadDirRequest rq = CFLUE__V1__READ_DIR_REQUEST__INIT;
    ProtobufCMessage *resp;
    struct rpc_status st;
    rq.sandbox = d->workspace;
    rq.path = ".";
    rq.page_size = LISTING_MAX;
    if (tools && *tools->working_directory) {
        buf_printf(b, "\nWorking directory: %s", tools->working_directory);
    }
    if (!rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &rq.base,
                   &cflue__v1__read_dir_response__descriptor, SANDBOX_TIMEOUT_MS, &resp, &st)) {
        return !tools_failed(d, "listing the working directory failed", &st);
    }
    Cflue__V1__ReadDirResponse *r = (Cflue__V1__ReadDirResponse *)resp;
    buf_append_str(b, "\nTop-level entries of the working directory:");
    size_t shown = r->n_entries < LISTING_MAX ? r->n_entries : LISTING_MAX;
    for (size_t i = 0; i < shown; i++) {
        bool dir = r->entries[i]->type == CFLUE__V1__FILE_TYPE__FILE_TYPE_DIRECTORY;
        buf_printf(b, "\n  %s%s", r->entries[i]->name, dir ? "/" : "");
    }
    if (r->n_entries > shown || *r->next_page_token) {
        buf_append_str(b, "\n  ... and more");
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return true;
}

char *prompt_compose(struct drive *d, const Cflue__V1__ListToolsResponse *tools)
{
    struct buf b;
    char when[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof(when), "%Y-%m-%d", &tm);
    buf_init(&b, 1 << 20);
    buf_append_str(&b, d->agent->instructions);
    struct rpc_channel *ch = tools_channel(d);
    if (ch && !add_notes(d, ch, &b)) {
        buf_cleanup(&b);
        return NULL;
    }
    if (tools && tools->n_tools) {
        buf_append_str(&b, "\n\n## Tools you can call\n");
        for (size_t i = 0; i < tools->n_tools; i++) {
            const char *desc = tools->tools[i]->description;
            const char *dot = strchr(desc, '.');
            buf_printf(&b, "\n- %s: %.*s", tools->tools[i]->name,
                       dot ? (int)(dot - desc + 1) : (int)strlen(desc), desc);
        }
    }
    buf_printf(&b, "\n\n## Environment\n\nToday's date: %s", when);
    if (ch && !add_listing(d, ch, &b, tools)) {
        buf_cleanup(&b);
        return NULL;
    }
    return buf_take(&b);
}

char *prompt_frozen(struct drive *d)
{
    const Cflue__V1__Record *sys = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT);
    const Cflue__V1__Record *comp = rlog_latest(&d->log, CFLUE__V1__RECORD__BODY_COMPACTION);
    if (sys && (!comp || sys->offset < 0 /* pending */ || sys->offset > comp->offset)) {
        return mem_strdup(sys->system_prompt->text);
    }
    char *text = prompt_compose(d, d->tools.list);
    if (!text) {
        return NULL;
    }
    char id[64];
    snprintf(id, sizeof(id), "system:%d", d->log.compactions + 1);
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    sp.text = text;
    (void)dstore_defer_one(d, id, "", &sp.base); /* stored with the input, before any turn */
    if (d->fault.code != CF_OK) {
        free(text);
        return NULL;
    }
    return text;
}
