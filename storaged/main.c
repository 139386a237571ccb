/* main.c - storaged: the durable ledger daemon.
 *
 * Crash-only: start-up is recovery. SQLite replays its WAL on open; every state lives in the
 * database, so a storaged killed at any moment restarts into a consistent ledger. Leases that
 * ran out while it was down are found by ScanExpired and Claim.
 */
#include "backup.h"
#include "daemon.h"
#include "db.h"
#include "downtime.h"
#include "failpoint.h"
#include "ledger.h"
#include "log.h"
#include "rpc.h"
#include "service.h"
#include "store_clock.h"
#include "writer.h"

#include <stdio.h>
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
        sqlite3_bind_int64(st, 1, store_clock_now());
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

/* storaged's own options (the shared ones are in struct daemon) */
struct storaged_opts {
    const char *db_path, *boot_id_file;
    long long lease_ms, timeout_ms, max_attempts, max_msg, workers, group;
};

/* The time storaged was down, taken in as a step of db_boot. */
struct downtime_step {
    int64_t last_write_ms; /* the database files' last change before this start */
    struct downtime_moves moves;
};

static enum cf_status take_in_downtime(sqlite3 *db, const struct db_last_run *last, void *arg,
                                       struct cf_error *err)
{
    struct downtime_step *s = arg;
    return downtime_take_in(db, last, s->last_write_ms, &s->moves, err);
}

/* open_ledger takes the database for this process (db_hold), opens (creating) it and runs the
 * boot check: a new boot after an unclean stop fences running attempts; then takes in the time
 * storaged was down (downtime.h). Prints and logs why it failed. */
static bool open_ledger(const struct daemon *d, const struct storaged_opts *o, sqlite3 **db)
{
    struct cf_error err;
    char q[CF_ERROR_MSG_MAX + 16], boot_id[128];
    int fenced = 0;
    bool held;
    struct db_last_run last;
    struct downtime_step downtime;
    if (db_hold(o->db_path, &held, &err) != CF_OK) {
        log_error("db_in_use", "db=%s err=%s", o->db_path, log_quote(q, sizeof(q), err.msg));
        daemon_say(d, 1, "%s", err.msg);
        return false;
    }
    if (!held) {
        log_warn("db_not_locked",
                 "db=%s: this file system does not lock files (flock): nothing "
                 "keeps a second storaged from opening the database",
                 o->db_path);
    }
    downtime.last_write_ms = downtime_last_write_ms(o->db_path); /* before any write of ours */
    if (db_open(o->db_path, true, db, &err) != CF_OK) {
        log_error("db_open_failed", "db=%s err=%s", o->db_path, log_quote(q, sizeof(q), err.msg));
        daemon_say(d, 1, "%s", err.msg);
        return false;
    }
    read_boot_id(o->boot_id_file, boot_id, sizeof(boot_id));
    if (db_boot(*db, boot_id, take_in_downtime, &downtime, &fenced, &last, &err) != CF_OK) {
        log_error("db_boot_failed", "db=%s err=%s", o->db_path, log_quote(q, sizeof(q), err.msg));
        daemon_say(d, 1, "%s", err.msg);
        sqlite3_close(*db);
        return false;
    }
    if (fenced > 0) {
        log_warn("fenced_after_reboot",
                 "attempts=%d boot_id=%s: the machine restarted since the last run, which did "
                 "not stop cleanly; unsynced commits may be lost, so running attempts were fenced "
                 "off and recovery continues them",
                 fenced, boot_id);
    }
    downtime_log(&downtime.moves);
    log_startup_state(o->db_path);
    backup_sweep(o->db_path);
    return true;
}

