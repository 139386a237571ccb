/* engine_queue.h - a priority queue of intrusive items (a binary min-heap on a key), for the
 * engine's ready drives (key: admission order, oldest first) and timers (key: due time).
 *
 * An item lives inside its owner (struct drive); it is in at most one queue at a time, and a
 * queue never owns or frees it. Not thread-safe: the engine holds its lock around every call.
 */
#ifndef CFLUE_AGENTD_ENGINE_QUEUE_H
#define CFLUE_AGENTD_ENGINE_QUEUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct engine_queue_item {
    int64_t key;
    size_t pos; /* its index in the heap, plus one; 0: not queued */
};

struct engine_queue {
    struct engine_queue_item **heap;
    size_t n, cap;
};

/* engine_queue_init makes q empty; engine_queue_free releases its array (not the items). */
void engine_queue_init(struct engine_queue *q);
void engine_queue_free(struct engine_queue *q);

/* engine_queue_push adds it with its key; false (nothing changed) when it is queued already. */
bool engine_queue_push(struct engine_queue *q, struct engine_queue_item *it);

/* engine_queue_push_earliest queues it at key, or keeps it where it is when it is queued at
 * key or earlier (a drive's one timer keeps the earliest time asked of it). Returns whether
 * it was queued or moved. */
bool engine_queue_push_earliest(struct engine_queue *q, struct engine_queue_item *it, int64_t key);

/* engine_queue_peek: the item with the smallest key, or NULL when q is empty. */
struct engine_queue_item *engine_queue_peek(const struct engine_queue *q);

/* engine_queue_pop removes and returns the item with the smallest key (NULL: empty). Among
 * equal keys the order is unspecified. */
struct engine_queue_item *engine_queue_pop(struct engine_queue *q);

/* engine_queue_remove takes it out of q, wherever it is; a no-op when it is not queued. */
void engine_queue_remove(struct engine_queue *q, struct engine_queue_item *it);

/* engine_queue_queued: it is in a queue. */
bool engine_queue_queued(const struct engine_queue_item *it);

#endif
