/* follow_hub.h - who follows which conversation: the commit notifier of Follow streams.
 *
 * A Follow stream registers a waiter for its conversation; after a write commits records, the
 * service wakes the waiters of the conversations it appended to (follow_hub_wake), or all of
 * them when it cannot tell (follow_hub_wake_all). Waking calls each waiter's wake callback
 * under the hub's lock: the callback must not block and must not call back into the hub (it
 * schedules a read on the worker pool). After follow_hub_remove returns, the waiter's
 * callback is not running and will not run again. */
#ifndef CFLUE_STORAGED_FOLLOW_HUB_H
#define CFLUE_STORAGED_FOLLOW_HUB_H

#include <stdbool.h>

struct follow_hub;

struct follow_waiter {
    const char *conversation_id; /* owned by the waiter's owner; fixed while registered */
    void (*wake)(struct follow_waiter *w);
    struct follow_waiter *prev, *next; /* the hub's bucket */
    unsigned bucket;
    bool linked;
};

/* follow_hub_new creates an empty hub. Never NULL. */
struct follow_hub *follow_hub_new(void);

/* follow_hub_free frees the hub (NULL is fine); no waiter may be registered. */
void follow_hub_free(struct follow_hub *h);

/* follow_hub_add registers w (conversation_id and wake set) until follow_hub_remove. */
void follow_hub_add(struct follow_hub *h, struct follow_waiter *w);

/* follow_hub_remove unregisters w; idempotent. */
void follow_hub_remove(struct follow_hub *h, struct follow_waiter *w);

/* follow_hub_wake wakes every waiter of conversation_id. Cost: the waiters of its bucket. */
void follow_hub_wake(struct follow_hub *h, const char *conversation_id);

/* follow_hub_wake_all wakes every waiter (for writes whose conversations are unknown). */
void follow_hub_wake_all(struct follow_hub *h);

/* follow_hub_count returns how many waiters are registered. */
int follow_hub_count(struct follow_hub *h);

#endif
