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
};

/* config_parse applies the environment and then argv[1..] to the targets. On "--help" it
 * prints the usage text and the option table to stdout and sets *help_out. Unknown flags,
 * missing values, bad numbers and values out of bounds are CF_INVALID with a message naming
 * the flag or variable. Positional arguments are not accepted. */
CF_MUST_CHECK enum cf_status config_parse(const struct config_opt *opts, size_t n_opts, int argc,
                                          char **argv, const char *usage, bool *help_out,
                                          struct cf_error *err);

/* config_env_name writes the environment variable name of a flag into out. */
void config_env_name(char *out, size_t out_len, const char *flag);

#endif
