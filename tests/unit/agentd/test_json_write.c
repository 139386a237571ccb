/* test_json_write.c - the request bodies' JSON writer (agentd/json_write.c): what it writes is
 * read back with jansson, byte strings of every kind included. */
#include "../check.h"

#include "buf.h"
#include "json_write.h"
#include "utf8.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* read_back parses the writer's text (taking it); NULL when it was not JSON. */
static json_t *read_back(struct jw *w)
{
    size_t len = 0;
    char *text = jw_take(w, &len);
    json_t *j = text ? json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL) : NULL;
    CHECK(!text || strlen(text) == len);
    free(text);
    return j;
}

/* written is string s[0..n) as the writer writes it, read back; the caller frees it. */
static char *written(const char *s, size_t n, size_t *len_out)
{
    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_stringn(&w, s, n);
    json_t *j = read_back(&w);
    char *out = NULL;
    if (json_is_string(j)) {
        *len_out = json_string_length(j);
        out = malloc(*len_out + 1);
        memcpy(out, json_string_value(j), *len_out + 1);
    }
    json_decref(j);
    return out;
}

/* Structure: members, nesting, every kind of value, commas and colons where they belong. */
static void test_structure(void)
{
    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_object(&w);
    jw_key_string(&w, "model", "m");
    jw_key(&w, "n");
    jw_int(&w, -42);
    jw_key(&w, "list");
    jw_array(&w);
    jw_array(&w);
    jw_end(&w);
    jw_object(&w);
    jw_end(&w);
    jw_bool(&w, true);
    jw_bool(&w, false);
    jw_null(&w);
    jw_string(&w, NULL);
    jw_end(&w);
    jw_key(&w, "schema");
    json_t *schema =
        json_pack("{s:s, s:{s:{s:s}}}", "type", "object", "properties", "path", "type", "string");
    jw_json(&w, schema);
    jw_key(&w, "last");
    jw_object(&w);
    jw_key_string(&w, "k", "v");
    jw_end(&w);
    jw_end(&w);
    json_t *j = read_back(&w);
    CHECK(json_is_object(j) && json_object_size(j) == 5);
    CHECK_STR(json_string_value(json_object_get(j, "model")), "m");
    CHECK(json_integer_value(json_object_get(j, "n")) == -42);
    json_t *list = json_object_get(j, "list");
    CHECK(json_array_size(list) == 6);
    CHECK(json_is_array(json_array_get(list, 0)) && json_array_size(json_array_get(list, 0)) == 0);
    CHECK(json_is_object(json_array_get(list, 1)));
    CHECK(json_is_true(json_array_get(list, 2)) && json_is_false(json_array_get(list, 3)));
    CHECK(json_is_null(json_array_get(list, 4)));
    CHECK_STR(json_string_value(json_array_get(list, 5)), "");
    CHECK(json_equal(json_object_get(j, "schema"), schema));
    CHECK_STR(json_string_value(json_object_get(json_object_get(j, "last"), "k")), "v");
    json_decref(schema);
    json_decref(j);
}

/* Escapes: quote, backslash and every control character come back as they went in; slash and
 * DEL need none; well-formed multi-byte characters are copied. */
static void test_escapes(void)
{
    char all[128];
    for (int c = 1; c < 128; c++) {
        all[c - 1] = (char)c;
    }
    size_t len = 0;
    char *out = written(all, 127, &len);
    CHECK(out && len == 127 && memcmp(out, all, 127) == 0);
    free(out);

    const char nul[] = "a\0b";
    out = written(nul, 3, &len);
    CHECK(out && len == 3 && memcmp(out, nul, 3) == 0);
    free(out);

    const char *wide = "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80 \xef\xbf\xbf";
    out = written(wide, strlen(wide), &len);
    CHECK_STR(out, wide);
    free(out);

    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_string(&w, "q\"b\\n\n/");
    char *text = jw_take(&w, NULL);
    CHECK_STR(text, "\"q\\\"b\\\\n\\n/\"");
    free(text);
}

