/* tool_search.c - grep and glob.
 *
 * grep has three engines that produce the same text: ripgrep run inside the sandbox (when
 * `rg --version` works there; probed once per sandbox), toold's own walk with PCRE2 (JIT),
 * and `grep -rnHE` for sandboxes that can only run commands. Whatever the engine, matches are
 * kept as the first TOOL_GREP_MATCHES_MAX in (path, line) order in a bounded heap, so memory
 * does not grow with the number of matches, and printed as path:line:text with paths relative
 * to the working directory. glob walks the tree like `find -name` (every entry, hidden ones
 * included, regular files only) and keeps the first TOOL_GLOB_PATHS_MAX paths in byte order.
 */
#include "tool.h"

#include "driver.h"
#include "mem.h"
#include "proc.h"
#include "utf8.h"
#include "walk.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BINARY_SNIFF (64 * 1024)
#define GREP_CHUNK (1 << 20)     /* bytes read at a time by the built-in engine */
#define GREP_LINE_MAX (16 << 20) /* longer lines are searched in pieces of this size */

/* ---------- the first-K heap ---------- */

struct hit {
    char *path;
    int64_t line;
    char *text; /* NULL for glob */
};

struct topk {
    struct hit *items;
    size_t n, cap;
    uint64_t total;
};

static int hit_cmp(const struct hit *a, const struct hit *b)
{
    int c = strcmp(a->path, b->path);
    return c ? c : (a->line > b->line) - (a->line < b->line);
}

static void heap_swap(struct hit *a, struct hit *b)
{
    struct hit t = *a;
    *a = *b;
    *b = t;
}

/* topk_add offers a hit (taking ownership of its strings): a max-heap of the K smallest. */
static void topk_add(struct topk *k, struct hit h)
{
    k->total++;
    if (k->n < k->cap) {
        size_t i = k->n++;
        k->items[i] = h;
        while (i > 0 && hit_cmp(&k->items[(i - 1) / 2], &k->items[i]) < 0) {
            heap_swap(&k->items[(i - 1) / 2], &k->items[i]);
            i = (i - 1) / 2;
        }
        return;
    }
    if (hit_cmp(&h, &k->items[0]) >= 0) {
        free(h.path);
        free(h.text);
        return;
    }
    free(k->items[0].path);
    free(k->items[0].text);
    k->items[0] = h;
    for (size_t i = 0;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k->n && hit_cmp(&k->items[l], &k->items[m]) > 0) {
            m = l;
        }
        if (r < k->n && hit_cmp(&k->items[r], &k->items[m]) > 0) {
            m = r;
        }
        if (m == i) {
            break;
        }
        heap_swap(&k->items[i], &k->items[m]);
        i = m;
    }
}

static int qsort_hit(const void *a, const void *b)
{
    return hit_cmp(a, b);
}

static void topk_free(struct topk *k)
{
    for (size_t i = 0; i < k->n; i++) {
        free(k->items[i].path);
        free(k->items[i].text);
    }
    free(k->items);
}

/* append_path writes a hit's path (relative to the root) as the model names it, relative to the
 * call's working directory, as valid UTF-8: names are bytes, and invalid sequences become
 * U+FFFD (DECISIONS.md), so every protobuf string toold sends parses in any client. Sorting
 * happens before, on the raw bytes. */
static void append_path(const struct tool_ctx *ctx, struct buf *b, const char *path)
{
    char shown[WS_PATH_MAX + 1024];
    ws_shown_path(ctx->cwd, path, shown, sizeof(shown));
    if (utf8_sanitize(b, shown, strlen(shown)) != CF_OK) {
        /* the result buffer is full: the text is cut like any over-long result */
    }
}

/* ---------- grep ---------- */

