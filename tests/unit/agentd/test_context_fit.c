/* test_context_fit.c - the size of a request and making it fit (agentd/context_fit.c): the
 * estimate (images at a fixed count), the compaction's cut (later when the kept part is too
 * big), and the request shortened in its largest texts. */
#include "../check.h"

#include "context.h"
#include "utf8.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Records for one case; everything lives until recs_free. */
struct recs {
    Cflue__V1__Record *r[16];
    const Cflue__V1__Record *view[16];
    size_t n;
};

static Cflue__V1__Record *add(struct recs *rs, Cflue__V1__Record__BodyCase body)
{
    Cflue__V1__Record *r = calloc(1, sizeof(*r));
    cflue__v1__record__init(r);
    r->offset = (int64_t)rs->n;
    r->id = "";
    r->submission_id = "s1";
    r->body_case = body;
    rs->r[rs->n] = r;
    rs->view[rs->n] = r;
    rs->n++;
    return r;
}

static void user(struct recs *rs, const char *text)
{
    Cflue__V1__UserMessage *m = calloc(1, sizeof(*m));
    cflue__v1__user_message__init(m);
    m->text = (char *)text;
    add(rs, CFLUE__V1__RECORD__BODY_USER_MESSAGE)->user_message = m;
}

static void assistant(struct recs *rs, const char *text)
{
    Cflue__V1__AssistantMessage *m = calloc(1, sizeof(*m));
    cflue__v1__assistant_message__init(m);
    m->text = (char *)text;
    add(rs, CFLUE__V1__RECORD__BODY_ASSISTANT_MESSAGE)->assistant_message = m;
}

static void result(struct recs *rs, const char *text)
{
    Cflue__V1__ToolCallResult *m = calloc(1, sizeof(*m));
    cflue__v1__tool_call_result__init(m);
    m->text = (char *)text;
    add(rs, CFLUE__V1__RECORD__BODY_TOOL_RESULT)->tool_result = m;
}

static void recs_free(struct recs *rs)
{
    for (size_t i = 0; i < rs->n; i++) {
        free(rs->r[i]->user_message); /* the body union: one pointer whatever the case */
        free(rs->r[i]);
    }
    rs->n = 0;
}

/* filled returns n bytes of s repeated (heap). */
static char *filled(const char *s, size_t n)
{
    char *out = malloc(n + 1);
    size_t k = strlen(s);
    for (size_t i = 0; i < n; i++) {
        out[i] = s[i % k];
    }
    out[n] = 0;
    return out;
}

/* images returns n images on the heap (context_free frees a message's array). */
static struct llm_image *images(size_t n)
{
    struct llm_image *im = calloc(n, sizeof(*im));
    for (size_t i = 0; i < n; i++) {
        im[i].mime_type = "image/png";
        im[i].base64 = "AAAA";
    }
    return im;
}

/* Images count CONTEXT_IMAGE_TOKENS each, in a context and in the records, whatever their
 * bytes; attached text files count up to the 64 KiB the context shows. */
