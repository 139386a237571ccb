/* store_clock.h - storaged's clock: the wall clock, with its steps taken in by the writer.
 *
 * Leases, time limits and attempt starts are stored as times of this clock. Read as the wall
 * clock at every call, a step of it (set by hand, or stepped by NTP) while storaged runs would
 * move them all at once: forward, every lease ends together and its work is taken over; back,
 * a dead agentd's work waits that much longer. So the clock is the monotonic clock plus an
 * offset, and only the writer moves the offset: when the wall clock has left it by
 * STORE_CLOCK_STEP_MS or more, the writer moves the unsettled work's times by the step in the
 * transaction of its next batch (ledger_shift_times), and adopts the wall clock once that
 * committed. A smaller difference is adopted at once, as time passing.
 */
#ifndef CFLUE_STORAGED_STORE_CLOCK_H
#define CFLUE_STORAGED_STORE_CLOCK_H

#include <stdint.h>

/* A step of the wall clock at least this large moves the stored times with it (ms). */
#define STORE_CLOCK_STEP_MS 1000

/* The wall clock and the monotonic clock read together, and how far the wall clock is from
 * the store clock (the step not taken in yet). */
struct store_clock_reading {
    int64_t wall_ms, mono_ms;
    int64_t step_ms; /* wall_ms less the store clock's time */
};

/* store_clock_now returns the store clock's time (epoch ms): what readers compare with. The
 * first call of the process (of this or store_clock_read) sets the clock to the wall clock. */
int64_t store_clock_now(void);

/* store_clock_read reads both clocks into r. */
void store_clock_read(struct store_clock_reading *r);

/* store_clock_adopt sets the store clock to r's wall clock: after the times it stores were
 * moved by r's step, or when the step is too small to move them. Called by the writer alone. */
void store_clock_adopt(const struct store_clock_reading *r);

#endif
