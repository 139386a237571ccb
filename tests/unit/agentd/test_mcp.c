/* Unit tests of agentd/mcp.c's result mapping (what the model reads of a tools/call result)
 * and of agents.c's mcp: definitions. The protocol itself is tested against real servers in
 * tests/integration/test_agentd_mcp.py. */
#include "../check.h"

#include "agents.h"
#include "mcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* text_of maps the result JSON `json`; *is_error gets isError. */
static char *text_of(const char *json, bool *is_error)
{
    json_t *r = json_loads(json, 0, NULL);
    struct buf out;
    buf_init(&out, MCP_TEXT_MAX + 512);
    mcp_result_text(r, &out, is_error);
    json_decref(r);
    char *t = buf_take(&out);
    buf_cleanup(&out);
    return t ? t : calloc(1, 1);
}

static void test_result_text(void)
{
    bool err;
    char *t = text_of("{\"content\":[{\"type\":\"text\",\"text\":\"one\"},{\"type\":\"text\","
                      "\"text\":\"two\"}]}",
                      &err);
    CHECK_STR(t, "one\ntwo");
    CHECK(!err);
    free(t);
    t = text_of("{\"isError\":true,\"content\":[{\"type\":\"text\",\"text\":\"bad\"}]}", &err);
    CHECK(err && !strcmp(t, "bad"));
    free(t);
    /* images and audio are described (their size from the base64), never pasted */
    t = text_of("{\"content\":[{\"type\":\"image\",\"mimeType\":\"image/png\",\"data\":"
                "\"AAAAAAAA\"},{\"type\":\"audio\",\"data\":\"AAAA\"}]}",
                &err);
    CHECK_STR(t, "[image content: image/png, about 6 bytes; it cannot be shown here]\n"
                 "[audio content: of no stated type, about 3 bytes; it cannot be shown here]");
    free(t);
    t = text_of("{\"content\":[{\"type\":\"resource\",\"resource\":{\"uri\":\"file:///a\","
                "\"text\":\"A\"}},{\"type\":\"resource\",\"resource\":{\"uri\":\"file:///b\","
                "\"blob\":\"AA==\"}},{\"type\":\"resource_link\",\"uri\":\"file:///c\",\"name\":"
                "\"c\"},{\"type\":\"hologram\"}]}",
                &err);
    CHECK_STR(t, "[resource file:///a]\nA\n[resource file:///b: binary content; it cannot be "
                 "shown here]\n[resource link: file:///c c]\n[content of type \"hologram\"; it "
                 "cannot be shown here]");
    free(t);
    /* no content: the structured content; neither: said so */
    t = text_of("{\"content\":[],\"structuredContent\":{\"sum\":5}}", &err);
    CHECK_STR(t, "{\"sum\":5}");
    free(t);
    t = text_of("{}", &err);
    CHECK_STR(t, "(the tool returned no content)");
    free(t);
    /* past MCP_TEXT_MAX: cut at a character boundary, with a note */
    size_t n = MCP_TEXT_MAX + 100;
    char *big = malloc(n * 2 + 64);
    strcpy(big, "{\"content\":[{\"type\":\"text\",\"text\":\"");
    char *p = big + strlen(big);
    for (size_t i = 0; i < n / 2; i++) {
        memcpy(p, "\xc3\xa9", 2); /* é: two bytes */
        p += 2;
    }
    strcpy(p, "\"}]}");
    t = text_of(big, &err);
    CHECK(strlen(t) < MCP_TEXT_MAX + 200);
    CHECK(strstr(t, "[cut: the result has 51300 bytes; only the first 51200 are shown]") != NULL);
    CHECK(!memcmp(t + MCP_TEXT_MAX, "\n[cut", 5));
    free(t);
    free(big);
}

static void test_definitions(void)
{
    struct agent_def a;
    struct cf_error e;
    setenv("CFLUE_TEST_MCP_TOKEN", "s3cret", 1);
    CHECK(agents_parse("---\nmodel: openai/gpt\nmcp:\n  docs: {url: \"https://x/mcp\", headers: "
                       "{Authorization: \"Bearer ${CFLUE_TEST_MCP_TOKEN}\", X-Team: a}}\n  "
                       "local: {url: \"http://127.0.0.1:1/mcp\"}\n---\n",
                       "x", "x.md", &a, &e) == CF_OK);
    CHECK(a.n_mcp == 2);
    CHECK_STR(a.mcp[0].name, "docs");
    CHECK_STR(a.mcp[0].source, "mcp:docs");
    CHECK(a.mcp[0].n_headers == 2);
    CHECK_STR(a.mcp[0].headers[0], "Authorization: Bearer s3cret");
    CHECK_STR(a.mcp[0].headers[1], "X-Team: a");
    CHECK_STR(a.mcp[1].url, "http://127.0.0.1:1/mcp");
    agents_free_one(&a);
    const struct {
        const char *mcp, *want;
    } bad[] = {
        {"  d: {url: \"http://x\", headers: {A: \"${CFLUE_TEST_NOT_SET}\"}}",
         "x.md: mcp.d.headers.A: environment variable CFLUE_TEST_NOT_SET is not set"},
        {"  d: {url: \"ftp://x\"}", "x.md: mcp.d.url: required, an http:// or https:// URL"},
        {"  d: {headers: {}}", "x.md: mcp.d.url: required"},
        {"  a__b: {url: \"http://x\"}", "x.md: mcp.a__b: a server name is 1 to 32"},
        {"  d: {url: \"http://x\", headers: {\"Bad Name\": v}}", "not a header name"},
        {"  d: {url: \"http://x\", extra: 1}", "x.md: mcp.d: unknown field 'extra'"},
        {"  - d", "x.md: mcp: expected a mapping of at most 8"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++) {
        char def[512];
        snprintf(def, sizeof(def), "---\nmodel: openai/gpt\nmcp:\n%s\n---\n", bad[i].mcp);
        CHECK(agents_parse(def, "x", "x.md", &a, &e) == CF_INVALID);
        CHECK(strstr(e.msg, bad[i].want) != NULL);
    }
}

int main(void)
{
    test_result_text();
    test_definitions();
    return check_done("test_mcp");
}
