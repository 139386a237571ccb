/* drive.h - one claimed submission being driven, and the modules that drive it.
 *
 * The drive (drive.c) is a state machine whose states call into one module each:
 * drive_store.c (Store calls under the fence, appending through the record log),
 * record_log.c (the conversation in memory), context.c (records -> model messages),
 * prompt.c (the frozen system prompt), model_call.c (a model call with retries, deltas,
 * the recorded answer), tool_batch.c (the sandbox's tools and ExecuteBatch), joins.c (queued
 * messages joining the running work), compaction.c and settle.c (outcomes, repair of
 * unresolved calls). Internal to agentd's drive: api.c and main.c use agentd.h only.
 */
#ifndef CFLUE_AGENTD_DRIVE_H
#define CFLUE_AGENTD_DRIVE_H

#include "agentd.h"
#include "buf.h"
#include "context.h"
#include "engine_queue.h"
#include "mcp.h"
#include "proto_limits.h"
#include "record_log.h"
#include "skills.h"
#include "trace.h"

#include "cflue/v1/sandbox.pb-c.h"
#include "cflue/v1/tools.pb-c.h"

#define DRIVE_MODEL_MIN_MS 1000 /* a model call needs at least this much of the time limit */
#define DRIVE_CWD_MAX 1024      /* characters of a subagent's working directory (Delegation.cwd) */
/* Reloads a drive takes up at one turn boundary: later ones wait for the next boundary, so
 * that reloads landing faster than the prompt stage lists its tools cannot keep the drive
 * from its model call. */
#define DRIVE_REBINDS_MAX 4

/* The states of a drive; see the essay at the top of drive.c. */
enum drive_state {
    DRIVE_START,        /* budgets; the conversation's reading started */
    DRIVE_LOAD_WAIT,    /* parked on its pages */
    DRIVE_RECOVER_WAIT, /* takeover: parked on settling an earlier attempt's half-joins */
    DRIVE_INPUT,        /* the input appended and stamped applied, unresolved calls repaired */
    DRIVE_PROMPT,       /* the tool set and the sandbox asked for (one call to toold) */
    DRIVE_PROMPT_WAIT,  /* parked on that call; then the system prompt frozen */
    DRIVE_JOIN,         /* queued messages join, when storaged says some are queued */
    DRIVE_JOIN_WAIT,    /* parked on the joins' Store calls (claim, inputs, finalize) */
    DRIVE_MODEL,        /* one model turn asked (the call started) */
    DRIVE_MODEL_WAIT,   /* parked on the model call or its backoff; then the answer recorded */
    DRIVE_COMPACT,      /* the summary of the older part of the conversation started */
    DRIVE_COMPACT_WAIT, /* parked on it; then it and a recomposed prompt recorded */
    DRIVE_TOOLS,        /* the answer's tool calls started as one batch */
    DRIVE_TOOLS_WAIT,   /* parked on the batch; each result recorded as it arrives */
    DRIVE_SETTLE,       /* the outcome recorded, or the drive stopped or interrupted */
    DRIVE_SETTLE_WAIT,  /* parked on the Settle */
    DRIVE_DONE,
};

/* A drive's tool set, in the order the model sees it: the sandbox's (as Sandbox.Glance or
 * Tools.List gave it), the framework's, then those of the agent's own tool servers. */
struct toolset {
    ProtobufCMessage *owner;       /* the sandbox's answer (its tools' strings are in it) */
    const char *working_directory; /* where the sandbox's tools run ("": not said) */
    struct llm_tool *tools;
    const char **source; /* for each tool: the address of the server that runs it (NULL: agentd
                          * runs it, a framework tool) */
    size_t n;
};

/* One stream of a turn's tool calls (tool_batch.c): an ExecuteBatch of the calls for one
 * server, or an Execute of one call to a server without ExecuteBatch. The fields under mu are
 * written by the stream's callbacks (rpc's client-stream thread); the rest by the engine
 * thread. */
struct tool_lane {
    struct drive *d;
    pthread_mutex_t mu;
    ProtobufCMessage *result; /* under mu: a message not yet recorded (one at a time) */
    bool ended;               /* under mu: the stream is over; st says how */
    struct rpc_status st;     /* under mu */
    struct rpc_astream *stream;
    bool released;               /* the stream was released (cancelled, or taken to its end) */
    bool over;                   /* its end was taken */
    bool single;                 /* an Execute of calls[0]: its message is a ToolResult */
    const char *server;          /* the address the calls went to ("mcp:<name>": an MCP call) */
    const struct agent_mcp *mcp; /* an MCP server's tools/call of calls[0] (op), not a stream */
    struct mcp_op *op;
    struct tool_lane *after;    /* the same server's batch before this one: this one opens when
                                 * that one is over (a batch holds at most PROTO_BATCH_CALLS_MAX) */
    bool opened;                /* its stream (or MCP call) was started */
    Cflue__V1__ToolCall *calls; /* the calls sent, and for each: */
    Cflue__V1__ToolCall **ptrs;
    Google__Protobuf__Duration *limits;
    int *index; /* its index in the answer */
    bool *done; /* its result arrived */
    size_t m;
};

/* The tool calls of a turn in flight for a parked drive: one lane per server and batch of
 * calls (tool_batch.c). */
struct tool_wait {
    struct tool_lane **lanes;
    size_t n;
    bool running; /* lanes were started and not all their ends taken */
};

/* A model call in flight for a parked drive (model_call.c). The fields under mu are written
 * by the model I/O loop's callbacks; the rest by the engine thread stepping the drive. */
struct model_wait {
    pthread_mutex_t mu;
    bool done;              /* under mu: the call ended; rc and err say how */
    enum cf_status rc;      /* under mu */
    struct cf_error err;    /* under mu */
    struct buf pending;     /* under mu: streamed text not yet handed to the drive */
    bool flush_posted;      /* under mu: the drive was posted to flush deltas */
    int64_t flushed_ms;     /* under mu: monotonic time of the last delta flush */
    bool in_flight;         /* a call was started and its done not yet handled */
    bool backing_off;       /* waiting for backoff_until before the next try */
    int64_t backoff_until;  /* monotonic ms */
    int64_t try_started_us; /* monotonic: when the current try started (stats) */
    int attempt;
    struct context ctx; /* the turn's context, kept for retries */
    struct llm_request req;
    struct llm_events ev;
};

