/* tool_bash.c - the bash tool: bounded capture, tail view, spill file, deadlines.
 *
 * Output (stdout and stderr on one pipe, in arrival order) is never held whole in memory.
 * While it is small it is kept in `pending`; once it passes the page limits it goes to a spill
 * file in the workspace (.cflue/spill/) and only the last TAIL_KEEP bytes stay in a ring. The
 * model sees the tail: at most TOOL_LINES_MAX lines and TOOL_BYTES_MAX bytes, cut at a line
 * boundary, after a note saying what was left out and where the full output is, with the
 * offsets `read` needs to page through it.
 */
#include "tool.h"

#include "clock.h"
#include "driver.h"
#include "failpoint.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "proc.h"
#include "utf8.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PENDING_MAX (256 * 1024)
#define TAIL_KEEP (TOOL_BYTES_MAX + 8)

struct capture {
    struct tool_ctx *ctx;
    struct buf pending;   /* all output while no spill file exists */
    char ring[TAIL_KEEP]; /* the last bytes, once spilling */
    size_t ring_len, ring_pos;
    uint64_t total_bytes, newlines;
    char last_byte;
    int spill_fd;
    char spill_rel[128];
    bool spill_failed;
    uint64_t spill_room;    /* bytes the spill file may still take (UINT64_MAX: no bound) */
    bool spill_cut;         /* the spill file stopped at its bound */
    uint64_t spill_dropped; /* bytes of output not saved for that */
};

static void ring_add(struct capture *c, const char *p, size_t n)
{
    if (n >= TAIL_KEEP) {
        memcpy(c->ring, p + n - TAIL_KEEP, TAIL_KEEP);
        c->ring_len = TAIL_KEEP;
        c->ring_pos = 0;
        return;
    }
    for (size_t i = 0; i < n;) {
        size_t room = TAIL_KEEP - c->ring_pos, k = n - i < room ? n - i : room;
        memcpy(c->ring + c->ring_pos, p + i, k);
        c->ring_pos = (c->ring_pos + k) % TAIL_KEEP;
        i += k;
    }
    c->ring_len = c->ring_len + n > TAIL_KEEP ? TAIL_KEEP : c->ring_len + n;
}

static bool write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* prune_spills removes the oldest spill files so that, with the one about to be created, at
 * most keep remain and the rest hold at most half of max_bytes (0: no bound). Names carry a
 * time-ordered id, so name order is age order. Returns the bytes the rest hold. */
static uint64_t prune_spills(int dirfd, int keep, int64_t max_bytes)
{
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    char **names = NULL;
    size_t n = 0;
    struct dirent *e;
    uint64_t total = 0, *sizes = NULL;
    while (d && (e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (!strncmp(e->d_name, "bash_", 5) && len > 4 && !strcmp(e->d_name + len - 4, ".log")) {
            names = mem_realloc(names, sizeof(char *) * (n + 1));
            names[n++] = mem_strdup(e->d_name);
        }
    }
    if (d) {
        closedir(d);
    } else if (fd >= 0) {
        close(fd);
    }
    if (names) {
        qsort(names, n, sizeof(char *), cmp_name);
        sizes = mem_alloc(sizeof(*sizes) * n);
    }
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (fstatat(dirfd, names[i], &st, AT_SYMLINK_NOFOLLOW) == 0) {
            sizes[i] = (uint64_t)st.st_size;
            total += sizes[i];
        }
    }
    for (size_t i = 0; i < n; i++) {
        if ((keep > 0 && n - i >= (size_t)keep) ||
            (max_bytes > 0 && total > (uint64_t)max_bytes / 2)) {
            unlinkat(dirfd, names[i], 0);
            total -= sizes[i];
        }
        free(names[i]);
    }
    free(names);
    free(sizes);
    return total;
}

/* spill_write appends to the spill file up to its bound; false when a write failed. */
static bool spill_write(struct capture *c, const char *p, size_t n)
{
    if (n > c->spill_room) {
        c->spill_dropped += n - c->spill_room;
        n = (size_t)c->spill_room;
        c->spill_cut = true;
    }
    c->spill_room -= n;
    return write_all(c->spill_fd, p, n);
}

