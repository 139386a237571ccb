/* tool_files.c - read, write and edit.
 *
 * read pages through a file: lines are split on '\n' (a trailing '\n' ends the last line, it
 * does not start an empty one), a page holds at most TOOL_LINES_MAX lines and TOOL_BYTES_MAX
 * bytes (the lines plus the '\n' between them), never a partial line except when the first
 * line alone is over the byte budget. Whenever lines remain after the page, the text ends with
 * "[Showing lines A-B of T. Use offset=N to continue.]".
 *
 * A sandbox's files belong to whatever runs in it, which may truncate, grow or replace them at
 * any moment, or put a FIFO where a file was. So files are never mapped (a mapped file cut
 * short arrives as SIGBUS): they are opened with ws_open_regular (special files refused without
 * being opened for I/O) and read with pread into bounded buffers, READ_CHUNK at a time, with
 * the call's deadline and cancellation checked between chunks. The file's size at open fixes
 * the version being read: growth past it is not read, and a file cut short meanwhile gives an
 * error saying so. Paging a large file costs one scan to build its line index (cached per
 * file version), then one bounded read per page.
 *
 * write and edit replace the file atomically (temporary file + rename) while holding the
 * file's per-path turn, so same-path calls of one batch apply one after the other.
 */
#include "tool.h"

#include "mem.h"
#include "utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BINARY_SNIFF 8192
#define INDEX_STEP 4096 /* lines between remembered line starts */
#define INDEX_SLOTS 16
#define READ_CHUNK (256 * 1024)

/* A small cache of line counts and line-start marks per file version (device, inode, size,
 * modification time), so paging through a large file scans from the nearest mark instead of
 * from the start on every page. */
struct line_index {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    int64_t total;
    size_t n_marks;
    size_t *marks; /* marks[i]: byte offset where line 1 + i * INDEX_STEP starts */
};

static struct line_index index_cache[INDEX_SLOTS];
static int index_next;
static pthread_mutex_t index_mu = PTHREAD_MUTEX_INITIALIZER;

/* One file being read: its descriptor, the size that fixes the version, a chunk buffer. */
struct reader {
    struct tool_ctx *ctx;
    int fd;
    size_t size;
    const char *path;
    bool saved_output; /* a file of TOOL_SPILL_DIR: text, whatever its bytes */
    char *chunk;       /* READ_CHUNK bytes */
};

static bool same_version(const struct line_index *x, const struct stat *st)
{
    return x->marks && x->dev == st->st_dev && x->ino == st->st_ino && x->size == st->st_size &&
           x->mtime.tv_sec == st->st_mtim.tv_sec && x->mtime.tv_nsec == st->st_mtim.tv_nsec;
}

/* pread_full reads exactly n bytes at off; a file now shorter than that is an error. */
static enum cf_status pread_full(struct reader *r, char *p, size_t n, size_t off,
                                 struct cf_error *err)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(r->fd, p + got, n - got, (off_t)(off + got));
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k < 0) {
            return cf_error_set(err, CF_IO, "%s could not be read: %s", r->path, strerror(errno));
        }
        if (k == 0) {
            return cf_error_set(err, CF_IO,
                                "%s was cut short while it was being read (something in the "
                                "sandbox changed it); read it again",
                                r->path);
        }
        got += (size_t)k;
    }
    return CF_OK;
}

static enum cf_status check_time(struct reader *r, struct cf_error *err)
{
    if (tool_cancelled(r->ctx)) {
        return cf_error_set(err, CF_CANCELLED,
                            "Reading %s was cancelled or ran out of time before it finished.",
                            r->path);
    }
    return CF_OK;
}

/* build_index scans the whole file once: its line count and a mark every INDEX_STEP lines. */
static enum cf_status build_index(struct reader *r, int64_t *total_out, size_t **marks_out,
                                  size_t *n_out, struct cf_error *err)
{
    size_t cap = 16, n = 1;
    size_t *marks = mem_alloc(sizeof(size_t) * cap);
    uint64_t newlines = 0;
    char last = '\n';
    enum cf_status rc = CF_OK;
    for (size_t pos = 0; pos < r->size;) {
        size_t k = r->size - pos < READ_CHUNK ? r->size - pos : READ_CHUNK;
        if ((rc = check_time(r, err)) != CF_OK || (rc = pread_full(r, r->chunk, k, pos, err))) {
            free(marks);
            return rc;
        }
        for (const char *p = r->chunk, *end = r->chunk + k;
             (p = memchr(p, '\n', (size_t)(end - p))); p++) {
            newlines++;
            size_t next = pos + (size_t)(p - r->chunk) + 1;
            if (newlines % INDEX_STEP == 0 && next < r->size) {
                if (n == cap) {
                    cap *= 2;
                    marks = mem_realloc(marks, sizeof(size_t) * cap);
                }
                marks[n++] = next;
            }
        }
        last = r->chunk[k - 1];
        pos += k;
    }
    marks[0] = 0;
    *total_out = (int64_t)newlines + (r->size > 0 && last != '\n' ? 1 : 0);
    *marks_out = marks;
    *n_out = n;
    return CF_OK;
}

