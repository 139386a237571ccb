/* watch.c - Watch(follow) and GetSubmission(wait) without a thread per caller.
 *
 * Method: a "feed" per watched conversation holds one storaged Follow, an event-driven client
 * stream (rpc_astream), and a ring of the records it delivered most recently (at most
 * RING_RECORDS and RING_BYTES; offsets in a conversation are consecutive, so the ring is
 * indexed by offset). Each caller is a "watcher" attached to the feed of its conversation, with
 * its own offset (the last record it was given) and its own backpressure:
 * - a record arriving on the feed is pushed (never blocking) to every watcher whose offset is
 *   right before it, encoded once for all of them (kept in the ring beside the record:
 *   rpc_call_push_packed);
 * - a watcher whose send queue is full is paused and resumes from rpc's drained callback;
 * - a watcher behind the ring (it started before the feed, or fell behind while paused)
 *   catches up with storaged Read pages on the server's worker pool, then continues from the
 *   ring: the ring is only a cache, storaged is the truth.
 * The feed's Follow starts after the offset of the watcher that created it; a feed whose last
 * watcher leaves is closed (its Follow cancelled). When storaged ends a feed's Follow (it
 * restarts, or fails), every watcher ends with storaged's status, as a direct Follow would,
 * and callers resume from the last offset they received.
 *
 * GetSubmission(wait) first asks settled_here.c: a submission this process settled a moment
 * ago is answered at once, and a wait on one it drives now is parked there (no storaged call)
 * until the drive settles it, or ends without settling it and hands the wait back here. Else,
 * GetSubmission(wait) is a watcher that is given no records: it scans them for the
 * submission's "settled:<id>" record, then reads the submission and replies. It attaches at
 * the conversation's head read before its last check that the submission was not settled, so
 * the settlement record cannot fall before it. If storaged ends the feed or goes away, it
 * checks again and re-attaches (or fails while storaged is away); a feed storaged refused, or
 * one lost again within WAIT_RELOOK_MS with no record between, fails it with storaged's error.
 *
 * One mutex (mu) guards every feed and watcher: pushes are cheap and no blocking call is made
 * under it. rpc_call_finish / rpc_call_reply are called after it is released (a finish may
 * run the call's release callback, which takes mu); rpc_astream_release never calls back
 * synchronously, so it may run under mu. Lock order: mu, then rpc's per-call lock (inside
 * rpc_call_push).
 */
#include "watch.h"

#include "agentd.h"
#include "clients.h"
#include "clock.h"
#include "errinfo.h"
#include "log.h"
#include "mem.h"
#include "metrics.h"
#include "settled_here.h"
#include "trace.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RING_RECORDS 256
#define RING_BYTES (1 << 20)
/* What a ring's record is taken to cost: its decoded form and its encoding (made when a
 * watcher first pushes it) are about its encoded size each. */
#define RING_COST(size) (2 * (size_t)(size))
#define CATCHUP_PAGE 200
/* A wait whose Follow ended looks again at most this often (more often: it ends instead) */
#define WAIT_RELOOK_MS 5000
#define FEED_BUCKETS 4096
#define NO_STOP INT64_MAX       /* follow: no last offset */
#define HISTORY (INT64_MAX - 1) /* Watch without follow, before its last page */

enum wkind { W_WATCH, W_WAIT };

struct feed;

struct watcher {
    enum wkind kind;
    struct rpc_call *call;
    struct feed *feed; /* attached (holding a reference), or NULL */
    struct watcher *prev, *next;
    struct rpc_work work;    /* catch-up read (W_WATCH) or the next wait step (W_WAIT) */
    struct here_waiter here; /* W_WAIT: parked on a drive of this process (settled_here.c) */
    char *conversation_id;
    char *submission_id;  /* W_WAIT */
    char settled_id[256]; /* W_WAIT: "settled:<submission_id>" */
    int64_t offset;       /* last record given (or scanned) */
    int64_t stop_at;      /* W_WATCH without follow: the head when it started; else NO_STOP */
    bool paused;          /* W_WATCH: send queue full, waiting for drained */
    bool job;             /* work is queued or running */
    bool finished;        /* the call is being or was finished */
    bool seen;            /* W_WAIT: the settlement record went by */
    int64_t lost_ms;      /* W_WAIT: monotonic, when its feed last ended with no record since
                           * (0: none) */
    int64_t deadline_ms;  /* monotonic: the caller's deadline (0: none), which bounds the
                           * Store calls made for it */
    int refs;             /* the call (until release), and a queued job */
};

