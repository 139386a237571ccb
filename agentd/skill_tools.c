/* skill_tools.c - the framework's skill tools, run in agentd on the skills loaded at start
 * (skills.c): activate_skill gives the model a skill's instructions and the list of its
 * supporting files; read_skill_resource reads one of those files a page at a time, with the
 * read tool's limits and continuation marker (2000 lines or 51,200 bytes, never mid-line; a
 * binary file is paged as base64 lines of 76 characters). Both answer at once: nothing is
 * waited for. */
#include "drive.h"
#include "log.h"
#include "mem.h"
#include "skills.h"
#include "utf8.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PAGE_LINES 2000
#define PAGE_BYTES 51200
#define RESOURCE_PREFIX "skills/" /* advertised paths: skills/<skill>/<file> */

static const char ACTIVATE_DESCRIPTION[] =
    "Load the full instructions of one of your skills, listed in your instructions, before doing "
    "work that matches its description. Its supporting files are listed but not loaded; read "
    "the ones you need with read_skill_resource.";
static const char ACTIVATE_SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"description\":\"The "
    "skill's name.\"}},\"required\":[\"name\"]}";
static const char RESOURCE_DESCRIPTION[] =
    "Read a supporting file of a skill by the path activate_skill listed for it. Long files come "
    "a page at a time: continue with offset as the note at the end says.";
static const char RESOURCE_SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"path\":{\"type\":\"string\",\"description\":\"The file's path as activate_skill listed "
    "it.\"},"
    "\"offset\":{\"type\":\"number\",\"description\":\"The line to start at, from 1.\"},"
    "\"limit\":{\"type\":\"number\",\"description\":\"The most lines to show.\"}},"
    "\"required\":[\"path\"]}";

/* the skills of d's agent that are loaded (declared ones; all are, once agentd started) */
static const struct skill *agent_skill(const struct drive *d, size_t i)
{
    return skills_find(&d->defs->skills, d->agent->skills[i]);
}

void skill_tools_add(struct drive *d, struct toolset *ts)
{
    bool files = false;
    for (size_t i = 0; i < d->agent->n_skills; i++) {
        const struct skill *s = agent_skill(d, i);
        files = files || (s && s->n_files);
    }
    const char *names[] = {"activate_skill", "read_skill_resource"};
    const char *descs[] = {ACTIVATE_DESCRIPTION, RESOURCE_DESCRIPTION};
    const char *schemas[] = {ACTIVATE_SCHEMA, RESOURCE_SCHEMA};
    int n = !d->agent->n_skills && !d->ws_skills.n ? 0 : files ? 2 : 1;
    for (int k = 0; k < n; k++) {
        toolset_add(ts, names[k], descs[k], schemas[k], NULL);
    }
}

void skill_roster(struct buf *b, const struct drive *d)
{
    const struct agent_def *a = d->agent;
    if (!a->n_skills && !d->ws_skills.n) {
        return;
    }
    buf_append_str(b, "\n\n## Skills\n\nSkills are instructions for particular kinds of work, "
                      "loaded when needed. When a request matches a skill's description, call "
                      "activate_skill with its name first and follow what it says; its "
                      "supporting files stay unread until you read them.\n");
    for (size_t i = 0; i < a->n_skills; i++) {
        const struct skill *s = skills_find(&d->defs->skills, a->skills[i]);
        buf_printf(b, "\n- %s%s", a->skills[i], s ? ": " : "");
        prompt_line(b, s ? s->description : "", s ? strlen(s->description) : 0);
    }
    for (size_t i = 0; i < d->ws_skills.n; i++) {
        const struct skill *s = &d->ws_skills.items[i];
        buf_printf(b, "\n- %s: ", s->name);
        prompt_line(b, s->description, strlen(s->description));
    }
}

