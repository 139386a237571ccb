/* engine_queue.c - a binary min-heap of intrusive items (engine_queue.h). */
#include "engine_queue.h"
#include "mem.h"

#include <stdlib.h>

void engine_queue_init(struct engine_queue *q)
{
    q->heap = NULL;
    q->n = q->cap = 0;
}

void engine_queue_free(struct engine_queue *q)
{
    for (size_t i = 0; i < q->n; i++) {
        q->heap[i]->pos = 0;
    }
    free(q->heap);
    engine_queue_init(q);
}

static void place(struct engine_queue *q, size_t i, struct engine_queue_item *it)
{
    q->heap[i] = it;
    it->pos = i + 1;
}

/* sift_up moves the item at i towards the root while its parent's key is larger. */
static void sift_up(struct engine_queue *q, size_t i)
{
    struct engine_queue_item *it = q->heap[i];
    while (i > 0 && q->heap[(i - 1) / 2]->key > it->key) {
        place(q, i, q->heap[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    place(q, i, it);
}

/* sift_down moves the item at i towards the leaves while a child's key is smaller. */
static void sift_down(struct engine_queue *q, size_t i)
{
    struct engine_queue_item *it = q->heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= q->n) {
            break;
        }
        if (c + 1 < q->n && q->heap[c + 1]->key < q->heap[c]->key) {
            c++;
        }
        if (q->heap[c]->key >= it->key) {
            break;
        }
        place(q, i, q->heap[c]);
        i = c;
    }
    place(q, i, it);
}

bool engine_queue_push(struct engine_queue *q, struct engine_queue_item *it)
{
    if (it->pos) {
        return false;
    }
    if (q->n == q->cap) {
        q->cap = q->cap ? q->cap * 2 : 64;
        q->heap = mem_realloc(q->heap, sizeof(*q->heap) * q->cap);
    }
    place(q, q->n++, it);
    sift_up(q, q->n - 1);
    return true;
}

bool engine_queue_push_earliest(struct engine_queue *q, struct engine_queue_item *it, int64_t key)
{
    if (it->pos && it->key <= key) {
        return false;
    }
    engine_queue_remove(q, it);
    it->key = key;
    return engine_queue_push(q, it);
}

struct engine_queue_item *engine_queue_peek(const struct engine_queue *q)
{
    return q->n ? q->heap[0] : NULL;
}

void engine_queue_remove(struct engine_queue *q, struct engine_queue_item *it)
{
    if (!it->pos) {
        return;
    }
    size_t i = it->pos - 1;
    it->pos = 0;
    struct engine_queue_item *last = q->heap[--q->n];
    if (i == q->n) {
        return;
    }
    place(q, i, last);
    if (i > 0 && q->heap[(i - 1) / 2]->key > last->key) {
        sift_up(q, i);
    } else {
        sift_down(q, i);
    }
}

struct engine_queue_item *engine_queue_pop(struct engine_queue *q)
{
    struct engine_queue_item *it = engine_queue_peek(q);
    if (it) {
        engine_queue_remove(q, it);
    }
    return it;
}

bool engine_queue_queued(const struct engine_queue_item *it)
{
    return it->pos != 0;
}
