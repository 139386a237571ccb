/* utf8.c - UTF-8 validation (RFC 3629). */
#include "utf8.h"

#include <stdint.h>
#include <string.h>

#define HIGH_BITS 0x8080808080808080ULL
#define LOW_BITS 0x0101010101010101ULL

/* ascii_run returns the length of the run of ASCII bytes (NUL excluded when no_nul) that
 * starts p[0..n), looked at eight bytes at a time and then byte by byte: tool output and
 * model text are mostly ASCII, and a byte at a time was most of a large result's cost. */
static size_t ascii_run(const uint8_t *p, size_t n, bool no_nul)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        /* a byte >= 0x80, or (when asked) a zero byte: (w - 0x01..) & ~w has its high bit */
        if ((w & HIGH_BITS) || (no_nul && ((w - LOW_BITS) & ~w & HIGH_BITS))) {
            break;
        }
    }
    while (i < n && p[i] < 0x80 && (p[i] || !no_nul)) {
        i++;
    }
    return i;
}

bool utf8_valid(const char *p, size_t n, size_t *bad_at)
{
    const uint8_t *s = (const uint8_t *)p;
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) {
            i += ascii_run(s + i, n - i, false);
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            len = 2, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            len = 3, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            len = 4, cp = c & 0x07, min = 0x10000;
        } else {
            goto bad;
        }
        if (i + len > n) {
            goto bad;
        }
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) {
                goto bad;
            }
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            goto bad;
        }
        i += len;
    }
    return true;
bad:
    if (bad_at) {
        *bad_at = i;
    }
    return false;
}

#include "buf.h"

size_t utf8_seq_len(const char *p, size_t n)
{
    const uint8_t *s = (const uint8_t *)p;
    size_t bad;
    if (!n) {
        return 0;
    }
    uint8_t c = s[0];
    size_t len = c < 0x80             ? 1
                 : (c & 0xe0) == 0xc0 ? 2
                 : (c & 0xf0) == 0xe0 ? 3
                 : (c & 0xf8) == 0xf0 ? 4
                                      : 0;
    if (!len || len > n) {
        return 0;
    }
    return utf8_valid((const char *)s, len, &bad) ? len : 0;
}

enum cf_status utf8_sanitize(struct buf *out, const char *p, size_t n)
{
    const uint8_t *s = (const uint8_t *)p;
    size_t i = 0, run = 0;
    enum cf_status rc;
    while (i < n) {
        size_t len = s[i] == 0     ? 0
                     : s[i] < 0x80 ? ascii_run(s + i, n - i, true)
                                   : utf8_seq_len(p + i, n - i);
        if (len) {
            i += len;
            run += len;
            continue;
        }
        if (run && (rc = buf_append(out, p + i - run, run)) != CF_OK) {
            return rc;
        }
        run = 0;
        if ((rc = buf_append(out, "\xef\xbf\xbd", 3)) != CF_OK) {
            return rc;
        }
        i++;
    }
    return run ? buf_append(out, p + n - run, run) : CF_OK;
}

size_t utf8_prefix_len(const char *p, size_t n, size_t max)
{
    if (n <= max) {
        return n;
    }
    size_t k = max;
    /* step back over continuation bytes so we do not end inside a sequence */
    while (k > 0 && ((uint8_t)p[k] & 0xc0) == 0x80 && max - k < 3) {
        k--;
    }
    return k;
}

size_t utf8_suffix_start(const char *p, size_t n, size_t max)
{
    if (n <= max) {
        return 0;
    }
    size_t k = n - max;
    while (k < n && ((uint8_t)p[k] & 0xc0) == 0x80 && k - (n - max) < 3) {
        k++;
    }
    return k;
}

size_t utf8_count_chars(const char *p, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if (((uint8_t)p[i] & 0xc0) != 0x80) {
            count++;
        }
    }
    return count;
}

size_t utf8_chars_prefix_len(const char *p, size_t n, size_t max_chars)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if (((uint8_t)p[i] & 0xc0) != 0x80) {
            if (count == max_chars) {
                return i;
            }
            count++;
        }
    }
    return n;
}
