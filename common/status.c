/* status.c - names, messages and gRPC codes of enum cf_status. */
#include "status.h"

#include "utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    const char *message;
    grpc_status_code code;
    const char *reason;
} table[] = {
#define CF_STATUS_ROW(n, msg, c, r) {#n, msg, c, r},
    CF_STATUS_MAP(CF_STATUS_ROW)
#undef CF_STATUS_ROW
};

static int valid(enum cf_status st)
{
    return (int)st >= 0 && st < CF_STATUS_COUNT;
}

const char *status_name(enum cf_status st)
{
    return valid(st) ? table[st].name : "UNKNOWN";
}

const char *status_message(enum cf_status st)
{
    return valid(st) ? table[st].message : "unknown status";
}

grpc_status_code status_grpc_code(enum cf_status st)
{
    return valid(st) ? table[st].code : GRPC_STATUS_UNKNOWN;
}

const char *status_reason(enum cf_status st)
{
    return valid(st) ? table[st].reason : "UNKNOWN";
}

enum cf_status status_from_grpc(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return CF_OK;
    case GRPC_STATUS_INVALID_ARGUMENT:
        return CF_INVALID;
    case GRPC_STATUS_NOT_FOUND:
        return CF_NOT_FOUND;
    case GRPC_STATUS_ALREADY_EXISTS:
        return CF_EXISTS;
    case GRPC_STATUS_ABORTED:
        return CF_STALE;
    case GRPC_STATUS_FAILED_PRECONDITION:
        return CF_PRECONDITION;
    case GRPC_STATUS_OUT_OF_RANGE:
        return CF_RANGE;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return CF_BUSY;
    case GRPC_STATUS_DATA_LOSS:
        return CF_CORRUPT;
    case GRPC_STATUS_UNAVAILABLE:
    case GRPC_STATUS_DEADLINE_EXCEEDED: /* the peer did not answer in time: as if away */
        return CF_UNAVAILABLE;
    case GRPC_STATUS_CANCELLED:
        return CF_CANCELLED;
    case GRPC_STATUS_UNIMPLEMENTED:
        return CF_UNIMPLEMENTED;
    case GRPC_STATUS_UNAUTHENTICATED:
        return CF_UNAUTHENTICATED;
    case GRPC_STATUS_PERMISSION_DENIED:
        return CF_PERMISSION;
    default:
        return CF_INTERNAL;
    }
}

const char *cf_error_reason(const struct cf_error *err)
{
    return err->reason[0] ? err->reason : status_reason(err->code);
}

__attribute__((format(printf, 4, 0))) static void
vset(struct cf_error *err, enum cf_status code, const char *reason, const char *fmt, va_list ap)
{
    err->code = code;
    char text[2 * sizeof(err->msg)]; /* one past the cut shows where a character starts */
    int n = vsnprintf(text, sizeof(text), fmt, ap);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof(text) ? (size_t)n : sizeof(text) - 1;
    len = utf8_prefix_len(text, len, sizeof(err->msg) - 1); /* a cut between characters */
    memcpy(err->msg, text, len);
    err->msg[len] = '\0';
    snprintf(err->reason, sizeof(err->reason), "%s", reason ? reason : "");
}

enum cf_status cf_error_set(struct cf_error *err, enum cf_status code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vset(err, code, NULL, fmt, ap);
        va_end(ap);
    }
    return code;
}

enum cf_status cf_error_setr(struct cf_error *err, enum cf_status code, const char *reason,
                             const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vset(err, code, reason, fmt, ap);
        va_end(ap);
    }
    return code;
}

void cf_error_clear(struct cf_error *err)
{
    if (err) {
        err->code = CF_OK;
        err->msg[0] = '\0';
        err->reason[0] = '\0';
    }
}
