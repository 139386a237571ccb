/* pbcheck.h - checks protobuf-c cannot make: text fields must be valid UTF-8 without NUL.
 *
 * protobuf-c hands string fields to C as NUL-terminated strings, so an embedded NUL byte
 * would silently cut a name or a path short ("a.txt\0../../etc/passwd" reads as "a.txt").
 * proto3 also requires string fields to be valid UTF-8. pbcheck walks the wire bytes with the
 * message's descriptor, before decoding, and names the first offending field.
 */
#ifndef CFLUE_PBCHECK_H
#define CFLUE_PBCHECK_H

#include "status.h"

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* pbcheck_strings checks every string field (nested messages included) of the encoded
 * message. CF_INVALID with the field's name when one holds a NUL byte or invalid UTF-8;
 * malformed framing is left for the decoder to report. */
CF_MUST_CHECK enum cf_status pbcheck_strings(const ProtobufCMessageDescriptor *desc,
                                             const uint8_t *data, size_t len, struct cf_error *err);

#endif