/* A unary call a parked drive waits on (drive_call.c): its end posts the drive. The fields
 * under mu are written by the call's end (rpc's client loop); the rest by the engine thread
 * stepping the drive. A drive is freed only with no call in flight. */
struct drive_call {
    struct drive *d;
    pthread_mutex_t mu;
    bool ended;             /* under mu: the call is over; st and resp say how */
    struct rpc_status st;   /* under mu */
    ProtobufCMessage *resp; /* under mu: the response when st is OK */
    bool in_flight;         /* started, and its end not yet taken */
};

/* One of the agent's own tool servers, or one of its MCP servers, for one drive
 * (tool_servers.c). */
struct tool_source {
    const char *source;          /* in d->tools.source: the address, or "mcp:<name>" */
    const struct agent_mcp *mcp; /* an MCP server's definition; NULL: a cflue.v1.Tools server */
    struct drive_call list;      /* a Tools server's Tools.List of this drive */
    struct mcp_op *op;           /* an MCP server's tools/list of this drive */
    ProtobufCMessage *answer;    /* a Tools server's tools */
    bool listed;                 /* the listing's end was taken */
    char *down;                  /* why it could not be listed (NULL: it was) */
    bool told;                   /* the model was told this drive that it is gone */
};

/* The agent's own tool servers and MCP servers for one drive (tool_servers.c). */
struct tool_servers {
    struct tool_source *at; /* its tool servers, then its MCP servers, in the agent's order */
    size_t n;
    char **owned; /* names and schemas made for MCP tools */
    size_t n_owned;
};

/* One `task` call of a turn: a subagent's child submission being admitted, then followed
 * until it settles (task.c). The fields under the drive's tasks.mu are written by rpc's
 * callbacks; the rest by the engine thread stepping the drive. */
struct task_call {
    struct drive *d;
    int index;                 /* the call's index in the answer */
    const char *call_id;       /* the answer's */
    const struct skill *skill; /* an activate_skill of a skill in the sandbox: its SKILL.md is
                                * read again (admit carries the ReadFile); NULL: a task */
    char *agent;               /* the subagent */
    char *prompt;
    char *cwd; /* the child's working directory, relative to the sandbox's (Delegation.cwd) */
    const Cflue__V1__Attachment **atts; /* the conversation's attachments handed to the child
                                         * (the drive keeps the messages they are in) */
    size_t n_atts;
    bool done;                 /* its result is recorded (or the drive halted) */
    struct drive_call admit;   /* the Admit */
    uint64_t admit_ticket;     /* the Admit's claim in flight (engine_claim_with_admit; 0: none) */
    char *child_submission_id; /* once admitted */
    char *child_conversation_id;
    struct rpc_astream *follow; /* the Follow of the child's conversation, or NULL */
    bool follow_released;
    ProtobufCMessage *record;    /* under mu: a record of the Follow not yet taken */
    bool follow_ended;           /* under mu: the Follow is over; follow_st says how */
    struct rpc_status follow_st; /* under mu */
    int64_t offset;              /* the last record of the child's conversation seen (-1: none) */
    char *answer;                /* the child's latest assistant text */
    int64_t first_fail_ms; /* monotonic: the first failure of the retries going on (0: none) */
    int64_t retry_at_ms;   /* monotonic: when the next try is due (0: none waits) */
    int64_t backoff_ms;
};

/* The `task` calls of a turn (task.c). */
struct task_wait {
    pthread_mutex_t mu;
    struct task_call *calls;
    size_t n;
};

/* The drive's Store call in flight (drive_store.c): an Append, or the Settle. At most one at a
 * time, so records reach the stream in the order written. */
struct store_flight {
    struct drive_call call;
    const char *method;   /* "Append", "Settle", "Read" */
    bool courtesy;        /* an Append of assistant_delta records: one try, its end only freed */
    size_t n_sent;        /* it carries the first n_sent pending records */
    bool mark_sent;       /* an Append that stamps the input applied */
    int64_t first_try_ms; /* monotonic: the first try of this call (0: none is being made) */
    int64_t retry_at_ms;  /* monotonic: when the next try is due (0: none waits) */
    int64_t backoff_ms;   /* the wait before the try after next */
};

/* How a Store call in flight stands (dstore_flight_take). */
enum flight_state {
    FLIGHT_IDLE,    /* none is being made */
    FLIGHT_WAITING, /* in flight, or waiting for its retry timer: the drive parks */
    FLIGHT_ENDED,   /* over, for good: rc and resp say how */
};

/* What the engine keeps on a drive (engine.c; under the engine's lock). */
struct engine_link {
    struct engine_queue_item ready; /* in the ready queue; key: admission order */
    struct engine_queue_item timer; /* in the timer queue; key: due time (monotonic ms) */
    bool running;                   /* an engine thread is stepping it */
    bool again;                     /* posted while running: step it again */
    int64_t resume_ms;              /* the backoff before claiming it again if it is interrupted */
    bool on_children;               /* parked on its task children: not counted against
                                     * --max-drives (engine_on_children) */
};

