/* downtime.c - the time storaged was down, taken in when it starts again (downtime.h). */
#include "downtime.h"

#include "ledger.h"
#include "log.h"
#include "store_clock.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

int64_t downtime_boot_ms(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_BOOTTIME, &ts) != 0) {
        return 0;
    }
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* changed_ms is the change time of the file at path (epoch ms; 0 when it cannot be read). */
static int64_t changed_ms(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        return 0;
    }
    return (int64_t)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000;
}

int64_t downtime_last_write_ms(const char *db_path)
{
    char wal[4096];
    int n = snprintf(wal, sizeof(wal), "%s-wal", db_path);
    int64_t db = changed_ms(db_path);
    int64_t log = n > 0 && (size_t)n < sizeof(wal) ? changed_ms(wal) : 0;
    return log > db ? log : db;
}

enum downtime_source downtime_measure(const struct db_last_run *last, int64_t last_write_ms,
                                      int64_t now_ms, int64_t boot_now_ms, int64_t *down_ms,
                                      int64_t *step_ms)
{
    enum downtime_source source = DOWNTIME_UNKNOWN;
    int64_t since = 0; /* the stop by the wall clock (by the store clock, for a stamp) */
    *down_ms = 0;
    *step_ms = 0;
    if (last->clean && last->stopped_at_ms > 0) {
        since = last->stopped_at_ms;
        source = DOWNTIME_STOP_STAMP;
        if (last->same_boot && last->stopped_boot_ms > 0 && boot_now_ms >= last->stopped_boot_ms) {
            *down_ms = boot_now_ms - last->stopped_boot_ms;
            int64_t step = now_ms - since - *down_ms;
            *step_ms = step >= STORE_CLOCK_STEP_MS || step <= -STORE_CLOCK_STEP_MS ? step : 0;
            return DOWNTIME_BOOT_CLOCK;
        }
    } else if (!last->clean && last_write_ms > 0) {
        since = last_write_ms;
        source = DOWNTIME_LAST_WRITE;
    }
    if (source != DOWNTIME_UNKNOWN && now_ms > since) {
        *down_ms = now_ms - since;
    } else if (source != DOWNTIME_UNKNOWN && since - now_ms >= STORE_CLOCK_STEP_MS) {
        /* the stop lies ahead: the clock was set back meanwhile, by at least this (the time
         * down, unknown, is taken as none: the work keeps at least what it had left) */
        *step_ms = now_ms - since;
    }
    return source;
}

static const char *source_name(enum downtime_source s)
{
    switch (s) {
    case DOWNTIME_BOOT_CLOCK:
        return "boot_clock";
    case DOWNTIME_STOP_STAMP:
        return "stop_stamp";
    case DOWNTIME_LAST_WRITE:
        return "last_write";
    case DOWNTIME_UNKNOWN:
        break;
    }
    return "unknown";
}

enum cf_status downtime_take_in(sqlite3 *db, const struct db_last_run *last, int64_t last_write_ms,
                                struct downtime_moves *moves, struct cf_error *err)
{
    struct ledger_ctx ctx = {.db = db, .now = store_clock_now()};
    enum cf_status rc = CF_OK;
    memset(moves, 0, sizeof(*moves));
    moves->source = downtime_measure(last, last_write_ms, ctx.now, downtime_boot_ms(),
                                     &moves->down_ms, &moves->step_ms);
    if (moves->step_ms != 0) {
        rc = ledger_shift_times(&ctx, moves->step_ms, &moves->submissions_moved, err);
    }
    if (rc == CF_OK && moves->down_ms >= DOWNTIME_MIN_MS) {
        rc = ledger_extend_leases(&ctx, ctx.now - moves->down_ms, moves->down_ms,
                                  &moves->leases_extended, err);
    }
    return rc;
}

void downtime_log(const struct downtime_moves *moves)
{
    if (moves->step_ms == 0 && moves->down_ms < DOWNTIME_MIN_MS) {
        return;
    }
    log_info("downtime_taken_in",
             "down_ms=%lld measured_by=%s leases_extended=%d clock_step_ms=%lld "
             "submissions_moved=%d",
             (long long)moves->down_ms, source_name(moves->source), moves->leases_extended,
             (long long)moves->step_ms, moves->submissions_moved);
}
