/* validate.h - checks of Store requests before they reach the ledger.
 *
 * Each function returns CF_OK or CF_INVALID with a message naming the field that is wrong, so
 * a client learns exactly what to fix. Limits are documented in docs/storaged.md. */
#ifndef CFLUE_STORAGED_VALIDATE_H
#define CFLUE_STORAGED_VALIDATE_H

#include "proto_limits.h"
#include "status.h"

#include "cflue/v1/store.pb-c.h"

#define VALIDATE_NAME_MAX 128       /* agent names, conversation and submission ids */
#define VALIDATE_KEY_MAX 256        /* idempotency keys */
#define VALIDATE_TEXT_MAX (4 << 20) /* message text bytes */
#define VALIDATE_ATTACHMENTS_MAX 16
#define VALIDATE_METADATA_MAX 64
#define VALIDATE_METADATA_VALUE_MAX 4096
#define VALIDATE_ERROR_MAX 8192                /* settlement error text */
#define VALIDATE_RECORDS_MAX PROTO_RECORDS_MAX /* records per Append or Settle */
#define VALIDATE_FENCES_MAX PROTO_FENCES_MAX   /* fences per Heartbeat or Release */
#define VALIDATE_LEASE_MIN_MS 100
#define VALIDATE_LEASE_MAX_MS (3600LL * 1000)
#define VALIDATE_RESERVED_PREFIX "cflue." /* metadata keys cflue keeps for itself */
#define VALIDATE_DEPTH_MAX 4              /* delegation depth: a subagent's subagent's ... */
#define VALIDATE_TOOL_CALL_ID_MAX 256     /* a provider's tool call id */
#define VALIDATE_SANDBOX_MAX 256          /* Delegation.sandbox: a sandbox's name */
#define VALIDATE_CWD_MAX 1024             /* Delegation.cwd */
#define VALIDATE_RESOURCES_MAX 1024       /* entries of each list of a ResourceState */
#define VALIDATE_RESOURCE_NAME_MAX 256    /* bytes of a Resource's name */
#define VALIDATE_MODEL_MAX 256            /* delegation.model: provider/model-id */
/* Delegation.sandbox_tools and .sandbox_placement: a host name of up to 255 characters with
 * its port (and "dns:") */
#define VALIDATE_SANDBOX_ADDRESS_MAX 300

CF_MUST_CHECK enum cf_status validate_admit(const Cflue__V1__AdmitRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_claim(const Cflue__V1__ClaimRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_heartbeat(const Cflue__V1__HeartbeatRequest *r,
                                                struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_release(const Cflue__V1__ReleaseRequest *r,
                                              struct cf_error *err);
CF_MUST_CHECK enum cf_status
validate_mark_input_applied(const Cflue__V1__MarkInputAppliedRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_fenced(const Cflue__V1__FencedRequest *r,
                                             struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_claim_joinable(const Cflue__V1__ClaimJoinableRequest *r,
                                                     struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_join(const Cflue__V1__JoinRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_request_abort(const Cflue__V1__RequestAbortRequest *r,
                                                    struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_settle(const Cflue__V1__SettleRequest *r,
                                             struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_append(const Cflue__V1__AppendRequest *r,
                                             struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_get(const Cflue__V1__GetRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_list(const Cflue__V1__ListRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_conversation(const Cflue__V1__ConversationRequest *r,
                                                   struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_read(const Cflue__V1__ReadRequest *r, struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_follow(const Cflue__V1__FollowRequest *r,
                                             struct cf_error *err);
CF_MUST_CHECK enum cf_status validate_scan_expired(const Cflue__V1__ScanExpiredRequest *r,
                                                   struct cf_error *err);

#endif
