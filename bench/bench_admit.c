/* bench_admit - admissions per second through gRPC against the same inserts on SQLite, and
 * Claim's latency as the queues grow.
 *
 * Admissions. Baseline: ledger_admit run directly on a fresh database with storaged's schema
 * and pragmas (WAL, synchronous=FULL), one admission per transaction, as a program that embeds
 * SQLite would commit them. Measured: the same number of Admit RPCs to a real storaged process
 * from N concurrent client threads (storaged commits Admits with synchronous=FULL too, and
 * answers each only after its transaction committed; concurrent ones share a commit). Both
 * runs happen in this process, one after the other, on the same disk; the result is printed
 * as a ratio (issue 8's target: >= 3 at 16 clients).
 *
 * Claim. For each queue size Q (100, 10,000, 100,000 unless --claim-sizes says otherwise), a
 * fresh database holds Q queued submissions: half behind the running heads of 4 conversations
 * (admitted first, so they come first in sequence order), half in Q/2 conversations of their
 * own. ledger_claim runs directly (no RPC) inside a savepoint rolled back after it, so every
 * measured Claim sees the same queue. The savepoints of a round share one transaction: a
 * ROLLBACK of the whole transaction after each Claim would also drop every page the Claim wrote
 * from SQLite's cache, and the next Claim would read them from the file again, a cost a
 * storaged that commits its Claims does not pay (measured that way, in the same minutes, each
 * Claim took about twice as long: 66-93 us against 35-43). storaged's writer runs each job in a
 * savepoint too; the connection has storaged's page cache (256 KiB). The median and p95 of 200
 * are printed, and beside them the walk over queued rows that Claim used before schema 3 (the
 * same query, timed alone). The databases are filled first, and the 200 Claims of each size are
 * taken in 5 rounds over all sizes, so that the machine's drift during the run weighs on every
 * size alike. Target: flat within 20% from the smallest to the largest queue. With --count
 * under 1000 (a smoke run) the sizes are 100 and 1,000 unless --claim-sizes says otherwise.
 *
 * usage: bench_admit --storaged PATH [--count N] [--clients N] [--dir DIR]
 *                    [--claim-sizes N,N,...] (0: skip the Claim part) [--json FILE]
 *
 * Its databases go in a new directory made in --dir (default $TMPDIR or /tmp: the disk the
 * figures are about), removed at the end, so every run starts from fresh files.
 *
 * --json FILE also writes the key figures, each with its baseline, ratio and target, as JSON
 * (the format bench/run reads: bench/README.md).
 */
#include "clock.h"
#include "db.h"
#include "ledger.h"
#include "rpc.h"

#include "cflue/v1/store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int count = 2000, clients = 16;
static const char *claim_sizes; /* default: 100,10000,100000 (100,1000 for a smoke run) */
static int rounds = 3;
static const char *json_path; /* --json FILE */
static struct rpc_channel *chan;
static int next_index;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int failures;

static void fill(Cflue__V1__AdmitRequest *req, Cflue__V1__Message *msg, char *conv, char *text,
                 int i)
{
    snprintf(conv, 32, "bench-%d", i % 64);
    snprintf(text, 64, "admission number %d", i);
    msg->text = text;
    req->agent = "bench";
    req->conversation_id = conv;
    req->message = msg;
}

