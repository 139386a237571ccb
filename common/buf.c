/* buf.c - bounded growable buffers. */
#include "buf.h"

#include "mem.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void buf_init(struct buf *b, size_t max)
{
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->max = max;
}

void buf_cleanup(struct buf *b)
{
    free(b->data);
    buf_init(b, b->max);
}

void buf_reset(struct buf *b)
{
    b->len = 0;
    if (b->data) {
        b->data[0] = '\0';
    }
}

static enum cf_status reserve(struct buf *b, size_t extra)
{
    if (extra > b->max - b->len) {
        return CF_TOOBIG;
    }
    size_t need = b->len + extra + 1;
    if (need <= b->cap) {
        return CF_OK;
    }
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        cap *= 2;
    }
    b->data = mem_realloc(b->data, cap);
    b->cap = cap;
    return CF_OK;
}

enum cf_status buf_append(struct buf *b, const void *p, size_t n)
{
    enum cf_status rc = reserve(b, n);
    if (rc != CF_OK) {
        return rc;
    }
    if (n) {
        memcpy(b->data + b->len, p, n);
    }
    b->len += n;
    b->data[b->len] = '\0';
    return CF_OK;
}

enum cf_status buf_append_str(struct buf *b, const char *s)
{
    return buf_append(b, s, strlen(s));
}

enum cf_status buf_printf(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    char small[256];
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0) {
        return CF_INVALID;
    }
    if ((size_t)n < sizeof(small)) {
        return buf_append(b, small, (size_t)n);
    }
    enum cf_status rc = reserve(b, (size_t)n);
    if (rc != CF_OK) {
        return rc;
    }
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return CF_OK;
}

const char *buf_cstr(const struct buf *b)
{
    return b->data ? b->data : "";
}

char *buf_take(struct buf *b)
{
    char *out = b->data ? b->data : mem_strdup("");
    buf_init(b, b->max);
    return out;
}
