/* clock.c - millisecond clocks. */
#include "clock.h"

#include <errno.h>
#include <time.h>

static int64_t read_ms(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t clock_now_ms(void)
{
    return read_ms(CLOCK_REALTIME);
}

int64_t clock_mono_ms(void)
{
    return read_ms(CLOCK_MONOTONIC);
}

int64_t clock_mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void clock_sleep_ms(int64_t ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void clock_deadline(struct timespec *ts, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

int clock_cond_wait(pthread_cond_t *cv, pthread_mutex_t *mu, const struct timespec *deadline)
{
    return pthread_cond_clockwait(cv, mu, CLOCK_MONOTONIC, deadline);
}
