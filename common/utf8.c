/* utf8.c - UTF-8 validation (RFC 3629). */
#include "utf8.h"

#include <stdint.h>

bool utf8_valid(const char *p, size_t n, size_t *bad_at)
{
    const uint8_t *s = (const uint8_t *)p;
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
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
