/* engine.h - the scheduler of agentd's drives: claiming work, the threads that drive it,
 * heartbeats and abort polling, the resume list, start-up reclaim and shutdown (engine.c). */
#ifndef CFLUE_AGENTD_ENGINE_H
#define CFLUE_AGENTD_ENGINE_H

#include "daemon.h"
#include "status.h"

#include "cflue/v1/store.pb-c.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

struct drive;

/* the default of --max-drives: drives in flight at once (at most ACTIVE_MAX) */
#define ENGINE_MAX_DRIVES_DEFAULT 4096

/* --max-drives: how many drives may be in flight at once, up to as many more of them waiting
 * on their task children aside (engine_on_children); the claimer claims while fewer are. */
extern long long engine_max_drives;

/* engine_note_start records this process's start, before it serves anything: the claimer's
 * first claims also take back the work this owner id held before (its attempts started
 * earlier, leases not yet run out), until one takes over nothing, at most --max-drives at a
 * time. */
void engine_note_start(void);

/* ENGINE_COMMANDS_GONE_MS: how long toold may take to stop the commands of a batch cut off
 * (SIGTERM, 2 s of grace, SIGKILL), with room for the results' way back. A released lease
 * lasts this much longer; an attempt that finds calls of an earlier one without results runs
 * no sandbox command before this much after its claim; a sandbox batch's stream ends this
 * much past the time left. */
#define ENGINE_COMMANDS_GONE_MS 5000

/* engine_start starts `workers` engine threads (they step ready drives), the claimer and the
 * heartbeat. When one cannot start it
 * stops those that did, prints and logs why and returns false (crash-only: the caller exits
 * non-zero and a restart resumes the work). */
bool engine_start(const struct daemon *d, long long workers);

/* engine_drain (at a stop, before engine_stop) ends claiming here: a Submit admits without
 * claiming, the claimer and the resume list stop. The drives in flight run on until none is
 * left, drain_ms passes, or a second SIGTERM or SIGINT comes; logged. Returns at once when
 * drain_ms is 0 or no drive is live. The drives left are then stopped by engine_stop. */
void engine_drain(int64_t drain_ms);

/* engine_stop tells the threads to stop and every drive that it is stopping (recovery resumes
 * their work). Returns at once. */
void engine_stop(void);

/* engine_join waits for the threads that engine_start started (after engine_stop). */
void engine_join(void);

/* engine_release_leases (after engine_join) hands back to storaged, in Release calls, the
 * leases of the drives that the shutdown stopped and of the interrupted work on the resume
 * list: each ends 5 s later (the time toold takes to
 * stop a cancelled command), so that another agentd takes the work over then instead of when
 * the lease runs out. A call storaged does not answer (2 s) ends the hand-back, logged; those
 * leases run out as before. */
void engine_release_leases(void);

/* engine_has_room: fewer than --max-drives drives are live (those waiting on their task
 * children aside: engine_on_children), fewer than ACTIVE_MAX in all, and the engine is not
 * stopping. */
bool engine_has_room(void);
/* engine_on_children says whether drive d waits on its task children (with nothing else it
 * could go on with meanwhile). Such a drive holds no --max-drives slot: a parent waiting on
 * children that need slots of their own would otherwise hold the one they need, and parents
 * filling every slot would stall the agentd until their time limits. */
struct drive;
void engine_on_children(struct drive *d, bool waiting);

/* What an Admit carries to claim the admitted submission for this process too. */
struct engine_admit_claim {
    Cflue__V1__ClaimRequest claim;
    Google__Protobuf__Duration lease;
    Google__Protobuf__Timestamp started; /* claim.owner_started_at */
    uint64_t ticket; /* the Admit's place among those in flight (admit_gate.h); 0: no claim */
};

/* engine_claim_with_admit makes ar claim the submission it admits for this process too
 * (AdmitRequest.claim) when a drive has room: no Claim call, and the drive starts here when
 * the answer comes (engine_admitted). c must live until ar is sent; the caller keeps c->ticket
 * and ends it with exactly one of engine_admitted and engine_admit_unanswered, however the
 * call ends: take-backs wait for it meanwhile. */
void engine_claim_with_admit(Cflue__V1__AdmitRequest *ar, struct engine_admit_claim *c);

/* engine_admitted takes the answer of an Admit made with engine_claim_with_admit (ticket: its
 * c->ticket): a claimed submission's drive starts here (the claim is taken from r); a
 * deduplicated one this owner holds with no drive here (an earlier Admit claimed it and lost
 * its answer) is taken back by the claimer once the Admits started before have ended. true in
 * those two cases: the submission is driven here. */
bool engine_admitted(uint64_t ticket, Cflue__V1__AdmitResponse *r);

/* engine_admit_unanswered ends ticket for an Admit that ended without its answer (code: how,
 * as store_status gave it), or whose answer is dropped unread. One that had a claim and may
 * have committed it (CF_UNAVAILABLE: lost, or past its deadline; CF_CANCELLED) makes the claimer
 * take this owner's undriven work back, as after an unanswered Claim. */
void engine_admit_unanswered(uint64_t ticket, enum cf_status code);

/* engine_post makes d ready: an engine thread steps it (drive_run) soon. Thread-safe and
 * non-blocking: the model I/O loop's callbacks call it. A drive posted while it is being
 * stepped is stepped again afterwards. */
void engine_post(struct drive *d);

/* engine_post_unlock posts d for a callback that holds held, a lock of the drive's, and
 * releases it: the drive is queued under the lock (once it sees the callback's news it may
 * finish and be freed) and an engine thread woken after the unlock, so the thread does not
 * block at once on the lock the callback still holds. Nothing of the drive is touched after
 * the unlock. */
void engine_post_unlock(struct drive *d, pthread_mutex_t *held);

/* engine_post_at posts d at monotonic time due_ms, or sooner: a drive has one timer, which
 * keeps the earliest time asked of it until it fires. So a waiter posted before its own time
 * (by another's timer, or an event) asks again for the time it still waits for. */
void engine_post_at(struct drive *d, int64_t due_ms);

#endif
