/* ledger.h - the submission ledger and conversation streams: every state transition of
 * storaged as one function that runs inside the caller's write transaction.
 *
 * Each function validates against the rows it reads in the same transaction, so two
 * concurrent callers can never both succeed where only one may (the writer serializes
 * transactions). Responses are built in the context's arena.
 */
#ifndef CFLUE_STORAGED_LEDGER_H
#define CFLUE_STORAGED_LEDGER_H

#include "arena.h"
#include "status.h"

#include "cflue/v1/store.pb-c.h"

#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>

/* Byte bounds of the record streams (see docs/storaged.md, "Page and record sizes").
 *
 * A Read page holds records while their encoded size stays within the page budget, and always
 * at least one record. Append refuses a record whose encoded size, plus LEDGER_RECORD_SLACK for
 * what storaged adds when storing it (offset, timestamp, attempt id, default submission id and
 * record id), exceeds the page budget, so every stored record fits a page on its own and a page
 * never exceeds the budget plus a few bytes of ReadResponse framing. storaged sets the budget to
 * half its --max-message-bytes, at most LEDGER_PAGE_BYTES_MAX (8 MiB): comfortably under its own
 * send limit and under the 16 MiB receive limit gRPC clients of this project default to. */
#define LEDGER_PAGE_BYTES_MAX (8 << 20)
#define LEDGER_RECORD_SLACK 1024
/* What a Submission carries beside its admission (ids, times, an error of up to 8 KiB, an
 * abort reason, usage) and a response beside the Submission: an admission whose payload is
 * within the message limit less this is always sent whole (Admit's, Claim's, Get's and List's
 * answers). */
#define LEDGER_ADMIT_SLACK (64 << 10)
#define LEDGER_FOLLOW_BYTES                                                                        \
    (1 << 20) /* what one Follow read holds in memory (at least 1 record)                          \
               */

struct ledger_config {
    int64_t lease_ms;     /* default lease when a Claim asks for 0 */
    int64_t timeout_ms;   /* default submission deadline, from the first claim */
    int32_t max_attempts; /* default budget of claims */
    int64_t page_bytes;   /* Read page budget; 0: LEDGER_PAGE_BYTES_MAX */
    /* the largest message the server sends (--max-message-bytes; 0: no bound): a record
     * stored under a larger limit, which would not fit a message alone, is refused by name
     * (RECORD_OVER_MESSAGE_LIMIT) rather than failing every read of its conversation */
    int64_t send_bytes;
};

/* ledger_page_bytes returns the page budget of cfg (its default when 0). */
int64_t ledger_page_bytes(const struct ledger_config *cfg);

/* ledger_record_bytes_max returns the largest encoded Record, as sent to Append, that cfg
 * accepts: the page budget minus LEDGER_RECORD_SLACK. */
int64_t ledger_record_bytes_max(const struct ledger_config *cfg);

struct ledger_ctx {
    sqlite3 *db;
    struct arena *arena;
    const struct ledger_config *cfg;
    int64_t now;   /* the store clock, epoch ms, fixed for the transaction */
    bool appended; /* a record was appended: wake followers after commit */
};

/* Validation of requests happens before a transaction; these run inside one. Each returns
 * CF_OK and fills the response, or a status with err set; on failure the caller rolls the
 * function's work back (savepoint). None of them is idempotent unless stated. */

/* ledger_admit admits a submission (idempotent per agent + idempotency key; req->claim is no
 * part of the key's payload). With req->claim it also claims the admitted submission as
 * ledger_claim naming it would, setting out->claim (and out->submission to the claimed row)
 * only when it was its conversation's runnable head; a deduplicated Admit claims nothing. With
 * req->delegation (checked by validate_admit: no conversation_id, kind MESSAGE) the parent is
 * read in this transaction after the key: CF_NOT_FOUND when unknown, CF_INVALID when it is not
 * in delegation.parent_conversation_id or not one level above delegation.depth. The child gets
 * a new conversation and the column parent_submission_id, and is admitted with an abort intent
 * when the parent has one or is settled. Principals: a new conversation takes req->principal
 * (a child's, its parent conversation's); into an existing one, a request with a principal and
 * without admin must name the conversation's principal, else CF_PERMISSION (reason
 * NOT_CONVERSATION_OWNER), checked before its agent so the error tells another principal
 * nothing of it. Every submission row keeps its conversation's principal. */
CF_MUST_CHECK enum cf_status ledger_admit(struct ledger_ctx *c, const Cflue__V1__AdmitRequest *req,
                                          Cflue__V1__AdmitResponse *out, struct cf_error *err);

