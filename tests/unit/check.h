/* check.h - a minimal assertion harness for the C unit tests.
 *
 * CHECK(cond) records a failure with file and line and continues; main returns check_done(),
 * which prints "N passed, M failed" and gives the process exit code. */
#ifndef CFLUE_TEST_CHECK_H
#define CFLUE_TEST_CHECK_H

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* atomic: callbacks on server or loop threads may CHECK too */
static atomic_int check_passed, check_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (cond) {                                                                                \
            check_passed++;                                                                        \
        } else {                                                                                   \
            check_failed++;                                                                        \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECK_STR(a, b)                                                                            \
    do {                                                                                           \
        const char *a_ = (a), *b_ = (b);                                                           \
        if (a_ && b_ && strcmp(a_, b_) == 0) {                                                     \
            check_passed++;                                                                        \
        } else {                                                                                   \
            check_failed++;                                                                        \
            fprintf(stderr, "%s:%d: CHECK_STR failed: '%s' != '%s'\n", __FILE__, __LINE__,         \
                    a_ ? a_ : "(null)", b_ ? b_ : "(null)");                                       \
        }                                                                                          \
    } while (0)

static inline int check_done(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
    return check_failed ? 1 : 0;
}

#endif
