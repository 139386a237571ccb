/* failpoint.h - named crash and delay points at durable boundaries, for crash tests.
 *
 * CFLUE_FAILPOINTS="storaged.commit.after=crash,storaged.commit.before=crash:3" makes the
 * process exit abruptly (as SIGKILL would leave it) the first time, or the Nth time, a named
 * point is reached; "storaged.commit.before=sleep:300" makes every hit wait 300 ms (a slow
 * disk). Unset in production: failpoint_hit is then one relaxed load.
 */
#ifndef CFLUE_FAILPOINT_H
#define CFLUE_FAILPOINT_H

#include <stdbool.h>

/* failpoint_init reads CFLUE_FAILPOINTS once; call at start-up before any thread starts. */
void failpoint_init(void);

/* failpoint_hit crashes the process if the named point is armed and its count is reached, or
 * waits when it is armed to sleep. */
void failpoint_hit(const char *name);

/* failpoint_armed: some point is armed (for a caller that must build a point's name). */
bool failpoint_armed(void);

#endif
