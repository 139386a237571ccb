/* sse.h - an incremental text/event-stream parser with bounded buffers. */
#ifndef CFLUE_AGENTD_SSE_H
#define CFLUE_AGENTD_SSE_H

#include "buf.h"

#include <stdbool.h>
#include <stddef.h>

struct sse {
    struct buf line;
    struct buf event;
    struct buf data;
    /* on_event gets the event name ("" when none) and the joined data lines; returning false
     * stops parsing (sse_feed then returns false) */
    bool (*on_event)(void *ctx, const char *event, const char *data);
    void *ctx;
    bool too_big;
    bool has_data; /* the event being read has a data line (it may be empty) */
    bool after_cr; /* the last piece ended with a CR: a LF beginning the next one is its pair */
};

/* sse_init prepares a parser whose lines and events are at most max bytes. */
void sse_init(struct sse *s, size_t max, bool (*on_event)(void *, const char *, const char *),
              void *ctx);

/* sse_feed consumes bytes; returns false when the callback stopped or a line exceeded max. */
bool sse_feed(struct sse *s, const char *p, size_t n);

/* sse_cleanup frees the buffers. */
void sse_cleanup(struct sse *s);

#endif
