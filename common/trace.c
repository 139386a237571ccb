/* trace.c - W3C Trace Context: traceparent and tracestate, and each thread's current trace.
 *
 * The parser follows the spec's rules for a receiver (Trace Context Level 1, "traceparent
 * Header" and "Versioning of traceparent"; Level 2's random flag is kept): a header it cannot
 * use is refused whole, and the caller then starts a trace of its own (or works without one);
 * it never fails the request that carried it. Ids are made by thread_random (a per-thread
 * generator seeded from the kernel), good enough for uniqueness; they are no secrets.
 */
#include "trace.h"

#include "thread.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static _Thread_local struct trace_ctx current;

/* ---------- ids ---------- */

static const char hexdig[] = "0123456789abcdef";

/* random_hex fills out with n random lowercase hex digits (n even) and a NUL, never all
 * zeros. */
static void random_hex(char *out, size_t n)
{
    bool zero = true;
    while (zero) {
        for (size_t i = 0; i < n; i += 16) {
            uint64_t r = thread_random();
            for (size_t k = 0; k < 16 && i + k < n; k++) {
                out[i + k] = hexdig[(r >> (4 * k)) & 0xf];
                zero = zero && out[i + k] == '0';
            }
        }
    }
    out[n] = '\0';
}

void trace_new_span(char out[TRACE_SPAN_HEX + 1])
{
    random_hex(out, TRACE_SPAN_HEX);
}

void trace_start(struct trace_ctx *out)
{
    memset(out, 0, sizeof(*out));
    random_hex(out->trace_id, TRACE_ID_HEX);
    random_hex(out->span_id, TRACE_SPAN_HEX);
    out->flags = TRACE_FLAG_SAMPLED;
}

void trace_child(struct trace_ctx *out, const struct trace_ctx *parent)
{
    if (out != parent) {
        memcpy(out->trace_id, parent->trace_id, sizeof(out->trace_id));
        out->flags = parent->flags;
        memcpy(out->state, parent->state, sizeof(out->state));
    }
    random_hex(out->span_id, TRACE_SPAN_HEX);
}

void trace_format(const struct trace_ctx *t, char out[TRACE_PARENT_SIZE])
{
    if (!t || !t->trace_id[0]) {
        out[0] = '\0';
        return;
    }
    snprintf(out, TRACE_PARENT_SIZE, "00-%s-%s-%02x", t->trace_id, t->span_id,
             t->flags & TRACE_FLAGS_KNOWN);
}

/* ---------- traceparent ---------- */

static bool lowerhex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

/* hex_field: p[0..n) is lowercase hex; *zero_out says whether every digit is 0. */
static bool hex_field(const char *p, size_t n, bool *zero_out)
{
    bool zero = true;
    for (size_t i = 0; i < n; i++) {
        if (!lowerhex(p[i])) {
            return false;
        }
        zero = zero && p[i] == '0';
    }
    *zero_out = zero;
    return true;
}

static int hexval(char c)
{
    return c <= '9' ? c - '0' : c - 'a' + 10;
}

static bool blank(char c)
{
    return c == ' ' || c == '\t';
}

/* trim finds s without the blanks around it: *len_out characters from the returned pointer. */
static const char *trim(const char *s, size_t n, size_t *len_out)
{
    while (n && blank(*s)) {
        s++;
        n--;
    }
    while (n && blank(s[n - 1])) {
        n--;
    }
    *len_out = n;
    return s;
}

