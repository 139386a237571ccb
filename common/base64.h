/* base64.h - the standard base64 alphabet (RFC 4648 section 4), with padding.
 *
 * Images cross two boundaries as base64: MCP servers send their image content so, and both
 * providers take image bytes so. Decoding bounds its output before it allocates anything.
 */
#ifndef CFLUE_BASE64_H
#define CFLUE_BASE64_H

#include "status.h"

#include <stddef.h>
#include <stdint.h>

/* base64_encode returns p[0..n) encoded, padded and NUL-terminated (the caller frees it).
 * Never NULL: it aborts on out-of-memory as mem_alloc does. */
char *base64_encode(const uint8_t *p, size_t n);

/* base64_decode decodes text[0..len) into a new buffer in *out (the caller frees it; never
 * NULL on success, even for empty input) of *out_len bytes. The padding '=' may be left off;
 * nothing else outside the alphabet is allowed (no whitespace). CF_INVALID for a character
 * outside the alphabet, padding anywhere but the end or a length no encoding has; CF_TOOBIG
 * when the bytes would pass max (checked before anything is allocated). On failure *out is
 * NULL and *out_len 0. */
CF_MUST_CHECK enum cf_status base64_decode(const char *text, size_t len, size_t max, uint8_t **out,
                                           size_t *out_len);

#endif
