/* main.c - agentd: the public Agent API (api.c) and the drives that carry submissions to
 * settlement (engine.c schedules them, drive.c drives one). Crash-only: all state is in
 * storaged; with a stable --owner-id a restarted agentd takes back its own unfinished work
 * at once (engine.c).
 */
#include "agentd.h"
#include "catalog.h"
#include "clients.h"
#include "clock.h"
#include "daemon.h"
#include "engine.h"
#include "failpoint.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "model_io.h"
#include "pbtime.h"
#include "placement.h"
#include "ready.h"
#include "settled_here.h"
#include "stats.h"
#include "thread.h"
#include "tokens.h"
#include "watch.h"

#include "grpc/health/v1/health.pb-c.h"

#include <curl/curl.h>
#include <inttypes.h>
#include <pthread.h>
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
    "OPENAI_BASE_URL. With --tokens every Agent call needs the metadata\n"
    "'authorization: Bearer <token>' of a token in the file (docs/security.md); grpc.health\n"
    "stays open. Also serves grpc.health.v1.Health.";

/* agentd's own options (the shared ones are in struct daemon) */
struct agentd_opts {
    const char *store, *agents_dir, *owner, *models, *tokens;
    long long workers, lease_ms, heartbeat_ms, model_timeout, model_stall, agents_poll_ms, drain_ms;
    long long keepalive_ms, replica_linger_ms, hold_writes_ms, watch_cache_mib, submit_mib;
    bool no_stream;
};

/* load_definitions loads the model catalog, then the agent definitions and their declared
 * skills (defs.c). Prints why it failed. */
static bool load_definitions(const struct daemon *d, const struct agentd_opts *o)
{
    struct cf_error err;
    if ((*o->models && catalog_load(o->models, &err) != CF_OK) ||
        defs_start(o->agents_dir, &err) != CF_OK) {
        daemon_say(d, 1, "%s", err.msg);
        log_error("agents_invalid", "dir=%s", o->agents_dir);
        catalog_free();
        return false;
    }
    return true;
}

/* The watch of --agents (and --tokens): a thread that reloads the definitions and the tokens
 * when SIGHUP asks or, every every_ms (0: never), when their files changed. Reloads run here, never
 * on the signal loop: one may wait seconds on tool servers, and SIGTERM must not wait for it. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    bool stop;
    bool hup; /* SIGHUP asked for a reload */
    long long every_ms;
    pthread_t thread;
    bool running;
} g_watch = {.mu = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static void *watch_definitions(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_watch.mu);
    while (!g_watch.stop) {
        if (!g_watch.hup && !g_watch.every_ms) {
            pthread_cond_wait(&g_watch.cond, &g_watch.mu);
        } else if (!g_watch.hup) {
            struct timespec until;
            clock_deadline(&until, g_watch.every_ms);
            clock_cond_wait(&g_watch.cond, &g_watch.mu, &until);
        }
        bool hup = g_watch.hup, polled = g_watch.every_ms > 0;
        g_watch.hup = false;
        if (!g_watch.stop && (hup || polled)) {
            pthread_mutex_unlock(&g_watch.mu);
            if (hup) {
                (void)defs_reload("sighup");
                (void)tokens_reload("sighup"); /* nothing without --tokens */
            } else {
                if (defs_changed()) {
                    (void)defs_reload("files_changed");
                }
                if (tokens_changed()) {
                    (void)tokens_reload("file_changed");
                }
            }
            pthread_mutex_lock(&g_watch.mu);
        }
    }
    pthread_mutex_unlock(&g_watch.mu);
    return NULL;
}

static void watch_stop(void)
{
    pthread_mutex_lock(&g_watch.mu);
    g_watch.stop = true;
    pthread_cond_signal(&g_watch.cond);
    pthread_mutex_unlock(&g_watch.mu);
    if (g_watch.running) {
        pthread_join(g_watch.thread, NULL);
        g_watch.running = false;
    }
}

