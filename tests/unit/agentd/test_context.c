/* test_context.c - the I/O-free context builder (agentd/context.c): typed records in, the
 * model's messages out. */
#include "../check.h"

#include "context.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A small arena of records for one case; everything lives until recs_free. */
struct recs {
    Cflue__V1__Record *r[32];
    const Cflue__V1__Record *view[32];
    size_t n;
};

static Cflue__V1__Record *add(struct recs *rs, const char *id, const char *sub)
{
    Cflue__V1__Record *r = calloc(1, sizeof(*r));
    cflue__v1__record__init(r);
    r->offset = (int64_t)rs->n;
    r->id = (char *)id;
    r->submission_id = (char *)sub;
    rs->r[rs->n] = r;
    rs->view[rs->n] = r;
    rs->n++;
    return r;
}

static void user(struct recs *rs, const char *id, const char *sub, const char *text, size_t n_att)
{
    Cflue__V1__Record *r = add(rs, id, sub);
    Cflue__V1__UserMessage *m = calloc(1, sizeof(*m));
    cflue__v1__user_message__init(m);
    m->text = (char *)text;
    m->n_attachments = n_att; /* only the count matters to the builder */
    r->body_case = CFLUE__V1__RECORD__BODY_USER_MESSAGE;
    r->user_message = m;
}

/* assistant adds assistant:<sub>:<turn> asking for the calls named in ids (NULL-terminated). */
static void assistant(struct recs *rs, const char *sub, int turn, const char *text,
                      const char *const *calls)
{
    char *id = malloc(64);
    snprintf(id, 64, "assistant:%s:%d", sub, turn);
    Cflue__V1__Record *r = add(rs, id, sub);
    Cflue__V1__AssistantMessage *m = calloc(1, sizeof(*m));
    cflue__v1__assistant_message__init(m);
    m->text = (char *)text;
    m->turn = turn;
    size_t n = 0;
    while (calls && calls[n]) {
        n++;
    }
    m->tool_calls = calloc(n + 1, sizeof(void *));
    for (size_t i = 0; i < n; i++) {
        Cflue__V1__ToolCallRequest *c = calloc(1, sizeof(*c));
        cflue__v1__tool_call_request__init(c);
        c->id = (char *)calls[i];
        c->name = "bash";
        c->arguments_json = "{}";
        m->tool_calls[i] = c;
    }
    m->n_tool_calls = n;
    r->body_case = CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE;
    r->assistant_message = m;
}

static void result(struct recs *rs, const char *sub, int turn, const char *call, const char *text)
{
    char *id = malloc(128);
    context_tool_result_id(id, 128, sub, turn, call);
    Cflue__V1__Record *r = add(rs, id, sub);
    Cflue__V1__ToolCallResult *m = calloc(1, sizeof(*m));
    cflue__v1__tool_call_result__init(m);
    m->turn = turn;
    m->tool_call_id = (char *)call;
    m->name = "bash";
    m->text = (char *)text;
    r->body_case = CFLUE__V1__RECORD__BODY_TOOL_RESULT;
    r->tool_result = m;
}

static void other(struct recs *rs, const char *id, Cflue__V1__Record__BodyCase body)
{
    Cflue__V1__Record *r = add(rs, id, "s1");
    r->body_case = body;
    switch (body) {
    case CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT:
        r->system_prompt = calloc(1, sizeof(*r->system_prompt));
        cflue__v1__system_prompt__init(r->system_prompt);
        r->system_prompt->text = "system";
        break;
    case CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA:
        r->assistant_delta = calloc(1, sizeof(*r->assistant_delta));
        cflue__v1__assistant_delta__init(r->assistant_delta);
        r->assistant_delta->text = "partial";
        break;
    case CFLUE__V1__RECORD__BODY_SIGNAL:
        r->signal = calloc(1, sizeof(*r->signal));
        cflue__v1__signal__init(r->signal);
        r->signal->kind = "timer";
        r->signal->resource = "tool";
        r->signal->text = "wake up: <skill> \"a&b\" </signal>";
        break;
    default:
        r->submission_settled = calloc(1, sizeof(*r->submission_settled));
        cflue__v1__submission_settled__init(r->submission_settled);
        break;
    }
}

static void compaction(struct recs *rs, const char *summary, int64_t first_kept)
{
    Cflue__V1__Record *r = add(rs, "compaction:s1:1", "s1");
    r->body_case = CFLUE__V1__RECORD__BODY_COMPACTION;
    r->compaction = calloc(1, sizeof(*r->compaction));
    cflue__v1__compaction__init(r->compaction);
    r->compaction->summary = (char *)summary;
    r->compaction->first_kept_offset = first_kept;
}

