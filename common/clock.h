/* clock.h - wall and monotonic time in milliseconds. */
#ifndef CFLUE_CLOCK_H
#define CFLUE_CLOCK_H

#include <pthread.h>
#include <stdint.h>

/* clock_now_ms returns Unix time in milliseconds (wall clock, for stored timestamps). */
int64_t clock_now_ms(void);

/* clock_mono_ms returns a monotonic clock in milliseconds, for intervals and deadlines. */
int64_t clock_mono_ms(void);

/* clock_mono_us is clock_mono_ms in microseconds, for latencies. */
int64_t clock_mono_us(void);

struct timespec;

/* clock_deadline fills ts with the time ms milliseconds from now on the monotonic clock, the
 * form clock_cond_wait takes. */
void clock_deadline(struct timespec *ts, int64_t ms);

/* clock_cond_wait waits on cv (mu held, as pthread_cond_timedwait) until it is signalled or
 * the monotonic clock passes deadline (clock_deadline): a step of the wall clock neither
 * stretches nor cuts the wait. Returns 0, or ETIMEDOUT when the deadline passed. */
int clock_cond_wait(pthread_cond_t *cv, pthread_mutex_t *mu, const struct timespec *deadline);

/* clock_sleep_ms sleeps at least ms milliseconds (restarting after signals). */
void clock_sleep_ms(int64_t ms);

#endif
