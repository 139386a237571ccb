/* engine.c - the scheduler of agentd's drives.
 *
 * Drives are objects (struct drive) stepped by a small fixed pool of engine threads
 * (--workers). A drive runs its states until it waits on a model call: then it PARKS, holding
 * no thread, and the call's end (on the model I/O loop) only posts it back to the ready queue
 * (engine_post). A tool batch parks the drive the same way (its stream's results post it), and
 * so do its Appends and its Settle (their ends post it). A model retry's or a Store retry's
 * backoff is a timer on the engine (engine_post_at), not a sleep. The drive's other Store
 * calls (reads, joins, compaction, settlements on rarer paths) still block the engine thread
 * that steps the drive (short in the usual case), so --workers bounds how many of those run
 * at once, never how many drives are in flight: that is --max-drives.
 *
 * One claimer thread claims work (queued heads, and leases that expired) while fewer than
 * --max-drives drives are live, woken by Submit and by a settlement (agentd_wake), by a
 * drive's end when all --max-drives were live, and every 500 ms for work admitted elsewhere;
 * it stops at the first empty Claim, so a burst of Submits costs one empty Claim, not one per
 * thread. One heartbeat thread renews every lease (a Heartbeat call per 1000 drives, storaged's
 * limit) and polls abort intents (one List of its aborted work per tick). Abort,
 * a lost lease and shutdown set the drive's flag, cancel the model call it is parked on at
 * once (llm_cancel) and post it, so it settles or stops without waiting for the model.
 *
 * Crash-only: all state is in storaged. With a stable --owner-id, a restarted agentd takes
 * back its own unfinished work at once (engine_note_start) instead of waiting for the leases
 * to run out. A graceful stop hands back the leases of the drives it stopped and of the work
 * waiting on the resume list (engine_release_leases: Store.Release), so any agentd takes that
 * work over 5 s later.
 *
 * A drive that storaged or toold interrupted (drive.c) is not settled: its submission goes on
 * the resume list, and the claimer claims it again (own-owner reclaim of that one submission)
 * after a backoff of 1 s doubling to 30 s (at most 2 s while storaged cannot be reached),
 * until the claim succeeds or finds it settled or taken by someone else. Each such claim is a
 * new attempt and counts against max_attempts (a drive whose sandbox's replica is out of DNS
 * waits for it instead, in its attempt: drive.c).
 *
 * Tracing: an engine thread steps a drive under the drive's trace (drive.h) and drops it after,
 * so nothing a drive logs or calls is attributed to another; the claimer's and heartbeat's lines
 * about one submission carry its trace (log_sub_info), their calls none.
 *
 * Locks: g_agentd.mu (the active table, flags, resume list) is taken before the engine's own
 * lock (ready queue, timers, counts), never after; the claiming Admits' gate (admit_gate.h) has
 * a lock of its own, taken under either or none, and takes no other.
 */
#include "engine.h"
#include "admit_gate.h"
#include "agentd.h"
#include "clients.h"
#include "clock.h"
#include "drive.h"
#include "log.h"
#include "mem.h"
#include "pbtime.h"
#include "proto_limits.h"
#include "thread.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long long engine_max_drives = ENGINE_MAX_DRIVES_DEFAULT;

#define CLAIM_POLL_MS 500       /* the claimer asks for work admitted elsewhere this often */
#define RELEASE_TIMEOUT_MS 2000 /* a Release at shutdown: past it the leases run out instead */
/* A released lease lasts this much longer: a command the stop cancelled in toold is still
 * being stopped when agentd's side of its stream has ended, and the workspace must not see
 * the next attempt's commands before it is gone. */
#define RELEASE_AFTER_MS ENGINE_COMMANDS_GONE_MS
#define DRAIN_POLL_MS 50 /* a drain looks whether the last drive has ended this often */

static struct engine {
    pthread_mutex_t mu;
    pthread_cond_t work;        /* engine threads: a drive is ready, a timer changed, or stop */
    struct engine_queue ready;  /* drives to step, the oldest admitted first */
    struct engine_queue timers; /* drives with a timer, the earliest first */
    int64_t admitted;           /* drives ever admitted: the ready queue's key */
    long long live;             /* drives admitted and not yet freed */
    long long on_children;      /* of those, parked on their task children */
    long long claiming;         /* Admits in flight that claim for this process: each may
                                 * bring a drive, so each holds a slot until it ends */
    bool claimer_done;          /* the claimer exited: no drive is admitted any more */
    bool stopping;              /* engine_stop was called (g_agentd.stopping, under eng.mu) */
    bool draining;              /* engine_drain: nothing new is claimed here */
    pthread_t *threads;         /* workers, then the claimer, then the heartbeat */
    long long n_workers, n_started;
    struct active *held; /* drives that stopped at shutdown holding their lease */
    size_t n_held, cap_held;
} eng = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER};

static bool woken; /* under g_agentd.mu: agentd_wake since the claimer last looked */

/* The Admits in flight that claim for this process (admit_gate.h): a take-back waits for those
 * started before it. */
static struct admit_gate admits = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* A Claim, or an Admit with a claim, ended without an answer: it may have committed, leaving
 * its submission RUNNING under this owner with no drive. The claimer takes such work back
 * (take_back_unanswered_claims) before it claims again. */
static atomic_bool claims_unanswered;

/* log_sub_info logs an info line about submission s under the trace it was admitted with
 * (drive_sub_trace; none: no trace), whatever thread logs it. */
#define log_sub_info(s, ev, ...)                                                                   \
    do {                                                                                           \
        struct trace_ctx t_, saved_;                                                               \
        (void)drive_sub_trace((s), &t_);                                                           \
        trace_enter(&t_, &saved_);                                                                 \
        log_info(ev, __VA_ARGS__);                                                                 \
        trace_leave(&saved_);                                                                      \
    } while (0)

/* ---------- the ready queue and timers ---------- */

#define DRIVE_OF(item, field) ((struct drive *)((char *)(item)-offsetof(struct drive, field)))

