/* placement.c - which toold replica holds a sandbox (see placement.h). */
#include "placement.h"

#include "clock.h"
#include "log.h"
#include "mem.h"
#include "thread.h"

#include <netdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define DNS_PREFIX "dns:"

typedef char replica_name[PLACEMENT_ADDRESS_MAX + 1];

/* One replica a lookup found: the name it is placed by, and the address it is reached at. */
struct found {
    replica_name name;  /* NAME:PORT of the reverse lookup (stable), else ip */
    replica_name addr;  /* what it is dialled at: its name (gRPC resolves it anew on each
                         * connect, so a pod back at a new address is found), else ip */
    replica_name ip;    /* the address just looked up, IP:PORT */
    bool named;         /* the reverse lookup answered */
    int64_t missing_ms; /* since when lookups miss it (linger); 0: this one found it */
};

/* A dns: spec and the replicas its last good lookup found. */
struct watched {
    char *spec;
    char host[PLACEMENT_ADDRESS_MAX + 1];
    char port[8];
    const char *names[PLACEMENT_REPLICAS_MAX];  /* interned, sorted */
    const char *addrs[PLACEMENT_REPLICAS_MAX];  /* interned, names[i]'s address */
    const char *ips[PLACEMENT_REPLICAS_MAX];    /* interned, the IP:PORT it was found at */
    int64_t missing_ms[PLACEMENT_REPLICAS_MAX]; /* since when lookups miss names[i]; 0: found */
    size_t n;
    bool looked_up; /* its first lookup has ended (found some or none) */
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* the refresh thread: stop, or a spec was added */
    pthread_cond_t looked; /* a round of lookups ended */
    unsigned added;        /* specs ever added: a change wakes the refresh thread */
    struct watched *watched;
    size_t n_watched;
    char **interned; /* every replica address handed out, for the process's life */
    size_t n_interned;
    bool started, stopping;
    int64_t linger_ms; /* placement_set_linger_ms */
    pthread_t thread;
} g = {.linger_ms = PLACEMENT_LINGER_DEFAULT_MS,
       .mu = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER,
       .looked = PTHREAD_COND_INITIALIZER};

/* intern returns the process-lifetime copy of s; under g.mu. */
static const char *intern(const char *s)
{
    for (size_t i = 0; i < g.n_interned; i++) {
        if (!strcmp(g.interned[i], s)) {
            return g.interned[i];
        }
    }
    g.interned = mem_realloc(g.interned, sizeof(*g.interned) * (g.n_interned + 1));
    return g.interned[g.n_interned++] = mem_strdup(s);
}

/* score is the rendezvous weight of sandbox on replica: FNV-1a over both (a 0 byte between),
 * then the splitmix64 finalizer so that near names spread over the whole range. */
static uint64_t score(const char *replica, const char *sandbox)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const char *p = replica; *p; p++) {
        h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
    }
    h = (h ^ 0) * 0x100000001b3ULL;
    for (const char *p = sandbox; *p; p++) {
        h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

/* best returns the index of the replica of names[0..n) that holds sandbox (-1 when n is 0);
 * a tie (never seen in practice) goes to the smaller name, so that every agentd decides
 * alike. */
static int best(const char *const *names, size_t n, const char *sandbox)
{
    int win = -1;
    uint64_t top = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = score(names[i], sandbox);
        if (win < 0 || s > top || (s == top && strcmp(names[i], names[win]) < 0)) {
            win = (int)i;
            top = s;
        }
    }
    return win;
}

/* split_list cuts a list spec into its entries (at most max, each at most
 * PLACEMENT_ADDRESS_MAX characters; longer ones are cut: placement_check refuses them). */
static size_t split_list(const char *spec, replica_name *out, size_t max)
{
    size_t n = 0;
    for (const char *p = spec; *p && n < max;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        snprintf(out[n++], sizeof(out[0]), "%.*s", (int)len, p);
        p += len + (end != NULL);
    }
    return n;
}