struct drive {
    Cflue__V1__ClaimResponse *claim; /* owned */
    const Cflue__V1__Submission *sub;
    /* the submission's trace (Submission.traceparent) with a span of this drive's own: the
     * engine makes it the current trace while it steps the drive, so its lines and its calls
     * carry it (a submission admitted without one gets a trace for this drive alone) */
    struct trace_ctx trace;
    Cflue__V1__Fence fence;
    struct active *act;
    struct agent_defs *defs; /* the definitions in force when the drive began (held) */
    const struct agent_def *agent;
    const char *tools_addr;  /* the sandbox's toold: the agent's own, or the parent's it shares
                              * (a subagent without a sandbox of its own); NULL: no sandbox */
    const char *tools_spec;  /* the placement tools_addr was picked by (placement.h): the
                              * agent's sandbox.tools, or the parent's dns: name; NULL: none */
    int64_t replica_wait_ms; /* since when the drive waits for its replica, out of DNS
                              * (monotonic; 0: it does not) */
    int64_t replica_back_ms; /* when the lookups found it again (0: not yet) */
    bool glance_unreached;   /* the last Glance failed for want of its toold (tools_failed) */
    char workspace[256];
    /* the limits on the sandbox's commands: its agent's sandbox.limits, or those the parent
     * shared its sandbox with (Delegation.sandbox_limits); NULL: toold's own */
    Cflue__V1__CommandLimits *limits;
    Cflue__V1__CommandLimits limits_buf;
    Google__Protobuf__Duration limits_cpu;
    char cwd[DRIVE_CWD_MAX + 1]; /* a subagent scoped to a directory of its parent's sandbox
                                  * (Delegation.cwd), relative to the sandbox's working
                                  * directory; "": that directory itself */
    const char *model;    /* provider/model-id it calls: its agent's, or (a subagent without one)
                           * its parent's; NULL: neither, and the drive fails before a turn */
    char provider[16];    /* the model's provider ("anthropic" or "openai") */
    const char *model_id; /* the model's id, after the provider */
    int depth;            /* delegation depth: 0 for work submitted directly, 1.. for subagents */
    bool takeover;
    int64_t turn_mark_us;  /* monotonic: the drive's start, then its last answer (stats_turn) */
    struct record_log log; /* the conversation, read once and appended through */
    bool log_loaded;       /* the whole conversation was read into the log */
    char *load_token;      /* the next page of the reading in flight, or NULL */
    Cflue__V1__Submission **known; /* submissions whose messages the drive holds (joins, Gets) */
    size_t n_known;
    /* streaming deltas */
    struct buf delta;
    int64_t delta_flushed_ms;
    int delta_seq;
    bool delta_restart;   /* the next delta is the first of its try (AssistantDelta.restart) */
    int turn;             /* the model turn being taken, from 1 (AssistantMessage.turn) */
    bool quiet;           /* a call whose text is not shown to watchers (summaries) */
    bool compact_request; /* this submission asks for a compaction, not an answer */
    /* The time limit storaged installed, on this process's monotonic clock (0: none): see
     * drive_set_deadline. claimed_mono_ms: when the claim was answered, by that clock. */
    int64_t timeout_at_mono_ms;
    int64_t claimed_mono_ms;
    struct cf_error err;
    struct cf_error fault; /* the first storaged/toold failure: the attempt ends unsettled */
    int store_tries;       /* how many tries the last dstore_call took */
    bool mark_pending;     /* the next flush stamps the input applied (budgets installed) */
    int64_t hold_until_ms; /* monotonic: the pending records wait for the model's answer until
                            * then (dstore_write_behind_held; 0: they do not) */
    bool store_down;       /* a Store call failed for good (storaged unreachable or busy) */
    int32_t queued;        /* submissions queued behind, as storaged last said */
    /* the state machine */
    enum drive_state state;
    enum drive_end end;
    bool parked; /* the last step waits for an event: the engine steps it when posted */
    struct model_wait mw;
    struct tool_wait tw;
    struct task_wait tasks;
    struct store_flight sf;
    struct drive_call prompt_call; /* the first turn's Glance (or Tools.List) to toold */
    struct tool_servers servers;   /* the agent's own tool servers */
    struct engine_link eng;
    struct toolset tools;
    struct skill_set ws_skills; /* the skills found in the sandbox this attempt (.agents/skills) */
    char *system_text;
    struct llm_response answer; /* the turn's answer, between MODEL and TOOLS */
    bool more;                  /* the work goes on after this turn: calls ran or input joined */
    bool joined_once;           /* the first JOIN (before the first turn) happened */
    struct {
        int phase;    /* joins.c: where the joining stands (DRIVE_JOIN_WAIT) */
        size_t first; /* the claimed deliveries: d->known[first .. first + n) */
        size_t n;
        size_t next; /* the next one to append, then to finalize */
        int joined;  /* how many joined */
        bool before_first_turn;
        Cflue__V1__ListResponse *earlier; /* takeover: what an earlier attempt left joining */
        char *page_token; /* the List's next page (NULL: its first): pages end at a byte budget */
    } joining;
    bool threshold_checked; /* this turn's context was compacted for size already */
    bool overflow_retried;  /* a context overflow was compacted once (per drive) */
    int rebinds;            /* reloads taken up since the last model call */
    bool commands_cut;      /* an earlier attempt's calls were found without results: their commands
                             * may still be stopping in toold (ENGINE_COMMANDS_GONE_MS) */
    bool fit_tightened;     /* an overflow compaction did not mend: requests
                             * fitted to half the room from then on (per drive) */
    enum cf_status model_rc;              /* the last model call's status */
    Cflue__V1__CompactionTrigger trigger; /* why DRIVE_COMPACT runs */
    struct {
        int64_t cut;             /* the offset of the first record kept verbatim */
        int64_t before;          /* the summarized part's estimated tokens */
        int64_t tail;            /* the kept part's */
        int phase;               /* compaction.c: summary, prompt, then stored */
    } compacting;                /* the summary in flight (DRIVE_COMPACT_WAIT) */
    Cflue__V1__Outcome outcome;  /* what DRIVE_SETTLE records */
    Cflue__V1__Outcome settling; /* what the Settle in flight records, and why: */
    const char *settling_error;  /* d->error or a constant string */
    char error[1024];            /* and why, when not completed */
};

/* ---- drive.c: a drive's life, stepped by the engine ---- */

/* drive_new makes a drive of a claim (taken: freed with the drive). NULL when this process
 * holds ACTIVE_MAX drives already (the claim is freed; its lease expires and the work is
 * taken again). */
