/* thread.h - starting threads, a per-thread random source for jitter, and the hand-off marks
 * ThreadSanitizer needs where gRPC moves our objects between threads.
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
 * default), named `name` (its first 15 characters, as top -H, ps and perf show it), and stores
 * its handle in *out. On failure *out is untouched, err names the reason and CF_BUSY is
 * returned; nothing was started. */
CF_MUST_CHECK enum cf_status thread_start(pthread_t *out, const char *name, size_t stack_size,
                                          void *(*fn)(void *), void *arg, struct cf_error *err);

/* thread_start_detached is thread_start for a thread nobody joins. */
CF_MUST_CHECK enum cf_status thread_start_detached(const char *name, size_t stack_size,
                                                   void *(*fn)(void *), void *arg,
                                                   struct cf_error *err);

/* thread_random returns 64 random bits from a generator private to the calling thread, seeded
 * from the kernel's random source on first use (so replicas and threads never share a
 * sequence). Not for secrets: for retry jitter and sampling. */
uint64_t thread_random(void);

/* thread_jitter_ms returns a uniformly random duration in [0, max_ms). 0 when max_ms <= 0. */
int64_t thread_jitter_ms(int64_t max_ms);

/* Hand-offs through gRPC, for ThreadSanitizer (scripts/test --tsan).
 *
 * gRPC is not built with -fsanitize=thread, so the ordering its completion queue gives (a tag
 * passed to grpc_call_start_batch or grpc_server_request_*call on one thread comes back from
 * grpc_completion_queue_next on another, after everything the first thread wrote) is invisible
 * to TSan, which then reports every later access to the tagged object as a race. Name the
 * edge instead of suppressing the report, with the tag itself (the pointer gRPC carries):
 *
 *     thread_handoff_release(&c->t_send);         just before handing the tag to gRPC
 *     grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL);
 *     ...
 *     ev = grpc_completion_queue_next(cq, ...);   on the thread that receives it,
 *     thread_handoff_acquire(ev.tag);             before the first read through the tag
 *
 * They only order memory for TSan: they are no-ops, with no cost, in every other build, and
 * never replace a lock or an atomic for a hand-off that gRPC does not order. */
#if defined(__SANITIZE_THREAD__)
#define CF_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CF_TSAN 1
#endif
#endif

#ifdef CF_TSAN
#include <sanitizer/tsan_interface.h>
static inline void thread_handoff_release(void *obj)
{
    __tsan_release(obj);
}
static inline void thread_handoff_acquire(void *obj)
{
    __tsan_acquire(obj);
}
#else
static inline void thread_handoff_release(void *obj)
{
    (void)obj;
}
static inline void thread_handoff_acquire(void *obj)
{
    (void)obj;
}
#endif

#endif