/* split_dns takes "dns:HOST:PORT" apart; false when it is not of that form. */
static bool split_dns(const char *spec, char *host, size_t host_len, char *port, size_t port_len)
{
    const char *rest = spec + strlen(DNS_PREFIX);
    const char *colon = strrchr(rest, ':');
    if (!colon || colon == rest || !colon[1] || strlen(colon + 1) >= port_len ||
        (size_t)(colon - rest) >= host_len) {
        return false;
    }
    for (const char *p = colon + 1; *p; p++) {
        if (*p < '0' || *p > '9') {
            return false;
        }
    }
    long v = strtol(colon + 1, NULL, 10);
    if (v < 1 || v > 65535) {
        return false;
    }
    snprintf(host, host_len, "%.*s", (int)(colon - rest), rest);
    snprintf(port, port_len, "%s", colon + 1);
    return true;
}

enum cf_status placement_check(const char *spec, char *why, size_t n)
{
    if (!strncmp(spec, DNS_PREFIX, strlen(DNS_PREFIX))) {
        char host[PLACEMENT_ADDRESS_MAX + 1], port[8];
        if (!split_dns(spec, host, sizeof(host), port, sizeof(port))) {
            snprintf(why, n, "'%.200s' is not dns:NAME:PORT (a port from 1 to 65535)", spec);
            return CF_INVALID;
        }
        return CF_OK;
    }
    if (!strchr(spec, ',')) {
        return CF_OK; /* one toold: any address gRPC takes */
    }
    replica_name names[PLACEMENT_REPLICAS_MAX];
    size_t k = 0;
    for (const char *p = spec;; p++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (k == PLACEMENT_REPLICAS_MAX) {
            snprintf(why, n, "more than %d replicas", PLACEMENT_REPLICAS_MAX);
            return CF_INVALID;
        }
        if (len == 0 || len > PLACEMENT_ADDRESS_MAX || memchr(p, ' ', len) ||
            !strncmp(p, DNS_PREFIX, strlen(DNS_PREFIX))) {
            snprintf(why, n, "replica %zu: '%.*s' is not an address (at most %d characters)", k,
                     (int)(len < 200 ? len : 200), p, PLACEMENT_ADDRESS_MAX);
            return CF_INVALID;
        }
        snprintf(names[k], sizeof(names[k]), "%.*s", (int)len, p);
        for (size_t j = 0; j < k; j++) {
            if (!strcmp(names[k], names[j])) {
                snprintf(why, n, "replica %zu: %s is listed twice", k, names[k]);
                return CF_INVALID;
            }
        }
        k++;
        if (!end) {
            return CF_OK;
        }
        p = end;
    }
}

static int name_order(const void *a, const void *b)
{
    return strcmp(((const struct found *)a)->name, ((const struct found *)b)->name);
}

/* resolve looks host up and names each address found by its reverse lookup, or by the address
 * itself; sorted by name, one per name. Returns how many (0: the lookup failed or found none). */
static size_t resolve(const char *host, const char *port, struct found *out, size_t max)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0) {
        return 0;
    }
    size_t n = 0;
    for (struct addrinfo *ai = res; ai && n < max; ai = ai->ai_next) {
        char ip[NI_MAXHOST], name[NI_MAXHOST];
        if (getnameinfo(ai->ai_addr, ai->ai_addrlen, ip, sizeof(ip), NULL, 0, NI_NUMERICHOST)) {
            continue;
        }
        bool named =
            getnameinfo(ai->ai_addr, ai->ai_addrlen, name, sizeof(name), NULL, 0, NI_NAMEREQD) == 0;
        struct found f = {.named = named};
        bool v6 = ai->ai_family == AF_INET6;
        int len = snprintf(f.ip, sizeof(f.ip), "%s%s%s:%s", v6 ? "[" : "", ip, v6 ? "]" : "", port);
        int nlen = named ? snprintf(f.name, sizeof(f.name), "%s:%s", name, port)
                         : snprintf(f.name, sizeof(f.name), "%s", f.ip);
        if (len >= (int)sizeof(f.ip) || nlen >= (int)sizeof(f.name)) {
            continue;
        }
        memcpy(f.addr, f.name, sizeof(f.addr));
        bool seen = false;
        for (size_t i = 0; i < n && !seen; i++) {
            seen = !strcmp(out[i].name, f.name);
        }
        if (!seen) {
            out[n++] = f;
        }
    }
    freeaddrinfo(res);
    qsort(out, n, sizeof(*out), name_order);
    return n;
}