struct feed {
    char *conversation_id;
    struct rpc_astream *follow;
    struct feed *next_in_bucket;
    unsigned bucket;
    bool in_map;
    bool ended;    /* the Follow's on_end ran */
    bool released; /* rpc_astream_release was called (closing, or at on_end) */
    Cflue__V1__Record *ring[RING_RECORDS];
    grpc_byte_buffer *ring_packed[RING_RECORDS]; /* encoded once, when a watcher first pushes it */
    uint32_t ring_size[RING_RECORDS]; /* encoded sizes (gRPC messages stay far below 4 GiB) */
    int ring_head, ring_n;
    size_t ring_bytes;
    int64_t ring_first; /* offset of the oldest record in the ring */
    int64_t last_off;   /* the last offset the feed received (or it started after) */
    struct watcher *watchers;
    int n_watchers;
    int refs; /* the Follow (until on_end), and each attached watcher */
};

/* A finish to make once mu is released. */
struct fin {
    struct rpc_call *call;
    bool reply; /* W_WAIT: reply with msg */
    ProtobufCMessage *msg;
    bool has_err;
    struct cf_error err;
    grpc_status_code code;
    char details[160];
    struct fin *next;
};

static struct {
    pthread_mutex_t mu;
    struct rpc_server *srv;
    struct feed *buckets[FEED_BUCKETS];
    int n_feeds, n_watchers;
    /* every feed's ring together (RING_COST), and its bound: a feed taking a record past it
     * first gives up its own oldest ones, down to the new record alone (watchers behind it
     * then catch up from storaged), so thousands of watched conversations do not hold a
     * ring each of RING_BYTES */
    size_t cache_bytes, cache_max;
    struct metric *m_feeds, *m_watchers, *m_cache;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER, .cache_max = WATCH_CACHE_DEFAULT};

static void deliver_locked(struct watcher *w, struct fin **fl);
static void feed_on_message(void *arg, ProtobufCMessage *msg);
static void feed_on_end(void *arg, const struct rpc_status *st);
static const struct rpc_astream_ops feed_ops = {feed_on_message, feed_on_end};

static unsigned hash(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++) {
        h = (h ^ (unsigned char)*s) * 16777619u;
    }
    return h % FEED_BUCKETS;
}

/* ---------- finishing outside the lock ---------- */

static void fin_add(struct fin **fl, struct rpc_call *c, grpc_status_code code, const char *details,
                    const struct cf_error *err)
{
    struct fin *f = mem_alloc(sizeof(*f));
    f->call = c;
    f->code = code;
    if (details) {
        snprintf(f->details, sizeof(f->details), "%s", details);
    }
    if (err) {
        f->has_err = true;
        f->err = *err;
    }
    f->next = *fl;
    *fl = f;
}

static void fin_run(struct fin *fl)
{
    while (fl) {
        struct fin *f = fl;
        fl = f->next;
        if (f->reply) {
            rpc_call_reply(f->call, f->msg);
            protobuf_c_message_free_unpacked(f->msg, NULL);
        } else if (f->has_err) {
            rpc_call_fail_error(f->call, &f->err);
        } else {
            rpc_call_finish(f->call, f->code, f->details[0] ? f->details : NULL);
        }
        free(f);
    }
}

/* ---------- feeds ---------- */

/* ring_drop frees the ring's record in slot, and its encoding, and takes its bytes off. */
static void ring_drop(struct feed *f, int slot)
{
    f->ring_bytes -= f->ring_size[slot];
    g.cache_bytes -= RING_COST(f->ring_size[slot]);
    protobuf_c_message_free_unpacked(&f->ring[slot]->base, NULL);
    if (f->ring_packed[slot]) {
        grpc_byte_buffer_destroy(f->ring_packed[slot]);
        f->ring_packed[slot] = NULL;
    }
}

static void feed_free_locked(struct feed *f)
{
    for (int i = 0; i < f->ring_n; i++) {
        ring_drop(f, (f->ring_head + i) % RING_RECORDS);
    }
    free(f->conversation_id);
    free(f);
}

