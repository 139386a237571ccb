/* clock.h - wall and monotonic time in milliseconds. */
#ifndef CFLUE_CLOCK_H
#define CFLUE_CLOCK_H

#include <stdint.h>

/* clock_now_ms returns Unix time in milliseconds (wall clock, for stored timestamps). */
int64_t clock_now_ms(void);

/* clock_mono_ms returns a monotonic clock in milliseconds, for intervals and deadlines. */
int64_t clock_mono_ms(void);

/* clock_mono_us is clock_mono_ms in microseconds, for latencies. */
int64_t clock_mono_us(void);

struct timespec;

/* clock_deadline fills ts with the wall-clock time ms milliseconds from now, the form
 * pthread_cond_timedwait takes. */
void clock_deadline(struct timespec *ts, int64_t ms);

/* clock_sleep_ms sleeps at least ms milliseconds (restarting after signals). */
void clock_sleep_ms(int64_t ms);

#endif
