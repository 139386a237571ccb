/* page_token.h - opaque page tokens for list and read methods (AIP-158).
 *
 * A token names where the next page starts and what it belongs to: the method's scope (the
 * conversation, the filters of a List, a directory) is hashed into it, so a token replayed
 * against another scope is refused with INVALID_ARGUMENT, reason INVALID_PAGE_TOKEN. Tokens
 * are lowercase hex, at most PAGE_TOKEN_MAX - 1 characters. They do not expire.
 */
#ifndef CFLUE_PAGE_TOKEN_H
#define CFLUE_PAGE_TOKEN_H

#include "status.h"

#include <stddef.h>
#include <stdint.h>

#define PAGE_TOKEN_MAX 640
#define PAGE_TOKEN_POSITION_MAX 288 /* bytes of position a token can carry */

/* page_token_make writes the token for `position` (a string of at most
 * PAGE_TOKEN_POSITION_MAX bytes, e.g. a file name) within `scope` into out[PAGE_TOKEN_MAX]. */
void page_token_make(char out[PAGE_TOKEN_MAX], const char *scope, const char *position);

/* page_token_make_int is page_token_make for an integer position (an offset, a sequence). */
void page_token_make_int(char out[PAGE_TOKEN_MAX], const char *scope, int64_t position);

/* page_token_parse reads a token made for `scope` into position[PAGE_TOKEN_POSITION_MAX + 1].
 * CF_INVALID (reason INVALID_PAGE_TOKEN) when it is malformed or belongs to another scope. */
CF_MUST_CHECK enum cf_status page_token_parse(const char *token, const char *scope,
                                              char position[PAGE_TOKEN_POSITION_MAX + 1],
                                              struct cf_error *err);

/* page_token_parse_int reads an integer position (>= -1). */
CF_MUST_CHECK enum cf_status page_token_parse_int(const char *token, const char *scope,
                                                  int64_t *position, struct cf_error *err);

#endif