bool skill_tools_discover(struct drive *d, Cflue__V1__GlanceSkill *const *found, size_t n)
{
    struct skill_set *ws = &d->ws_skills;
    skills_free(ws);
    ws->items = mem_alloc(sizeof(*ws->items) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        const Cflue__V1__GlanceSkill *g = found[i];
        struct skill s;
        struct cf_error err;
        if (skill_parse((const char *)g->data.data, g->data.len, g->path, g->dir, &s, &err) !=
            CF_OK) {
            char q[600];
            log_warn("skill_skipped", "submission=%s path=%s err=%s%s", d->sub->submission_id,
                     g->path, log_quote(q, sizeof(q), err.msg),
                     g->truncated ? " truncated=\"only its first 64 KiB were read\"" : "");
            continue;
        }
        for (size_t k = 0; k < d->agent->n_skills; k++) {
            if (!strcmp(d->agent->skills[k], s.name)) {
                snprintf(d->error, sizeof(d->error),
                         "the skill \"%s\" is declared by agent %s and also found in the sandbox "
                         "at %s; rename one of them",
                         s.name, d->agent->name, g->path);
                skill_free(&s);
                return false;
            }
        }
        free(s.body); /* read again when activated: an edit since is seen */
        s.body = NULL;
        s.origin = mem_strdup(g->path);
        ws->items[ws->n++] = s;
    }
    return true;
}

const struct skill *skill_tools_in_sandbox(struct drive *d, const struct llm_call *c)
{
    if (strcmp(c->name, "activate_skill") != 0) {
        return NULL;
    }
    json_t *args = json_loads(c->arguments_json ? c->arguments_json : "", 0, NULL);
    const char *name = json_string_value(json_object_get(args, "name"));
    const struct skill *s = name ? skills_find(&d->ws_skills, name) : NULL;
    json_decref(args);
    return s;
}

bool skill_tools_activated(struct drive *d, const struct skill *s, const uint8_t *data, size_t len,
                           struct buf *out)
{
    struct skill now;
    struct cf_error err;
    if (len > SKILL_FILE_MAX) {
        buf_printf(out,
                   "The skill \"%s\" could not be activated: its SKILL.md (%s) has %zu bytes, "
                   "more than the %d a skill may have.",
                   s->name, s->origin, len, SKILL_FILE_MAX);
        return false;
    }
    if (skill_parse((const char *)data, len, s->origin, s->name, &now, &err) != CF_OK) {
        buf_printf(out, "The skill \"%s\" could not be activated: %s", s->name, err.msg);
        return false;
    }
    const char *slash = strrchr(s->origin, '/');
    const char *wd = d->tools.working_directory ? d->tools.working_directory : "";
    enum cf_status rc = buf_printf(
        out,
        "Skill \"%s\" is active. Follow these instructions for the work at hand:\n\n"
        "<skill_instructions>\n%s\n</skill_instructions>\n\n"
        "Its supporting files, if any, are in the sandbox beside its SKILL.md; read only "
        "the ones you need, with paths relative to this directory:\n<skill_resources>\n"
        "- Base directory: %s%s%.*s\n</skill_resources>",
        now.name, now.body, wd, *wd ? "/" : "", (int)(slash - s->origin), s->origin);
    skill_free(&now);
    if (rc != CF_OK) { /* out is left as it was: empty */
        buf_printf(out, "The skill \"%s\" could not be activated: its instructions are too long.",
                   s->name);
        return false;
    }
    return true;
}

/* ---------- activate_skill ---------- */

