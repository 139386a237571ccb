/* token.h - the Agent API's bearer token in the cflue command: which one the agent commands
 * send, and `cflue token hash|new` for the operator's token file (docs/security.md).
 */
#ifndef CFLUE_CLI_TOKEN_H
#define CFLUE_CLI_TOKEN_H

#include "rpc.h"

#include <stddef.h>

#define TOKEN_SECRET_MAX 1024 /* as agentd accepts (TOKENS_SECRET_MAX) */

/* token_attach makes every call on ch (an agentd channel) carry the caller's bearer token as
 * the metadata "authorization: Bearer <token>". The token is flag_token (--token), else the
 * first line of flag_file (--token-file), else $CFLUE_TOKEN, else the first line of
 * $CFLUE_TOKEN_FILE; none: nothing is attached. Returns 0, or 2 after printing why (both flags
 * given, a file that cannot be read, a token that is not 1 to TOKEN_SECRET_MAX printable
 * characters without spaces). Never prints the token. */
int token_attach(struct rpc_channel *ch, const char *flag_token, const char *flag_file);

/* cmd_token runs `cflue token hash` (the SHA-256, in hex, of the token read from stdin, one
 * trailing newline dropped: the sha256 of a token file entry) and `cflue token new` (a new
 * random token and its hash). Returns the exit code (2: usage). */
int cmd_token(int argc, char **argv);

#endif
