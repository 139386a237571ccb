/* Fuzz target: the SSE parser and both providers' stream event parsers (model output is
 * outside input). */
#include "provider.h"
#include "sse.h"

#include <stdint.h>
#include <string.h>

struct ctx {
    void *a, *o;
    struct llm_response ra, ro;
};

static bool on_event(void *p, const char *event, const char *data)
{
    struct ctx *c = p;
    struct cf_error err;
    (void)!anthropic_parse_event(c->a, event, data, NULL, &c->ra, &err); /* any result is fine */
    (void)!openai_parse_event(c->o, event, data, NULL, &c->ro, &err);
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct ctx c;
    struct sse s;
    struct cf_error err;
    c.a = anthropic_stream_new();
    c.o = openai_stream_new();
    llm_response_init(&c.ra);
    llm_response_init(&c.ro);
    sse_init(&s, 1 << 16, on_event, &c);
    /* feed in two pieces so events split across reads are exercised */
    size_t half = size / 2;
    if (sse_feed(&s, (const char *)data, half)) {
        sse_feed(&s, (const char *)data + half, size - half);
    }
    sse_cleanup(&s);
    /* and the whole input as a non-streamed body */
    (void)!anthropic_parse_body((const char *)data, size, &c.ra, &err); /* any result is fine */
    (void)!openai_parse_body((const char *)data, size, &c.ro, &err);
    anthropic_stream_free(c.a);
    openai_stream_free(c.o);
    llm_response_cleanup(&c.ra);
    llm_response_cleanup(&c.ro);
    return 0;
}