struct drive *drive_new(Cflue__V1__ClaimResponse *claim);
/* drive_run steps d until it parks (waits for an event: engine_post steps it again) or is
 * done; returns true when done. One thread at a time. */
bool drive_run(struct drive *d);
/* drive_end_of: how a done drive ended. */
enum drive_end drive_end_of(const struct drive *d);
/* drive_sub_trace reads the trace submission s was admitted with (Submission.traceparent and
 * .tracestate) into out: true; false, out holding no trace, when it has none usable. */
bool drive_sub_trace(const Cflue__V1__Submission *s, struct trace_ctx *out);
/* drive_trace: d's trace (its submission's, with the drive's own span). */
const struct trace_ctx *drive_trace(const struct drive *d);
/* drive_lease_held copies into out the active slot of a done drive that stopped because this
 * process is stopping, its lease still held (a lease to hand back): true; false otherwise. */
bool drive_lease_held(const struct drive *d, struct active *out);
/* drive_free releases a done drive (its active slot first: nothing posts it afterwards). */
void drive_free(struct drive *d);

/* ---- drive.c: the drive's flags (each reads the active slot under g_agentd.mu) ---- */

/* drive_stopped: an abort was asked, the lease was lost or the process is stopping. */
bool drive_stopped(struct drive *d);
/* drive_abort_seen: an abort intent was seen. */
bool drive_abort_seen(struct drive *d);
/* drive_mark_lease_lost marks the lease lost: the drive writes nothing more. Idempotent. */
void drive_mark_lease_lost(struct drive *d);
/* drive_lost_or_down: the attempt must not write any more (lease lost or stopping); an abort
 * alone still lets it record the aborted outcome. */
bool drive_lost_or_down(struct drive *d);
/* drive_broken: drive_lost_or_down, or a fault. */
bool drive_broken(struct drive *d);
/* drive_halted: the drive must stop taking steps: drive_stopped, or a fault. */
bool drive_halted(struct drive *d);
/* drive_fault keeps why this attempt cannot go on (the first reason wins) and logs it. */
void drive_fault(struct drive *d, const char *what, const struct cf_error *e);
/* drive_time_left: milliseconds left before the time limit (INT64_MAX: none). */
int64_t drive_time_left(struct drive *d);
/* drive_set_deadline puts in force the time limit storaged gave the submission (sub's
 * deadline, a time of storaged's clock; none: no limit). It is kept as a time of this
 * process's monotonic clock: as much time is left as was left at the claim by storaged's own
 * clock (the deadline less the attempt's start_time, storaged's clock at the claim, both
 * read from sub: storaged moves both when its clock steps), counted from when the claim was
 * answered here. So neither a clock that differs between the two hosts nor a step of either
 * clock while the drive runs moves it. */
void drive_set_deadline(struct drive *d, const Cflue__V1__Submission *sub);
/* drive_transient: a status from storaged or toold that says "try again later". */
bool drive_transient(enum cf_status rc);

/* ---- drive_call.c: a unary call a parked drive waits on ---- */

/* dcall_init readies c for d's calls; dcall_cleanup frees what an untaken end left. */
void dcall_init(struct drive_call *c, struct drive *d);
void dcall_cleanup(struct drive_call *c);
/* dcall_start starts one event-driven call (rpc_acall_start): its end posts the drive. At
 * most one per drive_call at a time. */
void dcall_start(struct drive_call *c, struct rpc_channel *ch, const char *path,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                 int64_t timeout_ms);
/* dcall_post posts the drive `drive` (an mcp_done_fn). */
void dcall_post(void *drive);
/* dcall_take: true when the call has ended, with its status in *st and its response (the
 * caller's: NULL unless OK) in *resp; false while it is in flight (the drive parks). */
bool dcall_take(struct drive_call *c, struct rpc_status *st, ProtobufCMessage **resp);

/* ---- drive_store.c: Store calls of a drive ---- */

/* dstore_call makes one Store call, retrying transient failures with backoff and jitter for as
 * long as the attempt may hold its lease (at least 5 s), unless the lease is lost or the process
 * stops (an abort still retries: the outcome must be recorded). Every method retried is
 * idempotent for the same request. A stale fence (CF_STALE) marks the lease lost. On success
 * *resp is the caller's to free; the last failure is in d->err. */
enum cf_status dstore_call(struct drive *d, const char *method, const ProtobufCMessage *req,
                           const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp);
/* dstore_retry_again tells whether a Store call of d that failed with err (the first try at
 * first_try_ms, monotonic) is tried again wait_ms from now: while the failure is transient and
 * the drive goes on, for as long as the lease lasts (at least 5 s); past that only when
 * storaged refused for want of room (STORAGE_FULL), while the submission has time left: no
 * claim takes the work over meanwhile, and storaged counts the time it could not write
 * against no lease. */
bool dstore_retry_again(struct drive *d, const struct cf_error *err, int64_t first_try_ms,
                        int64_t wait_ms);
/* dstore_load reads the whole conversation into d->log, paging with page tokens, blocking
 * (the rarer paths). A failure is a fault. */
enum cf_status dstore_load(struct drive *d);
/* dstore_load_start starts reading the conversation into d->log as the call in flight (one
 * page at a time; no thread waits); false when there is nothing to read (the claim saw the
 * conversation empty). */
bool dstore_load_start(struct drive *d);
/* How the reading dstore_load_start began stands (dstore_load_take). */
enum load_state {
    LOAD_WAITING, /* a page is in flight, or its retry waits: the drive parks */
    LOAD_DONE,    /* the whole conversation is in d->log */
    LOAD_FAILED,  /* a fault (or a lost lease) */
};
/* dstore_load_take takes the page that arrived into d->log and asks for the next. */
enum load_state dstore_load_take(struct drive *d);
/* dstore_defer_one writes one record with typed body `body` (the caller keeps it) as pending
 * in d->log: the next store write carries it (dstore_flush, or the Settle). CF_INTERNAL (a
 * fault) only when body is no record body. */