static void activate(struct drive *d, json_t *args, struct buf *out, bool *is_error)
{
    const char *name = json_string_value(json_object_get(args, "name"));
    const struct skill *s = NULL;
    for (size_t i = 0; name && i < d->agent->n_skills && !s; i++) {
        s = !strcmp(d->agent->skills[i], name) ? agent_skill(d, i) : NULL;
    }
    if (!name) {
        buf_append_str(out, "activate_skill needs a string \"name\": the skill to load.");
        *is_error = true;
        return;
    }
    if (!s) {
        buf_printf(out, "There is no skill named \"%.200s\". Skills you can activate: ", name);
        for (size_t i = 0; i < d->agent->n_skills; i++) {
            buf_printf(out, "%s%s", i ? ", " : "", d->agent->skills[i]);
        }
        for (size_t i = 0; i < d->ws_skills.n; i++) {
            buf_printf(out, "%s%s", i || d->agent->n_skills ? ", " : "",
                       d->ws_skills.items[i].name);
        }
        buf_append_str(out, d->agent->n_skills || d->ws_skills.n ? "." : "none.");
        return; /* an answer, not a failure */
    }
    buf_printf(out,
               "Skill \"%s\" is active. Follow these instructions for the work at hand:\n\n"
               "<skill_instructions>\n%s\n</skill_instructions>",
               s->name, s->body);
    if (s->n_files) {
        buf_append_str(out, "\n\nIts supporting files are not in your context; read the ones "
                            "you need with read_skill_resource and the path given:\n"
                            "<skill_resources>");
        for (size_t i = 0; i < s->n_files; i++) {
            buf_printf(out, "\n- %s: " RESOURCE_PREFIX "%s/%s", s->files[i].path, s->name,
                       s->files[i].path);
        }
        buf_append_str(out, "\n</skill_resources>");
    }
}

/* ---------- read_skill_resource ---------- */

/* as_text is the file as the model reads it: its text, or base64 lines of 76 characters when
 * it holds NUL bytes or is not UTF-8 (*binary set). The caller frees it. */
static char *as_text(const struct skill_file *f, bool *binary)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    *binary = memchr(f->data, '\0', f->len) || !utf8_valid(f->data, f->len, NULL);
    if (!*binary) {
        return mem_strdup(f->data);
    }
    size_t n = f->len, enc = ((n + 2) / 3) * 4;
    char *out = mem_alloc(enc + enc / 76 + 2), *o = out;
    for (size_t i = 0, col = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)(unsigned char)f->data[i] << 16 |
                     (i + 1 < n ? (uint32_t)(unsigned char)f->data[i + 1] << 8 : 0) |
                     (i + 2 < n ? (unsigned char)f->data[i + 2] : 0);
        char q[4] = {tab[(v >> 18) & 63], tab[(v >> 12) & 63], i + 1 < n ? tab[(v >> 6) & 63] : '=',
                     i + 2 < n ? tab[v & 63] : '='};
        for (int k = 0; k < 4; k++, col++) {
            if (col == 76) {
                *o++ = '\n';
                col = 0;
            }
            *o++ = q[k];
        }
    }
    *o = '\0';
    return out;
}

/* page writes lines [offset, ...) of text as the read tool pages a file: at most limit lines
 * (0: no limit of its own), 2000 lines and 51,200 bytes, whole lines only, with the
 * continuation marker when lines remain. false (the reason in out) when offset is past the
 * end. */
static bool page(const char *text, const char *path, int64_t offset, int64_t limit, struct buf *out)
{
    size_t len = strlen(text);
    int64_t total = 0;
    for (size_t i = 0; i < len; i++) {
        total += text[i] == '\n';
    }
    total += len && text[len - 1] != '\n';
    if (offset > total && !(total == 0 && offset == 1)) {
        buf_printf(out, "offset %lld is past the end of %s, which has %lld line%s.",
                   (long long)offset, path, (long long)total, total == 1 ? "" : "s");
        return false;
    }
    const char *p = text, *end = text + len;
    for (int64_t line = 1; line < offset; line++) {
        p = memchr(p, '\n', (size_t)(end - p)) + 1;
    }
    int64_t max = limit > 0 && limit < PAGE_LINES ? limit : PAGE_LINES, shown = 0;
    const char *start = p, *stop = p;
    while (p < end && shown < max) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *line_end = nl ? nl : end;
        if ((size_t)(line_end - start) > PAGE_BYTES) {
            break;
        }
        stop = line_end;
        shown++;
        p = nl ? nl + 1 : end;
    }
    if (!shown && p < end) {
        /* one line alone is over the budget: its head */
        size_t cut = utf8_prefix_len(start, (size_t)(end - start), PAGE_BYTES);
        buf_append(out, start, cut);
        buf_printf(out,
                   "\n\n[Line %lld is longer than %d bytes; only its first %zu bytes are shown, "
                   "and the rest cannot be reached with offset/limit.]",
                   (long long)offset, PAGE_BYTES, cut);
        shown = 1;
    } else {
        buf_append(out, start, (size_t)(stop - start));
    }
    int64_t last = offset + shown - 1;
    if (shown && last < total) {
        buf_printf(out, "\n\n[Showing lines %lld-%lld of %lld. Use offset=%lld to continue.]",
                   (long long)offset, (long long)last, (long long)total, (long long)last + 1);
    }
    return true;
}