static void feed_unref_locked(struct feed *f)
{
    if (--f->refs == 0) {
        feed_free_locked(f);
    }
}

static void feed_unmap_locked(struct feed *f)
{
    if (!f->in_map) {
        return;
    }
    struct feed **pp = &g.buckets[f->bucket];
    while (*pp != f) {
        pp = &(*pp)->next_in_bucket;
    }
    *pp = f->next_in_bucket;
    f->in_map = false;
    g.n_feeds--;
}

/* feed_get_locked returns the open feed of a conversation, starting one (its Follow after
 * offset) when there is none. */
static struct feed *feed_get_locked(const char *conversation_id, int64_t offset)
{
    unsigned b = hash(conversation_id);
    for (struct feed *f = g.buckets[b]; f; f = f->next_in_bucket) {
        if (!strcmp(f->conversation_id, conversation_id)) {
            return f;
        }
    }
    struct feed *f = mem_alloc(sizeof(*f));
    f->conversation_id = mem_strdup(conversation_id);
    f->bucket = b;
    f->ring_first = offset + 1;
    f->last_off = offset;
    f->refs = 1; /* the Follow */
    f->in_map = true;
    f->next_in_bucket = g.buckets[b];
    g.buckets[b] = f;
    g.n_feeds++;
    Cflue__V1__FollowRequest fr = CFLUE__V1__FOLLOW_REQUEST__INIT;
    fr.conversation_id = f->conversation_id;
    fr.after_offset = offset;
    /* shared by every watcher of the conversation: the Follow carries none's trace */
    struct trace_ctx saved;
    trace_enter(NULL, &saved);
    /* callbacks come on the client loop thread and take mu: not before we release it */
    f->follow = rpc_astream_open(g_agentd.store, "/cflue.v1.Store/Follow", &fr.base,
                                 &cflue__v1__record__descriptor, 0, &feed_ops, f);
    log_debug("watch.feed_open", "conversation=%s after=%lld", conversation_id, (long long)offset);
    trace_leave(&saved);
    return f;
}

static void attach_locked(struct watcher *w, struct feed *f)
{
    w->feed = f;
    f->refs++;
    w->prev = NULL;
    w->next = f->watchers;
    if (f->watchers) {
        f->watchers->prev = w;
    }
    f->watchers = w;
    f->n_watchers++;
    g.n_watchers++;
}

/* detach_locked takes w off its feed; returns the feed's Follow to release when w was its last
 * watcher (the feed is then closed: out of the map, ended by its on_end). */
static struct rpc_astream *detach_locked(struct watcher *w)
{
    struct feed *f = w->feed;
    struct rpc_astream *close = NULL;
    if (!f) {
        return NULL;
    }
    if (w->prev) {
        w->prev->next = w->next;
    } else {
        f->watchers = w->next;
    }
    if (w->next) {
        w->next->prev = w->prev;
    }
    w->prev = w->next = NULL;
    w->feed = NULL;
    f->n_watchers--;
    g.n_watchers--;
    if (f->n_watchers == 0 && f->in_map && !f->ended) {
        feed_unmap_locked(f);
        f->released = true;
        close = f->follow;
    }
    feed_unref_locked(f);
    return close;
}

/* ring_slot returns the ring's slot of the record at offset (ring_first <= offset <= last_off). */
static int ring_slot(const struct feed *f, int64_t offset)
{
    return (f->ring_head + (int)(offset - f->ring_first)) % RING_RECORDS;
}

