/* ready.c - the readiness probe (ready.h). */
#include "ready.h"

#include "clock.h"
#include "log.h"
#include "mem.h"
#include "thread.h"

#include <pthread.h>
#include <stdlib.h>

struct ready_probe {
    struct rpc_server *srv;
    const char *what;
    ready_check_fn check;
    void *arg;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
};

static void *probe_main(void *arg)
{
    struct ready_probe *p = arg;
    bool ready = true; /* as a new server is */
    for (;;) {
        char why[512] = "";
        bool ok = p->check(p->arg, why, sizeof(why));
        if (ok != ready) {
            rpc_server_set_ready(p->srv, ok);
            if (ok) {
                log_info("ready", "need=%s", p->what);
            } else {
                char q[sizeof(why) + 8];
                log_warn("not_ready", "need=%s why=%s", p->what, log_quote(q, sizeof(q), why));
            }
            ready = ok;
        }
        struct timespec ts;
        clock_deadline(&ts, READY_EVERY_MS);
        pthread_mutex_lock(&p->mu);
        if (!p->stop) {
            clock_cond_wait(&p->cv, &p->mu, &ts);
        }
        bool stop = p->stop;
        pthread_mutex_unlock(&p->mu);
        if (stop) {
            return NULL;
        }
    }
}

struct ready_probe *ready_start(struct rpc_server *srv, const char *what, ready_check_fn check,
                                void *arg, struct cf_error *err)
{
    struct ready_probe *p = mem_alloc(sizeof(*p));
    p->srv = srv;
    p->what = what;
    p->check = check;
    p->arg = arg;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (thread_start(&p->thread, "ready-probe", 0, probe_main, p, err) != CF_OK) {
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        return NULL;
    }
    return p;
}

void ready_stop(struct ready_probe *p)
{
    if (!p) {
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
