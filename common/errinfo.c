/* errinfo.c - google.rpc.Status / ErrorInfo in the status details trailer. */
#include "errinfo.h"

#include "mem.h"

#include "google/rpc/error_details.pb-c.h"
#include "google/rpc/status.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ERRINFO_TYPE_URL "type.googleapis.com/google.rpc.ErrorInfo"

const char *errinfo_default_reason(grpc_status_code code)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    return (unsigned)code < sizeof(names) / sizeof(names[0]) ? names[code] : "UNKNOWN";
}

grpc_slice errinfo_pack(grpc_status_code code, const char *message, const char *reason)
{
    Google__Rpc__ErrorInfo info = GOOGLE__RPC__ERROR_INFO__INIT;
    info.reason = (char *)(reason && *reason ? reason : errinfo_default_reason(code));
    info.domain = CF_ERROR_DOMAIN;
    size_t info_len = google__rpc__error_info__get_packed_size(&info);
    uint8_t *info_bytes = mem_alloc(info_len ? info_len : 1);
    google__rpc__error_info__pack(&info, info_bytes);

    Google__Protobuf__Any any = GOOGLE__PROTOBUF__ANY__INIT;
    any.type_url = ERRINFO_TYPE_URL;
    any.value.data = info_bytes;
    any.value.len = info_len;
    Google__Protobuf__Any *details[1] = {&any};

    Google__Rpc__Status st = GOOGLE__RPC__STATUS__INIT;
    st.code = (int32_t)code;
    st.message = (char *)(message ? message : "");
    st.details = details;
    st.n_details = 1;
    size_t len = google__rpc__status__get_packed_size(&st);
    grpc_slice out = grpc_slice_malloc(len);
    google__rpc__status__pack(&st, GRPC_SLICE_START_PTR(out));
    free(info_bytes);
    return out;
}

/* reason_of copies the ErrorInfo reason of one Any detail; false when it is no ErrorInfo. */
static bool reason_of(const Google__Protobuf__Any *any, bool ours_only, char *reason,
                      size_t reason_len)
{
    if (!any->type_url || strcmp(any->type_url, ERRINFO_TYPE_URL) != 0) {
        return false;
    }
    Google__Rpc__ErrorInfo *info =
        google__rpc__error_info__unpack(NULL, any->value.len, any->value.data);
    if (!info) {
        return false;
    }
    bool ok = info->reason && *info->reason &&
              (!ours_only || (info->domain && !strcmp(info->domain, CF_ERROR_DOMAIN)));
    if (ok) {
        snprintf(reason, reason_len, "%s", info->reason);
    }
    google__rpc__error_info__free_unpacked(info, NULL);
    return ok;
}

bool errinfo_find_reason(const grpc_metadata_array *md, char *reason, size_t reason_len)
{
    reason[0] = '\0';
    for (size_t i = 0; md && i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, ERRINFO_TRAILER_KEY) != 0) {
            continue;
        }
        const grpc_slice v = md->metadata[i].value;
        Google__Rpc__Status *st =
            google__rpc__status__unpack(NULL, GRPC_SLICE_LENGTH(v), GRPC_SLICE_START_PTR(v));
        if (!st) {
            return false;
        }
        bool found = false;
        for (int pass = 0; pass < 2 && !found; pass++) {
            for (size_t k = 0; k < st->n_details && !found; k++) {
                found = reason_of(st->details[k], pass == 0, reason, reason_len);
            }
        }
        google__rpc__status__free_unpacked(st, NULL);
        return found;
    }
    return false;
}