/* line_lookup finds the total line count and the nearest mark at or before line `line`
 * (*from_line, *from_byte), building the file's index on a miss. */
static enum cf_status line_lookup(struct reader *r, const struct stat *st, int64_t line,
                                  int64_t *total, int64_t *from_line, size_t *from_byte,
                                  struct cf_error *err)
{
    pthread_mutex_lock(&index_mu);
    for (int i = 0; i < INDEX_SLOTS; i++) {
        struct line_index *x = &index_cache[i];
        if (same_version(x, st)) {
            size_t m = (size_t)((line - 1) / INDEX_STEP);
            if (m >= x->n_marks) {
                m = x->n_marks - 1;
            }
            *total = x->total;
            *from_line = 1 + (int64_t)m * INDEX_STEP;
            *from_byte = x->marks[m];
            pthread_mutex_unlock(&index_mu);
            return CF_OK;
        }
    }
    pthread_mutex_unlock(&index_mu);
    size_t *marks, n;
    int64_t count;
    enum cf_status rc = build_index(r, &count, &marks, &n, err);
    if (rc != CF_OK) {
        return rc;
    }
    size_t m = (size_t)((line - 1) / INDEX_STEP);
    if (m >= n) {
        m = n - 1;
    }
    *total = count;
    *from_line = 1 + (int64_t)m * INDEX_STEP;
    *from_byte = marks[m];
    pthread_mutex_lock(&index_mu);
    struct line_index *slot = &index_cache[index_next];
    index_next = (index_next + 1) % INDEX_SLOTS;
    free(slot->marks);
    *slot = (struct line_index){st->st_dev, st->st_ino, st->st_size, st->st_mtim, count, n, marks};
    pthread_mutex_unlock(&index_mu);
    return CF_OK;
}

/* skip_lines moves *pos (the start of line *line) forward to the start of line target. */
static enum cf_status skip_lines(struct reader *r, size_t *pos, int64_t *line, int64_t target,
                                 struct cf_error *err)
{
    enum cf_status rc;
    while (*line < target && *pos < r->size) {
        size_t k = r->size - *pos < READ_CHUNK ? r->size - *pos : READ_CHUNK, i = 0;
        if ((rc = check_time(r, err)) != CF_OK || (rc = pread_full(r, r->chunk, k, *pos, err))) {
            return rc;
        }
        while (*line < target) {
            const char *nl = memchr(r->chunk + i, '\n', k - i);
            if (!nl) {
                i = k;
                break;
            }
            i = (size_t)(nl - r->chunk) + 1;
            (*line)++;
        }
        *pos += i;
    }
    return CF_OK;
}

/* line_length finds how long the line starting at pos is (up to its '\n' or the end). */
static enum cf_status line_length(struct reader *r, size_t pos, size_t *len_out,
                                  struct cf_error *err)
{
    enum cf_status rc;
    for (size_t at = pos; at < r->size;) {
        size_t k = r->size - at < READ_CHUNK ? r->size - at : READ_CHUNK;
        if ((rc = check_time(r, err)) != CF_OK || (rc = pread_full(r, r->chunk, k, at, err))) {
            return rc;
        }
        const char *nl = memchr(r->chunk, '\n', k);
        if (nl) {
            *len_out = at + (size_t)(nl - r->chunk) - pos;
            return CF_OK;
        }
        at += k;
    }
    *len_out = r->size - pos;
    return CF_OK;
}

static const char *binary_kind(const unsigned char *p, size_t n)
{
    static const struct {
        const char *magic;
        size_t len;
        const char *kind;
    } kinds[] = {
        {"\x89PNG", 4, "PNG image"},
        {"\xff\xd8\xff", 3, "JPEG image"},
        {"GIF8", 4, "GIF image"},
        {"%PDF", 4, "PDF document"},
        {"PK\x03\x04", 4, "ZIP archive"},
        {"\x7f"
         "ELF",
         4, "ELF executable"},
        {"\x1f\x8b", 2, "gzip data"},
        {"SQLite format 3", 15, "SQLite database"},
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (n >= kinds[i].len && !memcmp(p, kinds[i].magic, kinds[i].len)) {
            return kinds[i].kind;
        }
    }
    return "binary data";
}

