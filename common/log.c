/* log.c - logfmt lines on stderr. */
#include "log.h"

#include "trace.h"

#include <grpc/support/log.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *service_name = "cflue";
static enum log_level min_level = LOG_INFO;
static const char *level_names[] = {"debug", "info", "warn", "error"};

void log_init(const char *service, enum log_level level)
{
    service_name = service;
    min_level = level;
}

int log_parse_level(const char *text)
{
    for (int i = 0; i < 4; i++) {
        if (strcmp(text, level_names[i]) == 0) {
            return i;
        }
    }
    return -1;
}

const char *log_quote(char *out, unsigned long out_len, const char *text)
{
    size_t o = 0;
    if (out_len < 3) {
        if (out_len) {
            out[0] = '\0';
        }
        return out;
    }
    out[o++] = '"';
    for (const unsigned char *p = (const unsigned char *)(text ? text : ""); *p; p++) {
        char esc[8];
        size_t n;
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            n = 2;
        } else if (*p == '\n') {
            memcpy(esc, "\\n", 2);
            n = 2;
        } else if (*p < 0x20 || *p == 0x7f) {
            n = (size_t)snprintf(esc, sizeof(esc), "\\x%02x", *p);
        } else {
            esc[0] = (char)*p;
            n = 1;
        }
        if (o + n + 2 > out_len) {
            break;
        }
        memcpy(out + o, esc, n);
        o += n;
    }
    out[o++] = '"';
    out[o] = '\0';
    return out;
}

void log_write(enum log_level level, const char *event, const char *fmt, ...)
{
    char line[4096];
    char traced[80] = ""; /* the current trace's fields: always at the end of the line */
    struct timespec ts;
    struct tm tm;
    size_t n, tail;
    va_list ap;

    if (level < min_level) {
        return;
    }
    const struct trace_ctx *t = trace_current();
    if (t) {
        snprintf(traced, sizeof(traced), " trace_id=%s span_id=%s", t->trace_id, t->span_id);
    }
    tail = strlen(traced);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    n = strftime(line, sizeof(line), "ts=%Y-%m-%dT%H:%M:%S", &tm);
    n += (size_t)snprintf(line + n, sizeof(line) - n, ".%03ldZ level=%s svc=%s event=%s",
                          ts.tv_nsec / 1000000, level_names[level], service_name, event);
    size_t room = sizeof(line) - tail - 1; /* the fields end before the trace and the newline */
    if (fmt && *fmt && n < room - 1) {
        line[n++] = ' ';
        va_start(ap, fmt);
        int m = vsnprintf(line + n, room - n, fmt, ap);
        va_end(ap);
        if (m > 0) {
            n += (size_t)m;
        }
    }
    if (n > room - 1) {
        n = room - 1;
    }
    memcpy(line + n, traced, tail);
    n += tail;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w;
}

static void grpc_log_sink(gpr_log_func_args *args)
{
    char q[1024];
    enum log_level lv = args->severity == GPR_LOG_SEVERITY_ERROR  ? LOG_ERROR
                        : args->severity == GPR_LOG_SEVERITY_INFO ? LOG_INFO
                                                                  : LOG_DEBUG;
    const char *file = strrchr(args->file, '/');
    log_write(lv, "grpc", "src=%s:%d msg=%s", file ? file + 1 : args->file, args->line,
              log_quote(q, sizeof(q), args->message));
}

void log_capture_grpc(void)
{
    gpr_set_log_function(grpc_log_sink);
}
