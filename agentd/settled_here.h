/* settled_here.h - GetSubmission(wait) answered without storaged for submissions this agentd
 * drives or settled recently (see settled_here.c). */
#ifndef CFLUE_AGENTD_SETTLED_HERE_H
#define CFLUE_AGENTD_SETTLED_HERE_H

#include "cflue/v1/common.pb-c.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct here_entry;
struct here_waiter;

/* here_done_fn answers a parked waiter, exactly once, on the thread that settled or ended the
 * drive, with no lock of this module held. sub is the settled submission (the callee owns and
 * frees it), or NULL: the drive ended without an answer for the waiter, which must take the
 * storaged path. */
typedef void (*here_done_fn)(struct here_waiter *hw, Cflue__V1__Submission *sub);

/* A waiter, embedded in its owner's state (zeroed before the first here_wait). */
struct here_waiter {
    here_done_fn done;
    struct here_entry *entry; /* registered with this entry (under the module's lock) */
    struct here_waiter *next;
};

enum here_answer {
    HERE_SETTLED,   /* settled here recently: *out is the submission (caller frees) */
    HERE_PARKED,    /* driven here now: hw->done will be called once (unless here_cancel) */
    HERE_ELSEWHERE, /* neither: take the storaged path */
};

/* here_wait answers a wait on submission_id from what this process knows: the submissions it
 * settled recently, then its active drives (hw is registered with done). Never blocks and never
 * calls done itself. */
enum here_answer here_wait(struct here_waiter *hw, here_done_fn done, const char *submission_id,
                           Cflue__V1__Submission **out);

/* here_cancel unregisters a parked waiter. true: it was registered and done will never be
 * called; false: it was not (never parked, or done was or is being called). Idempotent. */
bool here_cancel(struct here_waiter *hw);

/* here_begin records that a drive of submission_id starts in this process (drive.c). */
void here_begin(const char *submission_id);

/* here_end records that a drive of submission_id ended (drive.c, after here_settled when it
 * settled). When no drive of it is left, its waiters still parked are answered with NULL (the
 * storaged path). Idempotent per here_begin. */
void here_end(const char *submission_id);

/* here_settled is called with what a finishing Store.Settle returned (settle.c): sub is
 * remembered (a copy; the caller keeps sub) and answers its parked waiters; the waiters of the
 * joined submissions settled with it (settled_with, not returned by Settle) take the storaged
 * path. A sub that is not SETTLED answers no one with it. */
void here_settled(const Cflue__V1__Submission *sub, char *const *settled_with,
                  size_t n_settled_with);

/* here_forget_older forgets the submissions remembered more than age_ms before now_ms
 * (monotonic milliseconds); their later waits take the storaged path. */
void here_forget_older(int64_t now_ms, int64_t age_ms);

/* here_counts reports how many submissions are remembered and how many waiters are parked. */
void here_counts(int *remembered_out, int *waiters_out);

#endif
