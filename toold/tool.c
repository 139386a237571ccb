/* tool.c - the tool registry, argument schemas, strict argument parsing, result helpers. */
#include "tool.h"

#include "clock.h"
#include "locks.h"
#include "utf8.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct tool_arg read_args[] = {
    {"path", ARG_STRING, true, "File to read, relative to the working directory or absolute"},
    {"offset", ARG_INTEGER, false, "First line to show, counting from 1 (default 1)"},
    {"limit", ARG_INTEGER, false, "Most lines to show (default: as many as fit)"},
};
static const struct tool_arg write_args[] = {
    {"path", ARG_STRING, true, "File to write; missing directories are created"},
    {"content", ARG_STRING, true, "The complete new content of the file"},
};
static const struct tool_arg edit_args[] = {
    {"path", ARG_STRING, true, "File to change"},
    {"oldText", ARG_STRING, true,
     "Text to replace, copied exactly from the file (whitespace included); must occur once "
     "unless replaceAll is set"},
    {"newText", ARG_STRING, true, "Text to put in its place"},
    {"replaceAll", ARG_BOOLEAN, false, "Replace every occurrence instead of exactly one"},
};
static const struct tool_arg bash_args[] = {
    {"command", ARG_STRING, true, "The command line, run by bash -c in the working directory"},
    {"timeout", ARG_NUMBER, false, "Seconds before the command is stopped (default 300)"},
};
static const struct tool_arg grep_args[] = {
    {"pattern", ARG_STRING, true, "Regular expression (PCRE syntax) to search for"},
    {"path", ARG_STRING, false, "Directory or file to search (default: the working directory)"},
    {"include", ARG_STRING, false, "Only search files whose name matches this glob, e.g. *.c"},
    {"literal", ARG_BOOLEAN, false, "Treat the pattern as plain text, not a regular expression"},
};
static const struct tool_arg glob_args[] = {
    {"pattern", ARG_STRING, true,
     "File-name pattern such as *.py or test_*; it matches names, not paths"},
    {"path", ARG_STRING, false, "Directory to search (default: the working directory)"},
};

#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const struct tool_def tools[] = {
    {"read",
     "Show the contents of a text file. Long files come in pages of at most 2000 lines or 50 KB; "
     "a note at the end gives the offset for the next page.",
     read_args, N(read_args), tool_read_run, false},
    {"write", "Create a file or replace its whole content. Missing parent directories are created.",
     write_args, N(write_args), tool_write_run, true},
    {"edit",
     "Change part of a file by replacing an exact piece of text. The text must appear exactly "
     "once, or set replaceAll to change every occurrence.",
     edit_args, N(edit_args), tool_edit_run, true},
    {"bash",
     "Run a shell command in the working directory and return its combined output and exit "
     "code. Long output keeps its last 2000 lines or 50 KB; the full output is saved to a file "
     "you can read.",
     bash_args, N(bash_args), tool_bash_run, false},
    {"grep",
     "Search the contents of files for a regular expression. Prints path:line:text for each "
     "matching line, at most 100 matches; hidden and git-ignored files are skipped.",
     grep_args, N(grep_args), tool_grep_run, false},
    {"glob",
     "Find files by name pattern (like find -name). Lists matching files, sorted, at most "
     "1000.",
     glob_args, N(glob_args), tool_glob_run, false},
};

const struct tool_def *tool_find(const char *name)
{
    for (int i = 0; i < N(tools); i++) {
        if (!strcmp(tools[i].name, name)) {
            return &tools[i];
        }
    }
    return NULL;
}

const struct tool_def *tool_all(int *n_out)
{
    *n_out = N(tools);
    return tools;
}

static const char *type_name(enum arg_type t)
{
    switch (t) {
    case ARG_STRING:
        return "string";
    case ARG_INTEGER:
        return "integer";
    case ARG_NUMBER:
        return "number";
    case ARG_BOOLEAN:
        return "boolean";
    }
    return "string";
}