struct grep {
    struct tool_ctx *ctx;
    struct ignore_filter *filter; /* for engines run as commands */
    const char *start_rel;
    struct topk hits;
    pcre2_code *re;
    pcre2_match_data *md;
    const char *include;
    struct buf line; /* partial output line of an external engine */
    int engine_errors;
    /* an external engine's stderr: its partial line, and its complete lines, those that do
     * not say "Permission denied" apart (the first kept, for the error) */
    struct buf err_line;
    int err_lines, err_other;
    bool engine_stopped; /* by a limit or its time, not by its own end */
    char err_first[256];
    char *data; /* the built-in engine's read buffer */
    size_t data_cap;
};

static char *cut_text(const char *p, size_t n)
{
    struct buf b;
    buf_init(&b, TOOL_GREP_LINE_CHARS_MAX * 4 + 64);
    size_t keep = utf8_chars_prefix_len(p, n, TOOL_GREP_LINE_CHARS_MAX);
    utf8_sanitize(&b, p, keep);
    if (keep < n) {
        buf_append_str(&b, " [... line cut at 500 characters]");
    }
    return buf_take(&b);
}

static bool include_ok(const struct grep *g, const char *rel)
{
    if (!g->include) {
        return true;
    }
    const char *name = strrchr(rel, '/');
    name = name ? name + 1 : rel;
    if (strchr(g->include, '/')) {
        return fnmatch(g->include, rel, FNM_PATHNAME) == 0;
    }
    return fnmatch(g->include, name, 0) == 0;
}

/* grep_segment searches data[0..size), whole lines starting at line *line_no, and advances
 * *line_no past them. A line is reported once even when it was searched in pieces. */