static void feed_on_message(void *arg, ProtobufCMessage *msg)
{
    struct feed *f = arg;
    Cflue__V1__Record *rec = (Cflue__V1__Record *)msg;
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    if (rec->offset != f->last_off + 1) {
        /* cannot happen with storaged's Follow; the ring must stay consecutive */
        log_warn("watch.feed_gap", "conversation=%s expected=%lld got=%lld", f->conversation_id,
                 (long long)(f->last_off + 1), (long long)rec->offset);
        protobuf_c_message_free_unpacked(msg, NULL);
        pthread_mutex_unlock(&g.mu);
        rpc_astream_next(f->follow);
        return;
    }
    size_t size = protobuf_c_message_get_packed_size(msg);
    while (f->ring_n > 0 && (f->ring_n == RING_RECORDS || f->ring_bytes + size > RING_BYTES ||
                             g.cache_bytes + RING_COST(size) > g.cache_max)) {
        ring_drop(f, f->ring_head);
        f->ring_head = (f->ring_head + 1) % RING_RECORDS;
        f->ring_n--;
        f->ring_first++;
    }
    if (f->ring_n == 0) {
        f->ring_first = rec->offset;
        f->ring_head = 0;
    }
    int slot = (f->ring_head + f->ring_n) % RING_RECORDS;
    f->ring[slot] = rec;
    f->ring_size[slot] = (uint32_t)size;
    f->ring_n++;
    f->ring_bytes += size;
    g.cache_bytes += RING_COST(size);
    f->last_off = rec->offset;
    for (struct watcher *w = f->watchers, *next; w; w = next) {
        next = w->next; /* deliver may detach w */
        deliver_locked(w, &fl);
    }
    struct rpc_astream *follow = f->follow;
    pthread_mutex_unlock(&g.mu);
    fin_run(fl);
    rpc_astream_next(follow);
}

static void schedule_locked(struct watcher *w);

static void feed_on_end(void *arg, const struct rpc_status *st)
{
    struct feed *f = arg;
    struct fin *fl = NULL;
    struct cf_error e;
    if (st->code != GRPC_STATUS_OK) {
        bool specific = st->reason[0] && strcmp(st->reason, errinfo_default_reason(st->code)) != 0;
        cf_error_setr(&e, status_from_grpc(st->code), specific ? st->reason : NULL, "%s",
                      st->details[0] ? st->details : "storaged ended the stream");
    }
    pthread_mutex_lock(&g.mu);
    f->ended = true;
    feed_unmap_locked(f);
    if (f->n_watchers > 0) {
        log_info("watch.feed_ended", "conversation=%s watchers=%d code=%d", f->conversation_id,
                 f->n_watchers, (int)st->code);
    }
    while (f->watchers) {
        struct watcher *w = f->watchers;
        (void)detach_locked(w); /* f is ended: never returns a stream to close */
        if (w->finished) {
            continue;
        }
        if (w->kind == W_WAIT &&
            (st->code == GRPC_STATUS_OK || st->code == GRPC_STATUS_UNAVAILABLE) &&
            (!w->lost_ms || clock_mono_ms() - w->lost_ms > WAIT_RELOOK_MS)) {
            /* storaged ended the Follow or went away: look again (the look fails the wait
             * while storaged is away, and attaches to a new Follow once it is back) */
            w->lost_ms = clock_mono_ms();
            schedule_locked(w);
            continue;
        }
        if (w->kind == W_WAIT) {
            /* refused (out of streams, a read that failed), or lost again soon after the last
             * look with no record between: looking again would meet it at once, in a loop
             * against storaged; it ends the wait with storaged's error, as it ends a Watch */
            if (st->code == GRPC_STATUS_OK) {
                cf_error_set(&e, CF_UNAVAILABLE,
                             "storaged ended the stream of the conversation again; ask again");
            }
            w->finished = true;
            fin_add(&fl, w->call, GRPC_STATUS_OK, NULL, &e);
            continue;
        }
        w->finished = true;
        if (st->code == GRPC_STATUS_OK) {
            fin_add(&fl, w->call, GRPC_STATUS_OK, NULL, NULL);
        } else {
            fin_add(&fl, w->call, GRPC_STATUS_OK, NULL, &e);
        }
    }
    struct rpc_astream *follow = f->released ? NULL : f->follow;
    f->released = true;
    feed_unref_locked(f);
    pthread_mutex_unlock(&g.mu);
    fin_run(fl);
    rpc_astream_release(follow); /* inside on_end: freed when this callback returns */
}

/* ---------- watchers ---------- */

static void watcher_unref(struct watcher *w)
{
    pthread_mutex_lock(&g.mu);
    int left = --w->refs;
    pthread_mutex_unlock(&g.mu);
    if (left == 0) {
        free(w->conversation_id);
        free(w->submission_id);
        free(w);
    }
}