/* queue_locked makes d ready (eng.mu held) and returns whether a thread must be woken for it.
 * Ready drives are stepped oldest first: when the CPU is the limit, the conversations admitted
 * first finish first, instead of every one of them finishing late. */
static bool queue_locked(struct drive *d)
{
    if (d->eng.running) {
        d->eng.again = true; /* its thread steps it again */
        return false;
    }
    return engine_queue_push(&eng.ready, &d->eng.ready);
}

/* post_locked makes d ready and wakes a thread for it (eng.mu held: for the timers and the
 * rarer paths; the usual posts wake after the unlock). */
static void post_locked(struct drive *d)
{
    if (queue_locked(d)) {
        pthread_cond_signal(&eng.work);
    }
}

/* post_quiet queues d and returns whether an engine thread must be woken for it. */
static bool post_quiet(struct drive *d)
{
    pthread_mutex_lock(&eng.mu);
    bool wake = queue_locked(d);
    pthread_mutex_unlock(&eng.mu);
    return wake;
}

void engine_post(struct drive *d)
{
    if (post_quiet(d)) {
        pthread_cond_signal(&eng.work); /* after the unlock: the thread woken finds eng.mu free */
    }
}

void engine_post_unlock(struct drive *d, pthread_mutex_t *held)
{
    bool wake = post_quiet(d);
    pthread_mutex_unlock(held);
    if (wake) {
        pthread_cond_signal(&eng.work); /* eng is global: no drive touched */
    }
}

void engine_post_at(struct drive *d, int64_t due_ms)
{
    pthread_mutex_lock(&eng.mu);
    /* kept when an earlier one is set: the waiter asks again when it finds itself early.
     * Only a new earliest timer changes a wait's deadline, and one waiting worker taking it
     * is enough (a running worker reads the timers before it waits again): waking them all
     * costs every worker a wake-up and a turn at eng.mu on every model call's hold. */
    if (engine_queue_push_earliest(&eng.timers, &d->eng.timer, due_ms) &&
        engine_queue_peek(&eng.timers) == &d->eng.timer) {
        pthread_cond_signal(&eng.work);
    }
    pthread_mutex_unlock(&eng.mu);
}

/* fire_timers posts the drives whose timer is due; returns the earliest timer left (0:
 * none). eng.mu held. */
static int64_t fire_timers(int64_t now)
{
    struct engine_queue_item *it;
    while ((it = engine_queue_peek(&eng.timers)) && it->key <= now) {
        engine_queue_pop(&eng.timers);
        post_locked(DRIVE_OF(it, eng.timer));
    }
    return it ? (it->key > 0 ? it->key : 1) : 0;
}

/* kick_locked posts the drive of slot a and returns the model call to cancel (g_agentd.mu
 * held); the caller cancels it after unlocking. */
static uint64_t kick_locked(struct active *a)
{
    if (a->drive) {
        engine_post(a->drive);
    }
    return a->model_call;
}

void agentd_wake(void)
{
    pthread_mutex_lock(&g_agentd.mu);
    woken = true;
    pthread_cond_broadcast(&g_agentd.wake);
    pthread_mutex_unlock(&g_agentd.mu);
}