/* reload_on_hup (SIGHUP): the watch loads the definitions again now. */
static void reload_on_hup(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_watch.mu);
    g_watch.hup = true;
    pthread_cond_signal(&g_watch.cond);
    pthread_mutex_unlock(&g_watch.mu);
}

#define OWNER_MAX 128 /* storaged's limit on a lease owner's name */

/* default_owner names this process for leases when --owner-id is not given: agentd, the host
 * and the listen address, with every character a lease owner may not hold turned into '_'.
 * A listen address on port 0 names no stable instance (every start binds another port, and
 * agentds started side by side would share the name, so each would take over the others'
 * running work as its own): the process id and start time are added, and a restart leaves the
 * old instance's work to lease expiry. A name over OWNER_MAX characters keeps its start and
 * ends with a hash of the whole. */
static const char *default_owner(char out[OWNER_MAX + 1], const char *listen)
{
    char host[128] = "host", name[512];
    gethostname(host, sizeof(host) - 1);
    size_t n = strlen(listen);
    if (n >= 2 && !strcmp(listen + n - 2, ":0")) {
        snprintf(name, sizeof(name), "agentd-%s-%s-%ld-%lld", host, listen, (long)getpid(),
                 (long long)clock_now_ms());
    } else {
        snprintf(name, sizeof(name), "agentd-%s-%s", host, listen);
    }
    for (char *p = name; *p; p++) {
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '_' || *p == '.')) {
            *p = '_';
        }
    }
    if (strlen(name) > OWNER_MAX) {
        snprintf(name + OWNER_MAX - 17, sizeof(name) - (OWNER_MAX - 17), "-%016" PRIx64,
                 ids_hash64(name));
    }
    snprintf(out, OWNER_MAX + 1, "%.*s", OWNER_MAX, name); /* fits: shortened above */
    return out;
}

/* set_engine fills in what the drives read from g_agentd: lease timing, streaming and the
 * model providers (credentials from the environment). */
static void set_engine(const struct agentd_opts *o)
{
    g_agentd.owner_id = o->owner;
    g_agentd.lease_ms = o->lease_ms;
    g_agentd.heartbeat_ms = o->heartbeat_ms;
    g_agentd.hold_writes_ms = o->hold_writes_ms;
    g_agentd.submit_mib = o->submit_mib;
    g_agentd.stream = !o->no_stream;
    const char *ab = getenv("ANTHROPIC_BASE_URL"), *ob = getenv("OPENAI_BASE_URL");
    g_agentd.anthropic =
        (struct provider_endpoint){.base_url = ab && *ab ? ab : "https://api.anthropic.com",
                                   .api_key = getenv("ANTHROPIC_API_KEY"),
                                   .timeout_ms = o->model_timeout,
                                   .stall_ms = o->model_stall};
    g_agentd.openai =
        (struct provider_endpoint){.base_url = ob && *ob ? ob : "https://api.openai.com/v1",
                                   .api_key = getenv("OPENAI_API_KEY"),
                                   .timeout_ms = o->model_timeout,
                                   .stall_ms = o->model_stall};
    pthread_mutex_init(&g_agentd.mu, NULL);
    pthread_cond_init(&g_agentd.wake, NULL);
}

/* storaged_answers is agentd's readiness: storaged's health says it serves the ledger. */
static bool storaged_answers(void *arg, char *why, size_t why_len)
{
    const char *addr = arg;
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = "cflue.v1.Store";
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    if (!rpc_unary(g_agentd.store, "/grpc.health.v1.Health/Check", &rq.base,
                   &grpc__health__v1__health_check_response__descriptor, READY_EVERY_MS, &resp,
                   &st)) {
        snprintf(why, why_len, "storaged at %s does not answer: %s", addr, st.details);
        return false;
    }
    bool serving = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status ==
                   GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    protobuf_c_message_free_unpacked(resp, NULL);
    if (!serving) {
        snprintf(why, why_len, "storaged at %s is not serving", addr);
    }
    return serving;
}