/* schedule_locked queues w's job (catch-up read or wait step) unless one is queued. */
static void schedule_locked(struct watcher *w)
{
    if (w->job || w->finished) {
        return;
    }
    w->job = true;
    w->refs++;
    if (!rpc_server_post(g.srv, &w->work)) {
        w->job = false;
        w->refs--;
    }
}

/* end_locked finishes w (once) and detaches it; returns a feed stream to release. */
static struct rpc_astream *end_locked(struct watcher *w, struct fin **fl, grpc_status_code code,
                                      const char *details, const struct cf_error *err)
{
    if (w->finished) {
        return NULL;
    }
    w->finished = true;
    fin_add(fl, w->call, code, details, err);
    return detach_locked(w);
}

/* give_locked hands one record to w: pushed (W_WATCH) or scanned (W_WAIT). false when w must
 * stop for now (paused, dead, finished, or its settlement went by). packed: where the record's
 * encoding is kept for the other watchers (a ring slot's; encoded at the first push), or NULL. */
static bool give_locked(struct watcher *w, Cflue__V1__Record *rec, grpc_byte_buffer **packed,
                        struct fin **fl, struct rpc_astream **close)
{
    if (w->kind == W_WAIT) {
        w->offset = rec->offset;
        w->lost_ms = 0;
        if (!strcmp(rec->id, w->settled_id)) {
            w->seen = true;
            *close = detach_locked(w);
            schedule_locked(w); /* reads the submission and replies */
            return false;
        }
        return true;
    }
    if (packed && !*packed) {
        *packed = rpc_pack(&rec->base);
    }
    int r = packed ? rpc_call_push_packed(w->call, *packed) : rpc_call_push(w->call, &rec->base);
    if (r < 0) {
        *close = end_locked(w, fl, GRPC_STATUS_CANCELLED, "the watcher went away", NULL);
        return false;
    }
    w->offset = rec->offset;
    if (r == 0) {
        w->paused = true;
        return false;
    }
    return true;
}

/* release_stream closes a feed's Follow whose last watcher left. rpc_astream_release never
 * calls back synchronously (on_end comes on the loop thread), so this is safe under mu. */
static void release_stream(struct rpc_astream *s)
{
    rpc_astream_release(s);
}

/* deliver_locked gives w what it is missing: from the feed's ring, or by a catch-up read when
 * it is behind the ring (or has no feed: Watch without follow). */
static void deliver_locked(struct watcher *w, struct fin **fl)
{
    struct rpc_astream *close = NULL;
    while (!w->finished && !w->paused && !w->job && !w->seen) {
        if (w->offset >= w->stop_at) {
            close = end_locked(w, fl, GRPC_STATUS_OK, NULL, NULL);
            break;
        }
        struct feed *f = w->feed;
        if (!f || w->offset + 1 < f->ring_first) {
            schedule_locked(w);
            break;
        }
        if (w->offset >= f->last_off) {
            break; /* up to date: idle */
        }
        int slot = ring_slot(f, w->offset + 1);
        if (!give_locked(w, f->ring[slot], &f->ring_packed[slot], fl, &close)) {
            break;
        }
    }
    release_stream(close);
}

/* store_timeout: how long a Store call made for w may take (bounded by the deadline its
 * caller had when w was made). */
static int64_t store_timeout(const struct watcher *w)
{
    if (!w->deadline_ms) {
        return STORE_TIMEOUT_MS;
    }
    int64_t left = w->deadline_ms - clock_mono_ms();
    return store_timeout_within(left < 0 ? 0 : left);
}

/* still_waiting: w's caller has not gone away (a wait step stops between its calls). */
static bool still_waiting(struct watcher *w)
{
    pthread_mutex_lock(&g.mu);
    bool on = !w->finished;
    pthread_mutex_unlock(&g.mu);
    return on;
}

