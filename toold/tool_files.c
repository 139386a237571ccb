/* tool_files.c - read, write and edit.
 *
 * read pages through a file: lines are split on '\n' (a trailing '\n' ends the last line, it
 * does not start an empty one), a page holds at most TOOL_LINES_MAX lines and TOOL_BYTES_MAX
 * bytes (the lines plus the '\n' between them), never a partial line except when the first
 * line alone is over the byte budget. Whenever lines remain after the page, the text ends with
 * "[Showing lines A-B of T. Use offset=N to continue.]". The file is mapped, not copied, so
 * paging through a large file costs one scan per page and no heap.
 *
 * write and edit replace the file atomically (temporary file + rename) while holding the
 * file's per-path turn, so same-path calls of one batch apply one after the other.
 */
#include "tool.h"

#include "utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define BINARY_SNIFF 8192
#define INDEX_STEP 4096 /* lines between remembered line starts */
#define INDEX_SLOTS 16

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

static bool same_version(const struct line_index *x, const struct stat *st)
{
    return x->marks && x->dev == st->st_dev && x->ino == st->st_ino && x->size == st->st_size &&
           x->mtime.tv_sec == st->st_mtim.tv_sec && x->mtime.tv_nsec == st->st_mtim.tv_nsec;
}

/* line_lookup finds the total line count and where line `line` starts (or the nearest mark
 * before it: *from_line, *from_byte). Builds the index on a miss. */
