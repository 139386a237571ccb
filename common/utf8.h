/* utf8.h - UTF-8 validation. */
#ifndef CFLUE_UTF8_H
#define CFLUE_UTF8_H

#include <stdbool.h>
#include <stddef.h>

/* utf8_valid reports whether p[0..n) is well-formed UTF-8 (no overlongs, no surrogates, no
 * code points past U+10FFFF). When it is not and bad_at is not NULL, *bad_at is the byte
 * offset of the first bad sequence. */
bool utf8_valid(const char *p, size_t n, size_t *bad_at);

#endif
