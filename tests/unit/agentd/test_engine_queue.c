/* test_engine_queue.c - the engine's priority queue (agentd/engine_queue.c): the ready drives
 * come out oldest first and timers earliest first, whatever order they went in; an item is
 * queued once; one taken out of the middle leaves the rest in order; a timer set again keeps
 * the earliest time asked of it. */
#include "../check.h"

#include "engine_queue.h"

#include <stdint.h>
#include <stdlib.h>

#define N 1000

/* pops everything and checks the keys come out in order; returns how many came out */
static size_t drain_sorted(struct engine_queue *q)
{
    size_t n = 0;
    int64_t last = INT64_MIN;
    struct engine_queue_item *it;
    bool ordered = true;
    while ((it = engine_queue_pop(q))) {
        ordered = ordered && it->key >= last && !engine_queue_queued(it);
        last = it->key;
        n++;
    }
    CHECK(ordered);
    return n;
}

static void test_order(void)
{
    static struct engine_queue_item items[N];
    struct engine_queue q;
    engine_queue_init(&q);
    CHECK(engine_queue_pop(&q) == NULL);
    CHECK(engine_queue_peek(&q) == NULL);
    srand(7);
    for (int i = 0; i < N; i++) {
        items[i].key = rand() % 500; /* duplicates too */
        CHECK(engine_queue_push(&q, &items[i]));
    }
    CHECK(q.n == N);
    CHECK(drain_sorted(&q) == N);
    engine_queue_free(&q);
}

static void test_push_once(void)
{
    struct engine_queue_item a = {.key = 5}, b = {.key = 3};
    struct engine_queue q;
    engine_queue_init(&q);
    CHECK(engine_queue_push(&q, &a));
    CHECK(!engine_queue_push(&q, &a)); /* posted twice: queued once */
    CHECK(engine_queue_push(&q, &b));
    CHECK(q.n == 2);
    CHECK(engine_queue_peek(&q) == &b);
    CHECK(engine_queue_pop(&q) == &b);
    CHECK(engine_queue_pop(&q) == &a);
    CHECK(engine_queue_pop(&q) == NULL);
    CHECK(engine_queue_push(&q, &a)); /* popped: may be queued again */
    engine_queue_free(&q);
    CHECK(!engine_queue_queued(&a)); /* freeing the queue unlinks what was in it */
}

static void test_remove(void)
{
    static struct engine_queue_item items[N];
    struct engine_queue q;
    engine_queue_init(&q);
    for (int i = 0; i < N; i++) {
        items[i].key = (int64_t)((i * 7919) % N);
        engine_queue_push(&q, &items[i]);
    }
    /* a drive that ends with a timer still set: taken out wherever it is */
    for (int i = 0; i < N; i += 3) {
        engine_queue_remove(&q, &items[i]);
        CHECK(!engine_queue_queued(&items[i]));
    }
    engine_queue_remove(&q, &items[0]); /* not queued: a no-op */
    size_t left = (size_t)(N - (N + 2) / 3);
    CHECK(q.n == left);
    CHECK(drain_sorted(&q) == left);
    engine_queue_free(&q);
}

/* A drive's one timer, asked for by two waiters (a model backoff and a Store retry): whichever
 * asks first, it fires at the earlier time, and asking again after it moved it earlier keeps
 * that. Replacing the time instead left one waiter to the other's later time (or none). */
static void test_push_earliest(void)
{
    struct engine_queue_item other = {.key = 150}, timer = {.key = 0};
    struct engine_queue q;
    engine_queue_init(&q);
    CHECK(engine_queue_push(&q, &other));
    CHECK(engine_queue_push_earliest(&q, &timer, 200)); /* not queued: queued at 200 */
    CHECK(timer.key == 200 && engine_queue_peek(&q) == &other);
    CHECK(!engine_queue_push_earliest(&q, &timer, 300)); /* later: the earlier time stays */
    CHECK(!engine_queue_push_earliest(&q, &timer, 200)); /* the same: nothing moves */
    CHECK(timer.key == 200);
    CHECK(engine_queue_push_earliest(&q, &timer, 100)); /* earlier: moved, ahead of other */
    CHECK(timer.key == 100 && q.n == 2 && engine_queue_peek(&q) == &timer);
    CHECK(engine_queue_pop(&q) == &timer);
    CHECK(engine_queue_push_earliest(&q, &timer, 400)); /* fired: any time may be set again */
    CHECK(engine_queue_pop(&q) == &other && engine_queue_pop(&q) == &timer);
    engine_queue_free(&q);
}

int main(void)
{
    test_order();
    test_push_once();
    test_remove();
    test_push_earliest();
    return check_done("test_engine_queue");
}