static void line_lookup(const struct stat *st, const char *data, size_t size, int64_t line,
                        int64_t *total, int64_t *from_line, size_t *from_byte)
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
            return;
        }
    }
    pthread_mutex_unlock(&index_mu);
    size_t cap = 16, n = 1;
    size_t *marks = malloc(sizeof(size_t) * cap);
    int64_t count = 0;
    marks[0] = 0;
    for (const char *p = data, *end = data + size; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        count++;
        p = nl ? nl + 1 : end;
        if (count % INDEX_STEP == 0 && p < end) {
            if (n == cap) {
                cap *= 2;
                marks = realloc(marks, sizeof(size_t) * cap);
            }
            marks[n++] = (size_t)(p - data);
        }
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
    if (ws_relative(ctx->sb, path, rel, sizeof(rel), &err) != CF_OK ||
        ws_open(ctx->sb, rel, O_RDONLY, 0, path, &fd, &err) != CF_OK) {
        tool_fail_error(res, &err);
        return;
    }
    if (fstat(fd, &st) != 0) {
        tool_fail(res, "%s: cannot read its status: %s", path, strerror(errno));
        close(fd);
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        close(fd);
        tool_fail(res, "%s is a directory, not a file. Use glob or bash (ls) to list it.", path);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        tool_fail(res, "%s is not a regular file (a device, socket or pipe); it cannot be read.",
                  path);
        return;
    }
    size_t size = (size_t)st.st_size;
    const char *data = "";
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            close(fd);
            tool_fail(res, "%s: cannot map the file: %s", path, strerror(errno));
            return;
        }
        data = map;
        madvise(map, size, MADV_SEQUENTIAL);
    }
    close(fd);
    json_object_set_new(res->details, "bytes", json_integer((json_int_t)size));
    res->trunc.total_bytes = (int64_t)size;

    if (memchr(data, '\0', size < BINARY_SNIFF ? size : BINARY_SNIFF)) {
        buf_printf(&res->text,
                   "%s is a binary file (%zu bytes, %s); its bytes are not shown as text.", path,
                   size, binary_kind((const unsigned char *)data, size));
        json_object_set_new(res->details, "binary", json_true());
        goto done;
    }

    /* count lines and find where line `offset` starts, from the nearest indexed mark */
    int64_t total, line;
    size_t start_byte;
    line_lookup(&st, data, size, offset, &total, &line, &start_byte);
    while (line < offset && start_byte < size) {
        const char *nl = memchr(data + start_byte, '\n', size - start_byte);
        start_byte = nl ? (size_t)(nl - data) + 1 : size;
        line++;
    }
    res->trunc.total_lines = total;
    json_object_set_new(res->details, "lines", json_integer(total));
    if (offset > total && !(total == 0 && offset == 1)) {
        tool_fail(res, "offset %lld is past the end of %s, which has %lld line%s.",
                  (long long)offset, path, (long long)total, total == 1 ? "" : "s");
        goto done;
    }
    if (total == 0) {
        goto done;
    }

    /* select the page */
    int64_t max_lines = TOOL_LINES_MAX;
    bool by_limit = false;
    if (limit > 0 && limit <= max_lines) {
        max_lines = limit;
        by_limit = true;
    }
    int64_t shown = 0;
    size_t page_end = start_byte, budget = TOOL_BYTES_MAX;
    bool bytes_hit = false;
    for (const char *p = data + start_byte, *end = data + size; p < end && shown < max_lines;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *line_end = nl ? nl : end;
        size_t need = (size_t)(line_end - (data + start_byte));
        if (need > budget) {
            bytes_hit = true;
            break;
        }
        page_end = (size_t)(line_end - data);
        shown++;
        p = nl ? nl + 1 : end;
    }
    int64_t first = offset, last = offset + shown - 1;
    if (shown == 0) {
        /* the first line alone is over the budget: show its head */
        const char *p = data + start_byte;
        const char *nl = memchr(p, '\n', size - start_byte);
        size_t line_len = nl ? (size_t)(nl - p) : size - start_byte;
        size_t cut = utf8_prefix_len(p, line_len, TOOL_BYTES_MAX);
        utf8_sanitize(&res->text, p, cut);
        buf_printf(&res->text,
                   "\n\n[Line %lld is %zu bytes long, over the %d-byte page limit; only its "
                   "first %zu bytes are shown. The rest of this line cannot be reached with "
                   "offset/limit; use bash (for example cut -c or fold) to see it.]",
                   (long long)offset, line_len, TOOL_BYTES_MAX, cut);
        res->trunc.truncated = true;
        res->trunc.by = CFLUE__V1__TRUNCATED_BY__BYTES;
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
        goto done;
    }
    utf8_sanitize(&res->text, data + start_byte, page_end - start_byte);
    res->trunc.shown_first_line = first;
    res->trunc.shown_last_line = last;
    if (last < total) {
        buf_printf(&res->text,
                   "\n\n[Showing lines %lld-%lld of %lld. Use offset=%lld to continue.]",
                   (long long)first, (long long)last, (long long)total, (long long)last + 1);
        res->trunc.next_offset = last + 1;
        if (bytes_hit || !by_limit) {
            res->trunc.truncated = true;
            res->trunc.by =
                bytes_hit ? CFLUE__V1__TRUNCATED_BY__BYTES : CFLUE__V1__TRUNCATED_BY__LINES;
        }
    }
done:
    if (map) {
        munmap(map, size);
    }
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

/* read_all loads a whole file for edit (bounded by TOOL_EDIT_FILE_MAX). */
static enum cf_status read_all(struct tool_ctx *ctx, const char *rel, const char *path, char **out,
                               size_t *len_out, struct cf_error *err)
{
    int fd;
    struct stat st;
    enum cf_status rc = ws_open(ctx->sb, rel, O_RDONLY, 0, path, &fd, err);
    if (rc != CF_OK) {
        return rc;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return cf_error_set(err, CF_INVALID, "%s is not a regular file", path);
    }
    if (st.st_size > TOOL_EDIT_FILE_MAX) {
        close(fd);
        return cf_error_set(err, CF_TOOBIG,
                            "%s is %lld bytes; edit works on files up to %d bytes (use bash "
                            "with sed for larger ones)",
                            path, (long long)st.st_size, TOOL_EDIT_FILE_MAX);
    }
    char *data = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (data && got < (size_t)st.st_size) {
        ssize_t r = read(fd, data + got, (size_t)st.st_size - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) {
                continue;
            }
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (!data) {
        return cf_error_set(err, CF_NOMEM, "out of memory reading %s", path);
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
    char *out = malloc(out_len + 1);
    if (!out) {
        tool_fail(res, "Out of memory editing %s; nothing was changed.", path);
        goto out;
    }
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