static void grep_segment(struct grep *g, const char *rel, const char *data, size_t size,
                         int64_t *line_no_io, int64_t *last_hit)
{
    int64_t line_no = *line_no_io;
    const char *counted = data;
    size_t pos = 0;
    while (pos < size) {
        int rc = pcre2_match(g->re, (PCRE2_SPTR)data, size, pos, 0, g->md, NULL);
        if (rc < 0) {
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(g->md);
        size_t mstart = ov[0];
        const char *ls = mstart > 0 ? memrchr(data, '\n', mstart) : NULL;
        size_t line_start = ls ? (size_t)(ls - data) + 1 : 0;
        const char *le = memchr(data + mstart, '\n', size - mstart);
        size_t line_end = le ? (size_t)(le - data) : size;
        if (mstart == size && line_start == size) {
            break; /* an empty match after the final newline is not a line */
        }
        /* confirm on the line alone: a match must not span lines */
        int one = ov[1] <= line_end ? 1
                                    : pcre2_match(g->re, (PCRE2_SPTR)(data + line_start),
                                                  line_end - line_start, 0, 0, g->md, NULL);
        for (const char *q = counted; (q = memchr(q, '\n', (size_t)(data + line_start - q))); q++) {
            line_no++;
        }
        counted = data + line_start;
        if (one >= 0 && line_no != *last_hit) {
            struct hit h = {mem_strdup(rel), line_no,
                            cut_text(data + line_start, line_end - line_start)};
            topk_add(&g->hits, h);
            *last_hit = line_no;
        }
        pos = line_end + 1;
    }
    for (const char *q = counted; (q = memchr(q, '\n', (size_t)(data + size - q))); q++) {
        line_no++;
    }
    *line_no_io = line_no;
}

/* fill reads until want bytes are in or the file ends; false on an error. */
static bool fill(int fd, char *p, size_t want, size_t *got_out)
{
    size_t got = 0;
    while (got < want) {
        ssize_t r = read(fd, p + got, want - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return false;
        }
        if (r == 0) {
            break;
        }
        got += (size_t)r;
    }
    *got_out = got;
    return true;
}

/* grep_visit searches one file of the walk: opened only if it is a regular file, read (never
 * mapped) in GREP_CHUNK steps cut at line ends, up to the size it had when opened. */
static bool grep_visit(void *arg, const char *rel, int dirfd, const char *name)
{
    struct grep *g = arg;
    struct stat st;
    struct cf_error err;
    int fd;
    if (!include_ok(g, rel)) {
        return true;
    }
    if (ws_open_regular_at(dirfd, name, rel, &fd, &st, &err) != CF_OK) {
        return true; /* special files (and what vanished) are skipped */
    }
    size_t left = (size_t)st.st_size, have = 0;
    int64_t line_no = 1, last_hit = 0;
    bool first = true, more = left > 0;
    while (more) {
        if (g->data_cap - have < GREP_CHUNK) {
            g->data_cap = have + GREP_CHUNK;
            g->data = mem_realloc(g->data, g->data_cap);
        }
        size_t want = left < GREP_CHUNK ? left : GREP_CHUNK, got;
        if (!fill(fd, g->data + have, want, &got)) {
            break;
        }
        have += got;
        left -= got;
        more = got == want && left > 0;
        if (first) {
            first = false;
            if (memchr(g->data, '\0', have < BINARY_SNIFF ? have : BINARY_SNIFF)) {
                break; /* binary: skipped, as ripgrep does */
            }
        }
        size_t upto = have;
        if (more) {
            const char *nl = memrchr(g->data, '\n', have);
            if (nl) {
                upto = (size_t)(nl - g->data) + 1;
            } else if (have < GREP_LINE_MAX) {
                continue; /* a long line: read more of it */
            }
        }
        grep_segment(g, rel, g->data, upto, &line_no, &last_hit);
        memmove(g->data, g->data + upto, have - upto);
        have -= upto;
        if (tool_cancelled(g->ctx)) {
            break;
        }
    }
    close(fd);
    if (g->data_cap > 4 * GREP_CHUNK) { /* do not keep a long line's buffer */
        free(g->data);
        g->data = NULL;
        g->data_cap = 0;
    }
    return !tool_cancelled(g->ctx);
}

/* grep_cancelled: the caller went away or the deadline passed (walks and engines). */
static bool grep_cancelled(void *arg)
{
    struct grep *g = arg;
    return tool_cancelled(g->ctx);
}

/* parse_engine_line handles "path\0line:text" from rg --null or grep -Z. */
static void parse_engine_line(struct grep *g, const char *p, size_t n)
{
    const char *nul = memchr(p, '\0', n);
    if (!nul) {
        g->engine_errors++;
        return;
    }
    const char *path = p;
    if (!strncmp(path, "./", 2)) {
        path += 2;
    }
    const char *num = nul + 1, *colon = memchr(num, ':', n - (size_t)(num - p));
    if (!colon) {
        g->engine_errors++;
        return;
    }
    char *end;
    int64_t line = strtoll(num, &end, 10);
    if (end != colon) {
        g->engine_errors++;
        return;
    }
    char *rel = mem_strndup(path, (size_t)(nul - path));
    if (g->filter && ignore_filter_skips(g->filter, rel, g->start_rel)) {
        free(rel);
        return;
    }
    struct hit h = {rel, line, cut_text(colon + 1, n - (size_t)(colon + 1 - p))};
    topk_add(&g->hits, h);
}

/* engine_out_line ends the engine's output line in g->line: a hit, or an error. */
static void engine_out_line(struct grep *g)
{
    parse_engine_line(g, buf_cstr(&g->line), g->line.len);
    buf_reset(&g->line);
}

/* engine_err_line ends the engine's stderr line in g->err_line, counting it. */
static void engine_err_line(struct grep *g)
{
    const char *l = buf_cstr(&g->err_line);
    if (g->err_line.len) {
        g->err_lines++;
        if (!strstr(l, "Permission denied")) {
            if (!g->err_other++) {
                snprintf(g->err_first, sizeof(g->err_first), "%s", l);
            }
        }
    }
    buf_reset(&g->err_line);
}

/* engine_lines gathers an engine's bytes into lines in line, ending each with end. A line
 * longer than the buffer keeps its start (a hit's path, number and the head of its text,
 * which is all that is printed); the rest is dropped up to its end. */
static void engine_lines(struct grep *g, struct buf *line, void (*end)(struct grep *),
                         const char *p, size_t n)
{
    for (size_t i = 0; i < n;) {
        const char *nl = memchr(p + i, '\n', n - i);
        size_t k = nl ? (size_t)(nl - (p + i)) : n - i;
        size_t room = line->max - line->len;
        (void)buf_append(line, p + i, k < room ? k : room);
        if (!nl) {
            break;
        }
        end(g);
        i += k + 1;
    }
}

/* engine_output takes an engine's stdout: its hits. */
static bool engine_output(void *arg, const char *p, size_t n)
{
    struct grep *g = arg;
    engine_lines(g, &g->line, engine_out_line, p, n);
    return true;
}

/* engine_stderr takes an engine's stderr: what it could not read, and why it failed. */
static bool engine_stderr(void *arg, const char *p, size_t n)
{
    struct grep *g = arg;
    engine_lines(g, &g->err_line, engine_err_line, p, n);
    return true;
}

static void shell_quote(struct buf *b, const char *s)
{
    buf_append_str(b, " '");
    for (const char *p = s; *p; p++) {
        if (*p == '\'') {
            buf_append_str(b, "'\\''");
        } else {
            buf_append(b, p, 1);
        }
    }
    buf_append_str(b, "'");
}

static enum cf_status run_engine(struct grep *g, const char *command, int *exit_code,
                                 struct cf_error *err)
{
    struct sandbox *sb = g->ctx->sb;
    const char *const env[] = {"LC_ALL=C.UTF-8"};
    struct proc_spec spec = {.timeout_ms = 600000,
                             .on_output = engine_output,
                             .on_stderr = engine_stderr,
                             .cancelled = grep_cancelled,
                             .ctx = g};
    struct proc_result pr = {0};
    enum cf_status rc = driver_run(sb, g->ctx->limits, sb->root, command, env, 1, &spec, &pr, err);
    if (g->line.len) {
        engine_out_line(g);
    }
    engine_err_line(g);
    *exit_code = pr.exit_code;
    g->engine_stopped = pr.timed_out || pr.cancelled || pr.limit != PROC_LIMIT_NONE;
    return rc;
}

static bool rg_available(struct tool_ctx *ctx)
{
    struct sandbox *sb = ctx->sb;
    pthread_mutex_lock(&sb->mu);
    int state = sb->rg_state;
    pthread_mutex_unlock(&sb->mu);
    if (state) {
        return state > 0;
    }
    struct proc_spec spec = {.timeout_ms = 10000};
    struct proc_result pr;
    struct cf_error err;
    bool ok = driver_run(sb, NULL, sb->root, "rg --version >/dev/null 2>&1", NULL, 0, &spec, &pr,
                         &err) == CF_OK &&
              pr.exit_code == 0;
    pthread_mutex_lock(&sb->mu);
    sb->rg_state = ok ? 1 : -1;
    pthread_mutex_unlock(&sb->mu);
    return ok;
}

/* search_root resolves path (the workspace rule of ws_relative) into rel and stats what it
 * names, without opening it for reading. Fails the result and returns false when it cannot. */
static bool search_root(struct tool_ctx *ctx, const char *path, char *rel, size_t rel_len,
                        struct stat *st, struct tool_result *res)
{
    struct cf_error err;
    int fd;
    if (tool_resolve(ctx, path, rel, rel_len, &err) != CF_OK ||
        ws_open(ctx->sb, rel, O_PATH, 0, path, &fd, &err) != CF_OK) {
        tool_fail_error(res, &err);
        return false;
    }
    int st_rc = fstat(fd, st);
    close(fd);
    if (st_rc != 0) {
        st->st_mode = 0; /* neither a file nor a directory: the callers refuse it */
    }
    return true;
}

/* list_hits writes the hits in path (and line) order, one a line: "PATH" or, with lines,
 * "PATH:LINE:TEXT". Fails the result and returns false when the search was cancelled or ran
 * out of time, as its hits are then not all there are. */
static bool list_hits(struct tool_ctx *ctx, struct topk *hits, bool with_lines,
                      struct tool_result *res)
{
    if (tool_cancelled(ctx)) {
        tool_fail(res, "The search was cancelled or ran out of time before it finished.");
        return false;
    }
    qsort(hits->items, hits->n, sizeof(struct hit), qsort_hit);
    for (size_t i = 0; i < hits->n; i++) {
        if (i) {
            buf_append_str(&res->text, "\n");
        }
        append_path(ctx, &res->text, hits->items[i].path);
        if (with_lines) {
            buf_printf(&res->text, ":%lld:%s", (long long)hits->items[i].line, hits->items[i].text);
        }
    }
    json_object_set_new(res->details, "matches", json_integer((json_int_t)hits->total));
    return true;
}

/* compile_pattern checks the pattern argument and compiles it (literal: as plain text). Fails
 * the result and returns false when it is too long, empty, holds a NUL or does not compile. */
static bool compile_pattern(struct grep *g, json_t *jp, bool literal, struct tool_result *res)
{
    const char *pattern = json_string_value(jp);
    int errcode;
    PCRE2_SIZE erroff;
    if (json_string_length(jp) > TOOL_PATTERN_MAX) {
        tool_fail(res, "The pattern is %zu bytes; the limit is %d.", json_string_length(jp),
                  TOOL_PATTERN_MAX);
        return false;
    }
    if (!*pattern) {
        tool_fail(res, "The pattern is empty; give the text or regular expression to find.");
        return false;
    }
    if (json_string_length(jp) != strlen(pattern)) {
        tool_fail(res, "The pattern contains a NUL character.");
        return false;
    }
    g->re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_MATCH_INVALID_UTF |
                              (literal ? PCRE2_LITERAL : PCRE2_MULTILINE),
                          &errcode, &erroff, NULL);
    if (!g->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(errcode, msg, sizeof(msg));
        tool_fail(res,
                  "The pattern is not a valid regular expression: %s at position %zu. Escape "
                  "special characters, or set literal to search for the text as it is.",
                  (const char *)msg, (size_t)erroff);
        return false;
    }
    pcre2_jit_compile(g->re, PCRE2_JIT_COMPLETE);
    g->md = pcre2_match_data_create_from_pattern(g->re, NULL);
    return true;
}