/* close_clients releases what the drives used, after they stopped. */
static void close_clients(void)
{
    model_io_shutdown(); /* after the drives: none of them waits on a model call any more */
    rpc_channel_free(g_agentd.store);
    rpc_global_shutdown();
    curl_global_cleanup();
    defs_stop();
    placement_stop(); /* after the definitions: nothing looks a replica up any more */
    catalog_free();
    tokens_stop();
}

/* release_memory (every 10 s): settled submissions are remembered for 10 to 20 s (long
 * enough for a client's GetSubmission right after the answer), so an idle agentd soon returns
 * to its idle size. */
static void release_memory(void *arg)
{
    (void)arg;
    here_forget_older(clock_mono_ms(), 10 * 1000);
}

/* start_serving_extras starts what runs beside the API once it serves (the definitions'
 * watch, the storaged readiness probe), logs the listening line and the auth mode, and
 * returns the probe (NULL: readiness stays SERVING, logged). */
static struct ready_probe *start_serving_extras(const struct daemon *d, const struct agentd_opts *o,
                                                struct rpc_server *srv, size_t n_agents)
{
    struct cf_error err;
    g_watch.every_ms = o->agents_poll_ms;
    if (thread_start(&g_watch.thread, "agents-watch", 0, watch_definitions, NULL, &err) == CF_OK) {
        g_watch.running = true;
    } else {
        char q[CF_ERROR_MSG_MAX + 8];
        log_warn("agents_watch_off", "err=%s note=\"definitions are not reloaded\"",
                 log_quote(q, sizeof(q), err.msg));
    }
    log_info("listening", "addr=%s port=%d store=%s agents=%zu owner=%s workers=%lld", d->listen,
             d->port, o->store, n_agents, o->owner, o->workers);
    if (tokens_enabled()) {
        log_info("auth_on", "tokens=%zu file=%s", tokens_count(), o->tokens);
    } else {
        log_warn("auth_off", "note=\"no --tokens: the Agent API serves every caller that reaches "
                             "it, and conversations record no principal\"");
    }
    struct ready_probe *ready =
        ready_start(srv, "storaged", storaged_answers, (void *)o->store, &err);
    if (!ready) {
        char q[CF_ERROR_MSG_MAX + 8];
        log_warn("ready_probe_off", "err=%s note=\"readiness stays SERVING\"",
                 log_quote(q, sizeof(q), err.msg));
    }
    return ready;
}

/* stop ends agentd in order: the probe (not ready from then on), the drain, the watch, the
 * engine's new work, the API (its grace), then the drives, and the clients last. */
static void stop(struct daemon *d, struct ready_probe *ready, int64_t drain_ms)
{
    ready_stop(ready);
    rpc_server_set_ready(d->server, false);
    engine_drain(drain_ms);
    watch_stop();
    int feeds, watchers;
    watch_counts(&feeds, &watchers);
    /* what Watch(follow) and GetSubmission(wait) held when the stop came: 0 and 0 once every
     * caller left (tests/integration/test_watch_outage.py reads it) */
    log_info("watch.counts", "feeds=%d watchers=%d", feeds, watchers);
    engine_stop();
    daemon_stop_serving(d);
    engine_join();
    engine_release_leases();
    close_clients();
    log_info("stopped", "code=0");
}

/* prepare checks what the options alone cannot, loads the definitions and the tokens and
 * names the owner (in owner when it is the default): DAEMON_RUN, or the exit status, said. */
