/* main.c - agentd: the public Agent API and the workers that drive submissions.
 *
 * Crash-only: all state is in storaged. Workers claim work (queued heads, and leases that
 * expired), heartbeat their leases, and poll abort intents every second. With a stable
 * --owner-id, a restarted agentd takes back its own unfinished work at once instead of
 * waiting for the leases to run out.
 *
 * A drive that storaged or toold interrupted (turn.c) is not settled: its submission goes on
 * the resume list, and a worker claims it again (own-owner reclaim of that one submission)
 * after a backoff of 1 s doubling to 30 s (at most 2 s while storaged cannot be reached),
 * until the claim succeeds or finds it settled or taken by someone else. Each such claim is a new
 * attempt and counts against max_attempts.
 */
#include "agentd.h"
#include "catalog.h"
#include "clients.h"
#include "clock.h"
#include "daemon.h"
#include "failpoint.h"
#include "log.h"
#include "mem.h"
#include "model_io.h"
#include "pbtime.h"
#include "thread.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct agentd g_agentd;

static const char usage[] =
    "usage: agentd --agents DIR [options]\n\n"
    "Serves cflue.v1.Agent (Submit, Watch, GetSubmission, Abort, Compact, ListAgents,\n"
    "GetConversation) "
    "and drives submissions: claims them from storaged, calls the agent's model (Anthropic\n"
    "Messages or OpenAI Chat Completions), runs its tools through toold, and settles each once.\n"
    "Model credentials come from ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL and OPENAI_API_KEY /\n"
    "OPENAI_BASE_URL. Also serves grpc.health.v1.Health.";

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

static void reclaim_own_work(void)
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

/* stop_all tells the workers to stop and every drive that it is stopping (recovery resumes
 * their work). */
static void stop_all(void)
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

/* agentd's own options (the shared ones are in struct daemon) */
struct agentd_opts {
    const char *store, *agents_dir, *owner, *models;
    long long workers, lease_ms, heartbeat_ms, model_timeout;
    bool no_stream;
};

/* load_definitions loads the agent definitions and the model catalog, warning about agents
 * whose model the catalog does not know. Prints why it failed. */
static bool load_definitions(const struct daemon *d, const struct agentd_opts *o)
{
    struct cf_error err;
    if (agents_load(o->agents_dir, &g_agentd.agents, &err) != CF_OK) {
        daemon_say(d, 1, "%s", err.msg);
        log_error("agents_invalid", "dir=%s", o->agents_dir);
        return false;
    }
    if (*o->models && catalog_load(o->models, &err) != CF_OK) {
        daemon_say(d, 1, "%s", err.msg);
        agents_free(&g_agentd.agents);
        return false;
    }
    for (size_t i = 0; i < g_agentd.agents.n; i++) {
        if (!catalog_lookup(g_agentd.agents.items[i].model).known) {
            log_warn("model_unknown",
                     "agent=%s model=%s msg=\"not in the catalog: using a 128k window, 8192 "
                     "output tokens and no price\"",
                     g_agentd.agents.items[i].name, g_agentd.agents.items[i].model);
        }
    }
    return true;
}

/* default_owner names this process for leases when --owner-id is not given: agentd, the host
 * and the listen address, with every character a lease owner may not hold turned into '_'. */
static const char *default_owner(char *out, size_t out_len, const char *listen)
{
    char host[128] = "host";
    gethostname(host, sizeof(host) - 1);
    snprintf(out, out_len, "agentd-%s-%s", host, listen);
    for (char *p = out; *p; p++) {
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '_' || *p == '.')) {
            *p = '_';
        }
    }
    return out;
}

/* set_engine fills in what the drives read from g_agentd: lease timing, streaming and the
 * model providers (credentials from the environment). */
static void set_engine(const struct agentd_opts *o)
{
    g_agentd.owner_id = o->owner;
    g_agentd.lease_ms = o->lease_ms;
    g_agentd.heartbeat_ms = o->heartbeat_ms;
    g_agentd.stream = !o->no_stream;
    const char *ab = getenv("ANTHROPIC_BASE_URL"), *ob = getenv("OPENAI_BASE_URL");
    g_agentd.anthropic =
        (struct provider_endpoint){.base_url = ab && *ab ? ab : "https://api.anthropic.com",
                                   .api_key = getenv("ANTHROPIC_API_KEY"),
                                   .timeout_ms = o->model_timeout};
    g_agentd.openai =
        (struct provider_endpoint){.base_url = ob && *ob ? ob : "https://api.openai.com/v1",
                                   .api_key = getenv("OPENAI_API_KEY"),
                                   .timeout_ms = o->model_timeout};
    pthread_mutex_init(&g_agentd.mu, NULL);
    pthread_cond_init(&g_agentd.wake, NULL);
}

