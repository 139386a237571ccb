/* Fuzz target: the W3C traceparent and tracestate parsers (a caller's request metadata is
 * outside input). The input is split at its first newline: traceparent, then tracestate. A
 * trace it accepts must format back to a valid version-00 traceparent of the same ids. */
#include "trace.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *in = malloc(size + 1);
    memcpy(in, data, size);
    in[size] = '\0';
    char *state = strchr(in, '\n');
    if (state) {
        *state++ = '\0';
    }
    struct trace_ctx t, back;
    struct cf_error err;
    if (trace_parse(&t, in, state, &err) == CF_OK) {
        char tp[TRACE_PARENT_SIZE];
        trace_format(&t, tp);
        if (trace_parse(&back, tp, t.state, &err) != CF_OK || strcmp(back.trace_id, t.trace_id) ||
            strcmp(back.span_id, t.span_id) || strcmp(back.state, t.state) ||
            strlen(t.state) > TRACE_STATE_MAX) {
            abort();
        }
    }
    free(in);
    return 0;
}
