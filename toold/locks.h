/* locks.h - per-path FIFO locks for write and edit.
 *
 * Each path has a ticket queue: a caller takes a ticket (in the order it dispatches calls),
 * then waits until its ticket is served. Calls on one path therefore run one at a time in
 * ticket order; calls on different paths do not wait for each other. A failed call releases
 * its turn like a successful one. Entries disappear when their queue drains.
 */
#ifndef CFLUE_TOOLD_LOCKS_H
#define CFLUE_TOOLD_LOCKS_H

#include <stdint.h>

struct lock_table;

/* locks_new returns an empty table; never NULL. */
struct lock_table *locks_new(void);

/* locks_free frees the table (NULL is fine); no lock may be held. */
void locks_free(struct lock_table *t);

/* locks_ticket reserves the next turn on key and returns it. */
uint64_t locks_ticket(struct lock_table *t, const char *key);

/* locks_wait blocks until the ticket's turn on key has come. */
void locks_wait(struct lock_table *t, const char *key, uint64_t ticket);

/* locks_release ends the turn of the ticket holder on key. */
void locks_release(struct lock_table *t, const char *key);

#endif
