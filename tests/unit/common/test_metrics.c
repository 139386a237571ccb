/* Unit tests of common/metrics.c: the text format (help, type, escaped label values, cumulative
 * histogram buckets with +Inf, sum and count), one family per name, gauges cleared, and the
 * series bound with its dropped counter. */
#include "../check.h"

#include "metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int has(const char *text, const char *line)
{
    int found = strstr(text, line) != NULL;
    if (!found) {
        fprintf(stderr, "  missing: %s\n", line);
    }
    return found;
}

int main(void)
{
    struct metric *c = metrics_counter("t_calls_total", "Calls.", "method,code");
    CHECK(metrics_counter("t_calls_total", "again", "x") == c); /* one family per name */
    metrics_add(c, METRICS_LABELS("/a/B", "OK"), 1);
    metrics_add(c, METRICS_LABELS("/a/B", "OK"), 2);
    metrics_add(c, METRICS_LABELS("q\"u\\o\nte", "OK"), 1);
    metrics_add(c, METRICS_LABELS("/a/B", "OK"), -5); /* a counter never goes down */
    static const double b[] = {0.1, 1};
    struct metric *h = metrics_histogram("t_seconds", "Time.", "", b, 2);
    metrics_observe(h, NULL, 0.05);
    metrics_observe(h, NULL, 0.5);
    metrics_observe(h, NULL, 7);
    struct metric *g = metrics_gauge("t_rows", "Rows.", "status");
    metrics_set(g, METRICS_LABELS("queued"), 4);
    metrics_set(g, METRICS_LABELS("queued"), 2);
    metrics_add(NULL, NULL, 1); /* a family never made: nothing happens */
    size_t len;
    char *text = metrics_render(&len);
    CHECK(len == strlen(text));
    CHECK(has(text, "# HELP t_calls_total Calls.\n# TYPE t_calls_total counter\n"));
    CHECK(has(text, "t_calls_total{method=\"/a/B\",code=\"OK\"} 3\n"));
    CHECK(has(text, "t_calls_total{method=\"q\\\"u\\\\o\\nte\",code=\"OK\"} 1\n"));
    CHECK(has(text, "# TYPE t_seconds histogram\n"));
    CHECK(has(text, "t_seconds_bucket{le=\"0.1\"} 1\nt_seconds_bucket{le=\"1\"} 2\n"
                    "t_seconds_bucket{le=\"+Inf\"} 3\nt_seconds_sum 7.5499999999999998\n"
                    "t_seconds_count 3\n"));
    CHECK(has(text, "t_rows{status=\"queued\"} 2\n"));
    CHECK(has(text, "process_resident_memory_bytes "));
    free(text);
    metrics_clear(g);
    text = metrics_render(&len);
    CHECK(strstr(text, "t_rows{") == NULL);
    free(text);
    /* the series bound: past it, observations are counted as dropped */
    struct metric *many = metrics_counter("t_many_total", "Many.", "k");
    for (int i = 0; i < METRICS_SERIES_MAX + 10; i++) {
        char k[16];
        snprintf(k, sizeof(k), "%d", i);
        metrics_add(many, METRICS_LABELS(k), 1);
    }
    text = metrics_render(&len);
    CHECK(has(text, "cflue_metrics_series_dropped_total{family=\"t_many_total\"} 10\n"));
    CHECK(strstr(text, "t_many_total{k=\"511\"} 1\n") != NULL);
    CHECK(strstr(text, "t_many_total{k=\"512\"}") == NULL);
    free(text);
    return check_done("test_metrics");
}
