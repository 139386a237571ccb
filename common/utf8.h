/* utf8.h - UTF-8 validation. */
#ifndef CFLUE_UTF8_H
#define CFLUE_UTF8_H

#include <stdbool.h>
#include <stddef.h>

/* utf8_valid reports whether p[0..n) is well-formed UTF-8 (no overlongs, no surrogates, no
 * code points past U+10FFFF). When it is not and bad_at is not NULL, *bad_at is the byte
 * offset of the first bad sequence. */
bool utf8_valid(const char *p, size_t n, size_t *bad_at);

struct buf;
#include "status.h"

/* utf8_sanitize appends p[0..n) to out, each invalid byte, and each NUL, replaced by U+FFFD:
 * what it gives is text for a protobuf string, which ends at a NUL (protobuf-c's strings are
 * C strings), so a NUL kept would drop the rest. A sequence cut at the end of the input counts
 * as invalid. CF_TOOBIG when out's cap is reached. */
enum cf_status utf8_sanitize(struct buf *out, const char *p, size_t n);

/* utf8_seq_len returns the length (1 to 4) of the well-formed sequence that starts p[0..n), or
 * 0 when p starts with a bad or cut-off one (or n is 0). */
size_t utf8_seq_len(const char *p, size_t n);

/* utf8_prefix_len returns the largest length <= max of a prefix of p[0..n) that does not end
 * inside a multi-byte sequence. */
size_t utf8_prefix_len(const char *p, size_t n, size_t max);

/* utf8_suffix_start returns the smallest offset k such that p[k..n) has at most max bytes and
 * does not start inside a multi-byte sequence. */
size_t utf8_suffix_start(const char *p, size_t n, size_t max);

/* utf8_count_chars counts the code points of p[0..n) (invalid bytes count one each). */
size_t utf8_count_chars(const char *p, size_t n);

/* utf8_chars_prefix_len returns the byte length of the first max_chars code points. */
size_t utf8_chars_prefix_len(const char *p, size_t n, size_t max_chars);
#endif
