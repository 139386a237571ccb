/* Unit tests of common/trace.c: the W3C traceparent and tracestate parsers (the spec's valid
 * and invalid cases), the formatter, new traces and spans, the thread's current trace, and the
 * trace fields log_write adds to a line. */
#include "../check.h"

#include "log.h"
#include "trace.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TID "4bf92f3577b34da6a3ce929d0e0e4736"
#define PID "00f067aa0ba902b7"

static bool parses(const char *tp)
{
    struct trace_ctx t;
    struct cf_error err;
    return trace_parse(&t, tp, NULL, &err) == CF_OK;
}

static bool all_hex(const char *s, size_t n)
{
    if (strlen(s) != n) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) {
            return false;
        }
    }
    return true;
}

static void test_parent_valid(void)
{
    struct trace_ctx t;
    struct cf_error err;
    CHECK(trace_parse(&t, "00-" TID "-" PID "-01", NULL, &err) == CF_OK);
    CHECK_STR(t.trace_id, TID);
    CHECK_STR(t.span_id, PID);
    CHECK(t.flags == TRACE_FLAG_SAMPLED);
    CHECK_STR(t.state, "");
    CHECK(trace_parse(&t, "00-" TID "-" PID "-00", NULL, &err) == CF_OK && t.flags == 0);
    /* flags it does not know are dropped (the spec: a forwarder sets them to zero); Level 2's
     * random flag is kept */
    CHECK(trace_parse(&t, "00-" TID "-" PID "-ff", NULL, &err) == CF_OK &&
          t.flags == TRACE_FLAGS_KNOWN);
    CHECK(trace_parse(&t, "00-" TID "-" PID "-09", NULL, &err) == CF_OK &&
          t.flags == TRACE_FLAG_SAMPLED);
    /* blanks around the value (HTTP's optional whitespace) */
    CHECK(trace_parse(&t, " \t00-" TID "-" PID "-01\t ", NULL, &err) == CF_OK);
    CHECK_STR(t.trace_id, TID);
    /* a later version: at least 55 characters, parsed as 00, the rest after a '-' ignored */
    CHECK(trace_parse(&t, "01-" TID "-" PID "-01", NULL, &err) == CF_OK);
    CHECK(trace_parse(&t, "cc-" TID "-" PID "-01-what-the-future-will-be-like", NULL, &err) ==
          CF_OK);
    CHECK_STR(t.trace_id, TID);
    CHECK_STR(t.span_id, PID);
    CHECK(t.flags == TRACE_FLAG_SAMPLED);
    /* the spec's own example ids */
    CHECK(parses("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
}

static void test_parent_invalid(void)
{
    struct trace_ctx t;
    struct cf_error err;
    const char *bad[] = {
        NULL,
        "",
        "   ",
        "00",
        "00-" TID "-" PID,                       /* no flags */
        "00-" TID "-" PID "-0",                  /* one flag digit */
        "00-" TID "-" PID "-01-",                /* version 00 has nothing after the flags */
        "00-" TID "-" PID "-01-extra",           /* ... not even a '-' field */
        "00-" TID "-" PID "-011",                /* 56 characters */
        "01-" TID "-" PID "-01.what-the-future", /* a later version: '-' after the flags */
        "ff-" TID "-" PID "-01",                 /* version ff is invalid */
        "0g-" TID "-" PID "-01",                 /* version not hex */
        "0A-" TID "-" PID "-01",                 /* uppercase version */
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-" PID "-01",  /* uppercase trace-id */
        "00-" TID "-00F067AA0BA902B7-01",                  /* uppercase parent-id */
        "00-" TID "-" PID "-0A",                           /* uppercase flags */
        "00-00000000000000000000000000000000-" PID "-01",  /* all-zero trace-id */
        "00-" TID "-0000000000000000-01",                  /* all-zero parent-id */
        "00-4bf92f3577b34da6a3ce929d0e0e473-" PID "-01",   /* 31-digit trace-id */
        "00-4bf92f3577b34da6a3ce929d0e0e47366-" PID "-01", /* 33 digits */
        "00-" TID "-00f067aa0ba902b-01",                   /* 15-digit parent-id */
        "00-" TID "-00f067aa0ba902b77-01",                 /* 17 digits */
        "00_" TID "-" PID "-01",                           /* wrong separators */
        "00-" TID "_" PID "-01",
        "00-" TID "-" PID "_01",
        "00-4bf92f3577b34da6a3ce929d0e0e473g-" PID "-01", /* not hex */
        "00-" TID "-00f067aa0ba902bz-01",
        "00-" TID "-" PID "-0z",
        "00 -" TID "-" PID "-01", /* a blank inside */
        "00-" TID "-" PID "- 1",
        "01-" TID "-" PID, /* a later version, still at least 55 characters */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&t, 'x', sizeof(t));
        bool refused = trace_parse(&t, bad[i], "a=b", &err) == CF_INVALID;
        if (!refused) {
            fprintf(stderr, "accepted: '%s'\n", bad[i] ? bad[i] : "(null)");
        }
        CHECK(refused);
        CHECK(!t.trace_id[0] && !t.state[0]); /* nothing of it is kept */
        CHECK(*err.msg);
    }
    CHECK(trace_parse(&t, "00-" TID "-0000000000000000-01", NULL, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "parent-id is all zeros") != NULL);
}

static const char *state_of(const char *ts)
{
    static struct trace_ctx t;
    struct cf_error err;
    CHECK(trace_parse(&t, "00-" TID "-" PID "-01", ts, &err) == CF_OK);
    CHECK_STR(t.trace_id, TID); /* a tracestate never costs the trace */
    return t.state;
}

static void test_state(void)
{
    CHECK_STR(state_of(NULL), "");
    CHECK_STR(state_of(""), "");
    CHECK_STR(state_of("congo=t61rcWkgMzE"), "congo=t61rcWkgMzE");
    /* blanks around members and empty members go; order is kept */
    CHECK_STR(state_of(" rojo=00f067aa0ba902b7 ,, congo=t61rcWkgMzE ,"),
              "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE");
    /* multi-tenant keys, the key characters, a value with inner blanks */
    CHECK_STR(state_of("t0-n_a*n/t@sys-1=v,a/b*c_d-e=x y"), "t0-n_a*n/t@sys-1=v,a/b*c_d-e=x y");
    /* invalid: dropped whole */
    const char *bad[] = {
        "Congo=x",             /* uppercase key */
        "1abc=x",              /* a simple key starts with a letter */
        "congo",               /* no '=' */
        "congo=",              /* empty value */
        "congo=a,b",           /* ',' ends the member: "b" has no '=' */
        "congo=a=b",           /* '=' in a value */
        "congo=x,congo=y",     /* a key twice */
        "a@=x",                /* empty system id */
        "@b=x",                /* empty tenant id */
        "a@1b=x",              /* a system id starts with a letter */
        "a@abcdefghijklmno=x", /* a system id of 15 characters */
        "k=\x01x",             /* a control character */
        "k=caf\xc3\xa9",       /* beyond ASCII */
        "k =v",                /* a blank before '=' */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *got = state_of(bad[i]);
        if (*got) {
            fprintf(stderr, "kept tracestate '%s' as '%s'\n", bad[i], got);
        }
        CHECK(!*got);
    }
    /* 32 members are fine, 33 are not */
    char many[33 * 8 + 1] = "";
    for (int i = 0; i < 32; i++) {
        char m[16];
        snprintf(m, sizeof(m), "%sk%02d=v", i ? "," : "", i);
        strcat(many, m);
    }
    CHECK_STR(state_of(many), many);
    strcat(many, ",k32=v");
    CHECK_STR(state_of(many), "");
    /* too long to keep (over 512): members over 128 characters go first, then the last ones */
    char big[1200], value[200];
    memset(value, 'v', 150);
    value[150] = '\0';
    snprintf(big, sizeof(big), "a=%.100s,huge=%s,b=%.100s,c=%.100s,d=%.100s,e=%.100s", value, value,
             value, value, value, value);
    const char *kept = state_of(big);
    CHECK(strlen(kept) <= TRACE_STATE_MAX);
    CHECK(strstr(kept, "huge=") == NULL);
    CHECK(strncmp(kept, "a=", 2) == 0 && strstr(kept, ",b=") && strstr(kept, ",c=") &&
          strstr(kept, ",d="));
    CHECK(strstr(kept, ",e=") == NULL); /* a, b, c, d and e are 514 characters with commas */
}

static void test_make(void)
{
    struct trace_ctx a, b, c;
    char tp[TRACE_PARENT_SIZE];
    struct cf_error err;
    trace_start(&a);
    trace_start(&b);
    CHECK(all_hex(a.trace_id, TRACE_ID_HEX) && all_hex(a.span_id, TRACE_SPAN_HEX));
    CHECK(strcmp(a.trace_id, b.trace_id) != 0 && strcmp(a.span_id, b.span_id) != 0);
    CHECK(a.flags == TRACE_FLAG_SAMPLED && !a.state[0]);
    /* format, then parse: the same context */
    trace_format(&a, tp);
    CHECK(strlen(tp) == TRACE_PARENT_SIZE - 1 && !strncmp(tp, "00-", 3));
    CHECK(trace_parse(&c, tp, NULL, &err) == CF_OK);
    CHECK_STR(c.trace_id, a.trace_id);
    CHECK_STR(c.span_id, a.span_id);
    CHECK(c.flags == a.flags);
    CHECK(trace_parse(&c, "00-" TID "-" PID "-03", NULL, &err) == CF_OK);
    trace_format(&c, tp);
    CHECK_STR(tp, "00-" TID "-" PID "-03");
    /* a child: the same trace, flags and state, a span of its own */
    CHECK(trace_parse(&a, "00-" TID "-" PID "-01", "x=1", &err) == CF_OK);
    trace_child(&b, &a);
    CHECK_STR(b.trace_id, TID);
    CHECK(strcmp(b.span_id, PID) != 0 && all_hex(b.span_id, TRACE_SPAN_HEX));
    CHECK(b.flags == 1);
    CHECK_STR(b.state, "x=1");
    trace_child(&a, &a); /* in place */
    CHECK_STR(a.trace_id, TID);
    CHECK(strcmp(a.span_id, PID) != 0);
    /* no trace: nothing to format */
    memset(&c, 0, sizeof(c));
    trace_format(&c, tp);
    CHECK_STR(tp, "");
    trace_format(NULL, tp);
    CHECK_STR(tp, "");
    /* spans differ from one another */
    char s1[TRACE_SPAN_HEX + 1], s2[TRACE_SPAN_HEX + 1];
    trace_new_span(s1);
    trace_new_span(s2);
    CHECK(all_hex(s1, TRACE_SPAN_HEX) && strcmp(s1, s2) != 0);
}

static void *other_thread(void *arg)
{
    *(bool *)arg = trace_current() == NULL; /* a thread starts with none */
    return NULL;
}

static void test_current(void)
{
    struct trace_ctx t, u, saved, saved2;
    char tp[TRACE_PARENT_SIZE];
    struct cf_error err;
    CHECK(trace_current() == NULL);
    CHECK(!trace_outgoing(tp) && !*tp);
    struct trace_http none_h;
    const char *none_lines[2];
    CHECK(trace_http_headers(NULL, &none_h, none_lines) == 0);
    CHECK(trace_parse(&t, "00-" TID "-" PID "-01", "k=v", &err) == CF_OK);
    trace_enter(&t, &saved);
    CHECK(trace_current() && !strcmp(trace_current()->trace_id, TID));
    CHECK_STR(trace_current()->state, "k=v");
    /* an outgoing request: the trace, a new parent-id each time */
    char tp2[TRACE_PARENT_SIZE];
    CHECK(trace_outgoing(tp) && trace_outgoing(tp2));
    CHECK(!strncmp(tp, "00-" TID "-", 36) && !strcmp(tp + 52, "-01"));
    CHECK(strncmp(tp + 36, PID, 16) != 0 && strcmp(tp, tp2) != 0);
    /* an HTTP request's header lines: the current trace, or one given; a span of their own */
    struct trace_http h;
    const char *lines[2] = {NULL, NULL};
    CHECK(trace_http_headers(NULL, &h, lines) == 2);
    CHECK(!strncmp(lines[0], "traceparent: 00-" TID "-", 49) && !strcmp(lines[0] + 65, "-01"));
    CHECK(strncmp(lines[0] + 49, PID, 16) != 0);
    CHECK_STR(lines[1], "tracestate: k=v");
    struct trace_ctx plain;
    trace_start(&plain);
    lines[1] = NULL;
    CHECK(trace_http_headers(&plain, &h, lines) == 1 && lines[1] == NULL);
    CHECK(!strncmp(lines[0] + 16, plain.trace_id, 32) && strncmp(lines[0] + 49, plain.span_id, 16));
    bool none = false;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, other_thread, &none) == 0);
    pthread_join(th, NULL);
    CHECK(none);
    /* nested: another trace, then none, each restored in turn */
    trace_start(&u);
    trace_enter(&u, &saved2);
    CHECK_STR(trace_current()->trace_id, u.trace_id);
    struct trace_ctx saved3;
    trace_enter(NULL, &saved3);
    CHECK(trace_current() == NULL);
    trace_leave(&saved3);
    CHECK_STR(trace_current()->trace_id, u.trace_id);
    trace_leave(&saved2);
    CHECK_STR(trace_current()->trace_id, TID);
    trace_leave(&saved);
    CHECK(trace_current() == NULL);
    /* a context holding no trace clears the current one */
    memset(&u, 0, sizeof(u));
    trace_enter(&t, &saved);
    trace_enter(&u, &saved2);
    CHECK(trace_current() == NULL);
    trace_leave(&saved2);
    trace_leave(&saved);
}

