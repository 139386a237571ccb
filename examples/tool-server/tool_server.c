/* tool_server.c - cflue-example-tools: a small custom tool server, to copy.
 *
 * It serves cflue.v1.Tools (protos/cflue/v1/tools.proto) with two tools, word_count and
 * utc_now, over the project's own server layer (common/rpc.h) and daemon conventions
 * (common/daemon.h: --help, --log-level, grpc.health.v1, SIGTERM). An agent uses it by naming
 * its address in the `tools:` list of its definition (docs/tool-servers.md).
 *
 * To make your own:
 *   1. Copy this directory to examples/<yours>/ (or anywhere in this tree), add an
 *      add_subdirectory line for it to the top-level CMakeLists.txt, and rename the target in
 *      its CMakeLists.txt.
 *   2. Change the name, usage text, LISTEN_ENV and default address in main.
 *   3. Replace the rows of `tools` (and their run functions): a name the model calls, one
 *      paragraph telling the model what the tool does and when to use it, the JSON Schema of
 *      its arguments, and the argument names it accepts. Names must not clash with the
 *      sandbox's tools (read write edit bash grep glob), the framework's (task,
 *      activate_skill, read_skill_resource, finish, give_up) or another server's.
 *   4. Keep the contract: anything wrong with a call (bad arguments, a failed lookup, a
 *      timeout) is a result with is_error set, written for the model to read and act on; a
 *      gRPC error means the call never ran. Bound every input (TEXT_MAX here). A request that
 *      does not decode, or whose text fields are not UTF-8, is refused by rpc.h with
 *      INVALID_ARGUMENT before a handler runs.
 *
 * Each call's ToolCall.sandbox names the agent's sandbox (empty when it has none), for tools
 * that act on it; ToolCall.timeout is the caller's time left: a tool that can take long should
 * stop by then, and run on RPC_THREAD rather than RPC_POOL. These tools need neither: they ignore
 * the sandbox, finish at once, and ExecuteBatch runs its calls one after another.
 */
#include "daemon.h"
#include "log.h"
#include "proto_limits.h"
#include "rpc.h"
#include "utf8.h"

#include "cflue/v1/tools.pb-c.h"

#include <ctype.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LISTEN_ENV "CFLUE_EXAMPLE_TOOLS_LISTEN"
#define TEXT_MAX (1 << 20) /* word_count's text, bytes */
#define ARGS_MAX (8 << 20) /* one call's arguments JSON, bytes (TEXT_MAX escaped fits) */
#define RESULT_MAX 1024    /* a result's text and details: every message here fits */
#define NAME_SHOWN 64      /* bytes of a name from the caller quoted back in a message */

/* One call's outcome, built on the caller's stack. */
struct result {
    bool is_error;
    char text[RESULT_MAX];
    char details[RESULT_MAX]; /* JSON object */
};

/* A tool: what List tells the model, and what Execute runs once the arguments are an object
 * holding only names from args. run fills res (is_error for a bad argument). */
struct tool {
    const char *name;
    const char *description;
    const char *parameters_json;
    const char *const *args; /* accepted argument names, NULL-terminated */
    void (*run)(json_t *args, struct result *res);
};

static void set_result(struct result *res, bool is_error, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* set_result writes the text of res; a text cut at RESULT_MAX is cut at a UTF-8 boundary. */
static void set_result(struct result *res, bool is_error, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(res->text, sizeof(res->text), fmt, ap);
    va_end(ap);
    size_t n = strlen(res->text);
    res->text[utf8_prefix_len(res->text, n, n)] = '\0';
    res->is_error = is_error;
    snprintf(res->details, sizeof(res->details), "{}");
}

/* shown is how many bytes of s to quote back: at most NAME_SHOWN, whole UTF-8 characters. */
static int shown(const char *s)
{
    return (int)utf8_prefix_len(s, strlen(s), NAME_SHOWN);
}

/* append_name adds name to the list in out ("a, b"), cut at out_len. */
static void append_name(char *out, size_t out_len, const char *name)
{
    size_t len = strlen(out);
    snprintf(out + len, out_len - len, "%s%s", len ? ", " : "", name);
}

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        break;
    }
    return "null";
}