/* engine_command writes the shell command that runs engine ("rg" or "grep") over rel with the
 * same rules as the pcre2 walk: hidden entries skipped, include as a file-name filter. */
static void engine_command(const struct grep *g, const char *engine, const char *pattern,
                           bool literal, const char *rel, struct buf *cmd)
{
    if (!strcmp(engine, "rg")) {
        buf_append_str(cmd, "exec rg --no-config --null --line-number --with-filename "
                            "--no-heading --color=never --no-require-git --engine=auto --no-mmap "
                            "--no-ignore-global --no-ignore-exclude --no-ignore-parent");
        if (literal) {
            buf_append_str(cmd, " --fixed-strings");
        }
        if (g->include) {
            /* a file type filters without overriding hidden and ignore rules */
            struct buf t;
            buf_init(&t, TOOL_PATTERN_MAX);
            buf_printf(&t, "cflueinclude:%s", g->include);
            buf_append_str(cmd, " --type-add");
            shell_quote(cmd, buf_cstr(&t));
            buf_append_str(cmd, " --type cflueinclude");
            buf_cleanup(&t);
        }
    } else {
        buf_append_str(cmd, literal ? "LC_ALL=C exec grep -rnHZF" : "LC_ALL=C exec grep -rnHZE");
        buf_append_str(cmd, " --binary-files=without-match --devices=skip");
        if (g->include) {
            /* before the excludes: with both, the last matching option wins */
            buf_append_str(cmd, " --include");
            shell_quote(cmd, g->include);
        }
        /* hidden entries, but not the starting "." itself */
        buf_append_str(cmd, " --exclude='.*' --exclude-dir='.[!.]*' --exclude-dir='..?*'");
    }
    buf_append_str(cmd, " -e");
    shell_quote(cmd, pattern);
    buf_append_str(cmd, " --");
    shell_quote(cmd, rel);
}

