/* main.c - storaged: the durable ledger daemon.
 *
 * Crash-only: start-up is recovery. SQLite replays its WAL on open; every state lives in the
 * database, so a storaged killed at any moment restarts into a consistent ledger. Leases that
 * ran out while it was down are found by ScanExpired and Claim.
 */
#include "clock.h"
#include "config.h"
#include "daemon.h"
#include "db.h"
#include "failpoint.h"
#include "ledger.h"
#include "log.h"
#include "rpc.h"
#include "service.h"
#include "writer.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: storaged [options]\n\n"
    "Serves cflue.v1.Store: the submission ledger and the conversation record streams, in one\n"
    "SQLite database (WAL; synchronous=FULL for admissions, settlements, abort intents, joins\n"
    "and input stamps, NORMAL for the rest: see docs/storaged.md). Also serves\n"
    "grpc.health.v1.Health.";

static void log_startup_state(const char *path)
{
    sqlite3 *db;
    struct cf_error err;
    if (db_open(path, false, &db, &err) != CF_OK) {
        return;
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db,
                           "SELECT (SELECT count(*) FROM submissions WHERE status != 'settled'),"
                           " (SELECT count(*) FROM submissions WHERE status IN "
                           "('running','terminalizing') AND lease_expires_at < ?),"
                           " (SELECT count(*) FROM conversations)",
                           -1, &st, NULL) == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, clock_now_ms());
        if (sqlite3_step(st) == SQLITE_ROW) {
            log_info("recovered", "unsettled=%d expired_leases=%d conversations=%d",
                     sqlite3_column_int(st, 0), sqlite3_column_int(st, 1),
                     sqlite3_column_int(st, 2));
        }
        sqlite3_finalize(st);
    }
    sqlite3_close(db);
}

/* read_boot_id reads the kernel's boot id (one line); "" when it cannot be read. */
static void read_boot_id(const char *path, char *out, size_t out_len)
{
    out[0] = '\0';
    FILE *f = *path ? fopen(path, "r") : NULL;
    if (!f) {
        return;
    }
    if (fgets(out, (int)out_len, f)) {
        out[strcspn(out, "\r\n")] = '\0';
    } else {
        out[0] = '\0';
    }
    fclose(f);
}

