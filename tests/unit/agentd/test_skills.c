/* Unit tests of agentd/skills.c: every SKILL.md frontmatter rule, valid and invalid, and
 * declared skills loaded from a directory with their supporting files. */
#include "../check.h"

#include "mem.h"
#include "skills.h"
#include "yaml_load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static struct cf_error err;

/* parse parses text as skills/<dir>/SKILL.md; returns the status (out freed on success unless
 * keep). */
static enum cf_status parse(const char *text, const char *dir, struct skill *out)
{
    return skill_parse(text, strlen(text), "skills/x/SKILL.md", dir, out, &err);
}

/* refused: text is invalid, and the message holds want. */
static void refused(const char *text, const char *dir, const char *want)
{
    struct skill s;
    CHECK(parse(text, dir, &s) == CF_INVALID);
    CHECK(strstr(err.msg, "skills/x/SKILL.md") != NULL);
    if (!strstr(err.msg, want)) {
        fprintf(stderr, "message %s lacks %s\n", err.msg, want);
        CHECK(0);
    }
}

static void test_valid(void)
{
    struct skill s;
    const char *full = "\xEF\xBB\xBF---  \r\n"
                       "name: review-pr\n"
                       "description:   Review a pull request  \n"
                       "license: MIT\n"
                       "compatibility: ''\n"
                       "version: 1.0\n"
                       "beta: true\n"
                       "metadata:\n  owner: web\n  empty:\n"
                       "allowed-tools: read grep\n"
                       "---\n\n  Read the diff first.\n\n";
    CHECK(parse(full, "review-pr", &s) == CF_OK);
    CHECK_STR(s.name, "review-pr");
    CHECK_STR(s.description, "Review a pull request");
    CHECK_STR(s.license, "MIT");
    CHECK(s.compatibility == NULL); /* empty: absent */
    CHECK_STR(s.body, "Read the diff first.");
    skill_free(&s);

    /* the closing fence may end the file; the body is then empty */
    CHECK(parse("---\nname: a\ndescription: d\n---", "a", &s) == CF_OK);
    CHECK_STR(s.body, "");
    skill_free(&s);
    /* 64 characters, and digits, are fine; a 1024-character description too */
    char name[80], text[4096];
    memset(name, 'a', 64);
    name[64] = '\0';
    snprintf(text, sizeof(text), "---\nname: %s\ndescription: x\n---\n", name);
    CHECK(parse(text, name, &s) == CF_OK);
    skill_free(&s);
    char desc[1100];
    memset(desc, 'd', 1024);
    desc[1024] = '\0';
    snprintf(text, sizeof(text), "---\nname: v2-beta\ndescription: %s\n---\n", desc);
    CHECK(parse(text, "v2-beta", &s) == CF_OK);
    skill_free(&s);
    /* characters, not bytes: 1024 two-byte characters */
    char wide[2100] = "";
    for (int i = 0; i < 1024; i++) {
        strcat(wide, "\xC3\xA9");
    }
    char big[2300];
    snprintf(big, sizeof(big), "---\nname: wide\ndescription: %s\n---\n", wide);
    CHECK(parse(big, "wide", &s) == CF_OK);
    skill_free(&s);
}

static void test_invalid(void)
{
    refused("name: a\ndescription: d\n", "a", "no frontmatter");
    refused("---\nname: a\ndescription: d\n", "a", "no frontmatter"); /* never closed */
    refused("--- x\nname: a\n---\n", "a", "no frontmatter");
    refused("---\nname: [a\n---\n", "a", "not valid YAML");
    refused("---\n- a\n- b\n---\n", "a", "YAML mapping");
    refused("---\n---\n", "a", "YAML mapping");
    refused("---\ndescription: d\n---\n", "a", "needs a name");
    refused("---\nname:\ndescription: d\n---\n", "a", "needs a name");
    refused("---\nname: '   '\ndescription: d\n---\n", "a", "needs a name");
    refused("---\nname: [a]\ndescription: d\n---\n", "a", "needs a name");
    refused("---\nname: a\n---\n", "a", "needs a description");
    refused("---\nname: a\ndescription: ''\n---\n", "a", "needs a description");
    char text[4096], name[80];
    memset(name, 'a', 65);
    name[65] = '\0';
    snprintf(text, sizeof(text), "---\nname: %s\ndescription: d\n---\n", name);
    refused(text, name, "longer than 64");
    refused("---\nname: Review\ndescription: d\n---\n", "Review", "lowercase letters");
    refused("---\nname: re_view\ndescription: d\n---\n", "re_view", "lowercase letters");
    refused("---\nname: -review\ndescription: d\n---\n", "-review", "hyphen");
    refused("---\nname: review-\ndescription: d\n---\n", "review-", "hyphen");
    refused("---\nname: re--view\ndescription: d\n---\n", "re--view", "two in a row");
    refused("---\nname: review\ndescription: d\n---\n", "other", "its directory is \"other\"");
    char desc[1100];
    memset(desc, 'd', 1025);
    desc[1025] = '\0';
    snprintf(text, sizeof(text), "---\nname: a\ndescription: %s\n---\n", desc);
    refused(text, "a", "longer than 1024");
    refused("---\nname: a\ndescription: d\nlicense: [MIT]\n---\n", "a", "license must be a string");
    refused("---\nname: a\ndescription: d\ncompatibility: {x: y}\n---\n", "a",
            "compatibility must be a string");
    memset(desc, 'c', 501);
    desc[501] = '\0';
    snprintf(text, sizeof(text), "---\nname: a\ndescription: d\ncompatibility: %s\n---\n", desc);
    refused(text, "a", "longer than 500");
    refused("---\nname: a\ndescription: d\nmetadata: [x]\n---\n", "a", "map strings to strings");
    refused("---\nname: a\ndescription: d\nmetadata: {x: [1]}\n---\n", "a",
            "map strings to strings");
    refused("---\nname: a\ndescription: d\nallowed-tools: [read]\n---\n", "a",
            "allowed-tools must be a string");
    refused("---\nname: a\ndescription: d\ndescription: e\n---\n", "a",
            "a key appears twice in one mapping");
}

