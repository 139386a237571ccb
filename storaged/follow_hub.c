/* follow_hub.c - conversation-keyed waiters of Follow streams (see follow_hub.h).
 *
 * A fixed table of buckets, each a doubly linked list of waiters hashed by conversation id
 * (FNV-1a), under one mutex: a wake walks one bucket, so a commit costs the followers of its
 * conversation (and of the few conversations sharing the bucket), not every follower. */
#include "follow_hub.h"

#include "mem.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BUCKETS 4096

struct follow_hub {
    pthread_mutex_t mu;
    struct follow_waiter *buckets[BUCKETS];
    int count;
};

static unsigned hash(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++) {
        h = (h ^ (unsigned char)*s) * 16777619u;
    }
    return h % BUCKETS;
}

struct follow_hub *follow_hub_new(void)
{
    struct follow_hub *h = mem_alloc(sizeof(*h));
    pthread_mutex_init(&h->mu, NULL);
    return h;
}

void follow_hub_free(struct follow_hub *h)
{
    if (!h) {
        return;
    }
    pthread_mutex_destroy(&h->mu);
    free(h);
}

void follow_hub_add(struct follow_hub *h, struct follow_waiter *w)
{
    w->bucket = hash(w->conversation_id);
    pthread_mutex_lock(&h->mu);
    w->prev = NULL;
    w->next = h->buckets[w->bucket];
    if (w->next) {
        w->next->prev = w;
    }
    h->buckets[w->bucket] = w;
    w->linked = true;
    h->count++;
    pthread_mutex_unlock(&h->mu);
}

void follow_hub_remove(struct follow_hub *h, struct follow_waiter *w)
{
    pthread_mutex_lock(&h->mu);
    if (w->linked) {
        if (w->prev) {
            w->prev->next = w->next;
        } else {
            h->buckets[w->bucket] = w->next;
        }
        if (w->next) {
            w->next->prev = w->prev;
        }
        w->linked = false;
        h->count--;
    }
    pthread_mutex_unlock(&h->mu);
}

void follow_hub_wake(struct follow_hub *h, const char *conversation_id)
{
    unsigned b = hash(conversation_id);
    pthread_mutex_lock(&h->mu);
    for (struct follow_waiter *w = h->buckets[b]; w; w = w->next) {
        if (!strcmp(w->conversation_id, conversation_id)) {
            w->wake(w);
        }
    }
    pthread_mutex_unlock(&h->mu);
}

void follow_hub_wake_all(struct follow_hub *h)
{
    pthread_mutex_lock(&h->mu);
    for (unsigned b = 0; b < BUCKETS; b++) {
        for (struct follow_waiter *w = h->buckets[b]; w; w = w->next) {
            w->wake(w);
        }
    }
    pthread_mutex_unlock(&h->mu);
}

int follow_hub_count(struct follow_hub *h)
{
    pthread_mutex_lock(&h->mu);
    int n = h->count;
    pthread_mutex_unlock(&h->mu);
    return n;
}
