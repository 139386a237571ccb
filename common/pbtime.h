/* pbtime.h - google.protobuf.Timestamp and Duration to and from milliseconds.
 *
 * Inside cflue, times are int64 milliseconds (Unix epoch for instants; 0 = unset); on the wire
 * they are google.protobuf.Timestamp / Duration, where an absent message means unset.
 */
#ifndef CFLUE_PBTIME_H
#define CFLUE_PBTIME_H

#include "arena.h"
#include "status.h"

#include "google/protobuf/duration.pb-c.h"
#include "google/protobuf/timestamp.pb-c.h"

#include <stdbool.h>
#include <stdint.h>

/* pbtime_ms returns a timestamp in epoch milliseconds (sub-millisecond part dropped); 0 for
 * NULL. */
int64_t pbtime_ms(const Google__Protobuf__Timestamp *ts);

/* pbtime_set fills ts with epoch milliseconds ms. */
void pbtime_set(Google__Protobuf__Timestamp *ts, int64_t ms);

/* pbtime_in returns a timestamp for ms allocated in arena a, or NULL when ms is 0 (unset). */
Google__Protobuf__Timestamp *pbtime_in(struct arena *a, int64_t ms);

/* pbdur_ms returns a duration in milliseconds (rounded down); 0 for NULL. */
int64_t pbdur_ms(const Google__Protobuf__Duration *d);

/* pbdur_set fills d with ms milliseconds. */
void pbdur_set(Google__Protobuf__Duration *d, int64_t ms);

/* pbdur_in returns a duration of ms allocated in arena a, or NULL when ms <= 0 (unset). */
Google__Protobuf__Duration *pbdur_in(struct arena *a, int64_t ms);

/* pbdur_check validates an optional duration field named `field`: NULL is fine; otherwise
 * seconds and nanos must have the same sign, |nanos| < 1e9, the value must not be negative
 * and, when max_ms > 0, at most max_ms. CF_INVALID with a message naming the field. */
CF_MUST_CHECK enum cf_status pbdur_check(const Google__Protobuf__Duration *d, const char *field,
                                         int64_t max_ms, struct cf_error *err);

/* pbtime_check validates an optional timestamp field: NULL is fine; otherwise 0 <= nanos < 1e9
 * and the instant between 1970 and 9999. */
CF_MUST_CHECK enum cf_status pbtime_check(const Google__Protobuf__Timestamp *ts, const char *field,
                                          struct cf_error *err);

#endif
