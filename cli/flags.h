/* flags.h - number-valued flags of the cflue command: a value that is not a whole number in
 * range is a usage error naming the flag, never read as 0 or as its leading digits. */
#ifndef CFLUE_CLI_FLAGS_H
#define CFLUE_CLI_FLAGS_H

#include "status.h"

#include <stdbool.h>

/* flags_number reads s, the value given to flag ("--after"), as a whole decimal number from
 * min to max into *out and returns true. Anything else (empty, letters, trailing characters,
 * out of range) prints "cflue: FLAG needs a whole number ..., not 'S'" on stderr and returns
 * false with *out unchanged: the caller exits 2 (usage). */
CF_MUST_CHECK bool flags_number(const char *flag, const char *s, long long min, long long max,
                                long long *out);

#endif
