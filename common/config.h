/* config.h - daemon and CLI options from flags and CFLUE_* environment variables.
 *
 * Each option is declared once in a table; its environment variable is CFLUE_ followed by the
 * flag name in upper case with '-' turned into '_' (--lease-ms -> CFLUE_LEASE_MS). A flag
 * beats the environment, which beats the default already stored in the target.
 */
#ifndef CFLUE_CONFIG_H
#define CFLUE_CONFIG_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>

enum config_type {
    CONFIG_STRING, /* target: const char ** (points into argv or environ, never freed) */
    CONFIG_INT,    /* target: long long * */
    CONFIG_BOOL,   /* target: bool *; "--flag" alone means true */
};

struct config_opt {
    const char *name; /* flag without the leading "--" */
    enum config_type type;
    void *target;
    long long min, max; /* bounds for CONFIG_INT (inclusive) */
    const char *help;
    /* CONFIG_STRING: the values it may take (NULL-terminated), or NULL: any. A value outside
     * them is CF_INVALID "--NAME must be A, B or C", checked once all flags are read. */
    const char *const *choices;
};

/* config_parse applies the environment and then argv[1..] to the targets. On "--help" it
 * prints the usage text and the option table to stdout and sets *help_out. Unknown flags,
 * missing values, bad numbers, values out of bounds and strings outside their choices are
 * CF_INVALID with a message naming the flag or variable. Positional arguments are not
 * accepted. Targets already set stay set on failure. */
CF_MUST_CHECK enum cf_status config_parse(const struct config_opt *opts, size_t n_opts, int argc,
                                          char **argv, const char *usage, bool *help_out,
                                          struct cf_error *err);

/* Table entries, one per type (every field named, the rest zero). */
#define CONFIG_OPT_STRING(name, target, help)                                                      \
    {                                                                                              \
        (name), CONFIG_STRING, (target), 0, 0, (help), NULL                                        \
    }
#define CONFIG_OPT_CHOICE(name, target, choices, help)                                             \
    {                                                                                              \
        (name), CONFIG_STRING, (target), 0, 0, (help), (choices)                                   \
    }
#define CONFIG_OPT_INT(name, target, min, max, help)                                               \
    {                                                                                              \
        (name), CONFIG_INT, (target), (min), (max), (help), NULL                                   \
    }
#define CONFIG_OPT_BOOL(name, target, help)                                                        \
    {                                                                                              \
        (name), CONFIG_BOOL, (target), 0, 0, (help), NULL                                          \
    }

/* CONFIG_COUNT is the number of entries of an option table (an array, not a pointer). */
#define CONFIG_COUNT(opts) (sizeof(opts) / sizeof((opts)[0]))

/* config_env_name writes the environment variable name of a flag into out. */
void config_env_name(char *out, size_t out_len, const char *flag);

#endif
