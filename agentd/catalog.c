/* catalog.c - the model catalog. */
#include "catalog.h"

#include "mem.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

struct entry {
    const char *name;
    struct model_info info;
};

static const struct entry builtin[] = {
    {"anthropic/claude-opus-4-1", {200000, 32000, 15.0, 75.0, true}},
    {"anthropic/claude-sonnet-4-5", {200000, 64000, 3.0, 15.0, true}},
    {"anthropic/claude-haiku-4-5", {200000, 64000, 1.0, 5.0, true}},
    {"openai/gpt-4.1", {1047576, 32768, 2.0, 8.0, true}},
    {"openai/gpt-4.1-mini", {1047576, 32768, 0.4, 1.6, true}},
    {"openai/gpt-4o", {128000, 16384, 2.5, 10.0, true}},
    {"openai/gpt-4o-mini", {128000, 16384, 0.15, 0.6, true}},
};

static struct entry *loaded;
static size_t n_loaded;

static double num(json_t *o, const char *k, bool *ok)
{
    json_t *v = json_object_get(o, k);
    if (!json_is_number(v) || json_number_value(v) < 0) {
        *ok = false;
        return 0;
    }
    return json_number_value(v);
}

enum cf_status catalog_load(const char *path, struct cf_error *err)
{
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    json_t *models = json_object_get(root, "models");
    if (!json_is_object(models)) {
        json_decref(root);
        return cf_error_set(err, CF_INVALID, "%s: %s", path,
                            root ? "expected {\"models\": {NAME: {...}}}" : je.text);
    }
    const char *name;
    json_t *m;
    json_object_foreach(models, name, m)
    {
        bool ok = json_is_object(m);
        struct model_info info = {.known = true};
        info.context_window = (int64_t)num(m, "context_window", &ok);
        info.max_output_tokens = (int64_t)num(m, "max_output_tokens", &ok);
        info.input_usd_per_mtok = num(m, "input_usd_per_mtok", &ok);
        info.output_usd_per_mtok = num(m, "output_usd_per_mtok", &ok);
        if (!ok || info.context_window < 1024 || info.max_output_tokens < 1) {
            json_decref(root);
            return cf_error_set(err, CF_INVALID,
                                "%s: models.%s: needs context_window (>= 1024), "
                                "max_output_tokens, input_usd_per_mtok and output_usd_per_mtok",
                                path, name);
        }
        loaded = mem_realloc(loaded, sizeof(*loaded) * (n_loaded + 1));
        loaded[n_loaded].name = mem_strdup(name);
        loaded[n_loaded].info = info;
        n_loaded++;
    }
    json_decref(root);
    return CF_OK;
}

struct model_info catalog_lookup(const char *model)
{
    for (size_t i = n_loaded; i-- > 0;) {
        if (!strcmp(loaded[i].name, model)) {
            return loaded[i].info;
        }
    }
    for (size_t i = 0; i < sizeof(builtin) / sizeof(builtin[0]); i++) {
        if (!strcmp(builtin[i].name, model)) {
            return builtin[i].info;
        }
    }
    return (struct model_info){128000, 8192, 0, 0, false};
}

double catalog_cost(const struct model_info *m, int64_t input_tokens, int64_t output_tokens)
{
    double usd = ((double)input_tokens * m->input_usd_per_mtok +
                  (double)output_tokens * m->output_usd_per_mtok) /
                 1e6;
    return usd < CATALOG_COST_MAX ? usd : CATALOG_COST_MAX;
}

void catalog_free(void)
{
    for (size_t i = 0; i < n_loaded; i++) {
        free((char *)loaded[i].name);
    }
    free(loaded);
    loaded = NULL;
    n_loaded = 0;
}