/* Bytes that are not well-formed UTF-8 (stray continuation bytes, overlongs, surrogates, past
 * U+10FFFF, cut-off sequences) each become U+FFFD, as utf8_sanitize writes them, and the text
 * stays JSON: checked on fixed cases and on random byte strings. */
static void test_bad_utf8(void)
{
    const char *cases[] = {"\x80",     "a\xc0\xaf", "\xed\xa0\x80z", "\xf4\x90\x80\x80",
                           "\xe2\x82", "\xff\xfe",  "ok\xf0\x9f\x98"};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct buf want;
        buf_init(&want, SIZE_MAX);
        CHECK(utf8_sanitize(&want, cases[i], strlen(cases[i])) == CF_OK);
        size_t len = 0;
        char *out = written(cases[i], strlen(cases[i]), &len);
        CHECK_STR(out, buf_cstr(&want));
        free(out);
        buf_cleanup(&want);
    }
    uint32_t seed = 12345;
    for (int round = 0; round < 2000; round++) {
        char s[64];
        size_t n = (size_t)(round % 64);
        for (size_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            s[i] = (char)(seed >> 16);
            /* NUL is well-formed UTF-8, written as \u0000; utf8_sanitize replaces it (its text
             * is a protobuf-c string): not a byte the two are compared on */
            s[i] = s[i] ? s[i] : 1;
        }
        struct buf want;
        buf_init(&want, SIZE_MAX);
        CHECK(utf8_sanitize(&want, s, n) == CF_OK);
        size_t len = 0;
        char *out = written(s, n, &len);
        CHECK(out && len == want.len && memcmp(out, buf_cstr(&want), len) == 0);
        free(out);
        buf_cleanup(&want);
    }
}

/* Misuse and limits give no text: a container left open, a key without its value, a close too
 * many, nesting past JW_DEPTH_MAX, a text past the writer's cap, nothing written at all. */
static void test_failures(void)
{
    struct jw w;
    jw_init(&w, SIZE_MAX);
    jw_object(&w);
    CHECK(jw_take(&w, NULL) == NULL);

    jw_init(&w, SIZE_MAX);
    jw_object(&w);
    jw_key(&w, "k");
    jw_end(&w);
    CHECK(jw_take(&w, NULL) == NULL);

    jw_init(&w, SIZE_MAX);
    jw_array(&w);
    jw_end(&w);
    jw_end(&w);
    CHECK(jw_take(&w, NULL) == NULL);

    jw_init(&w, SIZE_MAX);
    for (int i = 0; i < JW_DEPTH_MAX; i++) {
        jw_array(&w);
    }
    for (int i = 0; i < JW_DEPTH_MAX; i++) {
        jw_end(&w);
    }
    char *text = jw_take(&w, NULL);
    CHECK(text && strlen(text) == 2 * JW_DEPTH_MAX); /* as deep as allowed */
    free(text);
    jw_init(&w, SIZE_MAX);
    for (int i = 0; i <= JW_DEPTH_MAX; i++) {
        jw_array(&w);
    }
    for (int i = 0; i <= JW_DEPTH_MAX; i++) {
        jw_end(&w);
    }
    CHECK(jw_take(&w, NULL) == NULL);

    jw_init(&w, 16);
    jw_string(&w, "fourteen chars");
    text = jw_take(&w, NULL);
    CHECK_STR(text, "\"fourteen chars\"");
    free(text);
    jw_init(&w, 16);
    jw_string(&w, "fifteen chars..");
    CHECK(jw_take(&w, NULL) == NULL);

    jw_init(&w, SIZE_MAX);
    CHECK(jw_take(&w, NULL) == NULL);
    jw_init(&w, SIZE_MAX);
    jw_string(&w, "dropped");
    jw_cleanup(&w);
}

int main(void)
{
    test_structure();
    test_escapes();
    test_bad_utf8();
    test_failures();
    return check_done("test_json_write");
}