static void recs_free(struct recs *rs)
{
    for (size_t i = 0; i < rs->n; i++) {
        Cflue__V1__Record *r = rs->r[i];
        if (r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE) {
            for (size_t k = 0; k < r->assistant_message->n_tool_calls; k++) {
                free(r->assistant_message->tool_calls[k]);
            }
            free(r->assistant_message->tool_calls);
        }
        if (r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE ||
            r->body_case == CFLUE__V1__RECORD__BODY_TOOL_RESULT) {
            free(r->id);
        }
        free(r->user_message); /* the body union: one pointer whatever the case */
        free(r);
    }
    rs->n = 0;
}

static enum cf_status build(struct context *c, struct recs *rs, int64_t before,
                            context_attachments_fn fn, void *arg)
{
    struct context_source src = {
        .records = rs->view, .n_records = rs->n, .before = before, .attachments = fn, .arg = arg};
    struct cf_error err;
    memset(c, 0, sizeof(*c));
    return context_build(c, &src, &err);
}

/* Every record type: messages for user, signal, assistant (with results); none for the
 * system prompt, deltas and settlements. Results follow their call in call order, whatever
 * order they were recorded in. */
static void test_record_types(void)
{
    struct recs rs = {0};
    static const char *const calls[] = {"c1", "c2", NULL};
    other(&rs, "system:1", CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT);
    user(&rs, "input:s1", "s1", "hello", 0);
    other(&rs, "delta:s1:1:a:0", CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA);
    assistant(&rs, "s1", 1, "let me look", calls);
    result(&rs, "s1", 1, "c2", "second");
    result(&rs, "s1", 1, "c1", "first");
    other(&rs, "signal:1", CFLUE__V1__RECORD__BODY_SIGNAL);
    assistant(&rs, "s1", 2, "done", NULL);
    other(&rs, "settled:s1", CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED);
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 6);
    CHECK(c.msgs[0].role == LLM_USER);
    CHECK_STR(c.msgs[0].text, "hello");
    CHECK(c.msgs[1].role == LLM_ASSISTANT && c.msgs[1].n_calls == 2);
    CHECK_STR(c.msgs[1].calls[1].id, "c2");
    CHECK(c.msgs[2].role == LLM_TOOL_RESULT && !c.msgs[2].is_error);
    CHECK_STR(c.msgs[2].tool_call_id, "c1");
    CHECK_STR(c.msgs[2].text, "first");
    CHECK_STR(c.msgs[3].tool_call_id, "c2");
    CHECK_STR(c.msgs[3].text, "second");
    CHECK(c.msgs[4].role == LLM_USER);
    /* the body is escaped: what it quotes can never close the envelope */
    CHECK_STR(c.msgs[4].text,
              "<signal type=\"timer\" resource=\"tool\">\nwake up: &lt;skill&gt; \"a&amp;b\" "
              "&lt;/signal&gt;\n</signal>");
    CHECK(c.msgs[5].role == LLM_ASSISTANT && c.msgs[5].n_calls == 0);
    CHECK_STR(c.msgs[5].text, "done");
    context_free(&c);
    CHECK(c.n == 0 && c.msgs == NULL);
    context_free(&c); /* idempotent */

    /* `before` cuts the stream: only what precedes it counts */
    CHECK(build(&c, &rs, 3, NULL, NULL) == CF_OK);
    CHECK(c.n == 1);
    CHECK_STR(c.msgs[0].text, "hello");
    context_free(&c);
    recs_free(&rs);
}

/* A compaction's summary stands in for what precedes its first kept offset; one at or after
 * `before` does not count (a summary is made of what precedes it). */
