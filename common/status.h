/* status.h - the project's one status enum, generated from a single table.
 *
 * Functions return an enum cf_status and pass data through out-parameters. A struct cf_error
 * carries the precise, human-readable reason next to the code, for logs and gRPC details.
 */
#ifndef CFLUE_STATUS_H
#define CFLUE_STATUS_H

#include <grpc/status.h>
#include <stddef.h>

/* X(name, message, grpc status code) */
#define CF_STATUS_MAP(X)                                                                           \
    X(OK, "ok", GRPC_STATUS_OK)                                                                    \
    X(INVALID, "invalid argument", GRPC_STATUS_INVALID_ARGUMENT)                                   \
    X(NOT_FOUND, "not found", GRPC_STATUS_NOT_FOUND)                                               \
    X(EXISTS, "already exists with different content", GRPC_STATUS_ALREADY_EXISTS)                 \
    X(STALE, "precondition failed", GRPC_STATUS_FAILED_PRECONDITION)                               \
    X(RANGE, "out of range", GRPC_STATUS_OUT_OF_RANGE)                                             \
    X(TOOBIG, "too big", GRPC_STATUS_RESOURCE_EXHAUSTED)                                           \
    X(BUSY, "resource exhausted", GRPC_STATUS_RESOURCE_EXHAUSTED)                                  \
    X(NOMEM, "out of memory", GRPC_STATUS_RESOURCE_EXHAUSTED)                                      \
    X(IO, "input/output error", GRPC_STATUS_INTERNAL)                                              \
    X(DB, "database error", GRPC_STATUS_INTERNAL)                                                  \
    X(CORRUPT, "stored data is not what cflue wrote", GRPC_STATUS_DATA_LOSS)                       \
    X(VERSION, "unsupported schema version", GRPC_STATUS_FAILED_PRECONDITION)                      \
    X(UNAVAILABLE, "unavailable", GRPC_STATUS_UNAVAILABLE)                                         \
    X(CANCELLED, "cancelled", GRPC_STATUS_CANCELLED)                                               \
    X(DEADLINE, "deadline exceeded", GRPC_STATUS_DEADLINE_EXCEEDED)                                \
    X(UNIMPLEMENTED, "not implemented", GRPC_STATUS_UNIMPLEMENTED)                                 \
    X(INTERNAL, "internal error", GRPC_STATUS_INTERNAL)

enum cf_status {
#define CF_STATUS_ENUM(name, msg, code) CF_##name,
    CF_STATUS_MAP(CF_STATUS_ENUM)
#undef CF_STATUS_ENUM
        CF_STATUS_COUNT
};

/* CF_MUST_CHECK marks a fallible function: ignoring its result fails the build
 * (-Werror=unused-result). Put it before the declaration in the header. */
#define CF_MUST_CHECK __attribute__((warn_unused_result))

#define CF_ERROR_MSG_MAX 512

/* A status with the precise reason, as the caller should read it. */
struct cf_error {
    enum cf_status code;
    char msg[CF_ERROR_MSG_MAX];
};

/* status_name returns the enum's short name ("NOT_FOUND"); never NULL. */
const char *status_name(enum cf_status st);

/* status_message returns the generic message of a status; never NULL. */
const char *status_message(enum cf_status st);

/* status_grpc_code maps a status to the gRPC status code clients see. */
grpc_status_code status_grpc_code(enum cf_status st);

/* cf_error_set stores code and a printf-formatted reason in err (which may be NULL) and
 * returns code, so callers can write `return cf_error_set(err, CF_INVALID, "...")`. The
 * message is truncated to fit. */
enum cf_status cf_error_set(struct cf_error *err, enum cf_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* cf_error_clear resets err to CF_OK with an empty message. */
void cf_error_clear(struct cf_error *err);

#endif