/* search collects the hits of g under rel (path as the model wrote it): with pcre2 (and for
 * paths outside the workspace) by walking the tree here, else by running engine in the
 * sandbox. Fails the result and returns false when the search could not run. */
static bool search(struct grep *g, const char *engine, const char *pattern, bool literal,
                   const char *rel, const char *path, bool is_dir, struct tool_result *res)
{
    struct cf_error err;
    if (!strcmp(engine, "pcre2") || rel[0] == '/') {
        struct walk_opts wo = {.skip_hidden = true,
                               .gitignore = true,
                               .visit = grep_visit,
                               .cancelled = grep_cancelled,
                               .ctx = g};
        if (walk_tree(g->ctx->sb, rel, path, &wo, &err) != CF_OK) {
            tool_fail_error(res, &err);
            return false;
        }
        return true;
    }
    /* a start the search cannot read is refused as toold's own walk refuses it (the engines
     * would pass it over, as they do a directory below it, and say there are no matches) */
    if (is_dir) {
        int fd;
        if (ws_open(g->ctx->sb, rel, O_RDONLY | O_DIRECTORY, 0, path, &fd, &err) != CF_OK) {
            tool_fail_error(res, &err);
            return false;
        }
        close(fd);
    }
    struct buf cmd;
    int code;
    buf_init(&cmd, TOOL_PATTERN_MAX * 4 + 8192);
    engine_command(g, engine, pattern, literal, rel, &cmd);
    g->filter = ignore_filter_new(g->ctx->sb);
    g->start_rel = rel;
    enum cf_status rc = run_engine(g, buf_cstr(&cmd), &code, &err);
    buf_cleanup(&cmd);
    if (rc != CF_OK) {
        tool_fail(res, "The search could not run: %s", err.msg);
        return false;
    }
    /* exit 2 whose every complaint is "Permission denied": directories it could not read */
    bool unreadable_only = code == 2 && !g->engine_stopped && g->err_lines && !g->err_other;
    if (code > 1 && g->hits.total == 0 && !unreadable_only) {
        tool_fail(res, "The search failed (%s exited with code %d%s%s).", engine, code,
                  g->err_other ? ": " : "", g->err_first);
        return false;
    }
    /* directories it could not read are passed over, as toold's own walk does */
    return true;
}

