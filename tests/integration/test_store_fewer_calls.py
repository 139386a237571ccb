"""The fields that let a conversation cost fewer storaged calls (store.proto): Admit with a claim,
Claim's head_offset and queued_behind, Append with mark_input_applied and its queued and
abort_requested hints, Settle with records and conversation_queued, List by owner and abort
intent. Each against a real storaged over loopback gRPC."""

import time
import unittest

import grpc

from cflue_harness import (
    ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT, StoragedTestCase, admit_request,
    append, claim, common_pb2, duration, error_reason, get, get_conversation, list_all,
    read_all, record, request_abort, settle, store_pb2, timestamp, ts_ms)

STALE = grpc.StatusCode.ABORTED
RUNNING = common_pb2.SUBMISSION_STATUS_RUNNING
QUEUED = common_pb2.SUBMISSION_STATUS_QUEUED
SETTLED = common_pb2.SUBMISSION_STATUS_SETTLED


def admit_claiming(stub, conv, text='hi', key='', owner='me', lease_ms=30000, **claim_fields):
    req = admit_request(conv=conv, text=text, key=key)
    req.claim.owner_id = owner
    if lease_ms:
        req.claim.lease_duration.CopyFrom(duration(lease_ms))
    for k, v in claim_fields.items():
        if k == 'reclaim_started_before':
            req.claim.reclaim_started_before.CopyFrom(v)
        else:
            setattr(req.claim, k, v)
    return stub.admit(req, timeout=5)


def append_marking(stub, fence_, records, max_attempts=0, timeout_ms=0):
    req = store_pb2.AppendRequest(fence=fence_, records=records)
    req.mark_input_applied.max_attempts = max_attempts
    if timeout_ms:
        req.mark_input_applied.timeout.CopyFrom(duration(timeout_ms))
    return stub.append(req, timeout=10)


def settle_with(stub, fence_, records, outcome=common_pb2.OUTCOME_COMPLETED, error='',
                reserve_only=False, mark=None):
    """Settle with records; mark: (max_attempts, timeout_ms) of a mark_input_applied."""
    req = store_pb2.SettleRequest(fence=fence_, outcome=outcome, error=error,
                                  reserve_only=reserve_only, records=records)
    if mark:
        req.mark_input_applied.max_attempts = mark[0]
        if mark[1]:
            req.mark_input_applied.timeout.CopyFrom(duration(mark[1]))
    return stub.settle(req, timeout=10)


