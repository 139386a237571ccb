/* skills.c - SKILL.md frontmatter validation (libyaml) and declared skills loaded from the
 * agents directory with their supporting files. */
#include "skills.h"

#include "file_read.h"
#include "mem.h"
#include "utf8.h"
#include "yaml_load.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

/* ---------- the frontmatter ---------- */

/* fence_line: p starts a line that is "---" (trailing blanks allowed) ended by a newline or
 * the end; *next is where the following line starts. */
static bool fence_line(const char *p, const char *end, const char **next)
{
    if (end - p < 3 || strncmp(p, "---", 3) != 0) {
        return false;
    }
    p += 3;
    while (p < end && (*p == ' ' || *p == '\t')) {
        p++;
    }
    if (p < end && *p == '\r' && p + 1 < end && p[1] == '\n') {
        p++;
    }
    if (p < end && *p != '\n') {
        return false;
    }
    *next = p < end ? p + 1 : p;
    return true;
}

/* split finds the YAML block and the body of SKILL.md; false when it has no frontmatter. */
static bool split(const char *text, size_t len, const char **yaml, size_t *yaml_len,
                  const char **body, size_t *body_len)
{
    const char *p = text, *end = text + len, *next;
    if (len >= 3 && !memcmp(p, "\xEF\xBB\xBF", 3)) {
        p += 3; /* a byte order mark */
    }
    if (!fence_line(p, end, &next)) {
        return false;
    }
    *yaml = next;
    for (const char *line = next; line < end;) {
        const char *after;
        if (fence_line(line, end, &after)) {
            *yaml_len = (size_t)(line - *yaml);
            *body = after;
            *body_len = (size_t)(end - after);
            return true;
        }
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        line = nl ? nl + 1 : end;
    }
    return false;
}

/* trimmed copies p[0..n) without the blanks at either end. */
static char *trimmed(const char *p, size_t n)
{
    while (n && strchr(" \t\r\n", *p)) {
        p++;
        n--;
    }
    while (n && strchr(" \t\r\n", p[n - 1])) {
        n--;
    }
    char *out = mem_alloc(n + 1);
    memcpy(out, p, n);
    out[n] = '\0';
    return out;
}

static yaml_node_t *get(yaml_document_t *doc, yaml_node_t *map, const char *key)
{
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp((char *)k->data.scalar.value, key)) {
            return yaml_document_get_node(doc, p->value);
        }
    }
    return NULL;
}

/* is_null: a key without a value (every other scalar is a string, as YAML's fail-safe schema
 * reads it). */
static bool is_null(const yaml_node_t *n)
{
    return !n || (n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
                  n->data.scalar.length == 0);
}

/* string_field reads an optional string field, trimmed (empty: absent, *out stays NULL). */
static enum cf_status string_field(yaml_node_t *n, const char *path, const char *field, char **out,
                                   struct cf_error *err)
{
    if (is_null(n)) {
        return CF_OK;
    }
    if (n->type != YAML_SCALAR_NODE) {
        return cf_error_set(err, CF_INVALID, "%s: frontmatter field %s must be a string", path,
                            field);
    }
    char *v = trimmed((char *)n->data.scalar.value, n->data.scalar.length);
    if (*v) {
        *out = v;
    } else {
        free(v);
    }
    return CF_OK;
}

static enum cf_status check_name(const char *name, const char *path, const char *dir_name,
                                 struct cf_error *err)
{
    size_t n = strlen(name);
    if (n > SKILL_NAME_MAX) {
        return cf_error_set(err, CF_INVALID, "%s: the skill name is longer than %d characters",
                            path, SKILL_NAME_MAX);
    }
    if (strspn(name, "abcdefghijklmnopqrstuvwxyz0123456789-") != n) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the skill name \"%s\" may use only lowercase letters a-z, digits "
                            "and hyphens (for example \"check-links\")",
                            path, name);
    }
    if (name[0] == '-' || name[n - 1] == '-' || strstr(name, "--")) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the skill name \"%s\" may not begin or end with a hyphen, nor "
                            "hold two in a row (for example \"check-links\")",
                            path, name);
    }
    if (dir_name && strcmp(name, dir_name) != 0) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the skill is named \"%s\" but its directory is \"%s\"; the two "
                            "must be the same: rename one of them",
                            path, name, dir_name);
    }
    return CF_OK;
}

