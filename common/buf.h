/* buf.h - growable byte buffers bounded by a named cap.
 *
 * Every buffer that carries model or tool text is a struct buf with a maximum size. A write
 * that would exceed it fails with CF_TOOBIG and leaves the buffer unchanged, so truncation is
 * a property of the type rather than of each caller's care. The content is always
 * NUL-terminated (the terminator is not counted in len).
 */
#ifndef CFLUE_BUF_H
#define CFLUE_BUF_H

#include "status.h"

#include <stddef.h>

struct buf {
    char *data; /* NULL until the first write */
    size_t len;
    size_t cap;
    size_t max; /* the cap on len */
};

/* buf_init prepares an empty buffer that may hold at most max bytes. */
void buf_init(struct buf *b, size_t max);

/* buf_cleanup releases the memory; the buffer may be reused after buf_init. */
void buf_cleanup(struct buf *b);

/* buf_reset empties the buffer and keeps its memory. */
void buf_reset(struct buf *b);

/* buf_append adds n bytes; CF_TOOBIG (buffer unchanged) if len would pass max. */
enum cf_status buf_append(struct buf *b, const void *p, size_t n);

/* buf_append_str adds a NUL-terminated string. */
enum cf_status buf_append_str(struct buf *b, const char *s);

/* buf_printf appends printf-formatted text; CF_TOOBIG (buffer unchanged) past max. */
enum cf_status buf_printf(struct buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* buf_cstr returns the content as a C string ("" when empty); valid until the next write. */
const char *buf_cstr(const struct buf *b);

/* buf_take hands the heap content to the caller (free() it) and empties the buffer. Returns an
 * allocated "" when empty. */
char *buf_take(struct buf *b);

#endif
