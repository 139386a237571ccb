/* status.h - the project's one status enum, generated from a single table.
 *
 * Functions return an enum cf_status and pass data through out-parameters. A struct cf_error
 * carries the precise, human-readable reason next to the code, for logs and gRPC details.
 */
#ifndef CFLUE_STATUS_H
#define CFLUE_STATUS_H

#include <grpc/status.h>
#include <stddef.h>

/* X(name, message, gRPC status code, default ErrorInfo reason) */
#define CF_STATUS_MAP(X)                                                                           \
    X(OK, "ok", GRPC_STATUS_OK, "")                                                                \
    X(INVALID, "invalid argument", GRPC_STATUS_INVALID_ARGUMENT, "INVALID_ARGUMENT")               \
    X(NOT_FOUND, "not found", GRPC_STATUS_NOT_FOUND, "NOT_FOUND")                                  \
    X(EXISTS, "already exists with different content", GRPC_STATUS_ALREADY_EXISTS,                 \
      "ALREADY_EXISTS")                                                                            \
    X(STALE, "stale fence: another attempt holds the work", GRPC_STATUS_ABORTED, "STALE_FENCE")    \
    X(PRECONDITION, "precondition failed", GRPC_STATUS_FAILED_PRECONDITION, "FAILED_PRECONDITION") \
    X(RANGE, "out of range", GRPC_STATUS_OUT_OF_RANGE, "OUT_OF_RANGE")                             \
    X(TOOBIG, "too big", GRPC_STATUS_RESOURCE_EXHAUSTED, "TOO_LARGE")                              \
    X(BUSY, "resource exhausted", GRPC_STATUS_RESOURCE_EXHAUSTED, "OVERLOADED")                    \
    X(NOMEM, "out of memory", GRPC_STATUS_RESOURCE_EXHAUSTED, "OUT_OF_MEMORY")                     \
    X(FULL, "storage full", GRPC_STATUS_RESOURCE_EXHAUSTED, "STORAGE_FULL")                        \
    X(IO, "input/output error", GRPC_STATUS_INTERNAL, "IO_ERROR")                                  \
    X(DB, "database error", GRPC_STATUS_INTERNAL, "DATABASE_ERROR")                                \
    X(CORRUPT, "stored data is not what cflue wrote", GRPC_STATUS_DATA_LOSS, "DATA_CORRUPTED")     \
    X(VERSION, "unsupported schema version", GRPC_STATUS_FAILED_PRECONDITION,                      \
      "UNSUPPORTED_SCHEMA_VERSION")                                                                \
    X(UNAVAILABLE, "unavailable", GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE")                          \
    X(CANCELLED, "cancelled", GRPC_STATUS_CANCELLED, "CANCELLED")                                  \
    X(DEADLINE, "deadline exceeded", GRPC_STATUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")           \
    X(UNIMPLEMENTED, "not implemented", GRPC_STATUS_UNIMPLEMENTED, "UNIMPLEMENTED")                \
    X(INTERNAL, "internal error", GRPC_STATUS_INTERNAL, "INTERNAL")                                \
    X(UNAUTHENTICATED, "unauthenticated", GRPC_STATUS_UNAUTHENTICATED, "UNAUTHENTICATED")          \
    X(PERMISSION, "permission denied", GRPC_STATUS_PERMISSION_DENIED, "PERMISSION_DENIED")

enum cf_status {
#define CF_STATUS_ENUM(name, msg, code, reason) CF_##name,
    CF_STATUS_MAP(CF_STATUS_ENUM)
#undef CF_STATUS_ENUM
        CF_STATUS_COUNT
};

/* CF_MUST_CHECK marks a fallible function: ignoring its result fails the build
 * (-Werror=unused-result). Put it before the declaration in the header. */
#define CF_MUST_CHECK __attribute__((warn_unused_result))

#define CF_ERROR_MSG_MAX 512
#define CF_ERROR_REASON_MAX 64

/* The ErrorInfo domain of every error cflue's services return. */
#define CF_ERROR_DOMAIN "cflue.dev"

/* A status with the precise reason, as the caller should read it. `reason` is the machine-
 * readable ErrorInfo reason (UPPER_SNAKE_CASE, docs/protocol.md); empty means the status's
 * default reason (status_reason). */
struct cf_error {
    enum cf_status code;
    char msg[CF_ERROR_MSG_MAX];
    char reason[CF_ERROR_REASON_MAX];
};

/* status_name returns the enum's short name ("NOT_FOUND"); never NULL. */
const char *status_name(enum cf_status st);

/* status_message returns the generic message of a status; never NULL. */
const char *status_message(enum cf_status st);

/* status_grpc_code maps a status to the gRPC status code clients see. */
grpc_status_code status_grpc_code(enum cf_status st);

/* status_from_grpc maps a gRPC status code a client received to the closest status;
 * DEADLINE_EXCEEDED becomes CF_UNAVAILABLE (the peer did not answer in time). */
enum cf_status status_from_grpc(grpc_status_code code);

/* status_reason returns the ErrorInfo reason of a status ("STALE_FENCE"); "" for CF_OK. */
const char *status_reason(enum cf_status st);

/* cf_error_reason returns err's ErrorInfo reason: the specific one if set, else the code's
 * default. Never NULL. */
const char *cf_error_reason(const struct cf_error *err);

/* cf_error_set stores code and a printf-formatted reason in err (which may be NULL) and
 * returns code, so callers can write `return cf_error_set(err, CF_INVALID, "...")`. The
 * message is truncated to fit; the ErrorInfo reason is reset to the code's default. */
enum cf_status cf_error_set(struct cf_error *err, enum cf_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* cf_error_setr is cf_error_set with a specific ErrorInfo reason (UPPER_SNAKE_CASE, at most
 * 63 characters), e.g. cf_error_setr(err, CF_INVALID, "RESERVED_METADATA_KEY", "..."). */
enum cf_status cf_error_setr(struct cf_error *err, enum cf_status code, const char *reason,
                             const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* cf_error_clear resets err to CF_OK with an empty message. */
void cf_error_clear(struct cf_error *err);

#endif