int main(int argc, char **argv)
{
    const char *listen = "127.0.0.1:7101", *db_path = "cflue-store.db", *port_file = "";
    const char *level = "info", *boot_id_file = "/proc/sys/kernel/random/boot_id";
    long long lease_ms = 30000, timeout_ms = 3600000, max_attempts = 10;
    long long max_msg = 16 << 20, workers = 8, group = 256, grace_ms = 5000, max_queue = 256;
    bool help;
    struct cf_error err;
    const struct config_opt opts[] = {
        {"listen", CONFIG_STRING, &listen, 0, 0, "address to serve on (host:port or unix:PATH)"},
        {"db", CONFIG_STRING, &db_path, 0, 0, "SQLite database file (created if missing)"},
        {"port-file", CONFIG_STRING, &port_file, 0, 0,
         "write the bound TCP port here once listening"},
        {"lease-ms", CONFIG_INT, &lease_ms, 100, 86400000, "lease length when Claim asks 0"},
        {"timeout-ms", CONFIG_INT, &timeout_ms, 1000, 30LL * 86400000,
         "submission deadline from its first claim"},
        {"max-attempts", CONFIG_INT, &max_attempts, 1, 1000, "claims before recovery gives up"},
        {"max-message-bytes", CONFIG_INT, &max_msg, 1 << 20, 1 << 30,
         "largest request or response; Read pages hold at most half of it (8 MiB at most)"},
        {"workers", CONFIG_INT, &workers, 1, 256, "threads serving reads"},
        {"group-commit", CONFIG_INT, &group, 1, 10000, "most writes committed together"},
        {"grace-ms", CONFIG_INT, &grace_ms, 0, 600000, "how long shutdown waits for live calls"},
        {"max-queue", CONFIG_INT, &max_queue, 1, 100000,
         "calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"},
        {"log-level", CONFIG_STRING, &level, 0, 0, "debug, info, warn or error"},
        {"boot-id-file", CONFIG_STRING, &boot_id_file, 0, 0,
         "where the machine's boot id is read (a new boot after an unclean stop fences running "
         "attempts)"},
    };

    log_init("storaged", LOG_INFO);
    if (config_parse(opts, sizeof(opts) / sizeof(opts[0]), argc, argv, usage, &help, &err) !=
        CF_OK) {
        fprintf(stderr, "storaged: %s\n", err.msg);
        return 2;
    }
    if (help) {
        return 0;
    }
    int lv = log_parse_level(level);
    if (lv < 0) {
        fprintf(stderr, "storaged: --log-level must be debug, info, warn or error\n");
        return 2;
    }
    log_init("storaged", (enum log_level)lv);
    failpoint_init();

    sqlite3 *db;
    if (db_open(db_path, true, &db, &err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_error("db_open_failed", "db=%s err=%s", db_path, log_quote(q, sizeof(q), err.msg));
        fprintf(stderr, "storaged: %s\n", err.msg);
        return 1;
    }
    char boot_id[128];
    read_boot_id(boot_id_file, boot_id, sizeof(boot_id));
    int fenced = 0;
    if (db_boot(db, boot_id, &fenced, &err) != CF_OK) {
        char q[CF_ERROR_MSG_MAX + 16];
        log_error("db_boot_failed", "db=%s err=%s", db_path, log_quote(q, sizeof(q), err.msg));
        fprintf(stderr, "storaged: %s\n", err.msg);
        sqlite3_close(db);
        return 1;
    }
    if (fenced > 0) {
        log_warn("fenced_after_reboot",
                 "attempts=%d boot_id=%s: the machine restarted since the last run, which did "
                 "not stop cleanly; unsynced commits may be lost, so running attempts were fenced "
                 "off and recovery continues them",
                 fenced, boot_id);
    }
    log_startup_state(db_path);

    rpc_global_init();
    /* Read pages stay comfortably under the message limit (see ledger.h). */
    long long page_bytes =
        max_msg / 2 < LEDGER_PAGE_BYTES_MAX ? max_msg / 2 : LEDGER_PAGE_BYTES_MAX;
    struct ledger_config cfg = {.lease_ms = lease_ms,
                                .timeout_ms = timeout_ms,
                                .max_attempts = (int32_t)max_attempts,
                                .page_bytes = page_bytes};
    struct notifier *notifier = notifier_new();
    struct writer *writer;
    if (writer_start(&writer, db, &cfg, notifier, (int)group, &err) != CF_OK) {
        log_error("writer_start_failed", "err=%s", err.msg);
        fprintf(stderr, "storaged: cannot start the writer thread: %s\n", err.msg);
        sqlite3_close(db);
        notifier_free(notifier);
        rpc_global_shutdown();
        return 1;
    }
    struct service *svc = service_new(db_path, writer, notifier, &cfg);
    struct rpc_server_opts ro = {
        .workers = (int)workers, .max_message_bytes = (int)max_msg, .max_queue = (int)max_queue};
    struct rpc_server *srv = rpc_server_new(&ro);
    service_register(svc, srv);
    int port = 0;
    bool listening = rpc_server_listen(srv, listen, &port, &err) == CF_OK;
    if (!listening) {
        log_error("listen_failed", "addr=%s", listen);
        fprintf(stderr, "storaged: %s\n", err.msg);
    } else if (rpc_server_start(srv) != CF_OK) {
        fprintf(stderr, "storaged: could not start serving (threads); see the log\n");
        listening = false;
    }
    if (!listening) {
        rpc_server_free(srv);
        service_free(svc);
        writer_stop(writer);
        notifier_free(notifier);
        rpc_global_shutdown();
        return 1;
    }
    daemon_port_file(port_file, port);
    log_info("listening",
             "addr=%s port=%d db=%s lease_ms=%lld page_bytes=%lld record_bytes_max=%lld", listen,
             port, db_path, lease_ms, page_bytes, (long long)ledger_record_bytes_max(&cfg));

    daemon_wait_for_stop();

    rpc_server_shutdown(srv, (int)grace_ms);
    writer_stop(writer);
    service_free(svc);
    rpc_server_free(srv);
    notifier_free(notifier);
    rpc_global_shutdown();
    log_info("stopped", "code=0");
    return 0;
}
