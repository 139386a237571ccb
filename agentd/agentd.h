/* agentd.h - the shared state of one agentd process. */
#ifndef CFLUE_AGENTD_AGENTD_H
#define CFLUE_AGENTD_AGENTD_H

#include "agents.h"
#include "defs.h"
#include "provider.h"
#include "rpc.h"
#include "skills.h"
#include "trace.h"

#include "cflue/v1/store.pb-c.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define ACTIVE_MAX 4096 /* drives in flight at most (--max-drives) */

struct drive;

/* One submission being driven by this process. */
struct active {
    char submission_id[64];
    char attempt_id[64];
    char conversation_id[129]; /* ids are at most 128 characters (storaged's limit) */
    int64_t epoch;
    bool in_use;
    bool queued_hint;     /* a message was admitted behind it here: worth a ClaimJoinable */
    bool abort_requested; /* durable abort intent seen: settle aborted */
    bool lease_lost;      /* another attempt took over: stop without writing */
    bool shutting_down;   /* this process is stopping: stop, recovery will resume */
    bool settle_sent;     /* its Settle went out: a Heartbeat may find it settled, not lost */
    struct drive *drive;  /* posted when a flag above is set (engine.c) */
    uint64_t model_call;  /* the model call it is parked on (0: none), cancelled with them */
    char traceparent[TRACE_PARENT_SIZE]; /* the drive's trace, for lines logged elsewhere */
};

struct agentd {
    const char *owner_id;
    int64_t lease_ms;
    int64_t heartbeat_ms;
    int64_t hold_writes_ms; /* --hold-writes-ms (dstore_write_behind_held) */
    long long submit_mib;   /* --submit-memory-mib: messages of Submits waiting on storaged */
    bool stream;            /* ask providers to stream */
    struct provider_endpoint anthropic, openai;
    struct rpc_channel *store;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    bool stopping;
    /* The drives' slots. Slots [0, active_used) have held a drive; the ones past it never
     * have, and nothing reads them, so their pages are not resident until work needs them. */
    int active_used;
    struct active active[ACTIVE_MAX];
};

extern struct agentd g_agentd;

/* agentd_wake tells the claimer that work may be claimable (engine.c). */
void agentd_wake(void);

/* agentd_note_queued tells the drive of conversation_id running here, if any, that a message
 * was admitted behind it (its next JOIN asks storaged for joins); returns whether one runs. */
bool agentd_note_queued(const char *conversation_id);

/* agentd_mark_abort flags a locally running submission as aborted; returns whether it runs
 * here. */
bool agentd_mark_abort(const char *submission_id);

/* How a drive ended. */
enum drive_end {
    DRIVE_SETTLED,     /* the submission has its outcome */
    DRIVE_STOPPED,     /* lease lost, or this process is stopping: someone else resumes it */
    DRIVE_INTERRUPTED, /* storaged or toold failed: unsettled; claim it again later */
};

/* The error a Compact submission settles failed with when there was nothing to compact;
 * Agent.Compact answers it as FAILED_PRECONDITION, reason NOTHING_TO_COMPACT. */
#define AGENTD_NOTHING_TO_COMPACT                                                                  \
    "nothing to compact: the conversation is no longer than the recent part that compaction "      \
    "keeps verbatim"
/* The same when what is kept is a single turn larger than the model's context allows: there is
 * nothing older to summarize, and every request sends that turn shortened to fit. */
#define AGENTD_NOTHING_TO_COMPACT_OVERSIZED                                                        \
    "nothing to compact: the conversation since its last compaction is a single turn, too large "  \
    "for the model's context by itself; each request sends it with its largest texts shortened "   \
    "to fit"

/* api_register adds the Agent service to srv. */
void api_register(struct rpc_server *srv);

/* tool_servers_check lists once the tools of every agent's own tool servers (and its sandbox's
 * toold) that answer within a few seconds, and checks each agent's tool set as a drive would
 * (tool_servers.c): CF_INVALID, naming the agent and both sources, when a name is reserved by
 * the framework or offered twice. A server that does not answer is logged and checked when a
 * submission lists it. After rpc_global_init. */
CF_MUST_CHECK enum cf_status tool_servers_check(const struct agent_set *agents,
                                                struct cf_error *err);

#endif
