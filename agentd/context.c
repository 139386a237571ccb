/* context.c - the model's context from a conversation's typed records.
 *
 * No I/O: records in, provider-neutral messages out (struct llm_message, which provider.c
 * encodes for each wire format). Attachments' bytes stay with their submissions; the caller
 * supplies them through a lookup (the drive has most of them already: its own claim, the
 * joined deliveries it claimed; it asks storaged for the rest once).
 *
 * A compaction replaces what precedes its first kept offset with its summary. Tool results are
 * placed right after the assistant message that asked for them, in call order, whenever they
 * were recorded; a call without a result is shown as interrupted, so the model never sees a
 * call without an answer. Images (a message's attachments, a tool result's images) are
 * handed on base64-encoded, each provider placing them as its wire format allows.
 */
#include "context.h"

#include "base64.h"
#include "buf.h"
#include "image.h"
#include "mem.h"
#include "utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *context_keep(struct context *c, char *s)
{
    c->strings = mem_realloc(c->strings, sizeof(char *) * (c->n_strings + 1));
    c->strings[c->n_strings++] = s;
    return s;
}

struct llm_message *context_push(struct context *c)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 32;
        c->msgs = mem_realloc(c->msgs, sizeof(*c->msgs) * c->cap);
    }
    memset(&c->msgs[c->n], 0, sizeof(c->msgs[0]));
    return &c->msgs[c->n++];
}

void context_free(struct context *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free((void *)c->msgs[i].calls);
        free((void *)c->msgs[i].images);
    }
    for (size_t i = 0; i < c->n_strings; i++) {
        free(c->strings[i]);
    }
    free(c->strings);
    free(c->msgs);
    memset(c, 0, sizeof(*c));
}

void context_tool_result_id(char *out, size_t out_len, const char *submission_id, int turn,
                            const char *call_id)
{
    snprintf(out, out_len, "tool:%s:%d:%s", submission_id, turn, call_id);
}

/* add_image makes attachment a the next of images[] when it is an image the model may be
 * shown (image.h's types, at most IMAGE_BYTES_MAX); false when it is not. */
static bool add_image(struct context *c, struct llm_image *images, size_t *n,
                      const Cflue__V1__Attachment *a)
{
    const char *mt = image_type(a->mime_type);
    if (!mt || !a->data.len || a->data.len > IMAGE_BYTES_MAX) {
        return false;
    }
    images[*n].mime_type = mt;
    images[*n].base64 = context_keep(c, base64_encode(a->data.data, a->data.len));
    (*n)++;
    return true;
}

/* add_attachments gives the model what message msg carried: images as image blocks, text
 * files inline after the message's text (up to 64 KiB each), and a note for anything else. */
static void add_attachments(struct context *c, struct llm_message *m, const Cflue__V1__Message *msg)
{
    struct buf text;
    buf_init(&text, PROVIDER_TEXT_MAX);
    buf_append_str(&text, m->text);
    struct llm_image *images = mem_alloc(sizeof(*images) * (msg ? msg->n_attachments + 1 : 1));
    size_t n_images = 0;
    for (size_t i = 0; msg && i < msg->n_attachments; i++) {
        const Cflue__V1__Attachment *a = msg->attachments[i];
        const char *mt = a->mime_type;
        if (add_image(c, images, &n_images, a)) {
            buf_printf(&text, "\n\n[Attached image %s (%s) follows.]", a->name, mt);
        } else if (!strncmp(mt, "text/", 5) || !strcmp(mt, "application/json")) {
            size_t n = a->data.len < CONTEXT_ATTACHMENT_TEXT_MAX ? a->data.len
                                                                 : CONTEXT_ATTACHMENT_TEXT_MAX;
            buf_printf(&text, "\n\n[Attached file %s (%s, %zu bytes)%s:]\n", a->name, mt,
                       a->data.len, n < a->data.len ? ", first 64 KiB" : "");
            utf8_sanitize(&text, (const char *)a->data.data, n);
        } else {
            buf_printf(&text,
                       "\n\n[Attached file %s (%s, %zu bytes): its content cannot be shown "
                       "here.]",
                       a->name, mt, a->data.len);
        }
    }
    m->text = context_keep(c, buf_take(&text));
    m->images = images;
    m->n_images = n_images;
}

static int cmp_record_id(const void *a, const void *b)
{
    return strcmp((*(const Cflue__V1__Record *const *)a)->id,
                  (*(const Cflue__V1__Record *const *)b)->id);
}

/* result_of finds a tool_result record by id in the sorted index. */
static const Cflue__V1__Record *result_of(const Cflue__V1__Record **index, size_t n, const char *id)
{
    Cflue__V1__Record key = CFLUE__V1__RECORD__INIT;
    const Cflue__V1__Record *k = &key, **hit;
    key.id = (char *)id;
    hit = index ? bsearch(&k, index, n, sizeof(*index), cmp_record_id) : NULL;
    return hit ? *hit : NULL;
}