static double direct_rate(const char *dir, int round)
{
    char path[512];
    struct cf_error err;
    sqlite3 *db;
    snprintf(path, sizeof(path), "%s/direct-%d.db", dir, round);
    if (db_open(path, true, &db, &err) != CF_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        exit(1);
    }
    struct ledger_config cfg = {.lease_ms = 30000, .timeout_ms = 3600000, .max_attempts = 10};
    int64_t t0 = clock_mono_ms();
    for (int i = 0; i < count; i++) {
        Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
        Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
        Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
        char conv[32], text[64];
        struct arena a;
        arena_init(&a);
        fill(&req, &msg, conv, text, i);
        struct ledger_ctx c = {.db = db, .arena = &a, .cfg = &cfg, .now = clock_now_ms()};
        if (db_exec(db, "BEGIN IMMEDIATE", &err) != CF_OK ||
            ledger_admit(&c, &req, &out, &err) != CF_OK || db_exec(db, "COMMIT", &err) != CF_OK) {
            fprintf(stderr, "bench: direct admit failed: %s\n", err.msg);
            exit(1);
        }
        arena_cleanup(&a);
    }
    int64_t ms = clock_mono_ms() - t0;
    sqlite3_close(db);
    return count * 1000.0 / (double)(ms ? ms : 1);
}

static void *client_main(void *arg)
{
    for (;;) {
        pthread_mutex_lock(&mu);
        int i = next_index++;
        pthread_mutex_unlock(&mu);
        if (i >= count) {
            return NULL;
        }
        Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
        Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
        char conv[32], text[64];
        ProtobufCMessage *resp;
        struct rpc_status st;
        fill(&req, &msg, conv, text, i);
        if (rpc_unary(chan, "/cflue.v1.Store/Admit", &req.base,
                      &cflue__v1__admit_response__descriptor, 30000, &resp, &st)) {
            protobuf_c_message_free_unpacked(resp, NULL);
        } else {
            pthread_mutex_lock(&mu);
            failures++;
            pthread_mutex_unlock(&mu);
        }
    }
}

/* cpu_ms returns the CPU time (user + system) process pid used so far, from /proc. */
static double cpu_ms(pid_t pid)
{
    char path[64], buf[1024];
    unsigned long long ut = 0, st = 0;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) {
        return 0;
    }
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* fields after the command name: state is field 3 */
    if (!p ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) {
        return 0;
    }
    return (double)(ut + st) * 1000.0 / (double)sysconf(_SC_CLK_TCK);
}

static double storaged_cpu_us, client_cpu_us; /* per admission, last run */

/* self_cpu_ms is this process's CPU time (all threads) so far. */
static double self_cpu_ms(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000.0 +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000.0;
}

static double grpc_rate(const char *storaged, const char *dir, int round)
{
    char db[512], addr[600];
    int failed_before = failures;
    snprintf(db, sizeof(db), "%s/served-%d.db", dir, round);
    snprintf(addr, sizeof(addr), "unix:%s/s-%d.sock", dir, round);
    next_index = 0;
    pid_t pid = fork();
    if (pid == 0) {
        execl(storaged, storaged, "--listen", addr, "--db", db, "--log-level", "warn", NULL);
        _exit(127);
    }
    chan = rpc_channel_new(addr, 0);
    for (int i = 0; i < 100; i++) {
        Grpc__Health__V1__HealthCheckRequest h = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        ProtobufCMessage *resp;
        struct rpc_status st;
        if (rpc_unary(chan, "/grpc.health.v1.Health/Check", &h.base,
                      &grpc__health__v1__health_check_response__descriptor, 1000, &resp, &st)) {
            protobuf_c_message_free_unpacked(resp, NULL);
            break;
        }
        clock_sleep_ms(100);
    }
    pthread_t *t = calloc((size_t)clients, sizeof(pthread_t));
    double cpu0 = cpu_ms(pid), self0 = self_cpu_ms();
    int64_t t0 = clock_mono_ms();
    for (int i = 0; i < clients; i++) {
        pthread_create(&t[i], NULL, client_main, NULL);
    }
    for (int i = 0; i < clients; i++) {
        pthread_join(t[i], NULL);
    }
    int64_t ms = clock_mono_ms() - t0;
    storaged_cpu_us = (cpu_ms(pid) - cpu0) * 1000.0 / count;
    client_cpu_us = (self_cpu_ms() - self0) * 1000.0 / count;
    free(t);
    rpc_channel_free(chan);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    return (count - (failures - failed_before)) * 1000.0 / (double)(ms ? ms : 1);
}

