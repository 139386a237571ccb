/* walk.c - directory walks with hidden-entry and ignore-file rules.
 *
 * Ignore rules (.gitignore, then .ignore, in each directory from the sandbox root down): one
 * pattern per line; blank lines and lines starting with '#' are skipped; a leading '!'
 * re-includes; a trailing '/' matches directories only; a pattern with a '/' elsewhere is
 * anchored to the directory of its file, otherwise it matches a name at any depth below it;
 * '*', '?', '[...]' as in fnmatch, and '**' for any number of directories. The last matching
 * rule wins; an ignored directory is not entered.
 */
#include "walk.h"

#include "mem.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define IGNORE_FILE_MAX (1 << 20) /* bytes of one .gitignore or .ignore that are read */
#define WALK_DEPTH_MAX 256        /* directories below the start a walk enters */

/* The rules one walk (or one ignore filter) holds at once: past either bound, further rules
 * are not read (docs/toold.md). Without it every line of every ignore file on the way down
 * became a rule of its own (256 levels of 1 MiB files): a hostile workspace took toold's
 * memory and the time of every name's check with it. */
#define RULES_MAX 32768
#define RULES_BYTES_MAX (4u << 20) /* what the rules held take: patterns, segments, bases */

struct rule {
    char *pattern; /* without '!', trailing '/', leading '/' */
    char **segs;   /* an anchored pattern with a "**": its segments (split_segments) */
    int n_segs;
    int n_fixed; /* segments other than "**": a path with fewer components cannot match */
    /* directory of the ignore file, relative to the root ("" for the root): one copy per
     * ignore file, shared by its rules and owned by the first of them (rules are dropped
     * last first) */
    const char *base;
    size_t base_len;
    size_t cost; /* bytes counted against the budget */
    bool owns_base, negate, dir_only, anchored;
};

struct rules {
    struct rule *items;
    size_t n, cap;
};

/* What the rules held by one walk or filter take, against RULES_MAX and RULES_BYTES_MAX. */
struct rule_budget {
    size_t rules, bytes;
};

/* One ignore file being read: its base, copied when its first rule is kept. */
struct ignore_file {
    const char *base;
    char *copy;
};

/* A rule's pattern with a "**" segment is matched segment by segment (split_segments); one
 * with more segments than this can match no path (each segment other than "**" takes a
 * component, a component at least two bytes of the path with its '/', and runs of "**" are
 * one), and is dropped. */
#define RULE_SEGMENTS_MAX (WS_PATH_MAX + 1)

/* split_segments splits pat (modified in place) at '/' into segs, a run of "**" segments
 * kept as one; returns how many, or -1 when more than max. */
static int split_segments(char *pat, char **segs, int max)
{
    int n = 0;
    for (char *p = pat, *slash;; p = slash + 1) {
        slash = strchr(p, '/');
        if (slash) {
            *slash = '\0';
        }
        if (!(n > 0 && !strcmp(p, "**") && !strcmp(segs[n - 1], "**"))) {
            if (n == max) {
                return -1;
            }
            segs[n++] = p;
        }
        if (!slash) {
            return n;
        }
    }
}

/* glob_match tells whether path (relative to the rule's directory) matches the rule's
 * segments: "**" spans any number of components (a trailing one at least one: everything
 * inside), every other segment matches one component as fnmatch does ("**" within a segment
 * is a '*'). Dynamic programming over (segment, component), from the end: time grows with
 * their product, never exponentially however many "**" a hostile pattern holds, and no
 * recursion. */
static bool glob_match(char *const *segs, int n_segs, int n_fixed, const char *path)
{
    char copy[WS_PATH_MAX];
    const char *comps[WS_PATH_MAX / 2 + 1]; /* each component takes a byte and a '/' */
    int n = 0;
    if (snprintf(copy, sizeof(copy), "%s", path) >= (int)sizeof(copy)) {
        return false;
    }
    for (char *p = copy, *slash;; p = slash + 1) {
        comps[n++] = p;
        if (!(slash = strchr(p, '/'))) {
            break;
        }
        *slash = '\0';
    }
    if (n < n_fixed) {
        return false;
    }
    /* next[j]: segments i+1.. match components j..; cur[j]: segments i.. do */
    bool rows[2][WS_PATH_MAX / 2 + 2];
    bool *next = rows[0], *cur = rows[1];
    for (int j = 0; j <= n; j++) {
        next[j] = j == n;
    }
    for (int i = n_segs - 1; i >= 0; i--) {
        bool dstar = !strcmp(segs[i], "**"), last = i == n_segs - 1;
        cur[n] = dstar && !last && next[n]; /* no component left: the rest must match none */
        for (int j = n - 1; j >= 0; j--) {
            cur[j] = dstar ? next[j] || cur[j + 1] || (last && j < n)
                           : next[j + 1] && fnmatch(segs[i], comps[j], 0) == 0;
        }
        bool *t = next;
        next = cur;
        cur = t;
    }
    return next[0];
}

