/* walk.h - confined directory walks for grep and glob.
 *
 * Walks start at a path inside the sandbox, never follow symbolic links, and report regular
 * files with their path relative to the sandbox root. Optionally they skip hidden entries
 * (names starting with '.') and what .gitignore and .ignore files exclude, as ripgrep does
 * (also outside git repositories).
 */
#ifndef CFLUE_TOOLD_WALK_H
#define CFLUE_TOOLD_WALK_H

#include "status.h"
#include "workspace.h"

#include <stdbool.h>

struct walk_opts {
    bool skip_hidden;
    bool gitignore;
    /* visit is called for each regular file: its path relative to the root, and the
     * directory descriptor and name to open it with (openat, never following links), or,
     * for a start that is a file, name "" and an O_PATH descriptor of the file itself
     * (ws_open_regular_at takes both). Returning false stops the walk. */
    bool (*visit)(void *ctx, const char *rel_path, int dirfd, const char *name);
    bool (*cancelled)(void *ctx);
    void *ctx;
};

/* walk_tree walks start_rel (a normalized path from ws_relative). A regular file as start is
 * visited alone (hidden and ignore rules do not apply to it). CF_NOT_FOUND and friends, with
 * messages naming shown_path, when the start cannot be opened. */
CF_MUST_CHECK enum cf_status walk_tree(const struct sandbox *sb, const char *start_rel,
                                       const char *shown_path, const struct walk_opts *opts,
                                       struct cf_error *err);

/* An ignore filter answers, for paths an external engine (rg, grep) reported, whether toold's
 * own walk would have skipped them: a hidden component, an ignore-file rule on the file or a
 * directory above it, or binary content (a NUL in the first 64 KiB). Engines then agree
 * exactly. The filter holds the rules of the directories above the path it checked last,
 * within one budget, as a walk holds them there (rules past it are not applied; docs/toold.md);
 * a directory is read again when the hits come back to it. */
struct ignore_filter;

/* ignore_filter_new prepares a filter for one search in sb (never NULL). */
struct ignore_filter *ignore_filter_new(const struct sandbox *sb);

/* ignore_filter_skips reports whether rel (relative to the root) is excluded. The search's
 * start path itself (explicitly given) is never treated as hidden. */
bool ignore_filter_skips(struct ignore_filter *f, const char *rel, const char *start_rel);

/* ignore_filter_free releases it (NULL is fine). */
void ignore_filter_free(struct ignore_filter *f);

#endif
