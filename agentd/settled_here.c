/* settled_here.c - GetSubmission(wait) answered without storaged.
 *
 * Method: a submission this process drives, or settled a moment ago, needs no storaged call to
 * wait on: the drive learns its final state from the Settle it makes itself. One map, keyed by
 * submission id, holds an entry per submission that is
 * - driven here now (drives > 0; here_begin / here_end around each drive), with the waiters
 *   parked on it (no thread each: a waiter is a callback), and/or
 * - remembered: settled here recently, its Submission packed exactly as Settle returned it
 *   (what Store.Get returns from then on: a settled submission never changes). At most
 *   RING_MAX of them and RING_BYTES in all, the oldest forgotten first, and none for longer
 *   than here_forget_older says (agentd: 10 to 20 s, so an idle agentd soon returns to its
 *   idle size); one bigger than ENTRY_BYTES_MAX is not remembered (its waiters are still
 *   answered).
 * A wait first looks for a remembered submission (answered at once), then for a drive here
 * (parked), else it takes the storaged path (watch.c). Both checks and the registration are
 * made under one lock, and here_settled remembers and takes the waiters under that same lock,
 * so a settlement cannot fall between a check and a registration. A drive that ends without
 * settling (lease lost, shutdown, interrupted) hands its waiters to the storaged path: a waiter
 * is always answered, by done, exactly once, or cancelled (here_cancel) by its owner.
 *
 * One mutex (mu); no blocking call and no callback under it (done runs after it is released).
 * It is taken under no other lock of agentd's, and takes none.
 */
#include "settled_here.h"

#include "clock.h"
#include "log.h"
#include "mem.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ID_MAX 64
#define BUCKETS 4096
#define RING_MAX 1024
#define RING_BYTES (8 << 20)
#define ENTRY_BYTES_MAX (256 << 10)

struct here_entry {
    char id[ID_MAX];
    int drives;                  /* drives of it running here */
    struct here_waiter *waiters; /* parked on those drives */
    uint8_t *packed;             /* remembered: the settled Submission, or NULL */
    size_t packed_len;
    int64_t remembered_ms; /* monotonic: when it was */
    struct here_entry *next_in_bucket;
};

static struct {
    pthread_mutex_t mu;
    struct here_entry *buckets[BUCKETS];
    struct here_entry *ring[RING_MAX]; /* remembered entries, oldest at head */
    int ring_head, ring_n;
    size_t ring_bytes;
    int n_waiters;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static unsigned hash(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++) {
        h = (h ^ (unsigned char)*s) * 16777619u;
    }
    return h % BUCKETS;
}

static struct here_entry *find_locked(const char *id)
{
    for (struct here_entry *e = g.buckets[hash(id)]; e; e = e->next_in_bucket) {
        if (!strcmp(e->id, id)) {
            return e;
        }
    }
    return NULL;
}

/* get_locked returns id's entry, adding an empty one; NULL when id is too long to keep. */
static struct here_entry *get_locked(const char *id)
{
    struct here_entry *e = find_locked(id);
    if (e || strlen(id) >= ID_MAX) {
        return e;
    }
    unsigned b = hash(id);
    e = mem_alloc(sizeof(*e));
    strcpy(e->id, id);
    e->next_in_bucket = g.buckets[b];
    g.buckets[b] = e;
    return e;
}

/* drop_if_unused_locked frees e when nothing holds it any more. */
static void drop_if_unused_locked(struct here_entry *e)
{
    if (e->drives > 0 || e->waiters || e->packed) {
        return;
    }
    struct here_entry **pp = &g.buckets[hash(e->id)];
    while (*pp != e) {
        pp = &(*pp)->next_in_bucket;
    }
    *pp = e->next_in_bucket;
    free(e);
}

/* forget_oldest_locked drops the oldest remembered submission. */
static void forget_oldest_locked(void)
{
    struct here_entry *e = g.ring[g.ring_head];
    g.ring_head = (g.ring_head + 1) % RING_MAX;
    g.ring_n--;
    g.ring_bytes -= e->packed_len;
    free(e->packed);
    e->packed = NULL;
    e->packed_len = 0;
    drop_if_unused_locked(e);
}

/* remember_locked keeps a copy of packed as e's settled submission. */
static void remember_locked(struct here_entry *e, const uint8_t *packed, size_t len)
{
    if (e->packed || len > ENTRY_BYTES_MAX) {
        return; /* a repeated Settle answers what is remembered already */
    }
    while (g.ring_n > 0 && (g.ring_n == RING_MAX || g.ring_bytes + len > RING_BYTES)) {
        forget_oldest_locked();
    }
    e->packed = mem_alloc(len ? len : 1);
    memcpy(e->packed, packed, len);
    e->packed_len = len;
    e->remembered_ms = clock_mono_ms();
    g.ring[(g.ring_head + g.ring_n) % RING_MAX] = e;
    g.ring_n++;
    g.ring_bytes += len;
}

/* take_waiters_locked unregisters e's waiters and returns them as a list. */
static struct here_waiter *take_waiters_locked(struct here_entry *e)
{
    struct here_waiter *list = e->waiters;
    e->waiters = NULL;
    for (struct here_waiter *w = list; w; w = w->next) {
        w->entry = NULL;
        g.n_waiters--;
    }
    return list;
}

