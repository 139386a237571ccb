/* model_io.c - the event loop that carries every model transfer (see model_io.h).
 *
 * Method. One thread owns the CURLM, the CURLSH and every easy handle: nothing but the loop
 * thread calls into libcurl, so libcurl needs no locks. The loop is event-driven: libcurl
 * tells it which sockets to watch (CURLMOPT_SOCKETFUNCTION, kept in an epoll set) and when
 * to come back (CURLMOPT_TIMERFUNCTION), and the loop hands it only the sockets that are
 * ready (curl_multi_socket_action). One event costs the same with one transfer in flight as
 * with a thousand, where curl_multi_perform and curl_multi_poll visit every transfer and
 * every socket on each wake-up. Other threads talk to the loop through io->mu, and wake it
 * with a write to an eventfd in the same epoll set:
 *
 *   start:  the transfer gets a slot (its id is the slot plus a process-wide sequence number,
 *           so an old id never names a new transfer), joins io->pending, and the loop is woken.
 *           The loop makes its easy handle and adds it to the multi.
 *   cancel: the id is looked up through its slot; a live transfer gets cancel_requested and
 *           its id joins io->cancels; the loop is woken, removes it from the multi and ends
 *           it.
 *   free:   stopping is set and the loop woken; the loop ends every transfer it holds or that
 *           is pending, then returns, and the caller joins it.
 *
 * Invariants. A transfer is in exactly one place: io->pending (queued, no easy handle yet), or
 * the loop's active list (in the multi). It holds its slot from start until end(), which is
 * the only place a transfer is freed, runs on the loop thread, and calls on_done exactly once
 * without io->mu held (so on_done may start or cancel transfers). in_flight counts the slots
 * taken. Each loop iteration: take pending and cancels, add, cancel, run libcurl's timer when
 * it is due, reap finished transfers, ask the cancelled checks (at most every
 * MODEL_IO_CANCEL_POLL_MS), wait for events (epoll_wait, until the timer or the next check),
 * hand each ready socket to libcurl, reap.
 */
#include "model_io.h"

#include "clock.h"
#include "log.h"
#include "mem.h"
#include "thread.h"

#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define SLOT_BITS 16
/* events taken from the epoll set per epoll_wait */
#define EVENTS_PER_WAIT 64
/* sockets libcurl may let go of while one batch of events is handed to it (more: the rest
 * of the batch waits for the next epoll_wait, which reports what is still ready) */
#define REMOVED_PER_BATCH 64

struct xfer {
    uint64_t id;
    int slot;
    struct model_io_request r; /* url and headers not used; body_take owned */
    char *url;
    struct curl_slist *headers;
    CURL *easy;
    int64_t started_ms;
    bool refused;          /* on_header/on_body returned false */
    bool cancel_requested; /* under io->mu */
    bool unwatched;        /* its socket could not join the epoll set: on io->unwatched */
    struct xfer *unwatched_next;
    char errbuf[CURL_ERROR_SIZE];
    struct xfer *next, *prev; /* io->pending (next only) or the active list */
};

struct model_io {
    pthread_mutex_t mu;
    /* under mu */
    bool stopping;
    struct xfer **slots; /* max_transfers entries */
    int *free_slots;     /* a stack of free slot numbers */
    int n_free;
    struct xfer *pending, *pending_tail;
    /* ids of transfers to cancel: one per transfer (cancel_requested); the transfers named
     * between two iterations are at most those live at the first plus those started on the
     * slots it freed, hence 2 * max_transfers */
    uint64_t *cancels;
    int n_cancels;
    int64_t started, connects;
    /* loop thread only */
    CURLM *multi;
    CURLSH *share;
    int epfd;            /* libcurl's sockets and wake_fd */
    int64_t timer_at_ms; /* when libcurl wants its timer run (-1: no timer) */
    struct xfer *active;
    int n_polled;           /* active transfers with a cancelled check */
    struct xfer *unwatched; /* transfers to end: a socket of theirs could not be watched */
    /* the sockets libcurl let go of during the batch dispatch() is handing it, whose
     * remaining events in the batch are stale (the fd may be another socket by now) */
    bool in_batch;
    int n_removed;
    int removed[REMOVED_PER_BATCH];
    int64_t polled_at_ms;
    uint64_t *cancels_work;
    /* fixed */
    int wake_fd; /* eventfd: other threads write to it to wake the loop */
    int max_transfers;
    pthread_t thread;
    bool thread_started;
};

