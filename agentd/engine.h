/* engine.h - the scheduler of agentd's drives: claiming work, the threads that drive it,
 * heartbeats and abort polling, the resume list, start-up reclaim and shutdown (engine.c). */
#ifndef CFLUE_AGENTD_ENGINE_H
#define CFLUE_AGENTD_ENGINE_H

#include "daemon.h"

#include <stdbool.h>

/* engine_reclaim_own takes back, before anything else is claimed, the work this owner id held
 * before the process restarted. */
void engine_reclaim_own(void);

/* engine_start starts `workers` drive threads and the heartbeat. When one cannot start it
 * stops those that did, prints and logs why and returns false (crash-only: the caller exits
 * non-zero and a restart resumes the work). */
bool engine_start(const struct daemon *d, long long workers);

/* engine_stop tells the threads to stop and every drive that it is stopping (recovery resumes
 * their work). Returns at once. */
void engine_stop(void);

/* engine_join waits for the threads that engine_start started (after engine_stop). */
void engine_join(void);

#endif