/* ---------- the tools ---------- */

static const char *const word_count_args[] = {"text", NULL};

static void word_count(json_t *args, struct result *res)
{
    json_t *v = json_object_get(args, "text");
    if (!v) {
        set_result(res, true,
                   "word_count needs the argument 'text' (a string): the text to count.");
        return;
    }
    if (!json_is_string(v)) {
        set_result(res, true, "The argument 'text' of word_count must be a string; got %s.",
                   type_name(v));
        return;
    }
    const char *p = json_string_value(v);
    size_t n = json_string_length(v);
    if (n > TEXT_MAX) {
        set_result(res, true,
                   "The text is %zu bytes; word_count takes at most %d bytes (1 MiB). Count it "
                   "in parts and add the results up.",
                   n, TEXT_MAX);
        return;
    }
    size_t words = 0, lines = 0;
    bool in_word = false;
    for (size_t i = 0; i < n; i++) {
        bool space = isspace((unsigned char)p[i]) != 0; /* the C locale's: ASCII only */
        words += !space && !in_word;
        in_word = !space;
        lines += p[i] == '\n';
    }
    lines += n > 0 && p[n - 1] != '\n'; /* a last line without a line break */
    size_t chars = utf8_count_chars(p, n);
    set_result(res, false, "words: %zu, lines: %zu, characters: %zu", words, lines, chars);
    snprintf(res->details, sizeof(res->details), "{\"words\":%zu,\"lines\":%zu,\"characters\":%zu}",
             words, lines, chars);
}

static const char *const utc_now_args[] = {NULL};

static void utc_now(json_t *args, struct result *res)
{
    time_t now = time(NULL);
    struct tm tm;
    char stamp[32];
    if (!gmtime_r(&now, &tm) || !strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &tm)) {
        set_result(res, true, "The clock of the tool server could not be read.");
        return;
    }
    set_result(res, false, "%s", stamp);
    snprintf(res->details, sizeof(res->details), "{\"utc\":\"%s\"}", stamp);
}

static const struct tool tools[] = {
    {"word_count",
     "Counts the words, lines and characters of a text and answers `words: W, lines: L, "
     "characters: C`. Words are runs of characters between whitespace (spaces, tabs, line "
     "breaks); lines are counted as an editor shows them (a last line without a line break "
     "counts, an empty text has none); characters are Unicode code points, not bytes. Use it "
     "when an exact count matters rather than an estimate. The text may be at most 1 MiB of "
     "UTF-8; count a longer one in parts.",
     "{\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\",\"description\":"
     "\"The text to count, at most 1 MiB of UTF-8.\"}},\"required\":[\"text\"],"
     "\"additionalProperties\":false}",
     word_count_args, word_count},
    {"utc_now",
     "Answers the current date and time in UTC as an ISO 8601 timestamp with seconds, for "
     "example 2025-03-14T09:26:53Z. Use it whenever you need today's date or the time now: "
     "what you remember of the date may be out of date. Takes no arguments.",
     "{\"type\":\"object\",\"properties\":{},\"additionalProperties\":false}", utc_now_args,
     utc_now},
};

#define N_TOOLS (sizeof(tools) / sizeof(tools[0]))

/* ---------- running a call ---------- */

/* parse_args turns a call's arguments into an object holding only the tool's argument names
 * (the caller releases it), or NULL with an error result in res. "" is read as {}. */
