/* context_fit.c - how much of the model's context a request takes, and making it fit.
 *
 * No I/O, like context.c. One scale for everything: characters / 4, and CONTEXT_IMAGE_TOKENS
 * for an image whatever its bytes (a provider scales images down; their base64 is not read as
 * text). compaction.c uses it three ways:
 *
 * - the threshold: a request whose estimate and output budget leave less than the reserve
 *   free compacts first (context_tokens);
 * - the cut: a compaction keeps the newest keep_recent_tokens verbatim, but never more than a
 *   request has room for (context_choose_cut). One turn can be larger than that: a big tool
 *   result comes right after the assistant message that asked for it, and no cut may fall
 *   between them. The cut then moves later, down to the newest turn, so the next compaction
 *   still has something older to summarize and the conversation never stops at "nothing to
 *   compact" while it is over the window;
 * - the request: when what is sent is still too large (the newest turn alone, or the part a
 *   summary is asked for), its largest texts are cut in the request only, a head and a tail
 *   kept with a note between them (context_fit). The records keep every byte.
 */
#include "context.h"

#include "buf.h"
#include "image.h"
#include "mem.h"
#include "utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the characters one message adds for its framing (role, block types) */
#define MESSAGE_FRAMING 16
/* the longest note a cut text gets (its byte count included) */
#define NOTE_MAX 160

#define FIT_NOTE                                                                                   \
    "\n\n[... %zu bytes left out here so that the request fits the model's context ...]\n\n"

static size_t message_chars(const struct llm_message *m)
{
    size_t chars = strlen(m->text ? m->text : "") + MESSAGE_FRAMING;
    for (size_t k = 0; k < m->n_calls; k++) {
        chars += strlen(m->calls[k].arguments_json) + strlen(m->calls[k].name);
    }
    return chars;
}

/* fixed_chars is what the system prompt and the tools take, whatever the messages. */
static size_t fixed_chars(const char *system, const struct llm_tool *tools, size_t n_tools)
{
    size_t chars = strlen(system ? system : "");
    for (size_t i = 0; i < n_tools; i++) {
        chars += strlen(tools[i].description) + strlen(tools[i].schema_json);
    }
    return chars;
}

static int64_t tokens_of(size_t chars, size_t images)
{
    return (int64_t)(chars / 4) + (int64_t)images * CONTEXT_IMAGE_TOKENS;
}

int64_t context_tokens(const char *system, const struct context *c, const struct llm_tool *tools,
                       size_t n_tools)
{
    size_t chars = fixed_chars(system, tools, n_tools), images = 0;
    for (size_t i = 0; c && i < c->n; i++) {
        chars += message_chars(&c->msgs[i]);
        images += c->msgs[i].n_images;
    }
    return tokens_of(chars, images);
}

/* attachment_cost adds what the context shows of attachment a: an image block, a text file's
 * first 64 KiB inline, or a short note (counted with the message's own size). */
static void attachment_cost(const Cflue__V1__AttachmentRef *a, size_t *chars, size_t *images)
{
    const char *mt = a->mime_type ? a->mime_type : "";
    size_t size = a->size_bytes > 0 ? (size_t)a->size_bytes : 0;
    if (image_type(mt) && size && size <= IMAGE_BYTES_MAX) {
        (*images)++;
    } else if (!strncmp(mt, "text/", 5) || !strcmp(mt, "application/json")) {
        *chars += size < CONTEXT_ATTACHMENT_TEXT_MAX ? size : CONTEXT_ATTACHMENT_TEXT_MAX;
    }
}

int64_t context_record_tokens(const Cflue__V1__Record *r)
{
    size_t chars = 0, images = 0;
    switch (r->body_case) {
    case CFLUE__V1__RECORD__BODY_USER_MESSAGE:
        chars = protobuf_c_message_get_packed_size(&r->user_message->base);
        for (size_t i = 0; r->user_message->attachments && i < r->user_message->n_attachments;
             i++) {
            attachment_cost(r->user_message->attachments[i], &chars, &images);
        }
        break;
    case CFLUE__V1__RECORD__BODY_TOOL_RESULT:
        chars = protobuf_c_message_get_packed_size(&r->tool_result->base);
        for (size_t i = 0; r->tool_result->images && i < r->tool_result->n_images; i++) {
            size_t len = r->tool_result->images[i]->data.len;
            chars -= len < chars ? len : chars; /* an image counts as one, not by its bytes */
            images++;
        }
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE:
        chars = protobuf_c_message_get_packed_size(&r->assistant_message->base);
        break;
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        chars = protobuf_c_message_get_packed_size(&r->signal->base);
        break;
    default:
        break; /* prompts, compactions, deltas, settlements: not messages of the context */
    }
    return tokens_of(chars, images);
}