static atomic_uint_fast64_t g_seq = 1;

/* ---------- the loop thread ---------- */

static size_t on_write(char *p, size_t size, size_t n, void *ctx)
{
    struct xfer *x = ctx;
    size_t len = size * n;
    if (x->r.on_body && !x->r.on_body(x->r.ctx, p, len)) {
        x->refused = true;
        return 0;
    }
    return len;
}

static size_t on_header(char *p, size_t size, size_t n, void *ctx)
{
    struct xfer *x = ctx;
    size_t len = size * n;
    if (x->r.on_header && !x->r.on_header(x->r.ctx, p, len)) {
        x->refused = true;
        return 0;
    }
    return len;
}

/* setup makes x's easy handle; false when libcurl could not. */
static bool setup(struct model_io *io, struct xfer *x)
{
    CURL *e = curl_easy_init();
    if (!e) {
        return false;
    }
    x->easy = e;
    curl_easy_setopt(e, CURLOPT_PRIVATE, x);
    curl_easy_setopt(e, CURLOPT_URL, x->url);
    curl_easy_setopt(e, CURLOPT_SHARE, io->share);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, x->headers);
    curl_easy_setopt(e, CURLOPT_POST, 1L);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, x->r.body_take ? x->r.body_take : "");
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)x->r.body_len);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->errbuf);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_2TLS);
    /* over TLS, a second transfer to a host whose connection is still being set up waits to
     * learn whether it can share it (HTTP/2) instead of opening another; plain http:// is
     * HTTP/1.1 here, where waiting would only queue concurrent calls behind the first answer */
    if (!strncasecmp(x->url, "https://", 8)) {
        curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    }
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(e, CURLOPT_USERAGENT, "cflue-agentd/0.1");
    long connect_ms = x->r.connect_timeout_ms > 0 ? (long)x->r.connect_timeout_ms : 10000L;
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
    if (x->r.timeout_ms > 0) {
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)x->r.timeout_ms);
    }
    if (x->r.stall_ms > 0) {
        curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
        curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, (long)((x->r.stall_ms + 999) / 1000));
    }
    return true;
}

static void active_link(struct model_io *io, struct xfer *x)
{
    x->prev = NULL;
    x->next = io->active;
    if (io->active) {
        io->active->prev = x;
    }
    io->active = x;
    if (x->r.cancelled) {
        io->n_polled++;
    }
}

static void active_unlink(struct model_io *io, struct xfer *x)
{
    if (x->prev) {
        x->prev->next = x->next;
    } else {
        io->active = x->next;
    }
    if (x->next) {
        x->next->prev = x->prev;
    }
    x->next = x->prev = NULL;
    if (x->r.cancelled) {
        io->n_polled--;
    }
}

static void xfer_free(struct xfer *x)
{
    if (x->easy) {
        curl_easy_cleanup(x->easy);
    }
    curl_slist_free_all(x->headers);
    free(x->r.body_take);
    free(x->url);
    free(x);
}

/* end finishes x: out of the multi (when in it), slot released, on_done called, x freed. */
static void end(struct model_io *io, struct xfer *x, bool in_multi, struct model_io_result *res)
{
    if (in_multi) {
        active_unlink(io, x);
        curl_multi_remove_handle(io->multi, x->easy);
        long connects = 0;
        curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &res->http_status);
        curl_easy_getinfo(x->easy, CURLINFO_NUM_CONNECTS, &connects);
        res->connects = connects;
    }
    res->elapsed_ms = clock_mono_ms() - x->started_ms;
    pthread_mutex_lock(&io->mu);
    io->slots[x->slot] = NULL;
    io->free_slots[io->n_free++] = x->slot;
    io->connects += res->connects;
    pthread_mutex_unlock(&io->mu);
    x->r.on_done(x->r.ctx, res);
    xfer_free(x);
}