bool agentd_mark_abort(const char *submission_id)
{
    bool here = false;
    uint64_t cancel = 0;
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < g_agentd.active_used; i++) {
        struct active *a = &g_agentd.active[i];
        if (a->in_use && !strcmp(a->submission_id, submission_id)) {
            a->abort_requested = true;
            here = true;
            cancel = kick_locked(a);
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    llm_cancel(cancel); /* at once: the drive settles aborted without waiting for the model */
    return here;
}

bool agentd_note_queued(const char *conversation_id)
{
    bool here = false;
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < g_agentd.active_used && !here; i++) {
        struct active *a = &g_agentd.active[i];
        if (a->in_use && !strcmp(a->conversation_id, conversation_id)) {
            a->queued_hint = true;
            here = true;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return here;
}

/* This process's start (wall clock, ms, engine_note_start): until a claim succeeds with no
 * takeover (nothing, or queued work), the claimer's claims also take back this owner's
 * attempts started before it. 0: that is done. Set before the claimer starts, then the
 * claimer's alone. */
static int64_t reclaim_before_ms;

/* This process's start (wall clock, ms, engine_note_start), sent with every claim as
 * owner_started_at: what a later start of this owner reclaims by. */
static int64_t started_ms;

/* owner_started fills ts with started_ms for a claim. */
static Google__Protobuf__Timestamp *owner_started(Google__Protobuf__Timestamp *ts)
{
    google__protobuf__timestamp__init(ts);
    pbtime_set(ts, started_ms);
    return ts;
}

/* claim asks storaged for work under this process's owner id and lease: submission_id (NULL:
 * any queued or expired one), taking back this owner's own leases started before before_ms
 * (0: none). */
static enum cf_status claim(const char *submission_id, int64_t before_ms,
                            Cflue__V1__ClaimResponse **out, struct cf_error *err)
{
    Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
    Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
    Google__Protobuf__Timestamp before = GOOGLE__PROTOBUF__TIMESTAMP__INIT, started;
    ProtobufCMessage *resp = NULL;
    req.owner_id = (char *)g_agentd.owner_id;
    req.owner_started_at = owner_started(&started);
    pbdur_set(&lease, g_agentd.lease_ms);
    req.lease_duration = &lease;
    if (submission_id) {
        req.submission_id = (char *)submission_id;
    }
    if (before_ms) {
        pbtime_set(&before, before_ms);
        req.reclaim_started_before = &before;
    }
    enum cf_status rc = store_call(g_agentd.store, "Claim", &req.base,
                                   &cflue__v1__claim_response__descriptor, 15000, &resp, err);
    *out = (Cflue__V1__ClaimResponse *)resp;
    return rc;
}

void engine_note_start(void)
{
    started_ms = reclaim_before_ms = clock_now_ms();
}

/* live_drives: how many drives are admitted and not yet freed. */
static long long live_drives(void)
{
    pthread_mutex_lock(&eng.mu);
    long long live = eng.live;
    pthread_mutex_unlock(&eng.mu);
    return live;
}

void engine_drain(int64_t drain_ms)
{
    pthread_mutex_lock(&eng.mu);
    eng.draining = true;
    long long live = eng.live;
    pthread_mutex_unlock(&eng.mu);
    if (drain_ms <= 0 || live == 0) {
        return;
    }
    log_info("draining", "drives=%lld up_to_ms=%lld", live, (long long)drain_ms);
    int64_t t0 = clock_mono_ms(), now = t0;
    bool signalled = false;
    while ((live = live_drives()) > 0 && now - t0 < drain_ms && !signalled) {
        int64_t left = drain_ms - (now - t0);
        signalled = daemon_stop_signal_within(left < DRAIN_POLL_MS ? left : DRAIN_POLL_MS);
        now = clock_mono_ms();
    }
    live = live_drives(); /* as the drain ends, not as the last wait began */
    if (live == 0) {
        log_info("drained", "after_ms=%lld", (long long)(now - t0));
    } else {
        log_warn("drain_ended", "drives_left=%lld reason=%s after_ms=%lld", live,
                 signalled ? "signal" : "time", (long long)(now - t0));
    }
}

void engine_stop(void)
{
    uint64_t *cancel = mem_alloc(sizeof(*cancel) * ACTIVE_MAX);
    int n = 0;
    pthread_mutex_lock(&g_agentd.mu);
    g_agentd.stopping = true;
    for (int i = 0; i < g_agentd.active_used; i++) {
        struct active *a = &g_agentd.active[i];
        a->shutting_down = true;
        if (a->in_use) {
            cancel[n++] = kick_locked(a);
        }
    }
    pthread_cond_broadcast(&g_agentd.wake);
    pthread_mutex_unlock(&g_agentd.mu);
    for (int i = 0; i < n; i++) {
        llm_cancel(cancel[i]);
    }
    free(cancel);
    pthread_mutex_lock(&eng.mu);
    eng.stopping = true;
    pthread_cond_broadcast(&eng.work);
    pthread_mutex_unlock(&eng.mu);
}

/* driven_here_locked reports whether a drive of this process holds the submission now
 * (g_agentd.mu held); driven_here takes the lock. */
static bool driven_here_locked(const char *submission_id)
{
    bool here = false;
    for (int i = 0; i < g_agentd.active_used && !here; i++) {
        here =
            g_agentd.active[i].in_use && !strcmp(g_agentd.active[i].submission_id, submission_id);
    }
    return here;
}

static bool driven_here(const char *submission_id)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool here = driven_here_locked(submission_id);
    pthread_mutex_unlock(&g_agentd.mu);
    return here;
}

/* Submissions whose drive was interrupted, to claim again when due. */
#define RESUME_MAX ACTIVE_MAX
#define RESUME_FIRST_MS 1000
#define RESUME_MAX_MS 30000
static struct resume {
    char submission_id[64];
    char attempt_id[64]; /* the attempt whose lease this process holds (handed back at a stop) */
    int64_t epoch;
    int64_t due_ms;   /* monotonic */
    int64_t delay_ms; /* the next backoff */
    uint64_t behind;  /* a take-back: not due before the claiming Admits up to this ticket have
                       * ended (admit_gate.h); 0: an interrupted drive's resume */
} resumes[RESUME_MAX];
static int n_resumes;

/* resume_find returns submission_id's place on the resume list, or NULL (g_agentd.mu held). */
static struct resume *resume_find(const char *submission_id)
{
    for (int i = 0; i < n_resumes; i++) {
        if (!strcmp(resumes[i].submission_id, submission_id)) {
            return &resumes[i];
        }
    }
    return NULL;
}

/* resume_later_locked puts an interrupted submission, held under the fence (submission_id,
 * attempt_id, epoch), on the resume list (or backs it off again), due in delay_ms, and for a
 * take-back (behind > 0) not before the claiming Admits up to that ticket have ended; its next
 * backoff is delay_ms, or RESUME_FIRST_MS for one due at once (a backoff of 0 would double to
 * 0: a claim storaged does not answer would be asked again without a pause). g_agentd.mu held;
 * resume_later takes it. */
static void resume_later_locked(const char *submission_id, const char *attempt_id, int64_t epoch,
                                int64_t delay_ms, uint64_t behind)
{
    struct resume *r = resume_find(submission_id);
    bool listed = r != NULL;
    if (!r && n_resumes < RESUME_MAX) {
        r = &resumes[n_resumes++];
        snprintf(r->submission_id, sizeof(r->submission_id), "%s", submission_id);
    }
    if (r) {
        snprintf(r->attempt_id, sizeof(r->attempt_id), "%s", attempt_id);
        /* one listed already waits behind what it waited behind, at most: a later Admit of
         * this submission (a retried Submit's) is deduplicated and claims nothing */
        r->behind = !listed || behind < r->behind ? behind : r->behind;
        r->epoch = epoch;
        r->delay_ms = delay_ms > 0 ? delay_ms : RESUME_FIRST_MS;
        r->due_ms = clock_mono_ms() + delay_ms + thread_jitter_ms(delay_ms / 4 + 1);
    }
    /* a full list leaves the rest to lease expiry: another claim takes them in time */
}

static void resume_later(const char *submission_id, const char *attempt_id, int64_t epoch,
                         int64_t delay_ms, uint64_t behind)
{
    pthread_mutex_lock(&g_agentd.mu);
    resume_later_locked(submission_id, attempt_id, epoch, delay_ms, behind);
    pthread_mutex_unlock(&g_agentd.mu);
}

/* take_due_resume removes and returns a resume whose time has come (a take-back's once the
 * Admits it waits behind have ended). */
static bool take_due_resume(struct resume *out)
{
    bool found = false;
    int64_t now = clock_mono_ms();
    pthread_mutex_lock(&g_agentd.mu);
    uint64_t oldest = admit_gate_oldest(&admits);
    for (int i = 0; i < n_resumes && !found; i++) {
        if (resumes[i].due_ms <= now && resumes[i].behind < oldest) {
            *out = resumes[i];
            resumes[i] = resumes[--n_resumes];
            found = true;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return found;
}

/* note_claim_result logs when claims start failing and when they work again, once each,
 * instead of once per worker per second for as long as storaged is away. */
static void note_claim_result(enum cf_status rc, const struct cf_error *err)
{
    static int64_t failing_since; /* monotonic ms; 0: claims work */
    char q[600];
    pthread_mutex_lock(&g_agentd.mu);
    if (rc != CF_OK && !failing_since) {
        failing_since = clock_mono_ms();
        log_warn("claims_failing", "err=%s", log_quote(q, sizeof(q), err->msg));
    } else if (rc == CF_OK && failing_since) {
        log_info("claims_working", "after_ms=%lld", (long long)(clock_mono_ms() - failing_since));
        failing_since = 0;
    } else if (rc != CF_OK) {
        log_debug("claim_failed", "err=%s", log_quote(q, sizeof(q), err->msg));
    }
    pthread_mutex_unlock(&g_agentd.mu);
}

/* ---------- drives ---------- */

/* admit makes a drive of a claim (taken) with `resume_ms` its first resume backoff, and
 * queues it. */
static void admit(Cflue__V1__ClaimResponse *cl, int64_t resume_ms)
{
    struct drive *d = drive_new(cl);
    if (!d) {
        return; /* ACTIVE_MAX drives: the lease expires and the work is claimed again */
    }
    d->eng.resume_ms = resume_ms;
    pthread_mutex_lock(&eng.mu);
    eng.live++;
    d->eng.ready.key = eng.admitted++;
    pthread_mutex_unlock(&eng.mu);
    /* registered and queued at once: a kick (abort, lost lease, stop) from now on posts it,
     * and it cannot be freed before this unlocks (drive_free takes the slot back under it) */
    pthread_mutex_lock(&g_agentd.mu);
    d->act->drive = d;
    engine_post(d);
    pthread_mutex_unlock(&g_agentd.mu);
}

/* full_locked: --max-drives drives are live or on their way (claiming Admits, the claimer's
 * Claim), up to --max-drives of those parked on their children aside (so at most twice
 * --max-drives drives are held in all). */
static bool full_locked(void)
{
    long long aside = eng.on_children < engine_max_drives ? eng.on_children : engine_max_drives;
    return eng.live + eng.claiming - aside >= engine_max_drives;
}

/* room_locked: engine_has_room, eng.mu held. */
static bool room_locked(void)
{
    return !full_locked() && eng.live + eng.claiming < ACTIVE_MAX && !eng.stopping && !eng.draining;
}

bool engine_has_room(void)
{
    pthread_mutex_lock(&eng.mu);
    bool room = room_locked();
    pthread_mutex_unlock(&eng.mu);
    return room;
}

/* slot_take holds a slot for a claim on its way (a claiming Admit, the claimer's Claim) until
 * slot_give_back: false, holding none, when there is no room. */
static bool slot_take(void)
{
    pthread_mutex_lock(&eng.mu);
    bool room = room_locked();
    eng.claiming += room;
    pthread_mutex_unlock(&eng.mu);
    return room;
}

/* slot_give_back ends slot_take's hold (the claim's drive, if any, is live by now); the
 * claimer is woken when that leaves room (the claim brought no drive). */
static void slot_give_back(void)
{
    pthread_mutex_lock(&eng.mu);
    bool was_full = full_locked();
    eng.claiming--;
    bool freed = was_full && !full_locked();
    pthread_mutex_unlock(&eng.mu);
    if (freed) {
        agentd_wake();
    }
}

/* claim_ended gives back the slot a claiming Admit held (ticket 0: it claimed nothing). */
static void claim_ended(uint64_t ticket)
{
    if (ticket) {
        slot_give_back();
    }
}

void engine_on_children(struct drive *d, bool waiting)
{
    if (d->eng.on_children == waiting) {
        return; /* only the thread stepping d writes it */
    }
    pthread_mutex_lock(&eng.mu);
    bool was_full = full_locked();
    d->eng.on_children = waiting;
    eng.on_children += waiting ? 1 : -1;
    bool freed = was_full && !full_locked();
    pthread_mutex_unlock(&eng.mu);
    if (freed) {
        agentd_wake(); /* room for one more: the claimer waits for it */
    }
}

void engine_claim_with_admit(Cflue__V1__AdmitRequest *ar, struct engine_admit_claim *c)
{
    cflue__v1__claim_request__init(&c->claim);
    google__protobuf__duration__init(&c->lease);
    if (slot_take()) { /* held until the Admit ends: a burst of them cannot pass the bound */
        c->claim.owner_id = (char *)g_agentd.owner_id;
        pbdur_set(&c->lease, g_agentd.lease_ms);
        c->claim.lease_duration = &c->lease;
        c->claim.owner_started_at = owner_started(&c->started);
        ar->claim = &c->claim;
        c->ticket = admit_gate_enter(&admits);
    } else {
        c->ticket = 0;
    }
}

/* taken_in takes the answer of an Admit that had a claim: a claimed submission's drive starts
 * here; a deduplicated one this owner holds with no drive here is taken back. */
static bool taken_in(Cflue__V1__AdmitResponse *r)
{
    const Cflue__V1__Submission *s = r->submission;
    if (r->claim && r->claim->submission) {
        log_sub_info(r->claim->submission, "claimed", "submission=%s at=admit",
                     r->claim->submission->submission_id);
        admit(r->claim, RESUME_FIRST_MS); /* the drive owns the claim now */
        r->claim = NULL;
        return true;
    }
    if (!r->deduplicated || s->status != CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING ||
        strcmp(s->owner_id, g_agentd.owner_id) != 0) {
        return false;
    }
    if (!driven_here(s->submission_id)) {
        /* no drive holds the lease: take it back now rather than when the lease runs out, once
         * the Admits started so far have ended (the first one's answer may be on the way) */
        log_sub_info(s, "take_back", "submission=%s", s->submission_id);
        resume_later(s->submission_id, s->attempt_id, s->epoch, 0, admit_gate_behind_now(&admits));
        agentd_wake();
    }
    return true;
}

bool engine_admitted(uint64_t ticket, Cflue__V1__AdmitResponse *r)
{
    bool here = taken_in(r);
    claim_ended(ticket); /* its drive, if any, is live now */
    /* after: its drive, if any, is known here now; a take-back waiting for it is due */
    if (admit_gate_leave(&admits, ticket)) {
        agentd_wake();
    }
    return here;
}

void engine_admit_unanswered(uint64_t ticket, enum cf_status code)
{
    bool lost = ticket && (code == CF_UNAVAILABLE || code == CF_CANCELLED); /* unknown end */
    claim_ended(ticket);
    if (lost) {
        atomic_store(&claims_unanswered, true);
    }
    if (admit_gate_leave(&admits, ticket) || lost) {
        agentd_wake(); /* the claimer takes it back now, not at its next poll */
    }
}

/* hold_locked keeps a lease to hand back at the stop (eng.mu held). */
static void hold_locked(const struct active *a)
{
    if (eng.n_held == eng.cap_held) {
        eng.cap_held = eng.cap_held ? eng.cap_held * 2 : 16;
        eng.held = mem_realloc(eng.held, sizeof(*eng.held) * eng.cap_held);
    }
    eng.held[eng.n_held++] = *a;
}

/* hold_resumes adds the leases of the resume list's submissions (interrupted, waiting for
 * their next claim) to those to hand back, but for submissions a stopped drive held since. */
static void hold_resumes(void)
{
    pthread_mutex_lock(&g_agentd.mu);
    pthread_mutex_lock(&eng.mu);
    size_t stopped = eng.n_held;
    for (int i = 0; i < n_resumes; i++) {
        const struct resume *r = &resumes[i];
        bool known = !r->attempt_id[0];
        for (size_t k = 0; k < stopped && !known; k++) {
            known = !strcmp(eng.held[k].submission_id, r->submission_id);
        }
        if (!known) {
            struct active a = {.epoch = r->epoch};
            _Static_assert(sizeof(a.submission_id) == sizeof(r->submission_id) &&
                               sizeof(a.attempt_id) == sizeof(r->attempt_id),
                           "a resume's ids fit a slot's");
            memcpy(a.submission_id, r->submission_id, sizeof(a.submission_id));
            memcpy(a.attempt_id, r->attempt_id, sizeof(a.attempt_id));
            hold_locked(&a);
        }
    }
    n_resumes = 0;
    pthread_mutex_unlock(&eng.mu);
    pthread_mutex_unlock(&g_agentd.mu);
}

/* retire frees a done drive, filing an interrupted one for a later claim and keeping the
 * lease of one stopped by the shutdown for engine_release_leases. */
static void retire(struct drive *d)
{
    struct active held;
    bool keep = drive_lease_held(d, &held);
    if (drive_end_of(d) == DRIVE_INTERRUPTED) {
        resume_later(d->fence.submission_id, d->fence.attempt_id, d->fence.epoch, d->eng.resume_ms,
                     0);
    }
    pthread_mutex_lock(&eng.mu);
    engine_queue_remove(&eng.timers, &d->eng.timer);
    if (keep) {
        hold_locked(&held);
    }
    pthread_mutex_unlock(&eng.mu);
    engine_on_children(d, false);
    drive_free(d); /* its slot goes first: nothing posts it afterwards */
    pthread_mutex_lock(&eng.mu);
    bool was_full = full_locked();
    eng.live--;
    pthread_mutex_unlock(&eng.mu);
    if (was_full) {
        agentd_wake(); /* room for one more: the claimer waits for it */
    }
}

/* worker_main steps ready drives until the engine stops and the last drive is gone. */
static void *worker_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&eng.mu);
    for (;;) {
        int64_t next_timer = fire_timers(clock_mono_ms());
        struct engine_queue_item *it = engine_queue_pop(&eng.ready);
        if (it) {
            struct drive *d = DRIVE_OF(it, eng.ready);
            struct trace_ctx saved;
            d->eng.running = true;
            pthread_mutex_unlock(&eng.mu);
            trace_enter(drive_trace(d), &saved); /* its lines and calls carry its trace */
            bool done = drive_run(d);
            if (done) {
                retire(d); /* posts meanwhile are moot: nothing is left to step */
            }
            trace_leave(&saved);
            pthread_mutex_lock(&eng.mu);
            if (!done) {
                d->eng.running = false;
                if (d->eng.again) {
                    /* posted while it ran: this thread pops it (or an older drive) next, so
                     * another is woken only when more than that one is waiting */
                    d->eng.again = false;
                    if (engine_queue_push(&eng.ready, &d->eng.ready) && eng.ready.n > 1) {
                        pthread_cond_signal(&eng.work);
                    }
                }
            }
            continue;
        }
        if (eng.stopping && eng.claimer_done && eng.live == 0) {
            break;
        }
        struct timespec ts;
        int64_t wait = 1000;
        if (next_timer) {
            int64_t until = next_timer - clock_mono_ms();
            wait = until < 1 ? 1 : until < wait ? until : wait;
        }
        clock_deadline(&ts, wait);
        clock_cond_wait(&eng.work, &eng.mu, &ts);
    }
    pthread_cond_broadcast(&eng.work); /* the other workers see the end too */
    pthread_mutex_unlock(&eng.mu);
    return NULL;
}

/* resume_one claims a due interrupted submission again and admits its drive. Returns whether
 * there was one due. */
static bool resume_one(void)
{
    struct resume r;
    struct cf_error err;
    if (!take_due_resume(&r)) {
        return false;
    }
    if (driven_here(r.submission_id)) {
        return true; /* a drive here took it over meanwhile: never take it back */
    }
    int64_t next = r.delay_ms * 2 < RESUME_MAX_MS ? r.delay_ms * 2 : RESUME_MAX_MS;
    Cflue__V1__ClaimResponse *cl = NULL;
    /* This process's attempts carry its start (owner_started_at): asking by that, not by the
     * clock now, a wall clock set back since the start still finds them. */
    enum cf_status rc = claim(r.submission_id, started_ms + 1, &cl, &err);
    if (rc == CF_OK && cl->submission) {
        log_sub_info(cl->submission, "resumed", "submission=%s attempt=%s count=%d",
                     r.submission_id, cl->fence->attempt_id, cl->submission->attempt_count);
        admit(cl, next);
        return true;
    }
    if (rc == CF_UNAVAILABLE || rc == CF_BUSY) {
        /* storaged is away: no attempt was spent; ask again soon */
        resume_later(r.submission_id, r.attempt_id, r.epoch, r.delay_ms < 2000 ? r.delay_ms : 2000,
                     0);
    } else if (rc != CF_OK) {
        char q[600];
        log_warn("resume_dropped", "submission=%s err=%s", r.submission_id,
                 log_quote(q, sizeof(q), err.msg));
    }
    /* else: settled, or another process holds it now */
    if (cl) {
        protobuf_c_message_free_unpacked(&cl->base, NULL);
    }
    return true;
}

/* taken_from_self checks a claim made while reclaiming: one of this process's own drives holds
 * the submission when storaged's clock is behind this one's and a lease taken since the start
 * looked older. The claim made that drive's fence stale (it stops without writing); the claim
 * is not driven either, so the submission waits for its lease to run out. Reclaiming ends
 * there. Logs what it took back. */
static bool taken_from_self(const Cflue__V1__ClaimResponse *cl)
{
    if (driven_here(cl->submission->submission_id)) {
        log_warn("reclaim_stopped",
                 "submission=%s reason=\"a lease taken since the start looked older: the clocks "
                 "of agentd and storaged disagree\"",
                 cl->submission->submission_id);
        reclaim_before_ms = 0;
        return true;
    }
    if (cl->takeover) {
        log_sub_info(cl->submission, "reclaimed", "submission=%s", cl->submission->submission_id);
    }
    return false;
}

/* list_own calls each(submission) for this owner's submissions in one of n statuses (with an
 * abort intent only when abort_requested), a List page of 1000 at a time; false when storaged
 * did not answer (the caller asks again later). */
static bool list_own(const Cflue__V1__SubmissionStatus *statuses, size_t n, bool abort_requested,
                     void (*each)(const Cflue__V1__Submission *s))
{
    char *token = NULL;
    do {
        Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        struct cf_error err;
        lr.owner_id = (char *)g_agentd.owner_id;
        lr.abort_requested = abort_requested;
        lr.statuses = (Cflue__V1__SubmissionStatus *)statuses;
        lr.n_statuses = n;
        lr.page_size = 1000;
        lr.page_token = token ? token : "";
        enum cf_status rc = store_call(g_agentd.store, "List", &lr.base,
                                       &cflue__v1__list_response__descriptor, 5000, &resp, &err);
        free(token);
        token = NULL;
        if (rc != CF_OK) {
            return false;
        }
        const Cflue__V1__ListResponse *l = (const Cflue__V1__ListResponse *)resp;
        for (size_t i = 0; i < l->n_submissions; i++) {
            each(l->submissions[i]);
        }
        if (*l->next_page_token && l->n_submissions) {
            token = mem_strdup(l->next_page_token);
        }
        protobuf_c_message_free_unpacked(resp, NULL);
    } while (token);
    return true;
}

/* take_back_if_idle resumes s when no drive here holds it and no resume waits for it (one
 * check under one lock: a drive ending meanwhile puts its own resume first), once the claiming
 * Admits started so far have ended: one that claimed s may have its answer on the way, and the
 * resume then finds its drive here and leaves it alone. */
static void take_back_if_idle(const Cflue__V1__Submission *s)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool idle = !resume_find(s->submission_id) && !driven_here_locked(s->submission_id);
    if (idle) {
        resume_later_locked(s->submission_id, s->attempt_id, s->epoch, 0,
                            admit_gate_behind_now(&admits));
    }
    pthread_mutex_unlock(&g_agentd.mu);
    if (idle) {
        log_sub_info(s, "take_back", "submission=%s after=unanswered_claim", s->submission_id);
    }
}

