/* Unit tests of storaged/ledger.c and db.c on a real SQLite file, without gRPC. */
#include "../check.h"

#include "clock.h"
#include "db.h"
#include "ledger.h"
#include "page_token.h"
#include "pbtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static sqlite3 *db;
static struct arena arena;
static struct ledger_config cfg = {.lease_ms = 30000, .timeout_ms = 3600000, .max_attempts = 10};

static struct ledger_ctx ctx(void)
{
    struct ledger_ctx c = {.db = db, .arena = &arena, .cfg = &cfg, .now = clock_now_ms()};
    return c;
}

static Cflue__V1__Submission *admit(const char *conv, const char *text, const char *key)
{
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    msg.text = (char *)text;
    req.agent = "assistant";
    req.conversation_id = (char *)conv;
    req.idempotency_key = (char *)key;
    req.message = &msg;
    enum cf_status st = ledger_admit(&c, &req, &out, &err);
    return st == CF_OK ? out.submission : NULL;
}

static Cflue__V1__ClaimResponse claim(const char *owner, int64_t lease)
{
    Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
    Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    Google__Protobuf__Duration d = GOOGLE__PROTOBUF__DURATION__INIT;
    pbdur_set(&d, lease);
    req.owner_id = (char *)owner;
    req.lease_duration = &d;
    CHECK(ledger_claim(&c, &req, &out, &err) == CF_OK);
    return out;
}

static enum cf_status settle(const Cflue__V1__Fence *f, Cflue__V1__Outcome o, const char *error,
                             Cflue__V1__SettleResponse *out)
{
    Cflue__V1__SettleRequest req = CFLUE__V1__SETTLE_REQUEST__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    cflue__v1__settle_response__init(out);
    req.fence = (Cflue__V1__Fence *)f;
    req.outcome = o;
    req.error = (char *)error;
    return ledger_settle(&c, &req, out, &err);
}

/* append_one appends a Signal "note" with text body; *err_out (if given) gets the error. */
static enum cf_status append_err(const Cflue__V1__Fence *f, const char *id, const char *body,
                                 struct cf_error *err)
{
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    Cflue__V1__AppendResponse out = CFLUE__V1__APPEND_RESPONSE__INIT;
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__Signal sig = CFLUE__V1__SIGNAL__INIT;
    Cflue__V1__Record *recs[1] = {&rec};
    struct ledger_ctx c = ctx();
    rec.id = (char *)id;
    sig.kind = "note";
    sig.text = (char *)body;
    rec.body_case = CFLUE__V1__RECORD__BODY_SIGNAL;
    rec.signal = &sig;
    req.fence = (Cflue__V1__Fence *)f;
    req.records = recs;
    req.n_records = 1;
    return ledger_append(&c, &req, &out, err);
}

static enum cf_status append_one(const Cflue__V1__Fence *f, const char *id, const char *body)
{
    struct cf_error err;
    return append_err(f, id, body, &err);
}

static void test_fifo_and_fencing(void)
{
    Cflue__V1__Submission *a = admit("c1", "first", "");
    Cflue__V1__Submission *b = admit("c1", "second", "");
    Cflue__V1__Submission *other = admit("c2", "elsewhere", "");
    CHECK(a && b && other);
    CHECK(a->sequence < b->sequence);

    Cflue__V1__ClaimResponse c1 = claim("o1", 30000);
    CHECK(c1.submission && !strcmp(c1.submission->submission_id, a->submission_id));
    Cflue__V1__ClaimResponse c2 = claim("o1", 30000);
    CHECK(c2.submission && !strcmp(c2.submission->submission_id, other->submission_id));
    Cflue__V1__ClaimResponse c3 = claim("o1", 30000);
    CHECK(c3.submission == NULL); /* b waits behind a */

    CHECK(append_one(c1.fence, "r1", "{\"x\":1}") == CF_OK);
    CHECK(append_one(c1.fence, "r1", "{\"x\":1}") == CF_OK); /* identical resend */
    struct cf_error err;
    CHECK(append_err(c1.fence, "r1", "{\"x\":2}", &err) == CF_EXISTS); /* same id, other body */
    CHECK(!strcmp(cf_error_reason(&err), "RECORD_CONFLICT"));

    Cflue__V1__Fence stale = *c1.fence;
    stale.epoch += 1;
    CHECK(append_err(&stale, "r2", "{}", &err) == CF_STALE);
    CHECK(!strcmp(cf_error_reason(&err), "STALE_FENCE"));
    Cflue__V1__SettleResponse out;
    CHECK(settle(&stale, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "", &out) == CF_STALE);

    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__OUTCOME_FAILED, "boom", &out) == CF_OK);
    CHECK(out.submission->status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_SETTLED);
    CHECK(out.record_offset == 1);
    /* an identical retry is answered from the row; any other settle is refused */
    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__OUTCOME_FAILED, "boom", &out) == CF_OK &&
          out.already_settled);
    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "", &out) == CF_PRECONDITION);
    /* the fence still matches: the submission's state, not the fence, refuses the write */
    CHECK(append_one(c1.fence, "r3", "{}") == CF_PRECONDITION);

    Cflue__V1__ClaimResponse c4 = claim("o1", 30000);
    CHECK(c4.submission && !strcmp(c4.submission->submission_id, b->submission_id));
    CHECK(c4.fence->epoch == c1.fence->epoch + 1);
}