/* add_rule parses one ignore-file line (NUL-terminated, modified in place), kept when the
 * budget has room for it. */
static void add_rule(struct rules *r, struct rule_budget *b, struct ignore_file *file, char *line)
{
    size_t n = strcspn(line, "\r\n");
    line[n] = '\0';
    while (n > 0 && line[n - 1] == ' ' && (n < 2 || line[n - 2] != '\\')) {
        line[--n] = '\0';
    }
    char *p = line;
    if (!*p || *p == '#') {
        return;
    }
    struct rule rule = {0};
    if (*p == '!') {
        rule.negate = true;
        p++;
    } else if (*p == '\\' && (p[1] == '!' || p[1] == '#')) {
        p++;
    }
    n = strlen(p);
    if (n && p[n - 1] == '/') {
        rule.dir_only = true;
        p[--n] = '\0';
    }
    if (!n) {
        return;
    }
    if (*p == '/') {
        rule.anchored = true;
        p++;
    } else if (strchr(p, '/')) {
        rule.anchored = strncmp(p, "**/", 3) != 0 || strchr(p + 3, '/') != NULL;
    }
    if (!rule.anchored && !strncmp(p, "**/", 3)) {
        p += 3;
    }
    size_t cost = sizeof(rule) + strlen(p) + 1 + (file->copy ? 0 : strlen(file->base) + 1);
    if (rule.anchored && strstr(p, "**")) {
        cost += (strlen(p) + 1) * (1 + sizeof(char *)); /* the copy, at most one segment a byte */
    }
    if (b->rules >= RULES_MAX || cost > RULES_BYTES_MAX - b->bytes) {
        return; /* past the budget: left out */
    }
    if (rule.anchored && strstr(p, "**")) {
        int slashes = 0;
        for (const char *q = p; (q = strchr(q, '/')); q++) {
            slashes++;
        }
        char *copy = mem_strdup(p);
        rule.segs = mem_alloc(sizeof(char *) * (size_t)(slashes + 1));
        rule.n_segs = split_segments(copy, rule.segs, RULE_SEGMENTS_MAX);
        if (rule.n_segs < 0) {
            free(copy);
            free(rule.segs);
            return; /* matches no path */
        }
        for (int i = 0; i < rule.n_segs; i++) {
            rule.n_fixed += strcmp(rule.segs[i], "**") != 0;
        }
    }
    rule.pattern = mem_strdup(p);
    if (!file->copy) {
        file->copy = mem_strdup(file->base);
        rule.owns_base = true;
    }
    rule.base = file->copy;
    rule.base_len = strlen(file->copy);
    rule.cost = cost;
    b->rules++;
    b->bytes += cost;
    if (r->n == r->cap) {
        r->cap = r->cap ? r->cap * 2 : 16;
        r->items = mem_realloc(r->items, sizeof(*r->items) * r->cap);
    }
    r->items[r->n++] = rule;
}

/* add_rules reads the ignore file name in dirfd: only a regular file (a FIFO there must not
 * block the walk), only its first IGNORE_FILE_MAX bytes, and only while b has room. */