static void test_image_estimate(void)
{
    struct context c = {0};
    struct llm_message *m = context_push(&c);
    m->role = LLM_USER;
    m->text = "0123456789012345"; /* 16 characters, and 16 of framing: 8 tokens */
    CHECK(context_tokens(NULL, &c, NULL, 0) == 8);
    m->images = images(3);
    m->n_images = 3;
    CHECK(context_tokens(NULL, &c, NULL, 0) == 8 + 3 * CONTEXT_IMAGE_TOKENS);
    struct llm_tool tool = {.name = "t", .description = "abcd", .schema_json = "{}  "};
    CHECK(context_tokens("12345678", &c, &tool, 1) == 8 + 2 + 2 + 3 * CONTEXT_IMAGE_TOKENS);
    CHECK(context_tokens("12345678", NULL, &tool, 1) == 4);
    m->n_images = 0;
    context_free(&c);

    /* a tool result's two 1 MiB images: 2 x CONTEXT_IMAGE_TOKENS, not half a million */
    struct recs rs = {0};
    result(&rs, "see the images");
    Cflue__V1__Attachment a[2], *ap[2] = {&a[0], &a[1]};
    uint8_t *bytes = calloc(1, 1 << 20);
    for (int i = 0; i < 2; i++) {
        cflue__v1__attachment__init(&a[i]);
        a[i].name = "image-1";
        a[i].mime_type = "image/png";
        a[i].data.data = bytes;
        a[i].data.len = 1 << 20;
    }
    rs.r[0]->tool_result->images = ap;
    rs.r[0]->tool_result->n_images = 2;
    int64_t t = context_record_tokens(rs.r[0]);
    CHECK(t >= 2 * CONTEXT_IMAGE_TOKENS && t < 2 * CONTEXT_IMAGE_TOKENS + 50);
    /* a user message: an image reference at CONTEXT_IMAGE_TOKENS, a 1 MiB text file at
     * 64 KiB / 4 tokens, a PDF (only a note) at nothing more than its reference */
    user(&rs, "look");
    Cflue__V1__AttachmentRef refs[3], *rp[3] = {&refs[0], &refs[1], &refs[2]};
    const char *types[3] = {"image/jpeg", "text/plain", "application/pdf"};
    for (int i = 0; i < 3; i++) {
        cflue__v1__attachment_ref__init(&refs[i]);
        refs[i].name = "f";
        refs[i].mime_type = (char *)types[i];
        refs[i].size_bytes = 1 << 20;
    }
    rs.r[1]->user_message->attachments = rp;
    rs.r[1]->user_message->n_attachments = 3;
    t = context_record_tokens(rs.r[1]);
    int64_t want = CONTEXT_IMAGE_TOKENS + CONTEXT_ATTACHMENT_TEXT_MAX / 4;
    CHECK(t >= want && t < want + 50);
    /* records the context does not hold as messages count nothing */
    add(&rs, CFLUE__V1__RECORD__BODY_SUBMISSION_SETTLED);
    CHECK(context_record_tokens(rs.r[2]) == 0);
    free(bytes);
    recs_free(&rs);
}

/* The cut: the usual one while the kept part fits; later when one turn is too big to keep
 * (down to the newest turn); -1 when nothing is older than what must be kept. */
static void test_cut(void)
{
    char *big = filled("1\n2\n3\n", 40000); /* about 10,000 tokens */
    struct recs rs = {0};
    user(&rs, "hello");             /* 0 */
    assistant(&rs, "hi");           /* 1 */
    user(&rs, "print a long list"); /* 2 */
    assistant(&rs, "");             /* 3: asks for the list */
    result(&rs, big);               /* 4 */
    int64_t tail;
    struct context_cut_rule rule = {.first = -1, .keep = 50, .budget = 1000};
    /* the newest turn alone does not fit: the cut is before it, the newest boundary */
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == 3);
    CHECK(tail >= 10000);
    /* once cut there, nothing older is left: -1, and the kept part said to be too big */
    rule.first = 3;
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == -1);
    CHECK(tail > rule.budget);
    /* an answer after it: the cut moves past the oversized turn (before, -1 forever) */
    assistant(&rs, "Listed."); /* 5 */
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == 5);
    CHECK(tail < 20);
    user(&rs, "what now?"); /* 6 */
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == 5);
    /* a budget that holds it all: the usual cut, keep's */
    rule.first = -1;
    rule.budget = 1000000;
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == 3);
    /* a short conversation: nothing to compact, unless the provider refused it */
    rule.keep = 100000;
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == -1);
    CHECK(tail < rule.budget);
    rule.forced = true;
    CHECK(context_choose_cut(rs.view, rs.n, &rule, &tail) == 6);
    recs_free(&rs);
    free(big);
}

/* check_cut: text was cut to a head and tail of the original with the note between them. */
static void check_cut(const char *text, const char *original)
{
    const char *note = strstr(text, "[... ");
    CHECK(note != NULL && strstr(text, " bytes left out here so that the request fits") != NULL);
    if (!note) {
        return;
    }
    size_t left_out = strtoul(note + 5, NULL, 10), len = strlen(text), orig = strlen(original);
    CHECK(!strncmp(text, original, 64));                   /* its head */
    CHECK(!strcmp(text + len - 64, original + orig - 64)); /* its tail */
    CHECK(len - (size_t)(strstr(note, "]\n\n") + 3 - text) + (size_t)(note - 2 - text) + left_out ==
          orig); /* the bytes kept and left out add up */
}

/* The largest tool result is cut first, in the request only; a fitting request is left
 * alone. */
