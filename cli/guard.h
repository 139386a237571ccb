/* guard.h - every cflue command ends promptly on SIGINT/SIGTERM or at its deadline.
 *
 * rpc_global_init blocks SIGINT and SIGTERM in every thread, so without a guard a signal would
 * wait until the blocked call returned, which for a server that accepted the connection and
 * never answers is never. The guard thread waits for those signals and for the command's
 * deadline (--deadline-ms N or CFLUE_DEADLINE_MS); when one comes it cancels every call on
 * every channel made with guard_channel (they end at once), and if the command still has not
 * returned a few seconds later it prints the message and exits the process itself.
 */
#ifndef CFLUE_CLI_GUARD_H
#define CFLUE_CLI_GUARD_H

#include "rpc.h"

#include <stdbool.h>
#include <stdint.h>

/* Exit codes of a command the guard ended. */
#define GUARD_EXIT_DEADLINE 4
#define GUARD_EXIT_SIGINT 130  /* 128 + SIGINT */
#define GUARD_EXIT_SIGTERM 143 /* 128 + SIGTERM */

/* guard_start starts the guard for a command whose deadline is deadline_ms from now (<= 0:
 * none). Call once, after rpc_global_init (the signals must already be blocked). On failure
 * (no thread) prints why and returns false: the command must not run unguarded. */
CF_MUST_CHECK bool guard_start(int64_t deadline_ms);

/* guard_channel is rpc_channel_new for a channel the guard cancels; free it with
 * guard_channel_free. Never NULL; a channel made after the guard fired fails its calls at
 * once. */
struct rpc_channel *guard_channel(const char *target, int max_message_bytes);

/* guard_channel_free forgets and frees a channel from guard_channel (NULL is fine). */
void guard_channel_free(struct rpc_channel *ch);

/* guard_timeout_ms returns the deadline for the next call: default_ms (<= 0: none), cut to
 * what is left of the command's deadline (at least 1 ms once it has passed). */
int64_t guard_timeout_ms(int64_t default_ms);

/* guard_fail prints a failed call's status as "cflue: DETAILS [REASON] (gRPC status N)"
 * (REASON: the ErrorInfo reason, left out when there is none), unless the
 * guard ended the call (guard_exit_code then says why), and returns 1. */
int guard_fail(const struct rpc_status *st);

/* guard_fired reports whether a signal or the deadline ended the command. */
bool guard_fired(void);

/* guard_exit_code turns a command's exit code into the guard's when the guard fired or the
 * command's deadline passed, printing one line that says which; otherwise returns rc. */
int guard_exit_code(int rc);

#endif
