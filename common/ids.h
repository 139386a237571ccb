/* ids.h - prefixed, time-ordered unique ids: PREFIX + "_" + 26-character ULID.
 *
 * A ULID is 48 bits of Unix milliseconds followed by 80 random bits, in Crockford base32,
 * so ids sort by creation time. Examples: sub_01JD..., conv_01JD..., att_01JD....
 */
#ifndef CFLUE_IDS_H
#define CFLUE_IDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define IDS_MAX 64 /* enough for any prefix we use, the separator, the ULID and NUL */

/* ids_new writes a new id with the given prefix ("sub", "conv", ...) into out. */
void ids_new(char out[IDS_MAX], const char *prefix);

/* ids_valid_name reports whether s is a safe caller-chosen name or id: 1..max_len characters
 * of [A-Za-z0-9._-], not "." or "..". */
bool ids_valid_name(const char *s, size_t max_len);

/* The longest principal name (an Agent API token's name, AdmitRequest.principal). */
#define IDS_PRINCIPAL_MAX 64

/* ids_valid_principal reports whether s is a valid principal name: 1..IDS_PRINCIPAL_MAX
 * characters of [A-Za-z0-9._@-]. */
bool ids_valid_principal(const char *s);

/* ids_hash64 is the 64-bit FNV-1a hash of the string s (NULL hashes as ""): stable across
 * processes and builds, for names derived from longer ones. Not for security. */
uint64_t ids_hash64(const char *s);

/* IDS_HASH64_INIT and ids_hash64_more hash bytes in pieces with the same FNV-1a:
 * ids_hash64(s) == ids_hash64_more(IDS_HASH64_INIT, s, strlen(s)). */
#define IDS_HASH64_INIT 0xcbf29ce484222325ULL
uint64_t ids_hash64_more(uint64_t h, const void *p, size_t n);

#endif
