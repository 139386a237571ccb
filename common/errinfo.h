/* errinfo.h - google.rpc.Status details with an ErrorInfo, the machine-readable half of an
 * error.
 *
 * Every error a cflue server returns carries, in the "grpc-status-details-bin" trailer, a
 * google.rpc.Status whose details hold one google.rpc.ErrorInfo {reason, domain "cflue.dev"}.
 * Clients read the reason back (rpc_status.reason) instead of matching message text.
 */
#ifndef CFLUE_ERRINFO_H
#define CFLUE_ERRINFO_H

#include "status.h"

#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <stdbool.h>

/* The trailing metadata key that carries the serialized google.rpc.Status. */
#define ERRINFO_TRAILER_KEY "grpc-status-details-bin"

/* errinfo_pack returns a new slice holding a serialized google.rpc.Status {code, message,
 * details: [ErrorInfo{reason, domain}]}. An empty or NULL reason uses the reason named after
 * the gRPC code (errinfo_default_reason). The caller unrefs the slice. */
grpc_slice errinfo_pack(grpc_status_code code, const char *message, const char *reason);

/* errinfo_default_reason names a gRPC code in UPPER_SNAKE_CASE ("DEADLINE_EXCEEDED"). */
const char *errinfo_default_reason(grpc_status_code code);

/* errinfo_find_reason looks for the status details trailer in md and copies its ErrorInfo
 * reason (domain cflue.dev, or any domain when none is ours) into reason. False when absent or
 * undecodable; reason is then "". */
bool errinfo_find_reason(const grpc_metadata_array *md, char *reason, size_t reason_len);

#endif