/* check_metadata: metadata, when given, maps strings to strings (a key without a value is ""). */
static enum cf_status check_metadata(yaml_document_t *doc, yaml_node_t *m, const char *path,
                                     struct cf_error *err)
{
    if (is_null(m)) {
        return CF_OK;
    }
    bool ok = m->type == YAML_MAPPING_NODE;
    for (yaml_node_pair_t *p = ok ? m->data.mapping.pairs.start : NULL;
         ok && p < m->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        yaml_node_t *v = yaml_document_get_node(doc, p->value);
        ok = k && k->type == YAML_SCALAR_NODE && v && v->type == YAML_SCALAR_NODE;
    }
    if (!ok) {
        return cf_error_set(err, CF_INVALID,
                            "%s: frontmatter field metadata must map strings to strings", path);
    }
    return CF_OK;
}

/* fields reads and checks the frontmatter's fields into *out. */
static enum cf_status fields(yaml_document_t *doc, const char *path, const char *dir_name,
                             struct skill *out, struct cf_error *err)
{
    yaml_node_t *root = yaml_document_get_root_node(doc);
    enum cf_status rc;
    if (!root || root->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the frontmatter must be a YAML mapping of fields (name: ..., "
                            "description: ...)",
                            path);
    }
    const char *required[] = {"name", "description"};
    char **slots[] = {&out->name, &out->description};
    for (int i = 0; i < 2; i++) {
        yaml_node_t *n = get(doc, root, required[i]);
        if (is_null(n) || n->type != YAML_SCALAR_NODE ||
            (rc = string_field(n, path, required[i], slots[i], err)) != CF_OK || !*slots[i]) {
            return cf_error_set(err, CF_INVALID,
                                "%s: the frontmatter needs a %s: a non-empty string", path,
                                required[i]);
        }
    }
    if ((rc = check_name(out->name, path, dir_name, err)) != CF_OK) {
        return rc;
    }
    if (utf8_count_chars(out->description, strlen(out->description)) > SKILL_DESCRIPTION_MAX) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the description is longer than %d characters; make it a short "
                            "summary of when to use the skill",
                            path, SKILL_DESCRIPTION_MAX);
    }
    if ((rc = string_field(get(doc, root, "license"), path, "license", &out->license, err)) !=
            CF_OK ||
        (rc = string_field(get(doc, root, "compatibility"), path, "compatibility",
                           &out->compatibility, err)) != CF_OK) {
        return rc;
    }
    if (out->compatibility && utf8_count_chars(out->compatibility, strlen(out->compatibility)) >
                                  SKILL_COMPATIBILITY_MAX) {
        return cf_error_set(err, CF_INVALID, "%s: compatibility is longer than %d characters", path,
                            SKILL_COMPATIBILITY_MAX);
    }
    char *allowed = NULL; /* informational: checked to be a string, not kept */
    rc = string_field(get(doc, root, "allowed-tools"), path, "allowed-tools", &allowed, err);
    free(allowed);
    if (rc != CF_OK) {
        return rc;
    }
    return check_metadata(doc, get(doc, root, "metadata"), path, err);
}

