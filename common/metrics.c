/* metrics.c - Prometheus counters, gauges and histograms (see metrics.h). */
#include "metrics.h"

#include "buf.h"
#include "mem.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define RENDER_MAX (64u << 20) /* the most text one scrape renders */
#define COLLECTORS_MAX 8

enum metric_type { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM };

struct series {
    char *values[METRICS_LABELS_MAX];
    double value; /* counter, gauge; histogram: the sum */
    uint64_t count;
    uint64_t buckets[METRICS_BUCKETS_MAX + 1]; /* the last: +Inf */
};

struct metric {
    char *name, *help;
    enum metric_type type;
    char *labels[METRICS_LABELS_MAX];
    size_t n_labels;
    double bounds[METRICS_BUCKETS_MAX];
    size_t n_bounds;
    pthread_mutex_t mu;
    struct series *series;
    size_t n;
    struct metric *next;
};

const double metrics_latency_buckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                          0.25,   0.5,   1,      2.5,   5,    10,    30,   60};
const size_t metrics_latency_buckets_n =
    sizeof(metrics_latency_buckets) / sizeof(metrics_latency_buckets[0]);

static struct {
    pthread_mutex_t mu;
    struct metric *head, *tail;
    struct {
        void (*fn)(void *arg);
        void *arg;
    } collectors[COLLECTORS_MAX];
    size_t n_collectors;
    struct metric *dropped;
    double start_time;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct metric *family(const char *name, const char *help, const char *labels,
                             enum metric_type type, const double *bounds, size_t n_bounds);

static pthread_once_t dropped_once = PTHREAD_ONCE_INIT;

static void make_dropped(void)
{
    g.dropped = family("cflue_metrics_series_dropped_total",
                       "Observations left out because their family had too many series.", "family",
                       METRIC_COUNTER, NULL, 0);
}

static void note_dropped(const char *name)
{
    pthread_once(&dropped_once, make_dropped);
    metrics_add(g.dropped, METRICS_LABELS(name), 1);
}

static struct metric *family(const char *name, const char *help, const char *labels,
                             enum metric_type type, const double *bounds, size_t n_bounds)
{
    pthread_mutex_lock(&g.mu);
    if (!g.start_time) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        g.start_time = (double)ts.tv_sec + ts.tv_nsec / 1e9;
    }
    for (struct metric *m = g.head; m; m = m->next) {
        if (!strcmp(m->name, name)) {
            pthread_mutex_unlock(&g.mu);
            return m;
        }
    }
    struct metric *m = mem_alloc(sizeof(*m));
    memset(m, 0, sizeof(*m));
    m->name = mem_strdup(name);
    m->help = mem_strdup(help);
    m->type = type;
    for (const char *p = labels; p && *p && m->n_labels < METRICS_LABELS_MAX;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        m->labels[m->n_labels++] = mem_strndup(p, len);
        p += len + (end != NULL);
    }
    for (size_t i = 0; i < n_bounds && i < METRICS_BUCKETS_MAX; i++) {
        m->bounds[m->n_bounds++] = bounds[i];
    }
    pthread_mutex_init(&m->mu, NULL);
    if (g.tail) {
        g.tail->next = m;
    } else {
        g.head = m;
    }
    g.tail = m;
    pthread_mutex_unlock(&g.mu);
    return m;
}

struct metric *metrics_counter(const char *name, const char *help, const char *labels)
{
    return family(name, help, labels, METRIC_COUNTER, NULL, 0);
}

struct metric *metrics_gauge(const char *name, const char *help, const char *labels)
{
    return family(name, help, labels, METRIC_GAUGE, NULL, 0);
}

struct metric *metrics_histogram(const char *name, const char *help, const char *labels,
                                 const double *bounds, size_t n_bounds)
{
    return family(name, help, labels, METRIC_HISTOGRAM, bounds, n_bounds);
}

