/* Unit tests of common/: status table, bounded buffers, ids, config, UTF-8, arena, log quoting. */
#include "../check.h"

#include "arena.h"
#include "buf.h"
#include "config.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "status.h"
#include "thread.h"
#include "utf8.h"

#include <stdlib.h>
#include <string.h>

static void test_status(void)
{
    struct cf_error err;
    CHECK_STR(status_name(CF_NOT_FOUND), "NOT_FOUND");
    CHECK(status_grpc_code(CF_STALE) == GRPC_STATUS_FAILED_PRECONDITION);
    CHECK(status_grpc_code(CF_EXISTS) == GRPC_STATUS_ALREADY_EXISTS);
    CHECK(status_grpc_code(CF_RANGE) == GRPC_STATUS_OUT_OF_RANGE);
    CHECK(status_grpc_code(CF_STATUS_COUNT) == GRPC_STATUS_UNKNOWN);
    CHECK(cf_error_set(&err, CF_INVALID, "field %s", "x") == CF_INVALID);
    CHECK_STR(err.msg, "field x");
    CHECK(cf_error_set(NULL, CF_IO, "ignored") == CF_IO);
}

static void test_buf(void)
{
    struct buf b;
    buf_init(&b, 10);
    CHECK_STR(buf_cstr(&b), "");
    CHECK(buf_append_str(&b, "hello") == CF_OK);
    CHECK(buf_printf(&b, "%d", 12345) == CF_OK);
    CHECK(b.len == 10);
    CHECK(buf_append(&b, "x", 1) == CF_TOOBIG);
    CHECK_STR(buf_cstr(&b), "hello12345"); /* unchanged by the refused write */
    CHECK(buf_printf(&b, "%s", "more") == CF_TOOBIG);
    buf_reset(&b);
    CHECK(b.len == 0);
    char big[300];
    memset(big, 'a', sizeof(big) - 1);
    big[299] = '\0';
    b.max = 1000;
    CHECK(buf_printf(&b, "%s", big) == CF_OK);
    CHECK(b.len == 299);
    char *taken = buf_take(&b);
    CHECK(strlen(taken) == 299);
    CHECK(b.data == NULL);
    free(taken);
    buf_cleanup(&b);
}

static void test_ids(void)
{
    char a[IDS_MAX], b[IDS_MAX];
    ids_new(a, "sub");
    ids_new(b, "sub");
    CHECK(strncmp(a, "sub_", 4) == 0);
    CHECK(strlen(a) == 4 + 26);
    CHECK(strcmp(a, b) != 0);
    CHECK(strspn(a + 4, "0123456789ABCDEFGHJKMNPQRSTVWXYZ") == 26);
    CHECK(ids_valid_name("conv_01.x-y", 128));
    CHECK(!ids_valid_name("", 128));
    CHECK(!ids_valid_name("..", 128));
    CHECK(!ids_valid_name(".", 128));
    CHECK(!ids_valid_name("a/b", 128));
    CHECK(!ids_valid_name("abc", 2));
}

static void test_config(void)
{
    const char *s = "default";
    long long n = 5;
    bool flag = false, help;
    struct cf_error err;
    struct config_opt opts[] = {
        {"name", CONFIG_STRING, &s, 0, 0, "a name"},
        {"count-max", CONFIG_INT, &n, 1, 10, "a number"},
        {"flag", CONFIG_BOOL, &flag, 0, 0, "a flag"},
    };
    char *argv1[] = {"x", "--name", "n1", "--count-max=7", "--flag", NULL};
    CHECK(config_parse(opts, 3, 5, argv1, "u", &help, &err) == CF_OK);
    CHECK_STR(s, "n1");
    CHECK(n == 7 && flag && !help);
    setenv("CFLUE_COUNT_MAX", "3", 1);
    char *argv2[] = {"x", NULL};
    CHECK(config_parse(opts, 3, 1, argv2, "u", &help, &err) == CF_OK);
    CHECK(n == 3);
    char *argv3[] = {"x", "--count-max", "11", NULL};
    CHECK(config_parse(opts, 3, 3, argv3, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "--count-max") != NULL);
    char *argv4[] = {"x", "--nope", NULL};
    CHECK(config_parse(opts, 3, 2, argv4, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "unknown flag") != NULL);
    setenv("CFLUE_COUNT_MAX", "abc", 1);
    CHECK(config_parse(opts, 3, 1, argv2, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "CFLUE_COUNT_MAX") != NULL);
    unsetenv("CFLUE_COUNT_MAX");
    char *argv5[] = {"x", "--name", NULL};
    CHECK(config_parse(opts, 3, 2, argv5, "u", &help, &err) == CF_INVALID);
}