/* parse_parent checks a traceparent (without blanks around it) and fills out's ids and flags. */
static enum cf_status parse_parent(struct trace_ctx *out, const char *s, size_t n,
                                   struct cf_error *err)
{
    bool zero;
    if (n < 55) {
        return cf_error_set(err, CF_INVALID, "traceparent is %zu characters, shorter than 55", n);
    }
    if (!hex_field(s, 2, &zero) || s[2] != '-') {
        return cf_error_set(err, CF_INVALID,
                            "traceparent's version is not two lowercase hex digits and a '-'");
    }
    if (s[0] == 'f' && s[1] == 'f') {
        return cf_error_set(err, CF_INVALID, "traceparent's version ff is invalid");
    }
    if (zero && n != 55) {
        return cf_error_set(err, CF_INVALID,
                            "a version-00 traceparent is 55 characters; this one is %zu", n);
    }
    if (n > 55 && s[55] != '-') {
        return cf_error_set(err, CF_INVALID,
                            "traceparent's flags are followed by '%c', not '-' or the end", s[55]);
    }
    if (!hex_field(s + 3, TRACE_ID_HEX, &zero) || s[35] != '-') {
        return cf_error_set(err, CF_INVALID,
                            "traceparent's trace-id is not 32 lowercase hex digits and a '-'");
    }
    if (zero) {
        return cf_error_set(err, CF_INVALID, "traceparent's trace-id is all zeros");
    }
    if (!hex_field(s + 36, TRACE_SPAN_HEX, &zero) || s[52] != '-') {
        return cf_error_set(err, CF_INVALID,
                            "traceparent's parent-id is not 16 lowercase hex digits and a '-'");
    }
    if (zero) {
        return cf_error_set(err, CF_INVALID, "traceparent's parent-id is all zeros");
    }
    if (!hex_field(s + 53, 2, &zero)) {
        return cf_error_set(err, CF_INVALID,
                            "traceparent's trace-flags are not two lowercase hex digits");
    }
    memcpy(out->trace_id, s + 3, TRACE_ID_HEX);
    out->trace_id[TRACE_ID_HEX] = '\0';
    memcpy(out->span_id, s + 36, TRACE_SPAN_HEX);
    out->span_id[TRACE_SPAN_HEX] = '\0';
    out->flags = (unsigned)(hexval(s[53]) << 4 | hexval(s[54])) & TRACE_FLAGS_KNOWN;
    return CF_OK;
}

/* ---------- tracestate ---------- */

static bool lcalpha(char c)
{
    return c >= 'a' && c <= 'z';
}

static bool key_char(char c)
{
    return lcalpha(c) || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '*' || c == '/';
}

/* valid_key: simple-key = lcalpha 0*255(keychar); multi-tenant-key = tenant-id "@" system-id,
 * tenant-id = (lcalpha / DIGIT) 0*240(keychar), system-id = lcalpha 0*13(keychar). */
static bool valid_key(const char *k, size_t n)
{
    const char *at = memchr(k, '@', n);
    if (!at) {
        if (n < 1 || n > 256 || !lcalpha(k[0])) {
            return false;
        }
        for (size_t i = 1; i < n; i++) {
            if (!key_char(k[i])) {
                return false;
            }
        }
        return true;
    }
    size_t tn = (size_t)(at - k), sn = n - tn - 1;
    if (tn < 1 || tn > 241 || sn < 1 || sn > 14 ||
        !(lcalpha(k[0]) || (k[0] >= '0' && k[0] <= '9'))) {
        return false;
    }
    if (!lcalpha(at[1])) {
        return false;
    }
    for (size_t i = 1; i < n; i++) {
        if (k + i != at && !key_char(k[i])) {
            return false;
        }
    }
    return true;
}

/* valid_value: 0*255(chr) nblk-chr, chr = %x20 / nblk-chr, nblk-chr = %x21-7E but ',' and '='. */
static bool valid_value(const char *v, size_t n)
{
    if (n < 1 || n > 256 || v[n - 1] == ' ') {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)v[i];
        if (c < 0x20 || c > 0x7e || c == ',' || c == '=') {
            return false;
        }
    }
    return true;
}

struct member {
    const char *p; /* key=value, without blanks around it */
    size_t n;
    size_t key_n;
};

/* parse_state reads tracestate into out (normalized: members joined by ',' with no blanks,
 * cut to TRACE_STATE_MAX as the spec advises); false when it breaks the grammar. */