/* take_back_unanswered_claims: a Claim, or an Admit with a claim, that got no answer (storaged
 * went away, or the deadline passed) may still have committed: its submission is then running
 * (or terminalizing, taken over) under this owner with no drive until the lease runs out.
 * After one, before claiming again, this owner's such submissions that no drive here holds are
 * resumed (engine_admitted does the same for a retried Submit's Admit). false when storaged
 * did not answer. */
static bool take_back_unanswered_claims(void)
{
    static const Cflue__V1__SubmissionStatus held[] = {
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING,
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING};
    return list_own(held, 2, false, take_back_if_idle);
}

/* claim_held admits one drive (a due resume, or a new claim: at first also the work this owner
 * held before the start), a slot held for it; returns whether it found something (the claimer
 * asks again at once). *wait_ms is how long to wait otherwise. */
static bool claim_held(int64_t *wait_ms)
{
    struct cf_error err;
    if (!reclaim_before_ms && atomic_exchange(&claims_unanswered, false)) {
        /* once (an unanswered List leaves it to the lease, as before), and not while the
         * previous process's work is being reclaimed: that would be taken back as this one's */
        (void)take_back_unanswered_claims();
    }
    if (resume_one()) {
        return true;
    }
    Cflue__V1__ClaimResponse *cl = NULL;
    enum cf_status rc = claim(NULL, reclaim_before_ms, &cl, &err);
    if (rc == CF_UNAVAILABLE) {
        atomic_store(&claims_unanswered, true);
    }
    if (rc == CF_OK && cl->submission && reclaim_before_ms && taken_from_self(cl)) {
        protobuf_c_message_free_unpacked(&cl->base, NULL);
        return true;
    }
    if (rc == CF_OK && (!cl->submission || !cl->takeover)) {
        /* storaged hands out takeovers before queued work: nothing of the previous process is
         * left to take back */
        reclaim_before_ms = 0;
    }
    if (rc == CF_OK && cl->submission) {
        admit(cl, RESUME_FIRST_MS);
        return true;
    }
    if (cl) {
        protobuf_c_message_free_unpacked(&cl->base, NULL);
    }
    note_claim_result(rc, &err);
    *wait_ms = rc == CF_OK ? CLAIM_POLL_MS : 1000;
    return false;
}

