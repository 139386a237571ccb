/* daemon.h - what every cflue daemon does the same way around its server. */
#ifndef CFLUE_DAEMON_H
#define CFLUE_DAEMON_H

/* daemon_port_file writes the bound TCP port to path (when path is not empty), for tests and
 * supervisors that start a daemon on port 0. A failure is logged, not fatal. */
void daemon_port_file(const char *path, int port);

/* daemon_wait_for_stop blocks until SIGINT or SIGTERM (blocked in every thread by
 * rpc_global_init) and logs which one arrived. */
void daemon_wait_for_stop(void);

#endif