static bool is_message_start(const Cflue__V1__Record *r)
{
    return r->body_case == CFLUE__V1__RECORD__BODY_USER_MESSAGE ||
           r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE;
}

int64_t context_choose_cut(const Cflue__V1__Record *const *records, size_t n,
                           const struct context_cut_rule *rule, int64_t *tail)
{
    /* indexes of message starts: the oldest in force, the newest, the one keep asks for (with
     * the tokens from it on), and the oldest whose kept part fits the budget */
    ptrdiff_t oldest = -1, newest = -1, usual = -1, fits = -1;
    int64_t acc = 0, usual_tail = 0;
    for (size_t i = n; i-- > 0 && records[i]->offset >= rule->first;) {
        acc += context_record_tokens(records[i]);
        if (!is_message_start(records[i])) {
            continue;
        }
        oldest = (ptrdiff_t)i;
        newest = newest < 0 ? (ptrdiff_t)i : newest;
        fits = acc <= rule->budget ? (ptrdiff_t)i : fits;
        if (usual < 0 && acc >= rule->keep) {
            usual = (ptrdiff_t)i;
            usual_tail = acc;
        }
    }
    ptrdiff_t cut = usual;
    bool too_big = (usual >= 0 ? usual_tail : acc) > rule->budget;
    if (too_big || (rule->forced && (usual < 0 || usual == oldest))) {
        cut = fits > oldest ? fits : newest; /* keep less: down to the newest turn */
    }
    if (cut < 0 || cut <= oldest) {
        *tail = acc;
        return -1; /* nothing older than the kept part */
    }
    *tail = 0;
    for (size_t i = (size_t)cut; i < n; i++) {
        *tail += context_record_tokens(records[i]);
    }
    return records[cut]->offset;
}

/* A request being fitted: its context and the size of it so far. */
struct fitting {
    struct context *c;
    size_t chars, images;
    int64_t budget;
};

static int64_t excess(const struct fitting *f)
{
    return tokens_of(f->chars, f->images) - f->budget;
}

/* drop_images puts a note in place of message m's images. */
static void drop_images(struct context *c, struct llm_message *m, const char *why)
{
    m->text = context_keep(c, mem_asprintf("%s\n\n[%zu image%s left out here %s.]",
                                           m->text ? m->text : "", m->n_images,
                                           m->n_images == 1 ? "" : "s", why));
    m->n_images = 0;
}

/* Which texts a pass of context_fit may cut. */
enum fit_tier {
    FIT_TOOL_RESULTS, /* tool results */
    FIT_OLDER_TEXTS,  /* user and assistant texts before the newest user message */
    FIT_ANY_TEXT,     /* any text, the newest user message's too */
};

static bool in_tier(const struct context *c, size_t i, size_t newest_user, enum fit_tier t)
{
    enum llm_role role = c->msgs[i].role;
    switch (t) {
    case FIT_TOOL_RESULTS:
        return role == LLM_TOOL_RESULT;
    case FIT_OLDER_TEXTS:
        return role != LLM_TOOL_RESULT && i < newest_user;
    default:
        return true;
    }
}

/* cut_text cuts message m's text by what the request is over (no shorter than
 * CONTEXT_FIT_KEEP_MIN): its head and tail kept, a note between them. */
static void cut_text(struct fitting *f, struct llm_message *m)
{
    size_t len = strlen(m->text);
    size_t remove = (size_t)excess(f) * 4 + NOTE_MAX;
    size_t keep = len > remove ? len - remove : 0;
    keep = keep < CONTEXT_FIT_KEEP_MIN ? CONTEXT_FIT_KEEP_MIN : keep;
    size_t head = utf8_prefix_len(m->text, len, keep / 2);
    size_t tail_at = utf8_suffix_start(m->text, len, keep - head);
    char *cut =
        mem_asprintf("%.*s" FIT_NOTE "%s", (int)head, m->text, tail_at - head, m->text + tail_at);
    f->chars = f->chars - len + strlen(cut);
    m->text = context_keep(f->c, cut);
}

/* largest_text is the index of the longest text of tier t that a cut would shorten (c->n:
 * none). */
static size_t largest_text(const struct context *c, size_t newest_user, enum fit_tier t)
{
    size_t best = c->n, best_len = CONTEXT_FIT_KEEP_MIN + NOTE_MAX;
    for (size_t i = 0; i < c->n; i++) {
        size_t len = c->msgs[i].text ? strlen(c->msgs[i].text) : 0;
        if (len > best_len && in_tier(c, i, newest_user, t)) {
            best = i;
            best_len = len;
        }
    }
    return best;
}