/* claim_until claims (settling whatever earlier tests left runnable) until it holds s. */
static Cflue__V1__ClaimResponse claim_until(const Cflue__V1__Submission *s, const char *owner,
                                            int64_t lease)
{
    Cflue__V1__ClaimResponse cl;
    do {
        cl = claim(owner, lease);
    } while (cl.submission && strcmp(cl.submission->submission_id, s->submission_id) != 0 &&
             settle(cl.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                    &(Cflue__V1__SettleResponse){0}) == CF_OK);
    return cl;
}

static void test_takeover(void)
{
    Cflue__V1__Submission *s = admit("c3", "x", "");
    CHECK(s != NULL);
    Cflue__V1__ClaimResponse a = claim_until(s, "A", 1);
    CHECK(a.submission && !strcmp(a.submission->submission_id, s->submission_id));
    clock_sleep_ms(5);
    Cflue__V1__ClaimResponse b = claim("B", 30000);
    CHECK(b.submission && b.takeover && !strcmp(b.submission->submission_id, s->submission_id));
    CHECK(b.submission->attempt_count == 2);
    CHECK(append_one(a.fence, "late", "{}") == CF_STALE);
    CHECK(append_one(b.fence, "fresh", "{}") == CF_OK);
}

static void test_idempotency(void)
{
    Cflue__V1__Submission *x = admit("", "same", "key-1");
    Cflue__V1__Submission *y = admit("", "same", "key-1");
    CHECK(x && y && !strcmp(x->submission_id, y->submission_id));
    CHECK(!strcmp(x->conversation_id, y->conversation_id));
    CHECK(!strncmp(x->conversation_id, "conv_", 5));
    CHECK(admit("", "different", "key-1") == NULL);
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    msg.text = "other";
    req.agent = "assistant";
    req.idempotency_key = "key-1";
    req.message = &msg;
    CHECK(ledger_admit(&c, &req, &out, &err) == CF_EXISTS);
    CHECK(!strcmp(cf_error_reason(&err), "IDEMPOTENCY_CONFLICT"));
}

/* Pages are bounded by bytes (issue 7, defect 3): with a 4 KiB budget, ten records of ~1 KiB
 * come back three to a page, never an error, and a record over budget - slack is refused. */
static void test_page_bytes(void)
{
    struct ledger_config small = cfg;
    small.page_bytes = 4096;
    Cflue__V1__Submission *s = admit("c-pages", "x", "");
    CHECK(s != NULL);
    Cflue__V1__ClaimResponse cl = claim_until(s, "P", 30000);
    CHECK(cl.submission != NULL);
    char body[1100], id[16];
    memset(body, 'a', sizeof(body));
    body[sizeof(body) - 1] = '\0';
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof(id), "p%d", i);
        CHECK(append_one(cl.fence, id, body) == CF_OK);
    }
    int64_t after = -1;
    int pages = 0, seen = 0;
    char token[PAGE_TOKEN_MAX] = "";
    for (;;) {
        Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
        Cflue__V1__ReadResponse rs = CFLUE__V1__READ_RESPONSE__INIT;
        struct cf_error err;
        struct ledger_ctx c = ctx();
        c.cfg = &small;
        rq.conversation_id = "c-pages";
        rq.after_offset = pages ? 5 : -1; /* ignored once a token is given */
        rq.page_token = token;
        rq.page_size = 1000;
        CHECK(ledger_read(&c, &rq, &rs, &err) == CF_OK);
        CHECK(rs.n_records >= 1 && rs.n_records <= 3);
        CHECK(protobuf_c_message_get_packed_size(&rs.base) <= 4096 + 64);
        CHECK(rs.records[0]->offset == after + 1);
        seen += (int)rs.n_records;
        pages++;
        after = rs.records[rs.n_records - 1]->offset;
        CHECK(rs.head_offset == 9);
        if (!*rs.next_page_token) {
            break;
        }
        snprintf(token, sizeof(token), "%s", rs.next_page_token);
        CHECK(pages < 20);
    }
    CHECK(seen == 10 && pages >= 4);

    /* a record over the limit is refused before anything is written */
    char *huge = arena_alloc(&arena, 4096);
    memset(huge, 'b', 4095);
    huge[4095] = '\0';
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    Cflue__V1__AppendResponse out = CFLUE__V1__APPEND_RESPONSE__INIT;
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__SystemPrompt sp = CFLUE__V1__SYSTEM_PROMPT__INIT;
    Cflue__V1__Record *recs[1] = {&rec};
    struct cf_error err;
    struct ledger_ctx c = ctx();
    c.cfg = &small;
    rec.id = "huge";
    sp.text = huge;
    rec.body_case = CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT;
    rec.system_prompt = &sp;
    req.fence = cl.fence;
    req.records = recs;
    req.n_records = 1;
    CHECK(ledger_append(&c, &req, &out, &err) == CF_INVALID);
    CHECK(strstr(err.msg, "records[0]") != NULL);

    /* a token of another conversation is refused; so is an offset beyond the head */
    Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
    Cflue__V1__ReadResponse rs = CFLUE__V1__READ_RESPONSE__INIT;
    char foreign[PAGE_TOKEN_MAX];
    page_token_make_int(foreign, "c1", 0);
    rq.conversation_id = "c-pages";
    rq.page_token = foreign;
    c = ctx();
    CHECK(ledger_read(&c, &rq, &rs, &err) == CF_INVALID);
    CHECK(!strcmp(cf_error_reason(&err), "INVALID_PAGE_TOKEN"));
    rq.page_token = "";
    rq.after_offset = 10;
    CHECK(ledger_read(&c, &rq, &rs, &err) == CF_RANGE);
    CHECK(!strcmp(cf_error_reason(&err), "OFFSET_BEYOND_HEAD"));
}