/* catch_up reads a page after w's offset from storaged (on a worker) and gives it to w. */
static void catch_up(struct watcher *w)
{
    struct cf_error err;
    struct fin *fl = NULL;
    struct rpc_astream *close = NULL;
    Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    pthread_mutex_lock(&g.mu);
    rq.after_offset = w->offset;
    bool finished = w->finished;
    pthread_mutex_unlock(&g.mu);
    rq.conversation_id = w->conversation_id;
    rq.page_size = CATCHUP_PAGE;
    enum cf_status st = CF_OK;
    if (!finished) {
        st = store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                        store_timeout(w), &resp, &err);
    }
    pthread_mutex_lock(&g.mu);
    w->job = false;
    if (!w->finished && st != CF_OK) {
        close = end_locked(w, &fl, GRPC_STATUS_OK, NULL, &err);
    } else if (!w->finished && resp) {
        Cflue__V1__ReadResponse *page = (Cflue__V1__ReadResponse *)resp;
        for (size_t i = 0; i < page->n_records && !w->finished && !w->paused && !w->seen; i++) {
            if (page->records[i]->offset != w->offset + 1) {
                continue;
            }
            if (w->offset >= w->stop_at || !give_locked(w, page->records[i], NULL, &fl, &close)) {
                break;
            }
        }
        if (w->stop_at == HISTORY && !w->finished && !w->paused && !*page->next_page_token) {
            w->stop_at = w->offset; /* no more after this page: the history is sent */
        }
        deliver_locked(w, &fl);
    }
    pthread_mutex_unlock(&g.mu);
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    release_stream(close);
    fin_run(fl);
}

/* wait_step checks whether w's submission is settled (then replies) and otherwise attaches w
 * to its conversation's feed at the head read before the last check. On a worker. */
static void wait_step(struct watcher *w)
{
    struct cf_error err;
    struct fin *fl = NULL;
    Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
    ProtobufCMessage *sub = NULL, *conv = NULL;
    gr.submission_id = w->submission_id;
    enum cf_status st = CF_CANCELLED;
    if (still_waiting(w)) {
        st = store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                        store_timeout(w), &sub, &err);
    }
    int64_t head = -1;
    if (st == CF_OK && still_waiting(w) &&
        ((Cflue__V1__Submission *)sub)->status !=
            CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
        Cflue__V1__ConversationRequest cr = CFLUE__V1__CONVERSATION_REQUEST__INIT;
        cr.conversation_id = ((Cflue__V1__Submission *)sub)->conversation_id;
        st = store_call(g_agentd.store, "GetConversation", &cr.base,
                        &cflue__v1__conversation__descriptor, store_timeout(w), &conv, &err);
        if (st == CF_OK) {
            head = ((Cflue__V1__Conversation *)conv)->head_offset;
            free(w->conversation_id);
            w->conversation_id = mem_strdup(cr.conversation_id);
            protobuf_c_message_free_unpacked(conv, NULL);
            protobuf_c_message_free_unpacked(sub, NULL);
            sub = NULL;
            /* settled between the two reads? then its record is at or before head */
            st = !still_waiting(w)
                     ? CF_CANCELLED
                     : store_call(g_agentd.store, "Get", &gr.base,
                                  &cflue__v1__submission__descriptor, store_timeout(w), &sub, &err);
        }
    }
    pthread_mutex_lock(&g.mu);
    w->job = false;
    if (w->finished) {
        /* the caller went away meanwhile */
    } else if (st != CF_OK) {
        release_stream(end_locked(w, &fl, GRPC_STATUS_OK, NULL, &err));
    } else if (((Cflue__V1__Submission *)sub)->status ==
               CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED) {
        w->finished = true;
        release_stream(detach_locked(w));
        struct fin *f = mem_alloc(sizeof(*f));
        f->call = w->call;
        f->reply = true;
        f->msg = sub;
        sub = NULL;
        f->next = fl;
        fl = f;
    } else {
        /* from a previous feed that ended or that it fell behind of: start again at head */
        struct rpc_astream *close = detach_locked(w);
        w->seen = false;
        w->offset = head;
        attach_locked(w, feed_get_locked(w->conversation_id, head));
        deliver_locked(w, &fl);
        release_stream(close);
    }
    pthread_mutex_unlock(&g.mu);
    if (sub) {
        protobuf_c_message_free_unpacked(sub, NULL);
    }
    fin_run(fl);
}

static void watcher_work(struct rpc_work *work)
{
    struct watcher *w = (struct watcher *)((char *)work - offsetof(struct watcher, work));
    if (w->kind == W_WAIT) {
        wait_step(w);
    } else {
        catch_up(w);
    }
    watcher_unref(w);
}