enum cf_status skill_parse(const char *text, size_t len, const char *path, const char *dir_name,
                           struct skill *out, struct cf_error *err)
{
    const char *yaml, *body;
    size_t yaml_len, body_len;
    memset(out, 0, sizeof(*out));
    if (!split(text, len, &yaml, &yaml_len, &body, &body_len)) {
        return cf_error_set(err, CF_INVALID,
                            "%s: no frontmatter: SKILL.md must begin with a \"---\" line, then "
                            "the fields (name and description at least), then a closing \"---\" "
                            "line",
                            path);
    }
    yaml_document_t doc;
    const char *problem;
    size_t line;
    if (yaml_load(yaml, yaml_len, &doc, &problem, &line) != CF_OK) {
        return cf_error_set(err, CF_INVALID, "%s: the frontmatter is not valid YAML: %s (line %zu)",
                            path, problem, line + 2);
    }
    enum cf_status rc = fields(&doc, path, dir_name, out, err);
    yaml_document_delete(&doc);
    if (rc == CF_OK) {
        out->body = trimmed(body, body_len);
    } else {
        skill_free(out);
    }
    return rc;
}

/* ---------- supporting files ---------- */

/* What a skill's directory may hold: skipped quietly, or refused as a likely secret. */
static const char *const SKIPPED_DIRS[] = {".git",      ".cache", ".turbo",
                                           ".wrangler", "dist",   "node_modules"};
static const char *const SKIPPED_FILES[] = {".DS_Store", "*.swp", "*.swo", "*~"};
static const char *const SECRET_DIRS[] = {".aws", ".gnupg", ".ssh"};
static const char *const SECRET_FILES[] = {
    ".env",  ".env.*", ".dev.vars*", ".netrc", ".npmrc",  ".pypirc", "_netrc", "credentials.json",
    "*.key", "*.pem",  "*.p12",      "*.pfx",  "secret*", "secrets*"};

static bool matches(const char *name, const char *const *globs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (fnmatch(globs[i], name, 0) == 0) {
            return true;
        }
    }
    return false;
}

#define COUNT(a) (sizeof(a) / sizeof(*(a)))

struct walk {
    const char *skill_path; /* for messages */
    struct skill *s;
    size_t cap;
};

/* walk_dir adds the supporting files under dir (rel: its path inside the skill, "" at the
 * top). */
static enum cf_status walk_dir(struct walk *w, const char *dir, const char *rel, int depth,
                               struct cf_error *err)
{
    DIR *d = opendir(dir);
    if (!d) {
        return cf_error_set(err, CF_INVALID, "%s: cannot list: %s", dir, strerror(errno));
    }
    enum cf_status rc = CF_OK;
    struct dirent *e;
    while (rc == CF_OK && (e = readdir(d))) {
        const char *name = e->d_name;
        char path[4096], sub[4096];
        struct stat st;
        if (!strcmp(name, ".") || !strcmp(name, "..") || (!*rel && !strcmp(name, "SKILL.md"))) {
            continue;
        }
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        snprintf(sub, sizeof(sub), "%s%s%s", rel, *rel ? "/" : "", name);
        if (lstat(path, &st) != 0) {
            rc = cf_error_set(err, CF_INVALID, "%s: %s", path, strerror(errno));
        } else if (S_ISLNK(st.st_mode)) {
            rc = cf_error_set(err, CF_INVALID,
                              "%s: a symbolic link; a skill's files must be regular files", path);
        } else if (S_ISDIR(st.st_mode)) {
            if (matches(name, SECRET_DIRS, COUNT(SECRET_DIRS))) {
                rc = cf_error_set(err, CF_INVALID,
                                  "%s: looks like a directory of credentials; remove it from the "
                                  "skill",
                                  path);
            } else if (!matches(name, SKIPPED_DIRS, COUNT(SKIPPED_DIRS))) {
                rc = depth < SKILL_DEPTH_MAX
                         ? walk_dir(w, path, sub, depth + 1, err)
                         : cf_error_set(err, CF_INVALID, "%s: nested more than %d levels deep",
                                        path, SKILL_DEPTH_MAX);
            }
        } else if (matches(name, SECRET_FILES, COUNT(SECRET_FILES))) {
            rc = cf_error_set(err, CF_INVALID,
                              "%s: looks like a secret (keys, credentials, environment files); "
                              "remove it from the skill",
                              path);
        } else if (S_ISREG(st.st_mode) && !matches(name, SKIPPED_FILES, COUNT(SKIPPED_FILES))) {
            if (w->s->n_files == SKILL_FILES_MAX) {
                rc = cf_error_set(err, CF_INVALID, "%s: more than %d supporting files",
                                  w->skill_path, SKILL_FILES_MAX);
                break;
            }
            if (w->s->n_files == w->cap) {
                w->cap = w->cap ? w->cap * 2 : 8;
                w->s->files = mem_realloc(w->s->files, sizeof(*w->s->files) * w->cap);
            }
            struct skill_file *f = &w->s->files[w->s->n_files];
            if ((rc = file_read_regular(path, SKILL_FILE_MAX, FILE_READ_NOFOLLOW, &f->data, &f->len,
                                        err)) == CF_OK) {
                f->path = mem_strdup(sub);
                w->s->n_files++;
            }
        }
    }
    closedir(d);
    return rc;
}

