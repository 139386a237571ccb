/* admit_gate.c - the Admits that claim for this process, while their answers are on the way.
 * A small set of tickets under a lock: an Admit in flight enters it and leaves it once; the
 * claimer asks, for each take-back due, whether the Admits it waits behind have all left. The
 * set holds as many tickets as claiming Admits are in flight (the API's Submits are capped,
 * the drives' Admits bounded by their tool calls), and a scan of it is cheap next to a call. */
#include "admit_gate.h"
#include "mem.h"

#include <assert.h>
#include <stdlib.h>

void admit_gate_init(struct admit_gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    g->last = 0;
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

void admit_gate_leave(struct admit_gate *g, uint64_t ticket)
{
    if (!ticket) {
        return;
    }
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n; i++) {
        if (g->open[i] == ticket) {
            g->open[i] = g->open[--g->n];
            break;
        }
    }
    assert(ticket <= g->last);
    pthread_mutex_unlock(&g->mu);
}

uint64_t admit_gate_last(struct admit_gate *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t last = g->last;
    pthread_mutex_unlock(&g->mu);
    return last;
}

bool admit_gate_passed(struct admit_gate *g, uint64_t behind)
{
    bool passed = true;
    if (!behind) {
        return true;
    }
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n && passed; i++) {
        passed = g->open[i] > behind;
    }
    pthread_mutex_unlock(&g->mu);
    return passed;
}