class AdmitClaimTest(StoragedTestCase):

    def test_runnable_admission_is_claimed_in_the_same_call(self):
        r = admit_claiming(self.stub, 'ac-run', owner='owner-1', lease_ms=5000)
        self.assertFalse(r.deduplicated)
        self.assertTrue(r.HasField('claim'))
        c = r.claim
        sid = r.submission.submission_id
        self.assertEqual(c.submission.submission_id, sid)
        self.assertFalse(c.takeover)
        self.assertEqual(c.fence.submission_id, sid)
        self.assertTrue(c.fence.attempt_id.startswith('att_'))
        self.assertEqual(c.fence.epoch, 1)
        self.assertEqual(c.head_offset, -1)     # an empty conversation
        self.assertEqual(c.queued_behind, 0)
        row = get(self.stub, sid)
        self.assertEqual(row.status, RUNNING)
        self.assertEqual(row.owner_id, 'owner-1')
        self.assertEqual(row.attempt_id, c.fence.attempt_id)
        self.assertEqual(row.attempt_count, 1)
        lease = ts_ms(row.lease_expire_time) - ts_ms(row.start_time)
        self.assertEqual(lease, 5000)
        # the fence works for writes, exactly like a Claim's
        a = append(self.stub, c.fence, [record(id_='r1')])
        self.assertEqual(a.first_offset, 0)
        # and nothing is left for a Claim
        self.assertFalse(claim(self.stub, owner='other').HasField('submission'))

    def test_admission_behind_unsettled_work_is_not_claimed(self):
        first = admit_claiming(self.stub, 'ac-behind')
        self.assertTrue(first.HasField('claim'))
        second = admit_claiming(self.stub, 'ac-behind', text='second')
        self.assertFalse(second.HasField('claim'))
        row = get(self.stub, second.submission.submission_id)
        self.assertEqual(row.status, QUEUED)
        self.assertEqual(row.attempt_count, 0)
        self.assertEqual(row.owner_id, '')
        # once the first settles, a Claim takes it, and the conversation's epoch went on
        settle(self.stub, first.claim.fence)
        c = claim(self.stub, conversation_id='ac-behind')
        self.assertEqual(c.submission.submission_id, second.submission.submission_id)
        self.assertEqual(c.fence.epoch, 2)

    def test_deduplicated_admit_claims_nothing(self):
        r = admit_claiming(self.stub, 'ac-dedup', key='k1', owner='o1')
        self.assertTrue(r.HasField('claim'))
        again = admit_claiming(self.stub, 'ac-dedup', key='k1', owner='o2')
        self.assertTrue(again.deduplicated)
        self.assertFalse(again.HasField('claim'))
        row = get(self.stub, r.submission.submission_id)
        self.assertEqual(row.attempt_id, r.claim.fence.attempt_id)  # no second attempt
        self.assertEqual(row.owner_id, 'o1')
        self.assertEqual(row.attempt_count, 1)
        # the claim is no part of the admission's identity: without one it is the same too
        plain = self.stub.admit(admit_request(conv='ac-dedup', text='hi', key='k1'))
        self.assertTrue(plain.deduplicated)
        self.assertEqual(plain.submission.submission_id, r.submission.submission_id)
        # a deduplicated Admit of a submission still queued claims nothing either
        blocked = admit_claiming(self.stub, 'ac-dedup', key='k2')
        self.assertFalse(blocked.HasField('claim'))
        settle(self.stub, r.claim.fence)
        again = admit_claiming(self.stub, 'ac-dedup', key='k2')
        self.assertTrue(again.deduplicated)
        self.assertFalse(again.HasField('claim'))
        self.assertEqual(get(self.stub, blocked.submission.submission_id).status, QUEUED)

    def test_invalid_claim_fields_are_refused_and_admit_nothing(self):
        cases = [
            ({'owner': ''}, 'claim.owner_id'),
            ({'submission_id': 'sub_x'}, 'claim.submission_id'),
            ({'conversation_id': 'ac-bad'}, 'claim.conversation_id'),
            ({'reclaim_started_before': timestamp(1000)}, 'claim.reclaim_started_before'),
            ({'lease_ms': 5}, 'lease_duration'),
        ]
        for kwargs, field in cases:
            e = self.assertRpcError(INVALID_ARGUMENT, admit_claiming, self.stub, 'ac-bad',
                                    details_has=field, **kwargs)
            self.assertEqual(error_reason(e), 'INVALID_ARGUMENT')
        self.assertEqual(list_all(self.stub, conversation_id='ac-bad'), [])


class ClaimHintsTest(StoragedTestCase):

    def test_head_offset_and_queued_behind(self):
        a = admit_request(conv='hints', text='a')
        sa = self.stub.admit(a).submission.submission_id
        for t in ('b', 'c'):
            self.stub.admit(admit_request(conv='hints', text=t))
        c = claim(self.stub, conversation_id='hints')
        self.assertEqual(c.submission.submission_id, sa)
        self.assertEqual(c.head_offset, -1)
        self.assertEqual(c.queued_behind, 2)
        append(self.stub, c.fence, [record(id_='x'), record(id_='y')])
        s = settle(self.stub, c.fence)
        self.assertEqual(s.conversation_queued, 2)
        c2 = claim(self.stub, conversation_id='hints')
        self.assertEqual(c2.head_offset, 2)     # two records and a settlement record
        self.assertEqual(c2.queued_behind, 1)
        self.assertEqual(get_conversation(self.stub, 'hints').head_offset, 2)

    def test_takeover_carries_the_hints(self):
        s = self.stub.admit(admit_request(conv='hints-t')).submission.submission_id
        self.stub.admit(admit_request(conv='hints-t', text='behind'))
        a = claim(self.stub, owner='a', submission_id=s, lease_ms=100)
        append(self.stub, a.fence, [record(id_='r')])
        time.sleep(0.25)
        b = claim(self.stub, owner='b', conversation_id='hints-t')
        self.assertTrue(b.takeover)
        self.assertEqual(b.submission.submission_id, s)
        self.assertEqual(b.head_offset, 0)
        self.assertEqual(b.queued_behind, 1)


