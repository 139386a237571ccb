/* page_token.c - opaque page tokens: hex of "<version><scope hash>|<position>". */
#include "page_token.h"

#include "ids.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKEN_VERSION 'p'

void page_token_make(char out[PAGE_TOKEN_MAX], const char *scope, const char *position)
{
    char plain[PAGE_TOKEN_MAX / 2];
    int n = snprintf(plain, sizeof(plain), "%c%016" PRIx64 "|%.*s", TOKEN_VERSION,
                     ids_hash64(scope), PAGE_TOKEN_POSITION_MAX, position ? position : "");
    if (n < 0 || (size_t)n >= sizeof(plain)) {
        n = (int)sizeof(plain) - 1;
    }
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < n; i++) {
        out[2 * i] = hex[(unsigned char)plain[i] >> 4];
        out[2 * i + 1] = hex[(unsigned char)plain[i] & 15];
    }
    out[2 * n] = '\0';
}

void page_token_make_int(char out[PAGE_TOKEN_MAX], const char *scope, int64_t position)
{
    char pos[32];
    snprintf(pos, sizeof(pos), "%" PRId64, position);
    page_token_make(out, scope, pos);
}

static int unhex(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    return -1;
}

static enum cf_status bad(struct cf_error *err)
{
    return cf_error_setr(err, CF_INVALID, "INVALID_PAGE_TOKEN",
                         "page_token was not made by this method for this request (pass "
                         "next_page_token back unchanged, with the same other fields)");
}

enum cf_status page_token_parse(const char *token, const char *scope,
                                char position[PAGE_TOKEN_POSITION_MAX + 1], struct cf_error *err)
{
    char plain[PAGE_TOKEN_MAX / 2];
    size_t len = token ? strlen(token) : 0;
    if (len == 0 || len % 2 || len / 2 >= sizeof(plain)) {
        return bad(err);
    }
    for (size_t i = 0; i < len / 2; i++) {
        int hi = unhex(token[2 * i]), lo = unhex(token[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return bad(err);
        }
        plain[i] = (char)(hi << 4 | lo);
        if (!plain[i]) {
            return bad(err);
        }
    }
    plain[len / 2] = '\0';
    char expect[32];
    snprintf(expect, sizeof(expect), "%c%016" PRIx64 "|", TOKEN_VERSION, ids_hash64(scope));
    size_t el = strlen(expect);
    if (strncmp(plain, expect, el) != 0 || strlen(plain + el) > PAGE_TOKEN_POSITION_MAX) {
        return bad(err);
    }
    strcpy(position, plain + el);
    return CF_OK;
}

enum cf_status page_token_parse_int(const char *token, const char *scope, int64_t *position,
                                    struct cf_error *err)
{
    char pos[PAGE_TOKEN_POSITION_MAX + 1], *end;
    enum cf_status rc = page_token_parse(token, scope, pos, err);
    if (rc != CF_OK) {
        return rc;
    }
    long long v = strtoll(pos, &end, 10);
    if (!*pos || *end || v < -1) {
        return bad(err);
    }
    *position = v;
    return CF_OK;
}
