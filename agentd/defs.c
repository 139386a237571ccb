/* defs.c - the agent definitions in force, shared by reference, and their reload (defs.h). */
#include "defs.h"

#include "agentd.h"
#include "catalog.h"
#include "ids.h"
#include "log.h"
#include "mem.h"
#include "placement.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* directory levels under skills/ looked at for changes: a skill's directory, and every level
 * of supporting files below it that skills.c reads */
#define WALK_DEPTH_MAX (SKILL_DEPTH_MAX + 1)
#define WALK_FILES_MAX 10000 /* files looked at for changes */

static struct {
    pthread_mutex_t mu;         /* the snapshot in force and every refs count */
    pthread_mutex_t reloading;  /* one reload at a time */
    struct agent_defs *current; /* one reference is the module's */
    char *dir;
    uint64_t fingerprint; /* of the files `current` was loaded from */
    uint64_t generation;
} g_defs = {.mu = PTHREAD_MUTEX_INITIALIZER, .reloading = PTHREAD_MUTEX_INITIALIZER};

/* ---------- what the directory holds ---------- */

/* mix adds one file (its path, and its size, times and inode, followed through links). */
static uint64_t mix(uint64_t h, const char *path, const struct stat *st)
{
    h = ids_hash64_more(h, path, strlen(path) + 1);
    int64_t v[] = {(int64_t)st->st_size,        (int64_t)st->st_mtim.tv_sec, st->st_mtim.tv_nsec,
                   (int64_t)st->st_ctim.tv_sec, st->st_ctim.tv_nsec,         (int64_t)st->st_ino};
    return ids_hash64_more(h, v, sizeof(v));
}

/* walk mixes in every file under path (sorted, so the order of readdir does not matter). */
static uint64_t walk(uint64_t h, const char *path, int depth, int *files, bool md_only)
{
    struct dirent **names;
    int n = scandir(path, &names, NULL, alphasort);
    if (n < 0) {
        return ids_hash64_more(h, "?",
                               1); /* missing or unreadable: that too is a state to compare */
    }
    for (int i = 0; i < n; i++) {
        const char *name = names[i]->d_name;
        size_t len = strlen(name);
        char sub[4096];
        struct stat st;
        snprintf(sub, sizeof(sub), "%s/%s", path, name);
        bool skip = name[0] == '.' || (md_only && (len < 4 || strcmp(name + len - 3, ".md")));
        if (!skip && ++*files <= WALK_FILES_MAX && stat(sub, &st) == 0) {
            h = mix(h, sub, &st);
            if (S_ISDIR(st.st_mode) && depth < WALK_DEPTH_MAX) {
                h = walk(h, sub, depth + 1, files, false);
            }
        }
        free(names[i]);
    }
    free(names);
    return h;
}

static uint64_t fingerprint(const char *dir)
{
    char skills[4096];
    int files = 0;
    snprintf(skills, sizeof(skills), "%s/skills", dir);
    uint64_t h = walk(IDS_HASH64_INIT, dir, WALK_DEPTH_MAX, &files, true);
    return walk(h, skills, 0, &files, false);
}

/* ---------- loading ---------- */

static void defs_free(struct agent_defs *defs)
{
    skills_free(&defs->skills);
    agents_free(&defs->agents);
    free(defs);
}

/* load reads dir into a new snapshot (not yet in force). */
static enum cf_status load(const char *dir, struct agent_defs **out, struct cf_error *err)
{
    struct agent_defs *defs = mem_alloc(sizeof(*defs));
    memset(defs, 0, sizeof(*defs));
    enum cf_status rc = agents_load(dir, &defs->agents, err);
    if (rc != CF_OK) {
        free(defs);
        return rc;
    }
    char **names = NULL;
    size_t n_names = 0;
    for (size_t i = 0; i < defs->agents.n; i++) {
        const struct agent_def *a = &defs->agents.items[i];
        names = mem_realloc(names, sizeof(*names) * (n_names + a->n_skills + 1));
        for (size_t k = 0; k < a->n_skills; k++) {
            names[n_names++] = a->skills[k];
        }
    }
    rc = skills_load(dir, names, n_names, &defs->skills, err);
    free(names);
    if (rc != CF_OK) {
        defs_free(defs);
        return rc;
    }
    for (size_t i = 0; i < defs->agents.n; i++) {
        if (defs->agents.items[i].sandbox_tools) {
            placement_watch(
                defs->agents.items[i].sandbox_tools); /* dns: looked up in the background */
        }
        const char *model = defs->agents.items[i].model;
        if (model && !catalog_lookup(model).known) {
            log_warn("model_unknown",
                     "agent=%s model=%s msg=\"not in the catalog: using a 128k window, 8192 "
                     "output tokens and no price\"",
                     defs->agents.items[i].name, model);
        }
    }
    *out = defs;
    return CF_OK;
}

