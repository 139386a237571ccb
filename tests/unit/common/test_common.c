/* Unit tests of common/: status table, bounded buffers, ids, config and daemon options, UTF-8,
 * arena, log quoting, base64, image bounds, timed waits, bounded file reads. */
#include "../check.h"

#include "arena.h"
#include "base64.h"
#include "buf.h"
#include "clock.h"
#include "config.h"
#include "daemon.h"
#include "errinfo.h"
#include "file_read.h"
#include "ids.h"
#include "image.h"
#include "log.h"
#include "mem.h"
#include "page_token.h"
#include "pbtime.h"
#include "record_kind.h"
#include "status.h"
#include "thread.h"
#include "utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_status(void)
{
    struct cf_error err;
    CHECK_STR(status_name(CF_NOT_FOUND), "NOT_FOUND");
    CHECK(status_grpc_code(CF_STALE) == GRPC_STATUS_ABORTED);
    CHECK(status_grpc_code(CF_PRECONDITION) == GRPC_STATUS_FAILED_PRECONDITION);
    CHECK(status_from_grpc(GRPC_STATUS_FAILED_PRECONDITION) == CF_PRECONDITION);
    CHECK(status_from_grpc(GRPC_STATUS_DEADLINE_EXCEEDED) == CF_UNAVAILABLE);
    /* the Agent API's authentication answers travel through agentd's store calls unchanged */
    CHECK(status_from_grpc(GRPC_STATUS_PERMISSION_DENIED) == CF_PERMISSION);
    CHECK(status_from_grpc(GRPC_STATUS_UNAUTHENTICATED) == CF_UNAUTHENTICATED);
    CHECK(status_grpc_code(CF_PERMISSION) == GRPC_STATUS_PERMISSION_DENIED);
    CHECK_STR(status_reason(CF_STALE), "STALE_FENCE");
    /* every status has a reason in UPPER_SNAKE_CASE, distinct from the others */
    for (int i = 1; i < CF_STATUS_COUNT; i++) {
        const char *r = status_reason((enum cf_status)i);
        CHECK(*r);
        for (const char *q = r; *q; q++) {
            CHECK((*q >= 'A' && *q <= 'Z') || *q == '_');
        }
        for (int k = 1; k < i; k++) {
            CHECK(strcmp(r, status_reason((enum cf_status)k)) != 0);
        }
    }
    CHECK(cf_error_setr(&err, CF_INVALID, "RESERVED_METADATA_KEY", "key %s", "cflue.x") ==
          CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "RESERVED_METADATA_KEY");
    CHECK(cf_error_set(&err, CF_INVALID, "plain") == CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "INVALID_ARGUMENT"); /* a plain set drops the old reason */

    CHECK(status_grpc_code(CF_EXISTS) == GRPC_STATUS_ALREADY_EXISTS);
    CHECK(status_grpc_code(CF_RANGE) == GRPC_STATUS_OUT_OF_RANGE);
    CHECK(status_grpc_code(CF_STATUS_COUNT) == GRPC_STATUS_UNKNOWN);
    CHECK(cf_error_set(&err, CF_INVALID, "field %s", "x") == CF_INVALID);
    CHECK_STR(err.msg, "field x");
    CHECK(cf_error_set(NULL, CF_IO, "ignored") == CF_IO);
    /* a message over the limit is cut between characters, never inside one */
    char long_text[CF_ERROR_MSG_MAX + 8];
    memset(long_text, 'x', CF_ERROR_MSG_MAX - 2);
    strcpy(long_text + CF_ERROR_MSG_MAX - 2, "\xc3\xa9 more"); /* an e-acute over the cut */
    cf_error_set(&err, CF_INVALID, "%s", long_text);
    CHECK(strlen(err.msg) == CF_ERROR_MSG_MAX - 2);
    CHECK(utf8_valid(err.msg, strlen(err.msg), NULL));
}