static void w_ended(void *arg, enum rpc_end why)
{
    struct watcher *w = arg;
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    struct rpc_astream *close = end_locked(
        w, &fl, why == RPC_END_SHUTDOWN ? GRPC_STATUS_UNAVAILABLE : GRPC_STATUS_CANCELLED,
        why == RPC_END_SHUTDOWN ? "agentd is stopping; resume from the last offset "
                                  "received"
                                : "the watcher went away",
        NULL);
    pthread_mutex_unlock(&g.mu);
    release_stream(close);
    fin_run(fl);
    if (w->kind == W_WAIT && here_cancel(&w->here)) {
        watcher_unref(w); /* the local registration's reference: done will not come */
    }
}

static void w_drained(void *arg)
{
    struct watcher *w = arg;
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    w->paused = false;
    deliver_locked(w, &fl);
    pthread_mutex_unlock(&g.mu);
    fin_run(fl);
}

static void w_release(void *arg)
{
    watcher_unref(arg);
}

static const struct rpc_async_ops watcher_ops = {w_ended, w_drained, w_release};

static struct watcher *watcher_new(struct rpc_call *c, enum wkind kind)
{
    struct watcher *w = mem_alloc(sizeof(*w));
    w->kind = kind;
    w->call = c;
    int64_t left = rpc_call_remaining_ms(c);
    w->deadline_ms = left >= 0 ? clock_mono_ms() + left : 0;
    w->stop_at = NO_STOP;
    w->work.fn = watcher_work;
    w->refs = 1; /* the call */
    return w;
}

/* attach_call hands c to rpc's event-driven mode; false (the call finished, w freed whatever
 * its references: nothing else has it yet) when the caller already left or the server stops. */
static bool attach_call(struct watcher *w)
{
    if (rpc_call_async(w->call, &watcher_ops, w)) {
        return true;
    }
    rpc_call_finish(w->call,
                    rpc_server_stopping(rpc_call_server(w->call)) ? GRPC_STATUS_UNAVAILABLE
                                                                  : GRPC_STATUS_CANCELLED,
                    "the call ended before it started");
    free(w->conversation_id);
    free(w->submission_id);
    free(w);
    return false;
}

