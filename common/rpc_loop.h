/* rpc_loop.h - the process's one gRPC event loop: a completion queue and the thread that serves
 * it.
 *
 * Every event-driven gRPC event of a process arrives on this queue: the server's (rpc_server.c:
 * new calls, sends, closes, shutdown) and the client's event-driven calls and streams
 * (rpc_client.c). gRPC's epoll engine polls every socket of the process from one epoll set,
 * through whichever thread is polling at the time; with a second thread waiting on a second
 * queue, every event the first thread read for the second cost a wake-up and a context switch
 * (see docs/rpc.md). One thread polls here. A blocking call (rpc_unary, rpc_stream_*) still
 * polls its own queue while its caller waits.
 *
 * Each tag handed to gRPC with this queue begins with struct rpc_loop_tag, whose on_event runs on
 * the loop thread. Handlers must not block: they hand work to other threads, or start calls.
 */
#ifndef CFLUE_RPC_LOOP_H
#define CFLUE_RPC_LOOP_H

#include "status.h"

#include <grpc/grpc.h>
#include <stdbool.h>
#include <stdint.h>

struct rpc_loop_tag;

/* rpc_loop_fn handles one event of tag on the loop thread; ok is gRPC's success flag. */
typedef void (*rpc_loop_fn)(struct rpc_loop_tag *tag, bool ok);

/* The first member of every tag on the loop's queue. */
struct rpc_loop_tag {
    rpc_loop_fn on_event;
};

/* rpc_loop_set_tick makes the loop call tick() on its thread when it starts and then every time
 * the delay tick returned (ms, at least 1) has passed. Called before the loop starts
 * (rpc_global_init); NULL: no tick. */
void rpc_loop_set_tick(int64_t (*tick)(void));

/* rpc_loop_start starts the loop unless it runs. Safe from any thread. CF_BUSY, with err saying
 * why, when its thread cannot start: nothing changed, and a later call tries again. */
CF_MUST_CHECK enum cf_status rpc_loop_start(struct cf_error *err);

/* rpc_loop_cq returns the loop's completion queue. Only after rpc_loop_start succeeded. */
grpc_completion_queue *rpc_loop_cq(void);

/* rpc_loop_stop shuts the queue down, lets the loop run the events still due and joins it. Every
 * server must be freed and every event-driven call over first (rpc_global_shutdown). Nothing
 * happens when the loop does not run; a later rpc_loop_start starts a new one. */
void rpc_loop_stop(void);

#endif
