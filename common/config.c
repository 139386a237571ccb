/* config.c - flag and environment parsing. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void config_env_name(char *out, size_t out_len, const char *flag)
{
    size_t o = (size_t)snprintf(out, out_len, "CFLUE_");
    for (const char *p = flag; *p && o + 1 < out_len; p++) {
        out[o++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    }
    out[o < out_len ? o : out_len - 1] = '\0';
}

static enum cf_status set_value(const struct config_opt *o, const char *value, const char *source,
                                struct cf_error *err)
{
    switch (o->type) {
    case CONFIG_STRING:
        *(const char **)o->target = value;
        return CF_OK;
    case CONFIG_BOOL:
        if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes")) {
            *(bool *)o->target = true;
        } else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no")) {
            *(bool *)o->target = false;
        } else {
            return cf_error_set(err, CF_INVALID, "%s: expected true or false, got '%s'", source,
                                value);
        }
        return CF_OK;
    case CONFIG_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (errno || end == value || *end) {
            return cf_error_set(err, CF_INVALID, "%s: expected an integer, got '%s'", source,
                                value);
        }
        if (v < o->min || v > o->max) {
            return cf_error_set(err, CF_INVALID, "%s: %lld is outside %lld..%lld", source, v,
                                o->min, o->max);
        }
        *(long long *)o->target = v;
        return CF_OK;
    }
    }
    return CF_INVALID;
}

static void print_help(const struct config_opt *opts, size_t n, const char *usage)
{
    printf("%s\n\nOptions (each also read from its environment variable):\n", usage);
    for (size_t i = 0; i < n; i++) {
        char env[96], def[160];
        config_env_name(env, sizeof(env), opts[i].name);
        switch (opts[i].type) {
        case CONFIG_STRING: {
            const char *s = *(const char **)opts[i].target;
            snprintf(def, sizeof(def), "%s", s && *s ? s : "(none)");
            break;
        }
        case CONFIG_INT:
            snprintf(def, sizeof(def), "%lld", *(long long *)opts[i].target);
            break;
        case CONFIG_BOOL:
            snprintf(def, sizeof(def), "%s", *(bool *)opts[i].target ? "true" : "false");
            break;
        }
        printf("  --%-18s %s\n  %-20s env %s, default %s\n", opts[i].name, opts[i].help, "", env,
               def);
    }
    printf("  --%-18s %s\n", "help", "print this help and exit");
}

/* check_choices refuses a string option whose value is not one of its choices. */
static enum cf_status check_choices(const struct config_opt *o, struct cf_error *err)
{
    const char *v = *(const char **)o->target;
    size_t n = 0;
    for (; o->choices[n]; n++) {
        if (v && !strcmp(v, o->choices[n])) {
            return CF_OK;
        }
    }
    char list[256];
    size_t len = 0;
    list[0] = '\0';
    for (size_t i = 0; i < n && len < sizeof(list); i++) {
        const char *sep = i == 0 ? "" : i + 1 == n ? " or " : ", ";
        len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", sep, o->choices[i]);
    }
    return cf_error_set(err, CF_INVALID, "--%s must be %s", o->name, list);
}

enum cf_status config_parse(const struct config_opt *opts, size_t n_opts, int argc, char **argv,
                            const char *usage, bool *help_out, struct cf_error *err)
{
    enum cf_status rc;
    *help_out = false;
    for (size_t i = 0; i < n_opts; i++) {
        char env[96];
        config_env_name(env, sizeof(env), opts[i].name);
        const char *v = getenv(env);
        if (v && *v && (rc = set_value(&opts[i], v, env, err)) != CF_OK) {
            return rc;
        }
    }
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            print_help(opts, n_opts, usage);
            *help_out = true;
            return CF_OK;
        }
        if (strncmp(arg, "--", 2) != 0) {
            return cf_error_set(err, CF_INVALID, "unexpected argument '%s' (see --help)", arg);
        }
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
        const struct config_opt *o = NULL;
        for (size_t i = 0; i < n_opts; i++) {
            if (strlen(opts[i].name) == name_len && !strncmp(opts[i].name, name, name_len)) {
                o = &opts[i];
            }
        }
        if (!o) {
            return cf_error_set(err, CF_INVALID, "unknown flag '%s' (see --help)", arg);
        }
        const char *value = eq ? eq + 1 : NULL;
        if (!value && o->type == CONFIG_BOOL) {
            value = "true";
        } else if (!value) {
            if (a + 1 >= argc) {
                return cf_error_set(err, CF_INVALID, "flag --%s needs a value", o->name);
            }
            value = argv[++a];
        }
        char source[128];
        snprintf(source, sizeof(source), "--%s", o->name);
        if ((rc = set_value(o, value, source, err)) != CF_OK) {
            return rc;
        }
    }
    for (size_t i = 0; i < n_opts; i++) {
        if (opts[i].type == CONFIG_STRING && opts[i].choices &&
            (rc = check_choices(&opts[i], err)) != CF_OK) {
            return rc;
        }
    }
    return CF_OK;
}
