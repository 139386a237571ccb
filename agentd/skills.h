/* skills.h - skills: SKILL.md files whose frontmatter names and describes a piece of
 * instructions the model loads on demand (activate_skill), with supporting files it reads on
 * demand (read_skill_resource).
 *
 * Declared skills are directories `<agents dir>/skills/<name>/` holding SKILL.md and any
 * supporting files, named by an agent definition's `skills: [...]`; agentd loads them at start
 * and keeps them in memory, so a subagent on any replica reads the same files. SKILL.md:
 *
 *   ---
 *   name: review-pr                 # required: equals the directory name; [a-z0-9-], at most
 *                                   # 64, no leading, trailing or double hyphen
 *   description: Review a pull request   # required: at most 1024 characters
 *   license: MIT                    # optional string
 *   compatibility: needs git        # optional string, at most 500 characters
 *   metadata: {owner: web}          # optional string-to-string map
 *   allowed-tools: read grep        # optional, whitespace separated (informational)
 *   ---
 *   The instructions (the body).
 *
 * Every YAML scalar is taken as a string (`version: 1.0` is "1.0"); unknown keys are ignored.
 */
#ifndef CFLUE_AGENTD_SKILLS_H
#define CFLUE_AGENTD_SKILLS_H

#include "status.h"

#include <stddef.h>

#define SKILL_NAME_MAX 64
#define SKILL_DESCRIPTION_MAX 1024  /* Unicode characters */
#define SKILL_COMPATIBILITY_MAX 500 /* Unicode characters */
#define SKILL_FILE_MAX (1 << 20)    /* bytes of SKILL.md, and of one supporting file */
#define SKILL_DEPTH_MAX 8           /* directory levels of a skill's supporting files */
#define SKILL_FILES_MAX 256         /* supporting files of one skill */

/* One supporting file of a skill (not SKILL.md). */
struct skill_file {
    char *path; /* relative to the skill's directory, '/'-separated */
    char *data;
    size_t len;
};

struct skill {
    char *name;
    char *description;
    char *license;       /* NULL when absent */
    char *compatibility; /* NULL when absent */
    char *body;          /* the instructions, trimmed */
    char *origin; /* a skill found in the sandbox: its SKILL.md there (relative to the working
                   * directory); NULL for a declared skill */
    struct skill_file *files; /* sorted by path (byte order) */
    size_t n_files;
};

struct skill_set {
    struct skill *items;
    size_t n;
};

/* skill_parse validates SKILL.md's text (len bytes; path names it in messages, dir_name is the
 * name of the directory holding it) and fills *out (free with skill_free; no files). CF_INVALID
 * with a message naming path and the rule broken. */
CF_MUST_CHECK enum cf_status skill_parse(const char *text, size_t len, const char *path,
                                         const char *dir_name, struct skill *out,
                                         struct cf_error *err);

/* skills_load loads each skill named in names[0..n) (duplicates once) from
 * `<agents_dir>/skills/<name>/`: SKILL.md and its supporting files. A missing or invalid skill,
 * a supporting file that looks like a secret (keys, credentials, .env files) or a symbolic link
 * is CF_INVALID naming the file: a skill is never loaded half. */
CF_MUST_CHECK enum cf_status skills_load(const char *agents_dir, char *const *names, size_t n,
                                         struct skill_set *out, struct cf_error *err);

/* skills_find returns the skill named name, or NULL. */
const struct skill *skills_find(const struct skill_set *set, const char *name);

/* skill_file_find returns the supporting file of s at path, or NULL. */
const struct skill_file *skill_file_find(const struct skill *s, const char *path);

/* skill_free / skills_free release a skill, a set. */
void skill_free(struct skill *s);
void skills_free(struct skill_set *set);

#endif
