/* Unit tests of agentd/mcp.c's result mapping (what the model reads of a tools/call result)
 * and of agents.c's mcp: definitions. The protocol itself is tested against real servers in
 * tests/integration/test_agentd_mcp.py. */
#include "../check.h"

#include "agents.h"
#include "mcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* read_result maps the result JSON `json` into out (the caller cleans it up). */
static void read_result(struct mcp_result *out, const char *json)
{
    json_t *r = json_loads(json, 0, NULL);
    mcp_result_init(out);
    mcp_result_read(out, r);
    json_decref(r);
}

/* text_of maps the result JSON `json`; *is_error gets isError. */
static char *text_of(const char *json, bool *is_error)
{
    struct mcp_result r;
    read_result(&r, json);
    *is_error = r.is_error;
    char *t = buf_take(&r.text);
    mcp_result_cleanup(&r);
    return t;
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
    /* audio is described (its size from the base64), never pasted */
    t = text_of("{\"content\":[{\"type\":\"audio\",\"data\":\"AAAA\"}]}", &err);
    CHECK_STR(t, "[audio content: of no stated type, about 3 bytes; it cannot be shown here]");
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

/* Image content: a supported type with valid base64 becomes an image of the result (decoded,
 * named image-<n>, its type as image.h spells it) with a line in the text; an unsupported
 * type, bad base64, no data, or one past the count or size bounds stays a line saying why. */
static void test_result_images(void)
{
    struct mcp_result r;
    read_result(&r, "{\"content\":[{\"type\":\"text\",\"text\":\"Here:\"},{\"type\":\"image\","
                    "\"mimeType\":\"image/png\",\"data\":\"iVBORw0K\"},{\"type\":\"image\","
                    "\"mimeType\":\"IMAGE/JPEG\",\"data\":\"YWJj\"},{\"type\":\"text\",\"text\":"
                    "\"done\"}]}");
    CHECK_STR(buf_cstr(&r.text), "Here:\n[image-1 (image/png, 6 bytes) is shown after this text]\n"
                                 "[image-2 (image/jpeg, 3 bytes) is shown after this text]\ndone");
    CHECK(r.n_images == 2 && r.image_bytes == 9);
    CHECK(r.ptrs[0] == &r.images[0] && r.ptrs[1] == &r.images[1]);
    CHECK_STR(r.images[0].name, "image-1");
    CHECK_STR(r.images[0].mime_type, "image/png");
    CHECK(r.images[0].data.len == 6 && !memcmp(r.images[0].data.data, "\x89PNG\r\n", 6));
    CHECK_STR(r.images[1].name, "image-2");
    CHECK_STR(r.images[1].mime_type, "image/jpeg");
    CHECK(r.images[1].data.len == 3 && !memcmp(r.images[1].data.data, "abc", 3));
    mcp_result_cleanup(&r);

    /* unpadded base64 is fine */
    read_result(&r, "{\"content\":[{\"type\":\"image\",\"mimeType\":\"image/gif\",\"data\":"
                    "\"YWI\"}]}");
    CHECK(r.n_images == 1 && r.images[0].data.len == 2);
    mcp_result_cleanup(&r);

    read_result(&r, "{\"content\":[{\"type\":\"image\",\"mimeType\":\"image/svg+xml\",\"data\":"
                    "\"AAAA\"},{\"type\":\"image\",\"mimeType\":\"image/png\",\"data\":"
                    "\"not base64!\"},{\"type\":\"image\",\"mimeType\":\"image/png\",\"data\":"
                    "\"AA=A\"},{\"type\":\"image\",\"mimeType\":\"image/png\"},{\"type\":"
                    "\"image\",\"data\":\"AAAA\"}]}");
    CHECK(r.n_images == 0);
    CHECK_STR(buf_cstr(&r.text),
              "[image content (image/svg+xml, about 3 bytes) that cannot be shown: only PNG, "
              "JPEG, GIF and WebP images can be shown]\n"
              "[image content (image/png, about 6 bytes) that cannot be shown: its data is not "
              "valid base64]\n"
              "[image content (image/png, about 3 bytes) that cannot be shown: its data is not "
              "valid base64]\n"
              "[image content (image/png, about 0 bytes) that cannot be shown: it holds no "
              "data]\n"
              "[image content (of no stated type, about 3 bytes) that cannot be shown: only PNG, "
              "JPEG, GIF and WebP images can be shown]");
    mcp_result_cleanup(&r);

    /* past IMAGE_RESULT_MAX images: the rest are lines */
    struct buf j;
    buf_init(&j, 1 << 20);
    buf_append_str(&j, "{\"content\":[");
    for (int i = 0; i < IMAGE_RESULT_MAX + 2; i++) {
        buf_printf(&j, "%s{\"type\":\"image\",\"mimeType\":\"image/webp\",\"data\":\"AAAA\"}",
                   i ? "," : "");
    }
    buf_append_str(&j, "]}");
    read_result(&r, buf_cstr(&j));
    CHECK(r.n_images == IMAGE_RESULT_MAX);
    CHECK_STR(r.images[IMAGE_RESULT_MAX - 1].name, "image-8");
    CHECK(strstr(buf_cstr(&r.text), "[image-8 (image/webp, 3 bytes) is shown after this text]\n"
                                    "[image content (image/webp, about 3 bytes) that cannot be "
                                    "shown: a tool result can show at most 8 images]\n") != NULL);
    mcp_result_cleanup(&r);

    /* one image past IMAGE_BYTES_MAX, and two that would pass IMAGE_RESULT_BYTES_MAX together */
    size_t big = (size_t)IMAGE_BYTES_MAX / 3 * 4 + 8, four = (size_t)(4 << 20) / 3 * 4;
    buf_reset(&j);
    j.max = 64 << 20;
    buf_append_str(&j, "{\"content\":[{\"type\":\"image\",\"mimeType\":\"image/png\",\"data\":\"");
    for (size_t i = 0; i < big; i++) {
        buf_append(&j, "A", 1);
    }
    for (int k = 0; k < 2; k++) {
        buf_append_str(&j, "\"},{\"type\":\"image\",\"mimeType\":\"image/png\",\"data\":\"");
        for (size_t i = 0; i < four; i++) {
            buf_append(&j, "A", 1);
        }
    }
    buf_append_str(&j, "\"}]}");
    read_result(&r, buf_cstr(&j));
    CHECK(r.n_images == 1 && r.images[0].data.len == four / 4 * 3);
    CHECK(strstr(buf_cstr(&r.text), "that cannot be shown: it is larger than 5 MiB") != NULL);
    CHECK(strstr(buf_cstr(&r.text), "[image-1 (image/png, 4194303 bytes) is shown") != NULL);
    CHECK(strstr(buf_cstr(&r.text), "that cannot be shown: the result's images would pass 6 MiB "
                                    "together]") != NULL);
    mcp_result_cleanup(&r);
    mcp_result_cleanup(&r); /* again: nothing left to free */
    buf_cleanup(&j);
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
    test_result_images();
    test_definitions();
    return check_done("test_mcp");
}
