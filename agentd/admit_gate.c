/* admit_gate.c - the Admits that claim for this process, while their answers are on the way.
 * A small set of tickets under a lock: an Admit in flight enters it and leaves it once; the
 * claimer asks for the oldest still in flight once per look at its resume list: a take-back is
 * due when the ticket it waits behind is older. The set holds as many tickets as claiming
 * Admits are in flight (the API's Submits are capped, the drives' Admits bounded by their tool
 * calls), and a scan of it is cheap next to a call. */
#include "admit_gate.h"
#include "mem.h"

#include <assert.h>
#include <stdlib.h>

void admit_gate_init(struct admit_gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    g->last = g->watched = 0;
    g->open = NULL;
    g->n = g->cap = 0;
}

void admit_gate_free(struct admit_gate *g)
{
    free(g->open);
    g->open = NULL;
    g->n = g->cap = 0;
    pthread_mutex_destroy(&g->mu);
}

uint64_t admit_gate_enter(struct admit_gate *g)
{
    pthread_mutex_lock(&g->mu);
    if (g->n == g->cap) {
        g->cap = g->cap ? g->cap * 2 : 16;
        g->open = mem_realloc(g->open, sizeof(*g->open) * g->cap);
    }
    uint64_t ticket = ++g->last;
    g->open[g->n++] = ticket;
    pthread_mutex_unlock(&g->mu);
    return ticket;
}

bool admit_gate_leave(struct admit_gate *g, uint64_t ticket)
{
    bool held = false;
    if (!ticket) {
        return false;
    }
    pthread_mutex_lock(&g->mu);
    assert(ticket <= g->last);
    for (size_t i = 0; i < g->n && !held; i++) {
        if (g->open[i] == ticket) {
            g->open[i] = g->open[--g->n];
            held = true;
        }
    }
    bool waited_on = held && ticket <= g->watched;
    pthread_mutex_unlock(&g->mu);
    return waited_on;
}

uint64_t admit_gate_behind_now(struct admit_gate *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t last = g->last;
    g->watched = last;
    pthread_mutex_unlock(&g->mu);
    return last;
}

uint64_t admit_gate_oldest(struct admit_gate *g)
{
    uint64_t oldest = UINT64_MAX;
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n; i++) {
        oldest = g->open[i] < oldest ? g->open[i] : oldest;
    }
    pthread_mutex_unlock(&g->mu);
    return oldest;
}