char *tool_schema_json(const struct tool_def *t)
{
    json_t *props = json_object(), *req = json_array();
    for (int i = 0; i < t->n_args; i++) {
        const struct tool_arg *a = &t->args[i];
        json_t *p =
            json_pack("{s:s, s:s}", "type", type_name(a->type), "description", a->description);
        if (a->type == ARG_INTEGER) {
            json_object_set_new(p, "minimum", json_integer(1));
        }
        json_object_set_new(props, a->name, p);
        if (a->required) {
            json_array_append_new(req, json_string(a->name));
        }
    }
    json_t *schema =
        json_pack("{s:s, s:o, s:o}", "type", "object", "properties", props, "required", req);
    char *out = json_dumps(schema, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(schema);
    return out;
}

void tool_result_init(struct tool_result *res)
{
    buf_init(&res->text, TOOL_TEXT_MAX);
    res->is_error = false;
    res->details = json_object();
    cflue__v1__truncation__init(&res->trunc);
}

void tool_result_cleanup(struct tool_result *res)
{
    buf_cleanup(&res->text);
    json_decref(res->details);
    res->details = NULL;
}

void tool_fail(struct tool_result *res, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    buf_reset(&res->text);
    utf8_sanitize(&res->text, msg, strlen(msg));
    res->is_error = true;
}

void tool_fail_error(struct tool_result *res, const struct cf_error *err)
{
    tool_fail(res, "%s", err->msg);
}

enum cf_status tool_resolve(const struct tool_ctx *ctx, const char *path, char *out, size_t out_len,
                            struct cf_error *err)
{
    return ws_relative_from(ctx->sb, ctx->cwd, path, out, out_len, err);
}

bool tool_caller_gone(struct tool_ctx *ctx)
{
    return ctx->cancelled && ctx->cancelled(ctx->cancel_ctx);
}

bool tool_cancelled(struct tool_ctx *ctx)
{
    return (ctx->deadline_ms && clock_mono_ms() >= ctx->deadline_ms) || tool_caller_gone(ctx);
}

static void describe_value(char *out, size_t len, json_t *v)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (s && strlen(s) > 60) {
        snprintf(out, len, "%.57s...", s);
    } else {
        snprintf(out, len, "%s", s ? s : "?");
    }
    free(s);
}

json_t *tool_parse_args(const struct tool_def *t, const char *arguments_json,
                        struct tool_result *res)
{
    json_error_t jerr;
    const char *text = *arguments_json ? arguments_json : "{}";
    json_t *args = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!args) {
        tool_fail(res,
                  "The arguments of %s are not valid JSON: %s (line %d, column %d). Send one "
                  "JSON object.",
                  t->name, jerr.text, jerr.line, jerr.column);
        return NULL;
    }
    if (!json_is_object(args)) {
        tool_fail(res, "The arguments of %s must be a JSON object.", t->name);
        json_decref(args);
        return NULL;
    }
    for (int i = 0; i < t->n_args; i++) {
        const struct tool_arg *a = &t->args[i];
        json_t *v = json_object_get(args, a->name);
        char got[80];
        if (!v || json_is_null(v)) {
            if (a->required) {
                tool_fail(res, "%s needs the argument '%s' (%s): %s.", t->name, a->name,
                          type_name(a->type), a->description);
                json_decref(args);
                return NULL;
            }
            if (v) {
                json_object_del(args, a->name);
            }
            continue;
        }
        describe_value(got, sizeof(got), v);
        bool ok = true;
        switch (a->type) {
        case ARG_STRING:
            ok = json_is_string(v);
            break;
        case ARG_BOOLEAN:
            ok = json_is_boolean(v);
            break;
        case ARG_NUMBER:
            ok = json_is_number(v);
            break;
        case ARG_INTEGER:
            if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
                fabs(json_real_value(v)) < 1e15) {
                json_object_set_new(args, a->name, json_integer((json_int_t)json_real_value(v)));
                v = json_object_get(args, a->name);
            }
            ok = json_is_integer(v);
            if (ok && json_integer_value(v) < 1) {
                tool_fail(res, "The argument '%s' of %s must be 1 or more; got %s.", a->name,
                          t->name, got);
                json_decref(args);
                return NULL;
            }
            break;
        }
        if (!ok) {
            tool_fail(res, "The argument '%s' of %s must be %s %s; got %s.", a->name, t->name,
                      a->type == ARG_INTEGER ? "a whole" : "a", type_name(a->type), got);
            json_decref(args);
            return NULL;
        }
    }
    return args;
}

enum cf_status tool_lock_path(struct tool_ctx *ctx, const char *path, char *key, size_t key_len,
                              struct cf_error *err)
{
    enum cf_status rc = tool_resolve(ctx, path, key, key_len, err);
    if (rc != CF_OK) {
        return rc;
    }
    uint64_t ticket = ctx->has_ticket ? ctx->lock_ticket : locks_ticket(ctx->sb->locks, key);
    ctx->ticket_used = true;
    locks_wait(ctx->sb->locks, key, ticket);
    return CF_OK;
}

void tool_unlock_path(struct tool_ctx *ctx, const char *key)
{
    locks_release(ctx->sb->locks, key);
}