int main(int argc, char **argv)
{
    struct daemon d = DAEMON_INIT("storaged", usage, "127.0.0.1:7101");
    struct storaged_opts o = {.db_path = "cflue-store.db",
                              .boot_id_file = "/proc/sys/kernel/random/boot_id",
                              .lease_ms = 30000,
                              .timeout_ms = 3600000,
                              .max_attempts = 10,
                              .max_msg = 16 << 20,
                              .workers = 8,
                              .group = 256};
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(&d, "address to serve on (host:port or unix:PATH)"),
        CONFIG_OPT_STRING("db", &o.db_path, "SQLite database file (created if missing)"),
        DAEMON_OPT_PORT_FILE(&d, "write the bound TCP port here once listening"),
        CONFIG_OPT_INT("lease-ms", &o.lease_ms, 100, 86400000, "lease length when Claim asks 0"),
        CONFIG_OPT_INT("timeout-ms", &o.timeout_ms, 1000, 30LL * 86400000,
                       "submission deadline from its first claim"),
        CONFIG_OPT_INT("max-attempts", &o.max_attempts, 1, 1000, "claims before recovery gives up"),
        CONFIG_OPT_INT(
            "max-message-bytes", &o.max_msg, 1 << 20, 1 << 30,
            "largest request or response; Read pages hold at most half of it (8 MiB at most)"),
        CONFIG_OPT_INT("workers", &o.workers, 1, 256, "threads serving reads"),
        CONFIG_OPT_INT("group-commit", &o.group, 1, 10000, "most writes committed together"),
        DAEMON_OPT_GRACE_MS(&d, "how long shutdown waits for live calls"),
        DAEMON_OPT_MAX_QUEUE(&d, "calls waiting for a thread; more are refused RESOURCE_EXHAUSTED"),
        DAEMON_OPT_MAX_STREAM_MEMORY(&d),
        DAEMON_OPT_STREAM_STALL_MS(&d),
        DAEMON_OPT_LOG_LEVEL(&d),
        DAEMON_OPTS_TLS(&d),
        DAEMON_OPT_METRICS(&d),
        CONFIG_OPT_STRING(
            "boot-id-file", &o.boot_id_file,
            "where the machine's boot id is read (a new boot after an unclean stop fences running "
            "attempts)"),
    };
    int rc = daemon_configure(&d, opts, CONFIG_COUNT(opts), argc, argv);
    if (rc != DAEMON_RUN) {
        return rc;
    }
    sqlite3 *db;
    if (!open_ledger(&d, &o, &db)) {
        return 1;
    }

    rpc_global_init();
    /* Read pages stay comfortably under the message limit (see ledger.h). */
    long long page_bytes =
        o.max_msg / 2 < LEDGER_PAGE_BYTES_MAX ? o.max_msg / 2 : LEDGER_PAGE_BYTES_MAX;
    struct ledger_config cfg = {.lease_ms = o.lease_ms,
                                .timeout_ms = o.timeout_ms,
                                .max_attempts = (int32_t)o.max_attempts,
                                .page_bytes = page_bytes,
                                .send_bytes = o.max_msg};
    struct writer *writer;
    struct cf_error err;
    if (writer_start(&writer, db, &cfg, (int)o.group, &err) != CF_OK) {
        log_error("writer_start_failed", "err=%s", err.msg);
        daemon_say(&d, 1, "cannot start the writer thread: %s", err.msg);
        sqlite3_close(db);
        rpc_global_shutdown();
        return 1;
    }
    struct service *svc = service_new(o.db_path, writer, &cfg);
    struct rpc_server_opts ro = {.workers = (int)o.workers,
                                 .max_message_bytes = (int)o.max_msg,
                                 .max_queue = (int)d.max_queue,
                                 .max_stream_memory = (int64_t)d.max_stream_mib << 20,
                                 .stall_ms = d.stream_stall_ms};
    struct rpc_server *srv = rpc_server_new(&ro);
    service_register(svc, srv);
    if (!daemon_serve(&d, srv)) {
        service_free(svc);
        writer_stop(writer);
        rpc_global_shutdown();
        return 1;
    }
    log_info("listening",
             "addr=%s port=%d db=%s lease_ms=%lld page_bytes=%lld record_bytes_max=%lld", d.listen,
             d.port, o.db_path, o.lease_ms, page_bytes, (long long)ledger_record_bytes_max(&cfg));

    daemon_wait_for_stop(service_release_memory, svc);
    writer_note_stop(writer);
    daemon_stop_serving(&d);
    writer_stop(writer);
    service_free(svc);
    rpc_global_shutdown();
    log_info("stopped", "code=0");
    return 0;
}