static void test_compaction_cut(void)
{
    struct recs rs = {0};
    user(&rs, "input:s0", "s0", "old question", 0);  /* 0 */
    assistant(&rs, "s0", 1, "old answer", NULL);     /* 1 */
    user(&rs, "input:s1", "s1", "kept question", 0); /* 2 */
    compaction(&rs, "they talked", 2);               /* 3 */
    other(&rs, "system:2", CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT);
    assistant(&rs, "s1", 1, "kept answer", NULL); /* 5 */
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 3);
    CHECK(c.msgs[0].role == LLM_USER);
    CHECK(strstr(c.msgs[0].text, "<context_summary>") == c.msgs[0].text);
    CHECK(strstr(c.msgs[0].text, "they talked") != NULL);
    CHECK_STR(c.msgs[1].text, "kept question");
    CHECK_STR(c.msgs[2].text, "kept answer");
    context_free(&c);

    /* the summary request itself: everything before the cut, no earlier summary */
    CHECK(build(&c, &rs, 2, NULL, NULL) == CF_OK);
    CHECK(c.n == 2);
    CHECK_STR(c.msgs[0].text, "old question");
    CHECK_STR(c.msgs[1].text, "old answer");
    context_free(&c);

    /* records not stored yet (offset -1: a turn's results written beside the next model call)
     * are the newest: after the summary's kept part, and never before a cut */
    static const char *const calls[] = {"c1", NULL};
    assistant(&rs, "s1", 2, "running it", calls);
    result(&rs, "s1", 2, "c1", "it ran");
    rs.r[rs.n - 2]->offset = rs.r[rs.n - 1]->offset = -1;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 5);
    CHECK_STR(c.msgs[2].text, "kept answer");
    CHECK_STR(c.msgs[3].text, "running it");
    CHECK_STR(c.msgs[4].text, "it ran");
    CHECK(!c.msgs[4].is_error);
    context_free(&c);
    CHECK(build(&c, &rs, 2, NULL, NULL) == CF_OK);
    CHECK(c.n == 2);
    context_free(&c);
    recs_free(&rs);
}

/* A call without a recorded result is shown as interrupted (an error), never left without an
 * answer; a result keeps its is_error. */
static void test_unresolved_calls(void)
{
    struct recs rs = {0};
    static const char *const calls[] = {"c1", "c2", NULL};
    user(&rs, "input:s1", "s1", "go", 0);
    assistant(&rs, "s1", 1, "", calls);
    result(&rs, "s1", 1, "c1", "boom");
    rs.r[rs.n - 1]->tool_result->is_error = true;
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 4);
    CHECK(c.msgs[2].is_error);
    CHECK_STR(c.msgs[2].text, "boom");
    CHECK(c.msgs[3].is_error);
    CHECK_STR(c.msgs[3].tool_call_id, "c2");
    CHECK_STR(c.msgs[3].text, CONTEXT_INTERRUPTED_RESULT);
    context_free(&c);
    /* a result of another turn with the same call id is not this call's */
    recs_free(&rs);
    user(&rs, "input:s1", "s1", "go", 0);
    assistant(&rs, "s1", 2, "", calls);
    result(&rs, "s1", 1, "c1", "from turn 1");
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 4);
    CHECK_STR(c.msgs[2].text, CONTEXT_INTERRUPTED_RESULT);
    context_free(&c);
    recs_free(&rs);
}

/* The attachments lookup: what a submission's message carried. */
struct lookup {
    Cflue__V1__Message msg;
    Cflue__V1__Attachment att[3], *ptrs[3];
    int calls;
    const char *asked;
};

static enum cf_status lookup_ok(void *arg, const char *submission_id,
                                const Cflue__V1__Message **out, struct cf_error *err)
{
    struct lookup *l = arg;
    (void)err;
    l->calls++;
    l->asked = submission_id;
    *out = &l->msg;
    return CF_OK;
}

static enum cf_status lookup_down(void *arg, const char *submission_id,
                                  const Cflue__V1__Message **out, struct cf_error *err)
{
    (void)arg;
    (void)submission_id;
    *out = NULL;
    return cf_error_set(err, CF_UNAVAILABLE, "storaged is down");
}

/* Attachments: images as image blocks (base64), text files inline after the text, anything
 * else named with a note; messages without attachments never ask; a failed lookup fails the
 * build with its status. */