static void test_utf8(void)
{
    size_t bad;
    CHECK(utf8_valid("plain", 5, NULL));
    CHECK(utf8_valid("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9, NULL));
    CHECK(!utf8_valid("ab\xc3", 3, &bad) && bad == 2);        /* truncated */
    CHECK(!utf8_valid("\xc0\xaf", 2, &bad) && bad == 0);      /* overlong */
    CHECK(!utf8_valid("x\xed\xa0\x80", 4, &bad) && bad == 1); /* surrogate */
    CHECK(!utf8_valid("\xf4\x90\x80\x80", 4, NULL));          /* > U+10FFFF */
    CHECK(!utf8_valid("\xff", 1, NULL));
}

static void test_arena(void)
{
    struct arena a;
    arena_init(&a);
    char *s = arena_strdup(&a, "abc");
    CHECK_STR(s, "abc");
    void *big = arena_alloc(&a, 100000);
    CHECK(big != NULL);
    for (int i = 0; i < 1000; i++) {
        char *t = arena_alloc(&a, 33);
        CHECK(((uintptr_t)t % _Alignof(max_align_t)) == 0);
        t[32] = 1;
    }
    CHECK_STR(s, "abc");
    arena_cleanup(&a);
}

static void test_log_quote(void)
{
    char out[32];
    CHECK_STR(log_quote(out, sizeof(out), "a \"b\"\n"), "\"a \\\"b\\\"\\n\"");
    CHECK_STR(log_quote(out, 8, "abcdefghij"), "\"abcde\"");
}

static void *count_up(void *arg)
{
    int *n = arg;
    (*n)++;
    return NULL;
}

static void *random_of_thread(void *arg)
{
    *(uint64_t *)arg = thread_random();
    return NULL;
}

static void test_thread(void)
{
    struct cf_error err;
    pthread_t t;
    int n = 0;
    CHECK(thread_start(&t, 0, count_up, &n, &err) == CF_OK);
    pthread_join(t, NULL);
    CHECK(n == 1);
    /* a stack size the system refuses is a status, not a crash or a silent default */
    CHECK(thread_start(&t, 1, count_up, &n, &err) == CF_BUSY);
    CHECK(strstr(err.msg, "could not start a thread") != NULL);
    CHECK(n == 1);
    /* each thread has its own seeded sequence: two threads do not draw the same value */
    uint64_t a = 0, b = 0;
    pthread_t ta, tb;
    CHECK(thread_start(&ta, 0, random_of_thread, &a, &err) == CF_OK);
    CHECK(thread_start(&tb, 0, random_of_thread, &b, &err) == CF_OK);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK(a != b);
    for (int i = 0; i < 1000; i++) {
        int64_t j = thread_jitter_ms(250);
        CHECK(j >= 0 && j < 250);
    }
    CHECK(thread_jitter_ms(0) == 0);
    char *s = mem_asprintf("%s-%d", "x", 42);
    CHECK_STR(s, "x-42");
    free(s);
}

int main(void)
{
    test_status();
    test_buf();
    test_ids();
    test_config();
    test_utf8();
    test_arena();
    test_log_quote();
    test_thread();
    return check_done("test_common");
}