static bool parse_state(char out[TRACE_STATE_MAX + 1], const char *s)
{
    struct member m[TRACE_STATE_MEMBERS];
    size_t n = 0;
    const char *p = s;
    out[0] = '\0';
    for (;;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        size_t tl;
        const char *t = trim(p, len, &tl);
        if (tl) {
            const char *eq = memchr(t, '=', tl);
            if (!eq || n == TRACE_STATE_MEMBERS) {
                return false;
            }
            size_t kn = (size_t)(eq - t);
            if (!valid_key(t, kn) || !valid_value(eq + 1, tl - kn - 1)) {
                return false;
            }
            for (size_t i = 0; i < n; i++) {
                if (m[i].key_n == kn && !memcmp(m[i].p, t, kn)) {
                    return false; /* a key twice */
                }
            }
            m[n++] = (struct member){t, tl, kn};
        }
        if (!end) {
            break;
        }
        p = end + 1;
    }
    /* too long to keep: members over 128 characters go first, then the last ones */
    size_t total = n ? n - 1 : 0;
    for (size_t i = 0; i < n; i++) {
        total += m[i].n;
    }
    for (size_t i = n; i-- > 0 && total > TRACE_STATE_MAX;) {
        if (m[i].n > 128) {
            total -= m[i].n + (n > 1 ? 1 : 0);
            memmove(&m[i], &m[i + 1], sizeof(m[0]) * (n - i - 1));
            n--;
        }
    }
    while (n && total > TRACE_STATE_MAX) {
        n--;
        total -= m[n].n + (n ? 1 : 0);
    }
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (i) {
            out[o++] = ',';
        }
        memcpy(out + o, m[i].p, m[i].n);
        o += m[i].n;
    }
    out[o] = '\0';
    return true;
}

enum cf_status trace_parse(struct trace_ctx *out, const char *traceparent, const char *tracestate,
                           struct cf_error *err)
{
    size_t n;
    memset(out, 0, sizeof(*out));
    if (!traceparent || !*traceparent) {
        return cf_error_set(err, CF_INVALID, "no traceparent");
    }
    const char *s = trim(traceparent, strlen(traceparent), &n);
    enum cf_status rc = parse_parent(out, s, n, err);
    if (rc != CF_OK) {
        memset(out, 0, sizeof(*out));
        return rc;
    }
    if (tracestate && *tracestate && !parse_state(out->state, tracestate)) {
        out->state[0] = '\0'; /* the trace is kept without it */
    }
    return CF_OK;
}

/* ---------- the current trace ---------- */

const struct trace_ctx *trace_current(void)
{
    return current.trace_id[0] ? &current : NULL;
}

void trace_enter(const struct trace_ctx *t, struct trace_ctx *saved)
{
    *saved = current;
    if (t && t->trace_id[0]) {
        current = *t;
    } else {
        memset(&current, 0, sizeof(current));
    }
}

void trace_leave(const struct trace_ctx *saved)
{
    current = *saved;
}

size_t trace_http_headers(const struct trace_ctx *t, struct trace_http *h, const char **lines)
{
    t = t ? t : &current;
    if (!t->trace_id[0]) {
        return 0;
    }
    struct trace_ctx hop;
    char tp[TRACE_PARENT_SIZE];
    trace_child(&hop, t); /* the request's own span */
    trace_format(&hop, tp);
    snprintf(h->parent, sizeof(h->parent), "traceparent: %s", tp);
    lines[0] = h->parent;
    if (!t->state[0]) {
        return 1;
    }
    snprintf(h->state, sizeof(h->state), "tracestate: %s", t->state);
    lines[1] = h->state;
    return 2;
}

bool trace_outgoing(char out[TRACE_PARENT_SIZE])
{
    if (!current.trace_id[0]) {
        out[0] = '\0';
        return false;
    }
    struct trace_ctx hop;
    trace_child(&hop, &current);
    trace_format(&hop, out);
    return true;
}