class AppendMarkTest(StoragedTestCase):

    def running(self, conv):
        r = admit_claiming(self.stub, conv)
        return r.submission.submission_id, r.claim.fence

    def test_mark_input_applied_with_the_append(self):
        sid, f = self.running('am')
        before = get(self.stub, sid)
        self.assertEqual(ts_ms(before.input_apply_time), 0)
        r = append_marking(self.stub, f, [record('user_message', id_='in')], max_attempts=3,
                           timeout_ms=60000)
        self.assertEqual((r.first_offset, r.last_offset), (0, 0))
        self.assertFalse(r.deduplicated)
        self.assertTrue(r.HasField('submission'))
        self.assertEqual(r.submission.submission_id, sid)
        self.assertEqual(r.submission.max_attempts, 3)
        self.assertGreater(ts_ms(r.submission.input_apply_time), 0)
        self.assertEqual(ts_ms(r.submission.deadline), ts_ms(r.submission.start_time) + 60000)
        row = get(self.stub, sid)
        self.assertEqual(row.max_attempts, 3)
        self.assertEqual(ts_ms(row.input_apply_time), ts_ms(r.submission.input_apply_time))
        # an Append without it answers no submission
        plain = append(self.stub, f, [record(id_='out')])
        self.assertFalse(plain.HasField('submission'))

    def test_deduplicated_retry_still_marks_and_keeps_the_first_stamp(self):
        sid, f = self.running('am-dedup')
        append(self.stub, f, [record('user_message', id_='in')])
        self.assertEqual(ts_ms(get(self.stub, sid).input_apply_time), 0)
        # the retry of a batch that landed (its answer was lost) still marks the input applied
        r = append_marking(self.stub, f, [record('user_message', id_='in')], max_attempts=4)
        self.assertTrue(r.deduplicated)
        self.assertEqual(r.first_offset, 0)
        stamp = ts_ms(r.submission.input_apply_time)
        self.assertGreater(stamp, 0)
        self.assertEqual(r.submission.max_attempts, 4)
        # again: the first stamp and budgets win, as with MarkInputApplied
        r2 = append_marking(self.stub, f, [record('user_message', id_='in')], max_attempts=7)
        self.assertTrue(r2.deduplicated)
        self.assertEqual(ts_ms(r2.submission.input_apply_time), stamp)
        self.assertEqual(r2.submission.max_attempts, 4)
        self.assertEqual(len(read_all(self.stub, 'am-dedup')), 1)

    def test_stale_fence_writes_nothing(self):
        sid, f = self.running('am-stale')
        stale = store_pb2.Fence(submission_id=sid, attempt_id='att_not_it', epoch=f.epoch)
        e = self.assertRpcError(STALE, append_marking, self.stub, stale,
                                [record('user_message', id_='in')], max_attempts=2)
        self.assertEqual(error_reason(e), 'STALE_FENCE')
        row = get(self.stub, sid)
        self.assertEqual(ts_ms(row.input_apply_time), 0)
        self.assertEqual(row.max_attempts, 10)
        self.assertEqual(read_all(self.stub, 'am-stale'), [])

    def test_terminalizing_submission_is_refused_without_appending(self):
        """MarkInputApplied needs a running submission: a reserved one refuses the whole
        Append (its records are not written either)."""
        sid, f = self.running('am-term')
        settle(self.stub, f, common_pb2.OUTCOME_FAILED, 'x', reserve_only=True)
        self.assertRpcError(FAILED_PRECONDITION, append_marking, self.stub, f,
                            [record(id_='late')])
        self.assertEqual(read_all(self.stub, 'am-term'), [])
        self.assertEqual(ts_ms(get(self.stub, sid).input_apply_time), 0)

    def test_invalid_budgets_are_refused(self):
        sid, f = self.running('am-bad')
        self.assertRpcError(INVALID_ARGUMENT, append_marking, self.stub, f, [record(id_='a')],
                            max_attempts=-1, details_has='mark_input_applied.max_attempts')
        self.assertEqual(read_all(self.stub, 'am-bad'), [])

    def test_queued_and_abort_requested(self):
        sid, f = self.running('am-hints')
        r = append(self.stub, f, [record(id_='a')])
        self.assertEqual(r.queued, 0)
        self.assertFalse(r.abort_requested)
        q = [self.stub.admit(admit_request(conv='am-hints', text=t)).submission.submission_id
             for t in ('q1', 'q2')]
        r = append(self.stub, f, [record(id_='b')])
        self.assertEqual(r.queued, 2)
        self.assertFalse(r.abort_requested)
        # an intent on a queued submission is not the fenced one's
        request_abort(self.stub, submission_id=q[1])
        self.assertFalse(append(self.stub, f, [record(id_='c')]).abort_requested)
        request_abort(self.stub, submission_id=sid)
        r = append(self.stub, f, [record(id_='d')])
        self.assertTrue(r.abort_requested)
        self.assertEqual(r.queued, 2)
        # a deduplicated Append carries them as well
        r = append(self.stub, f, [record(id_='d')])
        self.assertTrue(r.deduplicated)
        self.assertTrue(r.abort_requested)
        self.assertEqual(r.queued, 2)