/* ledger_claim claims the next claimable work (see store.proto). An empty response (no
 * submission) is CF_OK. With a submission, head_offset and queued_behind are read in the same
 * transaction. */
CF_MUST_CHECK enum cf_status ledger_claim(struct ledger_ctx *c, const Cflue__V1__ClaimRequest *req,
                                          Cflue__V1__ClaimResponse *out, struct cf_error *err);

/* ledger_heartbeat renews the leases the owner still holds. */
CF_MUST_CHECK enum cf_status ledger_heartbeat(struct ledger_ctx *c,
                                              const Cflue__V1__HeartbeatRequest *req,
                                              Cflue__V1__HeartbeatResponse *out,
                                              struct cf_error *err);

/* ledger_release ends the leases the owner still holds of req's fences (work it stopped
 * without settling) after req's expire_after (unset: now): the next Claim after that takes
 * each submission over. Fences it no longer holds are reported lost and left alone. */
CF_MUST_CHECK enum cf_status ledger_release(struct ledger_ctx *c,
                                            const Cflue__V1__ReleaseRequest *req,
                                            Cflue__V1__ReleaseResponse *out, struct cf_error *err);

/* ledger_shift_times moves the times of the unsettled work that are compared with the store
 * clock (leases' ends, time limits, attempts' starts) by step_ms, after a step of the clock
 * (store_clock.h), so that each keeps the time it had left; none goes below 1 ms (a time at
 * or below 0 reads as none: a lease so moved would never run out), and a lease ended at a
 * start (1 ms) stays ended. *moved: how many submissions. */
CF_MUST_CHECK enum cf_status ledger_shift_times(struct ledger_ctx *c, int64_t step_ms, int *moved,
                                                struct cf_error *err);

/* ledger_extend_leases extends by outage_ms the leases that were still running at since_ms (a
 * time of the store clock, when the outage began): storaged could not store a heartbeat for
 * that long (it was down or stalled, or its disk full or failing), and that time counts
 * against no lease. *moved: how many submissions. */
CF_MUST_CHECK enum cf_status ledger_extend_leases(struct ledger_ctx *c, int64_t since_ms,
                                                  int64_t outage_ms, int *moved,
                                                  struct cf_error *err);

/* ledger_mark_input_applied stamps the input and installs budgets (first call only). */
CF_MUST_CHECK enum cf_status
ledger_mark_input_applied(struct ledger_ctx *c, const Cflue__V1__MarkInputAppliedRequest *req,
                          Cflue__V1__Submission *out, struct cf_error *err);

/* ledger_requeue returns a claimed submission to the queue. */
CF_MUST_CHECK enum cf_status ledger_requeue(struct ledger_ctx *c, const Cflue__V1__Fence *fence,
                                            Cflue__V1__Submission *out, struct cf_error *err);

/* ledger_claim_joinable takes the contiguous queued run behind a running host: it stops before
 * the first row with an abort intent or a Compact submission (never skipping one, so FIFO
 * holds), and a Compact host takes none. */
CF_MUST_CHECK enum cf_status ledger_claim_joinable(struct ledger_ctx *c,
                                                   const Cflue__V1__ClaimJoinableRequest *req,
                                                   Cflue__V1__ClaimJoinableResponse *out,
                                                   struct cf_error *err);

/* ledger_finish_join moves a joining delivery to joined (finalize) or back to queued. */
CF_MUST_CHECK enum cf_status ledger_finish_join(struct ledger_ctx *c,
                                                const Cflue__V1__JoinRequest *req, bool finalize,
                                                Cflue__V1__Submission *out, struct cf_error *err);

/* ledger_request_abort stamps abort intents (first stamp wins; idempotent) on its targets and
 * on the unsettled delegated descendants of each (in other conversations); out->affected lists
 * the targets, then their descendants, stamped now or before. */
CF_MUST_CHECK enum cf_status ledger_request_abort(struct ledger_ctx *c,
                                                  const Cflue__V1__RequestAbortRequest *req,
                                                  Cflue__V1__RequestAbortResponse *out,
                                                  struct cf_error *err);

/* ledger_settle reserves or finishes a submission's terminal outcome, with joined fan-out and
 * settlement records. A failed or aborted outcome, when reserved and when finished, stamps abort
 * intents on the unsettled delegated descendants of the submission (and of the joined ones
 * settled with it). req->records are appended first, through Append's path and its rules,
 * once the fence (with an attempt) matched: records_first_offset is the first one's offset,
 * -1 when none. Repeating an identical finished Settle is answered already_settled and appends
 * nothing. conversation_queued counts the conversation's queued rows after it. */