static void test_pbtime(void)
{
    struct arena a;
    struct cf_error err;
    Google__Protobuf__Timestamp ts;
    Google__Protobuf__Duration d;
    arena_init(&a);
    pbtime_set(&ts, 1700000000123);
    CHECK(ts.seconds == 1700000000 && ts.nanos == 123000000);
    CHECK(pbtime_ms(&ts) == 1700000000123);
    pbtime_set(&ts, -1); /* before the epoch: nanos stay positive */
    CHECK(ts.seconds == -1 && ts.nanos == 999000000 && pbtime_ms(&ts) == -1);
    CHECK(pbtime_ms(NULL) == 0 && pbtime_in(&a, 0) == NULL);
    CHECK(pbtime_ms(pbtime_in(&a, 42)) == 42);
    pbdur_set(&d, 30500);
    CHECK(d.seconds == 30 && d.nanos == 500000000 && pbdur_ms(&d) == 30500);
    CHECK(pbdur_in(&a, 0) == NULL && pbdur_ms(pbdur_in(&a, 7)) == 7);
    CHECK(pbdur_check(NULL, "x", 0, &err) == CF_OK);
    CHECK(pbdur_check(&d, "lease_duration", 30000, &err) == CF_INVALID);
    CHECK_STR(err.msg, "lease_duration must be at most 30000 ms");
    d.seconds = -1;
    d.nanos = 0;
    CHECK(pbdur_check(&d, "timeout", 0, &err) == CF_INVALID);
    d.seconds = 1;
    d.nanos = -5; /* mixed signs */
    CHECK(pbdur_check(&d, "timeout", 0, &err) == CF_INVALID);
    ts.seconds = 0;
    ts.nanos = 1000000000;
    CHECK(pbtime_check(&ts, "t", &err) == CF_INVALID);
    ts.nanos = 0;
    CHECK(pbtime_check(&ts, "t", &err) == CF_OK);
    arena_cleanup(&a);
}

static void test_page_token(void)
{
    char tok[PAGE_TOKEN_MAX], pos[PAGE_TOKEN_POSITION_MAX + 1];
    int64_t off = 0;
    struct cf_error err;
    page_token_make_int(tok, "conv_a", 41);
    CHECK(page_token_parse_int(tok, "conv_a", &off, &err) == CF_OK && off == 41);
    /* another scope, a changed byte, odd length, non-hex, empty: all refused the same way */
    CHECK(page_token_parse_int(tok, "conv_b", &off, &err) == CF_INVALID);
    CHECK_STR(cf_error_reason(&err), "INVALID_PAGE_TOKEN");
    tok[20] = tok[20] == '0' ? '1' : '0';
    CHECK(page_token_parse_int(tok, "conv_a", &off, &err) == CF_INVALID);
    CHECK(page_token_parse_int("abc", "conv_a", &off, &err) == CF_INVALID);
    CHECK(page_token_parse_int("zz", "conv_a", &off, &err) == CF_INVALID);
    CHECK(page_token_parse_int("", "conv_a", &off, &err) == CF_INVALID);
    /* string positions, including the longest file name and bytes that are not UTF-8 */
    char name[256];
    memset(name, 0xe9, 255);
    name[255] = '\0';
    page_token_make(tok, "sb\n/dir", name);
    CHECK(page_token_parse(tok, "sb\n/dir", pos, &err) == CF_OK);
    CHECK_STR(pos, name);
    page_token_make(tok, "sb\n/dir", "notanumber");
    CHECK(page_token_parse_int(tok, "sb\n/dir", &off, &err) == CF_INVALID);
}