class SettleRecordsTest(StoragedTestCase):

    def running(self, conv, text='hi'):
        r = admit_claiming(self.stub, conv, text=text)
        return r.submission.submission_id, r.claim.fence

    def test_records_are_appended_before_the_settlement(self):
        sid, f = self.running('sr')
        append(self.stub, f, [record('user_message', id_='in')])
        s = settle_with(self.stub, f, [record(id_='ans-1', body={'text': 'final'}),
                                       record('signal', id_='sig', body={'kind': 'done'})])
        self.assertFalse(s.already_settled)
        self.assertEqual(s.records_first_offset, 1)
        self.assertEqual(s.record_offset, 3)
        self.assertEqual(s.submission.status, SETTLED)
        recs = read_all(self.stub, 'sr')
        self.assertEqual([x.id for x in recs], ['in', 'ans-1', 'sig', 'settled:' + sid])
        self.assertEqual([x.offset for x in recs], [0, 1, 2, 3])
        self.assertEqual(recs[1].assistant_message.text, 'final')
        self.assertEqual(recs[1].submission_id, sid)
        self.assertEqual(recs[1].attempt_id, f.attempt_id)

        # an identical retry answers already_settled and appends nothing
        again = settle_with(self.stub, f, [record(id_='ans-1', body={'text': 'final'}),
                                           record('signal', id_='sig', body={'kind': 'done'})])
        self.assertTrue(again.already_settled)
        self.assertEqual(again.record_offset, 3)
        self.assertEqual(again.records_first_offset, -1)
        self.assertEqual(len(read_all(self.stub, 'sr')), 4)

    def test_the_input_is_stamped_applied_with_the_settlement(self):
        """A first answer that ends the work: the input, the answer and the input's stamp in
        the Settle. Stamped after the records and before the settlement; on a submission whose
        outcome is reserved the whole Settle is refused, records included; and the stamp needs
        an attempt's fence."""
        sid, f = self.running('sr-mark')
        s = settle_with(self.stub, f, [record('user_message', id_='in'),
                                       record(id_='ans-1', body={'text': 'final'})],
                        mark=(3, 60000))
        self.assertEqual(s.submission.status, SETTLED)
        self.assertEqual(s.submission.max_attempts, 3)
        applied = ts_ms(s.submission.input_apply_time)
        self.assertGreater(applied, 0)
        self.assertLessEqual(applied, ts_ms(s.submission.settle_time))
        self.assertEqual(ts_ms(s.submission.deadline), ts_ms(s.submission.start_time) + 60000)
        self.assertEqual(get(self.stub, sid), s.submission)
        self.assertEqual([x.id for x in read_all(self.stub, 'sr-mark')],
                         ['in', 'ans-1', 'settled:' + sid])

        sid, f = self.running('sr-mark-res')
        settle(self.stub, f, common_pb2.OUTCOME_FAILED, 'x', reserve_only=True)
        self.assertRpcError(FAILED_PRECONDITION, settle_with, self.stub, f,
                            [record(id_='late')], common_pb2.OUTCOME_FAILED, 'x', mark=(3, 0))
        self.assertEqual(read_all(self.stub, 'sr-mark-res'), [])
        self.assertEqual(ts_ms(get(self.stub, sid).input_apply_time), 0)

        sid, f = self.running('sr-mark-bad')
        self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub, f, [record(id_='a')],
                            mark=(-1, 0), details_has='mark_input_applied.max_attempts')
        no_attempt = store_pb2.Fence(submission_id=sid)
        self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub, no_attempt, [],
                            mark=(3, 0), details_has='mark_input_applied needs a fence')
        self.assertEqual(get(self.stub, sid).status, RUNNING)

    def test_without_records_the_offset_is_minus_one(self):
        sid, f = self.running('sr-none')
        s = settle(self.stub, f)
        self.assertEqual(s.records_first_offset, -1)
        self.assertEqual(s.record_offset, 0)

    def test_reserve_then_finish_with_records(self):
        sid, f = self.running('sr-res')
        r = settle_with(self.stub, f, [record(id_='partial')], common_pb2.OUTCOME_FAILED,
                        'boom', reserve_only=True)
        self.assertEqual(r.records_first_offset, 0)
        self.assertEqual(r.record_offset, -1)
        self.assertEqual(r.submission.status, common_pb2.SUBMISSION_STATUS_TERMINALIZING)
        done = settle_with(self.stub, f, [record(id_='last')], common_pb2.OUTCOME_FAILED, 'boom')
        self.assertEqual(done.records_first_offset, 1)
        self.assertEqual(done.record_offset, 2)
        self.assertEqual([x.id for x in read_all(self.stub, 'sr-res')],
                         ['partial', 'last', 'settled:' + sid])

    def test_stale_fence_writes_nothing(self):
        sid, f = self.running('sr-stale')
        stale = store_pb2.Fence(submission_id=sid, attempt_id='att_not_it', epoch=f.epoch)
        e = self.assertRpcError(STALE, settle_with, self.stub, stale, [record(id_='x')])
        self.assertEqual(error_reason(e), 'STALE_FENCE')
        self.assertEqual(read_all(self.stub, 'sr-stale'), [])
        self.assertEqual(get(self.stub, sid).status, RUNNING)

    def test_invalid_record_settles_nothing(self):
        sid, f = self.running('sr-bad')
        bad = common_pb2.Record(id='no-body')
        e = self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub, f, [bad])
        self.assertEqual(error_reason(e), 'MISSING_RECORD_BODY')
        e = self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub, f,
                                [record(id_='settled:' + sid)])
        self.assertEqual(error_reason(e), 'RESERVED_RECORD_ID')
        e = self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub, f,
                                [record('submission_settled')])
        self.assertEqual(error_reason(e), 'RESERVED_RECORD_TYPE')
        # records need an attempt: a queued submission's settle (no attempt) cannot carry them
        q = self.stub.admit(admit_request(conv='sr-bad', text='q')).submission.submission_id
        self.assertRpcError(INVALID_ARGUMENT, settle_with, self.stub,
                            store_pb2.Fence(submission_id=q), [record(id_='y')],
                            common_pb2.OUTCOME_FAILED, 'no', details_has='attempt')
        # a record id stored with other content: the same conflict as Append, nothing settled
        append(self.stub, f, [record(id_='taken', body={'text': 'one'})])
        e = self.assertRpcError(ALREADY_EXISTS, settle_with, self.stub, f,
                                [record(id_='taken', body={'text': 'two'})])
        self.assertEqual(error_reason(e), 'RECORD_CONFLICT')
        self.assertEqual(get(self.stub, sid).status, RUNNING)
        self.assertEqual(get(self.stub, q).status, QUEUED)
        self.assertEqual([x.id for x in read_all(self.stub, 'sr-bad')], ['taken'])

    def test_record_over_the_size_limit_settles_nothing(self):
        sd = self.start_storaged(extra_args=('--max-message-bytes', str(1 << 20)))
        r = admit_claiming(sd.stub, 'sr-big')
        f = r.claim.fence
        big = record(id_='big', body={'text': 'x' * (600 << 10)})
        self.assertRpcError(INVALID_ARGUMENT, settle_with, sd.stub, f, [big],
                            details_has='records[0]')
        self.assertEqual(get(sd.stub, r.submission.submission_id).status, RUNNING)
        self.assertEqual(read_all(sd.stub, 'sr-big'), [])

    def test_conversation_queued(self):
        sid, f = self.running('sr-q')
        q = [self.stub.admit(admit_request(conv='sr-q', text=t)).submission.submission_id
             for t in ('q1', 'q2', 'q3')]
        # q1 joins (joining), so it goes back to the queue when the host settles
        j = self.stub.claim_joinable(store_pb2.ClaimJoinableRequest(host=f, limit=1))
        self.assertEqual([x.submission_id for x in j.submissions], [q[0]])
        s = settle_with(self.stub, f, [record(id_='ans')])
        self.assertEqual(s.conversation_queued, 3)
        c = claim(self.stub, conversation_id='sr-q')
        self.assertEqual(c.queued_behind, 2)
        s = settle(self.stub, c.fence)
        self.assertEqual(s.conversation_queued, 2)
        self.assertEqual(settle(self.stub, c.fence).conversation_queued, 2)  # already settled


