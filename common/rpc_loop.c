/* rpc_loop.c - the process's one gRPC event loop (see rpc_loop.h). */
#include "rpc_loop.h"

#include "clock.h"
#include "thread.h"

#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>

#define NO_TICK_MS 3600000 /* how long the loop waits at most without a tick */

static struct {
    pthread_mutex_t mu;   /* starts and stops */
    _Atomic bool running; /* read first without mu: every event-driven call asks */
    grpc_completion_queue *cq;
    pthread_t thread;
    int64_t (*tick)(void);
} loop = {.mu = PTHREAD_MUTEX_INITIALIZER};

void rpc_loop_set_tick(int64_t (*tick)(void))
{
    loop.tick = tick;
}

static gpr_timespec in_ms(int64_t ms)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void *loop_main(void *arg)
{
    grpc_completion_queue *cq = arg;
    int64_t next_tick = clock_mono_ms();
    for (;;) {
        int64_t now = clock_mono_ms();
        if (loop.tick && now >= next_tick) {
            int64_t every = loop.tick();
            next_tick = now + (every < 1 ? 1 : every);
        }
        int64_t wait = loop.tick ? next_tick - now : NO_TICK_MS;
        grpc_event ev = grpc_completion_queue_next(cq, in_ms(wait < 1 ? 1 : wait), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            return NULL;
        }
        if (ev.type == GRPC_OP_COMPLETE) {
            thread_handoff_acquire(ev.tag);
            struct rpc_loop_tag *t = ev.tag;
            t->on_event(t, ev.success != 0);
        }
    }
}

enum cf_status rpc_loop_start(struct cf_error *err)
{
    if (atomic_load_explicit(&loop.running, memory_order_acquire)) {
        return CF_OK;
    }
    enum cf_status st = CF_OK;
    pthread_mutex_lock(&loop.mu);
    if (!atomic_load_explicit(&loop.running, memory_order_relaxed)) {
        grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
        st = thread_start(&loop.thread, "rpc-loop", 0, loop_main, cq, err);
        if (st == CF_OK) {
            loop.cq = cq;
            atomic_store_explicit(&loop.running, true, memory_order_release);
        } else {
            grpc_completion_queue_shutdown(cq);
            grpc_completion_queue_destroy(cq);
        }
    }
    pthread_mutex_unlock(&loop.mu);
    return st;
}

grpc_completion_queue *rpc_loop_cq(void)
{
    return loop.cq;
}

void rpc_loop_stop(void)
{
    pthread_mutex_lock(&loop.mu);
    if (atomic_load_explicit(&loop.running, memory_order_relaxed)) {
        grpc_completion_queue_shutdown(loop.cq);
        pthread_join(loop.thread, NULL);
        grpc_completion_queue_destroy(loop.cq);
        loop.cq = NULL;
        atomic_store_explicit(&loop.running, false, memory_order_release);
    }
    pthread_mutex_unlock(&loop.mu);
}
