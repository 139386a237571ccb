/* flags.c - number-valued flags of the cflue command; see flags.h. */
#include "flags.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

bool flags_number(const char *flag, const char *s, long long min, long long max, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = isspace((unsigned char)*s) ? 0 : strtoll(s, &end, 10);
    if (end && end != s && !*end && errno == 0 && v >= min && v <= max) {
        *out = v;
        return true;
    }
    if (max == LLONG_MAX) {
        fprintf(stderr, "cflue: %s needs a whole number of at least %lld, not '%s'\n", flag, min,
                s);
    } else {
        fprintf(stderr, "cflue: %s needs a whole number from %lld to %lld, not '%s'\n", flag, min,
                max, s);
    }
    return false;
}