void tool_grep_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    json_t *jp = json_object_get(args, "pattern");
    const char *pattern = json_string_value(jp);
    const char *path = json_string_value(json_object_get(args, "path"));
    const char *include = json_string_value(json_object_get(args, "include"));
    bool literal = json_is_true(json_object_get(args, "literal"));
    char rel[WS_PATH_MAX];
    struct grep g = {.ctx = ctx, .include = include && *include ? include : NULL};
    struct stat st;

    if (!path || !*path) {
        path = ".";
    }
    json_object_set_new(res->details, "pattern", json_string(pattern));
    json_object_set_new(res->details, "path", json_string(path));
    if (!compile_pattern(&g, jp, literal, res) ||
        !search_root(ctx, path, rel, sizeof(rel), &st, res)) {
        goto out;
    }
    /* the path exists and is reachable; the engines do the rest, but none is handed a FIFO,
     * socket or device to block on */
    if (!(S_ISDIR(st.st_mode) || S_ISREG(st.st_mode))) {
        tool_fail(res,
                  "%s is neither a regular file nor a directory (a FIFO, socket or device); grep "
                  "searches files and directories.",
                  path);
        goto out;
    }
    g.hits.cap = TOOL_GREP_MATCHES_MAX;
    g.hits.items = mem_alloc(g.hits.cap * sizeof(struct hit));
    buf_init(&g.line, 8192);
    buf_init(&g.err_line, 2 * WS_PATH_MAX); /* a path and what the engine says of it */
    const char *engine = ctx->cfg->grep_engine;
    if (!strcmp(engine, "auto")) {
        engine = rel[0] != '/' && rg_available(ctx) ? "rg" : "pcre2";
    }
    json_object_set_new(res->details, "engine", json_string(engine));
    if (!search(&g, engine, pattern, literal, rel, path, S_ISDIR(st.st_mode), res) ||
        !list_hits(ctx, &g.hits, true, res)) {
        goto out;
    }
    if (g.hits.total == 0) {
        buf_printf(&res->text, "No matches for the pattern in %s.", path);
    } else if (g.hits.total > g.hits.n) {
        buf_printf(&res->text,
                   "\n\n[Showing the first %zu of %llu matching lines, in path and line order. "
                   "Narrow the search (a more specific pattern, a path, or include) to see the "
                   "rest.]",
                   g.hits.n, (unsigned long long)g.hits.total);
        res->trunc.truncated = true;
        res->trunc.by = CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_MATCHES;
    }
    res->trunc.total_lines = (int64_t)g.hits.total;
