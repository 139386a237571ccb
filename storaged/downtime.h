/* downtime.h - the time storaged was down, taken in when it starts again.
 *
 * No agentd can renew a lease while storaged is down, so a restart that took longer than a
 * lease would find every running submission's lease ended, and the first Claim would take the
 * work over (an attempt each) while its agentds still ran it. At start-up, before anything is
 * served, the leases that still ran when storaged stopped are extended by the time it was down
 * (ledger_extend_leases), and a step of the wall clock made meanwhile is taken in as a running
 * storaged takes one in (ledger_shift_times, store_clock.h).
 *
 * How long it was down:
 * - after a clean stop on the same boot: by CLOCK_BOOTTIME, which runs on across process
 *   restarts; the wall clock's difference beyond it is a step;
 * - after a clean stop on another boot: by the wall clock, from the stop's stamp;
 * - after a crash (no stamp): by the wall clock, from the database files' last change. While
 *   a lease runs its heartbeats are written every few seconds, so that is close to the crash.
 */
#ifndef CFLUE_STORAGED_DOWNTIME_H
#define CFLUE_STORAGED_DOWNTIME_H

#include "db.h"
#include "status.h"

#include <sqlite3.h>
#include <stdint.h>

/* A time down shorter than this (ms) moves nothing: a quick restart. */
#define DOWNTIME_MIN_MS 1000

/* How the time down was told (downtime_measure). */
enum downtime_source {
    DOWNTIME_UNKNOWN = 0, /* nothing to tell it by (a first start, say) */
    DOWNTIME_BOOT_CLOCK,  /* CLOCK_BOOTTIME across a clean stop on the same boot */
    DOWNTIME_STOP_STAMP,  /* the wall clock, from a clean stop's stamp */
    DOWNTIME_LAST_WRITE,  /* the wall clock, from the files' last change after a crash */
};

/* downtime_boot_ms reads CLOCK_BOOTTIME in ms (the time since the machine booted, suspended time
 * included). */
int64_t downtime_boot_ms(void);

/* downtime_last_write_ms is the later change time of the database file at db_path and its
 * WAL (epoch ms by the wall clock; 0 when neither can be read). Read it before opening the
 * database, whose start-up writes would move it. */
int64_t downtime_last_write_ms(const char *db_path);

/* downtime_measure tells how long storaged was down (*down_ms, never negative) and by how much
 * the wall clock was stepped meanwhile (*step_ms, 0 when under STORE_CLOCK_STEP_MS: told by
 * the boot clock on the same boot after a clean stop; otherwise only a step back, by the stop
 * lying ahead of the clock now, by at least that much), from the previous run's stop (last),
 * the files' last change (last_write_ms, 0: unknown), the store clock now (now_ms) and
 * CLOCK_BOOTTIME now (boot_now_ms). Returns how it was told. */
enum downtime_source downtime_measure(const struct db_last_run *last, int64_t last_write_ms,
                                      int64_t now_ms, int64_t boot_now_ms, int64_t *down_ms,
                                      int64_t *step_ms);

/* What downtime_take_in found and moved. */
struct downtime_moves {
    enum downtime_source source;
    int64_t down_ms, step_ms; /* as downtime_measure told them */
    int leases_extended;      /* submissions whose lease was extended by down_ms */
    int submissions_moved;    /* submissions whose times were moved by step_ms */
};

/* downtime_take_in runs once at start-up on the writer connection, inside the start-up's
 * transaction (a step of db_boot), before anything is served: measures the time down
 * (downtime_measure), moves the unsettled work's times by the step and extends the leases that
 * ran at the stop by the time down (nothing when it was under DOWNTIME_MIN_MS and no step).
 * Fills *moves. On failure the caller rolls back and must not serve. */
CF_MUST_CHECK enum cf_status downtime_take_in(sqlite3 *db, const struct db_last_run *last,
                                              int64_t last_write_ms, struct downtime_moves *moves,
                                              struct cf_error *err);

/* downtime_log logs what downtime_take_in moved (`downtime_taken_in`), once its transaction
 * committed; nothing when it moved nothing. */
void downtime_log(const struct downtime_moves *moves);

#endif
