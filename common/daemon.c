/* daemon.c - port files and stop signals. */
#include "daemon.h"

#include "log.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

void daemon_port_file(const char *path, int port)
{
    if (!path || !*path) {
        return;
    }
    FILE *f = fopen(path, "w");
    if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0) {
        log_error("port_file_failed", "path=%s err=%d", path, errno);
    }
}

void daemon_wait_for_stop(void)
{
    sigset_t set;
    int sig = 0;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigwait(&set, &sig);
    log_info("stopping", "signal=%s", sig == SIGTERM ? "TERM" : "INT");
}
