/* Unit tests of agentd/model_io.c and the provider calls on it, against the real fake model
 * (tests/fake_model/fake_model.py, started here as a subprocess): connections kept alive
 * (counted by the server's /_stats), concurrency, cancellation, broken streams, the cap on
 * transfers in flight, and shutdown with calls in flight.
 *
 * Timing bounds are multiplied by 10 under CFLUE_TSAN or CFLUE_SLOW (valgrind). */
#include "../check.h"

#include "clock.h"
#include "mem.h"
#include "model_io.h"
#include "provider.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef FAKE_MODEL_PY
#define FAKE_MODEL_PY "tests/fake_model/fake_model.py"
#endif

extern char **environ;

static int g_port;
static pid_t g_fake;
static int64_t g_slack = 1;
static char g_anthropic_url[64], g_openai_url[64];

/* epoll_ctl, as model_io.c calls it (linked with -Wl,--wrap=epoll_ctl): while g_epoll_fail
 * is set, a socket cannot join or change in the epoll set (ENOMEM), as when the kernel is
 * out of memory or the user's max_user_watches is reached. */
static atomic_int g_epoll_fail;
int __real_epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev);
int __wrap_epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev);
int __wrap_epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
    if (atomic_load(&g_epoll_fail) && (op == EPOLL_CTL_ADD || op == EPOLL_CTL_MOD)) {
        errno = ENOMEM;
        return -1;
    }
    return __real_epoll_ctl(epfd, op, fd, ev);
}

/* ---------- the fake model ---------- */

