/* test_admit_gate.c - the claiming Admits in flight (agentd/admit_gate.c): a take-back waits
 * behind every Admit started before it, whatever order they end in, and not behind one started
 * after it; leaving says whether a take-back waits on the ticket; tickets left twice or never
 * handed out change nothing; many threads entering and leaving at once lose no ticket. */
#include "../check.h"

#include "admit_gate.h"

#include <pthread.h>

/* passed: a take-back behind ticket `behind` is due (the claimer's test, engine.c). */
static bool passed(struct admit_gate *g, uint64_t behind)
{
    return behind < admit_gate_oldest(g);
}

static void test_behind_the_earlier_ones(void)
{
    struct admit_gate g;
    admit_gate_init(&g);
    CHECK(admit_gate_oldest(&g) == UINT64_MAX);
    CHECK(passed(&g, 0)); /* no take-back waits on nothing */
    uint64_t a = admit_gate_enter(&g), b = admit_gate_enter(&g);
    CHECK(a > 0 && b > a && admit_gate_oldest(&g) == a);
    uint64_t behind = admit_gate_behind_now(&g); /* a take-back made now */
    CHECK(behind == b);
    uint64_t later = admit_gate_enter(&g); /* an Admit started after it */
    CHECK(!passed(&g, behind));
    CHECK(admit_gate_leave(&g, b)); /* the later of the two ends first: the take-back waits */
    CHECK(!passed(&g, behind) && admit_gate_oldest(&g) == a);
    CHECK(admit_gate_leave(&g, a));
    CHECK(passed(&g, behind)); /* not held up by the one started after */
    CHECK(!passed(&g, later) && admit_gate_oldest(&g) == later);
    CHECK(!admit_gate_leave(&g, later)); /* no take-back waits behind it: nobody to wake */
    CHECK(passed(&g, later) && admit_gate_oldest(&g) == UINT64_MAX);
    CHECK(g.n == 0);
    admit_gate_free(&g);
}

static void test_leaving_what_is_not_held(void)
{
    struct admit_gate g;
    admit_gate_init(&g);
    uint64_t a = admit_gate_enter(&g), b = admit_gate_enter(&g);
    CHECK(admit_gate_behind_now(&g) == b);
    CHECK(!admit_gate_leave(&g, 0)); /* an Admit without a claim */
    CHECK(admit_gate_leave(&g, a));
    CHECK(!admit_gate_leave(&g, a)); /* twice: b stays held, and nobody is woken again */
    CHECK(g.n == 1 && !passed(&g, b) && passed(&g, a));
    CHECK(admit_gate_leave(&g, b));
    CHECK(passed(&g, b));
    admit_gate_free(&g);
}

#define THREADS 4
#define ROUNDS 20000

static struct admit_gate shared;

static void *churn(void *arg)
{
    (void)arg;
    for (int i = 0; i < ROUNDS; i++) {
        uint64_t t = admit_gate_enter(&shared);
        if (i % 3 == 0) {
            uint64_t u = admit_gate_enter(&shared);
            admit_gate_leave(&shared, t);
            t = u;
        }
        admit_gate_leave(&shared, t);
    }
    return NULL;
}

static void test_threads(void)
{
    pthread_t th[THREADS];
    admit_gate_init(&shared);
    uint64_t held = admit_gate_enter(&shared); /* in flight throughout */
    for (int i = 0; i < THREADS; i++) {
        pthread_create(&th[i], NULL, churn, NULL);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
    }
    uint64_t expect = 1 + THREADS * (ROUNDS + (ROUNDS + 2) / 3);
    uint64_t behind = admit_gate_behind_now(&shared);
    CHECK(behind == expect); /* every ticket handed out once */
    CHECK(shared.n == 1 && admit_gate_oldest(&shared) == held);
    CHECK(!passed(&shared, behind));
    CHECK(admit_gate_leave(&shared, held));
    CHECK(passed(&shared, behind));
    admit_gate_free(&shared);
}

int main(void)
{
    test_behind_the_earlier_ones();
    test_leaving_what_is_not_held();
    test_threads();
    return check_done("test_admit_gate");
}