static Cflue__V1__Submission *unpack(const uint8_t *packed, size_t len)
{
    return (Cflue__V1__Submission *)protobuf_c_message_unpack(&cflue__v1__submission__descriptor,
                                                              NULL, len, packed);
}

/* answer calls done for every waiter of list: with its own copy of packed, or NULL. */
static void answer(struct here_waiter *list, const uint8_t *packed, size_t len)
{
    while (list) {
        struct here_waiter *w = list;
        list = w->next;
        w->next = NULL;
        w->done(w, packed ? unpack(packed, len) : NULL);
    }
}

enum here_answer here_wait(struct here_waiter *hw, here_done_fn done, const char *submission_id,
                           Cflue__V1__Submission **out)
{
    uint8_t *copy = NULL;
    size_t len = 0;
    enum here_answer a = HERE_ELSEWHERE;
    *out = NULL;
    pthread_mutex_lock(&g.mu);
    struct here_entry *e = find_locked(submission_id);
    if (e && e->packed) {
        len = e->packed_len;
        copy = mem_alloc(len ? len : 1);
        memcpy(copy, e->packed, len);
        a = HERE_SETTLED;
    } else if (e && e->drives > 0) {
        hw->done = done;
        hw->entry = e;
        hw->next = e->waiters;
        e->waiters = hw;
        g.n_waiters++;
        a = HERE_PARKED;
    }
    pthread_mutex_unlock(&g.mu);
    if (copy) {
        *out = unpack(copy, len);
        free(copy);
        if (!*out) { /* cannot happen: we packed it */
            log_warn("here.unpack_failed", "submission=%s", submission_id);
            a = HERE_ELSEWHERE;
        }
    }
    log_debug("here.wait", "submission=%s answer=%s", submission_id,
              a == HERE_SETTLED  ? "settled"
              : a == HERE_PARKED ? "parked"
                                 : "elsewhere");
    return a;
}

bool here_cancel(struct here_waiter *hw)
{
    bool was = false;
    pthread_mutex_lock(&g.mu);
    struct here_entry *e = hw->entry;
    if (e) {
        struct here_waiter **pp = &e->waiters;
        while (*pp != hw) {
            pp = &(*pp)->next;
        }
        *pp = hw->next;
        hw->next = NULL;
        hw->entry = NULL;
        g.n_waiters--;
        was = true;
        drop_if_unused_locked(e);
    }
    pthread_mutex_unlock(&g.mu);
    return was;
}

void here_begin(const char *submission_id)
{
    pthread_mutex_lock(&g.mu);
    struct here_entry *e = get_locked(submission_id);
    if (e) {
        e->drives++;
    }
    pthread_mutex_unlock(&g.mu);
}

void here_end(const char *submission_id)
{
    struct here_waiter *list = NULL;
    int n = 0;
    pthread_mutex_lock(&g.mu);
    struct here_entry *e = find_locked(submission_id);
    if (e && e->drives > 0 && --e->drives == 0) {
        list = take_waiters_locked(e);
        for (struct here_waiter *w = list; w; w = w->next) {
            n++;
        }
        drop_if_unused_locked(e);
    }
    pthread_mutex_unlock(&g.mu);
    if (n) {
        log_info("here.unsettled", "submission=%s waiters=%d next=storaged", submission_id, n);
    }
    answer(list, NULL, 0);
}

void here_settled(const Cflue__V1__Submission *sub, char *const *settled_with,
                  size_t n_settled_with)
{
    bool settled = sub->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED;
    size_t len = settled ? protobuf_c_message_get_packed_size(&sub->base) : 0;
    uint8_t *packed = settled ? mem_alloc(len ? len : 1) : NULL;
    if (settled) {
        protobuf_c_message_pack(&sub->base, packed);
    }
    struct here_waiter *list = NULL, *joined = NULL;
    pthread_mutex_lock(&g.mu);
    struct here_entry *e = settled ? get_locked(sub->submission_id) : NULL;
    if (e) {
        remember_locked(e, packed, len);
        list = take_waiters_locked(e);
        drop_if_unused_locked(e);
    }
    for (size_t i = 0; i < n_settled_with; i++) {
        struct here_entry *j = find_locked(settled_with[i]);
        if (j) {
            struct here_waiter *t = take_waiters_locked(j);
            while (t) {
                struct here_waiter *w = t;
                t = w->next;
                w->next = joined;
                joined = w;
            }
            drop_if_unused_locked(j);
        }
    }
    pthread_mutex_unlock(&g.mu);
    if (!settled) {
        log_warn("here.not_settled", "submission=%s status=%d", sub->submission_id,
                 (int)sub->status);
    }
    answer(list, packed, len);
    answer(joined, NULL, 0);
    free(packed);
}

void here_forget_older(int64_t now_ms, int64_t age_ms)
{
    pthread_mutex_lock(&g.mu);
    while (g.ring_n > 0 && now_ms - g.ring[g.ring_head]->remembered_ms > age_ms) {
        forget_oldest_locked();
    }
    pthread_mutex_unlock(&g.mu);
}

void here_counts(int *remembered_out, int *waiters_out)
{
    pthread_mutex_lock(&g.mu);
    *remembered_out = g.ring_n;
    *waiters_out = g.n_waiters;
    pthread_mutex_unlock(&g.mu);
}
