/* tokens.h - the Agent API's bearer tokens (agentd --tokens FILE) and the principals they name.
 *
 * The file is YAML, one entry per token, and holds no secret: only each secret's SHA-256.
 *
 *   tokens:
 *     - name: alice              # the principal: 1 to 64 of [A-Za-z0-9._@-]
 *       sha256: 9f86d0...        # SHA-256 of the secret, 64 hex digits
 *       agents: [coder, "*"]     # the agents it may Submit to and Compact with ("*": any)
 *       admin: false             # true: may act on every principal's conversations
 *
 * A caller sends the secret as the metadata `authorization: Bearer <secret>`; agentd hashes it
 * and compares the digest with every entry's in constant time (CRYPTO_memcmp), so neither the
 * file nor the comparison reveals a secret. Secrets are never logged, recorded or echoed.
 *
 * The set in force is replaced whole by a reload (SIGHUP, or a change of the file seen by
 * agentd's watch): a file that does not load leaves the set in force as it was. Lookups take
 * the module's lock for a moment and copy what they need; nothing outside holds the set.
 */
#ifndef CFLUE_AGENTD_TOKENS_H
#define CFLUE_AGENTD_TOKENS_H

#include "ids.h"
#include "status.h"

#include <stdbool.h>
#include <stddef.h>

#define TOKENS_SECRET_MAX 1024        /* bytes of a bearer token's secret */
#define TOKENS_AUTHORIZATION_MAX 1100 /* bytes of the authorization metadata value read */
#define TOKENS_MAX 1000               /* entries of a token file */
#define TOKENS_FILE_MAX (1 << 20)     /* bytes of a token file */

/* Who is calling: the name of the caller's token, and whether it is an admin token. */
struct principal {
    char name[IDS_PRINCIPAL_MAX + 1]; /* "" when authentication is off */
    bool admin;
};

struct token_set;

/* tokens_parse reads a token file's text (len bytes; file names it in messages) into a new set
 * (*out, freed with tokens_set_free). CF_INVALID naming the file, the line and what is wrong:
 * YAML that does not parse, a key other than those above, a missing name or sha256, a name or
 * agent that is not valid, sha256 that is not 64 hex digits, admin that is not true or false,
 * a name or hash used twice, more than TOKENS_MAX entries. */
CF_MUST_CHECK enum cf_status tokens_parse(const char *text, size_t len, const char *file,
                                          struct token_set **out, struct cf_error *err);

/* tokens_set_count returns the number of tokens of set. */
size_t tokens_set_count(const struct token_set *set);

/* tokens_set_free releases a set tokens_parse made (NULL is fine). */
void tokens_set_free(struct token_set *set);

/* tokens_start loads path and puts it in force (before any other tokens_ call but
 * tokens_parse); "" leaves authentication off. CF_IO or CF_INVALID, with why (the file and
 * line), when the file cannot be read or does not load; nothing is in force then. */
CF_MUST_CHECK enum cf_status tokens_start(const char *path, struct cf_error *err);

/* tokens_enabled reports whether --tokens was given (tokens_start with a path). */
bool tokens_enabled(void);

/* tokens_count returns the number of tokens in force (0 when authentication is off). */
size_t tokens_count(void);

/* tokens_reload loads the file again and puts it in force when it loads (logged
 * tokens_reloaded); else the set in force stays and the log says why (tokens_reload_failed;
 * the same file is not tried again by the watch until it changes). true when a new set is in
 * force. Does nothing (false) when authentication is off. Thread-safe: one at a time. */
bool tokens_reload(const char *why);

/* tokens_changed reports whether the file (followed through symbolic links, as a Kubernetes
 * Secret mounts it) differs from what the set in force, or the last failed reload, was loaded
 * from. false when authentication is off. */
bool tokens_changed(void);

/* tokens_stop releases the set in force (at shutdown). */
void tokens_stop(void);

/* tokens_authenticate finds the token of an authorization metadata value ("Bearer <secret>";
 * NULL when the call carried none) and fills *out with its principal. CF_UNAUTHENTICATED,
 * with a message that never repeats the value, when it is absent, not a bearer token, or no
 * token in force has its hash. Without authentication every caller is CF_OK with an empty
 * principal. Thread-safe. */
CF_MUST_CHECK enum cf_status tokens_authenticate(const char *authorization, struct principal *out,
                                                 struct cf_error *err);

/* tokens_allow_agent reports whether p's token, as in force now, may use agent (its `agents`
 * name it, or "*"). Always true without authentication; false for a token no longer in force.
 * Thread-safe. */
bool tokens_allow_agent(const struct principal *p, const char *agent);

/* tokens_owns reports whether p may act on a conversation of principal owner ("" for one made
 * without authentication): always without authentication, for an admin, and for owner itself. */
bool tokens_owns(const struct principal *p, const char *owner);

#endif
