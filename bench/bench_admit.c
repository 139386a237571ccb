/* bench_admit - admissions per second through gRPC against the same inserts on SQLite.
 *
 * Baseline: ledger_admit run directly on a fresh database with storaged's schema and pragmas
 * (WAL, synchronous=FULL), one admission per transaction, as a program that embeds SQLite
 * would commit them. Measured: the same number of Admit RPCs to a real storaged process from
 * N concurrent client threads. Both runs happen in this process, one after the other, on the
 * same disk; the result is printed as a ratio (target: >= 0.5 at 16 clients).
 *
 * usage: bench_admit --storaged PATH [--count N] [--clients N] [--dir DIR]
 */
#include "clock.h"
#include "db.h"
#include "ledger.h"
#include "rpc.h"

#include "cflue/v1/store.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int count = 2000, clients = 16;
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

static double direct_rate(const char *dir)
{
    char path[512];
    struct cf_error err;
    sqlite3 *db;
    snprintf(path, sizeof(path), "%s/direct.db", dir);
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

static double grpc_rate(const char *storaged, const char *dir)
{
    char db[512], addr[600];
    snprintf(db, sizeof(db), "%s/served.db", dir);
    snprintf(addr, sizeof(addr), "unix:%s/s.sock", dir);
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
    int64_t t0 = clock_mono_ms();
    for (int i = 0; i < clients; i++) {
        pthread_create(&t[i], NULL, client_main, NULL);
    }
    for (int i = 0; i < clients; i++) {
        pthread_join(t[i], NULL);
    }
    int64_t ms = clock_mono_ms() - t0;
    free(t);
    rpc_channel_free(chan);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    return (count - failures) * 1000.0 / (double)(ms ? ms : 1);
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
        }
    }
    if (!storaged || count <= 0 || clients <= 0) {
        fprintf(stderr, "usage: bench_admit --storaged PATH [--count N] [--clients N] [--dir D]\n");
        return 2;
    }
    char tmpl[] = "/tmp/cflue-bench-XXXXXX";
    const char *dir = dir_arg ? dir_arg : mkdtemp(tmpl);
    rpc_global_init();
    double direct = direct_rate(dir);
    double served = grpc_rate(storaged, dir);
    rpc_global_shutdown();
    printf("admissions: %d, clients: %d, durability: WAL + synchronous=FULL\n", count, clients);
    printf("direct SQLite, one commit per admission: %9.0f /s\n", direct);
    printf("storaged over gRPC (group commit):       %9.0f /s\n", served);
    printf("ratio storaged/direct: %.2f (target >= 0.50)\n", served / direct);
    if (failures) {
        printf("failed admissions: %d\n", failures);
    }
    if (!dir_arg) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        if (system(cmd) != 0) {
            fprintf(stderr, "bench: could not remove %s\n", dir);
        }
    }
    return failures ? 1 : 0;
}