static void end_with(struct model_io *io, struct xfer *x, bool in_multi, enum cf_status st,
                     const char *why)
{
    struct model_io_result res = {.status = st};
    cf_error_set(&res.err, st, "%s", why);
    end(io, x, in_multi, &res);
}

/* finished turns libcurl's verdict on x into a result and ends x. */
static void finished(struct model_io *io, struct xfer *x, CURLcode cc)
{
    struct model_io_result res = {.status = CF_OK};
    const char *detail = x->errbuf[0] ? x->errbuf : curl_easy_strerror(cc);
    if (cc == CURLE_OK) {
        cf_error_clear(&res.err);
    } else if (x->refused) {
        cf_error_set(&res.err, CF_INVALID, "the receiver stopped the transfer");
    } else if (cc == CURLE_OPERATION_TIMEDOUT) {
        cf_error_set(&res.err, CF_DEADLINE, "%s", detail);
    } else if (cc == CURLE_OUT_OF_MEMORY || cc == CURLE_BAD_FUNCTION_ARGUMENT ||
               cc == CURLE_UNKNOWN_OPTION) {
        cf_error_set(&res.err, CF_INTERNAL, "%s", detail);
    } else {
        cf_error_set(&res.err, CF_UNAVAILABLE, "%s", detail);
    }
    res.status = res.err.code;
    end(io, x, true, &res);
}

/* take_work moves the pending transfers and the cancel requests out of the shared state. */
static bool take_work(struct model_io *io, struct xfer **out_pending, int *out_n_cancels)
{
    pthread_mutex_lock(&io->mu);
    bool stopping = io->stopping;
    *out_pending = io->pending;
    io->pending = io->pending_tail = NULL;
    memcpy(io->cancels_work, io->cancels, sizeof(uint64_t) * (size_t)io->n_cancels);
    *out_n_cancels = io->n_cancels;
    io->n_cancels = 0;
    pthread_mutex_unlock(&io->mu);
    return stopping;
}

/* lookup returns the live transfer id names, or NULL. Under io->mu. */
static struct xfer *lookup(struct model_io *io, uint64_t id)
{
    uint64_t slot = id & ((1u << SLOT_BITS) - 1);
    if (!id || slot >= (uint64_t)io->max_transfers) {
        return NULL;
    }
    struct xfer *x = io->slots[slot];
    return x && x->id == id ? x : NULL;
}

static void add_pending(struct model_io *io, struct xfer *list)
{
    while (list) {
        struct xfer *x = list;
        list = x->next;
        x->next = NULL;
        if (!setup(io, x)) {
            end_with(io, x, false, CF_INTERNAL, "libcurl could not make a transfer handle");
            continue;
        }
        CURLMcode mc = curl_multi_add_handle(io->multi, x->easy);
        if (mc != CURLM_OK) {
            end_with(io, x, false, CF_INTERNAL, curl_multi_strerror(mc));
            continue;
        }
        active_link(io, x);
    }
}

static void cancel_requested(struct model_io *io, int n)
{
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&io->mu);
        struct xfer *x = lookup(io, io->cancels_work[i]);
        pthread_mutex_unlock(&io->mu);
        /* only this thread ends transfers, so x stays valid past the lock; pending ones were
         * all added above, so x is in the multi */
        if (x) {
            end_with(io, x, true, CF_CANCELLED, "the transfer was cancelled");
        }
    }
}

static void reap(struct model_io *io)
{
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(io->multi, &left))) {
        if (m->msg != CURLMSG_DONE) {
            continue;
        }
        struct xfer *x = NULL;
        CURLcode cc = m->data.result;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        finished(io, x, cc);
    }
}

/* poll_cancelled asks the cancelled checks, at most every MODEL_IO_CANCEL_POLL_MS. */
static void poll_cancelled(struct model_io *io)
{
    int64_t now = clock_mono_ms();
    if (!io->n_polled || now - io->polled_at_ms < MODEL_IO_CANCEL_POLL_MS) {
        return;
    }
    io->polled_at_ms = now;
    for (struct xfer *x = io->active, *next; x; x = next) {
        next = x->next;
        if (x->r.cancelled && x->r.cancelled(x->r.ctx)) {
            end_with(io, x, true, CF_CANCELLED, "the transfer was cancelled");
        }
    }
}