static void add_rules(struct rules *r, struct rule_budget *b, int dirfd, const char *name,
                      const char *base)
{
    int fd;
    struct stat st;
    struct cf_error err;
    if (b->rules >= RULES_MAX || b->bytes >= RULES_BYTES_MAX) {
        return; /* full: not even read */
    }
    if (ws_open_regular_at(dirfd, name, name, &fd, &st, &err) != CF_OK) {
        return;
    }
    struct ignore_file file = {.base = base};
    char *text = mem_alloc(IGNORE_FILE_MAX + 1);
    size_t got = 0;
    while (got < IGNORE_FILE_MAX) {
        ssize_t k = read(fd, text + got, IGNORE_FILE_MAX - got);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            break;
        }
        got += (size_t)k;
    }
    close(fd);
    text[got] = '\0';
    for (char *line = text, *next; line < text + got; line = next) {
        char *nl = memchr(line, '\n', (size_t)(text + got - line));
        next = nl ? nl + 1 : text + got;
        if (nl) {
            *nl = '\0';
        }
        if (!memchr(line, '\0', (size_t)((nl ? nl : text + got) - line))) {
            add_rule(r, b, &file, line);
        }
    }
    free(text);
}

/* drop_rules frees r's rules past the first keep, giving their room back to b. */
static void drop_rules(struct rules *r, struct rule_budget *b, size_t keep)
{
    while (r->n > keep) {
        r->n--;
        b->rules--;
        b->bytes -= r->items[r->n].cost;
        free(r->items[r->n].pattern);
        if (r->items[r->n].owns_base) {
            free((char *)r->items[r->n].base);
        }
        if (r->items[r->n].segs) {
            free(r->items[r->n].segs[0]); /* the copy the segments point into */
            free(r->items[r->n].segs);
        }
    }
}

/* apply_rules sets *out as r's last rule matching rel (name its last component) says, and
 * leaves it when none does: rules of several directories apply root first. */
static void apply_rules(const struct rules *r, const char *rel, const char *name, bool is_dir,
                        bool *out)
{
    for (size_t i = 0; i < r->n; i++) {
        const struct rule *x = &r->items[i];
        if (x->dir_only && !is_dir) {
            continue;
        }
        size_t blen = x->base_len;
        const char *sub = rel;
        if (blen) {
            if (strncmp(rel, x->base, blen) != 0 || rel[blen] != '/') {
                continue;
            }
            sub = rel + blen + 1;
        }
        bool hit = x->segs       ? glob_match(x->segs, x->n_segs, x->n_fixed, sub)
                   : x->anchored ? fnmatch(x->pattern, sub, FNM_PATHNAME) == 0
                                 : fnmatch(x->pattern, name, 0) == 0;
        if (hit) {
            *out = !x->negate;
        }
    }
}

static bool ignored(const struct rules *r, const char *rel, const char *name, bool is_dir)
{
    bool out = false;
    apply_rules(r, rel, name, is_dir, &out);
    return out;
}

struct walker {
    const struct walk_opts *o;
    struct rules rules;
    struct rule_budget budget;
    bool stop;
    int depth;
};

/* walk_dir walks the directory open as dirfd, whose path relative to the root is dir ("." for
 * the root itself). */
static void walk_dir(struct walker *w, int dirfd, const char *dir)
{
    size_t keep = w->rules.n;
    const char *base = strcmp(dir, ".") ? dir : "";
    if (w->depth >= WALK_DEPTH_MAX) {
        return;
    }
    if (w->o->gitignore) {
        add_rules(&w->rules, &w->budget, dirfd, ".gitignore", base);
        add_rules(&w->rules, &w->budget, dirfd, ".ignore", base);
    }
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) {
            close(fd);
        }
        drop_rules(&w->rules, &w->budget, keep);
        return;
    }
    char *child = mem_alloc(WS_PATH_MAX);
    struct dirent *e;
    w->depth++;
    while (!w->stop && (e = readdir(d))) {
        const char *name = e->d_name;
        if (!strcmp(name, ".") || !strcmp(name, "..") || (w->o->skip_hidden && name[0] == '.')) {
            continue;
        }
        if (w->o->cancelled && w->o->cancelled(w->o->ctx)) {
            w->stop = true;
            break;
        }
        unsigned char type = e->d_type;
        if (type == DT_UNKNOWN) {
            struct stat st;
            if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                continue;
            }
            type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_LNK;
        }
        if (type != DT_DIR && type != DT_REG) {
            continue; /* symbolic links and special files are neither followed nor listed */
        }
        int n = *base ? snprintf(child, WS_PATH_MAX, "%s/%s", base, name)
                      : snprintf(child, WS_PATH_MAX, "%s", name);
        if (n < 0 || n >= WS_PATH_MAX) {
            continue;
        }
        if (w->o->gitignore && ignored(&w->rules, child, name, type == DT_DIR)) {
            continue;
        }
        if (type == DT_DIR) {
            int sub = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0) {
                walk_dir(w, sub, child);
                close(sub);
            }
        } else if (!w->o->visit(w->o->ctx, child, dirfd, name)) {
            w->stop = true;
        }
    }
    w->depth--;
    free(child);
    closedir(d);
    drop_rules(&w->rules, &w->budget, keep);
}

