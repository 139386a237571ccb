/* record_kind.c - names of the typed record bodies. */
#include "record_kind.h"

#include <string.h>

#define BODY(X)                                                                                    \
    X(USER_MESSAGE, "user_message", cflue__v1__user_message__descriptor)                           \
    X(SYSTEM_PROMPT, "system_prompt", cflue__v1__system_prompt__descriptor)                        \
    X(ASSISTANT_DELTA, "assistant_delta", cflue__v1__assistant_delta__descriptor)                  \
    X(ASSISTANT_MESSAGE, "assistant_message", cflue__v1__assistant_message__descriptor)            \
    X(TOOL_RESULT, "tool_result", cflue__v1__tool_call_result__descriptor)                         \
    X(SIGNAL, "signal", cflue__v1__signal__descriptor)                                             \
    X(COMPACTION, "compaction", cflue__v1__compaction__descriptor)                                 \
    X(SUBMISSION_SETTLED, "submission_settled", cflue__v1__submission_settled__descriptor)         \
    X(TASK_STARTED, "task_started", cflue__v1__task_started__descriptor)

static const struct {
    Cflue__V1__Record__BodyCase kind;
    const char *name;
    const ProtobufCMessageDescriptor *desc;
} kinds[] = {
#define ROW(c, n, d) {CFLUE__V1__RECORD__BODY_##c, n, &d},
    BODY(ROW)
#undef ROW
};

#define N_KINDS (sizeof(kinds) / sizeof(kinds[0]))

const char *record_kind_name(Cflue__V1__Record__BodyCase kind)
{
    if (kind == CFLUE__V1__RECORD__BODY__NOT_SET) {
        return "unset";
    }
    for (size_t i = 0; i < N_KINDS; i++) {
        if (kinds[i].kind == kind) {
            return kinds[i].name;
        }
    }
    return "unknown";
}

Cflue__V1__Record__BodyCase record_kind_from_name(const char *name)
{
    for (size_t i = 0; name && i < N_KINDS; i++) {
        if (!strcmp(kinds[i].name, name)) {
            return kinds[i].kind;
        }
    }
    return CFLUE__V1__RECORD__BODY__NOT_SET;
}

const ProtobufCMessageDescriptor *record_body_descriptor(Cflue__V1__Record__BodyCase kind)
{
    for (size_t i = 0; i < N_KINDS; i++) {
        if (kinds[i].kind == kind) {
            return kinds[i].desc;
        }
    }
    return NULL;
}

const ProtobufCMessage *record_body(const Cflue__V1__Record *r)
{
    /* every member of the union is a pointer to a message: read it through any of them */
    return record_body_descriptor(r->body_case) ? (const ProtobufCMessage *)r->user_message : NULL;
}

_Bool record_set_body(Cflue__V1__Record *r, ProtobufCMessage *msg)
{
    for (size_t i = 0; msg && i < N_KINDS; i++) {
        if (kinds[i].desc == msg->descriptor) {
            r->body_case = kinds[i].kind;
            r->user_message = (Cflue__V1__UserMessage *)msg; /* the union's shared slot */
            return 1;
        }
    }
    return 0;
}
