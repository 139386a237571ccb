/* writer.h - the single writer thread with group commit.
 *
 * Every write of storaged goes through one SQLite connection owned by one thread. Jobs that
 * arrive while a transaction commits wait and are committed together in the next one, each
 * inside its own savepoint, so one failing job does not undo the others. A job's completion
 * callback runs after the COMMIT returned, on the writer's completion thread, while the next
 * batch already runs. A batch holding a job marked `durable` (admission,
 * settlement, abort intents, join finalization, input stamps) commits with synchronous=FULL:
 * the WAL is synced before anyone is answered, so it survives power loss. Other batches
 * (record appends, claims, leases, joins claimed or reverted) commit with synchronous=NORMAL:
 * safe against any process crash, and made power-safe by the next synced commit, as the
 * durability statement allows; db_boot fences attempts that a power loss could have left
 * writing on top of lost commits.
 */
#ifndef CFLUE_STORAGED_WRITER_H
#define CFLUE_STORAGED_WRITER_H

#include "ledger.h"

#include <stdint.h>

struct writer;

struct writer_job {
    /* run executes the job's ledger work inside the shared transaction */
    enum cf_status (*run)(struct ledger_ctx *c, void *arg, struct cf_error *err);
    /* done is called once, on the completion thread, after commit or rollback */
    void (*done)(void *arg, enum cf_status st, const struct cf_error *err);
    void *arg;
    struct arena *arena; /* where run builds its response */
    bool durable;        /* must survive power loss before done is called */
    struct writer_job *next;
    enum cf_status st;
    struct cf_error err;
    bool refused; /* the writer's: run failed on its own, so st and err stand whatever follows */
};

/* writer_start starts the writer thread on db, which it then owns and closes, and stores it
 * in *out. Followers waiting on n are woken after each commit that appended records. When the
 * thread cannot be started it returns the status of thread_start with err set, *out is NULL
 * and db still belongs to the caller.
 *
 * Failures inside a batch: a job whose work fails is rolled back to its savepoint alone. When
 * SAVEPOINT, ROLLBACK TO, RELEASE or COMMIT fail, the whole batch is rolled back and every job
 * that had not failed on its own gets that error: nothing is answered as written unless its
 * COMMIT returned. When a job's failure made SQLite roll the whole transaction back (a full
 * disk, an I/O error, no memory), the other jobs get that job's error: the batch is gone.
 * SQLITE_BUSY/LOCKED after the busy timeout are CF_UNAVAILABLE (retry). */
CF_MUST_CHECK enum cf_status writer_start(struct writer **out, sqlite3 *db,
                                          const struct ledger_config *cfg, int max_batch,
                                          struct cf_error *err);

/* writer_submit queues a job; the job must stay valid until its done callback. After
 * writer_stop began, the job completes at once with CF_UNAVAILABLE. */
void writer_submit(struct writer *w, struct writer_job *job);

/* writer_release_memory asks the writer thread to drop its connection's page cache the next
 * time it has nothing queued (at once when idle). */
void writer_release_memory(struct writer *w);

/* writer_note_stop takes now as the time storaged stopped: call it when the server stops
 * taking calls. From then on no agentd can renew a lease, though the calls in flight still
 * drain (for up to --grace-ms), so the next start counts the drain as time down (downtime.h).
 * Main thread only, before writer_stop. */
void writer_note_stop(struct writer *w);

/* writer_stop commits what is queued, stops the thread, stamps a clean stop (db_clean_stop)
 * with the time writer_note_stop took (else now), read on the store clock as it is at the
 * stamp, closes the database and frees w. */
void writer_stop(struct writer *w);

#endif