CF_MUST_CHECK enum cf_status ledger_settle(struct ledger_ctx *c,
                                           const Cflue__V1__SettleRequest *req,
                                           Cflue__V1__SettleResponse *out, struct cf_error *err);

/* ledger_append appends a fenced batch of records (idempotent for identical resends). A record
 * over ledger_record_bytes_max is CF_INVALID naming it. With req->mark_input_applied it then
 * does ledger_mark_input_applied's work for req's fence (also after a deduplicated resend) and
 * answers the row in out->submission; the caller commits it with synchronous=FULL. queued and
 * abort_requested are read in the same transaction. */
CF_MUST_CHECK enum cf_status ledger_append(struct ledger_ctx *c,
                                           const Cflue__V1__AppendRequest *req,
                                           Cflue__V1__AppendResponse *out, struct cf_error *err);

/* Reads: run on a reader connection, outside the writer. */

/* ledger_get reads one submission; CF_NOT_FOUND when unknown. */
CF_MUST_CHECK enum cf_status ledger_get(struct ledger_ctx *c, const char *submission_id,
                                        Cflue__V1__Submission *out, struct cf_error *err);

/* ledger_list lists submissions in sequence order, one page (see ListRequest; owner_id and
 * abort_requested are served by their partial indexes): the page token's scope is the filters,
 * its position the last sequence returned; next_page_token is
 * empty on the last page. CF_INVALID (INVALID_PAGE_TOKEN) for a token of other filters. */
CF_MUST_CHECK enum cf_status ledger_list(struct ledger_ctx *c, const Cflue__V1__ListRequest *req,
                                         Cflue__V1__ListResponse *out, struct cf_error *err);

/* ledger_scan_expired lists running or terminalizing rows whose lease expired, one page (page
 * token scope "scan", position the last sequence). CF_INVALID for a foreign token. */
CF_MUST_CHECK enum cf_status ledger_scan_expired(struct ledger_ctx *c,
                                                 const Cflue__V1__ScanExpiredRequest *req,
                                                 Cflue__V1__ListResponse *out,
                                                 struct cf_error *err);

/* ledger_conversation summarizes a conversation; CF_NOT_FOUND when unknown. */
CF_MUST_CHECK enum cf_status ledger_conversation(struct ledger_ctx *c, const char *conversation_id,
                                                 Cflue__V1__Conversation *out,
                                                 struct cf_error *err);

/* ledger_read returns one page of records after an offset (or after where req->page_token
 * says): at most req->page_size records (0: 100, at most 1000) and at most the page budget of
 * encoded bytes, always at least one record when any is left. next_page_token (scope: the
 * conversation id; position: the last offset returned) is empty when none is left after the
 * page; head_offset is the head when read. CF_RANGE (OFFSET_BEYOND_HEAD) past the head,
 * CF_NOT_FOUND for an unknown conversation, CF_INVALID (INVALID_PAGE_TOKEN) for a token of
 * another conversation, CF_CORRUPT for a stored body that does not decode. */
CF_MUST_CHECK enum cf_status ledger_read(struct ledger_ctx *c, const Cflue__V1__ReadRequest *req,
                                         Cflue__V1__ReadResponse *out, struct cf_error *err);

/* ledger_read_bytes is ledger_read with an explicit byte budget (> 0) instead of the page
 * budget (Follow reads smaller batches to bound its memory). */
CF_MUST_CHECK enum cf_status ledger_read_bytes(struct ledger_ctx *c,
                                               const Cflue__V1__ReadRequest *req, int64_t budget,
                                               Cflue__V1__ReadResponse *out, struct cf_error *err);

/* ledger_settlement_offset finds the offset of a submission's settlement record in its
 * conversation: CF_OK with *offset_out (-1 when not settled yet); CF_NOT_FOUND if unknown. */
CF_MUST_CHECK enum cf_status ledger_settlement_offset(struct ledger_ctx *c,
                                                      const char *submission_id,
                                                      const char *conversation_id,
                                                      int64_t *offset_out, struct cf_error *err);

/* ledger_status_name is the column value of a status ("queued", ...). */
const char *ledger_status_name(Cflue__V1__SubmissionStatus st);

/* ledger_outcome_name is the column value of an outcome ("completed", ...), NULL if none. */
const char *ledger_outcome_name(Cflue__V1__Outcome o);

#endif