static void test_record_kind(void)
{
    Cflue__V1__Record r = CFLUE__V1__RECORD__INIT;
    Cflue__V1__ToolCallResult res = CFLUE__V1__TOOL_CALL_RESULT__INIT;
    CHECK_STR(record_kind_name(CFLUE__V1__RECORD__BODY_TOOL_RESULT), "tool_result");
    CHECK_STR(record_kind_name(CFLUE__V1__RECORD__BODY__NOT_SET), "unset");
    CHECK_STR(record_kind_name((Cflue__V1__Record__BodyCase)99), "unknown");
    CHECK(record_kind_from_name("submission_settled") ==
          CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED);
    CHECK(record_kind_from_name("nope") == CFLUE__V1__RECORD__BODY__NOT_SET);
    CHECK(record_body(&r) == NULL);
    CHECK(record_set_body(&r, &res.base));
    CHECK(r.body_case == CFLUE__V1__RECORD__BODY_TOOL_RESULT && r.tool_result == &res);
    CHECK(record_body(&r) == &res.base);
    CHECK(!record_set_body(&r, NULL));
    /* every body case of the proto has a name and a descriptor */
    const ProtobufCFieldDescriptor *f = cflue__v1__record__descriptor.fields;
    for (unsigned i = 0; i < cflue__v1__record__descriptor.n_fields; i++) {
        if (f[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            Cflue__V1__Record__BodyCase k = (Cflue__V1__Record__BodyCase)f[i].id;
            CHECK_STR(record_kind_name(k), f[i].name);
            CHECK(record_body_descriptor(k) == f[i].descriptor);
        }
    }
}

static void test_errinfo(void)
{
    char reason[CF_ERROR_REASON_MAX];
    grpc_slice v = errinfo_pack(GRPC_STATUS_ABORTED, "stale", "STALE_FENCE");
    grpc_metadata md = {.key = grpc_slice_from_static_string(ERRINFO_TRAILER_KEY), .value = v};
    grpc_metadata_array arr = {.count = 1, .capacity = 1, .metadata = &md};
    CHECK(errinfo_find_reason(&arr, reason, sizeof(reason)));
    CHECK_STR(reason, "STALE_FENCE");
    grpc_slice_unref(v);
    v = errinfo_pack(GRPC_STATUS_UNAVAILABLE, NULL, NULL);
    md.value = v;
    CHECK(errinfo_find_reason(&arr, reason, sizeof(reason)));
    CHECK_STR(reason, "UNAVAILABLE");
    grpc_slice_unref(v);
    md.value = grpc_slice_from_static_string("\xff\xff garbage");
    CHECK(!errinfo_find_reason(&arr, reason, sizeof(reason)) && !*reason);
    arr.count = 0;
    CHECK(!errinfo_find_reason(&arr, reason, sizeof(reason)));
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
    CHECK(!ids_valid_name(NULL, 128));
    CHECK(!ids_valid_name("a@b", 128));
    CHECK(ids_valid_principal("ops@example.com"));
    CHECK(!ids_valid_principal(""));
    CHECK(!ids_valid_principal(NULL));
    CHECK(!ids_valid_principal("a b"));
}

/* random_part is an id's last 16 characters: its 80 random bits. */
static const char *random_part(const char *id)
{
    return id + strlen(id) - 16;
}

#define IDS_THREADS 4
#define IDS_PER_THREAD 500
static char thread_ids[IDS_THREADS][IDS_PER_THREAD][IDS_MAX];

static void *make_ids(void *arg)
{
    char(*mine)[IDS_MAX] = arg;
    for (int i = 0; i < IDS_PER_THREAD; i++) {
        ids_new(mine[i], "att");
    }
    return NULL;
}

static int cmp_random_part(const void *a, const void *b)
{
    return strcmp(random_part(a), random_part(b));
}

/* Ids made at once on several threads, and in a forked child and its parent after the fork,
 * never share their random bits (each thread draws from a pool of its own; a child empties
 * the one it inherits). */
static void test_ids_unique(void)
{
    pthread_t t[IDS_THREADS];
    for (int i = 0; i < IDS_THREADS; i++) {
        CHECK(pthread_create(&t[i], NULL, make_ids, thread_ids[i]) == 0);
    }
    for (int i = 0; i < IDS_THREADS; i++) {
        pthread_join(t[i], NULL);
    }
    qsort(thread_ids, IDS_THREADS * IDS_PER_THREAD, IDS_MAX, cmp_random_part);
    char(*all)[IDS_MAX] = thread_ids[0];
    int repeats = 0;
    for (int i = 1; i < IDS_THREADS * IDS_PER_THREAD; i++) {
        repeats += strcmp(random_part(all[i - 1]), random_part(all[i])) == 0;
    }
    CHECK(repeats == 0);

    char before[IDS_MAX], parent[IDS_MAX], child[IDS_MAX] = "";
    ids_new(before, "sub"); /* the pool is full now: the child inherits it */
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        char id[IDS_MAX] = ""; /* every byte set: all of them are written */
        ids_new(id, "sub");
        _exit(write(fds[1], id, sizeof(id)) == (ssize_t)sizeof(id) ? 0 : 1);
    }
    CHECK(pid > 0);
    ids_new(parent, "sub");
    close(fds[1]);
    CHECK(read(fds[0], child, sizeof(child)) == (ssize_t)sizeof(child));
    close(fds[0]);
    int status = -1;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(strlen(child) == strlen(parent));
    CHECK(strcmp(random_part(child), random_part(parent)) != 0);
    CHECK(strcmp(random_part(before), random_part(parent)) != 0);
}

