/* Unit tests of storaged/downtime.c (and the stop stamps of db.c it reads), on a real SQLite
 * file. */
#include "../check.h"

#include "db.h"
#include "downtime.h"
#include "store_clock.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define NOW 1800000000000LL /* an epoch time in ms */
#define BOOT 500000LL       /* CLOCK_BOOTTIME at the stop */

/* how long down, by each source */
static void test_measure(void)
{
    int64_t down, step;
    struct db_last_run clean_same = {
        .clean = true, .same_boot = true, .stopped_at_ms = NOW - 7000, .stopped_boot_ms = BOOT};
    /* same boot: the boot clock tells the time down; the wall clock agrees: no step */
    CHECK(downtime_measure(&clean_same, 0, NOW, BOOT + 7000, &down, &step) == DOWNTIME_BOOT_CLOCK);
    CHECK(down == 7000 && step == 0);
    /* the wall clock went an hour forward meanwhile: 7 s down, a step of an hour */
    CHECK(downtime_measure(&clean_same, 0, NOW + 3600000, BOOT + 7000, &down, &step) ==
          DOWNTIME_BOOT_CLOCK);
    CHECK(down == 7000 && step == 3600000);
    /* an hour back */
    CHECK(downtime_measure(&clean_same, 0, NOW - 3600000, BOOT + 7000, &down, &step) ==
          DOWNTIME_BOOT_CLOCK);
    CHECK(down == 7000 && step == -3600000);
    /* under a second apart is time passing, not a step */
    CHECK(downtime_measure(&clean_same, 0, NOW + 900, BOOT + 7000, &down, &step) ==
          DOWNTIME_BOOT_CLOCK);
    CHECK(down == 7000 && step == 0);

    /* another boot: the wall clock from the stamp; no step can be told */
    struct db_last_run clean_other = clean_same;
    clean_other.same_boot = false;
    CHECK(downtime_measure(&clean_other, 0, NOW + 3600000, 1000, &down, &step) ==
          DOWNTIME_STOP_STAMP);
    CHECK(down == 3600000 + 7000 && step == 0);
    /* a stamp that lies ahead of the clock now: the clock was set back at least that much */
    CHECK(downtime_measure(&clean_other, 0, NOW - 3600000, 1000, &down, &step) ==
          DOWNTIME_STOP_STAMP);
    CHECK(down == 0 && step == -(3600000 - 7000));
    /* ahead by less than a second: time passing, no time down */
    CHECK(downtime_measure(&clean_other, 0, NOW - 7000 - 900, 1000, &down, &step) ==
          DOWNTIME_STOP_STAMP);
    CHECK(down == 0 && step == 0);
    /* the boot clock behind the stamp's (not the same boot after all): the wall clock */
    CHECK(downtime_measure(&clean_same, 0, NOW, BOOT - 1, &down, &step) == DOWNTIME_STOP_STAMP);
    CHECK(down == 7000 && step == 0);

    /* a crash: the files' last change; the stamps of an earlier clean stop are not read */
    struct db_last_run crashed = clean_same;
    crashed.clean = false;
    CHECK(downtime_measure(&crashed, NOW - 4000, NOW, BOOT + 99999, &down, &step) ==
          DOWNTIME_LAST_WRITE);
    CHECK(down == 4000 && step == 0);
    /* the files changed an hour after now: set back */
    CHECK(downtime_measure(&crashed, NOW + 3600000, NOW, BOOT + 99999, &down, &step) ==
          DOWNTIME_LAST_WRITE);
    CHECK(down == 0 && step == -3600000);
    CHECK(downtime_measure(&crashed, 0, NOW, BOOT, &down, &step) == DOWNTIME_UNKNOWN);
    CHECK(down == 0 && step == 0);
    /* a clean stop without stamps (an earlier version's): unknown */
    struct db_last_run unstamped = {.clean = true, .same_boot = true};
    CHECK(downtime_measure(&unstamped, NOW - 4000, NOW, BOOT, &down, &step) == DOWNTIME_UNKNOWN);
    CHECK(down == 0 && step == 0);
}

static enum cf_status failing_step(sqlite3 *db, const struct db_last_run *last, void *arg,
                                   struct cf_error *err)
{
    (void)db;
    (void)last;
    (*(int *)arg)++;
    return cf_error_set(err, CF_IO, "the step failed");
}

/* db_boot reports what db_clean_stop stamped, once: a crash after the next start leaves no
 * clean stop to read */
static void test_stamps(void)
{
    char path[128];
    struct cf_error err;
    sqlite3 *db;
    struct db_last_run last;
    int fenced;
    snprintf(path, sizeof(path), "/tmp/cflue-test-downtime-%d.db", (int)getpid());
    unlink(path);
    CHECK(db_open(path, true, &db, &err) == CF_OK);
    CHECK(db_boot(db, "boot-A", NULL, NULL, &fenced, &last, &err) == CF_OK);
    CHECK(!last.clean && !last.same_boot && last.stopped_at_ms == 0); /* first start */
    CHECK(db_clean_stop(db, NOW, BOOT, &err) == CF_OK);
    CHECK(db_boot(db, "boot-A", NULL, NULL, &fenced, &last, &err) == CF_OK);
    CHECK(last.clean && last.same_boot && last.stopped_at_ms == NOW &&
          last.stopped_boot_ms == BOOT);
    /* a start-up whose step fails is rolled back whole: the next start reads the same stop */
    CHECK(db_clean_stop(db, NOW, BOOT, &err) == CF_OK);
    int calls = 0;
    CHECK(db_boot(db, "boot-A", failing_step, &calls, &fenced, &last, &err) == CF_IO);
    CHECK(calls == 1);
    sqlite3_close(db);
    CHECK(db_open(path, true, &db, &err) == CF_OK);
    CHECK(db_boot(db, "boot-A", NULL, NULL, &fenced, &last, &err) == CF_OK);
    CHECK(last.clean && last.same_boot && last.stopped_at_ms == NOW);
    CHECK(db_boot(db, "boot-B", NULL, NULL, &fenced, &last, &err) == CF_OK); /* no stop between */
    CHECK(!last.clean && !last.same_boot);
    CHECK(db_boot(db, "", NULL, NULL, &fenced, &last, &err) == CF_OK);
    CHECK(!last.same_boot); /* an unknown boot id is never the same boot */
    /* the start-up with nothing to move changes nothing */
    struct downtime_moves moves;
    CHECK(downtime_take_in(db, &last, 0, &moves, &err) == CF_OK);
    CHECK(moves.source == DOWNTIME_UNKNOWN && moves.down_ms == 0 && moves.leases_extended == 0);
    sqlite3_close(db);
    unlink(path);
    for (const char *tail = "-wal"; tail; tail = *tail == '-' && tail[1] == 'w' ? "-shm" : NULL) {
        char side[160];
        snprintf(side, sizeof(side), "%s%s", path, tail);
        unlink(side);
    }
}

int main(void)
{
    test_measure();
    test_stamps();
    /* the files' last change: the later of the database's and its WAL's */
    CHECK(downtime_last_write_ms("/nonexistent/cflue.db") == 0);
    CHECK(downtime_last_write_ms("/proc/self/status") > 0);
    return check_done("test_downtime");
}
