/* log.h - structured logs on stderr, one logfmt line per event.
 *
 *   ts=2026-11-29T21:00:00.123Z level=info svc=storaged event=admit submission=sub_01...
 *
 * Thread-safe: each line is written with a single write(2). gRPC's own log lines are routed
 * through the same writer by log_capture_grpc(). A line written while the thread has a current
 * trace (trace.h) ends with its `trace_id=<32 hex> span_id=<16 hex>`, kept whole however long
 * the line's other fields are.
 */
#ifndef CFLUE_LOG_H
#define CFLUE_LOG_H

enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR };

/* log_init sets the service name printed in every line and the minimum level. */
void log_init(const char *service, enum log_level min_level);

/* log_parse_level maps "debug", "info", "warn", "error" to a level; returns -1 otherwise. */
int log_parse_level(const char *text);

/* log_write prints one line: the event name, then the printf-formatted key=value pairs. Values
 * that may contain spaces or quotes must be passed through log_quote first. */
void log_write(enum log_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* log_quote writes text into out as a double-quoted logfmt value (escaping quotes,
 * backslashes and control bytes), truncated to out_len; returns out. */
const char *log_quote(char *out, unsigned long out_len, const char *text);

/* log_capture_grpc routes gRPC core's log lines into log_write. Call before grpc_init. */
void log_capture_grpc(void);

#define log_debug(ev, ...) log_write(LOG_DEBUG, ev, __VA_ARGS__)
#define log_info(ev, ...) log_write(LOG_INFO, ev, __VA_ARGS__)
#define log_warn(ev, ...) log_write(LOG_WARN, ev, __VA_ARGS__)
#define log_error(ev, ...) log_write(LOG_ERROR, ev, __VA_ARGS__)

#endif