enum cf_status dstore_defer_one(struct drive *d, const char *id, const char *submission_id,
                                ProtobufCMessage *body);
/* The bytes of records one Append (or Settle) carries: within storaged's default 16 MiB message
 * limit, and above its bound on one record, so that any record goes. */
#define DSTORE_APPEND_BYTES_MAX (8 << 20)
/* dstore_flush appends the pending records under the fence (in one Append, or in several
 * of at most DSTORE_APPEND_BYTES_MAX each), stamping the input
 * applied when d->mark_pending (taking the time limit storaged installed); acknowledged, they
 * are in d->log at their offsets. Keeps the answer's hints (abort intent, queued count). Any
 * failure but a stale fence is a fault; on any failure the pending records are dropped. */
enum cf_status dstore_flush(struct drive *d);
/* dstore_flight_send sends req (method "Append" or "Settle") as the drive's Store call in
 * flight; its end, or its retry timer, posts the drive. Only when none is in flight. */
void dstore_flight_send(struct drive *d, const char *method, const ProtobufCMessage *req,
                        const ProtobufCMessageDescriptor *desc, size_t n_sent);
/* dstore_send_delta sends req (an Append of assistant_delta records for watchers) as the call
 * in flight, when none is: one try of at most timeout_ms, no fault whatever its end (a stale
 * fence marks the lease lost); the next write goes out after it, so watchers see the deltas
 * before the message that follows them. false (nothing sent) while another call is in flight. */
bool dstore_send_delta(struct drive *d, const ProtobufCMessage *req, int64_t timeout_ms);
/* dstore_flight_take takes the end of the call in flight when it came (a delta's end is
 * taken here alone: FLIGHT_IDLE). A transient failure is
 * tried again after a backoff, as dstore_call does: FLIGHT_WAITING, and once the timer posted
 * the drive, resend(d) sends the request again (through dstore_flight_send). A stale fence
 * marks the lease lost; a lost lease or shutdown during a backoff ends the call CF_STALE. On
 * FLIGHT_ENDED, *rc (d->err on failure) and *resp (the caller's to free; NULL unless CF_OK). */
enum flight_state dstore_flight_take(struct drive *d, void (*resend)(struct drive *d),
                                     enum cf_status *rc, ProtobufCMessage **resp);
/* dstore_writes_done takes the end of the drive's Append in flight (records acknowledged,
 * hints kept; a transient failure tried again after a backoff, as dstore_call does, with a
 * timer posting the drive; any other failure handled as dstore_flush does) and reports whether
 * none is in flight or waiting to be tried again. Never blocks: the drive parks while false,
 * and the call's end or the timer posts it. No synchronous Store call may write while one is
 * in flight (drive_run keeps every state but the waits behind this). */
bool dstore_writes_done(struct drive *d);
/* dstore_write_behind is dstore_writes_done, then an Append of the pending records started
 * when none is in flight (and the drive can still write). For records that must reach the
 * stream soon but need not be waited for: tool results as they arrive. */
void dstore_write_behind(struct drive *d);
/* dstore_write_behind_held is dstore_write_behind for the records pending as a model call
 * starts (the first turn's input and prompt, with the input's stamp; a batch's last tool
 * results): they wait up to --hold-writes-ms for its answer, and an answer that comes sooner
 * goes out with them, in one Append or the Settle (which stamps the input too), an Append
 * saved. A crash meanwhile loses them, as one before their Append committed always could: the
 * next attempt appends the input again, and records the outcome of the results' calls as
 * unknown. */
void dstore_write_behind_held(struct drive *d);
/* dstore_release_held starts the Append of held records once their time is up, or at once when
 * now is set (the model's output began to stream, or the drive halted: the results of commands
 * that ran are stored even while agentd shuts down, unless the lease is lost); until then it
 * sets the drive's timer for that time. Returns whether it let them go. */
bool dstore_release_held(struct drive *d, bool now);
/* dstore_mark fills mark (and limit, its time limit) with the budgets the drive's input stamp
 * installs: the agent's max_attempts and time limit. Returns mark. */
Cflue__V1__MarkInputAppliedRequest *dstore_mark(const struct drive *d,
                                                Cflue__V1__MarkInputAppliedRequest *mark,
                                                Google__Protobuf__Duration *limit);
/* dstore_stored is dstore_write_behind reporting whether every record written so far is
 * stored, or can no longer be (a fault, a lost lease, shutdown: drive_broken); the drive parks
 * while false. The input is stamped applied by the Append that carries it (a Compact request,
 * with no input record, stamps it with one blocking MarkInputApplied). */
bool dstore_stored(struct drive *d);
/* dstore_append_input writes submission s's message as its user_message `id` (text and one
 * AttachmentRef per attachment; the bytes stay with the submission), pending (as
 * dstore_defer_one). */
enum cf_status dstore_append_input(struct drive *d, const char *id, const Cflue__V1__Submission *s);
/* dstore_settled_hints takes a Settle's answer: the pending records it carried acknowledged,
 * and the claimer woken when the conversation's next message is runnable. */
void dstore_settled_hints(struct drive *d, const Cflue__V1__SettleResponse *sr);
/* dstore_keep_submission keeps s (owned by the drive from now on) so that its message's
 * attachments need no Get. */
void dstore_keep_submission(struct drive *d, Cflue__V1__Submission *s);
/* dstore_attachments is the drive's context_attachments_fn (arg: the drive): the message of a
 * submission from the claim, a kept submission, or one Store.Get (kept afterwards). */
enum cf_status dstore_attachments(void *arg, const char *submission_id,
                                  const Cflue__V1__Message **out, struct cf_error *err);
/* dstore_cleanup frees what the drive's store client keeps. Idempotent. */
void dstore_cleanup(struct drive *d);

/* dstore_utf8 returns text when it is valid UTF-8, else a copy in *scratch (set up here; the
 * caller frees it with buf_cleanup either way) with each invalid byte replaced by U+FFFD:
 * storaged refuses a record whose text is not UTF-8, and text cut at a byte count may end
 * inside a character. */
