/* context.h - the model's context from a conversation's typed records (no I/O). */
#ifndef CFLUE_AGENTD_CONTEXT_H
#define CFLUE_AGENTD_CONTEXT_H

#include "provider.h"
#include "status.h"

#include "cflue/v1/common.pb-c.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The result a tool call gets when an attempt ended before its outcome was recorded. */
#define CONTEXT_INTERRUPTED_RESULT                                                                 \
    "This tool call was interrupted before its result was recorded; whether it took effect is "    \
    "unknown."

/* The most of an attached text file the context shows inline. */
#define CONTEXT_ATTACHMENT_TEXT_MAX (64 * 1024)

/* Provider-neutral messages for one request. Texts point into the records they came from
 * (which must outlive the context) or into strings the context keeps. */
struct context {
    struct llm_message *msgs;
    size_t n, cap;
    char **strings; /* strings built here, freed with the context */
    size_t n_strings;
};

/* context_attachments_fn gives the message (with its attachments' bytes) of submission
 * `submission_id` in *out, owned by the caller of context_build and valid until the context is
 * freed. A failure's status and err are passed on by context_build. */
typedef enum cf_status (*context_attachments_fn)(void *arg, const char *submission_id,
                                                 const Cflue__V1__Message **out,
                                                 struct cf_error *err);

/* What a context is built from. */
struct context_source {
    const Cflue__V1__Record *const *records; /* in offset order; offset -1 (not stored yet)
                                              * last, the newest */
    size_t n_records;
    int64_t before; /* only records before this offset count (INT64_MAX: all, those not
                     * stored yet included) */
    context_attachments_fn attachments;
    void *arg;
};

/* context_build appends to c (zeroed, or built before) the messages of src: the newest
 * compaction's summary as a <context_summary> user message standing in for what precedes its
 * first kept offset; then each user_message (with its attachments: images as image blocks,
 * text files inline up to 64 KiB, a note for anything else), signal (<signal type="kind">)
 * and assistant_message, each assistant message followed by its calls' results in call order
 * (a call without a recorded result gets CONTEXT_INTERRUPTED_RESULT as an error). Other
 * records (prompts, deltas, settlements) are not part of it. On failure (only an attachments
 * lookup can fail) it returns that status with err set; c then holds a partial context that
 * context_free releases. */
CF_MUST_CHECK enum cf_status context_build(struct context *c, const struct context_source *src,
                                           struct cf_error *err);

/* context_push appends a zeroed message to c and returns it (valid until the next push). */
struct llm_message *context_push(struct context *c);

/* context_keep makes c own the heap string s (freed with c) and returns it. */
const char *context_keep(struct context *c, char *s);

/* context_free releases what c holds and zeroes it; idempotent. */
void context_free(struct context *c);

/* context_tool_result_id writes the deterministic record id of the result of call `call_id`
 * of turn `turn` of submission `submission_id`: tool:<sub>:<turn>:<call>. */
void context_tool_result_id(char *out, size_t out_len, const char *submission_id, int turn,
                            const char *call_id);

/* ---- context_fit.c: the size of a request, and making it fit ---- */

/* The tokens one image counts for in an estimate, whatever its size: Anthropic scales an image
 * down until it costs at most about 1,600 tokens. */
#define CONTEXT_IMAGE_TOKENS 1600

/* Texts context_fit never cuts below (bytes, head and tail together), and the part of a text
 * kept when one is cut: its head and tail, with a note between them. */
#define CONTEXT_FIT_KEEP_MIN 1024

/* context_tokens estimates what the request of system, c and the tools costs of the model's
 * context: characters / 4 (texts, call arguments, tool descriptions and schemas, 16 characters
 * of framing per message) plus CONTEXT_IMAGE_TOKENS per image. c may be NULL (system and tools
 * only). Pure. */
int64_t context_tokens(const char *system, const struct context *c, const struct llm_tool *tools,
                       size_t n_tools);

/* context_record_tokens estimates what record r adds to the model's context, on the same scale
 * as context_tokens: user messages (attached images at CONTEXT_IMAGE_TOKENS, text files up to
 * the 64 KiB the context shows), assistant messages, tool results (images at
 * CONTEXT_IMAGE_TOKENS, not by their bytes) and signals; 0 for every other record (prompts,
 * compactions, deltas, settlements: the context does not hold them as messages). Pure. */
int64_t context_record_tokens(const Cflue__V1__Record *r);

/* What context_choose_cut chooses by. */
struct context_cut_rule {
    int64_t first;  /* the offset of the first record in force (the newest compaction's first
                     * kept offset; -1: none) */
    int64_t keep;   /* the tokens to keep verbatim (keep_recent_tokens) */
    int64_t budget; /* the most the kept part may take: what a request has room for, less the
                     * system prompt and the tools */
    bool forced;    /* the provider refused the request as too long (or too large) */
};

/* context_choose_cut returns the offset of the first record a compaction keeps, or -1 when
 * there is nothing older than the kept part to summarize; *tail is the kept part's tokens
 * (context_record_tokens; with -1, those of every record from rule->first on). records are a
 * conversation's in offset order (none pending). A cut falls only before a user or assistant
 * message: a tool result is always shown right after its assistant message, so no call loses its
 * result. The cut is the first such boundary before the newest rule->keep tokens; when the part
 * that leaves kept is larger than rule->budget (or rule->forced and that cut leaves nothing older),
 * it moves later: to the oldest boundary whose kept part fits the budget, else the newest boundary
 * (its turn alone does not fit; context_fit shrinks what is sent). Pure. */
int64_t context_choose_cut(const Cflue__V1__Record *const *records, size_t n,
                           const struct context_cut_rule *rule, int64_t *tail);

/* context_fit shrinks the request of system, c and the tools until context_tokens is at most
 * budget, in c only (the records stay as they are): it cuts the largest text, keeping its head
 * and tail and a note saying how many bytes were left out, first among tool results, then
 * among the user and assistant texts before the newest user message, then it leaves out
 * images (oldest first, a note in their place), then any text; no text is cut below
 * CONTEXT_FIT_KEEP_MIN. Returns the number of texts cut and images left out (0: it fitted
 * already); when even that does not fit, it returns with what it could do. Strings it makes
 * are c's (context_keep). */
size_t context_fit(struct context *c, const char *system, const struct llm_tool *tools,
                   size_t n_tools, int64_t budget);

/* A tool call's arguments or result shown in a transcript at most (bytes; the rest is said,
 * not shown). */
#define CONTEXT_TRANSCRIPT_RESULT_MAX 2000

/* context_transcript replaces c's messages with one user message: a transcript of them as
 * text (who said what, the calls made and their results, the first
 * CONTEXT_TRANSCRIPT_RESULT_MAX bytes of each call's arguments and result, images as notes) between
 * <conversation> tags, then `ask`. What a summary is written from: a model shown the messages
 * themselves may go on with the conversation, and a provider refuses tool calls in a request that
 * offers no tools. */
void context_transcript(struct context *c, const char *ask);

#endif
