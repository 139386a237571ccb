/* Unit tests of agentd/: agent definitions, ListAgents paging, the reserved metadata keys, the
 * SSE parser, the providers' wire formats. */
#include "../check.h"

#include "agents.h"
#include "clock.h"
#include "drive.h"
#include "mem.h"
#include "metadata.h"
#include "page_token.h"
#include "provider.h"
#include "record_log.h"
#include "settled_here.h"
#include "sse.h"

#include <stdlib.h>
#include <string.h>

static void test_agents(void)
{
    struct agent_def a;
    struct cf_error err;
    const char *ok = "---\nname: coder\nmodel: anthropic/claude-x\nsandbox:\n  tools: "
                     "\"127.0.0.1:7102\"\n  workspace: ex\ndurability: {max_attempts: 3, "
                     "timeout_ms: 60000}\n---\n\nBe careful.\n";
    CHECK(agents_parse(ok, "coder", "coder.md", &a, &err) == CF_OK);
    CHECK_STR(a.provider, "anthropic");
    CHECK_STR(a.model_id, "claude-x");
    CHECK_STR(a.sandbox_tools, "127.0.0.1:7102");
    CHECK_STR(a.sandbox_workspace, "ex");
    CHECK(a.max_attempts == 3 && a.timeout_ms == 60000);
    CHECK_STR(a.instructions, "Be careful.\n");
    agents_free_one(&a);

    /* no model: a subagent that runs with its parent's */
    CHECK(agents_parse("---\nname: x\n---\nbody", "x", "x.md", &a, &err) == CF_OK);
    CHECK(a.model == NULL && a.provider == NULL && a.model_id == NULL);
    agents_free_one(&a);
    CHECK(agents_parse("---\nmodel: anthropic\n---\n", "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "x.md: model: 'anthropic' must be provider/model-id") != NULL);
    CHECK(agents_parse("---\nmodel: google/gemini\n---\n", "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "unknown provider 'google'") != NULL);
    CHECK(agents_parse("---\nmodel: openai/gpt\ncolour: red\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "colour: unknown field") != NULL);
    CHECK(agents_parse("---\nname: y\nmodel: openai/gpt\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "does not match the file name") != NULL);
    CHECK(agents_parse("---\nmodel: [unclosed\n---\n", "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "frontmatter line") != NULL);
    CHECK(agents_parse("no frontmatter", "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(agents_parse("---\nmodel: openai/gpt\ndurability: {max_attempts: 0}\n---\n", "x", "x.md",
                       &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "durability.max_attempts") != NULL);

    /* the workspace: {conversation}, or a sandbox name toold accepts */
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", workspace: \"{conversation}\"}\n---\n", "x",
                       "x.md", &a, &err) == CF_OK);
    CHECK_STR(a.sandbox_workspace, "{conversation}");
    agents_free_one(&a);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", workspace: \"team-{conversation}\"}\n---\n",
                       "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "x.md: sandbox.workspace: 'team-{conversation}' is neither") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", workspace: \"..\"}\n---\n", "x", "x.md", &a,
                       &err) == CF_INVALID);

    /* sandbox.tools: one address, a list of replicas (kept joined), or dns:NAME:PORT */
    CHECK(agents_parse("---\nsandbox: {tools: [\"a:1\", \"b:2\"]}\n---\n", "x", "x.md", &a, &err) ==
          CF_OK);
    CHECK_STR(a.sandbox_tools, "a:1,b:2");
    agents_free_one(&a);
    CHECK(agents_parse("---\nsandbox: {tools: [\"a:1\", \"a:1\"]}\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "x.md: sandbox.tools: replica 1: a:1 is listed twice") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: [\"a:1,b:2\"]}\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "sandbox.tools[0]: 'a:1,b:2' holds a ','") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: []}\n---\n", "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "sandbox.tools: an empty list") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: \"dns:toold\"}\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "sandbox.tools: 'dns:toold' is not dns:NAME:PORT") != NULL);
    CHECK(agents_parse("---\nmodel: openai/gpt\nsandbox: {tools: [\"a:1\", \"b:2\"]}\ntools: "
                       "[\"b:2\"]\n---\n",
                       "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "tools[0]: b:2 is the sandbox's toold") != NULL);

    /* sandbox.limits: each optional, whole numbers in range, no unknown field */
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", limits: {memory_mib: 64, cpu_s: 30}}\n---\n",
                       "x", "x.md", &a, &err) == CF_OK);
    CHECK(a.sandbox_limits.memory_mib == 64 && a.sandbox_limits.cpu_s == 30 &&
          a.sandbox_limits.procs == 0 && a.sandbox_limits.disk_mib == 0);
    agents_free_one(&a);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", limits: {memory_mib: 0}}\n---\n", "x",
                       "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "x.md: sandbox.limits.memory_mib: expected a whole number") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", limits: {memory: 64}}\n---\n", "x", "x.md",
                       &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "sandbox.limits.memory: unknown field (known: cpu_s, memory_mib") !=
          NULL);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", limits: 64}\n---\n", "x", "x.md", &a,
                       &err) == CF_INVALID);
    CHECK(strstr(err.msg, "sandbox.limits: expected {cpu_s") != NULL);
    CHECK(agents_parse("---\nsandbox: {tools: \"t:1\", workspce: ex}\n---\n", "x", "x.md", &a,
                       &err) == CF_INVALID);
    CHECK(strstr(err.msg,
                 "x.md: sandbox.workspce: unknown field (known: tools, workspace, limits)") !=
          NULL);

    /* tool servers: each once, not the sandbox's toold, at most 8, addresses bounded */
    CHECK(agents_parse("---\nmodel: openai/gpt\ntools: [\"a:1\", \"b:2\"]\n---\n", "x", "x.md", &a,
                       &err) == CF_OK);
    CHECK(a.n_tool_servers == 2);
    CHECK_STR(a.tool_servers[1], "b:2");
    agents_free_one(&a);
    CHECK(agents_parse("---\nmodel: openai/gpt\nsandbox: {tools: \"t:1\"}\ntools: [\"t:1\"]\n---\n",
                       "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "x.md: tools[0]: t:1 is the sandbox's toold") != NULL);
    CHECK(agents_parse("---\nmodel: openai/gpt\ntools: [a, b, a]\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "tools[2]: a is listed twice") != NULL);
    CHECK(agents_parse("---\nmodel: openai/gpt\ntools: [a, b, c, d, e, f, g, h, i]\n---\n", "x",
                       "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "9 tool servers; at most 8") != NULL);
    char long_addr[400];
    memset(long_addr, 'h', 300);
    snprintf(long_addr + 300, sizeof(long_addr) - 300, ":1");
    char def[600];
    snprintf(def, sizeof(def), "---\nmodel: openai/gpt\ntools: [\"%s\"]\n---\n", long_addr);
    CHECK(agents_parse(def, "x", "x.md", &a, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "tools[0]: longer than 255 characters") != NULL);
    CHECK(agents_parse("---\nmodel: openai/gpt\ntools: \"a:1\"\n---\n", "x", "x.md", &a, &err) ==
          CF_INVALID);
    CHECK(strstr(err.msg, "tools: expected a list of strings") != NULL);
}

/* ListAgents pages through the agents by name; a page token carries the last name returned,
 * so the pages are neither overlapping nor leaky, and a token of another scope is refused. */
static void test_agents_page(void)
{
    struct agent_def items[5];
    const char *names[5] = {"alpha", "bravo", "charlie", "delta", "echo"};
    struct agent_set set = {items, 5};
    char next[PAGE_TOKEN_MAX], other[PAGE_TOKEN_MAX];
    size_t first = 99, n = 99;
    struct cf_error err;
    memset(items, 0, sizeof(items));
    for (int i = 0; i < 5; i++) {
        items[i].name = (char *)names[i];
    }
    /* 0: the default (100): everything, last page */
    CHECK(agents_page(&set, 0, "", &first, &n, next, &err) == CF_OK);
    CHECK(first == 0 && n == 5);
    CHECK_STR(next, "");
    /* pages of 2: alpha bravo | charlie delta | echo */
    CHECK(agents_page(&set, 2, NULL, &first, &n, next, &err) == CF_OK);
    CHECK(first == 0 && n == 2);
    CHECK(next[0] != '\0');
    char token[PAGE_TOKEN_MAX];
    snprintf(token, sizeof(token), "%s", next);
    CHECK(agents_page(&set, 2, token, &first, &n, next, &err) == CF_OK);
    CHECK(first == 2 && n == 2);
    CHECK_STR(items[first].name, "charlie");
    snprintf(token, sizeof(token), "%s", next);
    CHECK(agents_page(&set, 2, token, &first, &n, next, &err) == CF_OK);
    CHECK(first == 4 && n == 1);
    CHECK_STR(items[first].name, "echo");
    CHECK_STR(next, ""); /* the last page says so */
    /* an exact fit ends without a token for an empty page */
    CHECK(agents_page(&set, 5, "", &first, &n, next, &err) == CF_OK);
    CHECK(n == 5);
    CHECK_STR(next, "");
    /* a token names a position, not an index: an agent gone since still pages on after it */
    page_token_make(token, AGENTS_PAGE_SCOPE, "bz");
    CHECK(agents_page(&set, 10, token, &first, &n, next, &err) == CF_OK);
    CHECK(first == 2 && n == 3);
    /* past the end: an empty last page */
    page_token_make(token, AGENTS_PAGE_SCOPE, "zulu");
    CHECK(agents_page(&set, 10, token, &first, &n, next, &err) == CF_OK);
    CHECK(n == 0);
    CHECK_STR(next, "");
    /* more than the maximum is the maximum */
    CHECK(agents_page(&set, 5000, "", &first, &n, next, &err) == CF_OK);
    CHECK(n == 5);
    /* refused: a negative size, garbage, another scope's token */
    CHECK(agents_page(&set, -1, "", &first, &n, next, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "page_size") != NULL);
    CHECK(agents_page(&set, 2, "not-a-token", &first, &n, next, &err) == CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "INVALID_PAGE_TOKEN");
    page_token_make(other, "conv_1", "bravo");
    CHECK(agents_page(&set, 2, other, &first, &n, next, &err) == CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "INVALID_PAGE_TOKEN");
}

/* Submit refuses metadata keys starting "cflue." (they are cflue's own) with a reason a client
 * can branch on; other keys, "cflue" alone and other cases pass. */
static void test_metadata(void)
{
    Cflue__V1__SubmitRequest__MetadataEntry e[4], *md[4] = {&e[0], &e[1], &e[2], &e[3]};
    const char *keys[4] = {"team", "cflue", "Cflue.x", "cflue.kind"};
    struct cf_error err;
    for (int i = 0; i < 4; i++) {
        cflue__v1__submit_request__metadata_entry__init(&e[i]);
        e[i].key = (char *)keys[i];
        e[i].value = "v";
    }
    CHECK(metadata_check(md, 0, &err) == CF_OK);
    CHECK(metadata_check(md, 3, &err) == CF_OK);
    CHECK(metadata_check(md, 4, &err) == CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "RESERVED_METADATA_KEY");
    CHECK(strstr(err.msg, "'cflue.kind'") != NULL);
    e[0].key = "cflue.";
    CHECK(metadata_check(md, 1, &err) == CF_INVALID);
}

struct seen {
    char events[8][32];
    char data[8][128];
    int n;
};

static bool collect(void *ctx, const char *event, const char *data)
{
    struct seen *s = ctx;
    if (s->n < 8) {
        snprintf(s->events[s->n], sizeof(s->events[0]), "%s", event);
        snprintf(s->data[s->n], sizeof(s->data[0]), "%s", data);
        s->n++;
    }
    return true;
}

static void test_sse(void)
{
    struct sse p;
    struct seen s = {0};
    sse_init(&p, 1024, collect, &s);
    const char *stream =
        ": comment\r\nevent: a\r\ndata: one\r\ndata:two\r\n\r\ndata: {\"x\":1}\n\n";
    /* feed byte by byte: events must not depend on how the bytes arrive */
    for (size_t i = 0; i < strlen(stream); i++) {
        CHECK(sse_feed(&p, stream + i, 1));
    }
    CHECK(s.n == 2);
    CHECK_STR(s.events[0], "a");
    CHECK_STR(s.data[0], "one\ntwo");
    CHECK_STR(s.events[1], "");
    CHECK_STR(s.data[1], "{\"x\":1}");
    sse_cleanup(&p);

    /* an event with no data line (a bare keep-alive "event: ping") is dropped, an empty data
     * line is an event; lines may end with a CR alone, and a CRLF split between two pieces
     * is one line end, not two (which would end the event early) */
    memset(&s, 0, sizeof(s));
    sse_init(&p, 1024, collect, &s);
    const char *pieces[] = {"event: ping\n\n", "event: e\rdata:\r\r", "data: a\r",
                            "\ndata: b\r\n\r\n", "data: c\r\r"};
    for (size_t i = 0; i < sizeof(pieces) / sizeof(pieces[0]); i++) {
        CHECK(sse_feed(&p, pieces[i], strlen(pieces[i])));
    }
    CHECK(s.n == 3);
    CHECK_STR(s.events[0], "e");
    CHECK_STR(s.data[0], "");
    CHECK_STR(s.events[1], "");
    CHECK_STR(s.data[1], "a\nb");
    CHECK_STR(s.data[2], "c");
    sse_cleanup(&p);
    sse_init(&p, 16, collect, &s);
    CHECK(!sse_feed(&p, "data: this line is far too long\n", 33));
    CHECK(p.too_big);
    sse_cleanup(&p);
}

/* A streamed answer's tool call arguments and text together are bounded (PROVIDER_RESPONSE_MAX)
 * however they are spread over calls: 17 calls of 1 MiB each are refused at the 17th, for
 * either provider, where each call alone is within the bound. */
static void test_streamed_answer_bound(void)
{
    size_t mib = 1 << 20;
    char *piece = mem_alloc(mib + 1);
    memset(piece, 'a', mib);
    piece[mib] = '\0';
    for (int openai = 0; openai < 2; openai++) {
        struct llm_response r;
        struct cf_error err = {0};
        llm_response_init(&r);
        void *st = openai ? openai_stream_new() : anthropic_stream_new();
        enum cf_status rc = CF_OK;
        int i;
        for (i = 0; i < 17 && rc == CF_OK; i++) {
            char *start = mem_asprintf(
                "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":{\"type\":"
                "\"tool_use\",\"id\":\"t%d\",\"name\":\"write\",\"input\":{}}}",
                i, i);
            char *delta =
                openai ? mem_asprintf("{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{"
                                      "\"index\":%d,\"id\":\"t%d\",\"function\":{\"name\":"
                                      "\"write\",\"arguments\":\"%s\"}}]}}]}",
                                      i, i, piece)
                       : mem_asprintf("{\"type\":\"content_block_delta\",\"index\":%d,\"delta\":{"
                                      "\"type\":\"input_json_delta\",\"partial_json\":\"%s\"}}",
                                      i, piece);
            char *stop = mem_asprintf("{\"type\":\"content_block_stop\",\"index\":%d}", i);
            if (openai) {
                rc = openai_parse_event(st, "", delta, NULL, &r, &err);
            } else if ((rc = anthropic_parse_event(st, "", start, NULL, &r, &err)) == CF_OK &&
                       (rc = anthropic_parse_event(st, "", delta, NULL, &r, &err)) == CF_OK) {
                rc = anthropic_parse_event(st, "", stop, NULL, &r, &err);
            }
            free(start);
            free(delta);
            free(stop);
        }
        CHECK(rc == CF_TOOBIG);
        CHECK(i == 17); /* the first 16 MiB were taken */
        CHECK(strstr(err.msg, "answer passed") != NULL);
        /* and no text fits after them */
        rc = openai ? openai_parse_event(st, "",
                                         "{\"choices\":[{\"index\":0,\"delta\":{\"content\":"
                                         "\"x\"}}]}",
                                         NULL, &r, &err)
                    : anthropic_parse_event(st, "",
                                            "{\"type\":\"content_block_delta\",\"index\":0,"
                                            "\"delta\":{\"type\":\"text_delta\",\"text\":\"x\"}}",
                                            NULL, &r, &err);
        CHECK(rc == CF_TOOBIG && r.text.len == 0);
        openai ? openai_stream_free(st) : anthropic_stream_free(st);
        llm_response_cleanup(&r);
    }
    free(piece);
    /* the last event marks the stream whole */
    struct llm_response r;
    struct cf_error err = {0};
    llm_response_init(&r);
    void *st = anthropic_stream_new();
    CHECK(!r.stream_ended);
    CHECK(anthropic_parse_event(st, "message_stop", "{\"type\":\"message_stop\"}", NULL, &r,
                                &err) == CF_OK);
    CHECK(r.stream_ended);
    anthropic_stream_free(st);
    llm_response_cleanup(&r);
    llm_response_init(&r);
    st = openai_stream_new();
    CHECK(openai_parse_event(st, "", "[DONE]", NULL, &r, &err) == CF_OK);
    CHECK(r.stream_ended);
    openai_stream_free(st);
    llm_response_cleanup(&r);
}

static void test_anthropic_stream(void)
{
    struct llm_response r;
    struct cf_error err;
    llm_response_init(&r);
    void *st = anthropic_stream_new();
    const char *events[][2] = {
        {"message_start",
         "{\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12}}}"},
        {"content_block_start", "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{"
                                "\"type\":\"text\",\"text\":\"\"}}"},
        {"content_block_delta", "{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":"
                                "\"text_delta\",\"text\":\"Hi \"}}"},
        {"content_block_delta", "{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":"
                                "\"text_delta\",\"text\":\"there\"}}"},
        {"content_block_stop", "{\"type\":\"content_block_stop\",\"index\":0}"},
        {"content_block_start",
         "{\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\","
         "\"id\":\"toolu_1\",\"name\":\"bash\",\"input\":{}}}"},
        {"content_block_delta", "{\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":"
                                "\"input_json_delta\",\"partial_json\":\"{\\\"comm\"}}"},
        {"content_block_delta", "{\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":"
                                "\"input_json_delta\",\"partial_json\":\"and\\\":\\\"ls\\\"}\"}}"},
        {"content_block_stop", "{\"type\":\"content_block_stop\",\"index\":1}"},
        {"message_delta", "{\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},"
                          "\"usage\":{\"output_tokens\":7}}"},
    };
    for (size_t i = 0; i < sizeof(events) / sizeof(events[0]); i++) {
        CHECK(anthropic_parse_event(st, events[i][0], events[i][1], NULL, &r, &err) == CF_OK);
    }
    CHECK_STR(buf_cstr(&r.text), "Hi there");
    CHECK(r.n_calls == 1);
    CHECK_STR(r.calls[0].id, "toolu_1");
    CHECK_STR(r.calls[0].arguments_json, "{\"command\":\"ls\"}");
    CHECK_STR(r.stop_reason, "tool_use");
    CHECK(r.input_tokens == 12 && r.output_tokens == 7);
    CHECK(anthropic_parse_event(st, "message_start", "{not json", NULL, &r, &err) == CF_INVALID);
    anthropic_stream_free(st);
    llm_response_cleanup(&r);
}

static void test_openai_stream(void)
{
    struct llm_response r;
    struct cf_error err;
    llm_response_init(&r);
    void *st = openai_stream_new();
    const char *chunks[] = {
        "{\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Ok\"}}]}",
        "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\","
        "\"type\":\"function\",\"function\":{\"name\":\"read\",\"arguments\":\"{\\\"pa\"}}]}}]}",
        "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{"
        "\"arguments\":\"th\\\":\\\"a\\\"}\"}}]}}]}",
        "{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}",
        "{\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3}}",
        "[DONE]",
    };
    for (size_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++) {
        CHECK(openai_parse_event(st, "", chunks[i], NULL, &r, &err) == CF_OK);
    }
    CHECK_STR(buf_cstr(&r.text), "Ok");
    CHECK(r.n_calls == 1);
    CHECK_STR(r.calls[0].name, "read");
    CHECK_STR(r.calls[0].arguments_json, "{\"path\":\"a\"}");
    CHECK_STR(r.stop_reason, "tool_use");
    CHECK(r.input_tokens == 5 && r.output_tokens == 3);
    openai_stream_free(st);
    llm_response_cleanup(&r);
}

/* A streamed answer with more blocks or calls than a small table holds keeps every one; an
 * index past PROVIDER_STREAM_PARTS_MAX is refused, not dropped. */
static void test_streams_with_many_calls(void)
{
    enum { N = 300 };
    char ev[300];
    struct llm_response r;
    struct cf_error err;
    llm_response_init(&r);
    void *st = anthropic_stream_new();
    for (int i = 0; i < N; i++) {
        snprintf(ev, sizeof(ev),
                 "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":{\"type\":"
                 "\"tool_use\",\"id\":\"toolu_%d\",\"name\":\"read\",\"input\":{}}}",
                 i, i);
        CHECK(anthropic_parse_event(st, "content_block_start", ev, NULL, &r, &err) == CF_OK);
        snprintf(ev, sizeof(ev),
                 "{\"type\":\"content_block_delta\",\"index\":%d,\"delta\":{\"type\":"
                 "\"input_json_delta\",\"partial_json\":\"{\\\"path\\\":\\\"%d\\\"}\"}}",
                 i, i);
        CHECK(anthropic_parse_event(st, "content_block_delta", ev, NULL, &r, &err) == CF_OK);
        snprintf(ev, sizeof(ev), "{\"type\":\"content_block_stop\",\"index\":%d}", i);
        CHECK(anthropic_parse_event(st, "content_block_stop", ev, NULL, &r, &err) == CF_OK);
    }
    CHECK(r.n_calls == N);
    CHECK_STR(r.calls[N - 1].id, "toolu_299");
    CHECK_STR(r.calls[N - 1].arguments_json, "{\"path\":\"299\"}");
    snprintf(ev, sizeof(ev), "{\"type\":\"content_block_stop\",\"index\":%d}",
             PROVIDER_STREAM_PARTS_MAX);
    CHECK(anthropic_parse_event(st, "content_block_stop", ev, NULL, &r, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "content block 4096") != NULL);
    CHECK(anthropic_parse_event(st, "content_block_stop", "{\"type\":\"content_block_stop\"}", NULL,
                                &r, &err) == CF_INVALID);
    anthropic_stream_free(st);
    llm_response_cleanup(&r);

    llm_response_init(&r);
    st = openai_stream_new();
    for (int i = 0; i < N; i++) {
        snprintf(ev, sizeof(ev),
                 "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":%d,"
                 "\"id\":\"call_%d\",\"type\":\"function\",\"function\":{\"name\":\"read\","
                 "\"arguments\":\"{\\\"path\\\":\\\"%d\\\"}\"}}]}}]}",
                 i, i, i);
        CHECK(openai_parse_event(st, "", ev, NULL, &r, &err) == CF_OK);
    }
    CHECK(openai_parse_event(st, "", "[DONE]", NULL, &r, &err) == CF_OK);
    CHECK(r.n_calls == N);
    CHECK_STR(r.calls[N - 1].id, "call_299");
    CHECK_STR(r.calls[N - 1].arguments_json, "{\"path\":\"299\"}");
    snprintf(ev, sizeof(ev),
             "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":%d,"
             "\"function\":{\"arguments\":\"{}\"}}]}}]}",
             PROVIDER_STREAM_PARTS_MAX);
    CHECK(openai_parse_event(st, "", ev, NULL, &r, &err) == CF_INVALID);
    openai_stream_free(st);
    llm_response_cleanup(&r);
}

/* parsed is a built request body as JSON (it takes the text), NULL when it was not JSON. */
static json_t *parsed(char *text)
{
    json_error_t je;
    json_t *j = text ? json_loads(text, 0, &je) : NULL;
    CHECK(j != NULL);
    free(text);
    return j;
}

/* A tool's schema: re-encoded compact once, then answered from the cache; what is not a JSON
 * object becomes {}; past the cache's size the oldest texts are parsed again, answers unchanged. */
static void test_schema_text(void)
{
    const char *schema =
        "{ \"type\": \"object\", \"properties\": {\"p\": {\"type\": \"string\"}} }";
    const char *compact = "{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"string\"}}}";
    for (int round = 0; round < 2; round++) {
        char *t = llm_schema_text(schema);
        CHECK_STR(t, compact);
        free(t);
    }
    const char *not_objects[] = {"", "[1]", "\"s\"", "{\"a\":", "{\"a\":\"\xff\"}", NULL};
    for (size_t i = 0; i < sizeof(not_objects) / sizeof(not_objects[0]); i++) {
        char *t = llm_schema_text(not_objects[i]);
        CHECK_STR(t, "{}");
        free(t);
    }
    for (int i = 0; i < LLM_SCHEMA_CACHE_MAX + 8; i++) {
        char in[64], want[64];
        snprintf(in, sizeof(in), "{ \"n\": %d }", i);
        snprintf(want, sizeof(want), "{\"n\":%d}", i);
        char *t = llm_schema_text(in);
        CHECK_STR(t, want);
        free(t);
    }
    char *t = llm_schema_text(schema);
    CHECK_STR(t, compact);
    free(t);
}

static void test_build(void)
{
    struct llm_call call = {"toolu_1", "bash", "{\"command\":\"ls\"}"};
    struct llm_message msgs[] = {
        {.role = LLM_USER, .text = "hi"},
        {.role = LLM_ASSISTANT, .text = "", .calls = &call, .n_calls = 1},
        {.role = LLM_TOOL_RESULT, .text = "a\nb", .tool_call_id = "toolu_1", .tool_name = "bash"},
        {.role = LLM_USER, .text = "also this"},
    };
    /* a schema as the tool set keeps it (schema_text), and one filled by hand (schema_json) */
    char kept[] = "{\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\"}}}";
    struct llm_tool tools[] = {
        {"bash", "Run.", "{ }", kept},
        {"read", "Read.", "{\"type\": \"object\", \"required\": [\"path\"]}", NULL}};
    struct llm_request req = {.provider = "anthropic",
                              .model = "m",
                              .system = "sys",
                              .messages = msgs,
                              .n_messages = 4,
                              .tools = tools,
                              .n_tools = 2,
                              .max_tokens = 100};
    json_t *a = parsed(anthropic_build(&req, NULL));
    json_t *ts = json_object_get(a, "tools");
    CHECK(json_is_object(json_object_get(
        json_object_get(json_object_get(json_array_get(ts, 0), "input_schema"), "properties"),
        "command")));
    CHECK_STR(
        json_string_value(json_array_get(
            json_object_get(json_object_get(json_array_get(ts, 1), "input_schema"), "required"),
            0)),
        "path");
    json_t *m = json_object_get(a, "messages");
    CHECK(json_array_size(m) == 3); /* the tool result and the next user text share a message */
    json_t *last = json_object_get(json_array_get(m, 2), "content");
    CHECK(json_array_size(last) == 2);
    CHECK_STR(json_string_value(json_object_get(json_array_get(last, 0), "type")), "tool_result");
    CHECK_STR(json_string_value(json_object_get(a, "system")), "sys");
    json_decref(a);
    req.provider = "openai";
    json_t *o = parsed(openai_build(&req, NULL));
    ts = json_object_get(o, "tools");
    CHECK_STR(json_string_value(
                  json_object_get(json_object_get(json_array_get(ts, 1), "function"), "name")),
              "read");
    CHECK(json_is_object(json_object_get(
        json_object_get(json_object_get(json_array_get(ts, 0), "function"), "parameters"),
        "properties")));
    CHECK_STR(
        json_string_value(json_array_get(
            json_object_get(
                json_object_get(json_object_get(json_array_get(ts, 1), "function"), "parameters"),
                "required"),
            0)),
        "path");
    m = json_object_get(o, "messages");
    CHECK(json_array_size(m) == 5); /* system, user, assistant, tool, user */
    CHECK_STR(json_string_value(json_object_get(json_array_get(m, 3), "role")), "tool");
    json_decref(o);

    struct llm_response r;
    struct cf_error err;
    llm_response_init(&r);
    const char *body = "{\"content\":[{\"type\":\"text\",\"text\":\"done\"}],\"stop_reason\":"
                       "\"end_turn\",\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}";
    CHECK(anthropic_parse_body(body, strlen(body), &r, &err) == CF_OK);
    CHECK_STR(buf_cstr(&r.text), "done");
    CHECK(anthropic_parse_body("<html>", 6, &r, &err) == CF_INVALID);
    CHECK(openai_parse_body("{}", 2, &r, &err) == CF_INVALID);
    llm_response_cleanup(&r);
}

/* A tool result with images: Anthropic carries them in the tool_result's content array after a
 * text block (a result without images keeps a string content); OpenAI keeps the tool messages
 * together after the assistant message (text only) and shows the turn's images in one user
 * message after them. */
static void test_build_result_images(void)
{
    struct llm_call calls[] = {{"call_1", "mcp__ev__get-tiny-image", "{}"},
                               {"call_2", "bash", "{}"},
                               {"call_3", "shot", "{}"}};
    struct llm_image png = {"image/png", "iVBORw=="},
                     gifs[] = {{"image/gif", "R0lG"}, {"image/webp", "UklG"}};
    struct llm_message msgs[] = {
        {.role = LLM_USER, .text = "hi"},
        {.role = LLM_ASSISTANT, .text = "", .calls = calls, .n_calls = 3},
        {.role = LLM_TOOL_RESULT,
         .text = "[image-1 (image/png, 4 bytes) is shown after this text]",
         .images = &png,
         .n_images = 1,
         .tool_call_id = "call_1",
         .tool_name = "mcp__ev__get-tiny-image"},
        {.role = LLM_TOOL_RESULT, .text = "ok", .tool_call_id = "call_2", .tool_name = "bash"},
        {.role = LLM_TOOL_RESULT,
         .text = "two",
         .images = gifs,
         .n_images = 2,
         .tool_call_id = "call_3",
         .tool_name = "shot"},
        {.role = LLM_USER, .text = "next"},
    };
    struct llm_request req = {
        .provider = "anthropic", .model = "m", .messages = msgs, .n_messages = 6, .max_tokens = 9};
    json_t *a = parsed(anthropic_build(&req, NULL));
    json_t *m = json_object_get(a, "messages");
    CHECK(json_array_size(m) == 3);
    json_t *user = json_object_get(json_array_get(m, 2), "content");
    CHECK(json_array_size(user) == 4); /* three results, then the user's text */
    json_t *r0 = json_array_get(user, 0);
    CHECK_STR(json_string_value(json_object_get(r0, "type")), "tool_result");
    CHECK_STR(json_string_value(json_object_get(r0, "tool_use_id")), "call_1");
    json_t *content = json_object_get(r0, "content");
    CHECK(json_is_array(content) && json_array_size(content) == 2);
    CHECK_STR(json_string_value(json_object_get(json_array_get(content, 0), "type")), "text");
    CHECK_STR(json_string_value(json_object_get(json_array_get(content, 0), "text")),
              "[image-1 (image/png, 4 bytes) is shown after this text]");
    json_t *img = json_array_get(content, 1);
    CHECK_STR(json_string_value(json_object_get(img, "type")), "image");
    json_t *src = json_object_get(img, "source");
    CHECK_STR(json_string_value(json_object_get(src, "type")), "base64");
    CHECK_STR(json_string_value(json_object_get(src, "media_type")), "image/png");
    CHECK_STR(json_string_value(json_object_get(src, "data")), "iVBORw==");
    CHECK_STR(json_string_value(json_object_get(json_array_get(user, 1), "content")), "ok");
    content = json_object_get(json_array_get(user, 2), "content");
    CHECK(json_array_size(content) == 3);
    CHECK_STR(json_string_value(
                  json_object_get(json_object_get(json_array_get(content, 2), "source"), "data")),
              "UklG");
    CHECK_STR(json_string_value(json_object_get(json_array_get(user, 3), "text")), "next");
    json_decref(a);

    req.provider = "openai";
    json_t *o = parsed(openai_build(&req, NULL));
    m = json_object_get(o, "messages");
    CHECK(json_array_size(m) == 7); /* user, assistant, tool x3, the images, user */
    for (size_t i = 2; i < 5; i++) {
        json_t *t = json_array_get(m, i);
        CHECK_STR(json_string_value(json_object_get(t, "role")), "tool");
        CHECK(json_is_string(json_object_get(t, "content")));
    }
    CHECK_STR(json_string_value(json_object_get(json_array_get(m, 2), "content")),
              "[image-1 (image/png, 4 bytes) is shown after this text]");
    json_t *shown = json_array_get(m, 5);
    CHECK_STR(json_string_value(json_object_get(shown, "role")), "user");
    json_t *parts = json_object_get(shown, "content");
    CHECK(json_array_size(parts) == 6);
    CHECK_STR(json_string_value(json_object_get(json_array_get(parts, 0), "text")),
              "Images returned by the tool calls above:");
    CHECK_STR(json_string_value(json_object_get(json_array_get(parts, 1), "text")),
              "From mcp__ev__get-tiny-image (call call_1):");
    CHECK_STR(json_string_value(
                  json_object_get(json_object_get(json_array_get(parts, 2), "image_url"), "url")),
              "data:image/png;base64,iVBORw==");
    CHECK_STR(json_string_value(json_object_get(json_array_get(parts, 3), "text")),
              "From shot (call call_3):");
    CHECK_STR(json_string_value(json_object_get(json_array_get(parts, 4), "type")), "image_url");
    CHECK_STR(json_string_value(
                  json_object_get(json_object_get(json_array_get(parts, 5), "image_url"), "url")),
              "data:image/webp;base64,UklG");
    CHECK_STR(json_string_value(json_object_get(json_array_get(m, 6), "content")), "next");
    json_decref(o);

    /* no images in the turn: no extra message */
    msgs[2].n_images = msgs[4].n_images = 0;
    o = parsed(openai_build(&req, NULL));
    CHECK(json_array_size(json_object_get(o, "messages")) == 6);
    json_decref(o);
    /* the results end the request: the images come last */
    msgs[4].n_images = 2;
    req.n_messages = 5;
    o = parsed(openai_build(&req, NULL));
    m = json_object_get(o, "messages");
    CHECK(json_array_size(m) == 6);
    CHECK_STR(json_string_value(json_object_get(json_array_get(m, 5), "role")), "user");
    json_decref(o);
}

/* page packs records into a ReadResponse the way storaged's answer arrives (heap, unpacked). */
static Cflue__V1__ReadResponse *page(Cflue__V1__Record **recs, size_t n)
{
    Cflue__V1__ReadResponse rr = CFLUE__V1__READ_RESPONSE__INIT;
    rr.records = recs;
    rr.n_records = n;
    size_t len = cflue__v1__read_response__get_packed_size(&rr);
    uint8_t *bytes = malloc(len + 1);
    cflue__v1__read_response__pack(&rr, bytes);
    Cflue__V1__ReadResponse *out = cflue__v1__read_response__unpack(NULL, len, bytes);
    free(bytes);
    return out;
}

/* The record log: read pages and acknowledged appends in offset order, each record once;
 * lookups by id and body; trimming keeps what the context and recovery need. */
static void test_record_log(void)
{
    Cflue__V1__UserMessage um = CFLUE__V1__USER_MESSAGE__INIT;
    Cflue__V1__AssistantDelta ad = CFLUE__V1__ASSISTANT_DELTA__INIT;
    Cflue__V1__Compaction cp = CFLUE__V1__COMPACTION__INIT;
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    Cflue__V1__Record r[6];
    Cflue__V1__Record *ptrs[6];
    static const char *const ids[] = {"input:old", "system:1",        "delta:x",
                                      "input:me",  "compaction:me:1", "system:2"};
    static const char *const subs[] = {"old", "", "old", "me", "me", ""};
    for (int i = 0; i < 6; i++) {
        cflue__v1__record__init(&r[i]);
        r[i].offset = i;
        r[i].id = (char *)ids[i];
        r[i].submission_id = (char *)subs[i];
        ptrs[i] = &r[i];
    }
    um.text = "hi";
    r[0].body_case = r[3].body_case = CFLUE__V1__RECORD__BODY_USER_MESSAGE;
    r[0].user_message = r[3].user_message = &um;
    r[1].body_case = r[5].body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
    r[1].system_prompt = r[5].system_prompt = &sp;
    r[2].body_case = CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA;
    r[2].assistant_delta = &ad;
    cp.first_kept_offset = 3;
    r[4].body_case = CFLUE__V1__RECORD__BODY_COMPACTION;
    r[4].compaction = &cp;

    struct record_log log;
    rlog_init(&log);
    CHECK(log.last_offset == -1 && rlog_find(&log, "input:me") == NULL);
    rlog_add_page(&log, page(ptrs, 3));
    rlog_add_page(&log, page(ptrs + 2, 2)); /* offset 2 again: skipped */
    CHECK(log.n == 4 && log.last_offset == 3);
    /* an acknowledged append: a copy at storaged's offset */
    rlog_add_pending(&log, &r[4]);
    rlog_add_pending(&log, &r[4]); /* written twice: once */
    rlog_ack_pending(&log, log.n_pending, 4);
    rlog_add_pending(&log, &r[4]); /* already stored: not again */
    r[5].offset = 99;              /* the offset that counts is storaged's */
    rlog_add_pending(&log, &r[5]);
    rlog_ack_pending(&log, log.n_pending, 5);
    CHECK(log.n == 6 && log.last_offset == 5 && log.compactions == 1);
    CHECK(rlog_find(&log, "system:2") != NULL && rlog_find(&log, "system:2")->offset == 5);
    CHECK(rlog_find(&log, "system:2") != &r[5]);
    CHECK(rlog_latest(&log, CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT)->offset == 5);
    CHECK(rlog_latest(&log, CFLUE__V1__RECORD__BODY_SIGNAL) == NULL);
    for (size_t i = 1; i < log.n; i++) {
        CHECK(log.recs[i - 1]->offset < log.recs[i]->offset);
    }
    /* trim: before the cut (3) and before "me"'s first record only the newest compaction and
     * system prompt stay; deltas go; the compaction count stays */
    rlog_trim(&log, "me");
    CHECK(log.n == 3);
    CHECK(rlog_find(&log, "input:old") == NULL && rlog_find(&log, "system:1") == NULL);
    CHECK(rlog_find(&log, "delta:x") == NULL && rlog_find(&log, "input:me") != NULL);
    CHECK(log.compactions == 1);
    rlog_trim(&log, "me"); /* idempotent */
    CHECK(log.n == 3);
    /* an own record before the cut is kept, and so is everything after it */
    rlog_cleanup(&log);
    rlog_add_page(&log, page(ptrs, 6));
    rlog_trim(&log, "old");
    CHECK(log.n == 5 && rlog_find(&log, "input:old") != NULL && !rlog_find(&log, "delta:x"));
    rlog_cleanup(&log);
    /* trimmed after each page (as a drive reads a long history): the same log as one trim
     * after the last page, for each submission */
    static const char *const owners[] = {"me", "old"};
    for (int k = 0; k < 2; k++) {
        struct record_log whole;
        rlog_init(&whole);
        rlog_add_page(&whole, page(ptrs, 6));
        rlog_trim(&whole, owners[k]);
        for (int at = 0; at < 6; at += 2) {
            rlog_add_page(&log, page(ptrs + at, 2));
            rlog_trim(&log, owners[k]);
        }
        CHECK(log.n == whole.n);
        for (size_t i = 0; i < log.n && i < whole.n; i++) {
            CHECK(log.recs[i]->offset == whole.recs[i]->offset);
        }
        rlog_cleanup(&whole);
        rlog_cleanup(&log);
    }
    rlog_cleanup(&log);
    CHECK(log.n == 0);
}

/* Pending records: seen by lookups at the end of the log before they are stored, carried in
 * order, then given storaged's offsets (ack) or removed (drop) without touching the rest. */
static void test_record_log_pending(void)
{
    Cflue__V1__UserMessage um = CFLUE__V1__USER_MESSAGE__INIT;
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    Cflue__V1__Compaction cp = CFLUE__V1__COMPACTION__INIT;
    Cflue__V1__Record r[4], *ptrs[1];
    static const char *const ids[] = {"input:old", "input:me", "system:1", "compaction:me:1"};
    for (int i = 0; i < 4; i++) {
        cflue__v1__record__init(&r[i]);
        r[i].id = (char *)ids[i];
        r[i].submission_id = "me";
    }
    um.text = "hi";
    r[0].body_case = r[1].body_case = CFLUE__V1__RECORD__BODY_USER_MESSAGE;
    r[0].user_message = r[1].user_message = &um;
    r[2].body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
    r[2].system_prompt = &sp;
    r[3].body_case = CFLUE__V1__RECORD__BODY_COMPACTION;
    r[3].compaction = &cp;
    r[0].offset = 0;
    ptrs[0] = &r[0];

    struct record_log log;
    size_t n = 7;
    rlog_init(&log);
    rlog_add_page(&log, page(ptrs, 1));
    CHECK(rlog_pending(&log, &n) == NULL && n == 0);
    rlog_add_pending(&log, &r[1]);
    rlog_add_pending(&log, &r[2]);
    rlog_add_pending(&log, &r[2]); /* the same id twice: once */
    Cflue__V1__Record **p = rlog_pending(&log, &n);
    CHECK(n == 2 && log.n == 3 && p && !strcmp(p[0]->id, "input:me") && p[0] != &r[1]);
    CHECK(!strcmp(p[1]->id, "system:1") && p[1]->offset == -1);
    CHECK(rlog_find(&log, "system:1") == p[1] && log.last_offset == 0);
    CHECK(rlog_latest(&log, CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT) == p[1]);
    size_t both = log.pending_bytes;
    /* an Append carried the first one while the second was added: only it is acknowledged */
    rlog_ack_pending(&log, 1, 7);
    p = rlog_pending(&log, &n);
    CHECK(n == 1 && log.n == 3 && p && !strcmp(p[0]->id, "system:1") && p[0]->offset == -1);
    CHECK(log.last_offset == 7 && log.pending_bytes > 0 && log.pending_bytes < both);
    CHECK(rlog_find(&log, "input:me")->offset == 7);
    rlog_ack_pending(&log, 1, 8);
    CHECK(rlog_pending(&log, &n) == NULL && n == 0 && log.n == 3 && log.last_offset == 8);
    CHECK(log.pending_bytes == 0);
    CHECK(rlog_find(&log, "input:me")->offset == 7 && rlog_find(&log, "system:1")->offset == 8);
    /* a write that failed: its records leave; what was stored stays */
    rlog_add_pending(&log, &r[3]);
    CHECK(log.n == 4 && log.compactions == 0); /* counted once stored */
    rlog_drop_pending(&log);
    CHECK(log.n == 3 && rlog_find(&log, "compaction:me:1") == NULL && log.compactions == 0);
    rlog_add_pending(&log, &r[3]);
    rlog_ack_pending(&log, log.n_pending, 9);
    CHECK(log.compactions == 1 &&
          rlog_latest(&log, CFLUE__V1__RECORD__BODY_COMPACTION)->offset == 9);
    rlog_drop_pending(&log); /* nothing pending: nothing happens */
    CHECK(log.n == 4);
    rlog_cleanup(&log);
}

/* A submission settled here is remembered (a wait is answered at once) until
 * here_forget_older forgets it; then a wait takes the storaged path. */
static void test_settled_here_forgets(void)
{
    Cflue__V1__Submission sub = CFLUE__V1__SUBMISSION__INIT;
    sub.submission_id = "sub_forget";
    sub.status = CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED;
    here_begin("sub_forget");
    here_settled(&sub, NULL, 0);
    here_end("sub_forget");
    int remembered, waiters;
    here_counts(&remembered, &waiters);
    CHECK(remembered == 1 && waiters == 0);
    struct here_waiter hw;
    Cflue__V1__Submission *got = NULL;
    memset(&hw, 0, sizeof(hw));
    CHECK(here_wait(&hw, NULL, "sub_forget", &got) == HERE_SETTLED);
    CHECK(got && !strcmp(got->submission_id, "sub_forget"));
    protobuf_c_message_free_unpacked(&got->base, NULL);
    int64_t now = clock_mono_ms();
    here_forget_older(now + 30000, 60000); /* remembered 30 s ago: kept */
    here_counts(&remembered, &waiters);
    CHECK(remembered == 1);
    here_forget_older(now + 61000, 60000);
    here_counts(&remembered, &waiters);
    CHECK(remembered == 0);
    memset(&hw, 0, sizeof(hw));
    got = NULL;
    CHECK(here_wait(&hw, NULL, "sub_forget", &got) == HERE_ELSEWHERE);
    CHECK(got == NULL);
}

/* Text cut at a byte count may end inside a character: what goes into a record is made valid
 * UTF-8 (storaged refuses anything else), and valid text is passed through as it is. */
static void test_utf8_for_records(void)
{
    struct buf scratch;
    const char *ok = "caf\xc3\xa9";
    CHECK(dstore_utf8(ok, &scratch) == ok);
    buf_cleanup(&scratch);
    const char *cut = dstore_utf8("caf\xc3", &scratch);
    CHECK_STR(cut, "caf\xef\xbf\xbd");
    buf_cleanup(&scratch);
}

struct agentd g_agentd; /* main.c's, which this test does not link: task.c refers to it */

/* The framework's task tool joins after the sandbox's tools; a tool with a reserved name, or
 * one a tool before it has, is refused, naming both sources. */
static void test_task_tools(void)
{
    struct drive d;
    struct agent_def agent = {.name = "a"}; /* no skills: no skill tools */
    memset(&d, 0, sizeof(d));
    d.agent = &agent;
    d.tools_addr = "127.0.0.1:7102";
    toolset_add(&d.tools, "read", "Read.", "{}", d.tools_addr);
    toolset_add(&d.tools, "bash", "Run.", "{}", d.tools_addr);
    CHECK(task_tools_add(&d));
    CHECK(d.tools.n == 3);
    CHECK_STR(d.tools.tools[0].name, "read");
    CHECK_STR(d.tools.tools[2].name, "task");
    CHECK(d.tools.source[2] == NULL && toolset_find(&d.tools, "task") == 2);
    CHECK(task_is_framework("task") && !task_is_framework("bash"));
    json_t *schema = json_loads(d.tools.tools[2].schema_text, 0, NULL);
    json_t *props = json_object_get(schema, "properties");
    CHECK(json_is_object(json_object_get(props, "prompt")));
    CHECK(json_is_object(json_object_get(props, "agent")));
    CHECK(json_array_size(json_object_get(schema, "required")) == 2);
    json_decref(schema);

    /* an own server's tools: a reserved name, a duplicate of the sandbox's, of the framework's */
    char why[512];
    CHECK(!servers_clash(&d.tools, "lookup", "10.0.0.9:7200", d.tools_addr, why, sizeof(why)));
    CHECK(servers_clash(&d.tools, "give_up", "10.0.0.9:7200", d.tools_addr, why, sizeof(why)));
    CHECK_STR(why, "tool name \"give_up\" is reserved by the framework, but the tool server at "
                   "10.0.0.9:7200 offers a tool by that name; rename that tool");
    CHECK(servers_clash(&d.tools, "bash", "10.0.0.9:7200", d.tools_addr, why, sizeof(why)));
    CHECK_STR(why, "duplicate tool name \"bash\": offered by the sandbox's toold at "
                   "127.0.0.1:7102 and by the tool server at 10.0.0.9:7200; rename one of them");
    CHECK(servers_clash(&d.tools, "task", NULL, d.tools_addr, why, sizeof(why)));
    CHECK(strstr(why, "offered by the framework and by the framework") != NULL);
    tools_cleanup(&d);

    memset(&d, 0, sizeof(d));
    d.agent = &agent;
    d.tools_addr = "10.0.0.9:7200";
    toolset_add(&d.tools, "activate_skill", "Mine.", "{}", d.tools_addr);
    CHECK(!task_tools_add(&d));
    CHECK(d.tools.n == 1);
    CHECK(strstr(d.error, "\"activate_skill\" is reserved") != NULL);
    CHECK(strstr(d.error, "the sandbox's toold at 10.0.0.9:7200") != NULL);
    tools_cleanup(&d);

    memset(&d, 0, sizeof(d));
    d.agent = &agent;
    d.tools_addr = "10.0.0.9:7200";
    toolset_add(&d.tools, "read", "Read.", "{}", d.tools_addr);
    toolset_add(&d.tools, "read", "Read again.", "{}", d.tools_addr);
    CHECK(!task_tools_add(&d));
    CHECK(strstr(d.error, "duplicate tool name \"read\"") != NULL);
    tools_cleanup(&d);
}

int main(void)
{
    test_agents();
    test_agents_page();
    test_metadata();
    test_sse();
    test_anthropic_stream();
    test_streamed_answer_bound();
    test_openai_stream();
    test_streams_with_many_calls();
    test_schema_text();
    test_build();
    test_build_result_images();
    test_record_log();
    test_record_log_pending();
    test_settled_here_forgets();
    test_task_tools();
    test_utf8_for_records();
    return check_done("test_agentd");
}