static int prepare(struct daemon *d, struct agentd_opts *o, char owner[OWNER_MAX + 1])
{
    if (!*o->agents_dir) {
        return daemon_say(d, 2,
                          "--agents DIR is required (a directory of NAME.md agent definitions)");
    }
    if (o->heartbeat_ms * 2 > o->lease_ms) {
        o->heartbeat_ms = o->lease_ms / 3;
    }
    placement_set_linger_ms(o->replica_linger_ms); /* before the definitions' first lookups */
    watch_set_cache_bytes((size_t)o->watch_cache_mib << 20);
    if (!load_definitions(d, o)) {
        return 1;
    }
    struct cf_error err;
    if (tokens_start(o->tokens, &err) != CF_OK) {
        log_error("tokens_invalid", "file=%s", o->tokens);
        defs_stop();
        catalog_free();
        return daemon_say(d, 2, "%s", err.msg);
    }
    if (!*o->owner) {
        o->owner = default_owner(owner, d->listen);
    } else if (!ids_valid_name(o->owner, OWNER_MAX)) {
        return daemon_say(d, 2, "--owner-id must be 1 to %d characters of A-Z a-z 0-9 . _ -",
                          OWNER_MAX);
    }
    return DAEMON_RUN;
}

/* run serves the Agent API with the options main read until a stop signal: the exit status. */
static int run(struct daemon *d, struct agentd_opts *o)
{
    char owner[OWNER_MAX + 1];
    int rc = prepare(d, o, owner);
    if (rc != DAEMON_RUN) {
        return rc;
    }
    set_engine(o);
    stats_init();
    curl_global_init(CURL_GLOBAL_DEFAULT);
    rpc_global_init();
    rpc_set_keepalive_ms((int)o->keepalive_ms);
    g_agentd.store = rpc_channel_new(o->store, 64 << 20);
    struct cf_error err;
    struct agent_defs *defs = defs_get();
    enum cf_status checked = tool_servers_check(&defs->agents, &err);
    size_t n_agents = defs->agents.n;
    defs_put(defs);
    if (checked != CF_OK) {
        daemon_say(d, 1, "%s", err.msg);
        log_error("agents_invalid", "dir=%s", o->agents_dir);
        close_clients();
        return 1;
    }

    struct rpc_server_opts ro = {.workers = 8,
                                 .max_threads = 1024,
                                 .max_queue = (int)d->max_queue,
                                 .max_stream_memory = (int64_t)d->max_stream_mib << 20};
    struct rpc_server *srv = rpc_server_new(&ro);
    api_register(srv);
    engine_note_start();
    if (!daemon_serve(d, srv)) {
        close_clients();
        return 1;
    }
    if (!engine_start(d, o->workers)) {
        d->grace_ms = 0;
        daemon_stop_serving(d);
        close_clients();
        return 1;
    }
    struct ready_probe *ready = start_serving_extras(d, o, srv, n_agents);
    daemon_wait_for_stop_or_hup(release_memory, reload_on_hup, NULL);
    stop(d, ready, o->drain_ms);
    return 0;
}