/* read_page fills res with the page of r starting at line offset (see the top). */
static enum cf_status read_page(struct reader *r, const struct stat *st, int64_t offset,
                                int64_t limit, struct tool_result *res, struct cf_error *err)
{
    const char *path = r->path;
    size_t size = r->size;
    enum cf_status rc;
    size_t sniff = size < BINARY_SNIFF ? size : BINARY_SNIFF;
    if ((rc = pread_full(r, r->chunk, sniff, 0, err)) != CF_OK) {
        return rc;
    }
    if (!r->saved_output && memchr(r->chunk, '\0', sniff)) {
        buf_printf(&res->text,
                   "%s is a binary file (%zu bytes, %s); its bytes are not shown as text.", path,
                   size, binary_kind((const unsigned char *)r->chunk, sniff));
        json_object_set_new(res->details, "binary", json_true());
        return CF_OK;
    }

    /* count lines and find where line `offset` starts, from the nearest indexed mark */
    int64_t total, line;
    size_t start_byte;
    if ((rc = line_lookup(r, st, offset, &total, &line, &start_byte, err)) != CF_OK ||
        (rc = skip_lines(r, &start_byte, &line, offset, err)) != CF_OK) {
        return rc;
    }
    res->trunc.total_lines = total;
    json_object_set_new(res->details, "lines", json_integer(total));
    if (offset > total && !(total == 0 && offset == 1)) {
        tool_fail(res, "offset %lld is past the end of %s, which has %lld line%s.",
                  (long long)offset, path, (long long)total, total == 1 ? "" : "s");
        return CF_OK;
    }
    if (total == 0) {
        return CF_OK;
    }

    /* the page lies within the budget plus one byte after start_byte */
    size_t wlen = size - start_byte < TOOL_BYTES_MAX + 1 ? size - start_byte : TOOL_BYTES_MAX + 1;
    const char *data = r->chunk; /* READ_CHUNK > TOOL_BYTES_MAX + 1 */
    if ((rc = pread_full(r, r->chunk, wlen, start_byte, err)) != CF_OK) {
        return rc;
    }
    bool window_reaches_end = start_byte + wlen == size;
    int64_t max_lines = TOOL_LINES_MAX;
    bool by_limit = false;
    if (limit > 0 && limit <= max_lines) {
        max_lines = limit;
        by_limit = true;
    }
    int64_t shown = 0;
    size_t page_end = 0, budget = TOOL_BYTES_MAX;
    bool bytes_hit = false;
    const char *p = data, *end = data + wlen;
    while (p < end && shown < max_lines) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl && !window_reaches_end) {
            bytes_hit = true; /* the line goes on past the window: over the budget */
            break;
        }
        const char *line_end = nl ? nl : end;
        size_t need = (size_t)(line_end - data);
        if (need > budget) {
            bytes_hit = true;
            break;
        }
        page_end = need;
        shown++;
        p = nl ? nl + 1 : end;
    }
    if (p == end && !window_reaches_end && shown < max_lines) {
        bytes_hit = true; /* a line ended on the window's last byte: the budget is spent */
    }
    int64_t first = offset, last = offset + shown - 1;
    if (shown == 0) {
        /* the first line alone is over the budget: show its head */
        size_t line_len;
        if ((rc = line_length(r, start_byte, &line_len, err)) != CF_OK ||
            (rc = pread_full(r, r->chunk, wlen, start_byte, err)) != CF_OK) {
            return rc;
        }
        size_t cut = utf8_prefix_len(data, line_len < wlen ? line_len : wlen, TOOL_BYTES_MAX);
        utf8_sanitize(&res->text, data, cut);
        buf_printf(&res->text,
                   "\n\n[Line %lld is %zu bytes long, over the %d-byte page limit; only its "
                   "first %zu bytes are shown. The rest of this line cannot be reached with "
                   "offset/limit; use bash (for example cut -c or fold) to see it.]",
                   (long long)offset, line_len, TOOL_BYTES_MAX, cut);
        res->trunc.truncated = true;
        res->trunc.by = CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_BYTES;
        res->trunc.line_too_long = true;
        last = offset;
        if (offset < total) {
            buf_printf(&res->text,
                       "\n[Showing lines %lld-%lld of %lld. Use offset=%lld to "
                       "continue.]",
                       (long long)offset, (long long)offset, (long long)total,
                       (long long)offset + 1);
            res->trunc.next_offset = offset + 1;
        }
        res->trunc.shown_first_line = first;
        res->trunc.shown_last_line = last;
        return CF_OK;
    }
    utf8_sanitize(&res->text, data, page_end);
    res->trunc.shown_first_line = first;
    res->trunc.shown_last_line = last;
    if (last < total) {
        buf_printf(&res->text,
                   "\n\n[Showing lines %lld-%lld of %lld. Use offset=%lld to continue.]",
                   (long long)first, (long long)last, (long long)total, (long long)last + 1);
        res->trunc.next_offset = last + 1;
        if (bytes_hit || !by_limit) {
            res->trunc.truncated = true;
            res->trunc.by = bytes_hit ? CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_BYTES
                                      : CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_LINES;
        }
    }
    return CF_OK;
}