/* load_parent_rules reads ignore files of the directories above the start, root first. */
static void load_parent_rules(struct walker *w, const struct sandbox *sb, const char *start)
{
    char part[WS_PATH_MAX] = "";
    char copy[WS_PATH_MAX];
    int fd = openat(sb->root_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return;
    }
    add_rules(&w->rules, &w->budget, fd, ".gitignore", "");
    add_rules(&w->rules, &w->budget, fd, ".ignore", "");
    snprintf(copy, sizeof(copy), "%s", start);
    char *slash = strrchr(copy, '/');
    if (!slash) {
        close(fd);
        return;
    }
    *slash = '\0';
    char *save = NULL;
    for (char *seg = strtok_r(copy, "/", &save); seg; seg = strtok_r(NULL, "/", &save)) {
        int sub = openat(fd, seg, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(fd);
        if (sub < 0) {
            return;
        }
        fd = sub;
        size_t n = strlen(part);
        snprintf(part + n, sizeof(part) - n, "%s%s", n ? "/" : "", seg);
        add_rules(&w->rules, &w->budget, fd, ".gitignore", part);
        add_rules(&w->rules, &w->budget, fd, ".ignore", part);
    }
    close(fd);
}

enum cf_status walk_tree(const struct sandbox *sb, const char *start_rel, const char *shown_path,
                         const struct walk_opts *opts, struct cf_error *err)
{
    int fd;
    struct stat st;
    /* O_PATH: the start is looked at before anything is opened for reading */
    enum cf_status rc = ws_open(sb, start_rel, O_PATH, 0, shown_path, &fd, err);
    if (rc != CF_OK) {
        return rc;
    }
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ws_errno_error(e, "stat", shown_path, err);
    }
    if (S_ISREG(st.st_mode)) {
        /* a file named explicitly: visit the descriptor ws_open resolved (confined, an
         * in-workspace symbolic link followed, as read and the rg engine do), not the name
         * again through its parent, which would refuse the link */
        opts->visit(opts->ctx, start_rel, fd, "");
        close(fd);
        return CF_OK;
    }
    close(fd);
    if (!S_ISDIR(st.st_mode)) {
        return cf_error_set(err, CF_INVALID,
                            "%s is neither a regular file nor a directory (a FIFO, socket or "
                            "device)",
                            shown_path);
    }
    if ((rc = ws_open(sb, start_rel, O_RDONLY | O_DIRECTORY, 0, shown_path, &fd, err)) != CF_OK) {
        return rc;
    }
    struct walker *w = mem_alloc(sizeof(*w));
    w->o = opts;
    if (opts->gitignore && strcmp(start_rel, ".") != 0) {
        load_parent_rules(w, sb, start_rel);
    }
    walk_dir(w, fd, start_rel);
    close(fd);
    drop_rules(&w->rules, &w->budget, 0);
    free(w->rules.items);
    free(w);
    return CF_OK;
}

/* ---------- ignore filter ---------- */

/* The ignore rules of one directory on the filter's path, "" for the root. */
struct dir_rules {
    char *dir;
    struct rules rules;
};

/* The filter holds the rules of the directories above the path it checked last, root first,
 * within one budget: what a walk holds when it reaches that path, so the rules past the budget
 * are the walk's too, and the memory is one path's, however many directories the hits cross
 * (an engine reports its hits directory by directory). */
struct ignore_filter {
    const struct sandbox *sb;
    struct dir_rules *stack;
    size_t depth, cap;
    struct rule_budget budget;
    char last_file[WS_PATH_MAX];
    bool last_skip;
};

struct ignore_filter *ignore_filter_new(const struct sandbox *sb)
{
    struct ignore_filter *f = mem_alloc(sizeof(*f));
    f->sb = sb;
    return f;
}

/* pop_to lets go of the directories past the first depth, deepest first (the budget is
 * given back in the order it was taken). */