/* keep_names gives the replicas a reverse lookup failed to name this time the names their
 * addresses had: a passing DNS fault must not move sandboxes between replicas. found stays
 * sorted by name. */
static void keep_names(const struct watched *w, struct found *found, size_t n)
{
    bool renamed = false;
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < w->n && !found[i].named; j++) {
            if (!strcmp(found[i].ip, w->ips[j]) && strcmp(w->names[j], w->ips[j]) != 0) {
                snprintf(found[i].name, sizeof(found[i].name), "%s", w->names[j]);
                snprintf(found[i].addr, sizeof(found[i].addr), "%s", w->addrs[j]);
                found[i].named = renamed = true;
            }
        }
    }
    if (renamed) {
        qsort(found, n, sizeof(*found), name_order);
    }
}

/* linger adds to found (n of them, sorted by name; room for PLACEMENT_REPLICAS_MAX) the
 * replicas w knew that this lookup did not find, until g.linger_ms after the first lookup that
 * missed each (a lookup that found nothing starts that time again: see store): a toold pod
 * that a rolling restart takes out of DNS for a moment keeps its sandboxes (the drives that
 * need it wait for it: drive.c) instead of having them placed anew on a replica where their
 * workspaces are not. Logs a replica missing for the first time, and one given up. Returns
 * the new n, found sorted by name again. */
static size_t linger(const struct watched *w, struct found *found, size_t n, int64_t now)
{
    size_t found_n = n;
    for (size_t j = 0; j < w->n; j++) {
        bool there = false;
        for (size_t i = 0; i < found_n && !there; i++) {
            there = !strcmp(found[i].name, w->names[j]);
        }
        if (there) {
            continue;
        }
        int64_t since = w->missing_ms[j] ? w->missing_ms[j] : now;
        if (now - since >= g.linger_ms || n == PLACEMENT_REPLICAS_MAX) {
            log_warn("toold_replica_dropped",
                     "spec=%s replica=%s missing_ms=%lld note=\"its sandboxes are placed on the "
                     "replicas left\"",
                     w->spec, w->names[j], (long long)(now - since));
            continue;
        }
        if (!w->missing_ms[j]) {
            log_warn("toold_replica_missing",
                     "spec=%s replica=%s linger_ms=%lld note=\"no longer in DNS: its sandboxes "
                     "stay placed on it until it is back or the time is up\"",
                     w->spec, w->names[j], (long long)g.linger_ms);
        }
        struct found f = {.named = true, .missing_ms = since};
        snprintf(f.name, sizeof(f.name), "%s", w->names[j]);
        snprintf(f.addr, sizeof(f.addr), "%s", w->addrs[j]);
        snprintf(f.ip, sizeof(f.ip), "%s", w->ips[j]);
        found[n++] = f;
    }
    if (n > found_n) {
        qsort(found, n, sizeof(*found), name_order);
    }
    return n;
}

/* store puts what a lookup of w found in force (nothing found: the replicas known stay, and
 * those missing start their linger again, so that only lookups that answered without a
 * replica for a whole linger give it up, never a DNS outage; a replica not found lingers: see
 * linger) and logs a change; under g.mu. */