const char *dstore_utf8(const char *text, struct buf *scratch);

/* dstore_build_context builds the context of the records before `before` from d->log, the
 * pending ones (not stored yet) the newest; a failed attachments lookup is a fault. */
void dstore_build_context(struct drive *d, struct context *c, int64_t before);

/* ---- prompt.c ---- */

/* prompt_recompose_start asks toold, in one call that holds no thread, for what a prompt
 * composed again after a compaction shows of the sandbox (nothing without a sandbox). */
void prompt_recompose_start(struct drive *d);
/* prompt_recompose_take: false while that call is in flight; then true, with *text the new
 * system prompt (instructions, project notes, tool roster of d->tools, date, working directory
 * and top-level listing; the caller frees it), or NULL with a fault when toold could not be
 * read: no prompt is frozen from a partial environment. */
bool prompt_recompose_take(struct drive *d, char **text);
/* prompt_line appends s[0..n) to b on one line: each line break, tab or other control
 * character becomes a space (what a skill or tool server describes cannot add lines, or
 * sections, to the system prompt). */
void prompt_line(struct buf *b, const char *s, size_t n);
/* prompt_start asks toold, in one call that holds no thread, for the tool set and (unless the
 * conversation holds a frozen prompt still in force) what the prompt shows of the sandbox.
 * Without a sandbox it starts nothing; a toold that cannot be reached is a fault. */
void prompt_start(struct drive *d);
/* prompt_take: false while prompt_start's call is in flight (the drive parks; its end posts
 * it). Then true, with d->tools listed and d->system_text the frozen prompt: the latest
 * recorded one still in force, or one composed now and recorded (pending). NULL system_text:
 * the drive halted or failed (a fault). */
bool prompt_take(struct drive *d);

/* ---- tool_batch.c ---- */

/* tools_channel_at returns the shared channel to the tool server at addr (kept for the
 * process's life), or NULL past TOOLS_CHANNELS_MAX servers. */
#define TOOLS_CHANNELS_MAX 64
struct rpc_channel *tools_channel_at(const char *addr);
/* tools_channel: tools_channel_at the drive's toold; NULL without a sandbox. */
struct rpc_channel *tools_channel(struct drive *d);
/* tools_server_down: a Tools/Sandbox status that says the server itself failed (down,
 * overloaded, timed out) rather than answering about the call. */
bool tools_server_down(const struct rpc_status *st);
/* tools_failed reports whether a Tools/Sandbox status means toold itself failed
 * (tools_server_down); such a failure is a fault. */
bool tools_failed(struct drive *d, const char *what, const struct rpc_status *st);
/* toolset_add appends one tool to ts, run by the server at source (NULL: by agentd); the
 * strings must outlive ts. */
void toolset_add(struct toolset *ts, const char *name, const char *description,
                 const char *schema_json, const char *source);
/* toolset_find: the index of the tool named name in ts, or -1. */
int toolset_find(const struct toolset *ts, const char *name);
/* tools_load lists the sandbox's tools into d->tools with a blocking Tools.List (for a toold
 * whose Glance does not list them); a sandboxed agent whose toold cannot be reached gets a
 * fault, never an empty tool set. */
void tools_load(struct drive *d);
/* tools_adopt makes specs d's tool set; the set keeps `owner`, the answer they came in. */
void tools_adopt(struct drive *d, ProtobufCMessage *owner, Cflue__V1__ToolSpec **specs, size_t n,
                 const char *working_directory);
/* tools_scope_refused faults a subagent scoped to a directory (d->cwd) whose sandbox server
 * did not apply the scope (applied: what it answered), as its calls would run elsewhere; true
 * then. A fault no retry mends. */
bool tools_scope_refused(struct drive *d, bool applied);
/* tools_no_channel faults a sandboxed agent whose toold this agentd cannot reach. */
void tools_no_channel(struct drive *d);
/* tools_cleanup frees d->tools. Idempotent. */
void tools_cleanup(struct drive *d);
/* tools_record_result writes the result of call `call_id` (index `index` of turn d->turn)
 * as a pending record (DRIVE_TOOLS_WAIT writes it behind; the next model turn waits until it
 * is stored); t, when truncated, is recorded with it. */
void tools_record_result(struct drive *d, int index, const char *call_id, const char *name,
                         const char *text, bool is_error, const Cflue__V1__Truncation *t,
                         bool outcome_unknown);
/* tools_record_images is tools_record_result of a result that holds images (the caller keeps
 * them; they are copied): those within image.h's bounds go with it, in order, and each other
 * one is named in a note after the text, saying why it is not shown. */
void tools_record_images(struct drive *d, int index, const char *call_id, const char *name,
                         const char *text, bool is_error, const Cflue__V1__Truncation *t,
                         Cflue__V1__Attachment *const *images, size_t n_images);
/* tools_start starts the calls of `resp`, one ExecuteBatch per server that runs them (calls
 * naming no tool of the set get their error result at once); false when nothing was started
 * (no call to run, or a fault). The streams' messages and ends post the drive. */
bool tools_start(struct drive *d, const struct llm_response *resp);
/* tools_poll records the results that arrived, cancels the calls when the drive halted, and
 * returns true once every lane is over. toold failing mid-batch is a fault; a server refusing
 * calls, and the agent's own tool server failing, give the calls left an error result (and,
 * for a server gone, a signal: servers_tell_gone). */
bool tools_poll(struct drive *d);
/* tools_all_answered: every call of the batch in flight has its result recorded (the streams'
 * ends may still be on their way). */
bool tools_all_answered(const struct drive *d);
/* tools_wait_init / tools_wait_cleanup set up and free d->tw (cleanup: no batch in flight). */
void tools_wait_init(struct drive *d);
void tools_wait_cleanup(struct drive *d);

/* ---- tool_servers.c: the agent's own tool servers ---- */