/* ---------- Claim latency ---------- */

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void admit_direct(struct ledger_ctx *c, const char *conv, int i)
{
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    char text[64];
    struct cf_error err;
    snprintf(text, sizeof(text), "queued %d", i);
    msg.text = text;
    req.agent = "bench";
    req.conversation_id = (char *)conv;
    req.message = &msg;
    if (ledger_admit(c, &req, &out, &err) != CF_OK) {
        fprintf(stderr, "bench: admit failed: %s\n", err.msg);
        exit(1);
    }
}

static void must(sqlite3 *db, const char *sql)
{
    struct cf_error err;
    if (db_exec(db, sql, &err) != CF_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        exit(1);
    }
}

/* fill_queue admits q submissions as the header says and claims the 4 busy heads. */
static void fill_queue(sqlite3 *db, struct ledger_config *cfg, int q)
{
    struct arena a;
    char conv[32];
    arena_init(&a);
    struct ledger_ctx c = {.db = db, .arena = &a, .cfg = cfg, .now = clock_now_ms()};
    int64_t t0 = now_us();
    must(db, "PRAGMA synchronous=OFF; PRAGMA cache_size=-262144");
    must(db, "BEGIN IMMEDIATE");
    for (int k = 0; k < 4; k++) {
        snprintf(conv, sizeof(conv), "busy-%d", k);
        admit_direct(&c, conv, -1);
        Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
        Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
        struct cf_error err;
        req.owner_id = "bench";
        req.conversation_id = conv;
        if (ledger_claim(&c, &req, &out, &err) != CF_OK || !out.submission) {
            fprintf(stderr, "bench: cannot claim the head of %s\n", conv);
            exit(1);
        }
    }
    for (int i = 0; i < q; i++) {
        if (i < q / 2) {
            snprintf(conv, sizeof(conv), "busy-%d", i % 4);
        } else {
            snprintf(conv, sizeof(conv), "lane-%d", i);
        }
        admit_direct(&c, conv, i);
        if (i % 10000 == 9999) {
            arena_cleanup(&a);
            arena_init(&a);
        }
    }
    must(db, "COMMIT");
    /* back to storaged's own settings (db_open) */
    must(db, "PRAGMA synchronous=FULL; PRAGMA cache_size=-256");
    arena_cleanup(&a);
    fprintf(stderr, "bench: %d queued in %.1f s\n", q, (double)(now_us() - t0) / 1e6);
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

#define CLAIM_RUNS 200

/* old_walk times the query Claim ran before schema 3 to find queued work, in microseconds. */
static int64_t old_walk_us(sqlite3 *db)
{
    sqlite3_stmt *st;
    int64_t t0 = now_us();
    if (sqlite3_prepare_v2(db,
                           "SELECT s.submission_id FROM submissions s WHERE s.status = 'queued' "
                           "AND NOT EXISTS (SELECT 1 FROM submissions p WHERE p.conversation_id = "
                           "s.conversation_id AND p.status IN ('queued','running','terminalizing',"
                           "'joining','joined') AND p.sequence < s.sequence) "
                           "ORDER BY s.sequence LIMIT 1",
                           -1, &st, NULL) != SQLITE_OK) {
        fprintf(stderr, "bench: %s\n", sqlite3_errmsg(db));
        exit(1);
    }
    int r = sqlite3_step(st);
    sqlite3_finalize(st);
    if (r != SQLITE_ROW) {
        fprintf(stderr, "bench: the old walk found nothing (%d)\n", r);
        exit(1);
    }
    return now_us() - t0;
}

#define CLAIM_ROUNDS 5
#define CLAIM_MAX_SIZES 16

/* One queue size of the Claim part: its database and its measured Claims. */
struct claim_queue {
    int q;
    sqlite3 *db;
    int n_runs;
    int64_t runs[CLAIM_RUNS];
};

/* leases outlive the run: a busy head taken over would be a different measurement */
static struct ledger_config claim_cfg = {
    .lease_ms = 36000000, .timeout_ms = 36000000, .max_attempts = 10};

/* claim_open makes cq's database (dir/claim-Q.db) and fills its queue. */
static void claim_open(const char *dir, struct claim_queue *cq)
{
    char path[512];
    struct cf_error err;
    snprintf(path, sizeof(path), "%s/claim-%d.db", dir, cq->q);
    if (db_open(path, true, &cq->db, &err) != CF_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        exit(1);
    }
    fill_queue(cq->db, &claim_cfg, cq->q);
}

/* claim_runs times n more Claims on cq's queue. */
static void claim_runs(struct claim_queue *cq, int n)
{
    struct cf_error err;
    must(cq->db, "BEGIN IMMEDIATE");
    for (int i = 0; i < n && cq->n_runs < CLAIM_RUNS; i++) {
        struct arena a;
        arena_init(&a);
        Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
        Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
        req.owner_id = "bench";
        must(cq->db, "SAVEPOINT claim");
        struct ledger_ctx c = {.db = cq->db, .arena = &a, .cfg = &claim_cfg, .now = clock_now_ms()};
        int64_t t0 = now_us();
        if (ledger_claim(&c, &req, &out, &err) != CF_OK || !out.submission ||
            strncmp(out.submission->conversation_id, "lane-", 5) != 0) {
            fprintf(stderr, "bench: claim on %d queued failed or took a busy row: %s %s\n", cq->q,
                    out.submission ? out.submission->conversation_id : "(none)",
                    out.submission ? "" : err.msg);
            exit(1);
        }
        cq->runs[cq->n_runs++] = now_us() - t0;
        must(cq->db, "ROLLBACK TO claim; RELEASE claim");
        arena_cleanup(&a);
    }
    must(cq->db, "ROLLBACK");
}

/* claim_report closes cq's database after timing the pre-schema-3 walk on it; prints one
 * line; returns the Claim median (us) and sets *walk_us to the walk's. */
static double claim_report(struct claim_queue *cq, double *walk_us)
{
    int64_t walks[5];
    for (int i = 0; i < 5; i++) {
        walks[i] = old_walk_us(cq->db);
    }
    sqlite3_close(cq->db);
    qsort(cq->runs, (size_t)cq->n_runs, sizeof(cq->runs[0]), cmp_i64);
    qsort(walks, 5, sizeof(walks[0]), cmp_i64);
    printf("  %7d queued: Claim median %6lld us, p95 %6lld us   (walk before schema 3: %lld us)\n",
           cq->q, (long long)cq->runs[cq->n_runs / 2], (long long)cq->runs[cq->n_runs * 95 / 100],
           (long long)walks[2]);
    *walk_us = (double)walks[2];
    return (double)cq->runs[cq->n_runs / 2];
}

/* What the Claim part measured, for --json: the first (smallest) queue, the slowest and the
 * last (largest). */
static struct {
    int ran, q_first, q_worst, q_last;
    double first, worst, last, last_walk;
} claim_res;

/* claim_part fills a database per queue size, then times Claims on them in CLAIM_ROUNDS
 * rounds, each taking its share of every size in turn, so that the machine's drift over the
 * minutes of the run (another process, the CPU's clock) falls on every size alike. */
static void claim_part(const char *dir)
{
    char sizes[256];
    static struct claim_queue queues[CLAIM_MAX_SIZES];
    double first = 0, worst = 0, walk = 0;
    int n = 0;
    snprintf(sizes, sizeof(sizes), "%s", claim_sizes);
    if (!strcmp(sizes, "0")) {
        return;
    }
    for (char *save = NULL, *tok = strtok_r(sizes, ",", &save); tok && n < CLAIM_MAX_SIZES;
         tok = strtok_r(NULL, ",", &save)) {
        queues[n].q = atoi(tok);
        claim_open(dir, &queues[n++]);
    }
    if (!n) {
        return;
    }
    printf("Claim latency (ledger_claim directly, each in a savepoint rolled back, %d runs "
           "per size in %d rounds over the sizes):\n",
           CLAIM_RUNS, CLAIM_ROUNDS);
    for (int r = 0; r < CLAIM_ROUNDS; r++) {
        for (int i = 0; i < n; i++) {
            claim_runs(&queues[i], CLAIM_RUNS / CLAIM_ROUNDS);
        }
    }
    for (int i = 0; i < n; i++) {
        double m = claim_report(&queues[i], &walk);
        first = i ? first : m;
        if (m > worst) {
            worst = m;
            claim_res.q_worst = queues[i].q;
        }
        claim_res.last = m;
        claim_res.last_walk = walk;
    }
    claim_res.ran = n > 0;
    claim_res.q_first = queues[0].q;
    claim_res.q_last = queues[n - 1].q;
    claim_res.first = first;
    claim_res.worst = worst;
    printf("largest / smallest-queue median: %.2f (target <= 1.20)\n", worst / (first ? first : 1));
}

/* remove_entry is nftw's callback removing each file, then its directory. */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    if (remove(path) != 0) {
        fprintf(stderr, "bench: could not remove %s: %s\n", path, strerror(errno));
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* json_figure writes one figure object (see bench/README.md); baseline < 0: none; target NULL:
 * none (meets is then left out). */
static void json_figure(FILE *f, bool *first, const char *id, const char *label, double value,
                        const char *unit, double baseline, const char *baseline_label, double ratio,
                        const char *target, bool meets)
{
    fprintf(f, "%s\n  {\"id\": \"%s\", \"label\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"",
            *first ? "" : ",", id, label, value, unit);
    if (baseline >= 0) {
        fprintf(f, ", \"baseline\": %.6g, \"baseline_label\": \"%s\", \"ratio\": %.6g", baseline,
                baseline_label, ratio);
    }
    if (target) {
        fprintf(f, ", \"target\": \"%s\", \"meets\": %s", target, meets ? "true" : "false");
    }
    fputc('}', f);
    *first = false;
}

/* write_json writes --json FILE: the admissions' medians and, when it ran, the Claim part. */
static void write_json(double direct, double served, double ratio, double cpu_us, double seconds)
{
    FILE *f = fopen(json_path, "w");
    bool first = true;
    char label[128], base[128];
    if (!f) {
        fprintf(stderr, "bench: cannot write %s\n", json_path);
        exit(1);
    }
    fprintf(f, "{\"bench\": \"bench_admit\", \"seconds\": %.1f, \"errors\": [", seconds);
    if (failures) {
        fprintf(f, "\"%d admissions failed\"", failures);
    }
    fprintf(f, "],\n\"figures\": [");
    snprintf(label, sizeof(label), "Admit/s, %d clients (group commit)", clients);
    json_figure(f, &first, "admit.rate", label, served, "/s", direct,
                "direct SQLite, a commit each", ratio, ">= 3x", ratio >= 3.0);
    json_figure(f, &first, "admit.storaged_cpu", "storaged CPU per Admit", cpu_us, "us", -1, "", 0,
                NULL, false);
    if (claim_res.ran) {
        /* the slowest queue size against the smallest, as the text's last line */
        snprintf(label, sizeof(label), "Claim median, %d queued (slowest)", claim_res.q_worst);
        snprintf(base, sizeof(base), "Claim median, %d queued", claim_res.q_first);
        double flat = claim_res.worst / (claim_res.first ? claim_res.first : 1);
        json_figure(f, &first, "claim.flat", label, claim_res.worst, "us", claim_res.first, base,
                    flat, "<= 1.2x", flat <= 1.20);
        snprintf(label, sizeof(label), "Claim median, %d queued", claim_res.q_last);
        json_figure(f, &first, "claim.vs_walk", label, claim_res.last, "us", claim_res.last_walk,
                    "walk before schema 3",
                    claim_res.last / (claim_res.last_walk ? claim_res.last_walk : 1), NULL, false);
    }
    fprintf(f, "\n]}\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "bench: cannot write %s\n", json_path);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    const char *storaged = NULL, *dir_arg = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--storaged")) {
            storaged = argv[i + 1];
        } else if (!strcmp(argv[i], "--count")) {
            count = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--clients")) {
            clients = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--dir")) {
            dir_arg = argv[i + 1];
        } else if (!strcmp(argv[i], "--rounds")) {
            rounds = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--claim-sizes")) {
            claim_sizes = argv[i + 1];
        } else if (!strcmp(argv[i], "--json")) {
            json_path = argv[i + 1];
        }
    }
    if (!storaged || count <= 0 || clients <= 0 || rounds <= 0 || rounds > 15) {
        fprintf(stderr, "usage: bench_admit --storaged PATH [--count N] [--clients N] [--dir D] "
                        "[--rounds N] [--claim-sizes N,N,...] [--json FILE]\n");
        return 2;
    }
    if (!claim_sizes) { /* a smoke run (ctest's bench/admit_smoke) keeps the Claim part short */
        claim_sizes = count < 1000 ? "100,1000" : "100,10000,100000";
    }
    const char *tmpdir = getenv("TMPDIR");
    if (!dir_arg) {
        dir_arg = tmpdir && *tmpdir ? tmpdir : "/tmp";
    }
    char dir[256]; /* room for the socket and database names beside it */
    if (snprintf(dir, sizeof(dir), "%s/cflue-bench-admit-XXXXXX", dir_arg) >= (int)sizeof(dir) ||
        strlen(dir) > 96) { /* a unix socket's path has 108 bytes */
        fprintf(stderr, "bench: --dir %s is too long (at most 70 characters)\n", dir_arg);
        return 2;
    }
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench: cannot make a directory in %s: %s\n", dir_arg, strerror(errno));
        return 2;
    }
    double direct[16], served[16], ratio[16], cpu[16];
    int64_t started = clock_mono_ms();
    printf("admissions: %d per run, clients: %d, durability: WAL + synchronous=FULL; %d rounds "
           "(direct then storaged in each, so both see the same disk)\n",
           count, clients, rounds);
    rpc_global_init();
    for (int r = 0; r < rounds; r++) {
        direct[r] = direct_rate(dir, r);
        served[r] = grpc_rate(storaged, dir, r);
        ratio[r] = served[r] / direct[r];
        cpu[r] = storaged_cpu_us;
        printf("  round %d: direct SQLite %7.0f /s, storaged over gRPC %7.0f /s, ratio %.2f "
               "(CPU per admission: storaged %.0f us, client %.0f us)\n",
               r + 1, direct[r], served[r], ratio[r], storaged_cpu_us, client_cpu_us);
        fflush(stdout);
    }
    rpc_global_shutdown();
    qsort(direct, (size_t)rounds, sizeof(double), cmp_double);
    qsort(served, (size_t)rounds, sizeof(double), cmp_double);
    qsort(ratio, (size_t)rounds, sizeof(double), cmp_double);
    qsort(cpu, (size_t)rounds, sizeof(double), cmp_double);
    printf("direct SQLite, one commit per admission: %9.0f /s (median)\n", direct[rounds / 2]);
    printf("storaged over gRPC (group commit):       %9.0f /s (median)\n", served[rounds / 2]);
    printf("ratio storaged/direct: %.2f (median of the rounds' ratios; target >= 3.00)\n",
           ratio[rounds / 2]);
    if (failures) {
        printf("failed admissions: %d\n", failures);
    }
    claim_part(dir);
    if (json_path) {
        write_json(direct[rounds / 2], served[rounds / 2], ratio[rounds / 2], cpu[rounds / 2],
                   (double)(clock_mono_ms() - started) / 1000.0);
    }
    nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return failures ? 1 : 0;
}