void tool_read_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    const char *path = json_string_value(json_object_get(args, "path"));
    json_t *joff = json_object_get(args, "offset"), *jlim = json_object_get(args, "limit");
    int64_t offset = joff ? json_integer_value(joff) : 1;
    int64_t limit = jlim ? json_integer_value(jlim) : 0;
    char rel[WS_PATH_MAX];
    struct cf_error err;
    struct stat st;
    int fd;

    json_object_set_new(res->details, "path", json_string(path));
    if (tool_resolve(ctx, path, rel, sizeof(rel), &err) != CF_OK) {
        tool_fail_error(res, &err);
        return;
    }
    if (ws_open_regular(ctx->sb, rel, path, &fd, &st, &err) != CF_OK) {
        if (S_ISDIR(st.st_mode)) {
            tool_fail(res, "%s is a directory, not a file. Use glob or bash (ls) to list it.",
                      path);
        } else {
            tool_fail_error(res, &err);
        }
        return;
    }
    struct reader r = {.ctx = ctx,
                       .fd = fd,
                       .size = (size_t)st.st_size,
                       .path = path,
                       .saved_output = !strncmp(rel, TOOL_SPILL_DIR "/", sizeof(TOOL_SPILL_DIR)),
                       .chunk = NULL};
    json_object_set_new(res->details, "bytes", json_integer((json_int_t)r.size));
    res->trunc.total_bytes = (int64_t)r.size;
    r.chunk = mem_alloc(READ_CHUNK);
    if (read_page(&r, &st, offset, limit, res, &err) != CF_OK) {
        buf_reset(&res->text);
        res->trunc = (Cflue__V1__Truncation)CFLUE__V1__TRUNCATION__INIT;
        res->trunc.total_bytes = (int64_t)r.size;
        tool_fail_error(res, &err);
    }
    free(r.chunk);
    close(fd);
}

void tool_write_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    const char *path = json_string_value(json_object_get(args, "path"));
    json_t *jc = json_object_get(args, "content");
    const char *content = json_string_value(jc);
    size_t len = json_string_length(jc);
    char key[WS_PATH_MAX];
    struct cf_error err;

    json_object_set_new(res->details, "path", json_string(path));
    if (tool_lock_path(ctx, path, key, sizeof(key), &err) != CF_OK) {
        tool_fail_error(res, &err);
        return;
    }
    if (tool_cancelled(ctx)) {
        tool_fail(res, "The call was cancelled before %s was written; nothing was changed.", path);
    } else if (ws_write_file(ctx->sb, key, content, len, 0, path, &err) != CF_OK) {
        tool_fail_error(res, &err);
    } else {
        buf_printf(&res->text, "Wrote %zu bytes to %s.", len, path);
        json_object_set_new(res->details, "bytes", json_integer((json_int_t)len));
    }
    tool_unlock_path(ctx, key);
}

/* read_all loads a whole file for edit (bounded by TOOL_EDIT_FILE_MAX), reading to its end
 * in bounded steps between which the deadline and cancellation are checked. */