/* claim_some runs claim_held with a slot held, so that Admits claiming meanwhile see it
 * taken. */
static bool claim_some(int64_t *wait_ms)
{
    *wait_ms = CLAIM_POLL_MS;
    if (!slot_take()) {
        return false; /* a drive's end wakes the claimer; a stop or a drain ends the claims */
    }
    bool found = claim_held(wait_ms);
    slot_give_back();
    return found;
}

/* claimer_main claims while there is room, then waits for agentd_wake or the poll interval. */
static void *claimer_main(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&g_agentd.mu);
        bool stop = g_agentd.stopping;
        woken = false; /* a wake from now on means: look again */
        pthread_mutex_unlock(&g_agentd.mu);
        if (stop) {
            break;
        }
        int64_t wait_ms;
        if (claim_some(&wait_ms)) {
            continue;
        }
        struct timespec ts;
        clock_deadline(&ts, wait_ms);
        pthread_mutex_lock(&g_agentd.mu);
        if (!g_agentd.stopping && !woken) {
            clock_cond_wait(&g_agentd.wake, &g_agentd.mu, &ts);
        }
        pthread_mutex_unlock(&g_agentd.mu);
    }
    pthread_mutex_lock(&eng.mu);
    eng.claimer_done = true;
    pthread_cond_broadcast(&eng.work);
    pthread_mutex_unlock(&eng.mu);
    return NULL;
}