/* A Compact submission is never joined, and the joinable run stops before it (defect 9). */
static void test_compact_not_joined(void)
{
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    struct cf_error err;
    Cflue__V1__Submission *host = admit("c-compact", "host", "");
    Cflue__V1__Submission *p1 = admit("c-compact", "p1", "");
    struct ledger_ctx c = ctx();
    req.agent = "assistant";
    req.conversation_id = "c-compact";
    req.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
    CHECK(ledger_admit(&c, &req, &out, &err) == CF_OK);
    CHECK(out.submission->kind == CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT);
    CHECK(out.submission->message == NULL && out.submission->n_metadata == 0);
    (void)msg;
    /* a compaction of a conversation that does not exist is refused */
    req.conversation_id = "c-never";
    c = ctx();
    CHECK(ledger_admit(&c, &req, &(Cflue__V1__AdmitResponse){0}, &err) == CF_NOT_FOUND);
    Cflue__V1__Submission *p2 = admit("c-compact", "p2", "");
    CHECK(host && p1 && p2);

    Cflue__V1__ClaimRequest cr = CFLUE__V1__CLAIM_REQUEST__INIT;
    Cflue__V1__ClaimResponse cl = CFLUE__V1__CLAIM_RESPONSE__INIT;
    cr.owner_id = "J";
    cr.submission_id = host->submission_id;
    c = ctx();
    CHECK(ledger_claim(&c, &cr, &cl, &err) == CF_OK && cl.submission);
    Cflue__V1__ClaimJoinableRequest jr = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    Cflue__V1__ClaimJoinableResponse jo = CFLUE__V1__CLAIM_JOINABLE_RESPONSE__INIT;
    jr.host = cl.fence;
    c = ctx();
    CHECK(ledger_claim_joinable(&c, &jr, &jo, &err) == CF_OK);
    CHECK(jo.n_submissions == 1 && !strcmp(jo.submissions[0]->submission_id, p1->submission_id));
}

static void test_schema_version(const char *path)
{
    struct cf_error err;
    sqlite3 *other;
    CHECK(db_exec(db, "UPDATE meta SET value='9' WHERE key='schema_version'", &err) == CF_OK);
    CHECK(db_open(path, true, &other, &err) == CF_VERSION);
    CHECK(strstr(err.msg, "schema version 9") != NULL);
    CHECK(db_exec(db, "UPDATE meta SET value='" DB_SCHEMA_VERSION "' WHERE key='schema_version'",
                  &err) == CF_OK);
}

int main(void)
{
    char path[128];
    struct cf_error err;
    snprintf(path, sizeof(path), "/tmp/cflue-test-ledger-%d.db", (int)getpid());
    CHECK(db_open(path, true, &db, &err) == CF_OK);
    arena_init(&arena);
    test_fifo_and_fencing();
    test_takeover();
    test_idempotency();
    test_page_bytes();
    test_compact_not_joined();
    test_schema_version(path);
    arena_cleanup(&arena);
    sqlite3_close(db);
    char side[160];
    unlink(path);
    snprintf(side, sizeof(side), "%s-wal", path);
    unlink(side);
    snprintf(side, sizeof(side), "%s-shm", path);
    unlink(side);
    return check_done("test_ledger");
}
