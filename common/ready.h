/* ready.h - readiness that means something: a thread checks, every few seconds, what a daemon
 * needs in order to do its work (agentd: storaged answering; toold: a writable root) and sets
 * the server's readiness (rpc_server_set_ready) to match, logging each change. Liveness is left
 * alone: a daemon waiting for storaged is alive, and restarting it would not bring storaged
 * back. */
#ifndef CFLUE_READY_H
#define CFLUE_READY_H

#include "rpc.h"
#include "status.h"

#include <stdbool.h>
#include <stddef.h>

#define READY_EVERY_MS 2000 /* how often the check runs */

/* A check: true when the daemon can work; false with the reason in why (at most why_len). It
 * runs on the probe's own thread and may block up to about READY_EVERY_MS. */
typedef bool (*ready_check_fn)(void *arg, char *why, size_t why_len);

struct ready_probe;

/* ready_start starts checking for srv every READY_EVERY_MS (the first check at once); what
 * names the need in the log ("storaged", "root"). NULL with err set when the thread cannot
 * start. */
struct ready_probe *ready_start(struct rpc_server *srv, const char *what, ready_check_fn check,
                                void *arg, struct cf_error *err);

/* ready_stop stops the probe and frees it (NULL is fine). */
void ready_stop(struct ready_probe *p);

#endif