static void end_all(struct model_io *io, struct xfer *pending)
{
    const char *why = "the model I/O loop is shutting down";
    while (io->active) {
        end_with(io, io->active, true, CF_CANCELLED, why);
    }
    while (pending) {
        struct xfer *x = pending;
        pending = x->next;
        end_with(io, x, false, CF_CANCELLED, why);
    }
}

/* on_socket is libcurl telling the loop which events to watch on s (CURLMOPT_SOCKETFUNCTION).
 * socketp is non-NULL once s is in the epoll set (curl_multi_assign). It never returns an
 * error to libcurl, which would take it as a reason to fail every transfer of the multi and
 * refuse new ones: a transfer whose socket cannot be watched is ended on its own instead
 * (end_unwatched), as a network failure. */
static int on_socket(CURL *easy, curl_socket_t s, int what, void *userp, void *socketp)
{
    struct model_io *io = userp;
    if (what == CURL_POLL_REMOVE) {
        epoll_ctl(io->epfd, EPOLL_CTL_DEL, s, NULL); /* ENOENT/EBADF: already gone */
        if (io->in_batch && io->n_removed < REMOVED_PER_BATCH) {
            io->removed[io->n_removed] = s;
        }
        io->n_removed += io->in_batch;
        return 0;
    }
    struct epoll_event ev = {.data.fd = s};
    ev.events = (what & CURL_POLL_IN ? EPOLLIN : 0u) | (what & CURL_POLL_OUT ? EPOLLOUT : 0u);
    int op = socketp ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    if (epoll_ctl(io->epfd, op, s, &ev) != 0) {
        /* the set's view and libcurl's may differ after an fd number was reused */
        int again = op == EPOLL_CTL_ADD ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
        if (epoll_ctl(io->epfd, again, s, &ev) != 0) {
            log_warn("model_io_watch", "fd=%d err=%s", (int)s, strerror(errno));
            struct xfer *x = NULL;
            curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&x);
            if (x && !x->unwatched) { /* NULL: libcurl's own handle, closing a connection */
                x->unwatched = true;
                x->unwatched_next = io->unwatched;
                io->unwatched = x;
            }
            return 0;
        }
    }
    if (!socketp) {
        curl_multi_assign(io->multi, s, io);
    }
    return 0;
}

/* end_unwatched ends the transfers on_socket could not watch. */
static void end_unwatched(struct model_io *io)
{
    while (io->unwatched) {
        struct xfer *x = io->unwatched;
        io->unwatched = x->unwatched_next;
        end_with(io, x, true, CF_UNAVAILABLE, "the connection to the model could not be watched");
    }
}

/* on_timer is libcurl asking to be called back in timeout_ms (-1: never)
 * (CURLMOPT_TIMERFUNCTION). */
static int on_timer(CURLM *multi, long timeout_ms, void *userp)
{
    (void)multi;
    struct model_io *io = userp;
    io->timer_at_ms = timeout_ms < 0 ? -1 : clock_mono_ms() + timeout_ms;
    return 0;
}

/* socket_action hands libcurl an event (or its timer: s is CURL_SOCKET_TIMEOUT). */
static void socket_action(struct model_io *io, curl_socket_t s, int flags)
{
    int running = 0;
    CURLMcode mc = curl_multi_socket_action(io->multi, s, flags, &running);
    if (mc != CURLM_OK) {
        /* libcurl leaves its timer as it was after an error: ask for it, and come back soon
         * at the latest, or a transfer waiting only on a timeout would wait for good */
        log_warn("model_io_action", "err=%s", curl_multi_strerror(mc));
        long t = -1;
        curl_multi_timeout(io->multi, &t);
        long in_ms = t < 0 ? 1000 : t < 10 ? 10 : t;
        io->timer_at_ms = clock_mono_ms() + in_ms;
    }
    end_unwatched(io);
}

/* run_timer runs libcurl's timer when it is due (timeouts, connection set-up, new transfers,
 * stall checks). */
