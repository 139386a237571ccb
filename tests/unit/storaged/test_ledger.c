/* Unit tests of storaged/ledger.c and db.c on a real SQLite file, without gRPC. */
#include "../check.h"

#include "clock.h"
#include "db.h"
#include "ledger.h"
#include "page_token.h"
#include "pbtime.h"
#include "stmt.h"
#include "validate.h"

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

/* claim_at claims as owner with the store clock at now. */
static Cflue__V1__ClaimResponse claim_at(const char *owner, int64_t lease, int64_t now)
{
    Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
    Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    c.now = now;
    Google__Protobuf__Duration d = GOOGLE__PROTOBUF__DURATION__INIT;
    pbdur_set(&d, lease);
    req.owner_id = (char *)owner;
    req.lease_duration = &d;
    CHECK(ledger_claim(&c, &req, &out, &err) == CF_OK);
    return out;
}

static Cflue__V1__ClaimResponse claim(const char *owner, int64_t lease)
{
    return claim_at(owner, lease, clock_now_ms());
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

/* claimed_pair admits a submission into each of the conversations c1 and c2 and claims each
 * as owner A, with leases of lease1 and lease2 ms; *s1 and *s2 are their admitted rows. */
static void claimed_pair(const char *c1, int64_t lease1, const char *c2, int64_t lease2,
                         Cflue__V1__Submission **s1, Cflue__V1__ClaimResponse *cl1,
                         Cflue__V1__Submission **s2, Cflue__V1__ClaimResponse *cl2)
{
    *s1 = admit(c1, "x", "");
    *s2 = admit(c2, "x", "");
    CHECK(*s1 && *s2);
    *cl1 = claim_until(*s1, "A", lease1);
    *cl2 = claim_until(*s2, "A", lease2);
    CHECK(cl1->submission && cl2->submission);
}

/* After a step of the clock, the unsettled work's leases, time limits and starts move with
 * it, so that a lease taken before a step forward has its time still; settled rows keep
 * theirs. */
static void test_clock_step(void)
{
    const int64_t hour = 3600000;
    struct cf_error err;
    Cflue__V1__Submission *run, *done;
    Cflue__V1__ClaimResponse a, b;
    claimed_pair("step-run", 30000, "step-done", 30000, &run, &a, &done, &b);
    CHECK(settle(b.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    struct ledger_ctx c = ctx();
    Cflue__V1__Submission before_run, before_done, after;
    CHECK(ledger_get(&c, run->submission_id, &before_run, &err) == CF_OK);
    CHECK(ledger_get(&c, done->submission_id, &before_done, &err) == CF_OK);
    CHECK(pbtime_ms(before_run.lease_expire_time) > 0 && pbtime_ms(before_run.deadline) > 0 &&
          pbtime_ms(before_run.start_time) > 0);

    int moved = -1;
    c.now += hour;
    CHECK(ledger_shift_times(&c, hour, &moved, &err) == CF_OK);
    CHECK(moved >= 1); /* with the earlier tests' unsettled work */
    CHECK(ledger_get(&c, run->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.lease_expire_time) == pbtime_ms(before_run.lease_expire_time) + hour);
    CHECK(pbtime_ms(after.deadline) == pbtime_ms(before_run.deadline) + hour);
    CHECK(pbtime_ms(after.start_time) == pbtime_ms(before_run.start_time) + hour);
    CHECK(pbtime_ms(after.create_time) == pbtime_ms(before_run.create_time));
    CHECK(ledger_get(&c, done->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.start_time) == pbtime_ms(before_done.start_time));
    CHECK(pbtime_ms(after.settle_time) == pbtime_ms(before_done.settle_time));

    /* an hour on, the lease has its 30 s still: nothing to take over */
    Cflue__V1__ClaimResponse other = claim_at("B", 30000, c.now);
    CHECK(other.submission == NULL);
    CHECK(append_one(a.fence, "after-step", "{}") == CF_OK);
    CHECK(settle(a.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
}

/* A Settle of a queued submission (a fence without an attempt) retried as it was, its first
 * answer lost, is answered as settled already; another outcome is refused. */
static void test_settle_without_attempt_retried(void)
{
    Cflue__V1__Submission *q = admit("bare-settle", "x", "");
    CHECK(q != NULL);
    Cflue__V1__Fence bare = CFLUE__V1__FENCE__INIT;
    bare.submission_id = q->submission_id;
    Cflue__V1__SettleResponse out;
    CHECK(settle(&bare, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "stopped", &out) == CF_OK);
    CHECK(!out.already_settled);
    CHECK(settle(&bare, CFLUE__V1__OUTCOME__OUTCOME_ABORTED, "stopped", &out) == CF_OK);
    CHECK(out.already_settled);
    CHECK(settle(&bare, CFLUE__V1__OUTCOME__OUTCOME_FAILED, "stopped", &out) == CF_PRECONDITION);
}

/* A step back longer than the times themselves (a clock set far back, or a fenced lease of
 * 1 ms after a reboot) leaves them at 1 ms at the least: a lease at or below 0 reads as no
 * lease, and the work would never be taken over. */
static void test_clock_step_back_keeps_times_positive(void)
{
    struct cf_error err;
    Cflue__V1__Submission *run, *other;
    Cflue__V1__ClaimResponse a, b;
    claimed_pair("back-run", 30000, "back-other", 30000, &run, &a, &other, &b);
    struct ledger_ctx c = ctx();
    Cflue__V1__Submission before, after;
    CHECK(ledger_get(&c, run->submission_id, &before, &err) == CF_OK);
    const int64_t step = -(pbtime_ms(before.lease_expire_time) + 3600000);
    int moved = -1;
    CHECK(ledger_shift_times(&c, step, &moved, &err) == CF_OK);
    CHECK(ledger_get(&c, run->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.lease_expire_time) == 1);
    CHECK(pbtime_ms(after.deadline) == 1 && pbtime_ms(after.start_time) == 1);
    CHECK(ledger_shift_times(&c, -1000, &moved, &err) == CF_OK); /* a lease at 1 stays there */
    CHECK(ledger_get(&c, run->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.lease_expire_time) == 1);
    CHECK(settle(a.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    CHECK(settle(b.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
}

/* After an outage during which storaged could not write, the leases still running when it
 * began are extended by its length; one that had run out before stays so. */
static void test_extend_leases(void)
{
    const int64_t outage = 60000;
    struct cf_error err;
    Cflue__V1__Submission *live, *gone;
    Cflue__V1__ClaimResponse a, b;
    claimed_pair("ext-live", 30000, "ext-gone", 100, &live, &a, &gone, &b);
    clock_sleep_ms(150); /* gone's lease runs out before the outage */
    struct ledger_ctx c = ctx();
    Cflue__V1__Submission live0, gone0, after;
    CHECK(ledger_get(&c, live->submission_id, &live0, &err) == CF_OK);
    CHECK(ledger_get(&c, gone->submission_id, &gone0, &err) == CF_OK);
    c.now += outage; /* the outage began now and lasted a minute */
    int moved = -1;
    CHECK(ledger_extend_leases(&c, c.now - outage, outage, &moved, &err) == CF_OK && moved >= 1);
    CHECK(ledger_get(&c, live->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.lease_expire_time) == pbtime_ms(live0.lease_expire_time) + outage);
    CHECK(pbtime_ms(after.start_time) == pbtime_ms(live0.start_time));
    CHECK(ledger_get(&c, gone->submission_id, &after, &err) == CF_OK);
    CHECK(pbtime_ms(after.lease_expire_time) == pbtime_ms(gone0.lease_expire_time));
    CHECK(settle(a.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    CHECK(settle(b.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
}

/* reclaim_claim claims as a process of owner that started at started_ms (its own clock;
 * 0: not said), taking back this owner's attempts of processes started before before_ms
 * (0: none); submission_id "" for any. */
static Cflue__V1__ClaimResponse reclaim_claim(const char *owner, int64_t started_ms,
                                              int64_t before_ms, const char *submission_id)
{
    Cflue__V1__ClaimRequest req = CFLUE__V1__CLAIM_REQUEST__INIT;
    Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
    Google__Protobuf__Timestamp started = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    Google__Protobuf__Timestamp before = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    req.owner_id = (char *)owner;
    req.submission_id = (char *)submission_id;
    if (started_ms) {
        pbtime_set(&started, started_ms);
        req.owner_started_at = &started;
    }
    if (before_ms) {
        pbtime_set(&before, before_ms);
        req.reclaim_started_before = &before;
    }
    CHECK(ledger_claim(&c, &req, &out, &err) == CF_OK);
    return out;
}

/* A restarted owner takes back what its previous process held by the two processes' own
 * start times (owner_started_at), not by storaged's clock: with the owner's clock an hour
 * ahead of storaged's, what the new process claims after its start is not taken back as
 * older at its next claim (by started_at, every attempt of the first hour would be), while
 * the previous process's attempts are, and an attempt claimed without owner_started_at (an
 * older claimer) still goes by its started_at. */
static void test_reclaim_by_owner_start(void)
{
    const int64_t ahead = 3600 * 1000;
    int64_t old_start = clock_now_ms() + ahead - 600000, new_start = clock_now_ms() + ahead;
    Cflue__V1__Submission *a = admit("c-reclaim-a", "a", "");
    Cflue__V1__Submission *b = admit("c-reclaim-b", "b", "");
    CHECK(a && b);
    /* the previous process (started 10 minutes before the new one) claims both */
    Cflue__V1__ClaimResponse oa = reclaim_claim("R", old_start, 0, a->submission_id);
    Cflue__V1__ClaimResponse ob = reclaim_claim("R", old_start, 0, b->submission_id);
    CHECK(oa.submission && ob.submission && !oa.takeover && !ob.takeover);
    /* the new process takes a back (its lease has not run out)... */
    Cflue__V1__ClaimResponse na = reclaim_claim("R", new_start, new_start, a->submission_id);
    CHECK(na.submission && na.takeover && na.submission->attempt_count == 2);
    /* ...and a is its own now: neither a targeted nor an open reclaim takes it again, though
     * its attempt started an hour before new_start by storaged's clock */
    Cflue__V1__ClaimResponse again = reclaim_claim("R", new_start, new_start, a->submission_id);
    CHECK(again.submission == NULL);
    Cflue__V1__ClaimResponse open = reclaim_claim("R", new_start, new_start, "");
    CHECK(open.submission && open.takeover &&
          !strcmp(open.submission->submission_id, b->submission_id));
    CHECK(append_one(na.fence, "still-mine", "{}") == CF_OK);
    /* an attempt claimed without owner_started_at is taken back by its started_at */
    Cflue__V1__Submission *c = admit("c-reclaim-c", "c", "");
    CHECK(c != NULL);
    Cflue__V1__ClaimResponse oc = reclaim_claim("R", 0, 0, c->submission_id);
    CHECK(oc.submission && !oc.takeover);
    Cflue__V1__ClaimResponse nc = reclaim_claim("R", new_start, new_start, c->submission_id);
    CHECK(nc.submission && nc.takeover);
    CHECK(settle(na.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    CHECK(settle(open.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    CHECK(settle(nc.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);

    /* a process whose clock reads an hour before the previous one's start (set back between
     * the two): its open reclaim still takes that one's attempt back; a targeted one (a
     * resume, which asks for its own) does not */
    int64_t behind = new_start - ahead;
    Cflue__V1__Submission *d = admit("c-reclaim-d", "d", "");
    CHECK(d != NULL);
    Cflue__V1__ClaimResponse od = reclaim_claim("R", new_start, 0, d->submission_id);
    CHECK(od.submission && !od.takeover);
    CHECK(reclaim_claim("R", behind, behind + 1, d->submission_id).submission == NULL);
    Cflue__V1__ClaimResponse nd = reclaim_claim("R", behind, behind, "");
    CHECK(nd.submission && nd.takeover && !strcmp(nd.submission->submission_id, d->submission_id));
    CHECK(append_one(od.fence, "stale", "{}") == CF_STALE);
    CHECK(settle(nd.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
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

/* A submission keeps the trace context it was admitted with; a retry of the same admission
 * with another trace is the same admission, and keeps the first trace; validate_admit takes a
 * version-00 traceparent only, and a tracestate only with it. */
static void test_trace_context(void)
{
    static const char tp1[] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    static const char tp2[] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    msg.text = "traced";
    req.agent = "assistant";
    req.idempotency_key = "key-trace";
    req.message = &msg;
    req.traceparent = (char *)tp1;
    req.tracestate = "rojo=1";
    CHECK(validate_admit(&req, &err) == CF_OK);
    CHECK(ledger_admit(&c, &req, &out, &err) == CF_OK);
    CHECK(!strcmp(out.submission->traceparent, tp1));
    CHECK(!strcmp(out.submission->tracestate, "rojo=1"));
    const char *sid = out.submission->submission_id;
    Cflue__V1__Submission got = CFLUE__V1__SUBMISSION__INIT;
    CHECK(ledger_get(&c, sid, &got, &err) == CF_OK && !strcmp(got.traceparent, tp1));
    /* the retry: same admission, the first trace */
    req.traceparent = (char *)tp2;
    req.tracestate = "";
    cflue__v1__admit_response__init(&out);
    CHECK(ledger_admit(&c, &req, &out, &err) == CF_OK && out.deduplicated);
    CHECK(!strcmp(out.submission->submission_id, sid));
    CHECK(!strcmp(out.submission->traceparent, tp1));
    CHECK(!strcmp(out.submission->tracestate, "rojo=1"));
    /* without one: none */
    Cflue__V1__Submission *plain = admit("", "untraced", "");
    CHECK(plain && !*plain->traceparent && !*plain->tracestate);
    /* what validate_admit refuses */
    req.idempotency_key = "";
    const char *bad[] = {"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                         "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                         " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                         "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                         "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                         "junk"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        req.traceparent = (char *)bad[i];
        CHECK(validate_admit(&req, &err) == CF_INVALID && strstr(err.msg, "traceparent"));
    }
    req.traceparent = "";
    req.tracestate = "a=b";
    CHECK(validate_admit(&req, &err) == CF_INVALID && strstr(err.msg, "tracestate"));
    req.traceparent = (char *)tp1;
    char long_state[600];
    memset(long_state, 'a', sizeof(long_state) - 1);
    long_state[sizeof(long_state) - 1] = '\0';
    req.tracestate = long_state;
    CHECK(validate_admit(&req, &err) == CF_INVALID && strstr(err.msg, "tracestate"));
    req.tracestate = "a=\x01";
    CHECK(validate_admit(&req, &err) == CF_INVALID && strstr(err.msg, "tracestate"));
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

    /* a first record larger than the budget (it always goes) fills the page: the budget left
     * is none, not a count wrapped around to "all of them" (Follow's 1 MiB batches decoded up
     * to 200 records of any size after one large one) */
    {
        Cflue__V1__ReadRequest rq = CFLUE__V1__READ_REQUEST__INIT;
        Cflue__V1__ReadResponse rs = CFLUE__V1__READ_RESPONSE__INIT;
        struct cf_error err;
        struct ledger_ctx c = ctx();
        rq.conversation_id = "c-pages";
        rq.after_offset = -1;
        rq.page_token = "";
        rq.page_size = 1000;
        CHECK(ledger_read_bytes(&c, &rq, 500, &rs, &err) == CF_OK);
        CHECK(rs.n_records == 1);
        CHECK(*rs.next_page_token != '\0');
        /* a record no message of this storaged can carry (stored before --max-message-bytes
         * was lowered) is refused by name, with the limit that would read it */
        struct ledger_config lowered = cfg;
        lowered.send_bytes = 1500;
        c.cfg = &lowered;
        cflue__v1__read_response__init(&rs);
        CHECK(ledger_read_bytes(&c, &rq, 500, &rs, &err) == CF_PRECONDITION);
        CHECK_STR(cf_error_reason(&err), "RECORD_OVER_MESSAGE_LIMIT");
        CHECK(strstr(err.msg, "record 0 of conversation c-pages") != NULL);
        CHECK(strstr(err.msg, "--max-message-bytes") != NULL);
        lowered.send_bytes = 4096;
        cflue__v1__read_response__init(&rs);
        CHECK(ledger_read_bytes(&c, &rq, 500, &rs, &err) == CF_OK && rs.n_records == 1);
    }

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

/* claim_with_joinable claims host as owner J (*cl) and asks what joins it. */
static Cflue__V1__ClaimJoinableResponse claim_with_joinable(const Cflue__V1__Submission *host,
                                                            Cflue__V1__ClaimResponse *cl)
{
    struct cf_error err;
    Cflue__V1__ClaimRequest cr = CFLUE__V1__CLAIM_REQUEST__INIT;
    cflue__v1__claim_response__init(cl);
    cr.owner_id = "J";
    cr.submission_id = host->submission_id;
    struct ledger_ctx c = ctx();
    CHECK(ledger_claim(&c, &cr, cl, &err) == CF_OK && cl->submission);
    Cflue__V1__ClaimJoinableRequest jr = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    Cflue__V1__ClaimJoinableResponse jo = CFLUE__V1__CLAIM_JOINABLE_RESPONSE__INIT;
    jr.host = cl->fence;
    c = ctx();
    CHECK(ledger_claim_joinable(&c, &jr, &jo, &err) == CF_OK);
    return jo;
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

    Cflue__V1__ClaimResponse cl;
    Cflue__V1__ClaimJoinableResponse jo = claim_with_joinable(host, &cl);
    CHECK(jo.n_submissions == 1 && !strcmp(jo.submissions[0]->submission_id, p1->submission_id));
}

/* Four 3 MiB messages queued behind a running host: a List page, and what ClaimJoinable joins,
 * stop at the page budget (8 MiB here) rather than make an answer no message can carry; the
 * rest comes on the next page, and what is not joined stays queued in order. */
static void test_pages_bounded_by_bytes(void)
{
    struct cf_error err;
    size_t big = 3 << 20;
    char *text = malloc(big + 1);
    memset(text, 'm', big);
    text[big] = '\0';
    Cflue__V1__Submission *host = admit("c-bytes", "host", "");
    Cflue__V1__Submission *q[4];
    for (int i = 0; i < 4; i++) {
        q[i] = admit("c-bytes", text, "");
        CHECK(q[i] != NULL);
    }
    free(text);
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    Cflue__V1__ListResponse lo = CFLUE__V1__LIST_RESPONSE__INIT;
    lr.conversation_id = "c-bytes";
    struct ledger_ctx c = ctx();
    CHECK(ledger_list(&c, &lr, &lo, &err) == CF_OK);
    CHECK(lo.n_submissions == 3 && *lo.next_page_token); /* the host and two 3 MiB messages */
    size_t seen = lo.n_submissions;
    for (int pages = 0; *lo.next_page_token && pages < 8; pages++) {
        lr.page_token = lo.next_page_token;
        c = ctx();
        CHECK(ledger_list(&c, &lr, &lo, &err) == CF_OK);
        seen += lo.n_submissions;
    }
    CHECK(seen == 5);

    Cflue__V1__ClaimResponse cl;
    Cflue__V1__ClaimJoinableResponse jo = claim_with_joinable(host, &cl);
    CHECK(jo.n_submissions == 2);
    CHECK(!strcmp(jo.submissions[0]->submission_id, q[0]->submission_id) &&
          !strcmp(jo.submissions[1]->submission_id, q[1]->submission_id));
    Cflue__V1__Submission left;
    c = ctx();
    CHECK(ledger_get(&c, q[2]->submission_id, &left, &err) == CF_OK &&
          left.status == CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_QUEUED);
    CHECK(settle(cl.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
}

/* The VM steps SQLite runs while the progress handler is set (one call per step). The trace
 * callback is not free for this: the statement cache finalizes its statements at close
 * through it. */
static int64_t list_steps;

static int count_step(void *user)
{
    (void)user;
    list_steps++;
    return 0;
}

/* held_by lists owner's RUNNING and TERMINALIZING submissions (agentd's take-back after a
 * claim that got no answer); returns how many, *steps what the List cost SQLite. */
static size_t held_by(const char *owner, int64_t *steps)
{
    static const Cflue__V1__SubmissionStatus held[] = {
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_TERMINALIZING,
        CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_RUNNING};
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    Cflue__V1__ListResponse lo = CFLUE__V1__LIST_RESPONSE__INIT;
    struct cf_error err;
    struct ledger_ctx c = ctx();
    lr.owner_id = (char *)owner;
    lr.statuses = (Cflue__V1__SubmissionStatus *)held;
    lr.n_statuses = 2;
    list_steps = 0;
    sqlite3_progress_handler(db, 1, count_step, NULL);
    CHECK(ledger_list(&c, &lr, &lo, &err) == CF_OK);
    sqlite3_progress_handler(db, 0, NULL, NULL);
    *steps = list_steps;
    for (size_t i = 0; i < lo.n_submissions; i++) {
        CHECK(!strcmp(lo.submissions[i]->owner_id, owner));
        CHECK(i == 0 || lo.submissions[i]->sequence > lo.submissions[i - 1]->sequence);
    }
    return lo.n_submissions;
}

/* An owner's held work is listed without walking the owner's history: the List costs SQLite
 * as many steps with 3,000 settled submissions of the owner behind it as with none (it walked
 * them all, through submissions_by_owner), and finds the same two. */
static void test_held_work_listed_without_the_history(void)
{
    const char *owner = "agentd-with-a-history";
    char conv[64];
    int64_t before, after;
    for (int i = 0; i < 2; i++) {
        snprintf(conv, sizeof(conv), "c-held-%d", i);
        Cflue__V1__Submission *s = admit(conv, "held", "");
        CHECK(s && reclaim_claim(owner, 0, 0, s->submission_id).submission);
    }
    CHECK(held_by(owner, &before) == 2);
    CHECK(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK);
    for (int i = 0; i < 3000; i++) {
        snprintf(conv, sizeof(conv), "c-history-%d", i);
        Cflue__V1__Submission *s = admit(conv, "done long ago", "");
        Cflue__V1__ClaimResponse cl =
            s ? reclaim_claim(owner, 0, 0, s->submission_id) : (Cflue__V1__ClaimResponse){0};
        CHECK(cl.fence && settle(cl.fence, CFLUE__V1__OUTCOME__OUTCOME_COMPLETED, "",
                                 &(Cflue__V1__SettleResponse){0}) == CF_OK);
    }
    CHECK(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK);
    CHECK(held_by(owner, &after) == 2);
    CHECK(before > 0 && after < 2 * before);
    if (after >= 2 * before) {
        fprintf(stderr, "held work List: %lld VM steps before the history, %lld after\n",
                (long long)before, (long long)after);
    }
}

static void test_schema_version(const char *path)
{
    struct cf_error err;
    sqlite3 *other;
    CHECK(db_exec(db, "UPDATE meta SET value='99' WHERE key='schema_version'", &err) == CF_OK);
    CHECK(db_open(path, true, &other, &err) == CF_VERSION);
    CHECK(strstr(err.msg, "schema version 99") != NULL);
    CHECK(db_exec(db, "UPDATE meta SET value='" DB_SCHEMA_VERSION "' WHERE key='schema_version'",
                  &err) == CF_OK);
}

/* Every connection db_open makes keeps its temporary storage in memory (a savepoint's statement
 * journal opens no file) and its page cache at 256 KiB, writer and readers alike. */
static void test_connection_settings(const char *path)
{
    struct cf_error err;
    sqlite3 *reader;
    CHECK(db_open(path, false, &reader, &err) == CF_OK);
    sqlite3 *conns[] = {db, reader};
    for (size_t i = 0; i < 2; i++) {
        sqlite3_stmt *q;
        CHECK(sqlite3_prepare_v2(conns[i], "PRAGMA temp_store", -1, &q, NULL) == SQLITE_OK);
        CHECK(sqlite3_step(q) == SQLITE_ROW && sqlite3_column_int(q, 0) == 2); /* 2: MEMORY */
        sqlite3_finalize(q);
        CHECK(sqlite3_prepare_v2(conns[i], "PRAGMA cache_size", -1, &q, NULL) == SQLITE_OK);
        CHECK(sqlite3_step(q) == SQLITE_ROW && sqlite3_column_int(q, 0) == -256);
        sqlite3_finalize(q);
    }
    sqlite3_close(reader);
}

/* ---------- stmt.c: statements prepared once, every step checked ---------- */

static void test_stmt(void)
{
    static const char ins[] = "INSERT INTO t(x) VALUES (?)";
    static const char sel[] = "SELECT x FROM t ORDER BY x";
    static const char overflow[] = "SELECT abs(?)";
    static const char nonsense[] = "SELEKT 1";
    struct cf_error err;
    struct stmt s, s2;
    bool row;
    CHECK(db_exec(db, "CREATE TEMP TABLE t(x INTEGER CHECK (x > 0))", &err) == CF_OK);
    size_t before = stmt_cache_size(db);
    CHECK(before > 0); /* the ledger's statements from the tests above */

    /* a failing step is a status naming the statement, not "done" */
    CHECK(stmt_open(&s, db, ins, "insert t", &err) == CF_OK);
    stmt_int(&s, 1, -1);
    CHECK(stmt_done(&s, &err) == CF_DB);
    CHECK(strstr(err.msg, "insert t") != NULL && strstr(err.msg, "CHECK") != NULL);
    CHECK(stmt_cache_size(db) == before + 1);
    CHECK(stmt_open(&s, db, overflow, "abs", &err) == CF_OK);
    stmt_int(&s, 1, INT64_MIN);
    CHECK(stmt_step(&s, &row, &err) == CF_DB && !row);
    CHECK(strstr(err.msg, "overflow") != NULL);
    stmt_close(&s);
    CHECK(stmt_open(&s, db, overflow, "abs", &err) == CF_OK); /* usable again after a failure */
    stmt_int(&s, 1, -3);
    CHECK(stmt_step(&s, &row, &err) == CF_OK && row && sqlite3_column_int(s.st, 0) == 3);
    stmt_close(&s);

    /* the cache survives a rollback: the statement runs again, and the rolled-back row is gone */
    CHECK(db_exec(db, "BEGIN", &err) == CF_OK);
    CHECK(stmt_open(&s, db, ins, "insert t", &err) == CF_OK);
    stmt_int(&s, 1, 5);
    CHECK(stmt_done(&s, &err) == CF_OK);
    CHECK(db_exec(db, "ROLLBACK", &err) == CF_OK);
    CHECK(stmt_open(&s, db, ins, "insert t", &err) == CF_OK);
    stmt_int(&s, 1, 7);
    CHECK(stmt_done(&s, &err) == CF_OK);
    CHECK(stmt_cache_size(db) == before + 2);

    /* the same SQL opened twice at once: the inner use gets its own statement */
    CHECK(stmt_open(&s, db, sel, "select t", &err) == CF_OK && s.slot != NULL);
    CHECK(stmt_open(&s2, db, sel, "select t", &err) == CF_OK && s2.slot == NULL);
    CHECK(stmt_step(&s, &row, &err) == CF_OK && row && sqlite3_column_int(s.st, 0) == 7);
    CHECK(stmt_step(&s2, &row, &err) == CF_OK && row && sqlite3_column_int(s2.st, 0) == 7);
    CHECK(stmt_step(&s, &row, &err) == CF_OK && !row);
    stmt_close(&s2);
    stmt_close(&s);
    stmt_close(&s); /* closing twice is harmless */
    CHECK(stmt_cache_size(db) == before + 3);

    /* stmt_run: a statement without results; one that returns a row is an internal error */
    static const char one[] = "SELECT 1", bump[] = "UPDATE t SET x = x + 1";
    CHECK(stmt_run(db, bump, &err) == CF_OK && sqlite3_changes(db) == 1);
    CHECK(stmt_run(db, one, &err) == CF_INTERNAL && strstr(err.msg, "returned a row") != NULL);
    CHECK(stmt_cache_size(db) == before + 5);

    /* SQL that does not compile is CF_DB and is not cached */
    CHECK(stmt_open(&s, db, nonsense, "nonsense", &err) == CF_DB);
    CHECK(strstr(err.msg, "nonsense") != NULL && s.st == NULL);
    stmt_close(&s);
    CHECK(stmt_cache_size(db) == before + 5);
    CHECK(db_exec(db, "DROP TABLE t", &err) == CF_OK);
}

/* A connection holding cached statements closes like any other (its cache is finalized). */
static void test_stmt_close(const char *path)
{
    static const char sql[] = "SELECT count(*) FROM submissions";
    struct cf_error err;
    struct stmt s;
    bool row;
    sqlite3 *other;
    CHECK(db_open(path, false, &other, &err) == CF_OK);
    CHECK(stmt_open(&s, other, sql, "count", &err) == CF_OK);
    CHECK(stmt_step(&s, &row, &err) == CF_OK && row);
    stmt_close(&s);
    CHECK(stmt_cache_size(other) >= 1);
    CHECK(sqlite3_close(other) == SQLITE_OK);
}

/* ---------- the runnable index against the walk it replaced ---------- */

static const char walk_sql[] =
    "SELECT group_concat(sequence) FROM (SELECT s.sequence FROM submissions s WHERE s.status = "
    "'queued' AND NOT EXISTS (SELECT 1 FROM submissions p WHERE p.conversation_id = "
    "s.conversation_id AND p.status != 'settled' AND p.sequence < s.sequence) ORDER BY "
    "s.sequence)";
static const char runnable_sql[] =
    "SELECT group_concat(sequence) FROM (SELECT sequence FROM runnable ORDER BY sequence)";

/* text_of returns the single text value sql yields on h ("" for NULL), in the arena. */
static const char *text_of(sqlite3 *h, const char *sql)
{
    struct cf_error err;
    struct stmt s;
    bool row = false;
    const char *out = "?";
    if (stmt_open(&s, h, sql, "probe", &err) == CF_OK && stmt_step(&s, &row, &err) == CF_OK &&
        row) {
        const unsigned char *t = sqlite3_column_text(s.st, 0);
        out = arena_strdup(&arena, t ? (const char *)t : "");
    }
    stmt_close(&s);
    return out;
}

/* old_pick is the claim query of schema 2 (a walk over queued rows), verbatim: the id it
 * picks for req at now, "" when none; *takeover_out as Claim reports it. */
static const char *old_pick(sqlite3 *h, const Cflue__V1__ClaimRequest *req, int64_t now,
                            bool *takeover_out)
{
    static const char expired[] =
        "SELECT submission_id FROM submissions WHERE status IN ('running','terminalizing') "
        "AND ((lease_expires_at > 0 AND lease_expires_at < ?1) OR "
        "(?4 > 0 AND owner_id = ?5 AND started_at < ?4)) "
        "AND (?2 = '' OR submission_id = ?2) AND (?3 = '' OR conversation_id = ?3) "
        "ORDER BY sequence LIMIT 1";
    static const char queued[] =
        "SELECT s.submission_id FROM submissions s WHERE s.status = 'queued' AND ?1 = ?1 "
        "AND (?2 = '' OR s.submission_id = ?2) AND (?3 = '' OR s.conversation_id = ?3) "
        "AND NOT EXISTS (SELECT 1 FROM submissions p WHERE p.conversation_id = "
        "s.conversation_id AND p.status IN ('queued','running','terminalizing','joining',"
        "'joined') AND p.sequence < s.sequence) ORDER BY s.sequence LIMIT 1";
    const char *sqls[2] = {expired, queued};
    for (int i = 0; i < 2; i++) {
        struct cf_error err;
        struct stmt s;
        bool row = false;
        CHECK(stmt_open(&s, h, sqls[i], "old pick", &err) == CF_OK);
        stmt_int(&s, 1, now);
        stmt_text(&s, 2, req->submission_id);
        stmt_text(&s, 3, req->conversation_id);
        stmt_int(&s, 4, pbtime_ms(req->reclaim_started_before));
        stmt_text(&s, 5, req->owner_id);
        CHECK(stmt_step(&s, &row, &err) == CF_OK);
        const char *id =
            row ? arena_strdup(&arena, (const char *)sqlite3_column_text(s.st, 0)) : "";
        stmt_close(&s);
        if (row) {
            *takeover_out = i == 0;
            return id;
        }
    }
    *takeover_out = false;
    return "";
}

/* A random history of a few conversations; the state it needs to make valid calls. */
struct history {
    sqlite3 *db;
    uint64_t rng;
    int64_t now;
    const char *subs[512];
    int n_subs;
    Cflue__V1__Fence *fences[64]; /* the latest claims (some stale by now) */
    int n_fences;
    Cflue__V1__JoinRequest *joins[64]; /* joinings claimed (some finished by now) */
    int n_joins;
    int mismatches;
};

static uint32_t rnd(struct history *h, uint32_t n)
{
    h->rng ^= h->rng << 13;
    h->rng ^= h->rng >> 7;
    h->rng ^= h->rng << 17;
    return (uint32_t)(h->rng % n);
}

static struct ledger_ctx hctx(struct history *h)
{
    struct ledger_ctx c = {.db = h->db, .arena = &arena, .cfg = &cfg, .now = h->now};
    return c;
}

static const char *hconv(struct history *h)
{
    static const char *convs[] = {"h0", "h1", "h2", "h3", "h4"};
    return convs[rnd(h, 5)];
}

static Cflue__V1__Fence *hfence(struct history *h)
{
    return h->n_fences ? h->fences[rnd(h, (uint32_t)h->n_fences)] : NULL;
}

static void remember_fence(struct history *h, Cflue__V1__Fence *f)
{
    h->fences[h->n_fences < 64 ? h->n_fences++ : (int)rnd(h, 64)] = f;
}

static enum cf_status h_admit(struct history *h)
{
    Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
    Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
    Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    msg.text = "m";
    req.agent = "assistant";
    req.conversation_id = (char *)hconv(h);
    req.message = &msg;
    if (rnd(h, 8) == 0) {
        req.kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
        req.message = NULL;
    }
    enum cf_status rc = ledger_admit(&c, &req, &out, &err);
    if (rc == CF_OK && h->n_subs < 512) {
        h->subs[h->n_subs++] = out.submission->submission_id;
    }
    return rc;
}

/* h_claim_req fills a random Claim request: any work, one conversation's, one submission, or
 * the owner's own attempts. */
static void h_claim_req(struct history *h, Cflue__V1__ClaimRequest *req,
                        Google__Protobuf__Duration *lease, Google__Protobuf__Timestamp *before)
{
    cflue__v1__claim_request__init(req);
    req->owner_id = rnd(h, 2) ? "A" : "B";
    pbdur_set(lease, 500 + rnd(h, 6000));
    req->lease_duration = lease;
    switch (rnd(h, 5)) {
    case 1:
        req->conversation_id = (char *)hconv(h);
        break;
    case 2:
        req->submission_id = h->n_subs ? (char *)h->subs[rnd(h, (uint32_t)h->n_subs)] : "";
        break;
    case 3:
        pbtime_set(before, h->now + 1);
        req->reclaim_started_before = before;
        break;
    default:
        break;
    }
}

static enum cf_status h_claim(struct history *h)
{
    Cflue__V1__ClaimRequest req;
    Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
    Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
    Google__Protobuf__Timestamp before = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    h_claim_req(h, &req, &lease, &before);
    enum cf_status rc = ledger_claim(&c, &req, &out, &err);
    if (rc == CF_OK && out.fence) {
        remember_fence(h, out.fence);
    }
    return rc;
}

static enum cf_status h_settle(struct history *h)
{
    Cflue__V1__SettleRequest req = CFLUE__V1__SETTLE_REQUEST__INIT;
    Cflue__V1__SettleResponse out = CFLUE__V1__SETTLE_RESPONSE__INIT;
    Cflue__V1__Fence bare = CFLUE__V1__FENCE__INIT;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    req.fence = hfence(h);
    if (rnd(h, 4) == 0 && h->n_subs) { /* a queued submission, without an attempt */
        bare.submission_id = (char *)h->subs[rnd(h, (uint32_t)h->n_subs)];
        req.fence = &bare;
    }
    if (!req.fence) {
        return CF_OK;
    }
    req.outcome = 1 + (Cflue__V1__Outcome)rnd(h, 3);
    req.reserve_only = *req.fence->attempt_id && rnd(h, 4) == 0;
    return ledger_settle(&c, &req, &out, &err);
}

static enum cf_status h_requeue(struct history *h)
{
    Cflue__V1__Submission out;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    Cflue__V1__Fence *f = hfence(h);
    return f ? ledger_requeue(&c, f, &out, &err) : CF_OK;
}

static enum cf_status h_join(struct history *h)
{
    Cflue__V1__ClaimJoinableRequest req = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    Cflue__V1__ClaimJoinableResponse out = CFLUE__V1__CLAIM_JOINABLE_RESPONSE__INIT;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    req.host = hfence(h);
    req.limit = (int32_t)rnd(h, 3);
    enum cf_status rc = req.host ? ledger_claim_joinable(&c, &req, &out, &err) : CF_OK;
    if (rc != CF_OK) {
        return rc;
    }
    for (size_t i = 0; i < out.n_submissions && h->n_joins < 64; i++) {
        Cflue__V1__JoinRequest *j = arena_alloc(&arena, sizeof(*j));
        cflue__v1__join_request__init(j);
        j->host = req.host;
        j->submission_id = out.submissions[i]->submission_id;
        h->joins[h->n_joins++] = j;
    }
    return CF_OK;
}

static enum cf_status h_finish_join(struct history *h)
{
    Cflue__V1__Submission out;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    if (!h->n_joins) {
        return CF_OK;
    }
    return ledger_finish_join(&c, h->joins[rnd(h, (uint32_t)h->n_joins)], rnd(h, 2), &out, &err);
}

static enum cf_status h_abort(struct history *h)
{
    Cflue__V1__RequestAbortRequest req = CFLUE__V1__REQUEST_ABORT_REQUEST__INIT;
    Cflue__V1__RequestAbortResponse out = CFLUE__V1__REQUEST_ABORT_RESPONSE__INIT;
    struct cf_error err;
    struct ledger_ctx c = hctx(h);
    if (!h->n_subs) {
        return CF_OK;
    }
    req.target_case = CFLUE__V1__REQUEST_ABORT_REQUEST__TARGET_SUBMISSION_ID;
    req.submission_id = (char *)h->subs[rnd(h, (uint32_t)h->n_subs)];
    return ledger_request_abort(&c, &req, &out, &err);
}

/* h_check compares the runnable table with the walk, and four Claims with the old query's
 * choice (each Claim rolled back). */
static void h_check(struct history *h, int step)
{
    struct cf_error err;
    const char *walk = text_of(h->db, walk_sql), *heads = text_of(h->db, runnable_sql);
    if (strcmp(walk, heads) != 0) {
        fprintf(stderr, "step %d: runnable [%s], walk [%s]\n", step, heads, walk);
        h->mismatches++;
    }
    for (int k = 0; k < 4; k++) {
        Cflue__V1__ClaimRequest req;
        Cflue__V1__ClaimResponse out = CFLUE__V1__CLAIM_RESPONSE__INIT;
        Google__Protobuf__Duration lease = GOOGLE__PROTOBUF__DURATION__INIT;
        Google__Protobuf__Timestamp before = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
        struct ledger_ctx c = hctx(h);
        bool old_takeover;
        h_claim_req(h, &req, &lease, &before);
        const char *want = old_pick(h->db, &req, h->now, &old_takeover);
        CHECK(db_exec(h->db, "SAVEPOINT probe", &err) == CF_OK);
        CHECK(ledger_claim(&c, &req, &out, &err) == CF_OK);
        const char *got = out.submission ? out.submission->submission_id : "";
        CHECK(db_exec(h->db, "ROLLBACK TO probe; RELEASE probe", &err) == CF_OK);
        if (strcmp(want, got) != 0 || (*got && old_takeover != out.takeover)) {
            fprintf(stderr, "step %d: claim (conv '%s' sub '%s' reclaim %d) got '%s', old '%s'\n",
                    step, req.conversation_id, req.submission_id,
                    req.reclaim_started_before != NULL, got, want);
            h->mismatches++;
        }
    }
}

static void test_runnable_property(const char *path)
{
    static enum cf_status (*const ops[])(struct history *) = {
        h_admit,  h_admit,   h_admit, h_claim, h_claim,       h_settle,
        h_settle, h_requeue, h_join,  h_join,  h_finish_join, h_abort};
    struct cf_error err;
    uint64_t seeds = getenv("CFLUE_SLOW") ? 1 : 4; /* valgrind: one history */
    for (uint64_t seed = 1; seed <= seeds; seed++) {
        struct history h = {.rng = 0x9E3779B97F4A7C15ull * seed, .now = 1700000000000};
        unlink(path);
        CHECK(db_open(path, true, &h.db, &err) == CF_OK);
        CHECK(db_exec(h.db, "BEGIN", &err) == CF_OK); /* one transaction: no commit per step */
        for (int step = 0; step < 400 && h.mismatches < 5; step++) {
            /* each call in a savepoint, rolled back when it fails, as the writer runs it */
            CHECK(db_exec(h.db, "SAVEPOINT op", &err) == CF_OK);
            enum cf_status rc = ops[rnd(&h, sizeof(ops) / sizeof(ops[0]))](&h);
            CHECK(rc != CF_DB && rc != CF_INTERNAL && rc != CF_CORRUPT && rc != CF_IO);
            CHECK(rc == CF_OK || db_exec(h.db, "ROLLBACK TO op", &err) == CF_OK);
            CHECK(db_exec(h.db, "RELEASE op", &err) == CF_OK);
            h.now += rnd(&h, 3) ? 10 : 2000 + rnd(&h, 4000);
            h_check(&h, step);
        }
        CHECK(h.mismatches == 0);
        CHECK(db_exec(h.db, "COMMIT", &err) == CF_OK);
        CHECK(sqlite3_close(h.db) == SQLITE_OK);
    }
}

/* ---------- migration from schema 2 ---------- */

static void test_migrate_from_2(const char *path)
{
    struct cf_error err;
    struct history h = {.rng = 77, .now = 1700000000000};
    unlink(path);
    CHECK(db_open(path, true, &h.db, &err) == CF_OK);
    for (int i = 0; i < 60; i++) {
        enum cf_status (*op)(struct history *) = i % 3 == 0   ? h_claim
                                                 : i % 5 == 0 ? h_settle
                                                              : h_admit;
        CHECK(db_exec(h.db, "SAVEPOINT op", &err) == CF_OK);
        CHECK(op(&h) == CF_OK || db_exec(h.db, "ROLLBACK TO op", &err) == CF_OK);
        CHECK(db_exec(h.db, "RELEASE op", &err) == CF_OK);
    }
    /* back to schema 2 exactly: no runnable table, triggers, Claim or List indexes (and below,
     * once the ledger of this version admitted rows, no parent column and its index, no
     * principal columns, no trace columns, no claimer start) */
    CHECK(db_exec(h.db,
                  "DROP TRIGGER runnable_on_admit; DROP TRIGGER runnable_on_status;"
                  "DROP TABLE runnable; DROP INDEX submissions_unsettled;"
                  "DROP INDEX submissions_by_lease; DROP INDEX submissions_by_owner;"
                  "DROP INDEX submissions_abort_requested;"
                  "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
                  &err) == CF_OK);
    for (int i = 0; i < 20; i++) {
        CHECK(h_admit(&h) == CF_OK); /* admitted at version 2: no trigger sees them */
    }
    for (int i = 0; i < 3; i++) { /* and new conversations, whose heads are queued */
        Cflue__V1__AdmitRequest req = CFLUE__V1__ADMIT_REQUEST__INIT;
        Cflue__V1__AdmitResponse out = CFLUE__V1__ADMIT_RESPONSE__INIT;
        Cflue__V1__Message msg = CFLUE__V1__MESSAGE__INIT;
        struct ledger_ctx c = hctx(&h);
        char conv[16];
        snprintf(conv, sizeof(conv), "v2-%d", i);
        msg.text = "at version 2";
        req.agent = "assistant";
        req.conversation_id = conv;
        req.message = &msg;
        CHECK(ledger_admit(&c, &req, &out, &err) == CF_OK);
    }
    CHECK(db_exec(h.db,
                  "DROP INDEX submissions_by_parent;"
                  "ALTER TABLE submissions DROP COLUMN parent_submission_id;"
                  "ALTER TABLE submissions DROP COLUMN principal;"
                  "ALTER TABLE conversations DROP COLUMN principal;"
                  "ALTER TABLE submissions DROP COLUMN traceparent;"
                  "ALTER TABLE submissions DROP COLUMN tracestate;"
                  "ALTER TABLE submissions DROP COLUMN owner_started_at",
                  &err) == CF_OK);
    CHECK(sqlite3_close(h.db) == SQLITE_OK);
    sqlite3 *reader;
    CHECK(db_open(path, false, &reader, &err) == CF_VERSION);
    CHECK(strstr(err.msg, "schema version 2") != NULL);
    CHECK(db_open(path, true, &h.db, &err) == CF_OK);
    CHECK(!strcmp(text_of(h.db, "SELECT value FROM meta WHERE key = 'schema_version'"),
                  DB_SCHEMA_VERSION));
    const char *walk = text_of(h.db, walk_sql);
    CHECK(*walk && !strcmp(walk, text_of(h.db, runnable_sql)));
    h_check(&h, -1);
    CHECK(h.mismatches == 0);
    CHECK(sqlite3_close(h.db) == SQLITE_OK);
    unlink(path);
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
    test_clock_step();
    test_clock_step_back_keeps_times_positive();
    test_settle_without_attempt_retried();
    test_pages_bounded_by_bytes();
    test_extend_leases();
    test_reclaim_by_owner_start();
    test_idempotency();
    test_trace_context();
    test_page_bytes();
    test_compact_not_joined();
    test_held_work_listed_without_the_history();
    test_schema_version(path);
    test_connection_settings(path);
    test_stmt();
    test_stmt_close(path);
    char other[160];
    snprintf(other, sizeof(other), "%s.2", path);
    test_runnable_property(other);
    test_migrate_from_2(other);
    arena_cleanup(&arena);
    CHECK(sqlite3_close(db) == SQLITE_OK); /* every statement finalized: nothing left open */
    char side[160];
    unlink(path);
    snprintf(side, sizeof(side), "%s-wal", path);
    unlink(side);
    snprintf(side, sizeof(side), "%s-shm", path);
    unlink(side);
    return check_done("test_ledger");
}
