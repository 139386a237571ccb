/* json_write.c - JSON text written straight into a buffer (see json_write.h). */
#include "json_write.h"

#include "utf8.h"

#include <stdlib.h>
#include <string.h>

static void put(struct jw *w, const void *p, size_t n)
{
    if (!w->failed && n && buf_append(&w->out, p, n) != CF_OK) {
        w->failed = true;
    }
}

/* before_value writes the comma that separates a value from the one before it in its
 * container (none after a key, none before a container's first member). */
static void before_value(struct jw *w)
{
    if (w->after_key) {
        w->after_key = false;
        return;
    }
    if (w->depth > 0) {
        uint64_t bit = 1ull << (w->depth - 1);
        if (w->has_member & bit) {
            put(w, ",", 1);
        }
        w->has_member |= bit;
    }
}

/* escape writes the escape sequence of ASCII character c. */
static void escape(struct jw *w, unsigned char c)
{
    static const char hex[] = "0123456789abcdef";
    char seq[6] = {'\\', (char)c};
    size_t n = 2;
    switch (c) {
    case '"':
    case '\\':
        break;
    case '\n':
        seq[1] = 'n';
        break;
    case '\r':
        seq[1] = 'r';
        break;
    case '\t':
        seq[1] = 't';
        break;
    case '\b':
        seq[1] = 'b';
        break;
    case '\f':
        seq[1] = 'f';
        break;
    default:
        seq[1] = 'u', seq[2] = '0', seq[3] = '0', seq[4] = hex[c >> 4], seq[5] = hex[c & 15];
        n = 6;
    }
    put(w, seq, n);
}

/* write_string writes s[0..n) quoted: runs that need nothing are copied whole. */
static void write_string(struct jw *w, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;
    put(w, "\"", 1);
    while (i < n) {
        unsigned char c = u[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            i++;
            continue;
        }
        size_t len = c >= 0x80 ? utf8_seq_len(s + i, n - i) : 0;
        if (len) {
            i += len;
            continue;
        }
        put(w, s + run, i - run);
        if (c >= 0x80) {
            put(w, "\xef\xbf\xbd", 3); /* not well-formed UTF-8: U+FFFD */
        } else {
            escape(w, c);
        }
        run = ++i;
    }
    put(w, s + run, n - run);
    put(w, "\"", 1);
}

void jw_init(struct jw *w, size_t max)
{
    *w = (struct jw){0};
    buf_init(&w->out, max);
}

static void open_container(struct jw *w, char c)
{
    before_value(w);
    if (w->depth == JW_DEPTH_MAX) {
        w->failed = true;
        return;
    }
    put(w, &c, 1);
    uint64_t bit = 1ull << w->depth++;
    w->has_member &= ~bit;
    w->in_array = c == '[' ? w->in_array | bit : w->in_array & ~bit;
}

void jw_object(struct jw *w)
{
    open_container(w, '{');
}

void jw_array(struct jw *w)
{
    open_container(w, '[');
}

void jw_end(struct jw *w)
{
    if (w->depth == 0 || w->after_key) {
        w->failed = true;
        return;
    }
    w->depth--;
    put(w, w->in_array & (1ull << w->depth) ? "]" : "}", 1);
}

void jw_key(struct jw *w, const char *name)
{
    before_value(w);
    write_string(w, name, strlen(name));
    put(w, ":", 1);
    w->after_key = true;
}

void jw_string(struct jw *w, const char *s)
{
    jw_stringn(w, s ? s : "", s ? strlen(s) : 0);
}

void jw_stringn(struct jw *w, const char *s, size_t n)
{
    before_value(w);
    write_string(w, s, n);
}

void jw_key_string(struct jw *w, const char *name, const char *s)
{
    jw_key(w, name);
    jw_string(w, s);
}

void jw_int(struct jw *w, long long v)
{
    before_value(w);
    if (!w->failed && buf_printf(&w->out, "%lld", v) != CF_OK) {
        w->failed = true;
    }
}

void jw_bool(struct jw *w, bool v)
{
    before_value(w);
    put(w, v ? "true" : "false", v ? 4 : 5);
}

void jw_null(struct jw *w)
{
    before_value(w);
    put(w, "null", 4);
}

void jw_raw(struct jw *w, const char *text)
{
    before_value(w);
    put(w, text, strlen(text));
}

void jw_json(struct jw *w, const json_t *v)
{
    before_value(w);
    char *text = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    if (!text) {
        w->failed = true;
        return;
    }
    put(w, text, strlen(text));
    free(text);
}

char *jw_take(struct jw *w, size_t *len_out)
{
    char *text = NULL;
    if (!w->failed && w->depth == 0 && !w->after_key && w->out.len) {
        if (len_out) {
            *len_out = w->out.len;
        }
        text = buf_take(&w->out);
    }
    jw_cleanup(w);
    return text;
}

void jw_cleanup(struct jw *w)
{
    buf_cleanup(&w->out);
    *w = (struct jw){0};
}