static void open_spill(struct capture *c)
{
    char id[IDS_MAX];
    struct cf_error err;
    int dirfd;
    char base[256];
    ids_new(id, "bash");
    snprintf(c->spill_rel, sizeof(c->spill_rel), TOOL_SPILL_DIR "/%s.log", id);
    if (ws_open_parent(c->ctx->sb, c->spill_rel, true, c->spill_rel, &dirfd, base, sizeof(base),
                       &err) != CF_OK) {
        c->spill_failed = true;
        return;
    }
    int64_t max = c->ctx->cfg->spill_max_bytes;
    uint64_t kept = prune_spills(dirfd, c->ctx->cfg->spill_keep, max);
    c->spill_room = max > 0 ? (uint64_t)max - kept : UINT64_MAX;
    c->spill_fd = openat(dirfd, base, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    close(dirfd);
    if (c->spill_fd < 0 ||
        !spill_write(c, c->pending.data ? c->pending.data : "", c->pending.len)) {
        c->spill_failed = true;
    }
    buf_cleanup(&c->pending);
}

static bool on_output(void *arg, const char *p, size_t n)
{
    struct capture *c = arg;
    c->total_bytes += n;
    for (const char *q = p; (q = memchr(q, '\n', n - (size_t)(q - p))); q++) {
        c->newlines++;
    }
    c->last_byte = p[n - 1];
    ring_add(c, p, n);
    if (c->spill_fd < 0 && !c->spill_failed) {
        bool kept = buf_append(&c->pending, p, n) == CF_OK;
        if (!kept || c->total_bytes > TOOL_BYTES_MAX + 1 || c->newlines > TOOL_LINES_MAX) {
            open_spill(c);
            if (!kept && c->spill_fd >= 0 && !spill_write(c, p, n)) {
                c->spill_failed = true;
            }
        }
    } else if (c->spill_fd >= 0 && !c->spill_failed && !spill_write(c, p, n)) {
        c->spill_failed = true;
    }
    return true;
}

/* cancelled: the caller went away. The call's deadline is not a cancel: it is the command's
 * own deadline (proc_spec.deadline_ms), so that its end reads as a timeout. */
static bool cancelled(void *arg)
{
    return tool_caller_gone(((struct capture *)arg)->ctx);
}

/* tail_view copies the last lines of the output (ring order) into a contiguous buffer. */
static size_t ring_linear(const struct capture *c, char *out)
{
    if (c->ring_len < TAIL_KEEP) {
        memcpy(out, c->ring, c->ring_len);
        return c->ring_len;
    }
    size_t first = TAIL_KEEP - c->ring_pos;
    memcpy(out, c->ring + c->ring_pos, first);
    memcpy(out + first, c->ring, c->ring_pos);
    return TAIL_KEEP;
}

static void format_seconds(char *out, size_t len, int64_t ms)
{
    if (ms % 1000 == 0) {
        snprintf(out, len, "%lld s", (long long)(ms / 1000));
    } else {
        snprintf(out, len, "%.3g s", (double)ms / 1000.0);
    }
}

/* bash_timeout reads the 'timeout' argument (seconds) into *timeout_ms, cut to the time left
 * for the call (*by_caller then true). Fails the result and returns false when it is bad. */
static bool bash_timeout(struct tool_ctx *ctx, json_t *args, struct tool_result *res,
                         int64_t *timeout_ms, bool *by_caller)
{
    json_t *jt = json_object_get(args, "timeout");
    *timeout_ms = ctx->cfg->bash_default_timeout_ms;
    *by_caller = false;
    if (jt) {
        double secs = json_number_value(jt);
        if (!(secs > 0) || !isfinite(secs)) {
            tool_fail(res,
                      "The argument 'timeout' of bash must be a number of seconds above 0; "
                      "got %g.",
                      secs);
            return false;
        }
        double ms = ceil(secs * 1000.0);
        if (ms > (double)ctx->cfg->bash_max_timeout_ms) {
            tool_fail(res,
                      "The argument 'timeout' of bash is %g s; this server allows at most "
                      "%lld s.",
                      secs, (long long)(ctx->cfg->bash_max_timeout_ms / 1000));
            return false;
        }
        *timeout_ms = (int64_t)ms;
    }
    if (ctx->deadline_ms) {
        int64_t left = ctx->deadline_ms - clock_mono_ms();
        if (left < *timeout_ms) {
            *timeout_ms = left > 1 ? left : 1;
            *by_caller = true;
        }
    }
    return true;
}

/* run_command runs the command in the sandbox, its output going to c. */
static enum cf_status run_command(struct capture *c, const char *command, int64_t timeout_ms,
                                  struct proc_result *pr, struct cf_error *err)
{
    struct tool_ctx *ctx = c->ctx;
    char cwd[PATH_MAX];
    ws_host_path(ctx->sb, ctx->cwd ? ctx->cwd : ".", cwd, sizeof(cwd));
    failpoint_hit("toold.bash.before_start"); /* a slow sandbox start */
    struct proc_spec spec = {.timeout_ms = timeout_ms,
                             .deadline_ms = ctx->deadline_ms,
                             .on_output = on_output,
                             .cancelled = cancelled,
                             .ctx = c};
    return driver_run(ctx->sb, ctx->limits, cwd, command, NULL, 0, &spec, pr, err);
}

/* view_whole shows all the output (it fits the page limits), without its final '\n'. */
static void view_whole(struct capture *c, uint64_t total_lines, struct tool_result *res)
{
    size_t n = c->pending.len;
    const char *p = buf_cstr(&c->pending);
    if (n && p[n - 1] == '\n') {
        n--;
    }
    utf8_sanitize(&res->text, p, n);
    if (total_lines) {
        res->trunc.shown_first_line = 1;
        res->trunc.shown_last_line = (int64_t)total_lines;
    }
}

/* tail_start chooses where the view of tail[0..n) starts: at most TOOL_LINES_MAX lines and
 * TOOL_BYTES_MAX bytes, whole lines unless the last line alone is over the budget
 * (*line_cut). Sets *shown_lines. */
static size_t tail_start(const char *tail, size_t n, bool *line_cut, uint64_t *shown_lines)
{
    size_t start = n > TOOL_BYTES_MAX ? n - TOOL_BYTES_MAX : 0;
    *line_cut = false;
    if (start > 0 && tail[start - 1] != '\n') {
        const char *nl = memchr(tail + start, '\n', n - start);
        if (nl) {
            start = (size_t)(nl + 1 - tail);
        } else {
            *line_cut = true; /* the last line alone is over the budget */
            start = utf8_suffix_start(tail, n, TOOL_BYTES_MAX);
        }
    }
    *shown_lines = 1;
    for (size_t i = start; i < n; i++) {
        if (tail[i] == '\n') {
            (*shown_lines)++;
        }
    }
    while (*shown_lines > TOOL_LINES_MAX) {
        start = (size_t)((char *)memchr(tail + start, '\n', n - start) + 1 - tail);
        (*shown_lines)--;
    }
    return start;
}

/* view_tail shows the end of output that did not fit, after a note saying what was left out
 * and where the full output is (the spill file). */
static void view_tail(struct capture *c, uint64_t total_lines, struct tool_result *res)
{
    char *tail = mem_alloc(TAIL_KEEP);
    size_t n = ring_linear(c, tail);
    /* the view never includes the final '\n' */
    if (n && tail[n - 1] == '\n') {
        n--;
    }
    bool line_cut;
    uint64_t shown_lines;
    size_t start = tail_start(tail, n, &line_cut, &shown_lines);
    uint64_t first_line = total_lines - shown_lines + 1;
    uint64_t shown_bytes = n - start;
    res->trunc.truncated = true;
    res->trunc.by = total_lines > TOOL_LINES_MAX && shown_lines == TOOL_LINES_MAX
                        ? CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_LINES
                        : CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_BYTES;
    res->trunc.shown_first_line = (int64_t)first_line;
    res->trunc.shown_last_line = (int64_t)total_lines;
    res->trunc.line_too_long = line_cut;
    if (c->spill_failed) {
        buf_printf(&res->text,
                   "[Output truncated: %llu earlier lines (%llu bytes) are not shown, and the "
                   "full output could not be saved.%s]\n",
                   (unsigned long long)(first_line - 1),
                   (unsigned long long)(c->total_bytes - shown_bytes),
                   line_cut ? " The last line is cut: only its end is shown." : "");
    } else if (c->spill_cut) {
        buf_printf(&res->text,
                   "[Output truncated: showing lines %llu-%llu of %llu (the last %llu of %llu "
                   "bytes).%s Only the first %llu bytes were saved, in %s (read it with "
                   "offset=1): the rest was past this sandbox's room for saved output.]\n",
                   (unsigned long long)first_line, (unsigned long long)total_lines,
                   (unsigned long long)total_lines, (unsigned long long)shown_bytes,
                   (unsigned long long)c->total_bytes,
                   line_cut ? " The last line is cut: only its end is shown." : "",
                   (unsigned long long)(c->total_bytes - c->spill_dropped), c->spill_rel);
        json_object_set_new(res->details, "spill_path", json_string(c->spill_rel));
        json_object_set_new(res->details, "spill_cut", json_true());
    } else {
        buf_printf(&res->text,
                   "[Output truncated: showing lines %llu-%llu of %llu (the last %llu of %llu "
                   "bytes).%s Full output: %s (read it with offset=1 from the start, or "
                   "offset=%llu for the part shown here).]\n",
                   (unsigned long long)first_line, (unsigned long long)total_lines,
                   (unsigned long long)total_lines, (unsigned long long)shown_bytes,
                   (unsigned long long)c->total_bytes,
                   line_cut ? " The last line is longer than the limit; only its end is "
                              "shown."
                            : "",
                   c->spill_rel, (unsigned long long)first_line);
        json_object_set_new(res->details, "spill_path", json_string(c->spill_rel));
        res->trunc.next_offset = (int64_t)first_line;
    }
    utf8_sanitize(&res->text, tail + start, n - start);
    free(tail);
}

/* view_output shows the captured output: whole, or its tail once it was spilled. */
static void view_output(struct capture *c, struct tool_result *res)
{
    uint64_t total_lines = c->newlines + (c->total_bytes && c->last_byte != '\n' ? 1 : 0);
    uint64_t shown_total = c->total_bytes - (c->total_bytes && c->last_byte == '\n' ? 1 : 0);
    bool spilled = shown_total > TOOL_BYTES_MAX || total_lines > TOOL_LINES_MAX;
    if (spilled && c->spill_fd < 0 && !c->spill_failed) {
        open_spill(c);
    }
    if (c->spill_fd >= 0) {
        close(c->spill_fd);
    }
    res->trunc.total_lines = (int64_t)total_lines;
    res->trunc.total_bytes = (int64_t)c->total_bytes;
    if (!spilled) {
        view_whole(c, total_lines, res);
    } else {
        view_tail(c, total_lines, res);
    }
    if (c->total_bytes == 0) {
        buf_append_str(&res->text, "[no output]");
    }
}

/* format_mib writes a byte count in MiB for the model ("1024 MiB", "0.5 MiB"). */
static void format_mib(char *out, size_t len, int64_t bytes)
{
    double mib = (double)bytes / (1 << 20);
    snprintf(out, len, mib >= 10 ? "%.0f MiB" : "%.1f MiB", mib);
}

/* note_limit tells the model which of the sandbox's limits stopped the command (or, for the
 * disk, that it left the workspace over its limit) and records it in the details. */
static void note_limit(const struct proc_result *pr, const struct proc_limits *l,
                       struct tool_result *res)
{
    char used[32], bound[32];
    switch (pr->limit) {
    case PROC_LIMIT_CPU:
        buf_printf(&res->text,
                   "\n\n[Stopped: the command and what it started used %.1f s of CPU time, over "
                   "this sandbox's limit of %.0f s, so all of it was killed. Exit code %d.]",
                   (double)pr->limit_used / 1000, (double)l->cpu_ms / 1000, pr->exit_code);
        break;
    case PROC_LIMIT_MEMORY:
        format_mib(used, sizeof(used), pr->limit_used);
        format_mib(bound, sizeof(bound), l->memory_bytes);
        buf_printf(&res->text,
                   "\n\n[Stopped: the command's processes held %s of memory together, over this "
                   "sandbox's limit of %s, so all of them were killed. Exit code %d.]",
                   used, bound, pr->exit_code);
        break;
    case PROC_LIMIT_PROCS:
        buf_printf(&res->text,
                   "\n\n[Stopped: the command reached this sandbox's limit of %lld processes and "
                   "threads running at once (runaway background jobs or a fork bomb look like "
                   "this), so all of them were killed. Exit code %d.]",
                   (long long)l->procs, pr->exit_code);
        break;
    case PROC_LIMIT_FILE:
        format_mib(bound, sizeof(bound), l->file_bytes);
        buf_printf(&res->text,
                   "\n\n[Exit code %d: a process was stopped by the file size limit: no file in "
                   "this sandbox may grow past %s.]",
                   pr->exit_code, bound);
        break;
    case PROC_LIMIT_DISK:
        format_mib(used, sizeof(used), pr->limit_used);
        format_mib(bound, sizeof(bound), l->disk_bytes);
        if (pr->limit_after_exit) {
            buf_printf(&res->text,
                       "\n\n[The command left the workspace at %s, over this sandbox's disk limit "
                       "of %s: the next command that writes more will be stopped. Remove files "
                       "to make room.]",
                       used, bound);
            if (pr->exit_code) {
                buf_printf(&res->text, "\n\n[Exit code %d]", pr->exit_code);
            }
        } else {
            buf_printf(&res->text,
                       "\n\n[Stopped: the workspace grew to %s, over this sandbox's disk limit of "
                       "%s, so the command and all it started were killed. Remove files to make "
                       "room. Exit code %d.]",
                       used, bound, pr->exit_code);
        }
        break;
    case PROC_LIMIT_NONE:
        return;
    }
    json_object_set_new(res->details, "limit", json_string(proc_limit_name(pr->limit)));
    if (pr->limit_used > 0) {
        json_object_set_new(res->details, "limit_used", json_integer(pr->limit_used));
    }
}

/* note_ending says how the command ended (timeout, cancelled, a limit, exit code) and records
 * it in the details. */
static void note_ending(const struct proc_result *pr, const struct proc_limits *limits,
                        int64_t timeout_ms, bool by_caller, struct tool_result *res)
{
    if (pr->limit && !pr->timed_out && !pr->cancelled) {
        note_limit(pr, limits, res);
    } else if (pr->timed_out) {
        char secs[32];
        format_seconds(secs, sizeof(secs), timeout_ms);
        buf_printf(&res->text,
                   "\n\n[Stopped after %s: the %s ran out, so the command and everything it "
                   "started were killed. Exit code 124.]",
                   secs, by_caller ? "time left for this call" : "timeout");
    } else if (pr->cancelled) {
        tool_fail(res, "The command was cancelled by the caller and killed; its outcome is "
                       "unknown.");
    } else if (pr->exit_code != 0) {
        buf_printf(&res->text, "\n\n[Exit code %d]", pr->exit_code);
    }
    json_object_set_new(res->details, "exit_code", json_integer(pr->exit_code));
    json_object_set_new(res->details, "timed_out", json_boolean(pr->timed_out));
    json_object_set_new(res->details, "duration_ms", json_integer(pr->duration_ms));
}

void tool_bash_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    const char *command = json_string_value(json_object_get(args, "command"));
    int64_t timeout_ms;
    bool by_caller;
    struct cf_error err;
    struct proc_result pr;

    json_object_set_new(res->details, "command", json_string(command));
    if (!bash_timeout(ctx, args, res, &timeout_ms, &by_caller)) {
        return;
    }
    if (strlen(command) == 0) {
        tool_fail(res, "The argument 'command' of bash is empty.");
        return;
    }
    struct capture *c = mem_alloc(sizeof(*c));
    c->ctx = ctx;
    c->spill_fd = -1;
    buf_init(&c->pending, PENDING_MAX);
    if (run_command(c, command, timeout_ms, &pr, &err) != CF_OK) {
        tool_fail(res, "The command could not be started: %s", err.msg);
    } else {
        view_output(c, res);
        note_ending(&pr, ctx->limits ? ctx->limits : &ctx->sb->limits, timeout_ms, by_caller, res);
    }
    buf_cleanup(&c->pending);
    free(c);
}
