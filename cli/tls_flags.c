/* tls_flags.c - --ca, --cert and --cert-key of the cflue command (tls_flags.h). */
#include "tls_flags.h"

#include "tls.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* take removes "FLAG VALUE" from argv and sets *value; otherwise *value is the variable env
 * (or NULL). false when the flag has no value. */
static bool take(int *argc, char **argv, const char *flag, const char *env, const char **value)
{
    *value = getenv(env);
    for (int i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], flag)) {
            if (i + 1 >= *argc) {
                return false;
            }
            *value = argv[i + 1];
            memmove(&argv[i], &argv[i + 2], sizeof(char *) * (size_t)(*argc - i - 1));
            *argc -= 2;
            i--;
        }
    }
    return true;
}

int tls_flags_take(int *argc, char **argv)
{
    struct tls_paths p = {.ca_flag = "--ca", .cert_flag = "--cert", .key_flag = "--cert-key"};
    const struct {
        const char *flag, *env, **value;
    } flags[] = {
        {"--ca", "CFLUE_CA", &p.ca},
        {"--cert", "CFLUE_CERT", &p.cert},
        {"--cert-key", "CFLUE_CERT_KEY", &p.key},
    };
    bool any = false;
    for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++) {
        if (!take(argc, argv, flags[i].flag, flags[i].env, flags[i].value)) {
            fprintf(stderr, "cflue: %s needs a value (a PEM file)\n", flags[i].flag);
            return 2;
        }
        any = any || (*flags[i].value && **flags[i].value);
    }
    struct cf_error err;
    if (any && tls_client_load(&p, &err) != CF_OK) {
        fprintf(stderr, "cflue: %s\n", err.msg);
        return 2;
    }
    return 0;
}
