/* engine.c - the scheduler of agentd's drives.
 *
 * Crash-only: all state is in storaged. Workers claim work (queued heads, and leases that
 * expired), heartbeat their leases, and poll abort intents every second. With a stable
 * --owner-id, a restarted agentd takes back its own unfinished work at once instead of
 * waiting for the leases to run out.
 *
 * A drive that storaged or toold interrupted (drive.c) is not settled: its submission goes on
 * the resume list, and a worker claims it again (own-owner reclaim of that one submission)
 * after a backoff of 1 s doubling to 30 s (at most 2 s while storaged cannot be reached),
 * until the claim succeeds or finds it settled or taken by someone else. Each such claim is a new
 * attempt and counts against max_attempts.
 */
#include "engine.h"
#include "agentd.h"
#include "clients.h"
#include "clock.h"
#include "log.h"
#include "mem.h"
#include "pbtime.h"
#include "thread.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void agentd_wake(void)
{
    pthread_mutex_lock(&g_agentd.mu);
    pthread_cond_broadcast(&g_agentd.wake);
    pthread_mutex_unlock(&g_agentd.mu);
}

bool agentd_mark_abort(const char *submission_id)
{
    bool here = false;
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < ACTIVE_MAX; i++) {
        struct active *a = &g_agentd.active[i];
        if (a->in_use && !strcmp(a->submission_id, submission_id)) {
            a->abort_requested = true;
            here = true;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return here;
}

/* Work this process held before it restarted, taken back at start-up (reclaim_own) before the
 * workers begin claiming anything else. */
static Cflue__V1__ClaimResponse *reclaimed[256];
static int n_reclaimed;

/* claim asks storaged for work under this process's owner id and lease: submission_id (NULL:
 * any queued or expired one), taking back this owner's own leases started before before_ms
 * (0: none). */
static enum cf_status claim(const char *submission_id, int64_t before_ms,
                            Cflue__V1__ClaimResponse **out, struct cf_error *err)
{
    Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
    Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
    Google__Protobuf__Timestamp before = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    ProtobufCMessage *resp = NULL;
    req.owner_id = (char *)g_agentd.owner_id;
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

void engine_reclaim_own(void)
{
    struct cf_error err;
    int64_t started = clock_now_ms();
    while (n_reclaimed < 256) {
        Cflue__V1__ClaimResponse *cl = NULL;
        if (claim(NULL, started, &cl, &err) != CF_OK) {
            if (cl) {
                protobuf_c_message_free_unpacked(&cl->base, NULL);
            }
            return;
        }
        if (!cl->submission) {
            protobuf_c_message_free_unpacked(&cl->base, NULL);
            return;
        }
        bool again = false;
        for (int i = 0; i < n_reclaimed; i++) {
            again = again ||
                    !strcmp(reclaimed[i]->submission->submission_id, cl->submission->submission_id);
        }
        if (again) { /* clocks disagree: never take one submission twice */
            protobuf_c_message_free_unpacked(&cl->base, NULL);
            return;
        }
        log_info("reclaimed", "submission=%s takeover=%d", cl->submission->submission_id,
                 (int)cl->takeover);
        reclaimed[n_reclaimed++] = cl;
    }
}

/* engine_stop tells the workers to stop and every drive that it is stopping (recovery resumes
 * their work). */
void engine_stop(void)
{
    pthread_mutex_lock(&g_agentd.mu);
    g_agentd.stopping = true;
    for (int i = 0; i < ACTIVE_MAX; i++) {
        g_agentd.active[i].shutting_down = true;
    }
    pthread_cond_broadcast(&g_agentd.wake);
    pthread_mutex_unlock(&g_agentd.mu);
}

/* driven_here reports whether a worker of this process holds the submission now. */
static bool driven_here(const char *submission_id)
{
    bool here = false;
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < ACTIVE_MAX && !here; i++) {
        here =
            g_agentd.active[i].in_use && !strcmp(g_agentd.active[i].submission_id, submission_id);
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return here;
}

/* Submissions whose drive was interrupted, to claim again when due. */
#define RESUME_MAX ACTIVE_MAX
#define RESUME_FIRST_MS 1000
#define RESUME_MAX_MS 30000
static struct resume {
    char submission_id[64];
    int64_t due_ms;   /* monotonic */
    int64_t delay_ms; /* the next backoff */
} resumes[RESUME_MAX];
static int n_resumes;

/* resume_later puts an interrupted submission on the resume list (or backs it off again). */
static void resume_later(const char *submission_id, int64_t delay_ms)
{
    pthread_mutex_lock(&g_agentd.mu);
    struct resume *r = NULL;
    for (int i = 0; i < n_resumes && !r; i++) {
        r = !strcmp(resumes[i].submission_id, submission_id) ? &resumes[i] : NULL;
    }
    if (!r && n_resumes < RESUME_MAX) {
        r = &resumes[n_resumes++];
        snprintf(r->submission_id, sizeof(r->submission_id), "%s", submission_id);
    }
    if (r) {
        r->delay_ms = delay_ms;
        r->due_ms = clock_mono_ms() + delay_ms + thread_jitter_ms(delay_ms / 4 + 1);
    }
    /* a full list leaves the rest to lease expiry: another claim takes them in time */
    pthread_mutex_unlock(&g_agentd.mu);
}

/* take_due_resume removes and returns a resume whose time has come. */
static bool take_due_resume(struct resume *out)
{
    bool found = false;
    int64_t now = clock_mono_ms();
    pthread_mutex_lock(&g_agentd.mu);
    for (int i = 0; i < n_resumes && !found; i++) {
        if (resumes[i].due_ms <= now) {
            *out = resumes[i];
            resumes[i] = resumes[--n_resumes];
            found = true;
        }
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return found;
}

/* after_drive files an interrupted drive for a later claim. */
static void after_drive(enum drive_end end, const char *submission_id, int64_t delay_ms)
{
    if (end == DRIVE_INTERRUPTED) {
        resume_later(submission_id, delay_ms);
    }
}

/* resume_one claims a due interrupted submission again and drives it. Returns whether there
 * was one due. */
static bool resume_one(void)
{
    struct resume r;
    struct cf_error err;
    if (!take_due_resume(&r)) {
        return false;
    }
    if (driven_here(r.submission_id)) {
        return true; /* another worker here took it over meanwhile: never take it back */
    }
    int64_t next = r.delay_ms * 2 < RESUME_MAX_MS ? r.delay_ms * 2 : RESUME_MAX_MS;
    Cflue__V1__ClaimResponse *cl = NULL;
    enum cf_status rc = claim(r.submission_id, clock_now_ms() + 1, &cl, &err);
    if (rc == CF_OK && cl->submission) {
        log_info("resumed", "submission=%s attempt=%s count=%d", r.submission_id,
                 cl->fence->attempt_id, cl->submission->attempt_count);
        after_drive(turn_drive(cl), r.submission_id, next);
    } else if (rc == CF_UNAVAILABLE || rc == CF_BUSY) {
        /* storaged is away: no attempt was spent; ask again soon */
        resume_later(r.submission_id, r.delay_ms < 2000 ? r.delay_ms : 2000);
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

static Cflue__V1__ClaimResponse *next_reclaimed(void)
{
    Cflue__V1__ClaimResponse *cl = NULL;
    pthread_mutex_lock(&g_agentd.mu);
    if (n_reclaimed > 0) {
        cl = reclaimed[--n_reclaimed];
    }
    pthread_mutex_unlock(&g_agentd.mu);
    return cl;
}

static void *worker_main(void *arg)
{
    struct cf_error err;
    for (;;) {
        pthread_mutex_lock(&g_agentd.mu);
        bool stop = g_agentd.stopping;
        pthread_mutex_unlock(&g_agentd.mu);
        if (stop) {
            return NULL;
        }
        Cflue__V1__ClaimResponse *own = next_reclaimed();
        if (own) {
            after_drive(turn_drive(own), own->submission->submission_id, RESUME_FIRST_MS);
            protobuf_c_message_free_unpacked(&own->base, NULL);
            continue;
        }
        if (resume_one()) {
            continue;
        }
        Cflue__V1__ClaimResponse *cl = NULL;
        enum cf_status rc = claim(NULL, 0, &cl, &err);
        if (rc == CF_OK && cl->submission) {
            after_drive(turn_drive(cl), cl->submission->submission_id, RESUME_FIRST_MS);
            protobuf_c_message_free_unpacked(&cl->base, NULL);
            continue;
        }
        if (cl) {
            protobuf_c_message_free_unpacked(&cl->base, NULL);
        }
        note_claim_result(rc, &err);
        struct timespec ts;
        clock_deadline(&ts, rc == CF_OK ? 500 : 1000);
        pthread_mutex_lock(&g_agentd.mu);
        if (!g_agentd.stopping) {
            pthread_cond_timedwait(&g_agentd.wake, &g_agentd.mu, &ts);
        }
        pthread_mutex_unlock(&g_agentd.mu);
    }
}

/* heartbeat_main renews leases every heartbeat_ms and polls abort intents every second. */
static void *heartbeat_main(void *arg)
{
    int64_t last_beat = 0;
    struct cf_error err;
    for (;;) {
        pthread_mutex_lock(&g_agentd.mu);
        bool stop = g_agentd.stopping;
        struct active snap[ACTIVE_MAX];
        int n = 0;
        for (int i = 0; i < ACTIVE_MAX; i++) {
            if (g_agentd.active[i].in_use) {
                snap[n++] = g_agentd.active[i];
            }
        }
        pthread_mutex_unlock(&g_agentd.mu);
        if (stop) {
            return NULL;
        }
        int64_t now = clock_mono_ms();
        if (n && now - last_beat >= g_agentd.heartbeat_ms) {
            Cflue__V1__HeartbeatRequest hb = CFLUE__V1__HEARTBEAT_REQUEST__INIT;
            Cflue__V1__Fence *fences = mem_alloc(sizeof(*fences) * (size_t)n);
            Cflue__V1__Fence **ptrs = mem_alloc(sizeof(void *) * (size_t)n);
            for (int i = 0; i < n; i++) {
                cflue__v1__fence__init(&fences[i]);
                fences[i].submission_id = snap[i].submission_id;
                fences[i].attempt_id = snap[i].attempt_id;
                fences[i].epoch = snap[i].epoch;
                ptrs[i] = &fences[i];
            }
            hb.owner_id = (char *)g_agentd.owner_id;
            Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
            pbdur_set(&lease, g_agentd.lease_ms);
            hb.lease_duration = &lease;
            hb.fences = ptrs;
            hb.n_fences = (size_t)n;
            ProtobufCMessage *resp = NULL;
            if (store_call(g_agentd.store, "Heartbeat", &hb.base,
                           &cflue__v1__heartbeat_response__descriptor, 10000, &resp,
                           &err) == CF_OK) {
                Cflue__V1__HeartbeatResponse *r = (Cflue__V1__HeartbeatResponse *)resp;
                pthread_mutex_lock(&g_agentd.mu);
                for (size_t k = 0; k < r->n_lost; k++) {
                    for (int i = 0; i < ACTIVE_MAX; i++) {
                        struct active *a = &g_agentd.active[i];
                        if (a->in_use && !strcmp(a->submission_id, r->lost[k])) {
                            a->lease_lost = true;
                            log_warn("lease_lost", "submission=%s", r->lost[k]);
                        }
                    }
                }
                pthread_mutex_unlock(&g_agentd.mu);
                protobuf_c_message_free_unpacked(resp, NULL);
                last_beat = now;
            }
            free(fences);
            free(ptrs);
        }
        for (int i = 0; i < n; i++) {
            if (snap[i].abort_requested) {
                continue;
            }
            Cflue__V1__GetRequest gr = CFLUE__V1__GET_REQUEST__INIT;
            ProtobufCMessage *resp = NULL;
            gr.submission_id = snap[i].submission_id;
            if (store_call(g_agentd.store, "Get", &gr.base, &cflue__v1__submission__descriptor,
                           5000, &resp, &err) == CF_OK) {
                if (((Cflue__V1__Submission *)resp)->abort_request_time) {
                    agentd_mark_abort(snap[i].submission_id);
                }
                protobuf_c_message_free_unpacked(resp, NULL);
            }
        }
        clock_sleep_ms(n ? 500 : 1000);
    }
}

static pthread_t *threads;
static long long n_threads;

bool engine_start(const struct daemon *d, long long workers)
{
    struct cf_error err;
    threads = mem_alloc(sizeof(pthread_t) * (size_t)(workers + 1));
    int started = 0;
    enum cf_status rc = CF_OK;
    for (; started < workers && rc == CF_OK; started++) {
        rc = thread_start(&threads[started], 0, worker_main, NULL, &err);
    }
    if (rc == CF_OK) {
        rc = thread_start(&threads[workers], 0, heartbeat_main, NULL, &err);
    } else {
        started--;
    }
    if (rc == CF_OK) {
        n_threads = workers + 1;
        return true;
    }
    char q[600];
    daemon_say(d, 1, "%s", err.msg);
    log_error("start_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
    engine_stop();
    for (int i = 0; i < started; i++) {
        pthread_join(threads[i], NULL);
    }
    free(threads);
    threads = NULL;
    return false;
}

void engine_join(void)
{
    for (long long i = 0; i < n_threads; i++) {
        pthread_join(threads[i], NULL);
    }
    free(threads);
    threads = NULL;
    n_threads = 0;
}
