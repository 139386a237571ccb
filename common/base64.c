/* base64.c - the standard base64 alphabet, padded (base64.h). */
#include "base64.h"

#include "mem.h"

#include <stdlib.h>

static const char TAB[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *base64_encode(const uint8_t *p, size_t n)
{
    char *out = mem_alloc(((n + 2) / 3) * 4 + 1), *o = out;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        *o++ = TAB[(v >> 18) & 63];
        *o++ = TAB[(v >> 12) & 63];
        *o++ = i + 1 < n ? TAB[(v >> 6) & 63] : '=';
        *o++ = i + 2 < n ? TAB[v & 63] : '=';
    }
    *o = '\0';
    return out;
}

/* sextet: the value of base64 character c, or -1. */
static int sextet(unsigned char c)
{
    if (c >= 'A' && c <= 'Z') {
        return c - 'A';
    }
    if (c >= 'a' && c <= 'z') {
        return c - 'a' + 26;
    }
    if (c >= '0' && c <= '9') {
        return c - '0' + 52;
    }
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

enum cf_status base64_decode(const char *text, size_t len, size_t max, uint8_t **out,
                             size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    size_t n = len;
    if (n % 4 == 0 && n && text[n - 1] == '=') {
        n -= 1 + (text[n - 2] == '=');
    }
    if (n % 4 == 1) {
        return CF_INVALID; /* one character left over encodes no byte */
    }
    size_t bytes = n / 4 * 3 + (n % 4 ? n % 4 - 1 : 0);
    if (bytes > max) {
        return CF_TOOBIG;
    }
    uint8_t *b = mem_alloc(bytes + 1), *o = b;
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        int v = sextet((unsigned char)text[i]);
        if (v < 0) {
            free(b);
            return CF_INVALID;
        }
        acc = acc << 6 | (uint32_t)v;
        if (i % 4 == 3) {
            *o++ = (uint8_t)(acc >> 16);
            *o++ = (uint8_t)(acc >> 8);
            *o++ = (uint8_t)acc;
            acc = 0;
        }
    }
    if (n % 4 == 2) {
        *o++ = (uint8_t)(acc >> 4);
    } else if (n % 4 == 3) {
        *o++ = (uint8_t)(acc >> 10);
        *o++ = (uint8_t)(acc >> 2);
    }
    *out = b;
    *out_len = (size_t)(o - b);
    return CF_OK;
}
