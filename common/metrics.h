/* metrics.h - Prometheus metrics: counters, gauges and histograms with labels, rendered in the
 * text exposition format (version 0.0.4) for /metrics (metrics_http.h).
 *
 * A family is made once (metrics_counter, metrics_gauge, metrics_histogram: asking again for a
 * name returns the same family) and lives for the process. Each set of label values is one
 * series, made on first use; a family holds at most METRICS_SERIES_MAX of them, and values past
 * that are counted in cflue_metrics_series_dropped_total instead, so a label fed from outside
 * (a tool name the model made up) cannot grow memory without bound. Every call is thread-safe
 * and takes the family's lock for a few instructions.
 *
 * Names follow Prometheus' conventions: cflue_<daemon>_<what>_<unit>, counters end in _total,
 * durations are seconds. docs/operations.md lists every series.
 */
#ifndef CFLUE_METRICS_H
#define CFLUE_METRICS_H

#include <stddef.h>

#define METRICS_LABELS_MAX 4
#define METRICS_SERIES_MAX 512
#define METRICS_BUCKETS_MAX 24

/* The label values of one observation, in the family's label order. */
#define METRICS_LABELS(...) ((const char *const[]){__VA_ARGS__})

struct metric;

/* Bucket bounds (seconds) for request and call latencies: 0.5 ms to 60 s. */
extern const double metrics_latency_buckets[];
extern const size_t metrics_latency_buckets_n;

/* metrics_counter, metrics_gauge and metrics_histogram return the family named name (made when
 * new) with help text and label names (comma-separated, at most METRICS_LABELS_MAX; "" for
 * none). A histogram takes its upper bounds in increasing order (at most METRICS_BUCKETS_MAX;
 * +Inf is added). Never NULL. */
struct metric *metrics_counter(const char *name, const char *help, const char *labels);
struct metric *metrics_gauge(const char *name, const char *help, const char *labels);
struct metric *metrics_histogram(const char *name, const char *help, const char *labels,
                                 const double *bounds, size_t n_bounds);

/* metrics_add adds v (>= 0) to a counter's series of the label values (NULL with no labels).
 * This and the other updates do nothing with m NULL (a family not made). */
void metrics_add(struct metric *m, const char *const *labels, double v);

/* metrics_set sets a gauge's series. */
void metrics_set(struct metric *m, const char *const *labels, double v);

/* metrics_clear removes every series of a gauge (before a scrape-time collector sets the ones
 * that exist now). */
void metrics_clear(struct metric *m);

/* metrics_observe counts one observation v in a histogram's series. */
void metrics_observe(struct metric *m, const char *const *labels, double v);

/* metrics_on_scrape has fn(arg) called before each rendering (at most 8 of them): it sets the
 * gauges that are read when asked (a database count, the process's memory). */
void metrics_on_scrape(void (*fn)(void *arg), void *arg);

/* metrics_render returns every family in the text exposition format (caller frees), its length
 * in *len; the process's own series (process_*) first. */
char *metrics_render(size_t *len);

#endif
