/* guard.h - cancel a blocking upstream stream when a condition turns true.
 *
 * Reading a storaged or toold stream blocks until the other side sends something. A guard
 * thread checks a condition ten times a second (the caller went away, an abort, a lost lease)
 * and cancels the stream, so the reader returns at once. */
#ifndef CFLUE_AGENTD_GUARD_H
#define CFLUE_AGENTD_GUARD_H

#include "rpc.h"
#include "status.h"

#include <pthread.h>
#include <stdbool.h>

struct stream_guard {
    struct rpc_stream *stream;
    bool (*stop)(void *ctx);
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool over;
    bool started;
    pthread_t thread;
};

/* guard_start watches stream until guard_end; stop(ctx) true cancels the stream. When the
 * watching thread cannot start, the stream is cancelled at once (so a reader never blocks
 * unguarded) and CF_BUSY is returned with the reason in err; guard_end is still called. */
CF_MUST_CHECK enum cf_status guard_start(struct stream_guard *g, struct rpc_stream *stream,
                                         bool (*stop)(void *ctx), void *ctx, struct cf_error *err);

/* guard_end stops watching and joins the thread; the stream stays the caller's. */
void guard_end(struct stream_guard *g);

#endif
