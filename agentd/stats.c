/* stats.c - agentd's Prometheus series (see stats.h). */
#include "stats.h"

#include "metrics.h"

#include <stdio.h>
#include <string.h>

static struct {
    struct metric *drives, *settled, *joined, *turns, *model_calls, *model_errors, *tokens, *cost,
        *tools, *truncations;
} g;

void stats_init(void)
{
    g.drives = metrics_counter("cflue_agentd_drives_total",
                               "Drives started, by whether they took over another attempt's work.",
                               "takeover");
    g.settled = metrics_counter("cflue_agentd_settled_total",
                                "Submissions this agentd settled, by outcome.", "outcome");
    g.joined = metrics_counter("cflue_agentd_joined_total",
                               "Queued submissions answered by a settlement they joined.", "");
    g.turns = metrics_histogram("cflue_agentd_turn_seconds",
                                "Time between two answers of a drive (the tools the last one "
                                "asked for, then the next model call), or from its start.",
                                "", metrics_latency_buckets, metrics_latency_buckets_n);
    g.model_calls = metrics_histogram(
        "cflue_agentd_model_call_seconds", "Model calls (each try), by provider and result.",
        "provider,result", metrics_latency_buckets, metrics_latency_buckets_n);
    g.model_errors =
        metrics_counter("cflue_agentd_model_errors_total",
                        "Model calls that failed, by provider and kind.", "provider,kind");
    g.tokens = metrics_counter("cflue_agentd_model_tokens_total",
                               "Tokens of recorded answers, by provider and direction.",
                               "provider,direction");
    g.cost = metrics_counter("cflue_agentd_model_cost_usd_total",
                             "Cost of recorded answers by the model catalog's prices.", "provider");
    g.tools = metrics_counter("cflue_agentd_tool_results_total",
                              "Tool results recorded, by tool and whether they are errors.",
                              "tool,error");
    g.truncations = metrics_counter("cflue_agentd_tool_truncations_total",
                                    "Tool results recorded truncated, by tool.", "tool");
}

/* provider_of copies model's provider ("anthropic/x" -> "anthropic") into out. */
static const char *provider_of(const char *model, char *out, size_t n)
{
    const char *slash = model ? strchr(model, '/') : NULL;
    snprintf(out, n, "%.*s", slash ? (int)(slash - model) : 7, slash ? model : "unknown");
    return out;
}

void stats_drive(bool takeover)
{
    metrics_add(g.drives, METRICS_LABELS(takeover ? "true" : "false"), 1);
}

void stats_settled(const char *outcome, size_t joined)
{
    metrics_add(g.settled, METRICS_LABELS(outcome), 1);
    metrics_add(g.joined, NULL, (double)joined);
}

void stats_turn(int64_t us)
{
    metrics_observe(g.turns, NULL, (double)us / 1e6);
}

void stats_model_call(const char *model, enum cf_status rc, const struct llm_response *r,
                      int64_t us)
{
    char provider[32], kind[48];
    provider_of(model, provider, sizeof(provider));
    if (rc == CF_OK) {
        snprintf(kind, sizeof(kind), "ok");
    } else if (r && r->context_overflow) {
        snprintf(kind, sizeof(kind), "context_overflow");
    } else if (r && r->http_status >= 400) {
        snprintf(kind, sizeof(kind), "http_%d", r->http_status);
    } else {
        snprintf(kind, sizeof(kind), "%s", status_reason(rc));
    }
    metrics_observe(g.model_calls, METRICS_LABELS(provider, rc == CF_OK ? "ok" : "error"),
                    (double)us / 1e6);
    if (rc != CF_OK) {
        metrics_add(g.model_errors, METRICS_LABELS(provider, kind), 1);
    }
}

void stats_usage(const char *model, int64_t input_tokens, int64_t output_tokens, double cost_usd)
{
    char provider[32];
    provider_of(model, provider, sizeof(provider));
    metrics_add(g.tokens, METRICS_LABELS(provider, "input"), (double)input_tokens);
    metrics_add(g.tokens, METRICS_LABELS(provider, "output"), (double)output_tokens);
    metrics_add(g.cost, METRICS_LABELS(provider), cost_usd);
}

void stats_tool_result(const char *tool, bool is_error, bool truncated)
{
    metrics_add(g.tools, METRICS_LABELS(tool, is_error ? "true" : "false"), 1);
    if (truncated) {
        metrics_add(g.truncations, METRICS_LABELS(tool), 1);
    }
}