static void test_fit_tool_result(void)
{
    char *big = filled("0123456789abcdef\n", 40000), *old = filled("older words ", 6000);
    struct context c = {0};
    struct llm_message *m = context_push(&c);
    m->role = LLM_USER;
    m->text = old;
    m = context_push(&c);
    m->role = LLM_ASSISTANT;
    m = context_push(&c);
    m->role = LLM_TOOL_RESULT;
    m->text = big;
    m = context_push(&c);
    m->role = LLM_USER;
    m->text = "what now?";
    int64_t before = context_tokens("system", &c, NULL, 0);
    CHECK(context_fit(&c, "system", NULL, 0, before) == 0);
    CHECK(c.msgs[2].text == big);
    CHECK(context_fit(&c, "system", NULL, 0, 4000) == 1);
    CHECK(context_tokens("system", &c, NULL, 0) <= 4000);
    CHECK(context_tokens("system", &c, NULL, 0) > 3900); /* no more cut than needed */
    CHECK(c.msgs[0].text == old);                        /* older texts only if needed */
    CHECK(strlen(big) == 40000);                         /* the source is untouched */
    check_cut(c.msgs[2].text, big);
    /* then the older user text; the newest message is kept */
    CHECK(context_fit(&c, "system", NULL, 0, 600) == 2);
    CHECK(context_tokens("system", &c, NULL, 0) <= 600);
    check_cut(c.msgs[0].text, old);
    CHECK(strlen(c.msgs[2].text) < CONTEXT_FIT_KEEP_MIN + 160);
    CHECK_STR(c.msgs[3].text, "what now?");
    context_free(&c);
    free(big);
    free(old);
}

/* Images go (oldest first) before the newest user text is cut; that is cut last, and a cut
 * never splits a UTF-8 sequence. */
static void test_fit_images_and_newest(void)
{
    char *huge = filled("\xc3\xa9t\xc3\xa9 ", 60000); /* "été " */
    struct context c = {0};
    struct llm_message *m = context_push(&c);
    m->role = LLM_TOOL_RESULT;
    m->text = "two images";
    m->images = images(2);
    m->n_images = 2;
    m = context_push(&c);
    m->role = LLM_USER;
    m->text = huge;
    CHECK(context_fit(&c, NULL, NULL, 0, 16000) == 2);
    CHECK(c.msgs[0].n_images == 0 && strstr(c.msgs[0].text, "[2 images left out here") != NULL);
    CHECK(c.msgs[1].text == huge);
    CHECK(context_fit(&c, NULL, NULL, 0, 2000) == 1);
    CHECK(context_tokens(NULL, &c, NULL, 0) <= 2000);
    CHECK(utf8_valid(c.msgs[1].text, strlen(c.msgs[1].text), NULL));
    check_cut(c.msgs[1].text, huge);
    context_free(&c);
    free(huge);
}

/* The summary's request: one user message, a transcript of who said what, each call and its
 * result (a long one cut at 2,000 bytes, saying how much is not shown), images as notes, then
 * the ask; nothing of the messages' own left to free twice. */
static void test_transcript(void)
{
    struct context c = {0};
    struct llm_message *m = context_push(&c);
    m->role = LLM_USER;
    m->text = "fix it";
    m->images = images(2);
    m->n_images = 2;
    struct llm_call *call = calloc(1, sizeof(*call));
    call->name = "bash";
    call->arguments_json = "{\"command\":\"make\"}";
    m = context_push(&c);
    m->role = LLM_ASSISTANT;
    m->text = "";
    m->calls = call;
    m->n_calls = 1;
    char *long_result = malloc(5001);
    memset(long_result, 'r', 5000);
    long_result[5000] = '\0';
    m = context_push(&c);
    m->role = LLM_TOOL_RESULT;
    m->tool_name = "bash";
    m->is_error = true;
    m->text = long_result;
    context_transcript(&c, "Summarize.");
    CHECK(c.n == 1 && c.msgs[0].role == LLM_USER && !c.msgs[0].n_images && !c.msgs[0].n_calls);
    const char *t = c.msgs[0].text;
    CHECK(strstr(t, "<conversation>\nUser: fix it [2 images]\n\n") != NULL);
    CHECK(strstr(t, "\n\nAssistant called bash with {\"command\":\"make\"}\n\n") != NULL);
    CHECK(strstr(t, "Result of bash (an error): rrr") != NULL);
    CHECK(strstr(t, " [3000 more bytes of this result are not shown]") != NULL);
    CHECK(strstr(t, "r r") == NULL && strlen(t) < 2300);
    CHECK(strstr(t, "</conversation>\n\nSummarize.") != NULL);
    context_free(&c);
    free(long_result);
}

int main(void)
{
    test_transcript();
    test_image_estimate();
    test_cut();
    test_fit_tool_result();
    test_fit_images_and_newest();
    return check_done("test_context_fit");
}
