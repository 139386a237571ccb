/* agentd.h - the shared state of one agentd process. */
#ifndef CFLUE_AGENTD_AGENTD_H
#define CFLUE_AGENTD_AGENTD_H

#include "agents.h"
#include "provider.h"
#include "rpc.h"

#include "cflue/v1/store.pb-c.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define ACTIVE_MAX 1024

/* One submission being driven by this process. */
struct active {
    char submission_id[64];
    char attempt_id[64];
    int64_t epoch;
    bool in_use;
    bool abort_requested; /* durable abort intent seen: settle aborted */
    bool lease_lost;      /* another attempt took over: stop without writing */
    bool shutting_down;   /* this process is stopping: stop, recovery will resume */
};

struct agentd {
    const char *owner_id;
    int64_t lease_ms;
    int64_t heartbeat_ms;
    bool stream; /* ask providers to stream */
    struct provider_endpoint anthropic, openai;
    struct agent_set agents;
    struct rpc_channel *store;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    bool stopping;
    struct active active[ACTIVE_MAX];
};

extern struct agentd g_agentd;

/* agentd_wake tells idle workers that work may be claimable. */
void agentd_wake(void);

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

/* turn_drive runs one claimed submission until it settles, its lease is lost, the process
 * stops, or storaged/toold fail past their retry window (see drive.c). The claim response is
 * owned by the caller. */
enum drive_end turn_drive(const Cflue__V1__ClaimResponse *claim);

/* api_register adds the Agent service to srv. */
void api_register(struct rpc_server *srv);

#endif
