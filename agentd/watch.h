/* watch.h - Watch(follow) and GetSubmission(wait) without a thread per caller: one storaged
 * Follow per watched conversation, fanned out to every watcher of it (see watch.c). */
#ifndef CFLUE_AGENTD_WATCH_H
#define CFLUE_AGENTD_WATCH_H

#include "rpc.h"

#include "cflue/v1/agent.pb-c.h"

/* watch_init binds the module to the server whose worker pool runs its reads. Call before
 * serving; once. */
void watch_init(struct rpc_server *srv);

/* watch_start serves a Watch call (an RPC_ASYNC handler's job): validates the conversation and
 * offset with storaged, then streams records after req->after_offset; with follow, stays open
 * and delivers new records as they commit. Finishes the call itself, now or later. */
void watch_start(struct rpc_call *c, const Cflue__V1__WatchRequest *req);

/* watch_wait_settled serves GetSubmission(wait) (an RPC_ASYNC handler's job): replies with the
 * submission once it is settled, woken by its conversation's shared Follow. Finishes the call
 * itself, now or later. */
void watch_wait_settled(struct rpc_call *c, const char *submission_id);

/* watch_counts returns how many storaged Follow streams the module holds (one per watched
 * conversation), and watchers how many callers are attached to them. */
void watch_counts(int *feeds_out, int *watchers_out);

/* The records kept in memory for watchers catching up, every watched conversation together
 * (--watch-cache-mib), by default. */
#define WATCH_CACHE_DEFAULT ((size_t)64 << 20)

/* watch_set_cache_bytes bounds those records (call before serving). */
void watch_set_cache_bytes(size_t max);

#endif
