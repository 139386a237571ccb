/* tool.h - the model-facing tools: shared types, argument schemas and the registry.
 *
 * A tool call never fails at the gRPC level because of what the model asked: every problem
 * (bad arguments, missing file, timeout) becomes a result with is_error set and a message the
 * model can act on. Results carry truncation metadata so clients can page without parsing.
 */
#ifndef CFLUE_TOOLD_TOOL_H
#define CFLUE_TOOLD_TOOL_H

#include "buf.h"
#include "workspace.h"

#include "cflue/v1/tools.pb-c.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#define TOOL_LINES_MAX 2000
#define TOOL_BYTES_MAX 51200
#define TOOL_TEXT_MAX (1 << 20) /* cap of any result text, markers included */
#define TOOL_GREP_MATCHES_MAX 100
#define TOOL_GREP_LINE_CHARS_MAX 500
#define TOOL_GLOB_PATHS_MAX 1000
#define TOOL_PATTERN_MAX 65536
#define TOOL_EDIT_FILE_MAX (64 << 20) /* files edit will load */
/* bash's saved full outputs, in the workspace: read pages them as text whatever bytes the
 * commands wrote (a NUL, from find -print0 say, shows as U+FFFD) */
#define TOOL_SPILL_DIR ".cflue/spill"

struct toold_config {
    int64_t bash_default_timeout_ms; /* when the model gives no timeout */
    int64_t bash_max_timeout_ms;     /* the most a call may ask for */
    const char *grep_engine;         /* "auto", "rg", "pcre2" or "grep" */
    int spill_keep;                  /* bash spill files kept per sandbox, newest first */
    int64_t spill_max_bytes;         /* and at most these bytes of them (0: no bound) */
};

struct tool_ctx {
    struct sandbox *sb;
    const char *cwd; /* the call's working directory, relative to the root as ws_relative
                      * writes it (ToolCall.cwd, checked); NULL: the root */
    const struct toold_config *cfg;
    const struct proc_limits *limits; /* what the commands it runs may use: the sandbox's,
                                       * tightened by ToolCall.limits; NULL: the sandbox's */
    const char *call_id;
    int64_t deadline_ms;          /* monotonic; 0: none (ToolCall.timeout_ms) */
    bool (*cancelled)(void *ctx); /* the caller went away */
    void *cancel_ctx;
    uint64_t lock_ticket; /* per-path turn reserved by a batch, when has_ticket */
    bool has_ticket;
    bool ticket_used; /* set by tool_lock_path */
};

struct tool_result {
    struct buf text;
    bool is_error;
    json_t *details; /* object, owned */
    Cflue__V1__Truncation trunc;
};

enum arg_type { ARG_STRING, ARG_INTEGER, ARG_NUMBER, ARG_BOOLEAN };

struct tool_arg {
    const char *name;
    enum arg_type type;
    bool required;
    const char *description;
};

struct tool_def {
    const char *name;
    const char *description;
    const struct tool_arg *args;
    int n_args;
    void (*run)(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
    bool mutates; /* takes the per-path lock on its `path` argument */
};

/* tool_find returns the tool named name, or NULL. */
const struct tool_def *tool_find(const char *name);

/* tool_all returns the tools in their fixed order (read write edit bash grep glob). */
const struct tool_def *tool_all(int *n_out);

/* tool_schema_json returns the JSON Schema of a tool's arguments (caller frees). */
char *tool_schema_json(const struct tool_def *t);

/* tool_parse_args parses arguments_json strictly (one JSON object, no duplicate keys, no
 * trailing data, no NUL characters) and checks it against the tool's schema. On failure the
 * result is an error naming the argument, and NULL is returned. */
json_t *tool_parse_args(const struct tool_def *t, const char *arguments_json,
                        struct tool_result *res);

/* tool_result_init / tool_result_cleanup manage a result. */
void tool_result_init(struct tool_result *res);
void tool_result_cleanup(struct tool_result *res);

/* tool_fail makes the result an error with a formatted message (replacing any text). */
void tool_fail(struct tool_result *res, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* tool_fail_error makes the result an error carrying err's message. */
void tool_fail_error(struct tool_result *res, const struct cf_error *err);

/* tool_resolve resolves a path the model gave against the call's working directory
 * (ws_relative_from). */
CF_MUST_CHECK enum cf_status tool_resolve(const struct tool_ctx *ctx, const char *path, char *out,
                                          size_t out_len, struct cf_error *err);

/* tool_caller_gone reports whether the call's caller went away. */
bool tool_caller_gone(struct tool_ctx *ctx);

/* tool_cancelled reports whether the call's caller went away or its deadline passed. */
bool tool_cancelled(struct tool_ctx *ctx);

/* The tools. */
void tool_read_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
void tool_write_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
void tool_edit_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
void tool_bash_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
void tool_grep_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);
void tool_glob_run(struct tool_ctx *ctx, json_t *args, struct tool_result *res);

/* tool_lock_path takes the per-path turn for a mutating call (its own ticket, or the one the
 * batch reserved), returning the lock key (a normalized path) for tool_unlock_path. */
CF_MUST_CHECK enum cf_status tool_lock_path(struct tool_ctx *ctx, const char *path, char *key,
                                            size_t key_len, struct cf_error *err);

/* tool_unlock_path ends the turn taken by tool_lock_path. */
void tool_unlock_path(struct tool_ctx *ctx, const char *key);

#endif