/* add_assistant adds assistant message r and, after it, its calls' results in call order. */
static void add_assistant(struct context *c, const Cflue__V1__Record *r,
                          const Cflue__V1__Record **results, size_t n_results)
{
    const Cflue__V1__AssistantMessage *am = r->assistant_message;
    size_t n = am->n_tool_calls;
    struct llm_call *cs = n ? mem_alloc(sizeof(*cs) * n) : NULL;
    for (size_t k = 0; k < n; k++) {
        cs[k].id = am->tool_calls[k]->id;
        cs[k].name = am->tool_calls[k]->name;
        cs[k].arguments_json = am->tool_calls[k]->arguments_json;
    }
    struct llm_message *m = context_push(c);
    m->role = LLM_ASSISTANT;
    m->text = am->text;
    m->calls = cs;
    m->n_calls = n;
    for (size_t k = 0; k < n; k++) {
        char id[512];
        context_tool_result_id(id, sizeof(id), r->submission_id, am->turn, cs[k].id);
        const Cflue__V1__Record *res = result_of(results, n_results, id);
        struct llm_message *t = context_push(c);
        t->role = LLM_TOOL_RESULT;
        t->tool_call_id = cs[k].id;
        t->tool_name = cs[k].name;
        t->text = res ? res->tool_result->text : CONTEXT_INTERRUPTED_RESULT;
        t->is_error = res ? res->tool_result->is_error : true;
        if (res && res->tool_result->n_images) {
            const Cflue__V1__ToolCallResult *tr = res->tool_result;
            struct llm_image *images = mem_alloc(sizeof(*images) * tr->n_images);
            size_t n_images = 0;
            for (size_t i = 0; i < tr->n_images; i++) {
                (void)add_image(c, images, &n_images, tr->images[i]); /* storaged checked them */
            }
            t->images = images;
            t->n_images = n_images;
        }
    }
}

/* signal_text renders a signal for the model: its body inside <signal type="KIND">, with &, <
 * and > escaped, so names and descriptions it quotes (a skill's, a tool server's) can never
 * close the envelope or open another. The kind is [a-z0-9_] (storaged checks it). */
static char *signal_text(const Cflue__V1__Signal *sig)
{
    struct buf b;
    buf_init(&b, SIZE_MAX);
    buf_printf(&b, "<signal type=\"%s\"", sig->kind);
    if (*sig->resource) {
        buf_printf(&b, " resource=\"%s\"", sig->resource); /* [a-z0-9_] (storaged checks it) */
    }
    buf_append_str(&b, ">\n");
    for (const char *p = sig->text; *p; p++) {
        const char *esc = *p == '&' ? "&amp;" : *p == '<' ? "&lt;" : *p == '>' ? "&gt;" : NULL;
        if (esc) {
            buf_append_str(&b, esc);
        } else {
            buf_append(&b, p, 1);
        }
    }
    buf_append_str(&b, "\n</signal>");
    return buf_take(&b);
}

/* add_record adds the message record r stands for, if any. */
static enum cf_status add_record(struct context *c, const struct context_source *src,
                                 const Cflue__V1__Record *r, const Cflue__V1__Record **results,
                                 size_t n_results, struct cf_error *err)
{
    if (r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE) {
        struct llm_message *m = context_push(c);
        m->role = LLM_USER;
        m->text = r->user_message->text;
        if (r->user_message->n_attachments) {
            const Cflue__V1__Message *msg = NULL;
            enum cf_status rc = src->attachments
                                    ? src->attachments(src->arg, r->submission_id, &msg, err)
                                    : cf_error_set(err, CF_INTERNAL, "no attachments lookup");
            if (rc != CF_OK) {
                return rc;
            }
            add_attachments(c, m, msg);
        }
    } else if (r->body_case == CFLUE__V1__RECORD__BODY_SIGNAL) {
        struct llm_message *m = context_push(c);
        m->role = LLM_USER;
        m->text = context_keep(c, signal_text(r->signal));
    } else if (r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE) {
        add_assistant(c, r, results, n_results);
    }
    return CF_OK;
}

/* offset_of is where r stands in the stream: a record not stored yet (offset -1) is the
 * newest, after every stored one. */
static int64_t offset_of(const Cflue__V1__Record *r)
{
    return r->offset < 0 ? INT64_MAX - 1 : r->offset;
}

enum cf_status context_build(struct context *c, const struct context_source *src,
                             struct cf_error *err)
{
    const Cflue__V1__Record *compaction = NULL, **results = NULL;
    int64_t first_kept = -1;
    size_t n_results = 0;
    /* one pass: the latest compaction, and an index of tool results by id (a conversation's
     * results are looked up once per call instead of by scanning the stream each time) */
    for (size_t i = 0; i < src->n_records; i++) {
        const Cflue__V1__Record *r = src->records[i];
        if (offset_of(r) < src->before && r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION) {
            compaction = r;
        } else if (r->body_case == CFLUE__V1__RECORD__BODY_TOOL_RESULT) {
            results = mem_realloc(results, sizeof(*results) * (n_results + 1));
            results[n_results++] = r;
        }
    }
    if (results) {
        qsort(results, n_results, sizeof(*results), cmp_record_id);
    }
    if (compaction) {
        /* the summary stands in for everything before the first kept record */
        first_kept = compaction->compaction->first_kept_offset;
        struct llm_message *m = context_push(c);
        m->role = LLM_USER;
        m->text = context_keep(c, mem_asprintf("<context_summary>\nThe earlier part of this "
                                               "conversation was compacted into this "
                                               "summary:\n\n%s\n</context_summary>",
                                               compaction->compaction->summary));
    }
    enum cf_status rc = CF_OK;
    for (size_t i = 0; i < src->n_records && rc == CF_OK; i++) {
        const Cflue__V1__Record *r = src->records[i];
        if (offset_of(r) < src->before && offset_of(r) >= first_kept) {
            rc = add_record(c, src, r, results, n_results, err);
        }
    }
    free(results);
    return rc;
}
