/* thread.c - thread start-up with checked results; a per-thread seeded random source. */
#include "thread.h"

#include "mem.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* What a new thread starts with: it names itself (a detached thread may be gone before its
 * starter could name it), then runs fn(arg). */
struct start_args {
    void *(*fn)(void *);
    void *arg;
    char name[16]; /* the kernel keeps 15 characters */
};

static void *named_main(void *p)
{
    struct start_args a = *(struct start_args *)p;
    free(p);
    (void)pthread_setname_np(pthread_self(), a.name); /* a label for top -H, ps and perf */
    return a.fn(a.arg);
}

static enum cf_status start(pthread_t *out, const char *name, size_t stack_size,
                            void *(*fn)(void *), void *arg, bool detached, struct cf_error *err)
{
    pthread_attr_t attr;
    pthread_t t;
    struct start_args *a = mem_alloc(sizeof(*a));
    a->fn = fn;
    a->arg = arg;
    snprintf(a->name, sizeof(a->name), "%s", name);
    int rc = pthread_attr_init(&attr);
    if (rc == 0 && stack_size) {
        rc = pthread_attr_setstacksize(&attr, stack_size);
    }
    if (rc == 0 && detached) {
        rc = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    }
    if (rc == 0) {
        rc = pthread_create(&t, &attr, named_main, a);
    }
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(a);
        return cf_error_set(err, CF_BUSY, "could not start a thread: %s", strerror(rc));
    }
    if (out) {
        *out = t;
    }
    return CF_OK;
}

enum cf_status thread_start(pthread_t *out, const char *name, size_t stack_size,
                            void *(*fn)(void *), void *arg, struct cf_error *err)
{
    return start(out, name, stack_size, fn, arg, false, err);
}

enum cf_status thread_start_detached(const char *name, size_t stack_size, void *(*fn)(void *),
                                     void *arg, struct cf_error *err)
{
    return start(NULL, name, stack_size, fn, arg, true, err);
}

static _Thread_local uint64_t state;

uint64_t thread_random(void)
{
    if (!state) {
        uint64_t seed = 0;
        if (getrandom(&seed, sizeof(seed), GRND_NONBLOCK) != (ssize_t)sizeof(seed)) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)getpid() ^
                   (uint64_t)(uintptr_t)&seed;
        }
        state = seed ? seed : 0x9e3779b97f4a7c15ULL;
    }
    /* splitmix64: full period, good enough spread for jitter */
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int64_t thread_jitter_ms(int64_t max_ms)
{
    return max_ms > 0 ? (int64_t)(thread_random() % (uint64_t)max_ms) : 0;
}