static enum cf_status read_all(struct tool_ctx *ctx, const char *rel, const char *path, char **out,
                               size_t *len_out, struct cf_error *err)
{
    int fd;
    struct stat st;
    enum cf_status rc = ws_open_regular(ctx->sb, rel, path, &fd, &st, err);
    if (rc != CF_OK) {
        if (S_ISDIR(st.st_mode)) {
            return cf_error_set(err, CF_INVALID, "%s is not a regular file", path);
        }
        return rc;
    }
    size_t cap = (size_t)st.st_size + 1, got = 0;
    if (cap > TOOL_EDIT_FILE_MAX + 1) {
        close(fd);
        return cf_error_set(err, CF_TOOBIG,
                            "%s is %lld bytes; edit works on files up to %d bytes (use bash "
                            "with sed for larger ones)",
                            path, (long long)st.st_size, TOOL_EDIT_FILE_MAX);
    }
    char *data = mem_alloc(cap + 1);
    for (;;) {
        if (got == cap) {
            if (cap > TOOL_EDIT_FILE_MAX) {
                rc = cf_error_set(err, CF_TOOBIG,
                                  "%s grew past %d bytes while it was being read; edit works on "
                                  "files up to that size",
                                  path, TOOL_EDIT_FILE_MAX);
                break;
            }
            cap *= 2;
            data = mem_realloc(data, cap + 1);
        }
        if (tool_cancelled(ctx)) {
            rc = cf_error_set(err, CF_CANCELLED,
                              "Reading %s was cancelled or ran out of time; nothing was changed.",
                              path);
            break;
        }
        size_t want = cap - got < READ_CHUNK ? cap - got : READ_CHUNK;
        ssize_t r = read(fd, data + got, want);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            rc = cf_error_set(err, CF_IO, "%s could not be read: %s", path, strerror(errno));
            break;
        }
        if (r == 0) {
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (rc != CF_OK) {
        free(data);
        return rc;
    }
    data[got] = '\0';
    *out = data;
    *len_out = got;
    return CF_OK;
}

void tool_edit_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res)
{
    const char *path = json_string_value(json_object_get(args, "path"));
    json_t *jold = json_object_get(args, "oldText"), *jnew = json_object_get(args, "newText");
    const char *old_text = json_string_value(jold), *new_text = json_string_value(jnew);
    size_t old_len = json_string_length(jold), new_len = json_string_length(jnew);
    bool all = json_is_true(json_object_get(args, "replaceAll"));
    char key[WS_PATH_MAX];
    struct cf_error err;
    char *data = NULL;
    size_t len = 0;

    json_object_set_new(res->details, "path", json_string(path));
    if (old_len == 0) {
        tool_fail(res, "oldText is empty; give the exact text to replace.");
        return;
    }
    if (tool_lock_path(ctx, path, key, sizeof(key), &err) != CF_OK) {
        tool_fail_error(res, &err);
        return;
    }
    if (read_all(ctx, key, path, &data, &len, &err) != CF_OK) {
        tool_fail_error(res, &err);
        goto out;
    }
    size_t count = 0;
    for (const char *p = data, *hit; (hit = memmem(p, len - (size_t)(p - data), old_text, old_len));
         p = hit + old_len) {
        count++;
    }
    if (count == 0) {
        tool_fail(res,
                  "Could not find oldText in %s; nothing was changed. oldText must match the "
                  "file exactly, including whitespace, indentation and line breaks.",
                  path);
        goto out;
    }
    if (count > 1 && !all) {
        tool_fail(res,
                  "oldText occurs %zu times in %s; nothing was changed. Include more of the "
                  "surrounding lines so it occurs once, or set replaceAll to replace all %zu.",
                  count, path, count);
        goto out;
    }
    size_t out_len = len - count * old_len + count * new_len;
    char *out = mem_alloc(out_len + 1);
    size_t o = 0;
    const char *p = data;
    for (const char *hit; (hit = memmem(p, len - (size_t)(p - data), old_text, old_len));
         p = hit + old_len) {
        memcpy(out + o, p, (size_t)(hit - p));
        o += (size_t)(hit - p);
        memcpy(out + o, new_text, new_len);
        o += new_len;
    }
    memcpy(out + o, p, len - (size_t)(p - data));
    if (tool_cancelled(ctx)) {
        tool_fail(res, "The call was cancelled before %s was written; nothing was changed.", path);
    } else if (ws_write_file(ctx->sb, key, out, out_len, 0, path, &err) != CF_OK) {
        tool_fail_error(res, &err);
    } else if (all) {
        buf_printf(&res->text, "Replaced %zu occurrence%s in %s.", count, count == 1 ? "" : "s",
                   path);
    } else {
        buf_printf(&res->text, "Edited %s: replaced 1 occurrence.", path);
    }
    json_object_set_new(res->details, "replacements", json_integer((json_int_t)count));
    free(out);
out:
    free(data);
    tool_unlock_path(ctx, key);
}
