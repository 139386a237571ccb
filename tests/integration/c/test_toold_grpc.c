/* test_toold_grpc - drives a real toold process over gRPC with cflue's own C client.
 *
 * usage: test_toold_grpc PATH-TO-TOOLD
 */
#include "../../unit/check.h"

#include "clock.h"
#include "rpc.h"

#include "cflue/v1/sandbox.pb-c.h"
#include "cflue/v1/tools.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static struct rpc_channel *ch;

static Cflue__V1__ToolResult *call(const char *name, const char *args)
{
    Cflue__V1__ToolCall c = CFLUE__V1__TOOL_CALL__INIT;
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    c.sandbox = "grpc-c";
    c.call_id = "t";
    c.name = (char *)name;
    c.arguments_json = (char *)args;
    if (!rpc_unary(ch, "/cflue.v1.Tools/Execute", &c.base, &cflue__v1__tool_result__descriptor,
                   30000, &resp, &st)) {
        fprintf(stderr, "Execute %s failed: %d %s\n", name, (int)st.code, st.details);
        return NULL;
    }
    return (Cflue__V1__ToolResult *)resp;
}

static bool text_is(const char *name, const char *args, const char *want, bool is_error)
{
    Cflue__V1__ToolResult *r = call(name, args);
    bool ok = r && r->is_error == is_error && (!want || !strcmp(r->text, want));
    if (r && !ok) {
        fprintf(stderr, "%s %s -> [%s] error=%d\n", name, args, r->text, (int)r->is_error);
    }
    if (r) {
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    return ok;
}

static bool contains(const char *name, const char *args, const char *needle, bool is_error)
{
    Cflue__V1__ToolResult *r = call(name, args);
    bool ok = r && r->is_error == is_error && strstr(r->text, needle);
    if (r && !ok) {
        fprintf(stderr, "%s %s -> [%s] error=%d\n", name, args, r->text, (int)r->is_error);
    }
    if (r) {
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    return ok;
}

int main(int argc, char **argv)
{
    char dir[] = "/tmp/cflue-toold-grpc-XXXXXX", sock[128], addr[160], root[128];
    if (argc < 2 || !mkdtemp(dir)) {
        fprintf(stderr, "usage: test_toold_grpc TOOLD\n");
        return 2;
    }
    snprintf(sock, sizeof(sock), "%s/t.sock", dir);
    snprintf(addr, sizeof(addr), "unix:%s", sock);
    snprintf(root, sizeof(root), "%s/ws", dir);
    char *args[] = {argv[1],       "--listen", addr,           "--root", root,
                    "--log-level", "warn",     "--spill-keep", "2",      NULL};
    pid_t pid;
    CHECK(posix_spawn(&pid, argv[1], NULL, NULL, args, environ) == 0);
    rpc_global_init();
    ch = rpc_channel_new(addr, 64 << 20);
    bool up = false;
    for (int i = 0; i < 100 && !up; i++) {
        Grpc__Health__V1__HealthCheckRequest h = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        ProtobufCMessage *resp = NULL;
        struct rpc_status st;
        up = rpc_unary(ch, "/grpc.health.v1.Health/Check", &h.base,
                       &grpc__health__v1__health_check_response__descriptor, 1000, &resp, &st);
        if (resp) {
            protobuf_c_message_free_unpacked(resp, NULL);
        }
        if (!up) {
            clock_sleep_ms(100);
        }
    }
    CHECK(up);

    Cflue__V1__ListToolsRequest lr = CFLUE__V1__LIST_TOOLS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    struct rpc_status st;
    lr.sandbox = "grpc-c";
    CHECK(rpc_unary(ch, "/cflue.v1.Tools/List", &lr.base,
                    &cflue__v1__list_tools_response__descriptor, 5000, &resp, &st));
    if (resp) {
        Cflue__V1__ListToolsResponse *l = (Cflue__V1__ListToolsResponse *)resp;
        const char *order[] = {"read", "write", "edit", "bash", "grep", "glob"};
        CHECK(l->n_tools == 6);
        for (size_t i = 0; i < l->n_tools && i < 6; i++) {
            CHECK_STR(l->tools[i]->name, order[i]);
        }
        CHECK(strstr(l->working_directory, "/ws/grpc-c") != NULL);
        protobuf_c_message_free_unpacked(resp, NULL);
    }

    CHECK(text_is("write", "{\"path\":\"src/a.txt\",\"content\":\"one\\ntwo\\n\"}",
                  "Wrote 8 bytes to src/a.txt.", false));
    CHECK(text_is("read", "{\"path\":\"src/a.txt\"}", "one\ntwo", false));
    CHECK(text_is("read", "{\"path\":\"src/a.txt\",\"limit\":1}",
                  "one\n\n[Showing lines 1-1 of 2. Use offset=2 to continue.]", false));
    CHECK(text_is("edit", "{\"path\":\"src/a.txt\",\"oldText\":\"two\",\"newText\":\"2\"}",
                  "Edited src/a.txt: replaced 1 occurrence.", false));
    CHECK(text_is("bash", "{\"command\":\"cat src/a.txt; exit 3\"}", "one\n2\n\n[Exit code 3]",
                  false));
    CHECK(text_is("grep", "{\"pattern\":\"^o\"}", "src/a.txt:1:one", false));
    CHECK(text_is("glob", "{\"pattern\":\"*.txt\"}", "src/a.txt", false));
    CHECK(contains("read", "{\"path\":\"../../etc/passwd\"}", "outside the sandbox", true));
    CHECK(contains("bash", "{\"command\":\"sleep 5\",\"timeout\":0.2}", "Exit code 124", false));
    CHECK(contains("nope", "{}", "no tool named 'nope'", true));
    CHECK(contains("read", "{\"path\":", "not valid JSON", true));

    /* 20 edits of one file in one batch, each on its own line: all applied */
    char content[512] = "";
    for (int i = 0; i < 20; i++) {
        char line[16];
        snprintf(line, sizeof(line), "line%02d\n", i);
        strcat(content, line);
    }
    Cflue__V1__WriteFileRequest wf = CFLUE__V1__WRITE_FILE_REQUEST__INIT;
    wf.sandbox = "grpc-c";
    wf.path = "many.txt";
    wf.data.data = (uint8_t *)content;
    wf.data.len = strlen(content);
    CHECK(rpc_unary(ch, "/cflue.v1.Sandbox/WriteFile", &wf.base,
                    &cflue__v1__write_file_response__descriptor, 5000, &resp, &st));
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    Cflue__V1__ToolCall calls[20], *ptrs[20];
    char eargs[20][128];
    for (int i = 0; i < 20; i++) {
        cflue__v1__tool_call__init(&calls[i]);
        snprintf(eargs[i], sizeof(eargs[i]),
                 "{\"path\":\"many.txt\",\"oldText\":\"line%02d\\n\",\"newText\":\"LINE%02d\\n\"}",
                 i, i);
        calls[i].sandbox = "grpc-c";
        calls[i].name = "edit";
        calls[i].arguments_json = eargs[i];
        ptrs[i] = &calls[i];
    }
    Cflue__V1__ToolBatch batch = CFLUE__V1__TOOL_BATCH__INIT;
    batch.calls = ptrs;
    batch.n_calls = 20;
    struct rpc_stream *s = rpc_stream_open(ch, "/cflue.v1.Tools/ExecuteBatch", &batch.base, 30000);
    ProtobufCMessage *m;
    int results = 0, errors = 0;
    while (rpc_stream_read(s, &cflue__v1__batch_result__descriptor, &m) == 1) {
        results++;
        errors += ((Cflue__V1__BatchResult *)m)->result->is_error;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    CHECK(rpc_stream_finish(s, &st));
    CHECK(results == 20 && errors == 0);
    Cflue__V1__ReadFileRequest rf = CFLUE__V1__READ_FILE_REQUEST__INIT;
    rf.sandbox = "grpc-c";
    rf.path = "many.txt";
    CHECK(rpc_unary(ch, "/cflue.v1.Sandbox/ReadFile", &rf.base,
                    &cflue__v1__read_file_response__descriptor, 5000, &resp, &st));
    if (resp) {
        Cflue__V1__ReadFileResponse *f = (Cflue__V1__ReadFileResponse *)resp;
        CHECK(f->data.len == strlen(content));
        CHECK(f->data.len && !memchr(f->data.data, 'l', f->data.len)); /* no lowercase line left */
        protobuf_c_message_free_unpacked(resp, NULL);
    }

    /* spill files: only the newest --spill-keep remain, and the newest is the last one named */
    char last_spill[256] = "";
    for (int i = 0; i < 4; i++) {
        Cflue__V1__ToolResult *r = call("bash", "{\"command\":\"seq 1 3000\"}");
        CHECK(r && r->truncation && r->truncation->truncated);
        if (r) {
            const char *p = strstr(r->text, ".cflue/spill/");
            const char *end = p ? strchr(p, ' ') : NULL;
            if (p && end) {
                snprintf(last_spill, sizeof(last_spill), "%.*s", (int)(end - p), p);
            }
            protobuf_c_message_free_unpacked(&r->base, NULL);
        }
    }
    Cflue__V1__ReadDirRequest dr = CFLUE__V1__READ_DIR_REQUEST__INIT;
    dr.sandbox = "grpc-c";
    dr.path = ".cflue/spill";
    CHECK(rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &dr.base,
                    &cflue__v1__read_dir_response__descriptor, 5000, &resp, &st));
    if (resp) {
        Cflue__V1__ReadDirResponse *d = (Cflue__V1__ReadDirResponse *)resp;
        CHECK(d->n_entries == 2);
        CHECK(d->n_entries == 2 && strstr(last_spill, d->entries[1]->name) != NULL);
        CHECK(d->n_entries == 2 && d->entries[1]->type == CFLUE__V1__FILE_TYPE__FILE_TYPE_REGULAR &&
              d->entries[1]->modify_time && d->entries[1]->modify_time->seconds > 0);
        CHECK_STR(d->next_page_token, "");
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    /* one entry a page: two pages, the token of one directory refused for another */
    char token[1024] = "";
    dr.page_size = 1;
    CHECK(rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &dr.base,
                    &cflue__v1__read_dir_response__descriptor, 5000, &resp, &st));
    if (resp) {
        Cflue__V1__ReadDirResponse *d = (Cflue__V1__ReadDirResponse *)resp;
        CHECK(d->n_entries == 1 && *d->next_page_token);
        snprintf(token, sizeof(token), "%s", d->next_page_token);
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    dr.page_token = token;
    CHECK(rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &dr.base,
                    &cflue__v1__read_dir_response__descriptor, 5000, &resp, &st));
    if (resp) {
        Cflue__V1__ReadDirResponse *d = (Cflue__V1__ReadDirResponse *)resp;
        CHECK(d->n_entries == 1 && !strcmp(d->next_page_token, ""));
        CHECK(d->n_entries == 1 && strstr(last_spill, d->entries[0]->name) != NULL);
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    dr.path = ".cflue";
    CHECK(!rpc_unary(ch, "/cflue.v1.Sandbox/ReadDir", &dr.base,
                     &cflue__v1__read_dir_response__descriptor, 5000, &resp, &st));
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR(st.reason, "INVALID_PAGE_TOKEN");

    /* a bad sandbox name is a gRPC error, not a result */
    Cflue__V1__ToolCall bad = CFLUE__V1__TOOL_CALL__INIT;
    bad.sandbox = "..";
    bad.name = "read";
    bad.arguments_json = "{\"path\":\"x\"}";
    CHECK(!rpc_unary(ch, "/cflue.v1.Tools/Execute", &bad.base, &cflue__v1__tool_result__descriptor,
                     5000, &resp, &st));
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT);
    CHECK_STR(st.reason, "INVALID_SANDBOX_NAME");

    /* a negative timeout is refused before the call runs */
    Google__Protobuf__Duration neg = GOOGLE__PROTOBUF__DURATION__INIT;
    neg.seconds = -1;
    bad.sandbox = "grpc-c";
    bad.timeout = &neg;
    CHECK(!rpc_unary(ch, "/cflue.v1.Tools/Execute", &bad.base, &cflue__v1__tool_result__descriptor,
                     5000, &resp, &st));
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT);

    rpc_channel_free(ch);
    rpc_global_shutdown();
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return check_done("test_toold_grpc");
}
