/* pbtime.c - google.protobuf.Timestamp and Duration to and from milliseconds. */
#include "pbtime.h"

#define NANOS_PER_MS 1000000
#define MAX_SECONDS 253402300799LL /* 9999-12-31T23:59:59Z */

int64_t pbtime_ms(const Google__Protobuf__Timestamp *ts)
{
    return ts ? ts->seconds * 1000 + ts->nanos / NANOS_PER_MS : 0;
}

void pbtime_set(Google__Protobuf__Timestamp *ts, int64_t ms)
{
    google__protobuf__timestamp__init(ts);
    int64_t s = ms / 1000, rem = ms % 1000;
    if (rem < 0) { /* nanos are never negative in a Timestamp */
        s -= 1;
        rem += 1000;
    }
    ts->seconds = s;
    ts->nanos = (int32_t)(rem * NANOS_PER_MS);
}

Google__Protobuf__Timestamp *pbtime_in(struct arena *a, int64_t ms)
{
    if (ms == 0) {
        return NULL;
    }
    Google__Protobuf__Timestamp *ts = arena_alloc(a, sizeof(*ts));
    pbtime_set(ts, ms);
    return ts;
}

int64_t pbdur_ms(const Google__Protobuf__Duration *d)
{
    return d ? d->seconds * 1000 + d->nanos / NANOS_PER_MS : 0;
}

void pbdur_set(Google__Protobuf__Duration *d, int64_t ms)
{
    google__protobuf__duration__init(d);
    d->seconds = ms / 1000;
    d->nanos = (int32_t)((ms % 1000) * NANOS_PER_MS);
}

Google__Protobuf__Duration *pbdur_in(struct arena *a, int64_t ms)
{
    if (ms <= 0) {
        return NULL;
    }
    Google__Protobuf__Duration *d = arena_alloc(a, sizeof(*d));
    pbdur_set(d, ms);
    return d;
}

enum cf_status pbdur_check(const Google__Protobuf__Duration *d, const char *field, int64_t max_ms,
                           struct cf_error *err)
{
    if (!d) {
        return CF_OK;
    }
    if (d->nanos <= -1000000000 || d->nanos >= 1000000000 || (d->seconds > 0 && d->nanos < 0) ||
        (d->seconds < 0 && d->nanos > 0) || d->seconds > MAX_SECONDS) {
        return cf_error_set(err, CF_INVALID, "%s is not a valid duration", field);
    }
    if (d->seconds < 0 || d->nanos < 0) {
        return cf_error_set(err, CF_INVALID, "%s must not be negative", field);
    }
    if (max_ms > 0 && pbdur_ms(d) > max_ms) {
        return cf_error_set(err, CF_INVALID, "%s must be at most %lld ms", field,
                            (long long)max_ms);
    }
    return CF_OK;
}

enum cf_status pbtime_check(const Google__Protobuf__Timestamp *ts, const char *field,
                            struct cf_error *err)
{
    if (ts && (ts->nanos < 0 || ts->nanos >= 1000000000 || ts->seconds < 0 ||
               ts->seconds > MAX_SECONDS)) {
        return cf_error_set(err, CF_INVALID, "%s is not a valid timestamp (1970 to 9999)", field);
    }
    return CF_OK;
}