class ListFiltersTest(StoragedTestCase):

    def test_owner_and_abort_filters_with_paging(self):
        mine, theirs = [], []
        for i in range(5):
            mine.append(admit_claiming(self.stub, 'lf-m%d' % i, owner='me').submission
                        .submission_id)
            theirs.append(admit_claiming(self.stub, 'lf-t%d' % i, owner='them').submission
                          .submission_id)
        queued = self.stub.admit(admit_request(conv='lf-m0', text='q')).submission.submission_id
        got = [s.submission_id for s in list_all(self.stub, page=2, owner_id='me')]
        self.assertEqual(got, mine)
        self.assertTrue(all(s.owner_id == 'them' for s in list_all(self.stub, owner_id='them')))
        self.assertEqual(list_all(self.stub, owner_id='nobody'), [])

        request_abort(self.stub, submission_id=mine[1])
        request_abort(self.stub, submission_id=theirs[3])
        request_abort(self.stub, conversation_id='lf-m0')   # mine[0] and the queued one
        got = [s.submission_id for s in list_all(self.stub, page=1, abort_requested=True)]
        self.assertEqual(got, [mine[0], mine[1], theirs[3], queued])
        got = [s.submission_id for s in
               list_all(self.stub, page=1, abort_requested=True, owner_id='me')]
        self.assertEqual(got, [mine[0], mine[1]])
        got = [s.submission_id for s in list_all(self.stub, abort_requested=True,
                                                 statuses=[QUEUED])]
        self.assertEqual(got, [queued])
        got = [s.submission_id for s in list_all(self.stub, abort_requested=True,
                                                 conversation_id='lf-t3')]
        self.assertEqual(got, [theirs[3]])
        # abort_requested=False is no filter
        self.assertEqual(len(list_all(self.stub, abort_requested=False)), 11)

    def test_page_token_is_bound_to_the_new_filters(self):
        for i in range(3):
            admit_claiming(self.stub, 'lt-%d' % i, owner='me')
        p = self.stub.list(store_pb2.ListRequest(page_size=1, owner_id='me'))
        self.assertTrue(p.next_page_token)
        for other in (store_pb2.ListRequest(page_size=1, page_token=p.next_page_token),
                      store_pb2.ListRequest(page_size=1, page_token=p.next_page_token,
                                            owner_id='them'),
                      store_pb2.ListRequest(page_size=1, page_token=p.next_page_token,
                                            owner_id='me', abort_requested=True)):
            e = self.assertRpcError(INVALID_ARGUMENT, self.stub.list, other)
            self.assertEqual(error_reason(e), 'INVALID_PAGE_TOKEN')
        # a token of no new filter is still valid without them
        p = self.stub.list(store_pb2.ListRequest(page_size=1))
        n = self.stub.list(store_pb2.ListRequest(page_size=1, page_token=p.next_page_token))
        self.assertEqual(len(n.submissions), 1)

    def test_invalid_owner_is_refused(self):
        self.assertRpcError(INVALID_ARGUMENT, self.stub.list,
                            store_pb2.ListRequest(owner_id='not valid'), details_has='owner_id')