static void run_timer(struct model_io *io)
{
    if (io->timer_at_ms >= 0 && clock_mono_ms() >= io->timer_at_ms) {
        io->timer_at_ms = -1;
        socket_action(io, CURL_SOCKET_TIMEOUT, 0);
    }
}

/* wait_ms is how long the loop may sleep: until libcurl's timer, or the next cancelled
 * check, or a second. */
static int wait_ms(const struct model_io *io)
{
    int64_t wait = io->n_polled ? MODEL_IO_CANCEL_POLL_MS : 1000;
    if (io->timer_at_ms >= 0) {
        int64_t until = io->timer_at_ms - clock_mono_ms();
        wait = until < 0 ? 0 : until < wait ? until : wait;
    }
    return (int)wait;
}

/* removed_in_batch tells whether libcurl let go of fd earlier in this batch. */
static bool removed_in_batch(const struct model_io *io, int fd)
{
    if (io->n_removed > REMOVED_PER_BATCH) {
        return true; /* lost count: every event left is taken as stale */
    }
    for (int i = 0; i < io->n_removed; i++) {
        if (io->removed[i] == fd) {
            return true;
        }
    }
    return false;
}

/* dispatch hands the ready sockets to libcurl and drains a wake-up. An event for a socket
 * libcurl let go of earlier in the batch is dropped: its fd may name a new socket by now, to
 * which an error flag meant for the old one would be fatal; the epoll set is level-triggered,
 * so whatever is ready on the new socket comes again with the next wait. */
static void dispatch(struct model_io *io, const struct epoll_event *evs, int n)
{
    io->in_batch = true;
    io->n_removed = 0;
    for (int i = 0; i < n; i++) {
        int fd = evs[i].data.fd;
        if (fd == io->wake_fd) {
            uint64_t v;
            ssize_t got = read(io->wake_fd, &v, sizeof(v));
            (void)got; /* EAGAIN: another read took it */
            continue;
        }
        if (removed_in_batch(io, fd)) {
            continue;
        }
        uint32_t e = evs[i].events;
        int flags = (e & EPOLLIN ? CURL_CSELECT_IN : 0) | (e & EPOLLOUT ? CURL_CSELECT_OUT : 0) |
                    (e & (EPOLLERR | EPOLLHUP) ? CURL_CSELECT_ERR : 0);
        socket_action(io, fd, flags);
    }
    io->in_batch = false;
}

static void *loop_main(void *arg)
{
    struct model_io *io = arg;
    struct epoll_event evs[EVENTS_PER_WAIT];
    for (;;) {
        struct xfer *pending;
        int n_cancels;
        if (take_work(io, &pending, &n_cancels)) {
            end_all(io, pending);
            /* starts after stopping was set fail, so nothing can be pending now */
            break;
        }
        add_pending(io, pending);
        cancel_requested(io, n_cancels);
        run_timer(io);
        reap(io);
        poll_cancelled(io);
        int n = epoll_wait(io->epfd, evs, EVENTS_PER_WAIT, wait_ms(io));
        if (n < 0 && errno != EINTR) {
            log_warn("model_io_wait", "err=%s", strerror(errno));
            clock_sleep_ms(10);
        }
        if (n == 0 && io->timer_at_ms < 0 && io->active) {
            /* a second with transfers in flight and no timer: let libcurl look (it would have
             * set one; this is a guard against losing it, not a poll) */
            socket_action(io, CURL_SOCKET_TIMEOUT, 0);
        }
        dispatch(io, evs, n);
        reap(io);
    }
    return NULL;
}

/* wake gets the loop out of epoll_wait. */
static void wake(struct model_io *io)
{
    uint64_t one = 1;
    ssize_t put = write(io->wake_fd, &one, sizeof(one));
    (void)put; /* EAGAIN: the counter is full, so the loop is awake anyway */
}

/* ---------- the API ---------- */

