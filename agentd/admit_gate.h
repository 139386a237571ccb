/* admit_gate.h - the Admits that claim for this process, while their answers are on the way.
 *
 * An Admit made with a claim (AdmitRequest.claim) commits the claim with the admission; its
 * drive starts here only when the answer arrives. Until then storaged holds the submission
 * RUNNING under this owner and no drive here knows it. A take-back (engine.c: after a Claim or
 * an Admit that got no answer, or a retried Submit's deduplicated Admit) looks for exactly
 * such submissions, and one made while the answer is still on the way would take the work
 * over from the drive about to start: an extra attempt, and the first drive stopped at its
 * first write. So each claiming Admit holds a ticket from its start to its end, and a
 * take-back waits until every Admit started before it has ended (admit_gate_oldest).
 *
 * Thread-safe: the API's and the drives' Admits enter and leave it from any thread.
 */
#ifndef CFLUE_AGENTD_ADMIT_GATE_H
#define CFLUE_AGENTD_ADMIT_GATE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct admit_gate {
    pthread_mutex_t mu;
    uint64_t last;    /* the newest ticket handed out (0: none yet) */
    uint64_t watched; /* the newest ticket a take-back waits behind (0: none) */
    uint64_t *open;   /* the tickets of the Admits in flight, in no order */
    size_t n, cap;
};

/* admit_gate_init makes g empty; admit_gate_free releases what it holds. */
void admit_gate_init(struct admit_gate *g);
void admit_gate_free(struct admit_gate *g);

/* admit_gate_enter hands out a ticket (> 0, one more than the last) for a claiming Admit about
 * to start; the Admit holds it until admit_gate_leave. */
uint64_t admit_gate_enter(struct admit_gate *g);

/* admit_gate_leave ends ticket's hold (its Admit ended: answered, failed or abandoned). A
 * ticket of 0, or one not held, changes nothing. Returns whether a take-back waits behind it
 * (the caller wakes whoever takes them). */
bool admit_gate_leave(struct admit_gate *g, uint64_t ticket);

/* admit_gate_behind_now: the ticket a take-back made now waits behind, the newest handed out
 * so far (0: none; admit_gate_leave of it and of every older one says so). */
uint64_t admit_gate_behind_now(struct admit_gate *g);

/* admit_gate_oldest: the oldest ticket in flight (UINT64_MAX: none). A take-back behind
 * ticket b is due once b < admit_gate_oldest. */
uint64_t admit_gate_oldest(struct admit_gate *g);

#endif