out:
    ignore_filter_free(g.filter);
    topk_free(&g.hits);
    buf_cleanup(&g.line);
    buf_cleanup(&g.err_line);
    pcre2_match_data_free(g.md);
    pcre2_code_free(g.re);
    free(g.data);
}

/* ---------- glob ---------- */

struct glob {
    struct tool_ctx *ctx;
    const char *pattern;
    struct topk hits;
};

static bool glob_visit(void *arg, const char *rel, int dirfd, const char *name_in_dir)
{
    struct glob *g = arg;
    (void)dirfd;
    (void)name_in_dir;
    const char *name = strrchr(rel, '/');
    name = name ? name + 1 : rel;
    if (fnmatch(g->pattern, name, 0) == 0) {
        struct hit h = {mem_strdup(rel), 0, NULL};
        topk_add(&g->hits, h);
    }
    return !tool_cancelled(g->ctx);
}

static bool glob_cancelled(void *arg)
{
    struct glob *g = arg;
    return tool_cancelled(g->ctx);
}

void tool_glob_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    const char *pattern = json_string_value(json_object_get(args, "pattern"));
    const char *path = json_string_value(json_object_get(args, "path"));
    char rel[WS_PATH_MAX];
    struct cf_error err;
    struct glob g = {.ctx = ctx, .pattern = pattern};
    struct stat st;

    if (!path || !*path) {
        path = ".";
    }
    json_object_set_new(res->details, "pattern", json_string(pattern));
    json_object_set_new(res->details, "path", json_string(path));
    if (json_string_length(json_object_get(args, "pattern")) > TOOL_PATTERN_MAX) {
        tool_fail(res, "The pattern is %zu bytes; the limit is %d.",
                  json_string_length(json_object_get(args, "pattern")), TOOL_PATTERN_MAX);
        return;
    }
    if (!*pattern) {
        tool_fail(res, "The pattern is empty; give a file-name pattern such as *.c.");
        return;
    }
    if (strchr(pattern, '/')) {
        tool_fail(res,
                  "The pattern '%s' contains '/', but glob matches file names only. Put the "
                  "directory in path and the name pattern in pattern.",
                  pattern);
        return;
    }
    if (!search_root(ctx, path, rel, sizeof(rel), &st, res)) {
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        tool_fail(res, "%s is not a directory; glob searches directories.", path);
        return;
    }
    g.hits.cap = TOOL_GLOB_PATHS_MAX;
    g.hits.items = mem_alloc(g.hits.cap * sizeof(struct hit));
    struct walk_opts wo = {.visit = glob_visit, .cancelled = glob_cancelled, .ctx = &g};
    if (walk_tree(ctx->sb, rel, path, &wo, &err) != CF_OK) {
        tool_fail_error(res, &err);
        goto out;
    }
    if (!list_hits(ctx, &g.hits, false, res)) {
        goto out;
    }
    if (g.hits.total == 0) {
        buf_printf(&res->text, "No files named like %s under %s.", pattern, path);
    } else if (g.hits.total > g.hits.n) {
        buf_printf(&res->text,
                   "\n\n[Showing the first %zu of %llu matching files, sorted by path. Narrow "
                   "the pattern or the path to see the rest.]",
                   g.hits.n, (unsigned long long)g.hits.total);
        res->trunc.truncated = true;
        res->trunc.by = CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_PATHS;
    }
out:
    topk_free(&g.hits);
}