/* start_drives starts the workers and the heartbeat (threads[workers]). When one cannot start
 * it stops those that did, prints and logs why and returns NULL (crash-only: the caller exits
 * non-zero and a restart resumes the work). */
static pthread_t *start_drives(const struct daemon *d, long long workers)
{
    struct cf_error err;
    pthread_t *threads = mem_alloc(sizeof(pthread_t) * (size_t)(workers + 1));
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
        return threads;
    }
    char q[600];
    daemon_say(d, 1, "%s", err.msg);
    log_error("start_failed", "err=%s", log_quote(q, sizeof(q), err.msg));
    stop_all();
    for (int i = 0; i < started; i++) {
        pthread_join(threads[i], NULL);
    }
    free(threads);
    return NULL;
}

/* close_clients releases what the drives used, after they stopped. */
static void close_clients(void)
{
    model_io_shutdown(); /* after the drives: none of them waits on a model call any more */
    rpc_channel_free(g_agentd.store);
    rpc_global_shutdown();
    curl_global_cleanup();
    agents_free(&g_agentd.agents);
    catalog_free();
}

int main(int argc, char **argv)
{
    struct daemon d = DAEMON_INIT("agentd", usage, "127.0.0.1:7100");
    struct agentd_opts o = {.store = "127.0.0.1:7101",
                            .agents_dir = "",
                            .owner = "",
                            .models = "",
                            .workers = 4,
                            .lease_ms = 30000,
                            .heartbeat_ms = 10000,
                            .model_timeout = 600000};
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(&d, "address to serve the Agent API on"),
        CONFIG_OPT_STRING("store", &o.store, "storaged address"),
        CONFIG_OPT_STRING("agents", &o.agents_dir, "directory of agent definitions (NAME.md)"),
        CONFIG_OPT_STRING("owner-id", &o.owner,
                          "stable name of this process for leases (default: host and port)"),
        CONFIG_OPT_INT("workers", &o.workers, 1, 1024, "submissions driven at once"),
        CONFIG_OPT_INT("lease-ms", &o.lease_ms, 500, 3600000, "lease on claimed work"),
        CONFIG_OPT_INT("heartbeat-ms", &o.heartbeat_ms, 100, 3600000, "lease renewal interval"),
        CONFIG_OPT_INT("model-timeout-ms", &o.model_timeout, 1000, 3600000, "one model call"),
        CONFIG_OPT_BOOL("no-stream", &o.no_stream, "ask providers for whole responses"),
        CONFIG_OPT_STRING("models", &o.models,
                          "model catalog JSON (context window, output limit, prices)"),
        DAEMON_OPT_PORT_FILE(&d, "write the bound TCP port here"),
        DAEMON_OPT_GRACE_MS(&d, "how long shutdown waits for calls"),
        DAEMON_OPT_MAX_QUEUE(&d,
                             "API calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"),
        DAEMON_OPT_LOG_LEVEL(&d),
    };
    int rc = daemon_configure(&d, opts, CONFIG_COUNT(opts), argc, argv);
    if (rc != DAEMON_RUN) {
        return rc;
    }
    if (!*o.agents_dir) {
        return daemon_say(&d, 2,
                          "--agents DIR is required (a directory of NAME.md agent definitions)");
    }
    if (o.heartbeat_ms * 2 > o.lease_ms) {
        o.heartbeat_ms = o.lease_ms / 3;
    }
    if (!load_definitions(&d, &o)) {
        return 1;
    }
    char owner[256];
    if (!*o.owner) {
        o.owner = default_owner(owner, sizeof(owner), d.listen);
    }
    set_engine(&o);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    rpc_global_init();
    g_agentd.store = rpc_channel_new(o.store, 64 << 20);

    struct rpc_server_opts ro = {.workers = 8, .max_threads = 1024, .max_queue = (int)d.max_queue};
    struct rpc_server *srv = rpc_server_new(&ro);
    api_register(srv);
    if (!daemon_serve(&d, srv)) {
        close_clients();
        return 1;
    }
    reclaim_own_work();
    pthread_t *threads = start_drives(&d, o.workers);
    if (!threads) {
        d.grace_ms = 0;
        daemon_stop_serving(&d);
        close_clients();
        return 1;
    }
    log_info("listening", "addr=%s port=%d store=%s agents=%zu owner=%s workers=%lld", d.listen,
             d.port, o.store, g_agentd.agents.n, o.owner, o.workers);

    daemon_wait_for_stop();
    stop_all();
    daemon_stop_serving(&d);
    for (int i = 0; i <= o.workers; i++) {
        pthread_join(threads[i], NULL);
    }
    free(threads);
    close_clients();
    log_info("stopped", "code=0");
    return 0;
}