static bool fake_start(void)
{
    const char *script = getenv("CFLUE_FAKE_MODEL") ? getenv("CFLUE_FAKE_MODEL") : FAKE_MODEL_PY;
    int fds[2];
    if (pipe(fds) != 0) {
        return false;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    char *argv[] = {"/usr/bin/python3", (char *)script, "--port", "0", "--quiet", NULL};
    int rc = posix_spawn(&g_fake, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        return false;
    }
    char line[128];
    size_t n = 0;
    while (n < sizeof(line) - 1) {
        ssize_t k = read(fds[0], line + n, 1);
        if (k <= 0 || line[n] == '\n') {
            break;
        }
        n++;
    }
    line[n] = 0;
    close(fds[0]);
    if (sscanf(line, "listening on %d", &g_port) != 1) {
        fprintf(stderr, "fake model did not start: '%s'\n", line);
        return false;
    }
    snprintf(g_anthropic_url, sizeof(g_anthropic_url), "http://127.0.0.1:%d", g_port);
    snprintf(g_openai_url, sizeof(g_openai_url), "http://127.0.0.1:%d/v1", g_port);
    return true;
}

static void fake_stop(void)
{
    kill(g_fake, SIGTERM);
    int st = 0;
    waitpid(g_fake, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static size_t collect(char *p, size_t size, size_t n, void *ctx)
{
    struct buf *b = ctx;
    return buf_append(b, p, size * n) == CF_OK ? size * n : 0;
}

/* http makes one request on its own connection (control traffic, not counted by /_stats);
 * returns the body parsed as JSON. */
static json_t *http(const char *path, const char *post)
{
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d%s", g_port, path);
    struct buf b;
    buf_init(&b, 1 << 20);
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    if (post) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, post);
    }
    CURLcode cc = curl_easy_perform(c);
    curl_easy_cleanup(c);
    json_t *j = cc == CURLE_OK ? json_loads(buf_cstr(&b), 0, NULL) : NULL;
    buf_cleanup(&b);
    return j;
}

struct counts {
    int64_t connections, requests;
};

static struct counts stats(void)
{
    json_t *j = http("/_stats", NULL);
    struct counts c = {json_integer_value(json_object_get(j, "connections")),
                       json_integer_value(json_object_get(j, "requests"))};
    CHECK(j != NULL);
    json_decref(j);
    return c;
}

static void scenario(const char *steps_json)
{
    json_t *j = http("/_fake/scenario", steps_json);
    CHECK(json_is_true(json_object_get(j, "ok")));
    json_decref(j);
}

/* ---------- calls ---------- */

static const struct llm_tool k_tools[] = {
    {"bash", "Run a command",
     "{\"type\":\"object\",\"properties\":{\"command\":{\"type\":"
     "\"string\"}},\"required\":[\"command\"]}",
     NULL}, /* no schema_text: each request reads schema_json (llm_schema_write) */
};

struct texts {
    struct buf b;
    pthread_t thread;
    bool bad; /* on_text ran on a thread other than the caller's, or overflowed */
};

static void on_text(void *ctx, const char *p, size_t n)
{
    struct texts *t = ctx;
    if (!pthread_equal(pthread_self(), t->thread) || buf_append(&t->b, p, n) != CF_OK) {
        t->bad = true;
    }
}

/* g_inconsistent counts calls whose streamed text did not reach on_text whole, on the
 * caller's thread (counted here, CHECKed on the main thread: check.h is not thread-safe) */
static atomic_int g_inconsistent;

static atomic_bool g_cancel;

static bool cancelled(void *ctx)
{
    return atomic_load(&g_cancel);
}

/* call makes one llm_complete with the user text msg; returns its status. */
static enum cf_status call(bool anthropic, bool stream, const char *msg, int64_t timeout_ms,
                           struct llm_response *out, struct cf_error *err)
{
    struct provider_endpoint ep = {.base_url = anthropic ? g_anthropic_url : g_openai_url,
                                   .api_key = "test-key",
                                   .timeout_ms = 30000};
    struct llm_message m = {.role = LLM_USER, .text = msg};
    struct llm_request req = {.provider = anthropic ? "anthropic" : "openai",
                              .model = "test-model",
                              .system = "You are a test.",
                              .messages = &m,
                              .n_messages = 1,
                              .tools = k_tools,
                              .n_tools = 1,
                              .max_tokens = 256,
                              .stream = stream,
                              .timeout_ms = timeout_ms};
    struct texts t = {.thread = pthread_self()};
    buf_init(&t.b, 1 << 20);
    struct llm_events ev = {.on_text = on_text, .cancelled = cancelled, .ctx = &t};
    llm_response_init(out);
    enum cf_status rc = llm_complete(&ep, &req, &ev, out, err);
    if (t.bad || (rc == CF_OK && stream && strcmp(buf_cstr(&t.b), buf_cstr(&out->text)))) {
        atomic_fetch_add(&g_inconsistent, 1);
    }
    buf_cleanup(&t.b);
    return rc;
}

/* 50 sequential calls, both providers, streamed and not, text and tool calls: one
 * connection. */
static void test_sequential_reuse(void)
{
    json_t *steps = json_array();
    for (int i = 0; i < 50; i++) {
        char text[32];
        snprintf(text, sizeof(text), "answer %d", i);
        json_t *s = json_pack("{s:s}", "text", text);
        if (i % 5 == 4) {
            json_object_set_new(
                s, "tool_calls",
                json_pack("[{s:s, s:{s:s}}]", "name", "bash", "arguments", "command", "ls"));
        }
        json_array_append_new(steps, s);
    }
    json_t *sc = json_pack("{s:o}", "steps", steps);
    char *body = json_dumps(sc, JSON_COMPACT);
    json_decref(sc);
    scenario(body);
    free(body);

    struct counts before = stats();
    int64_t t0 = clock_mono_ms();
    int ok = 0;
    for (int i = 0; i < 50; i++) {
        struct llm_response r;
        struct cf_error err = {0};
        bool anthropic = i % 2 == 0, stream = (i / 2) % 2 == 0;
        enum cf_status rc = call(anthropic, stream, "hello", 0, &r, &err);
        char want[32];
        snprintf(want, sizeof(want), "answer %d", i);
        if (rc == CF_OK && !strcmp(buf_cstr(&r.text), want) &&
            r.n_calls == (i % 5 == 4 ? 1u : 0u) &&
            !strcmp(r.stop_reason, i % 5 == 4 ? "tool_use" : "end_turn")) {
            ok++;
        } else {
            fprintf(stderr, "call %d: rc=%d text='%s' calls=%zu stop=%s err=%s\n", i, rc,
                    buf_cstr(&r.text), r.n_calls, r.stop_reason, err.msg);
        }
        if (i % 5 == 4 && r.n_calls == 1) {
            CHECK_STR(r.calls[0].name, "bash");
            CHECK_STR(r.calls[0].arguments_json, "{\"command\":\"ls\"}");
        }
        llm_response_cleanup(&r);
    }
    CHECK(ok == 50);
    struct counts after = stats();
    printf("sequential: 50 calls in %lld ms over %lld connection(s)\n",
           (long long)(clock_mono_ms() - t0), (long long)(after.connections - before.connections));
    CHECK(after.requests - before.requests == 50);
    CHECK(after.connections - before.connections == 1);
    struct model_io_stats ms;
    model_io_shared_stats(&ms);
    CHECK(ms.connects == 1 && ms.started == 50 && ms.in_flight == 0);
}

#define THREADS 8
#define PER_THREAD 5

struct worker {
    int k;
    int ok;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    for (int j = 0; j < PER_THREAD; j++) {
        char msg[64], want[64];
        snprintf(msg, sizeof(msg), "thread-%d call-%d", w->k, j);
        snprintf(want, sizeof(want), "reply %d %d", w->k, j);
        struct llm_response r;
        struct cf_error err = {0};
        enum cf_status rc = call(w->k % 2 == 0, j % 2 == 0, msg, 0, &r, &err);
        if (rc == CF_OK && !strcmp(buf_cstr(&r.text), want)) {
            w->ok++;
        } else {
            fprintf(stderr, "%s: rc=%d text='%s' err=%s\n", msg, rc, buf_cstr(&r.text), err.msg);
        }
        llm_response_cleanup(&r);
    }
    return NULL;
}

/* 8 threads calling at once: each gets its own answer; at most 8 connections. */
static void test_concurrent(void)
{
    json_t *steps = json_array();
    for (int k = 0; k < THREADS; k++) {
        for (int j = 0; j < PER_THREAD; j++) {
            char m[64], t[64];
            snprintf(m, sizeof(m), "thread-%d call-%d", k, j);
            snprintf(t, sizeof(t), "reply %d %d", k, j);
            json_array_append_new(steps,
                                  json_pack("{s:{s:s}, s:s, s:i}", "match", "last_user_contains", m,
                                            "text", t, "delay_ms", 30));
        }
    }
    json_t *sc = json_pack("{s:o}", "steps", steps);
    char *body = json_dumps(sc, JSON_COMPACT);
    json_decref(sc);
    scenario(body);
    free(body);

    struct counts before = stats();
    pthread_t th[THREADS];
    struct worker w[THREADS];
    for (int k = 0; k < THREADS; k++) {
        w[k] = (struct worker){.k = k};
        CHECK(pthread_create(&th[k], NULL, worker_main, &w[k]) == 0);
    }
    int ok = 0;
    for (int k = 0; k < THREADS; k++) {
        pthread_join(th[k], NULL);
        ok += w[k].ok;
    }
    struct counts after = stats();
    printf("concurrent: %d calls from %d threads over %lld connection(s)\n", THREADS * PER_THREAD,
           THREADS, (long long)(after.connections - before.connections));
    CHECK(ok == THREADS * PER_THREAD);
    CHECK(after.requests - before.requests == THREADS * PER_THREAD);
    CHECK(after.connections - before.connections <= THREADS);
}

struct slow_call {
    enum cf_status rc;
    struct cf_error err;
    int64_t ended_ms;
    bool stream;
};

static void *slow_main(void *arg)
{
    struct slow_call *s = arg;
    struct llm_response r;
    s->rc = call(true, s->stream, s->stream ? "slow stream" : "slow answer", 0, &r, &s->err);
    s->ended_ms = clock_mono_ms();
    llm_response_cleanup(&r);
    return NULL;
}

/* A cancelled call ends within 100 ms (its events->cancelled is asked on the calling thread),
 * and the next call works. */
static void test_cancel(void)
{
    scenario("{\"steps\": [{\"text\": \"slow\", \"delay_ms\": 5000},"
             " {\"match\": {\"last_user_contains\": \"slow stream\"}, \"text\": \"slow stream\","
             " \"chunk_delay_ms\": 5000},"
             " {\"text\": \"after the cancel\"}]}");
    for (int i = 0; i < 2; i++) {
        struct slow_call s = {.stream = i == 1};
        pthread_t th;
        atomic_store(&g_cancel, false);
        CHECK(pthread_create(&th, NULL, slow_main, &s) == 0);
        clock_sleep_ms(300);
        int64_t t0 = clock_mono_ms();
        atomic_store(&g_cancel, true);
        pthread_join(th, NULL);
        atomic_store(&g_cancel, false);
        printf("cancel (%s): ended %lld ms after the request\n", i ? "mid-stream" : "waiting",
               (long long)(s.ended_ms - t0));
        CHECK(s.rc == CF_CANCELLED);
        CHECK(s.ended_ms - t0 < 100 * g_slack);
    }
    struct llm_response r;
    struct cf_error err;
    CHECK(call(true, true, "next", 0, &r, &err) == CF_OK);
    CHECK_STR(buf_cstr(&r.text), "after the cancel");
    llm_response_cleanup(&r);
}

struct async_done {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int calls;
    enum cf_status rc;
    int64_t at_ms;
};

static void async_done(void *ctx, enum cf_status rc, const struct cf_error *err)
{
    struct async_done *d = ctx;
    pthread_mutex_lock(&d->mu);
    d->calls++;
    d->rc = rc;
    d->at_ms = clock_mono_ms();
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

static void async_wait(struct async_done *d, int calls)
{
    pthread_mutex_lock(&d->mu);
    while (d->calls < calls) {
        pthread_cond_wait(&d->cv, &d->mu);
    }
    pthread_mutex_unlock(&d->mu);
}

/* llm_start / llm_cancel: the asynchronous calls the engine steps on; done runs once. */
static void test_async(void)
{
    scenario("{\"steps\": [{\"text\": \"async answer\"}, {\"text\": \"slow\", \"delay_ms\": "
             "5000}]}");
    struct provider_endpoint ep = {.base_url = g_openai_url, .api_key = "k"};
    struct llm_message m = {.role = LLM_USER, .text = "hi"};
    struct llm_request req = {.provider = "openai",
                              .model = "gpt-test",
                              .messages = &m,
                              .n_messages = 1,
                              .max_tokens = 64,
                              .stream = true};
    struct async_done d = {.rc = CF_INTERNAL};
    pthread_mutex_init(&d.mu, NULL);
    pthread_cond_init(&d.cv, NULL);
    struct llm_response r;
    llm_response_init(&r);
    struct cf_error err;
    uint64_t id = 0;
    CHECK(llm_start(&ep, &req, NULL, &r, async_done, &d, &id, &err) == CF_OK);
    CHECK(id != 0);
    async_wait(&d, 1);
    CHECK(d.rc == CF_OK);
    CHECK_STR(buf_cstr(&r.text), "async answer");
    llm_cancel(id); /* ended: a no-op */
    llm_response_cleanup(&r);

    llm_response_init(&r);
    CHECK(llm_start(&ep, &req, NULL, &r, async_done, &d, &id, &err) == CF_OK);
    clock_sleep_ms(200);
    int64_t t0 = clock_mono_ms();
    llm_cancel(id);
    llm_cancel(id);
    async_wait(&d, 2);
    CHECK(d.rc == CF_CANCELLED);
    CHECK(d.at_ms - t0 < 100 * g_slack);
    clock_sleep_ms(50);
    CHECK(d.calls == 2); /* once each */
    llm_response_cleanup(&r);

    req.provider = "google";
    CHECK(llm_start(&ep, &req, NULL, &r, async_done, &d, &id, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "google") != NULL);
    pthread_cond_destroy(&d.cv);
    pthread_mutex_destroy(&d.mu);
}

/* A server that closes the connection mid-answer gives a retryable error at once; so do HTTP
 * errors that a retry may mend; the request's timeout (the work's time left) running out is
 * CF_DEADLINE, not retried; the next call works. */
static void test_broken(void)
{
    scenario("{\"steps\": ["
             "{\"text\": \"a long answer that is cut\", \"disconnect_after_chunks\": 3},"
             "{\"text\": \"a long answer that is cut\", \"disconnect_after_chunks\": 3},"
             "{\"text\": \"half a body\", \"disconnect_after_chunks\": 1},"
             "{\"error\": {\"status\": 429, \"retry_after\": 2}},"
             "{\"error\": {\"status\": 529, \"in_stream\": true}},"
             "{\"error\": {\"status\": 401}},"
             "{\"error\": {\"status\": 400, \"message\": \"prompt is too long: 300000 tokens > "
             "200000 maximum\"}},"
             "{\"text\": \"too slow\", \"delay_ms\": 3000},"
             "{\"text\": \"whole again\"}]}");
    struct {
        bool anthropic, stream;
        int64_t timeout_ms;
        enum cf_status rc;
        bool retryable;
    } cases[] = {
        {true, true, 0, CF_UNAVAILABLE, true},  {false, true, 0, CF_UNAVAILABLE, true},
        {true, false, 0, CF_UNAVAILABLE, true}, {false, false, 0, CF_UNAVAILABLE, true},
        {true, true, 0, CF_UNAVAILABLE, true},  {true, false, 0, CF_INVALID, false},
        {true, false, 0, CF_INVALID, false},    {true, true, 300, CF_DEADLINE, false},
        {false, true, 0, CF_OK, false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct llm_response r;
        struct cf_error err = {0};
        int64_t t0 = clock_mono_ms();
        enum cf_status rc =
            call(cases[i].anthropic, cases[i].stream, "hi", cases[i].timeout_ms, &r, &err);
        int64_t took = clock_mono_ms() - t0;
        if (rc != cases[i].rc || r.retryable != cases[i].retryable) {
            fprintf(stderr, "broken case %zu: rc=%d retryable=%d err=%s\n", i, rc, r.retryable,
                    err.msg);
        }
        CHECK(rc == cases[i].rc);
        CHECK(r.retryable == cases[i].retryable);
        CHECK(took < 2000 * g_slack);
        if (i == 3) {
            CHECK(r.retry_after_ms == 2000 && r.http_status == 429);
        }
        if (i == 5) {
            CHECK(strstr(err.msg, "credentials") != NULL);
        }
        if (i == 6) {
            CHECK(r.context_overflow);
        }
        if (i == 8) {
            CHECK_STR(buf_cstr(&r.text), "whole again");
        }
        llm_response_cleanup(&r);
    }
    /* nothing listens on this port: a network error, retryable */
    struct provider_endpoint ep = {.base_url = "http://127.0.0.1:1", .api_key = "k"};
    struct llm_message m = {.role = LLM_USER, .text = "hi"};
    struct llm_request req = {
        .provider = "anthropic", .model = "m", .messages = &m, .n_messages = 1, .max_tokens = 8};
    struct llm_response r;
    struct cf_error err;
    llm_response_init(&r);
    CHECK(llm_complete(&ep, &req, NULL, &r, &err) == CF_UNAVAILABLE);
    CHECK(r.retryable && strstr(err.msg, "could not be reached") != NULL);
    llm_response_cleanup(&r);
}

/* A connection that breaks after the stream's last event (message_stop, [DONE]) lost nothing:
 * the answer stands. One that breaks a step before it is cut short, as before. */
static void test_cut_after_the_end(void)
{
    /* "abcdefg" streams in 3 text pieces: Anthropic sends 9 events (message_start,
     * content_block_start, ping, 3 deltas, content_block_stop, message_delta, message_stop),
     * OpenAI 7 (the role, 3 pieces, the finish, the usage, [DONE]) */
    scenario("{\"steps\": ["
             "{\"text\": \"abcdefg\", \"disconnect_after_chunks\": 9},"
             "{\"text\": \"abcdefg\", \"disconnect_after_chunks\": 7},"
             "{\"text\": \"abcdefg\", \"disconnect_after_chunks\": 8},"
             "{\"text\": \"abcdefg\", \"disconnect_after_chunks\": 6}]}");
    struct {
        bool anthropic;
        enum cf_status rc;
    } cases[] = {{true, CF_OK}, {false, CF_OK}, {true, CF_UNAVAILABLE}, {false, CF_UNAVAILABLE}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct llm_response r;
        struct cf_error err = {0};
        enum cf_status rc = call(cases[i].anthropic, true, "hi", 0, &r, &err);
        if (rc != cases[i].rc) {
            fprintf(stderr, "cut case %zu: rc=%d err=%s\n", i, rc, err.msg);
        }
        CHECK(rc == cases[i].rc);
        if (rc == CF_OK) {
            CHECK_STR(buf_cstr(&r.text), "abcdefg");
            CHECK(r.output_tokens > 0); /* the usage came, before the end */
        } else {
            CHECK(r.retryable);
        }
        llm_response_cleanup(&r);
    }
}

/* The stall window (60 s by default) bounds a streamed answer's silences only: a whole
 * answer (no stream) sends nothing until it is written, however long that takes. (libcurl
 * averages the speed over its last few seconds: a 1 s window notices a silence after about
 * 6 s, hence the 9 s silences of both.) */
static void test_stall_is_for_streams(void)
{
    scenario("{\"steps\": ["
             "{\"text\": \"slow but whole\", \"delay_ms\": 9000},"
             "{\"text\": \"one two three four\", \"chunk_delay_ms\": 9000}]}");
    struct provider_endpoint ep = {
        .base_url = g_anthropic_url, .api_key = "k", .timeout_ms = 30000, .stall_ms = 1000};
    struct llm_message m = {.role = LLM_USER, .text = "hi"};
    struct llm_request req = {
        .provider = "anthropic", .model = "m", .messages = &m, .n_messages = 1, .max_tokens = 64};
    struct llm_response r;
    struct cf_error err = {0};
    llm_response_init(&r);
    CHECK(llm_complete(&ep, &req, NULL, &r, &err) == CF_OK);
    CHECK_STR(buf_cstr(&r.text), "slow but whole");
    llm_response_cleanup(&r);
    req.stream = true;
    llm_response_init(&r);
    int64_t t0 = clock_mono_ms();
    enum cf_status rc = llm_complete(&ep, &req, NULL, &r, &err);
    CHECK(rc != CF_OK && r.retryable);
    CHECK(clock_mono_ms() - t0 < 20000); /* the stall, not the call's 30 s */
    llm_response_cleanup(&r);
}

/* Retry-After: delay-seconds of any size (up to a day), a fraction, an HTTP-date; nothing
 * usable is 0. */
static void test_retry_after(void)
{
    time_t now = curl_getdate("Wed, 21 Oct 2026 07:28:00 GMT", NULL);
    CHECK(now > 0);
    CHECK(llm_retry_after_ms("2", now) == 2000);
    CHECK(llm_retry_after_ms(" 1.5\r\n", now) == 1500);
    CHECK(llm_retry_after_ms("7200", now) == 7200000); /* was dropped, then retried at once */
    CHECK(llm_retry_after_ms("999999999", now) == LLM_RETRY_AFTER_MAX_MS);
    CHECK(llm_retry_after_ms("Wed, 21 Oct 2026 07:28:30 GMT", now) == 30000);
    CHECK(llm_retry_after_ms("Wed, 21 Oct 2026 07:27:00 GMT", now) == 0); /* past */
    CHECK(llm_retry_after_ms("-5", now) == 0);
    CHECK(llm_retry_after_ms("soon", now) == 0);
    CHECK(llm_retry_after_ms("3 s", now) == 0);
    CHECK(llm_retry_after_ms("", now) == 0);
}

struct raw_done {
    atomic_int calls;
    atomic_int cancelled;
};

static void raw_done(void *ctx, const struct model_io_result *res)
{
    struct raw_done *d = ctx;
    atomic_fetch_add(&d->calls, 1);
    if (res->status == CF_CANCELLED) {
        atomic_fetch_add(&d->cancelled, 1);
    }
}

/* raw_request asks the fake model at url for a short answer, straight through model_io. */
static struct model_io_request raw_request(const char *url, int64_t timeout_ms,
                                           void (*on_done)(void *, const struct model_io_result *),
                                           void *ctx)
{
    static const char *headers[] = {"content-type: application/json",
                                    "anthropic-version: 2023-06-01"};
    struct model_io_request r = {
        .url = url,
        .headers = headers,
        .n_headers = 2,
        .body_take = mem_strdup("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":"
                                "\"user\",\"content\":\"hi\"}]}"),
        .timeout_ms = timeout_ms,
        .on_done = on_done,
        .ctx = ctx,
    };
    r.body_len = strlen(r.body_take);
    return r;
}

/* A private model_io: the cap on transfers in flight, and model_io_free with transfers in
 * flight. */
static void test_cap_and_free(void)
{
    scenario("{\"steps\": [{\"text\": \"slow\", \"delay_ms\": 5000},"
             " {\"text\": \"slow\", \"delay_ms\": 5000}]}");
    struct model_io *io = NULL;
    struct cf_error err;
    CHECK(model_io_new(&io, &(struct model_io_opts){.max_transfers = 2}, &err) == CF_OK);
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/v1/messages", g_port);
    struct raw_done d = {0};
    for (int i = 0; i < 3; i++) {
        struct model_io_request r = raw_request(url, 0, raw_done, &d);
        uint64_t id;
        enum cf_status rc = model_io_start(io, &r, &id, &err);
        CHECK(rc == (i < 2 ? CF_OK : CF_BUSY));
        if (i == 2) {
            CHECK(strstr(err.msg, "2 model calls are in flight") != NULL);
        }
    }
    struct model_io_stats st;
    model_io_get_stats(io, &st);
    CHECK(st.in_flight == 2 && st.started == 2);
    clock_sleep_ms(200);
    int64_t t0 = clock_mono_ms();
    model_io_free(io);
    int64_t took = clock_mono_ms() - t0;
    printf("model_io_free with 2 transfers in flight: %lld ms\n", (long long)took);
    CHECK(took < 100 * g_slack);
    CHECK(atomic_load(&d.calls) == 2 && atomic_load(&d.cancelled) == 2);
}

struct timed_done {
    atomic_int calls;
    atomic_int status;
    atomic_llong ended_ms;
    char msg[sizeof(((struct cf_error *)0)->msg)];
};

static void timed_done(void *ctx, const struct model_io_result *res)
{
    struct timed_done *d = ctx;
    snprintf(d->msg, sizeof(d->msg), "%s", res->err.msg);
    atomic_store(&d->status, (int)res->status);
    atomic_store(&d->ended_ms, (long long)clock_mono_ms());
    atomic_fetch_add(&d->calls, 1);
}

/* start_raw starts raw_request on io; d hears how it ended. */
static void start_raw(struct model_io *io, const char *url, int64_t timeout_ms,
                      struct timed_done *d)
{
    struct model_io_request r = raw_request(url, timeout_ms, timed_done, d);
    uint64_t id = 0;
    struct cf_error err;
    CHECK(model_io_start(io, &r, &id, &err) == CF_OK);
}

static bool wait_done(struct timed_done *d, int64_t ms)
{
    int64_t until = clock_mono_ms() + ms;
    while (!atomic_load(&d->calls) && clock_mono_ms() < until) {
        clock_sleep_ms(5);
    }
    return atomic_load(&d->calls) == 1;
}

/* A transfer whose socket cannot be watched ends alone, as a network failure, at once; the
 * loop goes on: a transfer already waiting still times out on time, and the next one
 * completes. */
static void test_unwatched(void)
{
    scenario("{\"steps\": [{\"text\": \"slow\", \"delay_ms\": 3000}, {\"text\": \"fine\"}]}");
    struct model_io *io = NULL;
    struct cf_error err;
    CHECK(model_io_new(&io, NULL, &err) == CF_OK);
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/v1/messages", g_port);
    struct timed_done waiting = {0}, unwatched = {0}, next = {0};
    int64_t t0 = clock_mono_ms();
    start_raw(io, url, 1000, &waiting);
    clock_sleep_ms(300); /* it has sent its request and waits for the answer */
    atomic_store(&g_epoll_fail, 1);
    int64_t t1 = clock_mono_ms();
    start_raw(io, url, 0, &unwatched);
    CHECK(wait_done(&unwatched, 2000 * g_slack));
    atomic_store(&g_epoll_fail, 0);
    CHECK(atomic_load(&unwatched.status) == CF_UNAVAILABLE);
    CHECK(strstr(unwatched.msg, "could not be watched") != NULL);
    CHECK(atomic_load(&unwatched.ended_ms) - t1 < 500 * g_slack);
    CHECK(wait_done(&waiting, 3000 * g_slack));
    CHECK(atomic_load(&waiting.status) == CF_DEADLINE);
    long long waited = atomic_load(&waiting.ended_ms) - t0;
    printf("unwatched: ended after %lld ms; the waiting transfer timed out after %lld ms\n",
           atomic_load(&unwatched.ended_ms) - (long long)t1, waited);
    CHECK(waited >= 900 && waited < 1000 + 500 * g_slack);
    start_raw(io, url, 10000, &next);
    CHECK(wait_done(&next, 5000 * g_slack));
    CHECK(atomic_load(&next.status) == CF_OK);
    model_io_free(io);
}

/* model_io_shutdown with llm_complete calls in flight: they end CF_CANCELLED at once; a
 * later call starts a fresh loop. */
static void test_shutdown(void)
{
    /* the streamed calls are cut mid-stream, the others while waiting for the answer */
    scenario("{\"steps\": [{\"text\": \"slow\", \"delay_ms\": 5000},"
             "{\"text\": \"slow\", \"delay_ms\": 5000},"
             "{\"match\": {\"last_user_contains\": \"slow stream\"}, \"text\": \"slow\","
             " \"chunk_delay_ms\": 5000},"
             "{\"match\": {\"last_user_contains\": \"slow stream\"}, \"text\": \"slow\","
             " \"chunk_delay_ms\": 5000},"
             "{\"text\": \"fresh\"}]}");
    struct slow_call s[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (struct slow_call){.stream = i % 2 == 1};
        CHECK(pthread_create(&th[i], NULL, slow_main, &s[i]) == 0);
    }
    clock_sleep_ms(300);
    int64_t t0 = clock_mono_ms();
    model_io_shutdown();
    int64_t took = clock_mono_ms() - t0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        if (s[i].rc != CF_CANCELLED) {
            fprintf(stderr, "shutdown: call %d: rc=%d err=%s\n", i, s[i].rc, s[i].err.msg);
        }
        CHECK(s[i].rc == CF_CANCELLED);
        CHECK(s[i].ended_ms - t0 < 200 * g_slack);
    }
    printf("shutdown with 4 calls in flight: %lld ms\n", (long long)took);
    CHECK(took < 200 * g_slack);
    model_io_shutdown(); /* idempotent */
    struct llm_response r;
    struct cf_error err;
    CHECK(call(true, false, "again", 0, &r, &err) == CF_OK);
    CHECK_STR(buf_cstr(&r.text), "fresh");
    llm_response_cleanup(&r);
    model_io_shutdown();
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    if (getenv("CFLUE_TSAN") || getenv("CFLUE_SLOW")) {
        g_slack = 10;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!fake_start()) {
        CHECK(!"the fake model started");
        return check_done("test_model_io");
    }
    test_sequential_reuse();
    test_concurrent();
    test_cancel();
    test_async();
    test_broken();
    test_cut_after_the_end();
    test_stall_is_for_streams();
    test_retry_after();
    test_cap_and_free();
    test_unwatched();
    test_shutdown();
    CHECK(atomic_load(&g_inconsistent) == 0);
    fake_stop();
    curl_global_cleanup();
    return check_done("test_model_io");
}
