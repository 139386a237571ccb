/* locks.c - ticket locks keyed by path. */
#include "locks.h"

#include "mem.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct entry {
    char *key;
    uint64_t next_ticket, serving;
    struct entry *next;
};

struct lock_table {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct entry *head;
};

struct lock_table *locks_new(void)
{
    struct lock_table *t = mem_alloc(sizeof(*t));
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    return t;
}

void locks_free(struct lock_table *t)
{
    if (!t) {
        return;
    }
    while (t->head) {
        struct entry *e = t->head;
        t->head = e->next;
        free(e->key);
        free(e);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

static struct entry *find(struct lock_table *t, const char *key)
{
    for (struct entry *e = t->head; e; e = e->next) {
        if (!strcmp(e->key, key)) {
            return e;
        }
    }
    return NULL;
}

uint64_t locks_ticket(struct lock_table *t, const char *key)
{
    pthread_mutex_lock(&t->mu);
    struct entry *e = find(t, key);
    if (!e) {
        e = mem_alloc(sizeof(*e));
        e->key = mem_strdup(key);
        e->next = t->head;
        t->head = e;
    }
    uint64_t ticket = e->next_ticket++;
    pthread_mutex_unlock(&t->mu);
    return ticket;
}

void locks_wait(struct lock_table *t, const char *key, uint64_t ticket)
{
    pthread_mutex_lock(&t->mu);
    struct entry *e;
    while ((e = find(t, key)) && e->serving != ticket) {
        pthread_cond_wait(&t->cv, &t->mu);
    }
    pthread_mutex_unlock(&t->mu);
}

void locks_release(struct lock_table *t, const char *key)
{
    pthread_mutex_lock(&t->mu);
    struct entry **pp = &t->head;
    while (*pp && strcmp((*pp)->key, key) != 0) {
        pp = &(*pp)->next;
    }
    struct entry *e = *pp;
    if (e) {
        e->serving++;
        if (e->serving == e->next_ticket) {
            *pp = e->next;
            free(e->key);
            free(e);
        }
    }
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}
