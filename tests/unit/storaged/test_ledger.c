/* Unit tests of storaged/ledger.c and db.c on a real SQLite file, without gRPC. */
#include "../check.h"

#include "clock.h"
#include "db.h"
#include "ledger.h"

#include <stdio.h>
#include <stdlib.h>
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
    req.owner_id = (char *)owner;
    req.lease_ms = lease;
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

static enum cf_status append_one(const Cflue__V1__Fence *f, const char *id, const char *body)
{
    Cflue__V1__AppendRequest req = CFLUE__V1__APPEND_REQUEST__INIT;
    Cflue__V1__AppendResponse out = CFLUE__V1__APPEND_RESPONSE__INIT;
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    Cflue__V1__Record *recs[1] = {&rec};
    struct cf_error err;
    struct ledger_ctx c = ctx();
    rec.id = (char *)id;
    rec.type = "note";
    rec.body_json = (char *)body;
    req.fence = (Cflue__V1__Fence *)f;
    req.records = recs;
    req.n_records = 1;
    return ledger_append(&c, &req, &out, &err);
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
    CHECK(append_one(c1.fence, "r1", "{\"x\":1}") == CF_OK);     /* identical resend */
    CHECK(append_one(c1.fence, "r1", "{\"x\":2}") == CF_EXISTS); /* same id, other body */

    Cflue__V1__Fence stale = *c1.fence;
    stale.epoch += 1;
    CHECK(append_one(&stale, "r2", "{}") == CF_STALE);
    Cflue__V1__SettleResponse out;
    CHECK(settle(&stale, CFLUE__V1__OUTCOME__COMPLETED, "", &out) == CF_STALE);

    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__FAILED, "boom", &out) == CF_OK);
    CHECK(out.submission->status == CFLUE__V1__SUBMISSION_STATUS__SETTLED);
    CHECK(out.record_offset == 1);
    /* an identical retry is answered from the row; any other settle is refused */
    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__FAILED, "boom", &out) == CF_OK &&
          out.already_settled);
    CHECK(settle(c1.fence, CFLUE__V1__OUTCOME__COMPLETED, "", &out) == CF_STALE);
    CHECK(append_one(c1.fence, "r3", "{}") == CF_STALE);

    Cflue__V1__ClaimResponse c4 = claim("o1", 30000);
    CHECK(c4.submission && !strcmp(c4.submission->submission_id, b->submission_id));
    CHECK(c4.fence->epoch == c1.fence->epoch + 1);
}

static void test_takeover(void)
{
    Cflue__V1__Submission *s = admit("c3", "x", "");
    CHECK(s != NULL);
    Cflue__V1__ClaimResponse a;
    do {
        a = claim("A", 1);
    } while (a.submission && strcmp(a.submission->submission_id, s->submission_id) != 0 &&
             settle(a.fence, CFLUE__V1__OUTCOME__COMPLETED, "", &(Cflue__V1__SettleResponse){0}) ==
                 CF_OK);
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
}

static void test_schema_version(const char *path)
{
    struct cf_error err;
    sqlite3 *other;
    CHECK(db_exec(db, "UPDATE meta SET value='2' WHERE key='schema_version'", &err) == CF_OK);
    CHECK(db_open(path, true, &other, &err) == CF_VERSION);
    CHECK(strstr(err.msg, "schema version 2") != NULL);
    CHECK(db_exec(db, "UPDATE meta SET value='1' WHERE key='schema_version'", &err) == CF_OK);
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
