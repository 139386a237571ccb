/* thread.h - starting threads, and a per-thread random source for jitter.
 *
 * Every thread the project starts goes through thread_start, so a failure to start one is a
 * status the caller must handle (a batch that cannot start a worker fails that call; a daemon
 * that cannot start its pool exits with a clear message) instead of a join on an unset handle.
 */
#ifndef CFLUE_THREAD_H
#define CFLUE_THREAD_H

#include "status.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* thread_start starts fn(arg) on a new joinable thread with the given stack size (0: the
 * default) and stores its handle in *out. On failure *out is untouched, err names the reason
 * and CF_BUSY is returned; nothing was started. */
CF_MUST_CHECK enum cf_status thread_start(pthread_t *out, size_t stack_size, void *(*fn)(void *),
                                          void *arg, struct cf_error *err);

/* thread_start_detached is thread_start for a thread nobody joins. */
CF_MUST_CHECK enum cf_status thread_start_detached(size_t stack_size, void *(*fn)(void *),
                                                   void *arg, struct cf_error *err);

/* thread_random returns 64 random bits from a generator private to the calling thread, seeded
 * from the kernel's random source on first use (so replicas and threads never share a
 * sequence). Not for secrets: for retry jitter and sampling. */
uint64_t thread_random(void);

/* thread_jitter_ms returns a uniformly random duration in [0, max_ms). 0 when max_ms <= 0. */
int64_t thread_jitter_ms(int64_t max_ms);

#endif