/* servers_init / servers_cleanup set up and free d->servers (cleanup: no listing in flight). */
void servers_init(struct drive *d);
void servers_cleanup(struct drive *d);
/* servers_list_start asks each of the agent's tool servers for its tools (Tools.List) and
 * each of its MCP servers (tools/list), one operation each that holds no thread; their ends
 * post the drive. */
void servers_list_start(struct drive *d);
/* servers_list_take: false while a listing is in flight; then true, each server's tools or
 * why it could not be listed kept in d->servers. Idempotent once true. */
bool servers_list_take(struct drive *d);
/* servers_tools_add appends the listed servers' tools to d->tools, in the agent's order (an
 * MCP server's as mcp__<server>__<tool>; a tool whose name would not be a valid tool name is
 * left out with a warning), and records a `resources` signal naming each server that could
 * not be listed (its tools are left out). false, with d->error naming both sources, when a
 * name is reserved for the framework or taken already. */
bool servers_tools_add(struct drive *d);
/* servers_tell_gone records, once per drive and server, a `resources` signal that the server
 * that runs d->tools' tools of `source` stopped answering (why) and that its tools fail until
 * it is back. */
void servers_tell_gone(struct drive *d, const char *source, const char *why);
/* servers_mcp: the MCP server whose tools have `source` ("mcp:<name>"), or NULL. */
const struct agent_mcp *servers_mcp(const struct drive *d, const char *source);
/* servers_clash: true, with why (of size n) naming both sources, when a tool named name from
 * source (an address; NULL: the framework) may not join ts: the framework reserves the name,
 * or a tool of ts has it. sandbox_addr tells the sandbox's toold from other servers in the
 * message. */
bool servers_clash(const struct toolset *ts, const char *name, const char *source,
                   const char *sandbox_addr, char *why, size_t n);

/* ---- narrate.c: telling the model what changed ---- */

/* One resource of a state (narrate.c). */
struct narrated_item {
    Cflue__V1__Resource r;
    char digest[17];
    int which; /* 0: a tool, 1: a skill, 2: a subagent */
};

/* A ResourceState made for a drive; its strings point into the drive. */
struct narrated {
    Cflue__V1__ResourceState st;
    char instructions[17];
    char sandbox[600];
    struct narrated_item *items;
    Cflue__V1__Resource **ptrs;
    size_t n;
};

/* narrate_state fills n with d's resources now: its agent's instructions, its sandbox, its
 * tool set (d->tools, assembled), its skills (declared, then found in the sandbox) and its
 * subagents. Free with narrate_cleanup. */
void narrate_state(const struct drive *d, struct narrated *n);
void narrate_cleanup(struct narrated *n);
/* narrate_changes compares d's resources now with the newest state the conversation told the
 * model of and records a signal for each kind of change, pending: `instructions` (with the new
 * instructions), `environment` (a sandbox attached, detached or switched, with every roster),
 * `resources` (tools, skills, subagents added, removed or updated). Each carries the new
 * state. Nothing without a baseline. */
void narrate_changes(struct drive *d);
/* narrate_skill_description: the description of skill `name` (declared, or found in the
 * sandbox), "" when unknown. */
const char *narrate_skill_description(const struct drive *d, const char *name);

/* ---- task.c: the framework's `task` tool ---- */

/* The depth below which a drive may still delegate: a `task` call made at this depth fails
 * with delegation_depth_exceeded. */
#define TASK_DEPTH_MAX 4
/* The most `task` calls one answer starts (the first, in the answer's order); each one past
 * it gets an error result. With the depth bound, a tree of work stays within bounds. */
#define TASK_CALLS_MAX 16

/* task_is_framework: name is a tool agentd runs itself (never sent to a tool server). */
bool task_is_framework(const char *name);
/* task_name_reserved: name is one only the framework may give a tool (its own, and the
 * structured-result tools finish and give_up). */
bool task_name_reserved(const char *name);
/* task_tools_add appends the framework tools to d->tools, after the sandbox's. false (with
 * d->error naming both sources) when a sandbox tool takes a name the framework reserves or
 * another sandbox tool's. */
bool task_tools_add(struct drive *d);
/* task_start starts the answer's `task` calls that have no result yet: a call that cannot
 * delegate (bad arguments, an undeclared subagent, the depth limit) gets its result at once;
 * each other one admits its child and follows it. true when any is in flight (their ends post
 * the drive). */
bool task_start(struct drive *d, const struct llm_response *resp);
/* task_poll takes what arrived for the calls in flight, records each call's result once its
 * child settled, retries what failed transiently, stops following when the drive halted, and
 * returns true once no call is in flight. */
bool task_poll(struct drive *d);
/* task_resume fills d->answer with the calls of this submission's latest turn when some of its
 * `task` calls have no result (an earlier attempt stopped while its children worked) and sets
 * d->turn to that turn: true when the drive is to wait for those children again. */
bool task_resume(struct drive *d);
/* task_wait_init / task_wait_cleanup set up and free d->tasks (cleanup: none in flight). */
void task_wait_init(struct drive *d);
void task_wait_cleanup(struct drive *d);

/* ---- skill_tools.c: the framework's skill tools ---- */

/* skill_tools_add appends activate_skill (when d's agent has skills) and read_skill_resource
 * (when one of them has supporting files) to ts. */
void skill_tools_add(struct drive *d, struct toolset *ts);
/* skill_roster appends the prompt's section listing d's skills: its agent's declared ones,
 * then those found in the sandbox (nothing without any). */
void skill_roster(struct buf *b, const struct drive *d);
/* skill_tools_discover keeps the skills a Glance found in the sandbox in d->ws_skills (one
 * whose SKILL.md breaks a rule is skipped, with a warning logged). false, with d->error set, when
 * one takes the name of a skill the agent declares. */
bool skill_tools_discover(struct drive *d, Cflue__V1__GlanceSkill *const *found, size_t n);
/* skill_tools_in_sandbox returns the skill in the sandbox that call c activates (activate_skill
 * naming a skill found there), or NULL. */
