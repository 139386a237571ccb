/* engine.h - the scheduler of agentd's drives: claiming work, the threads that drive it,
 * heartbeats and abort polling, the resume list, start-up reclaim and shutdown (engine.c). */
#ifndef CFLUE_AGENTD_ENGINE_H
#define CFLUE_AGENTD_ENGINE_H

#include "daemon.h"

#include "cflue/v1/store.pb-c.h"

#include <stdbool.h>
#include <stdint.h>

struct drive;

/* the default of --max-drives: drives in flight at once (at most ACTIVE_MAX) */
#define ENGINE_MAX_DRIVES_DEFAULT 4096

/* --max-drives: how many drives may be in flight at once; the claimer claims while fewer are. */
extern long long engine_max_drives;

/* engine_reclaim_own takes back, before anything else is claimed, the work this owner id held
 * before the process restarted. */
void engine_reclaim_own(void);

/* engine_start starts `workers` engine threads (they step ready drives), the claimer and the
 * heartbeat. When one cannot start it
 * stops those that did, prints and logs why and returns false (crash-only: the caller exits
 * non-zero and a restart resumes the work). */
bool engine_start(const struct daemon *d, long long workers);

/* engine_stop tells the threads to stop and every drive that it is stopping (recovery resumes
 * their work). Returns at once. */
void engine_stop(void);

/* engine_join waits for the threads that engine_start started (after engine_stop). */
void engine_join(void);

/* engine_has_room: fewer than --max-drives drives are live and the engine is not stopping. */
bool engine_has_room(void);

/* engine_admit_claimed starts a drive for a claim made elsewhere (Submit's Admit with claim);
 * takes cl. */
void engine_admit_claimed(Cflue__V1__ClaimResponse *cl);

/* engine_take_back has the claimer take back, at once, a submission this owner holds that no
 * drive here runs (an Admit that claimed it lost its answer); nothing when one does. */
void engine_take_back(const char *submission_id);

/* engine_post makes d ready: an engine thread steps it (drive_run) soon. Thread-safe and
 * non-blocking: the model I/O loop's callbacks call it. A drive posted while it is being
 * stepped is stepped again afterwards. */
void engine_post(struct drive *d);

/* engine_post_at posts d at monotonic time due_ms (a timer; replaces d's earlier one). */
void engine_post_at(struct drive *d, int64_t due_ms);

#endif