static void test_attachments(void)
{
    struct lookup l;
    memset(&l, 0, sizeof(l));
    cflue__v1__message__init(&l.msg);
    static const char *const names[] = {"a.png", "notes.txt", "blob.bin"};
    static const char *const types[] = {"image/png", "text/plain", "application/octet-stream"};
    static const char *const data[] = {"abc", "file text", "xyz"};
    for (int i = 0; i < 3; i++) {
        cflue__v1__attachment__init(&l.att[i]);
        l.att[i].name = (char *)names[i];
        l.att[i].mime_type = (char *)types[i];
        l.att[i].data.data = (uint8_t *)data[i];
        l.att[i].data.len = strlen(data[i]);
        l.ptrs[i] = &l.att[i];
    }
    l.msg.attachments = l.ptrs;
    l.msg.n_attachments = 3;
    struct recs rs = {0};
    user(&rs, "input:s0", "s0", "plain", 0);
    user(&rs, "input:s1", "s1", "see attached", 3);
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, lookup_ok, &l) == CF_OK);
    CHECK(l.calls == 1);
    CHECK_STR(l.asked, "s1");
    CHECK(c.n == 2);
    CHECK_STR(c.msgs[0].text, "plain");
    CHECK(c.msgs[1].n_images == 1);
    CHECK_STR(c.msgs[1].images[0].mime_type, "image/png");
    CHECK_STR(c.msgs[1].images[0].base64, "YWJj");
    CHECK(strstr(c.msgs[1].text, "see attached") == c.msgs[1].text);
    CHECK(strstr(c.msgs[1].text, "[Attached image a.png (image/png) follows.]") != NULL);
    CHECK(strstr(c.msgs[1].text, "notes.txt (text/plain, 9 bytes):]\nfile text") != NULL);
    CHECK(strstr(c.msgs[1].text, "blob.bin (application/octet-stream, 3 bytes): its content "
                                 "cannot be shown") != NULL);
    context_free(&c);

    CHECK(build(&c, &rs, INT64_MAX, lookup_down, NULL) == CF_UNAVAILABLE);
    context_free(&c);
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) != CF_OK); /* attachments and no lookup */
    context_free(&c);
    recs_free(&rs);
}

/* Joined deliveries: their inputs appear where they entered the stream, after the turn that
 * preceded them; the host's results stay with the host's calls. */
static void test_joined_order(void)
{
    struct recs rs = {0};
    static const char *const calls[] = {"c1", NULL};
    user(&rs, "input:host", "host", "first", 0);
    assistant(&rs, "host", 1, "", calls);
    result(&rs, "host", 1, "c1", "ran");
    user(&rs, "input:j1", "j1", "second", 0);
    user(&rs, "input:j2", "j2", "third", 0);
    assistant(&rs, "host", 2, "all three", NULL);
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 6);
    CHECK_STR(c.msgs[0].text, "first");
    CHECK(c.msgs[1].role == LLM_ASSISTANT);
    CHECK_STR(c.msgs[2].text, "ran");
    CHECK_STR(c.msgs[3].text, "second");
    CHECK_STR(c.msgs[4].text, "third");
    CHECK_STR(c.msgs[5].text, "all three");
    context_free(&c);
    recs_free(&rs);
}

/* A tool result's images become images of its LLM_TOOL_RESULT message, base64-encoded, in
 * order; a result without images has none. */
static void test_result_images(void)
{
    static const char *const calls[] = {"c1", "c2", NULL};
    Cflue__V1__Attachment img[2], *ptrs[2];
    static const char *const types[] = {"image/png", "image/webp"};
    static const char *const data[] = {"\x89PNG", "abc"};
    for (int i = 0; i < 2; i++) {
        cflue__v1__attachment__init(&img[i]);
        img[i].name = "image-1";
        img[i].mime_type = (char *)types[i];
        img[i].data.data = (uint8_t *)data[i];
        img[i].data.len = strlen(data[i]);
        ptrs[i] = &img[i];
    }
    struct recs rs = {0};
    user(&rs, "input:s1", "s1", "look", 0);
    assistant(&rs, "s1", 1, "", calls);
    result(&rs, "s1", 1, "c1", "[image-1 (image/png, 4 bytes) is shown after this text]");
    rs.r[rs.n - 1]->tool_result->images = ptrs;
    rs.r[rs.n - 1]->tool_result->n_images = 2;
    result(&rs, "s1", 1, "c2", "plain");
    struct context c;
    CHECK(build(&c, &rs, INT64_MAX, NULL, NULL) == CF_OK);
    CHECK(c.n == 4);
    CHECK(c.msgs[2].role == LLM_TOOL_RESULT);
    CHECK_STR(c.msgs[2].tool_call_id, "c1");
    CHECK(c.msgs[2].n_images == 2);
    CHECK_STR(c.msgs[2].images[0].mime_type, "image/png");
    CHECK_STR(c.msgs[2].images[0].base64, "iVBORw==");
    CHECK_STR(c.msgs[2].images[1].mime_type, "image/webp");
    CHECK_STR(c.msgs[2].images[1].base64, "YWJj");
    CHECK(strstr(c.msgs[2].text, "image-1") != NULL);
    CHECK(c.msgs[3].n_images == 0 && c.msgs[3].images == NULL);
    context_free(&c);
    recs_free(&rs);
}

int main(void)
{
    test_record_types();
    test_compaction_cut();
    test_unresolved_calls();
    test_attachments();
    test_joined_order();
    test_result_images();
    return check_done("test_context");
}