/* find returns the series of the label values (made when new), or NULL past the bound; under
 * m->mu. */
static struct series *find(struct metric *m, const char *const *labels)
{
    for (size_t i = 0; i < m->n; i++) {
        bool same = true;
        for (size_t k = 0; k < m->n_labels && same; k++) {
            same = !strcmp(m->series[i].values[k], labels[k] ? labels[k] : "");
        }
        if (same) {
            return &m->series[i];
        }
    }
    if (m->n == METRICS_SERIES_MAX) {
        return NULL;
    }
    if ((m->n & (m->n - 1)) == 0) { /* grow at powers of two */
        m->series = mem_realloc(m->series, sizeof(*m->series) * (m->n ? m->n * 2 : 1));
    }
    struct series *s = &m->series[m->n++];
    memset(s, 0, sizeof(*s));
    for (size_t k = 0; k < m->n_labels; k++) {
        s->values[k] = mem_strdup(labels[k] ? labels[k] : "");
    }
    return s;
}

/* update applies one change to the series of labels under the family's lock. */
static void update(struct metric *m, const char *const *labels, double v)
{
    if (!m) {
        return; /* a family never made (a unit test of a module without its daemon) */
    }
    pthread_mutex_lock(&m->mu);
    struct series *s = find(m, labels);
    if (s) {
        switch (m->type) {
        case METRIC_COUNTER:
            s->value += v > 0 ? v : 0;
            break;
        case METRIC_GAUGE:
            s->value = v;
            break;
        case METRIC_HISTOGRAM: {
            size_t b = 0;
            while (b < m->n_bounds && v > m->bounds[b]) {
                b++;
            }
            s->buckets[b]++;
            s->count++;
            s->value += v;
            break;
        }
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (!s && strcmp(m->name, "cflue_metrics_series_dropped_total") != 0) {
        note_dropped(m->name);
    }
}

void metrics_add(struct metric *m, const char *const *labels, double v)
{
    update(m, labels, v);
}

void metrics_set(struct metric *m, const char *const *labels, double v)
{
    update(m, labels, v);
}

void metrics_observe(struct metric *m, const char *const *labels, double v)
{
    update(m, labels, v);
}

void metrics_clear(struct metric *m)
{
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < m->n; i++) {
        for (size_t k = 0; k < m->n_labels; k++) {
            free(m->series[i].values[k]);
        }
    }
    free(m->series);
    m->series = NULL;
    m->n = 0;
    pthread_mutex_unlock(&m->mu);
}

void metrics_on_scrape(void (*fn)(void *arg), void *arg)
{
    pthread_mutex_lock(&g.mu);
    if (g.n_collectors < COLLECTORS_MAX) {
        g.collectors[g.n_collectors].fn = fn;
        g.collectors[g.n_collectors++].arg = arg;
    }
    pthread_mutex_unlock(&g.mu);
}

/* put_labels writes {a="x",b="y"[,le="..."]} with the values escaped as the format asks. */
static void put_labels(struct buf *b, const struct metric *m, const struct series *s,
                       const char *le)
{
    if (!m->n_labels && !le) {
        return;
    }
    (void)buf_append_str(b, "{");
    for (size_t k = 0; k < m->n_labels; k++) {
        (void)buf_printf(b, "%s%s=\"", k ? "," : "", m->labels[k]);
        for (const char *p = s->values[k]; *p; p++) {
            const char *esc = *p == '\\' ? "\\\\" : *p == '"' ? "\\\"" : *p == '\n' ? "\\n" : NULL;
            if (esc) {
                (void)buf_append_str(b, esc);
            } else {
                (void)buf_append(b, p, 1);
            }
        }
        (void)buf_append_str(b, "\"");
    }
    if (le) {
        (void)buf_printf(b, "%sle=\"%s\"", m->n_labels ? "," : "", le);
    }
    (void)buf_append_str(b, "}");
}

static void render_family(struct buf *b, struct metric *m)
{
    static const char *const types[] = {"counter", "gauge", "histogram"};
    pthread_mutex_lock(&m->mu);
    if (m->n || m->type != METRIC_GAUGE || !m->n_labels) {
        (void)buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", m->name, m->help, m->name,
                         types[m->type]);
    }
    if (!m->n && !m->n_labels) { /* a family without labels shows its zero */
        (void)buf_printf(b, "%s 0\n", m->name);
    }
    for (size_t i = 0; i < m->n; i++) {
        const struct series *s = &m->series[i];
        if (m->type != METRIC_HISTOGRAM) {
            (void)buf_append_str(b, m->name);
            put_labels(b, m, s, NULL);
            (void)buf_printf(b, " %.17g\n", s->value);
            continue;
        }
        uint64_t cum = 0;
        for (size_t k = 0; k <= m->n_bounds; k++) {
            char le[32];
            cum += s->buckets[k];
            if (k < m->n_bounds) {
                snprintf(le, sizeof(le), "%g", m->bounds[k]);
            } else {
                snprintf(le, sizeof(le), "+Inf");
            }
            (void)buf_printf(b, "%s_bucket", m->name);
            put_labels(b, m, s, le);
            (void)buf_printf(b, " %llu\n", (unsigned long long)cum);
        }
        (void)buf_printf(b, "%s_sum", m->name);
        put_labels(b, m, s, NULL);
        (void)buf_printf(b, " %.17g\n%s_count", s->value, m->name);
        put_labels(b, m, s, NULL);
        (void)buf_printf(b, " %llu\n", (unsigned long long)s->count);
    }
    pthread_mutex_unlock(&m->mu);
}

