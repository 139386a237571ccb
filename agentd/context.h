/* context.h - the model's context from a conversation's typed records (no I/O). */
#ifndef CFLUE_AGENTD_CONTEXT_H
#define CFLUE_AGENTD_CONTEXT_H

#include "provider.h"
#include "status.h"

#include "cflue/v1/common.pb-c.h"

#include <stddef.h>
#include <stdint.h>

/* The result a tool call gets when an attempt ended before its outcome was recorded. */
#define CONTEXT_INTERRUPTED_RESULT                                                                 \
    "This tool call was interrupted before its result was recorded; whether it took effect is "    \
    "unknown."

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

#endif