class IndexesTest(StoragedTestCase):

    def test_new_lookups_are_index_backed(self):
        """The plans of the new counts and filters, on the database storaged created."""
        import sqlite3
        admit_claiming(self.stub, 'ix')
        self.storaged.stop()
        con = sqlite3.connect(self.storaged.db)
        try:
            def plan(sql, *args):
                return ' '.join(r[3] for r in con.execute('EXPLAIN QUERY PLAN ' + sql, args))
            p = plan("SELECT count(*) FROM submissions WHERE conversation_id = ? AND "
                     "status = 'queued' AND sequence > ?", 'ix', 0)
            self.assertIn('USING COVERING INDEX submissions_by_conversation', p)
            # List's statement (ledger_list) with the owner filter, and with the abort filter
            base = ("SELECT * FROM submissions WHERE sequence > ?1 AND (?2 = '' OR "
                    "conversation_id = ?2) AND (?3 = '' OR joined_into = ?3) ")
            p = plan(base + "AND owner_id = ?5 ORDER BY sequence LIMIT ?4", 0, '', '', 10, 'me')
            self.assertIn('INDEX submissions_by_owner', p)
            self.assertNotIn('TEMP B-TREE', p)
            p = plan(base + "AND abort_requested_at IS NOT NULL ORDER BY sequence LIMIT ?4",
                     0, '', '', 10)
            self.assertIn('INDEX submissions_abort_requested', p)
            self.assertNotIn('TEMP B-TREE', p)
        finally:
            con.close()


if __name__ == '__main__':
    unittest.main()
