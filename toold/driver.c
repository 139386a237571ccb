/* driver.c - the local and bwrap drivers. */
#include "driver.h"

#include <stdio.h>
#include <string.h>

static void local_argv(const struct sandbox *sb, const char *cwd, const char *command,
                       const char **argv)
{
    (void)sb;
    (void)cwd;
    argv[0] = "bash";
    argv[1] = "-c";
    argv[2] = command;
    argv[3] = NULL;
}

static void bwrap_argv(const struct sandbox *sb, const char *cwd, const char *command,
                       const char **argv)
{
    int n = 0;
    argv[n++] = "bwrap";
    argv[n++] = "--ro-bind";
    argv[n++] = "/";
    argv[n++] = "/";
    argv[n++] = "--dev";
    argv[n++] = "/dev";
    argv[n++] = "--proc";
    argv[n++] = "/proc";
    argv[n++] = "--tmpfs";
    argv[n++] = "/tmp";
    argv[n++] = "--bind";
    argv[n++] = sb->root;
    argv[n++] = sb->root;
    argv[n++] = "--chdir";
    argv[n++] = cwd;
    argv[n++] = "--unshare-net";
    argv[n++] = "--unshare-pid";
    argv[n++] = "--unshare-ipc";
    argv[n++] = "--unshare-uts";
    argv[n++] = "--die-with-parent";
    argv[n++] = "--new-session";
    argv[n++] = "--";
    argv[n++] = "bash";
    argv[n++] = "-c";
    argv[n++] = command;
    argv[n] = NULL;
}

static const struct driver drivers[] = {
    {"local", local_argv},
    {"bwrap", bwrap_argv},
};

const struct driver *driver_find(const char *name)
{
    for (size_t i = 0; i < sizeof(drivers) / sizeof(drivers[0]); i++) {
        if (!strcmp(drivers[i].name, name)) {
            return &drivers[i];
        }
    }
    return NULL;
}

static bool collect(void *ctx, const char *p, size_t n)
{
    char *msg = ctx;
    size_t have = strlen(msg);
    if (have + 1 < 256) {
        snprintf(msg + have, 256 - have, "%.*s", (int)n, p);
    }
    return true;
}

enum cf_status driver_available(const struct driver *d, const char *root, struct cf_error *err)
{
    if (strcmp(d->name, "bwrap") != 0) {
        return CF_OK;
    }
    struct sandbox probe = {.root_fd = -1};
    snprintf(probe.root, sizeof(probe.root), "%s", root);
    const char *argv[PROC_ARGV_MAX];
    char output[256] = "";
    d->build_argv(&probe, root, "true", argv);
    char **env = proc_base_env(NULL, 0);
    struct proc_spec spec = {.argv = argv,
                             .cwd = root,
                             .envp = env,
                             .timeout_ms = 10000,
                             .on_output = collect,
                             .ctx = output};
    struct proc_result res;
    enum cf_status rc = proc_run(&spec, &res, err);
    proc_env_free(env);
    if (rc != CF_OK) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "the bwrap driver needs bubblewrap (apt-get install bubblewrap): %s",
                            err->msg);
    }
    if (res.exit_code != 0) {
        return cf_error_set(err, CF_UNAVAILABLE,
                            "bubblewrap cannot create a sandbox here (exit %d): %s", res.exit_code,
                            output);
    }
    return CF_OK;
}