static void pop_to(struct ignore_filter *f, size_t depth)
{
    while (f->depth > depth) {
        struct dir_rules *d = &f->stack[--f->depth];
        drop_rules(&d->rules, &f->budget, 0);
        free(d->rules.items);
        free(d->dir);
    }
}

void ignore_filter_free(struct ignore_filter *f)
{
    if (!f) {
        return;
    }
    pop_to(f, 0);
    free(f->stack);
    free(f);
}

/* hold makes the directory rel[0..len) the filter's level-th (loading its rules unless it is
 * already there, after letting go of what was held from that level on). */
static void hold(struct ignore_filter *f, size_t level, const char *rel, size_t len)
{
    if (level < f->depth && strlen(f->stack[level].dir) == len &&
        !memcmp(f->stack[level].dir, rel, len)) {
        return;
    }
    pop_to(f, level);
    if (f->depth == f->cap) {
        f->cap = f->cap ? f->cap * 2 : 16;
        f->stack = mem_realloc(f->stack, sizeof(*f->stack) * f->cap);
    }
    struct dir_rules *d = &f->stack[f->depth++];
    memset(d, 0, sizeof(*d));
    d->dir = mem_alloc(len + 1);
    memcpy(d->dir, rel, len);
    d->dir[len] = '\0';
    int fd;
    struct cf_error err;
    if (ws_open(f->sb, len ? d->dir : ".", O_RDONLY | O_DIRECTORY, 0, d->dir, &fd, &err) == CF_OK) {
        add_rules(&d->rules, &f->budget, fd, ".gitignore", d->dir);
        add_rules(&d->rules, &f->budget, fd, ".ignore", d->dir);
        close(fd);
    }
}

/* hold_path holds the directories above rel, root first, and nothing else. */
static void hold_path(struct ignore_filter *f, const char *rel)
{
    size_t level = 0;
    hold(f, level++, rel, 0);
    for (size_t i = 0; rel[i]; i++) {
        if (rel[i] == '/') {
            hold(f, level++, rel, i);
        }
    }
    pop_to(f, level);
}

/* excluded_by checks the component path[0..upto) against the rules of every directory above
 * it (held: hold_path), root first; the last matching rule wins, as in the walk. */
static bool excluded_by(struct ignore_filter *f, const char *path, size_t upto, bool is_dir)
{
    char partial[WS_PATH_MAX];
    snprintf(partial, sizeof(partial), "%.*s", (int)upto, path);
    const char *name = strrchr(partial, '/');
    name = name ? name + 1 : partial;
    bool out = false;
    size_t level = 0;
    for (size_t i = 0; i < upto; i++) {
        if (i == 0 || path[i - 1] == '/') {
            assert(level < f->depth);
            apply_rules(&f->stack[level++].rules, partial, name, is_dir, &out);
        }
    }
    return out;
}

bool ignore_filter_skips(struct ignore_filter *f, const char *rel, const char *start_rel)
{
    if (!strcmp(rel, f->last_file)) {
        return f->last_skip;
    }
    snprintf(f->last_file, sizeof(f->last_file), "%s", rel);
    hold_path(f, rel);
    size_t start_len = strcmp(start_rel, ".") ? strlen(start_rel) : 0;
    bool skip = false;
    /* hidden components and ignore rules, below the start path */
    for (size_t i = 0, n = strlen(rel); i <= n && !skip; i++) {
        if (i == n || rel[i] == '/') {
            size_t comp_start = i;
            while (comp_start > 0 && rel[comp_start - 1] != '/') {
                comp_start--;
            }
            if (i <= start_len) {
                continue; /* part of the path the caller named */
            }
            skip = rel[comp_start] == '.' || excluded_by(f, rel, i, i != n);
        }
    }
    if (!skip) {
        int fd;
        struct cf_error err;
        struct stat st;
        if (ws_open_regular(f->sb, rel, rel, &fd, &st, &err) == CF_OK) {
            char *buf = mem_alloc(64 * 1024);
            ssize_t r = read(fd, buf, 64 * 1024);
            skip = r > 0 && memchr(buf, 0, (size_t)r) != NULL;
            free(buf);
            close(fd);
        } else {
            skip = true; /* gone, or not a regular file: the walk would not list it */
        }
    }
    f->last_skip = skip;
    return skip;
}