static int cmp_file(const void *a, const void *b)
{
    return strcmp(((const struct skill_file *)a)->path, ((const struct skill_file *)b)->path);
}

/* load_one loads the skill `name` from `<agents_dir>/skills/<name>/`. */
static enum cf_status load_one(const char *agents_dir, const char *name, struct skill *out,
                               struct cf_error *err)
{
    char dir[4096], path[4200];
    char *text;
    size_t len;
    enum cf_status rc;
    snprintf(dir, sizeof(dir), "%s/skills/%s", agents_dir, name);
    snprintf(path, sizeof(path), "%s/SKILL.md", dir);
    if ((rc = file_read_regular(path, SKILL_FILE_MAX, FILE_READ_NOFOLLOW, &text, &len, err)) !=
        CF_OK) {
        return rc == CF_NOT_FOUND
                   ? cf_error_set(err, CF_INVALID,
                                  "skill \"%s\": no %s (a declared skill is a directory "
                                  "skills/<name>/ beside the agent definitions, holding SKILL.md)",
                                  name, path)
                   : rc;
    }
    rc = skill_parse(text, len, path, name, out, err);
    free(text);
    if (rc != CF_OK) {
        return rc;
    }
    struct walk w = {.skill_path = dir, .s = out};
    if ((rc = walk_dir(&w, dir, "", 0, err)) != CF_OK) {
        skill_free(out);
        return rc;
    }
    if (out->n_files) {
        qsort(out->files, out->n_files, sizeof(*out->files), cmp_file);
    }
    return CF_OK;
}

enum cf_status skills_load(const char *agents_dir, char *const *names, size_t n,
                           struct skill_set *out, struct cf_error *err)
{
    out->items = mem_alloc(sizeof(*out->items) * (n + 1));
    out->n = 0;
    for (size_t i = 0; i < n; i++) {
        if (skills_find(out, names[i])) {
            continue;
        }
        enum cf_status rc = load_one(agents_dir, names[i], &out->items[out->n], err);
        if (rc != CF_OK) {
            skills_free(out);
            return rc;
        }
        out->n++;
    }
    return CF_OK;
}

const struct skill *skills_find(const struct skill_set *set, const char *name)
{
    for (size_t i = 0; i < set->n; i++) {
        if (!strcmp(set->items[i].name, name)) {
            return &set->items[i];
        }
    }
    return NULL;
}

const struct skill_file *skill_file_find(const struct skill *s, const char *path)
{
    for (size_t i = 0; i < s->n_files; i++) {
        if (!strcmp(s->files[i].path, path)) {
            return &s->files[i];
        }
    }
    return NULL;
}

void skill_free(struct skill *s)
{
    free(s->name);
    free(s->description);
    free(s->license);
    free(s->compatibility);
    free(s->body);
    free(s->origin);
    for (size_t i = 0; i < s->n_files; i++) {
        free(s->files[i].path);
        free(s->files[i].data);
    }
    free(s->files);
    memset(s, 0, sizeof(*s));
}

void skills_free(struct skill_set *set)
{
    for (size_t i = 0; i < set->n; i++) {
        skill_free(&set->items[i]);
    }
    free(set->items);
    set->items = NULL;
    set->n = 0;
}