/* ---------- heartbeats and abort polling ---------- */

/* fences_of fills fences (and ptrs, pointing at them) with the fences of one call's share of
 * slots[first..n): at most PROTO_FENCES_MAX of them; returns how many. */
static size_t fences_of(const struct active *slots, size_t n, size_t first,
                        Cflue__V1__Fence *fences, Cflue__V1__Fence **ptrs)
{
    size_t k = n - first < PROTO_FENCES_MAX ? n - first : PROTO_FENCES_MAX;
    for (size_t i = 0; i < k; i++) {
        const struct active *a = &slots[first + i];
        cflue__v1__fence__init(&fences[i]);
        fences[i].submission_id = (char *)a->submission_id;
        fences[i].attempt_id = (char *)a->attempt_id;
        fences[i].epoch = a->epoch;
        ptrs[i] = &fences[i];
    }
    return k;
}

/* heartbeat_some renews the leases of ptrs[0..n) (at most PROTO_FENCES_MAX) in one call; lost
 * ones are marked, their model calls cancelled and their drives posted. Returns whether
 * storaged answered. */
static bool heartbeat_some(Cflue__V1__Fence **ptrs, size_t n)
{
    struct cf_error err;
    Cflue__V1__HeartbeatRequest hb = CFLUE__V1__HEARTBEAT_REQUEST__INIT;
    hb.owner_id = (char *)g_agentd.owner_id;
    Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
    pbdur_set(&lease, g_agentd.lease_ms);
    hb.lease_duration = &lease;
    hb.fences = ptrs;
    hb.n_fences = n;
    ProtobufCMessage *resp = NULL;
    bool ok = store_call(g_agentd.store, "Heartbeat", &hb.base,
                         &cflue__v1__heartbeat_response__descriptor, 10000, &resp, &err) == CF_OK;
    if (ok) {
        Cflue__V1__HeartbeatResponse *r = (Cflue__V1__HeartbeatResponse *)resp;
        for (size_t k = 0; k < r->n_lost; k++) {
            uint64_t cancel = 0;
            pthread_mutex_lock(&g_agentd.mu);
            for (int i = 0; i < g_agentd.active_used; i++) {
                struct active *a = &g_agentd.active[i];
                /* a drive whose Settle went out may be settled already: its Settle's answer,
                 * not the Heartbeat, says whether its lease was lost */
                if (a->in_use && !a->settle_sent && !strcmp(a->submission_id, r->lost[k])) {
                    struct trace_ctx t, saved;
                    struct cf_error ignored;
                    a->lease_lost = true;
                    cancel = kick_locked(a);
                    if (trace_parse(&t, a->traceparent, NULL, &ignored) != CF_OK) {
                        memset(&t, 0, sizeof(t));
                    }
                    trace_enter(&t, &saved); /* the drive's trace, on the heartbeat's thread */
                    log_warn("lease_lost", "submission=%s", r->lost[k]);
                    trace_leave(&saved);
                }
            }
            pthread_mutex_unlock(&g_agentd.mu);
            llm_cancel(cancel);
        }
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    return ok;
}

/* heartbeat renews the leases of snap[0..n), PROTO_FENCES_MAX at a time (more drives than that
 * are in flight at once). Returns whether storaged answered every call; it stops at the first
 * it did not answer (the next tick renews them all again). */
static bool heartbeat(const struct active *snap, int n)
{
    Cflue__V1__Fence *fences = mem_alloc(sizeof(*fences) * PROTO_FENCES_MAX);
    Cflue__V1__Fence **ptrs = mem_alloc(sizeof(void *) * PROTO_FENCES_MAX);
    bool ok = true;
    for (size_t first = 0, k; ok && first < (size_t)n; first += k) {
        k = fences_of(snap, (size_t)n, first, fences, ptrs);
        ok = heartbeat_some(ptrs, k);
    }
    free(fences);
    free(ptrs);
    return ok;
}

/* mark_if_fresh marks an abort intent on the drive here of s, when there is one that has not
 * heard of it yet. */
static void mark_if_fresh(const Cflue__V1__Submission *s)
{
    bool fresh = false;
    pthread_mutex_lock(&g_agentd.mu);
    for (int k = 0; k < g_agentd.active_used; k++) {
        struct active *a = &g_agentd.active[k];
        fresh = fresh ||
                (a->in_use && !a->abort_requested && !strcmp(a->submission_id, s->submission_id));
    }
    pthread_mutex_unlock(&g_agentd.mu);
    if (fresh) {
        agentd_mark_abort(s->submission_id);
    }
}

/* poll_aborts asks storaged which of this owner's running submissions have an abort intent
 * (aborts through this agentd's API arrive at once; this finds those asked through another
 * agentd). Not the settled ones: they keep their owner and intent for good. */
static void poll_aborts(void)
{
    static const Cflue__V1__SubmissionStatus held[] = {
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING,
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING};
    (void)list_own(held, 2, true, mark_if_fresh); /* unanswered: the next tick asks again */
}

/* heartbeat_main renews leases every heartbeat_ms and polls abort intents every tick. */
static void *heartbeat_main(void *arg)
{
    (void)arg;
    int64_t last_beat = 0;
    struct active *snap = mem_alloc(sizeof(*snap) * ACTIVE_MAX);
    for (;;) {
        pthread_mutex_lock(&g_agentd.mu);
        bool stop = g_agentd.stopping;
        int n = 0;
        for (int i = 0; i < g_agentd.active_used; i++) {
            if (g_agentd.active[i].in_use) {
                snap[n++] = g_agentd.active[i];
            }
        }
        pthread_mutex_unlock(&g_agentd.mu);
        if (stop) {
            break;
        }
        int64_t now = clock_mono_ms();
        if (n && now - last_beat >= g_agentd.heartbeat_ms && heartbeat(snap, n)) {
            last_beat = now;
        }
        if (n) {
            poll_aborts();
        }
        clock_sleep_ms(n ? 500 : 1000);
    }
    free(snap);
    return NULL;
}

/* ---------- start and stop ---------- */

bool engine_start(const struct daemon *d, long long workers)
{
    struct cf_error err;
    eng.threads = mem_alloc(sizeof(pthread_t) * (size_t)(workers + 2));
    eng.n_workers = workers;
    eng.n_started = 0;
    eng.claimer_done = false;
    enum cf_status rc = CF_OK;
    for (long long i = 0; i < workers && rc == CF_OK; i++) {
        rc = thread_start(&eng.threads[eng.n_started], "engine", 0, worker_main, NULL, &err);
        eng.n_started += rc == CF_OK;
    }
    if (rc == CF_OK) {
        rc = thread_start(&eng.threads[eng.n_started], "claimer", 0, claimer_main, NULL, &err);
        eng.n_started += rc == CF_OK;
    }
    if (rc == CF_OK) {
        rc = thread_start(&eng.threads[eng.n_started], "heartbeat", 0, heartbeat_main, NULL, &err);
        eng.n_started += rc == CF_OK;
    }
    if (rc == CF_OK) {
        return true;
    }
    char q[600];
    daemon_say(d, 1, "%s", err.msg);
    log_error("start_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
    engine_stop();
    if (eng.n_started <= workers) {
        pthread_mutex_lock(&eng.mu);
        eng.claimer_done = true; /* it never ran */
        pthread_cond_broadcast(&eng.work);
        pthread_mutex_unlock(&eng.mu);
    }
    engine_join();
    return false;
}

void engine_release_leases(void)
{
    size_t released = 0, lost = 0, failed = 0;
    Cflue__V1__Fence *fences = mem_alloc(sizeof(*fences) * PROTO_FENCES_MAX);
    Cflue__V1__Fence **ptrs = mem_alloc(sizeof(void *) * PROTO_FENCES_MAX);
    Google__Protobuf__Duration after = GOOGLE__PROTOBUF__DURATION__INIT;
    pbdur_set(&after, RELEASE_AFTER_MS);
    char q[600];
    hold_resumes();
    for (size_t first = 0, n; first < eng.n_held; first += n) {
        Cflue__V1__ReleaseRequest rr = CFLUE__V1__RELEASE_REQUEST__INIT;
        n = fences_of(eng.held, eng.n_held, first, fences, ptrs);
        rr.owner_id = (char *)g_agentd.owner_id;
        rr.fences = ptrs;
        rr.n_fences = n;
        rr.expire_after = &after;
        ProtobufCMessage *resp = NULL;
        struct cf_error err;
        if (store_call(g_agentd.store, "Release", &rr.base,
                       &cflue__v1__release_response__descriptor, RELEASE_TIMEOUT_MS, &resp,
                       &err) != CF_OK) {
            /* storaged does not answer: the next calls would wait as long; all run out */
            failed = eng.n_held - first;
            log_warn("leases_not_released", "n=%zu err=%s", failed,
                     log_quote(q, sizeof(q), err.msg));
            break;
        }
        Cflue__V1__ReleaseResponse *r = (Cflue__V1__ReleaseResponse *)resp;
        released += r->n_released;
        lost += r->n_lost;
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    if (eng.n_held) {
        log_info("leases_released", "released=%zu lost=%zu not_released=%zu", released, lost,
                 failed);
    }
    free(fences);
    free(ptrs);
    free(eng.held);
    eng.held = NULL;
    eng.n_held = eng.cap_held = 0;
}

void engine_join(void)
{
    for (long long i = 0; i < eng.n_started; i++) {
        pthread_join(eng.threads[i], NULL);
    }
    free(eng.threads);
    eng.threads = NULL;
    eng.n_started = 0;
    engine_queue_free(&eng.ready);
    engine_queue_free(&eng.timers);
}
