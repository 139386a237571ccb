/* stats.h - agentd's Prometheus series (metrics.h): drives and their outcomes, turns, model
 * calls (latency, errors by kind, tokens, cost) and tool results (by tool, errors,
 * truncations). Each function is one observation; docs/operations.md lists the series. */
#ifndef CFLUE_AGENTD_STATS_H
#define CFLUE_AGENTD_STATS_H

#include "provider.h"
#include "status.h"

#include <stdbool.h>
#include <stdint.h>

/* stats_init makes the families (once, before serving), so a scrape shows them at zero. */
void stats_init(void);

/* stats_drive counts a drive started: takeover when it continues another attempt's work. */
void stats_drive(bool takeover);

/* stats_settled counts a settlement by outcome ("completed", "failed", "aborted") and the
 * submissions joined into it. */
void stats_settled(const char *outcome, size_t joined);

/* stats_turn observes one turn of a drive: the time since its previous answer (or its start). */
void stats_turn(int64_t us);

/* stats_model_call observes one model call (one try) of model ("provider/model-id") that took
 * us: rc and r say how it ended (an error's kind: its HTTP status, context overflow, or the
 * status). */
void stats_model_call(const char *model, enum cf_status rc, const struct llm_response *r,
                      int64_t us);

/* stats_usage adds an answer's tokens and cost. */
void stats_usage(const char *model, int64_t input_tokens, int64_t output_tokens, double cost_usd);

/* stats_tool_result counts a tool result recorded, by tool name. */
void stats_tool_result(const char *tool, bool is_error, bool truncated);

#endif