/* logged runs log lines while stderr goes to a file and returns what was written. */
static char *logged(void (*fn)(void))
{
    char path[] = "/tmp/cflue-test-trace-XXXXXX";
    int fd = mkstemp(path);
    int keep = dup(STDERR_FILENO);
    CHECK(fd >= 0 && keep >= 0);
    fflush(stderr);
    dup2(fd, STDERR_FILENO);
    fn();
    dup2(keep, STDERR_FILENO);
    close(keep);
    static char out[16384];
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, out, sizeof(out) - 1);
    out[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    return out;
}

static void log_some(void)
{
    struct trace_ctx t, saved;
    struct cf_error err;
    log_info("untraced", "k=1");
    CHECK(trace_parse(&t, "00-" TID "-" PID "-01", NULL, &err) == CF_OK);
    trace_enter(&t, &saved);
    log_info("traced", "k=2");
    log_info("bare", NULL);
    /* a line longer than the writer's buffer keeps its trace fields whole */
    char *long_value = malloc(8000);
    memset(long_value, 'x', 7999);
    long_value[7999] = '\0';
    log_info("long", "v=%s", long_value);
    free(long_value);
    trace_leave(&saved);
    log_info("after", "k=3");
}

static void test_log_fields(void)
{
    log_init("test", LOG_INFO);
    char *out = logged(log_some);
    char *lines[5] = {0};
    int n = 0;
    for (char *p = strtok(out, "\n"); p && n < 5; p = strtok(NULL, "\n")) {
        lines[n++] = p;
    }
    CHECK(n == 5);
    if (n != 5) {
        return;
    }
    const char *suffix = " trace_id=" TID " span_id=" PID;
    size_t sl = strlen(suffix);
    CHECK(strstr(lines[0], "event=untraced k=1") && !strstr(lines[0], "trace_id="));
    CHECK(strstr(lines[1], "event=traced k=2 trace_id=" TID " span_id=" PID) != NULL);
    CHECK(strstr(lines[2], "event=bare trace_id=" TID) != NULL);
    CHECK(strlen(lines[3]) < 4096 && strlen(lines[3]) > sl &&
          !strcmp(lines[3] + strlen(lines[3]) - sl, suffix));
    CHECK(strstr(lines[4], "event=after k=3") && !strstr(lines[4], "trace_id="));
}

int main(void)
{
    test_parent_valid();
    test_parent_invalid();
    test_state();
    test_make();
    test_current();
    test_log_fields();
    return check_done("test_trace");
}
