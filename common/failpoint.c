/* failpoint.c - crash and delay points armed from the environment. */
#include "failpoint.h"

#include "log.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_POINTS 16

static struct {
    char name[96];
    atomic_int remaining; /* crash: hits left before the crash */
    int sleep_ms;         /* sleep: every hit waits this long (0: a crash point) */
} points[MAX_POINTS];
static int n_points;

void failpoint_init(void)
{
    const char *spec = getenv("CFLUE_FAILPOINTS");
    if (!spec || !*spec) {
        return;
    }
    char copy[1024];
    strncpy(copy, spec, sizeof(copy) - 1);
    copy[sizeof(copy) - 1] = '\0';
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && n_points < MAX_POINTS;
         tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            continue;
        }
        *eq = '\0';
        int count = 1;
        char *colon = strchr(eq + 1, ':');
        if (colon) {
            count = atoi(colon + 1);
        }
        bool sleeps = !strncmp(eq + 1, "sleep:", 6);
        if (sleeps && count <= 0) {
            log_warn("failpoint_refused", "point=%s why=\"sleep needs milliseconds above 0\"", tok);
            continue;
        }
        strncpy(points[n_points].name, tok, sizeof(points[n_points].name) - 1);
        atomic_store(&points[n_points].remaining, count > 0 ? count : 1);
        points[n_points].sleep_ms = sleeps ? count : 0;
        log_warn("failpoint_armed", "point=%s action=%s count=%d", points[n_points].name,
                 sleeps ? "sleep_ms" : "crash", count);
        n_points++;
    }
}

void failpoint_hit(const char *name)
{
    for (int i = 0; i < n_points; i++) {
        if (points[i].sleep_ms && !strcmp(points[i].name, name)) {
            log_info("failpoint_sleep", "point=%s ms=%d", name, points[i].sleep_ms);
            struct timespec ts = {points[i].sleep_ms / 1000,
                                  (points[i].sleep_ms % 1000) * 1000000L};
            while (nanosleep(&ts, &ts) != 0) {
            }
            continue;
        }
        if (!strcmp(points[i].name, name) && atomic_fetch_sub(&points[i].remaining, 1) == 1) {
            log_error("failpoint_crash", "point=%s", name);
            raise(SIGKILL);
            _exit(137);
        }
    }
}

bool failpoint_armed(void)
{
    return n_points > 0;
}
