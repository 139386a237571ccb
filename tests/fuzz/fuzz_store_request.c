/* Fuzz target: Store requests as they arrive over gRPC: the text-field check, the protobuf
 * decoder and storaged's validation (typed record bodies included). */
#include "pbcheck.h"
#include "validate.h"

#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TRY(desc, type, fn)                                                                        \
    do {                                                                                           \
        struct cf_error err;                                                                       \
        enum cf_status checked = pbcheck_strings(&desc, data, size, &err);                         \
        (void)checked; /* the decoder and validation run on what it would refuse, too */           \
        ProtobufCMessage *m = protobuf_c_message_unpack(&desc, NULL, size, data);                  \
        if (m) {                                                                                   \
            err.msg[0] = '\0';                                                                     \
            /* every refusal must name its reason */                                               \
            if (fn((const type *)m, &err) != CF_OK && !err.msg[0]) {                               \
                abort();                                                                           \
            }                                                                                      \
            protobuf_c_message_free_unpacked(m, NULL);                                             \
        }                                                                                          \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    TRY(cflue__v1__admit_request__descriptor, Cflue__V1__AdmitRequest, validate_admit);
    TRY(cflue__v1__append_request__descriptor, Cflue__V1__AppendRequest, validate_append);
    TRY(cflue__v1__settle_request__descriptor, Cflue__V1__SettleRequest, validate_settle);
    TRY(cflue__v1__claim_request__descriptor, Cflue__V1__ClaimRequest, validate_claim);
    TRY(cflue__v1__heartbeat_request__descriptor, Cflue__V1__HeartbeatRequest, validate_heartbeat);
    TRY(cflue__v1__list_request__descriptor, Cflue__V1__ListRequest, validate_list);
    TRY(cflue__v1__mark_input_applied_request__descriptor, Cflue__V1__MarkInputAppliedRequest,
        validate_mark_input_applied);
    TRY(cflue__v1__request_abort_request__descriptor, Cflue__V1__RequestAbortRequest,
        validate_request_abort);
    TRY(cflue__v1__claim_joinable_request__descriptor, Cflue__V1__ClaimJoinableRequest,
        validate_claim_joinable);
    TRY(cflue__v1__join_request__descriptor, Cflue__V1__JoinRequest, validate_join);
    TRY(cflue__v1__read_request__descriptor, Cflue__V1__ReadRequest, validate_read);
    TRY(cflue__v1__follow_request__descriptor, Cflue__V1__FollowRequest, validate_follow);
    TRY(cflue__v1__scan_expired_request__descriptor, Cflue__V1__ScanExpiredRequest,
        validate_scan_expired);
    return 0;
}