void watch_start(struct rpc_call *c, const Cflue__V1__WatchRequest *req)
{
    struct cf_error err;
    if (!*req->conversation_id) {
        rpc_call_fail(c, CF_INVALID, "conversation_id is required");
        return;
    }
    /* storaged checks the conversation and the offset (NOT_FOUND, OFFSET_BEYOND_HEAD) */
    Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rq.conversation_id = req->conversation_id;
    rq.after_offset = req->after_offset;
    rq.page_size = 1;
    if (store_call(g_agentd.store, "Read", &rq.base, &cflue__v1__read_response__descriptor,
                   store_timeout_within(rpc_call_remaining_ms(c)), &resp, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    struct watcher *w = watcher_new(c, W_WATCH);
    w->conversation_id = mem_strdup(req->conversation_id);
    w->offset = req->after_offset;
    if (!req->follow) {
        w->stop_at = HISTORY; /* set to the last offset by the page that says none is left */
    }
    w->refs++; /* this handler's until it returns: once attached, the call may end at once */
    if (!attach_call(w)) {
        return;
    }
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    if (!w->finished) { /* else the caller left already (w_ended) */
        if (req->follow) {
            attach_locked(w, feed_get_locked(w->conversation_id, w->offset));
        }
        deliver_locked(w, &fl);
    }
    pthread_mutex_unlock(&g.mu);
    fin_run(fl);
    watcher_unref(w);
}

/* reply_locked finishes w with *sub as its answer (taken: *sub is NULL afterwards); the
 * returned fin replies once mu is released (fin_run). */
static struct fin *reply_locked(struct watcher *w, Cflue__V1__Submission **sub)
{
    struct fin *f = mem_alloc(sizeof(*f));
    w->finished = true;
    f->call = w->call;
    f->reply = true;
    f->msg = &(*sub)->base;
    *sub = NULL;
    return f;
}

/* local_done answers a wait parked on a drive of this process (settled_here.c): with the
 * settled submission, or (sub NULL) by taking the storaged path. Drops the registration's
 * reference. */
static void local_done(struct here_waiter *hw, Cflue__V1__Submission *sub)
{
    struct watcher *w = (struct watcher *)((char *)hw - offsetof(struct watcher, here));
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    if (w->finished) {
        /* the caller went away meanwhile */
    } else if (sub) {
        fl = reply_locked(w, &sub);
    } else {
        schedule_locked(w); /* Get, GetConversation, Follow: as if it had not been here */
    }
    pthread_mutex_unlock(&g.mu);
    if (sub) {
        protobuf_c_message_free_unpacked(&sub->base, NULL);
    }
    fin_run(fl);
    watcher_unref(w);
}

/* wait_here answers w from this process when it can: true when w is answered or parked on a
 * local drive, false when it must take the storaged path (the caller then has a reference of
 * wait_here's for it). */
static bool wait_here(struct watcher *w)
{
    Cflue__V1__Submission *sub = NULL;
    pthread_mutex_lock(&g.mu);
    /* one for the local registration (if parked), one for this thread: once registered, the
     * answer may come and drop the first at once */
    w->refs += 2;
    pthread_mutex_unlock(&g.mu);
    enum here_answer a = here_wait(&w->here, local_done, w->submission_id, &sub);
    if (a == HERE_PARKED) {
        pthread_mutex_lock(&g.mu);
        bool gone = w->finished; /* w_ended ran before the registration: undo it */
        pthread_mutex_unlock(&g.mu);
        if (gone && here_cancel(&w->here)) {
            watcher_unref(w);
        }
        watcher_unref(w); /* this thread's */
        return true;
    }
    watcher_unref(w); /* not registered */
    if (a == HERE_ELSEWHERE) {
        return false; /* this thread's reference goes to the caller */
    }
    struct fin *fl = NULL;
    pthread_mutex_lock(&g.mu);
    if (!w->finished) {
        fl = reply_locked(w, &sub);
    }
    pthread_mutex_unlock(&g.mu);
    if (sub) {
        protobuf_c_message_free_unpacked(&sub->base, NULL);
    }
    fin_run(fl);
    watcher_unref(w); /* this thread's */
    return true;
}

void watch_wait_settled(struct rpc_call *c, const char *submission_id)
{
    struct watcher *w = watcher_new(c, W_WAIT);
    w->submission_id = mem_strdup(submission_id);
    snprintf(w->settled_id, sizeof(w->settled_id), "settled:%s", submission_id);
    w->refs++; /* this handler's until it returns: once attached, the call may end at once */
    if (!attach_call(w)) {
        return;
    }
    if (!wait_here(w)) {
        pthread_mutex_lock(&g.mu);
        w->job = true; /* this worker runs the first step, with wait_here's reference */
        pthread_mutex_unlock(&g.mu);
        watcher_work(&w->work);
    }
    watcher_unref(w);
}

/* collect sets the module's gauges when metrics are scraped. */
static void collect(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g.mu);
    double feeds = g.n_feeds, watchers = g.n_watchers, cached = (double)g.cache_bytes;
    pthread_mutex_unlock(&g.mu);
    metrics_set(g.m_feeds, NULL, feeds);
    metrics_set(g.m_watchers, NULL, watchers);
    metrics_set(g.m_cache, NULL, cached);
}

void watch_init(struct rpc_server *srv)
{
    g.srv = srv;
    g.m_feeds = metrics_gauge("cflue_agentd_watch_feeds",
                              "storaged Follow streams held for Watch and GetSubmission(wait), "
                              "one per watched conversation.",
                              "");
    g.m_watchers = metrics_gauge("cflue_agentd_watchers",
                                 "Watch(follow) and GetSubmission(wait) calls being served.", "");
    g.m_cache = metrics_gauge("cflue_agentd_watch_cache_bytes",
                              "Records kept in memory for watchers, every watched conversation "
                              "together (bounded by --watch-cache-mib).",
                              "");
    metrics_on_scrape(collect, NULL);
}

void watch_counts(int *feeds_out, int *watchers_out)
{
    pthread_mutex_lock(&g.mu);
    *feeds_out = g.n_feeds;
    *watchers_out = g.n_watchers;
    pthread_mutex_unlock(&g.mu);
}

void watch_set_cache_bytes(size_t max)
{
    pthread_mutex_lock(&g.mu);
    g.cache_max = max;
    pthread_mutex_unlock(&g.mu);
}