/* Brackets nested past YAML_FLOW_DEPTH_MAX are refused before libyaml sees them (whose time
 * is quadratic in the depth: 1 MiB of "[" took minutes); as deep as allowed still parses. */
static void test_deep_brackets(void)
{
    size_t n = 1 << 20;
    char *text = mem_alloc(n + 64);
    struct skill s;
    int len = snprintf(text, n + 64, "---\nname: a\ndescription: d\nx: ");
    memset(text + len, '[', n - (size_t)len);
    snprintf(text + n, 64, "\n---\n");
    CHECK(skill_parse(text, strlen(text), "SKILL.md", "a", &s, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "nest more than 64 deep") != NULL);
    len = snprintf(text, n + 64, "---\nname: a\ndescription: d\nx: ");
    for (int i = 0; i < YAML_FLOW_DEPTH_MAX; i++) {
        text[len + i] = '[';
        text[len + YAML_FLOW_DEPTH_MAX + i] = ']';
    }
    snprintf(text + len + 2 * YAML_FLOW_DEPTH_MAX, 64, "\n---\nbody\n");
    CHECK(skill_parse(text, strlen(text), "SKILL.md", "a", &s, &err) == CF_OK);
    skill_free(&s);
    free(text);
}

static void put(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_load(void)
{
    char root[] = "/tmp/cflue-skills-XXXXXX", p[4200];
    CHECK(mkdtemp(root) != NULL);
    snprintf(p, sizeof(p), "%s/skills", root);
    mkdir(p, 0755);
    snprintf(p, sizeof(p), "%s/skills/review", root);
    mkdir(p, 0755);
    snprintf(p, sizeof(p), "%s/skills/review/SKILL.md", root);
    put(p, "---\nname: review\ndescription: Review code\n---\nLook closely.\n");
    const char *dirs[] = {"refs", "refs/deep", "node_modules"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof(p), "%s/skills/review/%s", root, dirs[i]);
        mkdir(p, 0755);
    }
    const char *files[] = {"refs/checklist.md", "refs/deep/z.txt", "a.txt",
                           "node_modules/x.js", "notes.md~",       ".DS_Store"};
    for (int i = 0; i < 6; i++) {
        snprintf(p, sizeof(p), "%s/skills/review/%s", root, files[i]);
        put(p, files[i]);
    }
    char *names[] = {"review", "review"};
    struct skill_set set;
    CHECK(skills_load(root, names, 2, &set, &err) == CF_OK);
    CHECK(set.n == 1);
    const struct skill *s = skills_find(&set, "review");
    CHECK(s && s->n_files == 3); /* skipped: node_modules, editor backups, .DS_Store */
    CHECK_STR(s->files[0].path, "a.txt");
    CHECK_STR(s->files[1].path, "refs/checklist.md");
    CHECK_STR(s->files[2].path, "refs/deep/z.txt");
    CHECK(skill_file_find(s, "refs/checklist.md") && !skill_file_find(s, "SKILL.md"));
    CHECK_STR(skill_file_find(s, "refs/deep/z.txt")->data, "refs/deep/z.txt");
    skills_free(&set);

    /* a secret, a credentials directory and a symbolic link are refused, naming the file */
    snprintf(p, sizeof(p), "%s/skills/review/server.pem", root);
    put(p, "key");
    CHECK(skills_load(root, names, 1, &set, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "server.pem") && strstr(err.msg, "secret"));
    unlink(p);
    snprintf(p, sizeof(p), "%s/skills/review/.ssh", root);
    mkdir(p, 0755);
    CHECK(skills_load(root, names, 1, &set, &err) == CF_INVALID);
    CHECK(strstr(err.msg, ".ssh") && strstr(err.msg, "credentials"));
    rmdir(p);
    snprintf(p, sizeof(p), "%s/skills/review/link", root);
    CHECK(symlink("/etc/passwd", p) == 0);
    CHECK(skills_load(root, names, 1, &set, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "symbolic link") != NULL);
    unlink(p);
    /* a skill without its directory */
    char *missing[] = {"absent"};
    CHECK(skills_load(root, missing, 1, &set, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "skill \"absent\"") && strstr(err.msg, "SKILL.md"));

    char cmd[4300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    CHECK(system(cmd) == 0);
}

int main(void)
{
    test_valid();
    test_invalid();
    test_load();
    test_deep_brackets();
    return check_done("test_skills");
}
