/* status.c - names, messages and gRPC codes of enum cf_status. */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>

static const struct {
    const char *name;
    const char *message;
    grpc_status_code code;
} table[] = {
#define CF_STATUS_ROW(n, msg, c) {#n, msg, c},
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

enum cf_status cf_error_set(struct cf_error *err, enum cf_status code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}

void cf_error_clear(struct cf_error *err)
{
    if (err) {
        err->code = CF_OK;
        err->msg[0] = '\0';
    }
}