/* fit_texts cuts texts of tier t, the largest first, until the request fits or none is left. */
static size_t fit_texts(struct fitting *f, size_t newest_user, enum fit_tier t)
{
    size_t done = 0;
    while (excess(f) > 0) {
        size_t i = largest_text(f->c, newest_user, t);
        if (i == f->c->n) {
            break;
        }
        cut_text(f, &f->c->msgs[i]);
        done++;
    }
    return done;
}

/* fit_images leaves out images, the oldest first, until the request fits. */
static size_t fit_images(struct fitting *f)
{
    size_t done = 0;
    for (size_t i = 0; i < f->c->n && excess(f) > 0; i++) {
        struct llm_message *m = &f->c->msgs[i];
        if (m->n_images) {
            size_t before = strlen(m->text ? m->text : "");
            done += m->n_images;
            f->images -= m->n_images;
            drop_images(f->c, m, "so that the request fits the model's context");
            f->chars += strlen(m->text) - before;
        }
    }
    return done;
}

size_t context_fit(struct context *c, const char *system, const struct llm_tool *tools,
                   size_t n_tools, int64_t budget)
{
    struct fitting f = {.c = c, .chars = fixed_chars(system, tools, n_tools), .budget = budget};
    size_t newest_user = 0;
    for (size_t i = 0; i < c->n; i++) {
        f.chars += message_chars(&c->msgs[i]);
        f.images += c->msgs[i].n_images;
        newest_user = c->msgs[i].role == LLM_USER ? i : newest_user;
    }
    size_t done = fit_texts(&f, newest_user, FIT_TOOL_RESULTS);
    done += fit_texts(&f, newest_user, FIT_OLDER_TEXTS);
    done += fit_images(&f);
    done += fit_texts(&f, newest_user, FIT_ANY_TEXT);
    return done;
}

/* transcript_part appends the first CONTEXT_TRANSCRIPT_RESULT_MAX bytes of text (a call's
 * arguments or result: `what`) to b, saying how many more it had. */
static void transcript_part(struct buf *b, const char *text, const char *what)
{
    size_t len = strlen(text), keep = utf8_prefix_len(text, len, CONTEXT_TRANSCRIPT_RESULT_MAX);
    (void)buf_printf(b, "%.*s", (int)keep, text);
    if (keep < len) {
        (void)buf_printf(b, " [%zu more bytes of this %s are not shown]", len - keep, what);
    }
}

/* transcript_entry appends message m to the transcript b. */
static void transcript_entry(struct buf *b, const struct llm_message *m)
{
    const char *text = m->text ? m->text : "";
    switch (m->role) {
    case LLM_USER:
        (void)buf_printf(b, "User: %s", text);
        break;
    case LLM_ASSISTANT:
        if (*text || !m->n_calls) {
            (void)buf_printf(b, "Assistant: %s", *text ? text : "(no text)");
        }
        for (size_t k = 0; k < m->n_calls; k++) {
            (void)buf_printf(b, "%sAssistant called %s with ", *text || k ? "\n" : "",
                             m->calls[k].name);
            transcript_part(b, m->calls[k].arguments_json, "arguments");
        }
        break;
    case LLM_TOOL_RESULT:
        (void)buf_printf(b, "Result of %s%s: ", m->tool_name ? m->tool_name : "a tool call",
                         m->is_error ? " (an error)" : "");
        transcript_part(b, text, "result");
        break;
    }
    if (m->n_images) {
        (void)buf_printf(b, " [%zu image%s]", m->n_images, m->n_images == 1 ? "" : "s");
    }
    (void)buf_append_str(b, "\n\n");
}

void context_transcript(struct context *c, const char *ask)
{
    struct buf b;
    buf_init(&b, SIZE_MAX);
    (void)buf_append_str(&b, "The conversation to summarize:\n\n<conversation>\n");
    for (size_t i = 0; i < c->n; i++) {
        transcript_entry(&b, &c->msgs[i]);
    }
    (void)buf_printf(&b, "</conversation>\n\n%s", ask);
    const char *text = context_keep(c, buf_take(&b));
    for (size_t i = 0; i < c->n; i++) { /* the messages' own arrays, as context_free does */
        free((void *)c->msgs[i].calls);
        free((void *)c->msgs[i].images);
    }
    c->n = 0;
    struct llm_message *m = context_push(c);
    m->role = LLM_USER;
    m->text = text;
}
