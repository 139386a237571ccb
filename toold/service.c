/* service.c - Tools (List, Execute, ExecuteBatch) and Sandbox RPC handlers.
 *
 * Execute runs on a thread of its own (a bash call may take minutes). Problems with what the
 * model asked become error results; gRPC errors are kept for calls that never ran: a bad
 * sandbox name, an undecodable request, a server shutting down.
 */
#include "service.h"

#include "clock.h"
#include "driver.h"
#include "failpoint.h"
#include "ids.h"
#include "locks.h"
#include "log.h"
#include "mem.h"
#include "proc.h"
#include "thread.h"
#include "utf8.h"

#include "cflue/v1/sandbox.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SANDBOX_FILE_MAX (64 << 20)
#define EXEC_OUTPUT_MAX (8 << 20)

struct toold {
    struct workspaces *ws;
    const struct toold_config *cfg;
};

static struct toold server_state;

/* ---------- Tools ---------- */

static void on_list(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ListToolsRequest *req = (const void *)msg;
    struct sandbox *sb = NULL;
    struct cf_error err;
    if (*req->sandbox && workspaces_get(server_state.ws, req->sandbox, &sb, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    int n;
    const struct tool_def *defs = tool_all(&n);
    Cflue__V1__ListToolsResponse resp = CFLUE__V1__LIST_TOOLS_RESPONSE__INIT;
    Cflue__V1__ToolSpec specs[8], *ptrs[8];
    char *schemas[8];
    for (int i = 0; i < n && i < 8; i++) {
        cflue__v1__tool_spec__init(&specs[i]);
        specs[i].name = (char *)defs[i].name;
        specs[i].description = (char *)defs[i].description;
        schemas[i] = tool_schema_json(&defs[i]);
        specs[i].parameters_json = schemas[i];
        ptrs[i] = &specs[i];
    }
    resp.tools = ptrs;
    resp.n_tools = (size_t)n;
    resp.working_directory = sb ? sb->root : "";
    rpc_call_reply(c, &resp.base);
    for (int i = 0; i < n && i < 8; i++) {
        free(schemas[i]);
    }
}

/* call_gone: the client went away. Server shutdown is not a reason to stop a tool call: the
 * shutdown grace period lets it finish, and after it the call is cancelled (and then gone). */
static bool call_gone(void *arg)
{
    return arg && rpc_call_client_gone(arg);
}

/* run_call executes one ToolCall into res (with gRPC-level problems in *err). A batch passes
 * the per-path turn it reserved in ticket_key/ticket; a call that ends without using it still
 * waits for and passes its turn, so later calls on the path are not stranded. */
static enum cf_status run_call(const Cflue__V1__ToolCall *call, struct rpc_call *rpc,
                               const char *ticket_key, uint64_t ticket, struct tool_result *res,
                               struct cf_error *err)
{
    struct sandbox *sb;
    enum cf_status rc = workspaces_get(server_state.ws, call->sandbox, &sb, err);
    if (rc != CF_OK) {
        return rc;
    }
    int64_t t0 = clock_mono_ms();
    const struct tool_def *t = tool_find(call->name);
    if (!t) {
        tool_fail(res,
                  "There is no tool named '%s'. The tools are read, write, edit, bash, "
                  "grep and glob.",
                  call->name);
    } else {
        json_t *args = tool_parse_args(t, call->arguments_json, res);
        if (args) {
            struct tool_ctx ctx = {.sb = sb,
                                   .cfg = server_state.cfg,
                                   .call_id = call->call_id,
                                   .deadline_ms = call->timeout_ms > 0 ? t0 + call->timeout_ms : 0,
                                   .cancelled = call_gone,
                                   .cancel_ctx = rpc,
                                   .has_ticket = ticket_key != NULL,
                                   .lock_ticket = ticket};
            t->run(&ctx, args, res);
            json_decref(args);
            ticket_key = ctx.ticket_used ? NULL : ticket_key;
        }
    }
    if (ticket_key) {
        locks_wait(sb->locks, ticket_key, ticket);
        locks_release(sb->locks, ticket_key);
    }
    failpoint_hit("toold.tool.after_run"); /* ran; its result not yet sent */
    char q[256];
    log_info("tool.call", "sandbox=%s tool=%s call=%s error=%d truncated=%d ms=%lld", sb->name,
             log_quote(q, sizeof(q), call->name), *call->call_id ? call->call_id : "-",
             (int)res->is_error, (int)res->trunc.truncated, (long long)(clock_mono_ms() - t0));
    return CF_OK;
}

static void fill_result(Cflue__V1__ToolResult *out, struct tool_result *res, char **details)
{
    cflue__v1__tool_result__init(out);
    out->text = (char *)buf_cstr(&res->text);
    out->is_error = res->is_error;
    *details = json_dumps(res->details, JSON_COMPACT);
    out->details_json = *details ? *details : "{}";
    out->truncation = &res->trunc;
}

static void on_execute(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ToolCall *call = (const void *)msg;
    struct tool_result res;
    struct cf_error err;
    const char *problem = rpc_call_input_problem(c);
    if (problem && strncmp(problem, "arguments_json", 14) != 0) {
        /* a name that was cut short must not select another sandbox or tool */
        rpc_call_fail(c, CF_INVALID, "malformed request: %s", problem);
        return;
    }
    tool_result_init(&res);
    if (problem) {
        tool_fail(&res,
                  "The arguments are not valid JSON text: %s. Send one JSON object of "
                  "UTF-8 text.",
                  problem);
    } else if (call->timeout_ms < 0) {
        tool_fail(&res, "timeout_ms must not be negative");
    } else if (run_call(call, c, NULL, 0, &res, &err) != CF_OK) {
        tool_result_cleanup(&res);
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__ToolResult out;
    char *details;
    fill_result(&out, &res, &details);
    rpc_call_reply(c, &out.base);
    free(details);
    tool_result_cleanup(&res);
}

/* ---------- ExecuteBatch ---------- */

#define BATCH_MAX 64

struct batch;

struct batch_item {
    struct batch *b;
    int index;
    const Cflue__V1__ToolCall *call;
    char key[WS_PATH_MAX];
    bool has_ticket;
    uint64_t ticket;
    struct tool_result res;
    enum cf_status st;
    struct cf_error err;
    bool done, sent;
    bool started; /* thread holds a joinable handle */
    pthread_t thread;
};

struct batch {
    struct rpc_call *rpc;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *batch_worker(void *arg)
{
    struct batch_item *it = arg;
    it->st = run_call(it->call, it->b->rpc, it->has_ticket ? it->key : NULL, it->ticket, &it->res,
                      &it->err);
    pthread_mutex_lock(&it->b->mu);
    it->done = true;
    pthread_cond_broadcast(&it->b->cv);
    pthread_mutex_unlock(&it->b->mu);
    return NULL;
}

/* reserve takes the per-path turn of a write or edit call, in batch order. */
static void reserve(struct batch_item *it)
{
    const struct tool_def *t = tool_find(it->call->name);
    struct sandbox *sb;
    struct cf_error err;
    if (!t || !t->mutates ||
        workspaces_get(server_state.ws, it->call->sandbox, &sb, &err) != CF_OK) {
        return;
    }
    json_t *args = json_loads(it->call->arguments_json, JSON_REJECT_DUPLICATES, NULL);
    const char *path = json_string_value(json_object_get(args, "path"));
    if (path && ws_relative(sb, path, it->key, sizeof(it->key), &err) == CF_OK) {
        it->ticket = locks_ticket(sb->locks, it->key);
        it->has_ticket = true;
    }
    json_decref(args);
}

static void on_execute_batch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ToolBatch *req = (const void *)msg;
    if (req->n_calls > BATCH_MAX) {
        rpc_call_fail(c, CF_INVALID, "a batch holds at most %d calls; this one has %zu", BATCH_MAX,
                      req->n_calls);
        return;
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        if (!ids_valid_name(req->calls[i]->sandbox, 128) || req->calls[i]->timeout_ms < 0) {
            rpc_call_fail(c, CF_INVALID, "calls[%zu]: bad sandbox name or negative timeout_ms", i);
            return;
        }
    }
    struct batch b = {.rpc = c};
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    struct batch_item *items = mem_alloc(sizeof(*items) * (req->n_calls + 1));
    for (size_t i = 0; i < req->n_calls; i++) {
        items[i].b = &b;
        items[i].index = (int)i;
        items[i].call = req->calls[i];
        tool_result_init(&items[i].res);
        reserve(&items[i]);
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        if (thread_start(&items[i].thread, 0, batch_worker, &items[i], &items[i].err) != CF_OK) {
            /* this call gets an error result; its per-path turn is passed on unused */
            if (items[i].has_ticket) {
                struct sandbox *sb;
                struct cf_error e2;
                if (workspaces_get(server_state.ws, items[i].call->sandbox, &sb, &e2) == CF_OK) {
                    locks_wait(sb->locks, items[i].key, items[i].ticket);
                    locks_release(sb->locks, items[i].key);
                }
            }
            tool_fail(&items[i].res, "The call could not start (%s); it did not run.",
                      items[i].err.msg);
            pthread_mutex_lock(&b.mu);
            items[i].done = true;
            pthread_mutex_unlock(&b.mu);
        } else {
            items[i].started = true;
        }
    }
    size_t sent = 0;
    bool alive = true;
    while (sent < req->n_calls) {
        pthread_mutex_lock(&b.mu);
        struct batch_item *ready = NULL;
        while (!ready) {
            for (size_t i = 0; i < req->n_calls && !ready; i++) {
                if (items[i].done && !items[i].sent) {
                    ready = &items[i];
                }
            }
            if (!ready) {
                pthread_cond_wait(&b.cv, &b.mu);
            }
        }
        ready->sent = true;
        pthread_mutex_unlock(&b.mu);
        sent++;
        if (!alive) {
            continue;
        }
        Cflue__V1__BatchResult out = CFLUE__V1__BATCH_RESULT__INIT;
        Cflue__V1__ToolResult tr;
        char *details = NULL;
        if (ready->st != CF_OK) {
            tool_fail_error(&ready->res, &ready->err);
        }
        fill_result(&tr, &ready->res, &details);
        out.index = ready->index;
        out.result = &tr;
        alive = rpc_call_send(c, &out.base);
        free(details);
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        if (items[i].started) {
            pthread_join(items[i].thread, NULL);
        }
        tool_result_cleanup(&items[i].res);
    }
    free(items);
    pthread_mutex_destroy(&b.mu);
    pthread_cond_destroy(&b.cv);
    if (alive) {
        rpc_call_finish(c, GRPC_STATUS_OK, NULL);
    } else {
        rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the caller went away");
    }
}

/* ---------- Sandbox ---------- */

static bool sandbox_for(struct rpc_call *c, const char *name, const char *path, char *rel,
                        struct sandbox **sb)
{
    struct cf_error err;
    if (workspaces_get(server_state.ws, name, sb, &err) != CF_OK ||
        (path && ws_relative(*sb, path, rel, WS_PATH_MAX, &err) != CF_OK)) {
        rpc_call_fail_error(c, &err);
        return false;
    }
    return true;
}

/* read_whole reads fd to its end, at most max bytes (CF_TOOBIG past that), in bounded steps
 * that stop when the caller leaves. The file may change meanwhile: what is returned is what
 * was read, never more than max. */
static enum cf_status read_whole(struct rpc_call *c, int fd, const char *shown, size_t max,
                                 uint8_t **out, size_t *len_out, struct cf_error *err)
{
    size_t cap = 64 * 1024, got = 0;
    uint8_t *data = mem_alloc(cap);
    for (;;) {
        if (got == cap) {
            if (cap > max) {
                free(data);
                return cf_error_set(err, CF_TOOBIG,
                                    "%s is over %zu bytes, the most ReadFile returns", shown, max);
            }
            cap *= 2;
            data = mem_realloc(data, cap);
        }
        size_t want = cap - got < (1 << 20) ? cap - got : (1 << 20);
        ssize_t r = read(fd, data + got, want);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            int e = errno;
            free(data);
            return ws_errno_error(e, "read", shown, err);
        }
        if (r == 0) {
            break;
        }
        got += (size_t)r;
        if (got > max) {
            free(data);
            return cf_error_set(err, CF_TOOBIG, "%s is over %zu bytes, the most ReadFile returns",
                                shown, max);
        }
        if (rpc_call_client_gone(c)) {
            free(data);
            return cf_error_set(err, CF_CANCELLED, "the caller went away");
        }
    }
    *out = data;
    *len_out = got;
    return CF_OK;
}

static void on_read_file(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ReadFileRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX];
    struct sandbox *sb;
    struct cf_error err;
    struct stat st;
    uint8_t *data = NULL;
    size_t len = 0;
    int fd;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (ws_open_regular(sb, rel, req->path, &fd, &st, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    if (st.st_size > SANDBOX_FILE_MAX) {
        close(fd);
        rpc_call_fail(c, CF_TOOBIG, "%s is %lld bytes; ReadFile returns files up to %d bytes",
                      req->path, (long long)st.st_size, SANDBOX_FILE_MAX);
        return;
    }
    enum cf_status rc = read_whole(c, fd, req->path, SANDBOX_FILE_MAX, &data, &len, &err);
    close(fd);
    if (rc != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__ReadFileResponse resp = CFLUE__V1__READ_FILE_RESPONSE__INIT;
    resp.data.data = data;
    resp.data.len = len;
    rpc_call_reply(c, &resp.base);
    free(data);
}

static void on_write_file(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__WriteFileRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX];
    struct sandbox *sb;
    struct cf_error err;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (req->mode > 07777) {
        rpc_call_fail(c, CF_INVALID, "mode must be permission bits (at most 07777)");
        return;
    }
    uint64_t ticket = locks_ticket(sb->locks, rel);
    locks_wait(sb->locks, rel, ticket);
    enum cf_status rc =
        ws_write_file(sb, rel, req->data.data, req->data.len, req->mode, req->path, &err);
    locks_release(sb->locks, rel);
    if (rc != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__WriteFileResponse resp = CFLUE__V1__WRITE_FILE_RESPONSE__INIT;
    resp.bytes_written = (int64_t)req->data.len;
    rpc_call_reply(c, &resp.base);
}

static void stat_info(Cflue__V1__FileInfo *fi, const char *name, const struct stat *st,
                      bool is_link)
{
    cflue__v1__file_info__init(fi);
    fi->name = (char *)name;
    fi->type = is_link                ? CFLUE__V1__FILE_TYPE__SYMLINK
               : S_ISREG(st->st_mode) ? CFLUE__V1__FILE_TYPE__REGULAR
               : S_ISDIR(st->st_mode) ? CFLUE__V1__FILE_TYPE__DIRECTORY
                                      : CFLUE__V1__FILE_TYPE__OTHER;
    fi->size = st->st_size;
    fi->modified_at_ms = (int64_t)st->st_mtim.tv_sec * 1000 + st->st_mtim.tv_nsec / 1000000;
    fi->mode = st->st_mode & 07777;
}

static void on_stat(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__PathRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX];
    struct sandbox *sb;
    struct cf_error err;
    struct stat st;
    int fd;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (ws_open(sb, rel, O_PATH | O_NOFOLLOW, 0, req->path, &fd, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    int st_rc = fstat(fd, &st);
    int st_errno = errno;
    close(fd);
    if (st_rc != 0) {
        rpc_call_fail(c, ws_errno_error(st_errno, "stat", req->path, &err), "%s", err.msg);
        return;
    }
    Cflue__V1__FileInfo fi;
    const char *base = strrchr(rel, '/');
    stat_info(&fi, base ? base + 1 : rel, &st, S_ISLNK(st.st_mode));
    rpc_call_reply(c, &fi.base);
}

static int cmp_info(const void *a, const void *b)
{
    return strcmp((*(Cflue__V1__FileInfo *const *)a)->name,
                  (*(Cflue__V1__FileInfo *const *)b)->name);
}

static void on_read_dir(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__PathRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX];
    struct sandbox *sb;
    struct cf_error err;
    int fd;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (ws_open(sb, rel, O_RDONLY | O_DIRECTORY, 0, req->path, &fd, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    DIR *d = fdopendir(fd);
    size_t n = 0, cap = 64;
    Cflue__V1__FileInfo **items = mem_alloc(sizeof(void *) * cap);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        struct stat st;
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
            fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            continue;
        }
        if (n == cap) {
            cap *= 2;
            items = mem_realloc(items, sizeof(void *) * cap);
        }
        items[n] = mem_alloc(sizeof(Cflue__V1__FileInfo));
        stat_info(items[n], mem_strdup(e->d_name), &st, S_ISLNK(st.st_mode));
        n++;
    }
    if (d) {
        closedir(d);
    }
    qsort(items, n, sizeof(void *), cmp_info);
    Cflue__V1__ReadDirResponse resp = CFLUE__V1__READ_DIR_RESPONSE__INIT;
    resp.entries = items;
    resp.n_entries = n;
    rpc_call_reply(c, &resp.base);
    for (size_t i = 0; i < n; i++) {
        free(items[i]->name);
        free(items[i]);
    }
    free(items);
}

static void on_mkdir(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__MkdirRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX], base[NAME_MAX + 1], child[WS_PATH_MAX + 8];
    struct sandbox *sb;
    struct cf_error err;
    int dirfd;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (ws_open_parent(sb, rel, req->parents, req->path, &dirfd, base, sizeof(base), &err) !=
        CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    int r = mkdirat(dirfd, base, 0755);
    int e = errno;
    close(dirfd);
    snprintf(child, sizeof(child), "%s", rel);
    if (r != 0 && !(e == EEXIST && req->parents)) {
        rpc_call_fail(c, ws_errno_error(e, "mkdir", req->path, &err), "%s", err.msg);
        return;
    }
    Cflue__V1__MkdirResponse resp = CFLUE__V1__MKDIR_RESPONSE__INIT;
    rpc_call_reply(c, &resp.base);
}

static int remove_tree(int parent, const char *name)
{
    if (unlinkat(parent, name, 0) == 0) {
        return 0;
    }
    if (errno != EISDIR && errno != EPERM) {
        return -1;
    }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    DIR *d = fdopendir(fd);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
            remove_tree(dirfd(d), e->d_name) != 0) {
            closedir(d);
            return -1;
        }
    }
    if (d) {
        closedir(d);
    }
    return unlinkat(parent, name, AT_REMOVEDIR);
}

static void on_remove(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__RemoveRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX], base[NAME_MAX + 1];
    struct sandbox *sb;
    struct cf_error err;
    int dirfd;
    if (!sandbox_for(c, req->sandbox, req->path, rel, &sb)) {
        return;
    }
    if (ws_open_parent(sb, rel, false, req->path, &dirfd, base, sizeof(base), &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    int r = unlinkat(dirfd, base, 0);
    if (r != 0 && (errno == EISDIR || errno == EPERM)) {
        r = req->recursive ? remove_tree(dirfd, base) : unlinkat(dirfd, base, AT_REMOVEDIR);
    }
    int e = errno;
    close(dirfd);
    if (r != 0) {
        rpc_call_fail(c, ws_errno_error(e, "remove", req->path, &err), "%s", err.msg);
        return;
    }
    Cflue__V1__RemoveResponse resp = CFLUE__V1__REMOVE_RESPONSE__INIT;
    rpc_call_reply(c, &resp.base);
}

struct exec_out {
    struct buf out, err; /* share EXEC_OUTPUT_MAX between them */
    bool overflow;
};

static bool exec_collect_to(struct exec_out *o, struct buf *b, const char *p, size_t n)
{
    if (o->out.len + o->err.len + n > EXEC_OUTPUT_MAX || buf_append(b, p, n) != CF_OK) {
        o->overflow = true;
        return false;
    }
    return true;
}

static bool exec_collect(void *arg, const char *p, size_t n)
{
    struct exec_out *o = arg;
    return exec_collect_to(o, &o->out, p, n);
}

static bool exec_collect_err(void *arg, const char *p, size_t n)
{
    struct exec_out *o = arg;
    return exec_collect_to(o, &o->err, p, n);
}

static void on_exec(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ExecRequest *req = (const void *)msg;
    char rel[WS_PATH_MAX], cwd[PATH_MAX + WS_PATH_MAX];
    struct sandbox *sb;
    struct cf_error err;
    int fd;
    if (!sandbox_for(c, req->sandbox, *req->cwd ? req->cwd : ".", rel, &sb)) {
        return;
    }
    if (!*req->command) {
        rpc_call_fail(c, CF_INVALID, "command is required");
        return;
    }
    if (ws_open(sb, rel, O_PATH | O_DIRECTORY, 0, *req->cwd ? req->cwd : ".", &fd, &err) != CF_OK) {
        rpc_call_fail_error(c, &err);
        return;
    }
    close(fd);
    ws_host_path(sb, rel, cwd, sizeof(cwd));
    const char **extra = mem_alloc(sizeof(char *) * (req->n_env + 1));
    for (size_t i = 0; i < req->n_env; i++) {
        size_t len = strlen(req->env[i]->key) + strlen(req->env[i]->value) + 2;
        char *kv = mem_alloc(len);
        snprintf(kv, len, "%s=%s", req->env[i]->key, req->env[i]->value);
        extra[i] = kv;
    }
    char **env = proc_base_env(extra, req->n_env);
    for (size_t i = 0; i < req->n_env; i++) {
        free((char *)extra[i]);
    }
    free(extra);
    const char *argv[PROC_ARGV_MAX];
    sb->driver->build_argv(sb, cwd, req->command, argv);
    struct exec_out o = {.overflow = false};
    buf_init(&o.out, EXEC_OUTPUT_MAX);
    buf_init(&o.err, EXEC_OUTPUT_MAX);
    int64_t timeout =
        req->timeout_ms > 0 ? req->timeout_ms : server_state.cfg->bash_default_timeout_ms;
    struct proc_spec spec = {.argv = argv,
                             .cwd = cwd,
                             .envp = env,
                             .timeout_ms = timeout,
                             .stdin_data = req->stdin.len ? req->stdin.data : NULL,
                             .stdin_len = req->stdin.len,
                             .on_output = exec_collect,
                             .on_stderr = exec_collect_err,
                             .ctx = &o};
    struct proc_result pr;
    enum cf_status rc = proc_run(&spec, &pr, &err);
    proc_env_free(env);
    if (rc != CF_OK) {
        buf_cleanup(&o.out);
        buf_cleanup(&o.err);
        rpc_call_fail_error(c, &err);
        return;
    }
    Cflue__V1__ExecResponse resp = CFLUE__V1__EXEC_RESPONSE__INIT;
    resp.stdout.data = (uint8_t *)o.out.data;
    resp.stdout.len = o.out.len;
    resp.exit_code = pr.exit_code;
    resp.timed_out = pr.timed_out;
    if (o.overflow) {
        buf_reset(&o.err);
        buf_append_str(&o.err, "[output exceeded 8 MiB in all; the command was stopped]");
    }
    resp.stderr.data = (uint8_t *)o.err.data;
    resp.stderr.len = o.err.len;
    rpc_call_reply(c, &resp.base);
    buf_cleanup(&o.out);
    buf_cleanup(&o.err);
}

void toold_register(struct rpc_server *srv, struct workspaces *ws, const struct toold_config *cfg)
{
    server_state.ws = ws;
    server_state.cfg = cfg;
    rpc_server_add_method(srv, "/cflue.v1.Tools/List", &cflue__v1__list_tools_request__descriptor,
                          on_list, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Tools/Execute", &cflue__v1__tool_call__descriptor,
                          on_execute, NULL, RPC_THREAD);
    rpc_server_lenient_strings(srv, "/cflue.v1.Tools/Execute");
    rpc_server_add_method(srv, "/cflue.v1.Tools/ExecuteBatch", &cflue__v1__tool_batch__descriptor,
                          on_execute_batch, NULL, RPC_THREAD);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/ReadFile",
                          &cflue__v1__read_file_request__descriptor, on_read_file, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/WriteFile",
                          &cflue__v1__write_file_request__descriptor, on_write_file, NULL,
                          RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/Stat", &cflue__v1__path_request__descriptor,
                          on_stat, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/ReadDir", &cflue__v1__path_request__descriptor,
                          on_read_dir, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/Mkdir", &cflue__v1__mkdir_request__descriptor,
                          on_mkdir, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/Remove", &cflue__v1__remove_request__descriptor,
                          on_remove, NULL, RPC_POOL);
    rpc_server_add_method(srv, "/cflue.v1.Sandbox/Exec", &cflue__v1__exec_request__descriptor,
                          on_exec, NULL, RPC_THREAD);
}