int main(int argc, char **argv)
{
    struct daemon d = DAEMON_INIT("agentd", usage, "127.0.0.1:7100");
    struct agentd_opts o = {.store = "127.0.0.1:7101",
                            .agents_dir = "",
                            .owner = "",
                            .models = "",
                            .tokens = "",
                            .workers = 4,
                            .lease_ms = 30000,
                            .heartbeat_ms = 10000,
                            .model_timeout = 600000,
                            .model_stall = PROVIDER_STALL_MS,
                            .agents_poll_ms = 2000,
                            .keepalive_ms = 10000,
                            .hold_writes_ms = 50,
                            .submit_mib = 256,
                            .replica_linger_ms = PLACEMENT_LINGER_DEFAULT_MS,
                            .watch_cache_mib = WATCH_CACHE_DEFAULT >> 20};
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(&d, "address to serve the Agent API on"),
        CONFIG_OPT_STRING("store", &o.store, "storaged address"),
        CONFIG_OPT_STRING("agents", &o.agents_dir, "directory of agent definitions (NAME.md)"),
        CONFIG_OPT_INT("agents-poll-ms", &o.agents_poll_ms, 0, 3600000,
                       "how often to look for changed definitions and reload them (0: only on "
                       "SIGHUP)"),
        CONFIG_OPT_STRING("owner-id", &o.owner,
                          "stable name of this process for leases (default: host and listen "
                          "address; on port 0, pid and start time too)"),
        CONFIG_OPT_INT("workers", &o.workers, 1, 1024,
                       "engine threads that step drives (a drive waiting on the model holds none)"),
        CONFIG_OPT_INT("submit-memory-mib", &o.submit_mib, 1, 65536,
                       "MiB of messages the Submits waiting on storaged may hold; past it a "
                       "Submit is refused RESOURCE_EXHAUSTED"),
        CONFIG_OPT_INT("max-drives", &engine_max_drives, 1, ACTIVE_MAX,
                       "submissions in flight at once (not counting those waiting on their "
                       "task children)"),
        CONFIG_OPT_INT("lease-ms", &o.lease_ms, 500, 3600000, "lease on claimed work"),
        CONFIG_OPT_INT("heartbeat-ms", &o.heartbeat_ms, 100, 3600000, "lease renewal interval"),
        CONFIG_OPT_INT("model-timeout-ms", &o.model_timeout, 1000, 3600000, "one model call"),
        CONFIG_OPT_INT("model-stall-ms", &o.model_stall, 1000, 3600000,
                       "a streamed answer silent this long is a network failure, retried, and "
                       "so is one sending keep-alives only for five times this (a whole "
                       "answer, --no-stream, is bounded by --model-timeout-ms only)"),
        CONFIG_OPT_INT("hold-writes-ms", &o.hold_writes_ms, 0, 10000,
                       "how long the records a model call is asked with (the first turn's "
                       "input, a tool batch's last results) wait for its answer, to be stored "
                       "with it in one write (0: stored at once); a crash meanwhile loses them"),
        CONFIG_OPT_BOOL("no-stream", &o.no_stream, "ask providers for whole responses"),
        CONFIG_OPT_STRING("models", &o.models,
                          "model catalog JSON (context window, output limit, prices)"),
        CONFIG_OPT_STRING("tokens", &o.tokens,
                          "bearer tokens of the Agent API, YAML (name, sha256, agents, admin; "
                          "reloaded on SIGHUP and when it changes); unset: every caller is served"),
        DAEMON_OPT_PORT_FILE(&d, "write the bound TCP port here"),
        CONFIG_OPT_INT("drain-ms", &o.drain_ms, 0, 3600000,
                       "on SIGTERM, how long the drives in flight may run on to settle before "
                       "the rest are stopped and handed back (0: at once; a second SIGTERM "
                       "ends the wait)"),
        CONFIG_OPT_INT("watch-cache-mib", &o.watch_cache_mib, 0, 65536,
                       "records kept in memory for watchers catching up, every watched "
                       "conversation together (0: each delivered and let go; watchers behind "
                       "read from storaged)"),
        CONFIG_OPT_INT("replica-linger-ms", &o.replica_linger_ms, 0, 86400000,
                       "a toold replica that a lookup of a dns: sandbox.tools no longer finds "
                       "keeps its sandboxes this long (a pod restarting)"),
        CONFIG_OPT_INT("keepalive-ms", &o.keepalive_ms, 1000, 3600000,
                       "a connection with a call in flight (to storaged or a tool server, or "
                       "from an API client) is pinged after this long without word, and "
                       "dropped when the ping goes unanswered as long (a peer lost without a "
                       "reset)"),
        DAEMON_OPT_GRACE_MS(&d, "how long shutdown waits for calls"),
        DAEMON_OPT_MAX_QUEUE(&d,
                             "API calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"),
        DAEMON_OPT_MAX_STREAM_MEMORY(&d),
        DAEMON_OPT_LOG_LEVEL(&d),
        DAEMON_OPTS_TLS(&d),
        DAEMON_OPT_METRICS(&d),
        DAEMON_OPTS_PEER_TLS(&d),
    };
    int rc = daemon_configure(&d, opts, CONFIG_COUNT(opts), argc, argv);
    return rc == DAEMON_RUN ? run(&d, &o) : rc;
}