/* install puts defs in force (taking the caller's reference) and releases the one before. */
static void install(struct agent_defs *defs, uint64_t print)
{
    pthread_mutex_lock(&g_defs.mu);
    struct agent_defs *old = g_defs.current;
    defs->generation = ++g_defs.generation;
    defs->refs = 1;
    g_defs.current = defs;
    g_defs.fingerprint = print;
    pthread_mutex_unlock(&g_defs.mu);
    defs_put(old);
}

enum cf_status defs_start(const char *dir, struct cf_error *err)
{
    struct agent_defs *defs;
    uint64_t print = fingerprint(dir);
    enum cf_status rc = load(dir, &defs, err);
    if (rc == CF_OK) {
        g_defs.dir = mem_strdup(dir);
        install(defs, print);
    }
    return rc;
}

struct agent_defs *defs_get(void)
{
    pthread_mutex_lock(&g_defs.mu);
    struct agent_defs *defs = g_defs.current;
    if (defs) {
        defs->refs++;
    }
    pthread_mutex_unlock(&g_defs.mu);
    return defs;
}

uint64_t defs_generation(void)
{
    pthread_mutex_lock(&g_defs.mu);
    uint64_t g = g_defs.current ? g_defs.current->generation : 0;
    pthread_mutex_unlock(&g_defs.mu);
    return g;
}

void defs_put(struct agent_defs *defs)
{
    if (!defs) {
        return;
    }
    pthread_mutex_lock(&g_defs.mu);
    bool last = --defs->refs == 0;
    pthread_mutex_unlock(&g_defs.mu);
    if (last) {
        defs_free(defs);
    }
}

bool defs_changed(void)
{
    pthread_mutex_lock(&g_defs.mu);
    uint64_t was = g_defs.fingerprint;
    pthread_mutex_unlock(&g_defs.mu);
    return g_defs.dir && fingerprint(g_defs.dir) != was;
}

bool defs_reload(const char *why)
{
    struct agent_defs *defs;
    struct cf_error err;
    char q[CF_ERROR_MSG_MAX + 64];
    pthread_mutex_lock(&g_defs.reloading);
    uint64_t print = fingerprint(g_defs.dir);
    enum cf_status rc = load(g_defs.dir, &defs, &err);
    if (rc == CF_OK && (rc = tool_servers_check(&defs->agents, &err)) != CF_OK) {
        defs_free(defs);
    }
    if (rc != CF_OK) {
        /* the files stay as they are until someone mends them: not tried again until they
         * change again */
        pthread_mutex_lock(&g_defs.mu);
        g_defs.fingerprint = print;
        pthread_mutex_unlock(&g_defs.mu);
        log_error("agents_reload_failed", "why=%s err=%s note=\"the definitions in force stay\"",
                  why, log_quote(q, sizeof(q), err.msg));
        pthread_mutex_unlock(&g_defs.reloading);
        return false;
    }
    size_t n = defs->agents.n;
    install(defs, print);
    log_info("agents_reloaded", "why=%s agents=%zu generation=%llu", why, n,
             (unsigned long long)g_defs.generation);
    pthread_mutex_unlock(&g_defs.reloading);
    return true;
}

void defs_stop(void)
{
    pthread_mutex_lock(&g_defs.mu);
    struct agent_defs *defs = g_defs.current;
    g_defs.current = NULL;
    pthread_mutex_unlock(&g_defs.mu);
    defs_put(defs);
    free(g_defs.dir);
    g_defs.dir = NULL;
}