enum cf_status model_io_new(struct model_io **out, const struct model_io_opts *opts,
                            struct cf_error *err)
{
    int max_transfers =
        opts && opts->max_transfers > 0 ? opts->max_transfers : MODEL_IO_MAX_TRANSFERS;
    int max_conns =
        opts && opts->max_connections > 0 ? opts->max_connections : MODEL_IO_MAX_CONNECTIONS;
    if (max_transfers >= (1 << SLOT_BITS)) {
        return cf_error_set(err, CF_INVALID, "model_io: max_transfers %d is over %d", max_transfers,
                            (1 << SLOT_BITS) - 1);
    }
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        return cf_error_set(err, CF_INTERNAL, "libcurl could not initialise");
    }
    struct model_io *io = mem_alloc(sizeof(*io));
    io->max_transfers = max_transfers;
    io->slots = mem_alloc(sizeof(*io->slots) * (size_t)max_transfers);
    io->free_slots = mem_alloc(sizeof(int) * (size_t)max_transfers);
    for (int i = 0; i < max_transfers; i++) {
        io->free_slots[i] = max_transfers - 1 - i; /* slot 0 first */
    }
    io->n_free = max_transfers;
    io->cancels = mem_alloc(sizeof(uint64_t) * 2 * (size_t)max_transfers);
    io->cancels_work = mem_alloc(sizeof(uint64_t) * 2 * (size_t)max_transfers);
    pthread_mutex_init(&io->mu, NULL);
    io->timer_at_ms = -1;
    io->epfd = epoll_create1(EPOLL_CLOEXEC);
    io->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event wake_ev = {.events = EPOLLIN};
    wake_ev.data.fd = io->wake_fd;
    if (io->epfd < 0 || io->wake_fd < 0 ||
        epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->wake_fd, &wake_ev) != 0) {
        int e = errno;
        model_io_free(io);
        return cf_error_set(err, CF_INTERNAL, "model_io: no epoll set or eventfd: %s", strerror(e));
    }
    io->multi = curl_multi_init();
    io->share = curl_share_init();
    if (!io->multi || !io->share) {
        model_io_free(io);
        return cf_error_set(err, CF_INTERNAL, "libcurl could not make a multi or share handle");
    }
    curl_multi_setopt(io->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
    curl_multi_setopt(io->multi, CURLMOPT_SOCKETDATA, io);
    curl_multi_setopt(io->multi, CURLMOPT_TIMERFUNCTION, on_timer);
    curl_multi_setopt(io->multi, CURLMOPT_TIMERDATA, io);
    curl_multi_setopt(io->multi, CURLMOPT_MAXCONNECTS, (long)max_conns);
    curl_multi_setopt(io->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_MULTIPLEX);
    curl_share_setopt(io->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    curl_share_setopt(io->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
    io->polled_at_ms = clock_mono_ms();
    enum cf_status rc = thread_start(&io->thread, "model-io", 0, loop_main, io, err);
    if (rc != CF_OK) {
        model_io_free(io);
        return rc;
    }
    io->thread_started = true;
    *out = io;
    return CF_OK;
}

void model_io_free(struct model_io *io)
{
    if (!io) {
        return;
    }
    pthread_mutex_lock(&io->mu);
    io->stopping = true;
    pthread_mutex_unlock(&io->mu);
    if (io->thread_started) {
        wake(io);
        pthread_join(io->thread, NULL);
    }
    if (io->multi) {
        curl_multi_cleanup(io->multi); /* closes the cached connections: on_socket REMOVE */
    }
    if (io->share) {
        curl_share_cleanup(io->share);
    }
    if (io->epfd >= 0) {
        close(io->epfd);
    }
    if (io->wake_fd >= 0) {
        close(io->wake_fd);
    }
    pthread_mutex_destroy(&io->mu);
    free(io->slots);
    free(io->free_slots);
    free(io->cancels);
    free(io->cancels_work);
    free(io);
    curl_global_cleanup();
}

enum cf_status model_io_start(struct model_io *io, const struct model_io_request *r,
                              uint64_t *out_id, struct cf_error *err)
{
    if (!r->url || !r->on_done) {
        free(r->body_take);
        return cf_error_set(err, CF_INVALID, "model_io_start needs a url and on_done");
    }
    struct xfer *x = mem_alloc(sizeof(*x));
    x->r = *r;
    x->r.url = NULL;
    x->r.headers = NULL;
    x->url = mem_strdup(r->url);
    for (size_t i = 0; i < r->n_headers; i++) {
        struct curl_slist *h = curl_slist_append(x->headers, r->headers[i]);
        if (!h) {
            xfer_free(x);
            return cf_error_set(err, CF_NOMEM, "out of memory for the request headers");
        }
        x->headers = h;
    }
    x->started_ms = clock_mono_ms();
    pthread_mutex_lock(&io->mu);
    if (io->stopping || !io->n_free) {
        bool stopping = io->stopping;
        pthread_mutex_unlock(&io->mu);
        xfer_free(x);
        if (stopping) {
            return cf_error_set(err, CF_CANCELLED, "the model I/O loop is shutting down");
        }
        return cf_error_set(err, CF_BUSY,
                            "%d model calls are in flight, the most this agentd carries at once",
                            io->max_transfers);
    }
    x->slot = io->free_slots[--io->n_free];
    x->id = (atomic_fetch_add(&g_seq, 1) << SLOT_BITS) | (uint64_t)x->slot;
    io->slots[x->slot] = x;
    if (io->pending_tail) {
        io->pending_tail->next = x;
    } else {
        io->pending = x;
    }
    io->pending_tail = x;
    io->started++;
    *out_id = x->id;
    pthread_mutex_unlock(&io->mu);
    wake(io);
    return CF_OK;
}

void model_io_cancel(struct model_io *io, uint64_t id)
{
    pthread_mutex_lock(&io->mu);
    struct xfer *x = lookup(io, id);
    bool wake_it = false;
    if (x && !x->cancel_requested && io->n_cancels < 2 * io->max_transfers) {
        x->cancel_requested = true;
        io->cancels[io->n_cancels++] = id;
        wake_it = true;
    }
    pthread_mutex_unlock(&io->mu);
    if (wake_it) {
        wake(io);
    }
}

void model_io_get_stats(struct model_io *io, struct model_io_stats *st)
{
    pthread_mutex_lock(&io->mu);
    st->in_flight = io->max_transfers - io->n_free;
    st->started = io->started;
    st->connects = io->connects;
    pthread_mutex_unlock(&io->mu);
}

/* ---------- the shared instance ---------- */

static pthread_mutex_t g_shared_mu = PTHREAD_MUTEX_INITIALIZER;
static struct model_io *g_shared;
static bool g_shutting_down; /* model_io_shutdown is ending the transfers: no fresh start */

enum cf_status model_io_shared_start(const struct model_io_request *r, uint64_t *out_id,
                                     struct cf_error *err)
{
    pthread_mutex_lock(&g_shared_mu);
    enum cf_status rc = CF_OK;
    if (g_shutting_down) {
        rc = cf_error_set(err, CF_CANCELLED, "the model I/O loop is shutting down");
    } else if (!g_shared) {
        rc = model_io_new(&g_shared, NULL, err);
        if (rc == CF_OK) {
            log_info("model_io_started", "max_transfers=%d max_connections=%d",
                     MODEL_IO_MAX_TRANSFERS, MODEL_IO_MAX_CONNECTIONS);
        }
    }
    if (rc == CF_OK) {
        rc = model_io_start(g_shared, r, out_id, err);
    } else {
        free(r->body_take);
    }
    pthread_mutex_unlock(&g_shared_mu);
    return rc;
}

void model_io_shared_cancel(uint64_t id)
{
    pthread_mutex_lock(&g_shared_mu);
    if (g_shared) {
        model_io_cancel(g_shared, id);
    }
    pthread_mutex_unlock(&g_shared_mu);
}

void model_io_shared_stats(struct model_io_stats *st)
{
    memset(st, 0, sizeof(*st));
    pthread_mutex_lock(&g_shared_mu);
    if (g_shared) {
        model_io_get_stats(g_shared, st);
    }
    pthread_mutex_unlock(&g_shared_mu);
}

void model_io_shutdown(void)
{
    pthread_mutex_lock(&g_shared_mu);
    struct model_io *io = g_shared;
    g_shared = NULL;
    if (io) {
        g_shutting_down = true;
    }
    pthread_mutex_unlock(&g_shared_mu);
    if (io) {
        model_io_free(io);
        pthread_mutex_lock(&g_shared_mu);
        g_shutting_down = false;
        pthread_mutex_unlock(&g_shared_mu);
    }
}