static void test_config(void)
{
    static const char *const modes[] = {"fast", "safe", "off", NULL};
    const char *s = "default", *mode = "safe";
    long long n = 5;
    bool flag = false, help;
    struct cf_error err;
    const struct config_opt opts[] = {
        CONFIG_OPT_STRING("name", &s, "a name"),
        CONFIG_OPT_INT("count-max", &n, 1, 10, "a number"),
        CONFIG_OPT_BOOL("flag", &flag, "a flag"),
        CONFIG_OPT_CHOICE("mode", &mode, modes, "fast, safe or off"),
    };
    size_t n_opts = CONFIG_COUNT(opts);
    CHECK(n_opts == 4);
    /* nothing given: the defaults stay */
    char *argv0[] = {"x", NULL};
    CHECK(config_parse(opts, n_opts, 1, argv0, "u", &help, &err) == CF_OK);
    CHECK(!strcmp(s, "default") && n == 5 && !flag && !strcmp(mode, "safe") && !help);
    char *argv1[] = {"x", "--name", "n1", "--count-max=7", "--flag", "--mode=fast", NULL};
    CHECK(config_parse(opts, n_opts, 6, argv1, "u", &help, &err) == CF_OK);
    CHECK_STR(s, "n1");
    CHECK(n == 7 && flag && !help);
    CHECK_STR(mode, "fast");
    /* the environment beats the default, a flag beats the environment */
    setenv("CFLUE_COUNT_MAX", "3", 1);
    setenv("CFLUE_FLAG", "no", 1);
    CHECK(config_parse(opts, n_opts, 1, argv0, "u", &help, &err) == CF_OK);
    CHECK(n == 3 && !flag);
    char *argv2[] = {"x", "--count-max", "4", "--flag", NULL};
    CHECK(config_parse(opts, n_opts, 4, argv2, "u", &help, &err) == CF_OK);
    CHECK(n == 4 && flag);
    unsetenv("CFLUE_FLAG");
    /* errors name the flag or the variable */
    char *argv3[] = {"x", "--count-max", "11", NULL};
    CHECK(config_parse(opts, n_opts, 3, argv3, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "--count-max") != NULL && strstr(err.msg, "1..10") != NULL);
    char *argv4[] = {"x", "--nope", NULL};
    CHECK(config_parse(opts, n_opts, 2, argv4, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "unknown flag '--nope'") != NULL);
    setenv("CFLUE_COUNT_MAX", "abc", 1);
    CHECK(config_parse(opts, n_opts, 1, argv0, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "CFLUE_COUNT_MAX") != NULL);
    unsetenv("CFLUE_COUNT_MAX");
    char *argv5[] = {"x", "--name", NULL};
    CHECK(config_parse(opts, n_opts, 2, argv5, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "--name needs a value") != NULL);
    char *argv6[] = {"x", "stray", NULL};
    CHECK(config_parse(opts, n_opts, 2, argv6, "u", &help, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "unexpected argument 'stray'") != NULL);
    char *argv7[] = {"x", "--flag=maybe", NULL};
    CHECK(config_parse(opts, n_opts, 2, argv7, "u", &help, &err) == CF_INVALID);
    /* a value outside the choices, from a flag or the environment */
    char *argv8[] = {"x", "--mode", "slow", NULL};
    CHECK(config_parse(opts, n_opts, 3, argv8, "u", &help, &err) == CF_INVALID);
    CHECK_STR(err.msg, "--mode must be fast, safe or off");
    setenv("CFLUE_MODE", "on", 1);
    CHECK(config_parse(opts, n_opts, 1, argv0, "u", &help, &err) == CF_INVALID);
    CHECK_STR(err.msg, "--mode must be fast, safe or off");
    char *argv9[] = {"x", "--mode=off", NULL};
    CHECK(config_parse(opts, n_opts, 2, argv9, "u", &help, &err) == CF_OK);
    CHECK_STR(mode, "off");
    unsetenv("CFLUE_MODE");
}

/* configure runs daemon_configure on a daemon with the shared options and one of its own,
 * stdout and stderr (help and error text) sent to /dev/null. */
static int configure(struct daemon *d, long long *own, int argc, char **argv)
{
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(d, "address"),
        CONFIG_OPT_INT("own-ms", own, 0, 100, "its own option"),
        DAEMON_OPT_PORT_FILE(d, "port file"),
        DAEMON_OPT_GRACE_MS(d, "grace"),
        DAEMON_OPT_MAX_QUEUE(d, "queue"),
        DAEMON_OPT_LOG_LEVEL(d),
    };
    fflush(stdout);
    fflush(stderr);
    int out = dup(1), errfd = dup(2), null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    int rc = daemon_configure(d, opts, CONFIG_COUNT(opts), argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(out, 1);
    dup2(errfd, 2);
    close(out);
    close(errfd);
    close(null);
    return rc;
}