static json_t *parse_args(const struct tool *t, const char *arguments_json, struct result *res)
{
    size_t n = strlen(arguments_json);
    if (n > ARGS_MAX) {
        set_result(res, true, "The arguments of %s are %zu bytes; at most %d are accepted.",
                   t->name, n, ARGS_MAX);
        return NULL;
    }
    json_error_t jerr;
    json_t *args = json_loads(n ? arguments_json : "{}", JSON_REJECT_DUPLICATES, &jerr);
    if (!args) {
        set_result(res, true,
                   "The arguments of %s are not valid JSON: %s (line %d, column %d). Send one "
                   "JSON object.",
                   t->name, jerr.text, jerr.line, jerr.column);
        return NULL;
    }
    if (!json_is_object(args)) {
        set_result(res, true, "The arguments of %s must be a JSON object; got %s.", t->name,
                   type_name(args));
        json_decref(args);
        return NULL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(args, key, v)
    {
        size_t k = 0;
        while (t->args[k] && strcmp(t->args[k], key) != 0) {
            k++;
        }
        if (!t->args[k]) {
            char names[256] = "";
            for (k = 0; t->args[k]; k++) {
                append_name(names, sizeof(names), t->args[k]);
            }
            set_result(res, true, "%s has no argument '%.*s'; %s%s%s", t->name, shown(key), key,
                       *names ? "its arguments are: " : "it takes none: send {}", names, ".");
            json_decref(args);
            return NULL;
        }
    }
    return args;
}

/* run_call runs one ToolCall into res; every problem with the call is an error result. */
static void run_call(const Cflue__V1__ToolCall *call, struct result *res)
{
    const struct tool *t = NULL;
    for (size_t i = 0; i < N_TOOLS && !t; i++) {
        t = strcmp(tools[i].name, call->name) == 0 ? &tools[i] : NULL;
    }
    if (!t) {
        char names[256] = "";
        for (size_t i = 0; i < N_TOOLS; i++) {
            append_name(names, sizeof(names), tools[i].name);
        }
        set_result(res, true, "There is no tool named '%.*s' on this server. Its tools are: %s.",
                   shown(call->name), call->name, names);
    } else {
        json_t *args = parse_args(t, call->arguments_json, res);
        if (args) {
            t->run(args, res);
            json_decref(args);
        }
    }
    char q_name[NAME_SHOWN + 16], q_id[NAME_SHOWN + 16], q_sb[NAME_SHOWN + 16];
    log_info("tool.call", "tool=%s call=%s sandbox=%s error=%d",
             log_quote(q_name, sizeof(q_name), call->name),
             log_quote(q_id, sizeof(q_id), call->call_id),
             log_quote(q_sb, sizeof(q_sb), call->sandbox), (int)res->is_error);
}

/* fill_result points out at res (which must outlive out). */
static void fill_result(Cflue__V1__ToolResult *out, struct result *res)
{
    cflue__v1__tool_result__init(out);
    out->text = res->text;
    out->is_error = res->is_error;
    out->details_json = res->details;
}

/* ---------- the handlers ---------- */

static void on_list(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    Cflue__V1__ToolSpec specs[N_TOOLS];
    Cflue__V1__ToolSpec *ptrs[N_TOOLS];
    for (size_t i = 0; i < N_TOOLS; i++) {
        cflue__v1__tool_spec__init(&specs[i]);
        specs[i].name = (char *)tools[i].name;
        specs[i].description = (char *)tools[i].description;
        specs[i].parameters_json = (char *)tools[i].parameters_json;
        ptrs[i] = &specs[i];
    }
    Cflue__V1__ListToolsResponse resp = CFLUE__V1__LIST_TOOLS_RESPONSE__INIT;
    resp.tools = ptrs;
    resp.n_tools = N_TOOLS;
    rpc_call_reply(c, &resp.base); /* no working_directory: these tools touch no files */
}

static void on_execute(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    struct result res;
    Cflue__V1__ToolResult out;
    run_call((const Cflue__V1__ToolCall *)msg, &res);
    fill_result(&out, &res);
    rpc_call_reply(c, &out.base);
}

/* on_execute_batch runs the calls in order, sending each result as it is ready. */
static void on_execute_batch(struct rpc_call *c, const ProtobufCMessage *msg, void *user)
{
    const Cflue__V1__ToolBatch *req = (const void *)msg;
    if (req->n_calls > PROTO_BATCH_CALLS_MAX) {
        rpc_call_fail(c, CF_INVALID, "a batch holds at most %d calls; this one has %zu",
                      PROTO_BATCH_CALLS_MAX, req->n_calls);
        return;
    }
    for (size_t i = 0; i < req->n_calls; i++) {
        struct result res;
        Cflue__V1__ToolResult tr;
        Cflue__V1__BatchResult out = CFLUE__V1__BATCH_RESULT__INIT;
        run_call(req->calls[i], &res);
        fill_result(&tr, &res);
        out.index = (int32_t)i;
        out.result = &tr;
        if (!rpc_call_send(c, &out.base)) {
            rpc_call_finish(c, GRPC_STATUS_CANCELLED, "the caller went away");
            return;
        }
    }
    rpc_call_finish(c, GRPC_STATUS_OK, NULL);
}

static const struct rpc_method_def methods[] = {
    {"/cflue.v1.Tools/List", &cflue__v1__list_tools_request__descriptor, on_list, RPC_POOL},
    {"/cflue.v1.Tools/Execute", &cflue__v1__tool_call__descriptor, on_execute, RPC_POOL},
    /* a stream: rpc_call_send may wait for the client, so a thread of its own */
    {"/cflue.v1.Tools/ExecuteBatch", &cflue__v1__tool_batch__descriptor, on_execute_batch,
     RPC_THREAD},
};

static const char usage[] =
    "usage: cflue-example-tools [options]\n\n"
    "An example custom tool server: serves cflue.v1.Tools with word_count and utc_now (see\n"
    "docs/tool-servers.md). Also serves grpc.health.v1. --listen is also read from\n" LISTEN_ENV
    ", which beats CFLUE_LISTEN.";

int main(int argc, char **argv)
{
    struct daemon d = DAEMON_INIT("cflue-example-tools", usage, "127.0.0.1:7200");
    const struct config_opt opts[] = {
        DAEMON_OPT_LISTEN(&d, "address to serve on (host:port or unix:PATH)"),
        DAEMON_OPT_PORT_FILE(&d, "write the bound TCP port here"),
        DAEMON_OPT_GRACE_MS(&d, "how long shutdown waits for calls"),
        DAEMON_OPT_LOG_LEVEL(&d),
    };
    /* Every cflue daemon reads --listen from CFLUE_LISTEN (config.h); this server's own
     * variable wins over it, so that it can run beside a daemon configured through the
     * environment. A flag beats both. Single-threaded here: setenv is safe. */
    const char *own = getenv(LISTEN_ENV);
    if (own && *own && setenv("CFLUE_LISTEN", own, 1) != 0) {
        return daemon_say(&d, 1, "cannot apply %s", LISTEN_ENV);
    }
    int rc = daemon_configure(&d, opts, CONFIG_COUNT(opts), argc, argv);
    if (rc != DAEMON_RUN) {
        return rc;
    }
    rpc_global_init();
    struct rpc_server_opts ro = {.workers = 2, .max_threads = 64, .max_queue = (int)d.max_queue};
    struct rpc_server *srv = rpc_server_new(&ro);
    rpc_server_add_methods(srv, methods, sizeof(methods) / sizeof(methods[0]), NULL);
    if (!daemon_serve(&d, srv)) {
        rpc_global_shutdown();
        return 1;
    }
    log_info("listening", "addr=%s port=%d tools=%zu", d.listen, d.port, N_TOOLS);

    daemon_wait_for_stop(NULL, NULL);
    daemon_stop_serving(&d);
    rpc_global_shutdown();
    log_info("stopped", "code=0");
    return 0;
}