/* process_series writes the process's CPU time, resident memory, threads and start time
 * under the names Prometheus' client libraries use. */
static void process_series(struct buf *b)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    long rss_pages = 0, threads = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        long size;
        if (fscanf(f, "%ld %ld", &size, &rss_pages) != 2) {
            rss_pages = 0;
        }
        fclose(f);
    }
    f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof(line), f)) {
        if (!strncmp(line, "Threads:", 8)) {
            threads = strtol(line + 8, NULL, 10);
        }
    }
    if (f) {
        fclose(f);
    }
    (void)buf_printf(b,
                     "# HELP process_cpu_seconds_total User and system CPU time of the process.\n"
                     "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total %.6f\n"
                     "# HELP process_resident_memory_bytes Resident memory of the process.\n"
                     "# TYPE process_resident_memory_bytes gauge\n"
                     "process_resident_memory_bytes %lld\n"
                     "# HELP process_threads Threads of the process.\n"
                     "# TYPE process_threads gauge\nprocess_threads %ld\n"
                     "# HELP process_start_time_seconds When the process started (Unix time).\n"
                     "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %.3f\n",
                     cpu, (long long)rss_pages * sysconf(_SC_PAGESIZE), threads, g.start_time);
}

char *metrics_render(size_t *len)
{
    pthread_mutex_lock(&g.mu);
    size_t n = g.n_collectors;
    void (*fns[COLLECTORS_MAX])(void *);
    void *args[COLLECTORS_MAX];
    for (size_t i = 0; i < n; i++) {
        fns[i] = g.collectors[i].fn;
        args[i] = g.collectors[i].arg;
    }
    pthread_mutex_unlock(&g.mu);
    for (size_t i = 0; i < n; i++) {
        fns[i](args[i]);
    }
    struct buf b;
    buf_init(&b, RENDER_MAX);
    process_series(&b);
    pthread_mutex_lock(&g.mu); /* then each family's: the one order both are taken in */
    for (struct metric *m = g.head; m; m = m->next) {
        render_family(&b, m);
    }
    pthread_mutex_unlock(&g.mu);
    *len = b.len;
    char *out = mem_strndup(b.data ? b.data : "", b.len);
    buf_cleanup(&b);
    return out;
}
