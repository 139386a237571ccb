/* metadata.h - the rules for the metadata a client sends with a submission. */
#ifndef CFLUE_AGENTD_METADATA_H
#define CFLUE_AGENTD_METADATA_H

#include "status.h"

#include "cflue/v1/agent.pb-c.h"

#include <stddef.h>

/* Keys starting with this prefix are cflue's own (common.proto, SubmitRequest.metadata). */
#define METADATA_RESERVED_PREFIX "cflue."

/* metadata_check refuses a Submit whose metadata uses a reserved key: CF_INVALID with reason
 * RESERVED_METADATA_KEY naming the first such key. CF_OK otherwise (no other rule is checked
 * here: storaged checks counts and sizes at Admit). */
CF_MUST_CHECK enum cf_status metadata_check(Cflue__V1__SubmitRequest__MetadataEntry *const *md,
                                            size_t n, struct cf_error *err);

#endif