/* resource finds the file an advertised path names among d's agent's skills. */
static const struct skill_file *resource(struct drive *d, const char *path)
{
    path += *path == '/';
    if (strncmp(path, RESOURCE_PREFIX, strlen(RESOURCE_PREFIX)) != 0) {
        return NULL;
    }
    path += strlen(RESOURCE_PREFIX);
    for (size_t i = 0; i < d->agent->n_skills; i++) {
        const struct skill *s = agent_skill(d, i);
        size_t n = s ? strlen(s->name) : 0;
        if (s && !strncmp(path, s->name, n) && path[n] == '/') {
            return skill_file_find(s, path + n + 1);
        }
    }
    return NULL;
}

static void read_resource(struct drive *d, json_t *args, struct buf *out, bool *is_error)
{
    const char *path = json_string_value(json_object_get(args, "path"));
    json_t *joff = json_object_get(args, "offset"), *jlim = json_object_get(args, "limit");
    if (!path || (joff && (!json_is_number(joff) || json_number_value(joff) < 1)) ||
        (jlim && (!json_is_number(jlim) || json_number_value(jlim) < 1))) {
        buf_append_str(out, "read_skill_resource needs a string \"path\", and offset and limit "
                            "(when given) of at least 1.");
        *is_error = true;
        return;
    }
    const struct skill_file *f = resource(d, path);
    if (!f) {
        buf_printf(out,
                   "No supporting file of your skills is at \"%.300s\". activate_skill lists "
                   "each skill's files with their paths.",
                   path);
        *is_error = true;
        return;
    }
    bool binary;
    char *text = as_text(f, &binary);
    if (binary) {
        buf_printf(out, "[%s is binary (%zu bytes): shown as base64, 76 characters a line]\n", path,
                   f->len);
    }
    *is_error = !page(text, path, joff ? (int64_t)json_number_value(joff) : 1,
                      jlim ? (int64_t)json_number_value(jlim) : 0, out);
    free(text);
}

bool skill_tool_run(struct drive *d, int index, const struct llm_call *c)
{
    bool activate_call = !strcmp(c->name, "activate_skill");
    if (!activate_call && strcmp(c->name, "read_skill_resource") != 0) {
        return false;
    }
    struct buf out;
    bool is_error = false;
    buf_init(&out, SKILL_FILE_MAX + 2 * PAGE_BYTES); /* a whole SKILL.md body, or a page */
    json_t *args =
        json_loads(c->arguments_json ? c->arguments_json : "", JSON_REJECT_DUPLICATES, NULL);
    if (!json_is_object(args)) {
        buf_printf(&out, "The %s call was not run: its arguments are not a JSON object.", c->name);
        is_error = true;
    } else if (activate_call) {
        activate(d, args, &out, &is_error);
    } else {
        read_resource(d, args, &out, &is_error);
    }
    json_decref(args);
    char *text = buf_take(&out);
    tools_record_result(d, index, c->id, c->name, text, is_error, NULL, false);
    free(text);
    return true;
}