static void test_daemon_options(void)
{
    long long own = 7;
    struct daemon d = DAEMON_INIT("testd", "usage: testd", "127.0.0.1:1");
    char *argv0[] = {"testd", NULL};
    /* the defaults of DAEMON_INIT */
    CHECK(configure(&d, &own, 1, argv0) == DAEMON_RUN);
    CHECK_STR(d.listen, "127.0.0.1:1");
    CHECK_STR(d.port_file, "");
    CHECK_STR(d.log_level, "info");
    CHECK(d.grace_ms == 5000 && d.max_queue == 256 && own == 7 && !d.server);
    /* environment, then flags */
    setenv("CFLUE_LISTEN", "127.0.0.1:2", 1);
    setenv("CFLUE_GRACE_MS", "100", 1);
    setenv("CFLUE_OWN_MS", "9", 1);
    char *argv1[] = {"testd", "--listen=127.0.0.1:3", "--port-file", "/tmp/p", "--max-queue",
                     "5",     "--log-level",          "warn",        NULL};
    CHECK(configure(&d, &own, 8, argv1) == DAEMON_RUN);
    CHECK_STR(d.listen, "127.0.0.1:3");
    CHECK_STR(d.port_file, "/tmp/p");
    CHECK_STR(d.log_level, "warn");
    CHECK(d.grace_ms == 100 && d.max_queue == 5 && own == 9);
    unsetenv("CFLUE_LISTEN");
    unsetenv("CFLUE_GRACE_MS");
    unsetenv("CFLUE_OWN_MS");
    /* usage errors exit 2, --help exits 0 */
    char *argv2[] = {"testd", "--log-level", "loud", NULL};
    CHECK(configure(&d, &own, 3, argv2) == 2);
    char *argv3[] = {"testd", "--max-queue", "0", NULL};
    CHECK(configure(&d, &own, 3, argv3) == 2);
    char *argv4[] = {"testd", "--grace-ms", "soon", NULL};
    CHECK(configure(&d, &own, 3, argv4) == 2);
    char *argv5[] = {"testd", "--own-ms", "101", NULL};
    CHECK(configure(&d, &own, 3, argv5) == 2);
    char *argv6[] = {"testd", "--help", NULL};
    CHECK(configure(&d, &own, 2, argv6) == 0);
    setenv("CFLUE_LOG_LEVEL", "shout", 1);
    CHECK(configure(&d, &own, 1, argv0) == 2);
    unsetenv("CFLUE_LOG_LEVEL");
    log_init("test_common", LOG_WARN);
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
    /* sanitized text is a protobuf string: a NUL would end it, so it goes as U+FFFD too */
    struct buf b;
    buf_init(&b, 64);
    CHECK(utf8_sanitize(&b, "a\0b\xff\xc3\xa9\n", 7) == CF_OK);
    CHECK(b.len == 11 && !memcmp(buf_cstr(&b),
                                 "a\xef\xbf\xbd"
                                 "b\xef\xbf\xbd\xc3\xa9\n",
                                 11));
    buf_cleanup(&b);
    /* text is looked at eight bytes at a time: a NUL, a bad byte or a character of two bytes
     * at each offset of a 40-byte ASCII text, whatever its place in a word */
    for (size_t k = 0; k + 2 <= 40; k++) {
        char t[40], want[42];
        memset(t, 'x', sizeof(t));
        t[k] = '\0';
        CHECK(utf8_valid(t, sizeof(t), NULL));
        buf_init(&b, 64);
        CHECK(utf8_sanitize(&b, t, sizeof(t)) == CF_OK);
        memset(want, 'x', sizeof(want));
        memcpy(want + k, "\xef\xbf\xbd", 3);
        CHECK(b.len == 42 && !memcmp(b.data, want, 42));
        buf_cleanup(&b);
        t[k] = '\xff';
        CHECK(!utf8_valid(t, sizeof(t), &bad) && bad == k);
        buf_init(&b, 64);
        CHECK(utf8_sanitize(&b, t, sizeof(t)) == CF_OK);
        CHECK(b.len == 42 && !memcmp(b.data, want, 42));
        buf_cleanup(&b);
        memcpy(t + k, "\xc3\xa9", 2);
        CHECK(utf8_valid(t, sizeof(t), NULL));
        buf_init(&b, 64);
        CHECK(utf8_sanitize(&b, t, sizeof(t)) == CF_OK);
        CHECK(b.len == 40 && !memcmp(b.data, t, 40));
        buf_cleanup(&b);
    }
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

static void *own_name(void *arg)
{
    (void)pthread_getname_np(pthread_self(), arg, 32);
    return NULL;
}

struct waker {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool woken;
};

static void *wake_later(void *arg)
{
    struct waker *w = arg;
    clock_sleep_ms(50);
    pthread_mutex_lock(&w->mu);
    w->woken = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static void test_clock_wait(void)
{
    /* a deadline is a time of the monotonic clock (a wall-clock one would be decades ahead of
     * it), so a step of the wall clock cannot move it */
    struct timespec ts, mono;
    clock_gettime(CLOCK_MONOTONIC, &mono);
    clock_deadline(&ts, 1500);
    int64_t ahead =
        (int64_t)(ts.tv_sec - mono.tv_sec) * 1000 + (ts.tv_nsec - mono.tv_nsec) / 1000000;
    CHECK(ahead >= 1500 && ahead < 60000);
    /* a wait nobody ends times out at its deadline, not before */
    struct waker w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false};
    pthread_mutex_lock(&w.mu);
    int64_t t0 = clock_mono_ms();
    clock_deadline(&ts, 100);
    int rc = 0;
    while (rc == 0) { /* a wake-up without a signal may end a wait early: wait again */
        rc = clock_cond_wait(&w.cv, &w.mu, &ts);
    }
    CHECK(rc == ETIMEDOUT);
    CHECK(clock_mono_ms() - t0 >= 100);
    /* a signal ends it */
    pthread_t t;
    CHECK(pthread_create(&t, NULL, wake_later, &w) == 0);
    clock_deadline(&ts, 20000);
    t0 = clock_mono_ms();
    rc = 0;
    while (!w.woken && rc == 0) {
        rc = clock_cond_wait(&w.cv, &w.mu, &ts);
    }
    CHECK(rc == 0 && w.woken);
    CHECK(clock_mono_ms() - t0 < 15000);
    pthread_mutex_unlock(&w.mu);
    pthread_join(t, NULL);
}

static void test_thread(void)
{
    struct cf_error err;
    pthread_t t;
    int n = 0;
    CHECK(thread_start(&t, "counter", 0, count_up, &n, &err) == CF_OK);
    pthread_join(t, NULL);
    CHECK(n == 1);
    /* the thread carries its name from its first instruction, cut to the kernel's 15
     * characters; a detached one too */
    char name[32] = "";
    CHECK(thread_start(&t, "a-name-longer-than-fifteen", 0, own_name, name, &err) == CF_OK);
    pthread_join(t, NULL);
    CHECK_STR(name, "a-name-longer-t");
    /* a stack size the system refuses is a status, not a crash or a silent default */
    CHECK(thread_start(&t, "counter", 1, count_up, &n, &err) == CF_BUSY);
    CHECK(strstr(err.msg, "could not start a thread") != NULL);
    CHECK(n == 1);
    /* each thread has its own seeded sequence: two threads do not draw the same value */
    uint64_t a = 0, b = 0;
    pthread_t ta, tb;
    CHECK(thread_start(&ta, "random-a", 0, random_of_thread, &a, &err) == CF_OK);
    CHECK(thread_start(&tb, "random-b", 0, random_of_thread, &b, &err) == CF_OK);
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

/* base64: RFC 4648's test vectors both ways; padding optional on decode; anything outside the
 * alphabet, padding inside, an impossible length, or output past max refused. */
static void test_base64(void)
{
    static const char *const plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *const coded[] = {"",         "Zg==",     "Zm8=",    "Zm9v",
                                        "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (size_t i = 0; i < 7; i++) {
        char *e = base64_encode((const uint8_t *)plain[i], strlen(plain[i]));
        CHECK_STR(e, coded[i]);
        free(e);
        uint8_t *d;
        size_t n;
        CHECK(base64_decode(coded[i], strlen(coded[i]), 64, &d, &n) == CF_OK);
        CHECK(d != NULL && n == strlen(plain[i]) && !memcmp(d, plain[i], n));
        free(d);
    }
    uint8_t *d;
    size_t n;
    CHECK(base64_decode("Zm9vYg", 6, 64, &d, &n) == CF_OK && n == 4 && !memcmp(d, "foob", 4));
    free(d);
    CHECK(base64_decode("+/+/", 4, 64, &d, &n) == CF_OK && n == 3 && d[0] == 0xfb);
    free(d);
    static const char *const bad[] = {
        "Zm9v YmFy", "Zm9vY", "Zg=a", "Z===", "====", "Zm9v\n", "Zm-_"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++) {
        CHECK(base64_decode(bad[i], strlen(bad[i]), 64, &d, &n) == CF_INVALID);
        CHECK(d == NULL && n == 0);
    }
    CHECK(base64_decode("Zm9vYmFy", 8, 5, &d, &n) == CF_TOOBIG && d == NULL);
    CHECK(base64_decode("Zm9vYmFy", 8, 6, &d, &n) == CF_OK && n == 6);
    free(d);
}

/* image bounds: the four types (any case), then size and count; NULL when it may be shown. */
static void test_image(void)
{
    CHECK_STR(image_type("IMAGE/Png"), "image/png");
    CHECK(image_type("image/svg+xml") == NULL && image_type(NULL) == NULL);
    CHECK(image_refusal("image/webp", 10, 0, 0) == NULL);
    CHECK(strstr(image_refusal("image/bmp", 10, 0, 0), "only PNG") != NULL);
    CHECK(strstr(image_refusal("image/png", 0, 0, 0), "no data") != NULL);
    CHECK(strstr(image_refusal("image/png", IMAGE_BYTES_MAX + 1, 0, 0), "5 MiB") != NULL);
    CHECK(image_refusal("image/png", IMAGE_BYTES_MAX, 0, 0) == NULL);
    CHECK(strstr(image_refusal("image/gif", 1, IMAGE_RESULT_MAX, 0), "at most 8") != NULL);
    CHECK(strstr(image_refusal("image/gif", 2, 1, IMAGE_RESULT_BYTES_MAX - 1), "6 MiB") != NULL);
    CHECK(image_refusal("image/gif", 1, 1, IMAGE_RESULT_BYTES_MAX - 1) == NULL);
}

/* file_read_regular: whole files within the bound; a FIFO refused at once (opening one to
 * read waits for a writer); a file past the bound, a link with nofollow, a missing file. */
static void test_file_read(void)
{
    char dir[] = "/tmp/cflue-file-read-XXXXXX", path[256], link[256];
    struct cf_error err;
    char *data;
    size_t len;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/f.md", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs("0123456789", f);
    fclose(f);
    CHECK(file_read_regular(path, 10, FILE_READ_NOFOLLOW, &data, &len, &err) == CF_OK);
    CHECK(len == 10 && !strcmp(data, "0123456789"));
    free(data);
    CHECK(file_read_regular(path, 9, FILE_READ_NOFOLLOW, &data, &len, &err) == CF_TOOBIG &&
          data == NULL);
    CHECK(strstr(err.msg, "larger than 9 bytes") != NULL);
    CHECK(file_read_regular(path, 10, FILE_READ_SECRET, &data, &len, &err) == CF_OK);
    CHECK(len == 10 && !strcmp(data, "0123456789"));
    free(data);
    snprintf(link, sizeof(link), "%s/l.md", dir);
    CHECK(symlink(path, link) == 0);
    CHECK(file_read_regular(link, 64, 0, &data, &len, &err) == CF_OK && len == 10);
    free(data);
    CHECK(file_read_regular(link, 64, FILE_READ_NOFOLLOW, &data, &len, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "symbolic link") != NULL);
    unlink(link);
    CHECK(mkfifo(link, 0600) == 0);
    CHECK(file_read_regular(link, 64, 0, &data, &len, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "not a regular file") != NULL);
    CHECK(file_read_regular(dir, 64, 0, &data, &len, &err) == CF_INVALID);
    unlink(link);
    CHECK(file_read_regular(link, 64, 0, &data, &len, &err) == CF_NOT_FOUND);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    test_status();
    test_pbtime();
    test_page_token();
    test_record_kind();
    test_errinfo();
    test_buf();
    test_ids();
    test_ids_unique();
    test_config();
    test_daemon_options();
    test_utf8();
    test_arena();
    test_log_quote();
    test_thread();
    test_clock_wait();
    test_base64();
    test_image();
    test_file_read();
    return check_done("test_common");
}
