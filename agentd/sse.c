/* sse.c - text/event-stream parsing (WHATWG rules: lines end with CRLF, LF or CR alone; field
 * "event", "data" lines joined with '\n', dispatch on a blank line of an event that has a data
 * line (one without, a bare "event: ping", is dropped), ':' comments ignored, optional single
 * space after ':'). */
#include "sse.h"

#include <string.h>

void sse_init(struct sse *s, size_t max, bool (*on_event)(void *, const char *, const char *),
              void *ctx)
{
    buf_init(&s->line, max);
    buf_init(&s->event, 256);
    buf_init(&s->data, max);
    s->on_event = on_event;
    s->ctx = ctx;
    s->too_big = false;
    s->has_data = false;
    s->after_cr = false;
}

void sse_cleanup(struct sse *s)
{
    buf_cleanup(&s->line);
    buf_cleanup(&s->event);
    buf_cleanup(&s->data);
}

static bool line_done(struct sse *s)
{
    const char *l = buf_cstr(&s->line);
    size_t n = s->line.len;
    if (n == 0) {
        bool go = true;
        if (s->has_data) {
            go = s->on_event(s->ctx, buf_cstr(&s->event), buf_cstr(&s->data));
        }
        buf_reset(&s->event);
        buf_reset(&s->data);
        s->has_data = false;
        return go;
    }
    if (l[0] == ':') {
        return true;
    }
    const char *colon = memchr(l, ':', n);
    size_t flen = colon ? (size_t)(colon - l) : n;
    const char *v = colon ? colon + 1 : l + n;
    size_t vlen = colon ? n - flen - 1 : 0;
    if (vlen && *v == ' ') {
        v++;
        vlen--;
    }
    if (flen == 5 && !memcmp(l, "event", 5)) {
        buf_reset(&s->event);
        if (buf_append(&s->event, v, vlen) != CF_OK) {
            s->too_big = true;
            return false;
        }
    } else if (flen == 4 && !memcmp(l, "data", 4)) {
        if ((s->has_data && buf_append(&s->data, "\n", 1) != CF_OK) ||
            buf_append(&s->data, v, vlen) != CF_OK) {
            s->too_big = true;
            return false;
        }
        s->has_data = true;
    }
    return true;
}

/* line_end finds the first '\r' or '\n' in p[0..n), or NULL. */
static const char *line_end(const char *p, size_t n)
{
    const char *lf = memchr(p, '\n', n);
    const char *cr = memchr(p, '\r', lf ? (size_t)(lf - p) : n);
    return cr ? cr : lf;
}

bool sse_feed(struct sse *s, const char *p, size_t n)
{
    size_t i = 0;
    if (s->after_cr && n) {
        s->after_cr = false;
        if (p[0] == '\n') {
            i = 1; /* the LF of a CRLF whose CR ended the last piece */
        }
    }
    while (i < n) {
        const char *end = line_end(p + i, n - i);
        size_t k = end ? (size_t)(end - (p + i)) : n - i;
        if (buf_append(&s->line, p + i, k) != CF_OK) {
            s->too_big = true;
            return false;
        }
        if (!end) {
            break;
        }
        bool go = line_done(s);
        buf_reset(&s->line);
        if (!go) {
            return false;
        }
        i += k + 1;
        if (*end == '\r') {
            if (i == n) {
                s->after_cr = true; /* a LF may begin the next piece */
            } else if (p[i] == '\n') {
                i++;
            }
        }
    }
    return true;
}
