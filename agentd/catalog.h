/* catalog.h - what agentd knows about models: context window, output limit, prices.
 *
 * Built-in entries cover common models; --models FILE (JSON) adds or replaces entries:
 *   {"models": {"anthropic/claude-sonnet-4-5": {"context_window": 200000,
 *     "max_output_tokens": 64000, "input_usd_per_mtok": 3, "output_usd_per_mtok": 15}}}
 * A model found nowhere gets safe defaults (128k window, 8192 output tokens, no price) and a
 * warning at start-up.
 */
#ifndef CFLUE_AGENTD_CATALOG_H
#define CFLUE_AGENTD_CATALOG_H

#include "status.h"

#include <stdbool.h>
#include <stdint.h>

struct model_info {
    int64_t context_window;
    int64_t max_output_tokens;
    double input_usd_per_mtok;
    double output_usd_per_mtok;
    bool known;
};

/* catalog_load adds the entries of a JSON file; CF_INVALID naming the entry and field when
 * the file is malformed. */
CF_MUST_CHECK enum cf_status catalog_load(const char *path, struct cf_error *err);

/* catalog_lookup returns what is known of model ("provider/id"). */
struct model_info catalog_lookup(const char *model);

/* The most a usage may cost, in USD, as storaged takes it (a call's, a submission's) */
#define CATALOG_COST_MAX 1e9

/* catalog_cost prices a call's usage, at most CATALOG_COST_MAX. */
double catalog_cost(const struct model_info *m, int64_t input_tokens, int64_t output_tokens);

/* catalog_free releases entries loaded from files. */
void catalog_free(void);

#endif
