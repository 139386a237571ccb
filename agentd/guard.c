/* guard.c - the stream guard thread. */
#include "guard.h"

#include "clock.h"
#include "thread.h"

#include <time.h>

static void *watch(void *arg)
{
    struct stream_guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->over) {
        struct timespec ts;
        clock_deadline(&ts, 100);
        clock_cond_wait(&g->cv, &g->mu, &ts);
        if (!g->over && g->stop(g->ctx)) {
            rpc_stream_cancel(g->stream);
            break;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

enum cf_status guard_start(struct stream_guard *g, struct rpc_stream *stream,
                           bool (*stop)(void *ctx), void *ctx, struct cf_error *err)
{
    g->stream = stream;
    g->stop = stop;
    g->ctx = ctx;
    g->over = false;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    enum cf_status rc = thread_start(&g->thread, "stream-guard", 64 * 1024, watch, g, err);
    g->started = rc == CF_OK;
    if (rc != CF_OK) {
        rpc_stream_cancel(stream);
    }
    return rc;
}

void guard_end(struct stream_guard *g)
{
    pthread_mutex_lock(&g->mu);
    g->over = true;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (g->started) {
        pthread_join(g->thread, NULL);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}
