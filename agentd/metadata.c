/* metadata.c - the rules for the metadata a client sends with a submission. */
#include "metadata.h"

#include <string.h>

enum cf_status metadata_check(Cflue__V1__SubmitRequest__MetadataEntry *const *md, size_t n,
                              struct cf_error *err)
{
    size_t plen = strlen(METADATA_RESERVED_PREFIX);
    for (size_t i = 0; i < n; i++) {
        if (!strncmp(md[i]->key, METADATA_RESERVED_PREFIX, plen)) {
            return cf_error_setr(err, CF_INVALID, "RESERVED_METADATA_KEY",
                                 "metadata key '%.128s' is reserved: keys starting with '%s' are "
                                 "cflue's own",
                                 md[i]->key, METADATA_RESERVED_PREFIX);
        }
    }
    return CF_OK;
}
