/* proto_limits.h - the per-call limits the cflue.v1 protocol states (the .proto files in
 * protos/cflue/v1), kept once for the servers that enforce them and the clients that split
 * their calls. */
#ifndef CFLUE_COMMON_PROTO_LIMITS_H
#define CFLUE_COMMON_PROTO_LIMITS_H

/* records in one Store.Append or Store.Settle */
#define PROTO_RECORDS_MAX 1000
/* fences in one Store.Heartbeat or Store.Release */
#define PROTO_FENCES_MAX 1000
/* calls in one Tools.ExecuteBatch */
#define PROTO_BATCH_CALLS_MAX 64

#endif