const struct skill *skill_tools_in_sandbox(struct drive *d, const struct llm_call *c);
/* skill_tools_activated writes the result of activating s, read again from the sandbox as
 * data[0..len), into out; false (the reason in out) when it no longer passes the checks. */
bool skill_tools_activated(struct drive *d, const struct skill *s, const uint8_t *data, size_t len,
                           struct buf *out);
/* skill_tool_run answers call c (index `index` of the turn) when it is activate_skill or
 * read_skill_resource, recording its result at once: true; false for any other tool. */
bool skill_tool_run(struct drive *d, int index, const struct llm_call *c);

/* ---- model_call.c ---- */

/* model_output_tokens: the output budget of every request to model (provider/model-id). */
int64_t model_output_tokens(const char *model);
/* model_call_start starts the turn's model call (attempt 1) on the model I/O loop; ctx is
 * taken (freed when the call finishes). model_call_poll, on each step of the parked drive,
 * flushes streamed deltas, cancels the call when the drive stopped, retries what may be
 * retried after a backoff (an engine timer) and returns true once the call has finished, with
 * its status in *rc and the answer in d->answer. */
void model_call_start(struct drive *d, const char *system, struct context *ctx,
                      const struct llm_tool *tools, size_t n_tools);
bool model_call_poll(struct drive *d, enum cf_status *rc);
/* model_call_init / model_call_cleanup manage d->mw. */
void model_call_init(struct drive *d);
void model_call_cleanup(struct drive *d);
/* model_record_answer records resp as this turn's assistant_message. A failure is a fault. */
enum cf_status model_record_answer(struct drive *d, const struct llm_response *resp);

/* ---- compaction.c ---- */

enum compact_result {
    COMPACT_DONE,    /* a compaction record and a recomposed system prompt were recorded */
    COMPACT_NOTHING, /* nothing older than the kept tail: nothing to do */
    COMPACT_NOTHING_OVERSIZED, /* nothing older than the newest turn, which alone is larger
                                * than a request has room for (compaction_fit shrinks it) */
    COMPACT_FAILED, /* the summary could not be had from the model (d->err), or a fault */
};

/* compaction_needed: a request estimated at `tokens` (context_tokens) would not leave the
 * reserve free (it and the output asked for over the window less the reserve). */
bool compaction_needed(const struct drive *d, int64_t tokens);
/* compaction_fit makes the request of system, c (and d's tools when `tools`) fit what the
 * threshold allows (half of it once d->fit_tightened) when it does not (context_fit: the
 * largest texts cut in c only, the records untouched), and logs `context_fitted` when it cut
 * anything. Strings it makes are c's. A turn's request calls it only when compaction_needed
 * says so or the fit is tightened. */
void compaction_fit(struct drive *d, struct context *c, const char *system, bool tools);
/* compaction_start finds the cut (nothing may be pending: DRIVE_COMPACT waits until it is
 * stored) and starts the summary of what comes before it (model_call_start, quiet: no
 * deltas): true, and the drive parks until compaction_take. false when it is over at once:
 * *over is COMPACT_NOTHING, COMPACT_NOTHING_OVERSIZED or COMPACT_FAILED. The summary is
 * asked for with a transcript of that part (context_transcript), fitted like any request. */
bool compaction_start(struct drive *d, enum compact_result *over);
/* compaction_take: false while the summary call, the Glance for the recomposed prompt or the
 * Append of both is in flight (each holds no thread); then true, with the summary recorded
 * (`compaction`, and a recomposed `system_prompt` that d->system_text is now, in one Append)
 * on COMPACT_DONE. The trigger recorded is d->trigger. */
bool compaction_take(struct drive *d, enum compact_result *out);

/* ---- joins.c ---- */

/* joins_start claims the submissions queued behind this one (ClaimJoinable, as the drive's
 * Store call in flight) when storaged or a Submit here said some are queued: true, and the
 * drive parks until joins_take says the joining is over. false when nothing is worth asking. */
bool joins_start(struct drive *d);
/* joins_take goes on with the joining as its Store calls end: the inputs of the claimed
 * submissions appended, then each join finalized. False while a call is in flight; then true,
 * with *joined how many joined. A failure is a fault (or a lost lease): *joined is 0. */
bool joins_take(struct drive *d, int *joined);
/* joins_recover_start starts, at a takeover, settling what an earlier attempt left joining
 * into this submission: each made final when its input is in the stream, else put back in the
 * queue. The drive parks until joins_take says it is over (a failure is a fault). */
void joins_recover_start(struct drive *d);
/* joins_cleanup frees what a drive that ended while joining still holds. */
void joins_cleanup(struct drive *d);

/* ---- settle.c ---- */

/* settle_start records the outcome (see settle.c) with the Settle sent as the drive's Store
 * call in flight: true when it went out (the drive parks in DRIVE_SETTLE_WAIT until
 * settle_poll says it is over); false when the drive ended before (*end says how). error must
 * outlive the call. */
bool settle_start(struct drive *d, Cflue__V1__Outcome outcome, const char *error,
                  enum drive_end *end);
/* settle_poll takes the end of the Settle settle_start sent: true with *end once it is over
 * (retries included), false while the drive waits for it. */
bool settle_poll(struct drive *d, enum drive_end *end);
/* settle_unsettled_start ends a drive that stopped short of an outcome: settle_start's
 * answer for an abort seen (aborted) or a fault no retry can mend (failed); otherwise false,
 * with *end stopped or interrupted (what is pending written first when storaged answers). */
bool settle_unsettled_start(struct drive *d, enum drive_end *end);
/* settle_ended names how a drive ended without settling: stopped or interrupted. */
enum drive_end settle_ended(struct drive *d);
/* settle_answered: the log shows this submission's work finished (settle.c). */
bool settle_answered(struct drive *d);
/* settle_repair records the outcome-unknown result for every call without a result; with
 * keep_tasks, not for the `task` calls of the latest turn (task_resume waits for their children
 * again). */
void settle_repair(struct drive *d, bool keep_tasks);

#endif
