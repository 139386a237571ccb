/* record_kind.h - names of the typed record bodies (common.proto Record.body).
 *
 * The body's oneof case is the record's type; its name is the oneof field's name
 * ("user_message", "tool_result", ...), used in logs, the CLI and docs/protocol.md.
 */
#ifndef CFLUE_RECORD_KIND_H
#define CFLUE_RECORD_KIND_H

#include "cflue/v1/common.pb-c.h"

/* record_kind_name returns the name of a body case; "unset" for NOT_SET, "unknown" for a
 * number this build does not know. Never NULL. */
const char *record_kind_name(Cflue__V1__Record__BodyCase kind);

/* record_kind_from_name returns the body case named name, or NOT_SET when none is. */
Cflue__V1__Record__BodyCase record_kind_from_name(const char *name);

/* record_body returns the record's body message (whatever its case), or NULL when unset. */
const ProtobufCMessage *record_body(const Cflue__V1__Record *r);

/* record_body_descriptor returns the message descriptor of a body case, or NULL when unknown
 * or unset. */
const ProtobufCMessageDescriptor *record_body_descriptor(Cflue__V1__Record__BodyCase kind);

/* record_set_body points r's body at msg, whose descriptor decides the case. False when msg is
 * of no body type. */
_Bool record_set_body(Cflue__V1__Record *r, ProtobufCMessage *msg);

#endif