static void store(struct watched *w, struct found *found, size_t n)
{
    if (n == 0) {
        if (w->n) {
            log_warn("toold_replicas_unresolved",
                     "spec=%s known=%zu note=\"the lookup found none: the replicas known stay\"",
                     w->spec, w->n);
        }
        int64_t now = clock_mono_ms();
        for (size_t i = 0; i < w->n; i++) {
            w->missing_ms[i] = w->missing_ms[i] ? now : 0;
        }
        return;
    }
    keep_names(w, found, n);
    n = linger(w, found, n, clock_mono_ms());
    bool same = n == w->n;
    for (size_t i = 0; same && i < n; i++) {
        same = !strcmp(found[i].name, w->names[i]) && !strcmp(found[i].ip, w->ips[i]);
    }
    for (size_t i = 0; i < n; i++) {
        w->missing_ms[i] = found[i].missing_ms;
    }
    if (same) {
        return;
    }
    char list[1024] = "";
    for (size_t i = 0, len = 0; i < n; i++) {
        w->names[i] = intern(found[i].name);
        w->addrs[i] = intern(found[i].addr);
        w->ips[i] = intern(found[i].ip);
        if (len < sizeof(list)) {
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s=%s", i ? "," : "",
                                    found[i].name, found[i].ip);
        }
    }
    log_info("toold_replicas", "spec=%s replicas=%zu was=%zu list=%s", w->spec, n, w->n, list);
    w->n = n;
}

/* lookup_all looks every watched spec up once and puts what it found in force; under g.mu,
 * which it drops around each lookup (one may take seconds). */
static void lookup_all(void)
{
    for (size_t i = 0; i < g.n_watched && !g.stopping; i++) {
        char host[sizeof(g.watched[i].host)], port[sizeof(g.watched[i].port)];
        memcpy(host, g.watched[i].host, sizeof(host));
        memcpy(port, g.watched[i].port, sizeof(port));
        pthread_mutex_unlock(&g.mu);
        struct found found[PLACEMENT_REPLICAS_MAX];
        size_t n = resolve(host, port, found, PLACEMENT_REPLICAS_MAX);
        pthread_mutex_lock(&g.mu);
        struct watched *w = &g.watched[i]; /* entries are only ever added, never moved out */
        store(w, found, n);
        if (!w->looked_up && n == 0) {
            log_warn("toold_replicas_unresolved",
                     "spec=%s note=\"no replica found yet: looked up again every %d ms\"", w->spec,
                     PLACEMENT_REFRESH_MS);
        }
        w->looked_up = true;
    }
    pthread_cond_broadcast(&g.looked);
}

static void *refresh_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g.mu);
    while (!g.stopping) {
        unsigned added = g.added;
        lookup_all();
        struct timespec until;
        clock_deadline(&until, PLACEMENT_REFRESH_MS);
        while (!g.stopping && g.added == added && clock_cond_wait(&g.wake, &g.mu, &until) == 0) {
        }
    }
    pthread_cond_broadcast(&g.looked);
    pthread_mutex_unlock(&g.mu);
    return NULL;
}

/* find returns the watched entry of spec, or NULL; under g.mu. */
static struct watched *find(const char *spec)
{
    for (size_t i = 0; i < g.n_watched; i++) {
        if (!strcmp(g.watched[i].spec, spec)) {
            return &g.watched[i];
        }
    }
    return NULL;
}

void placement_watch(const char *spec)
{
    char host[PLACEMENT_ADDRESS_MAX + 1], port[8];
    if (strncmp(spec, DNS_PREFIX, strlen(DNS_PREFIX)) ||
        !split_dns(spec, host, sizeof(host), port, sizeof(port))) {
        return;
    }
    pthread_mutex_lock(&g.mu);
    if (find(spec) || g.stopping) {
        pthread_mutex_unlock(&g.mu);
        return;
    }
    /* the refresh thread reads entries by index under g.mu: growing the array is safe */
    g.watched = mem_realloc(g.watched, sizeof(*g.watched) * (g.n_watched + 1));
    struct watched *w = &g.watched[g.n_watched++];
    memset(w, 0, sizeof(*w));
    w->spec = mem_strdup(spec);
    memcpy(w->host, host, sizeof(w->host));
    memcpy(w->port, port, sizeof(w->port));
    g.added++;
    if (!g.started) {
        struct cf_error err;
        g.started = thread_start(&g.thread, "placement", 0, refresh_main, NULL, &err) == CF_OK;
        if (!g.started) {
            log_error("placement_thread_failed",
                      "err=%s note=\"replicas are looked up once, now, and not again\"", err.msg);
            lookup_all();
        }
    }
    pthread_cond_broadcast(&g.wake);
    pthread_mutex_unlock(&g.mu);
}

