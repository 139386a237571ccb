/* guard.c - the signal and deadline watchdog of the cflue command; see guard.h.
 *
 * One detached thread waits in sigtimedwait for SIGINT/SIGTERM until the deadline. When it
 * fires it records why, cancels every registered channel (rpc_channel_cancel_all ends blocked
 * unary calls and streams with CANCELLED), and then gives the command GRACE_MS to return
 * through its ordinary path (main prints the reason and exits with the guard's code). If the
 * command is stuck anyway (in gRPC's shutdown, say) the guard prints the reason and _exits.
 */
#include "guard.h"

#include "clock.h"
#include "mem.h"
#include "print.h"
#include "thread.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_CHANNELS 8
#define GRACE_MS 1500

static struct {
    pthread_mutex_t mu;
    struct rpc_channel *channels[MAX_CHANNELS];
    int64_t deadline_at; /* clock_mono_ms; 0: none */
    int64_t deadline_ms;
    int fired;     /* 0, SIGINT, SIGTERM, or -1 for the deadline */
    bool reported; /* guard_exit_code printed the reason */
    char why[128];
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int exit_code_for(int fired)
{
    return fired == SIGINT    ? GUARD_EXIT_SIGINT
           : fired == SIGTERM ? GUARD_EXIT_SIGTERM
                              : GUARD_EXIT_DEADLINE;
}

static void fire(int why)
{
    pthread_mutex_lock(&g.mu);
    if (!g.fired) {
        g.fired = why;
        if (why > 0) {
            snprintf(g.why, sizeof(g.why), "interrupted by %s; the call was cancelled",
                     why == SIGINT ? "SIGINT" : "SIGTERM");
        } else {
            snprintf(g.why, sizeof(g.why),
                     "deadline of %lld ms passed (--deadline-ms or CFLUE_DEADLINE_MS); the call "
                     "was cancelled",
                     (long long)g.deadline_ms);
        }
    }
    for (int i = 0; i < MAX_CHANNELS; i++) {
        if (g.channels[i]) {
            rpc_channel_cancel_all(g.channels[i], g.why);
        }
    }
    pthread_mutex_unlock(&g.mu);
}

static void *guard_main(void *arg)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    for (;;) {
        int64_t wait_ms = 1000;
        if (g.deadline_at) {
            int64_t left = g.deadline_at - clock_mono_ms();
            if (left <= 0) {
                fire(-1);
                break;
            }
            wait_ms = left < wait_ms ? left : wait_ms;
        }
        struct timespec ts = {wait_ms / 1000, (long)(wait_ms % 1000) * 1000000L};
        int sig = sigtimedwait(&set, NULL, &ts);
        if (sig == SIGINT || sig == SIGTERM) {
            fire(sig);
            break;
        }
    }
    clock_sleep_ms(GRACE_MS);
    /* the command did not return in time: end the process here */
    pthread_mutex_lock(&g.mu);
    fprintf(stderr, "cflue: %s\n", g.why);
    int code = exit_code_for(g.fired);
    pthread_mutex_unlock(&g.mu);
    _exit(code);
    return arg;
}

bool guard_start(int64_t deadline_ms)
{
    struct cf_error err;
    if (deadline_ms > 0) {
        g.deadline_ms = deadline_ms;
        g.deadline_at = clock_mono_ms() + deadline_ms;
    }
    if (thread_start_detached("stream-guard", 0, guard_main, NULL, &err) != CF_OK) {
        fprintf(stderr, "cflue: cannot start the signal and deadline guard: %s\n", err.msg);
        return false;
    }
    return true;
}

struct rpc_channel *guard_channel(const char *target, int max_message_bytes)
{
    struct rpc_channel *ch = rpc_channel_new(target, max_message_bytes);
    pthread_mutex_lock(&g.mu);
    int i = 0;
    while (i < MAX_CHANNELS && g.channels[i]) {
        i++;
    }
    if (i == MAX_CHANNELS) {
        /* a command uses one or two channels at a time; more is a bug in the CLI */
        pthread_mutex_unlock(&g.mu);
        fprintf(stderr, "cflue: internal error: too many channels\n");
        abort();
    }
    g.channels[i] = ch;
    if (g.fired) {
        rpc_channel_cancel_all(ch, g.why);
    }
    pthread_mutex_unlock(&g.mu);
    return ch;
}

void guard_channel_free(struct rpc_channel *ch)
{
    if (!ch) {
        return;
    }
    pthread_mutex_lock(&g.mu);
    for (int i = 0; i < MAX_CHANNELS; i++) {
        if (g.channels[i] == ch) {
            g.channels[i] = NULL;
        }
    }
    pthread_mutex_unlock(&g.mu);
    rpc_channel_free(ch);
}

int64_t guard_timeout_ms(int64_t default_ms)
{
    if (!g.deadline_at) {
        return default_ms;
    }
    int64_t left = g.deadline_at - clock_mono_ms();
    if (left < 1) {
        left = 1;
    }
    return default_ms > 0 && default_ms < left ? default_ms : left;
}

int guard_fail(const struct rpc_status *st)
{
    if (st->code == GRPC_STATUS_DEADLINE_EXCEEDED && g.deadline_at &&
        clock_mono_ms() >= g.deadline_at) {
        fire(-1); /* gRPC's deadline for the call is the command's: guard_exit_code says so */
    }
    if (!guard_fired()) {
        /* the details may quote a model's or a tool's text */
        const char *details = st->details[0] ? st->details : "call failed";
        fputs("cflue: ", stderr);
        print_text(stderr, details, strlen(details), PRINT_ONE_LINE);
        fputs(st->reason[0] ? " [" : "", stderr);
        print_text(stderr, st->reason, strlen(st->reason), PRINT_ONE_LINE);
        fprintf(stderr, "%s (gRPC status %d)\n", st->reason[0] ? "]" : "", (int)st->code);
    }
    return 1;
}

bool guard_fired(void)
{
    pthread_mutex_lock(&g.mu);
    bool fired = g.fired != 0;
    pthread_mutex_unlock(&g.mu);
    return fired;
}

int guard_exit_code(int rc)
{
    if (rc != 0 && g.deadline_at && clock_mono_ms() >= g.deadline_at) {
        fire(-1); /* gRPC's own deadline ended the call first: same outcome */
    }
    pthread_mutex_lock(&g.mu);
    int fired = g.fired;
    if (fired && !g.reported) {
        g.reported = true;
        fprintf(stderr, "cflue: %s\n", g.why);
    }
    pthread_mutex_unlock(&g.mu);
    return fired ? exit_code_for(fired) : rc;
}
