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
     * directory descriptor and name to open it with (openat, never following links).
     * Returning false stops the walk. */
    bool (*visit)(void *ctx, const char *rel_path, int dirfd, const char *name);
    bool (*cancelled)(void *ctx);
    void *ctx;
};

/* walk_tree walks start_rel (a normalized path from ws_relative). A regular file as start is
 * visited alone (hidden and ignore rules do not apply to it). CF_NOT_FOUND and friends, with
 * messages naming shown_path, when the start cannot be opened. */
enum cf_status walk_tree(const struct sandbox *sb, const char *start_rel, const char *shown_path,
                         const struct walk_opts *opts, struct cf_error *err);

#endif