/* await_first_lookup waits (at most PLACEMENT_FIRST_LOOKUP_MS) until spec's first lookup has
 * ended, so that a drive claimed just after start finds the replicas, and returns its entry
 * (found anew: the array may have grown while g.mu was dropped); under g.mu. */
static struct watched *await_first_lookup(const char *spec)
{
    struct timespec until;
    clock_deadline(&until, PLACEMENT_FIRST_LOOKUP_MS);
    struct watched *w;
    while ((w = find(spec)) && !w->looked_up && g.started && !g.stopping &&
           clock_cond_wait(&g.looked, &g.mu, &until) == 0) {
    }
    return w;
}

/* replicas_locked fills names and addrs with spec's replicas known now (at most max) and
 * returns how many there are; under g.mu. */
static size_t replicas_locked(const char *spec, const char **names, const char **addrs,
                              bool *missing, size_t max)
{
    size_t n = 0;
    if (!strncmp(spec, DNS_PREFIX, strlen(DNS_PREFIX))) {
        struct watched *w = await_first_lookup(spec);
        for (size_t i = 0; w && i < w->n; i++, n++) {
            if (n < max) {
                names[n] = w->names[i];
                addrs[n] = w->addrs[i];
                missing[n] = w->missing_ms[i] != 0;
            }
        }
    } else if (strchr(spec, ',')) {
        replica_name list[PLACEMENT_REPLICAS_MAX];
        size_t k = split_list(spec, list, PLACEMENT_REPLICAS_MAX);
        for (size_t i = 0; i < k; i++, n++) {
            if (n < max) {
                names[n] = addrs[n] = intern(list[i]);
                missing[n] = false;
            }
        }
    } else {
        if (max) {
            names[0] = addrs[0] = spec;
            missing[0] = false;
        }
        n = 1;
    }
    return n;
}

size_t placement_replicas(const char *spec, const char **out, size_t max)
{
    const char *names[PLACEMENT_REPLICAS_MAX];
    bool missing[PLACEMENT_REPLICAS_MAX];
    pthread_mutex_lock(&g.mu);
    size_t n = replicas_locked(spec, names, out, missing,
                               max < PLACEMENT_REPLICAS_MAX ? max : PLACEMENT_REPLICAS_MAX);
    pthread_mutex_unlock(&g.mu);
    return n;
}

const char *placement_pick(const char *spec, const char *sandbox, bool *missing)
{
    bool away = false;
    const char *addr = spec;
    if (!strncmp(spec, DNS_PREFIX, strlen(DNS_PREFIX)) || strchr(spec, ',')) {
        const char *names[PLACEMENT_REPLICAS_MAX], *addrs[PLACEMENT_REPLICAS_MAX];
        bool gone[PLACEMENT_REPLICAS_MAX];
        pthread_mutex_lock(&g.mu);
        size_t n = replicas_locked(spec, names, addrs, gone, PLACEMENT_REPLICAS_MAX);
        int i = best(names, n < PLACEMENT_REPLICAS_MAX ? n : PLACEMENT_REPLICAS_MAX, sandbox);
        pthread_mutex_unlock(&g.mu);
        addr = i < 0 ? NULL : addrs[i];
        away = i >= 0 && gone[i];
    }
    if (missing) {
        *missing = away;
    }
    return addr;
}

void placement_set_linger_ms(int64_t ms)
{
    pthread_mutex_lock(&g.mu);
    g.linger_ms = ms;
    pthread_mutex_unlock(&g.mu);
}

void placement_stop(void)
{
    pthread_mutex_lock(&g.mu);
    g.stopping = true;
    bool started = g.started;
    pthread_cond_broadcast(&g.wake);
    pthread_mutex_unlock(&g.mu);
    if (started) {
        pthread_join(g.thread, NULL);
    }
    for (size_t i = 0; i < g.n_watched; i++) {
        free(g.watched[i].spec);
    }
    free(g.watched);
    for (size_t i = 0; i < g.n_interned; i++) {
        free(g.interned[i]);
    }
    free(g.interned);
    g.watched = NULL;
    g.interned = NULL;
    g.n_watched = g.n_interned = 0;
}
