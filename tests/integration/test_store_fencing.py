"""Fencing: once attempt B took over attempt A's expired lease, no write of A lands."""

import json
import time
import unittest

import grpc
STALE = grpc.StatusCode.ABORTED  # a stale fence (reason STALE_FENCE)
from cflue_harness import (
    ts_ms, error_reason, duration,
    FAILED_PRECONDITION, StoragedTestCase, common_pb2,
    admit, append, claim, claim_joinable, finalize_join, get, heartbeat, list_all,
    mark_input_applied, read_all, record, release, requeue, revert_join, settle)

LEASE_MS = 300


class FencingTest(StoragedTestCase):

    def take_over(self, conv='fenced'):
        s = admit(self.stub, conv=conv, text='host').submission
        a = claim(self.stub, owner='owner-a', lease_ms=LEASE_MS)
        self.assertTrue(a.HasField('submission'))
        self.assertEqual(a.submission.submission_id, s.submission_id)
        time.sleep(LEASE_MS / 1000.0 + 0.15)
        b = claim(self.stub, owner='owner-b', lease_ms=30000)
        self.assertTrue(b.HasField('submission'), 'B claimed nothing after A expired')
        self.assertEqual(b.submission.submission_id, s.submission_id)
        self.assertTrue(b.takeover)
        self.assertNotEqual(b.fence.attempt_id, a.fence.attempt_id)
        self.assertTrue(b.fence.attempt_id.startswith('att_'))
        self.assertGreater(b.fence.epoch, a.fence.epoch)
        self.assertEqual(b.submission.owner_id, 'owner-b')
        self.assertEqual(b.submission.attempt_count, 2)
        self.assertEqual(b.submission.status, common_pb2.SUBMISSION_STATUS_RUNNING)
        return s, a.fence, b.fence

    def test_every_write_of_the_stale_attempt_is_refused(self):
        """Takeover after lease expiry: A's Append, Heartbeat (lost), MarkInputApplied,
        Requeue, ClaimJoinable, FinalizeJoin, RevertJoin and Settle are all refused; B's
        Append and Settle succeed and only B's records are in the stream."""
        s, fa, fb = self.take_over()
        sid = s.submission_id
        q1 = admit(self.stub, conv='fenced', text='queued-1').submission.submission_id
        q2 = admit(self.stub, conv='fenced', text='queued-2').submission.submission_id
        P = STALE  # ABORTED, reason STALE_FENCE

        e = self.assertRpcError(P, append, self.stub, fa, [record(id_='a-1', body={'by': 'a'})])
        self.assertTrue(e.details())
        self.assertEqual(error_reason(e), 'STALE_FENCE')
        h = heartbeat(self.stub, 'owner-a', [fa])
        self.assertEqual(list(h.lost), [sid])
        self.assertEqual(list(h.renewed), [])
        # A's fence presented by B's owner is stale as well
        h = heartbeat(self.stub, 'owner-b', [fa])
        self.assertEqual(list(h.lost), [sid])
        self.assertRpcError(P, mark_input_applied, self.stub, fa, 3, 1000)
        self.assertRpcError(P, requeue, self.stub, fa)
        self.assertRpcError(P, claim_joinable, self.stub, fa)
        self.assertEqual(get(self.stub, q1).status, common_pb2.SUBMISSION_STATUS_QUEUED)
        # B makes q1 and q2 JOINING; A may neither finalize nor revert them
        self.assertEqual([x.submission_id for x in claim_joinable(self.stub, fb)], [q1, q2])
        self.assertRpcError(P, finalize_join, self.stub, fa, q1)
        self.assertRpcError(P, revert_join, self.stub, fa, q2)
        self.assertEqual(get(self.stub, q1).status, common_pb2.SUBMISSION_STATUS_JOINING)
        self.assertEqual(get(self.stub, q2).status, common_pb2.SUBMISSION_STATUS_JOINING)
        self.assertRpcError(P, settle, self.stub, fa, common_pb2.OUTCOME_COMPLETED)
        self.assertRpcError(P, settle, self.stub, fa, common_pb2.OUTCOME_FAILED, 'a failed')
        self.assertRpcError(P, settle, self.stub, fa, common_pb2.OUTCOME_COMPLETED, reserve_only=True)
        # A's record naming a joining delivery is refused too
        self.assertRpcError(P, append, self.stub, fa, [record(submission_id=q1)])

        # the row is untouched by A's attempts
        row = get(self.stub, sid)
        self.assertEqual(row.status, common_pb2.SUBMISSION_STATUS_RUNNING)
        self.assertEqual(row.attempt_id, fb.attempt_id)
        self.assertEqual(row.epoch, fb.epoch)
        self.assertEqual(row.owner_id, 'owner-b')
        self.assertEqual(ts_ms(row.input_apply_time), 0)
        self.assertEqual(row.max_attempts, 10)

        # B works normally
        h = heartbeat(self.stub, 'owner-b', [fb])
        self.assertEqual(list(h.renewed), [sid])
        mark_input_applied(self.stub, fb)
        finalize_join(self.stub, fb, q1)
        r = append(self.stub, fb, [record('assistant_message', {'by': 'b'}, id_='b-1'),
                                   record('assistant_message', {'by': 'b', 'for': 'q1'},
                                          submission_id=q1)])
        self.assertEqual((r.first_offset, r.last_offset), (0, 1))
        st = settle(self.stub, fb, common_pb2.OUTCOME_COMPLETED)
        self.assertEqual(st.submission.status, common_pb2.SUBMISSION_STATUS_SETTLED)
        self.assertEqual(list(st.settled_with), [q1])
        self.assertEqual(get(self.stub, q2).status, common_pb2.SUBMISSION_STATUS_QUEUED)

        # after B settled, A is still refused
        self.assertRpcError(P, settle, self.stub, fa, common_pb2.OUTCOME_COMPLETED)
        self.assertRpcError(P, append, self.stub, fa, [record(id_='a-2')])

        recs = read_all(self.stub, 'fenced')
        self.assertEqual(len(recs), 4, [r.id for r in recs])
        self.assertEqual([x.offset for x in recs], [0, 1, 2, 3])
        for x in recs:
            self.assertEqual(x.attempt_id, fb.attempt_id, 'record %s not written by B' % x.id)
            if x.WhichOneof('body') != 'submission_settled':
                self.assertIn('"by": "b"', x.assistant_message.text)
        self.assertEqual(sorted(x.id for x in recs
                                if x.WhichOneof('body') == 'submission_settled'),
                         sorted(['settled:' + sid, 'settled:' + q1]))

    def test_takeover_keeps_budget_and_rejects_reclaim(self):
        """A takeover keeps timeout_at; B's live lease cannot be taken over again; A cannot
        re-claim its own row."""
        s, fa, fb = self.take_over()
        first = get(self.stub, s.submission_id)
        c = claim(self.stub, owner='owner-a', lease_ms=30000)
        self.assertFalse(c.HasField('submission'))
        c = claim(self.stub, owner='owner-a', submission_id=s.submission_id)
        self.assertFalse(c.HasField('submission'))
        self.assertEqual(get(self.stub, s.submission_id).attempt_id, fb.attempt_id)
        self.assertGreater(ts_ms(first.deadline), 0)
        running = list_all(self.stub, statuses=[common_pb2.SUBMISSION_STATUS_RUNNING])
        self.assertEqual([x.attempt_id for x in running], [fb.attempt_id])

    def test_stale_attempt_cannot_finish_reservation(self):
        """A reserved (TERMINALIZING) and lost its lease; B takes over; A's finishing Settle
        is refused; B's finishes with A's reserved outcome."""
        s = admit(self.stub, conv='fenced').submission
        a = claim(self.stub, owner='owner-a', lease_ms=LEASE_MS)
        settle(self.stub, a.fence, common_pb2.OUTCOME_ABORTED, 'user stopped', reserve_only=True)
        time.sleep(LEASE_MS / 1000.0 + 0.15)
        b = claim(self.stub, owner='owner-b')
        self.assertTrue(b.takeover)
        self.assertEqual(b.submission.status, common_pb2.SUBMISSION_STATUS_TERMINALIZING)
        self.assertRpcError(STALE, settle, self.stub, a.fence, common_pb2.OUTCOME_ABORTED,
                            'user stopped')
        self.assertEqual(get(self.stub, s.submission_id).status, common_pb2.SUBMISSION_STATUS_TERMINALIZING)
        r = settle(self.stub, b.fence, common_pb2.OUTCOME_COMPLETED)
        self.assertEqual(r.submission.outcome, common_pb2.OUTCOME_ABORTED)
        self.assertEqual(r.submission.error, 'user stopped')
        recs = read_all(self.stub, 'fenced')
        self.assertEqual(len(recs), 1)
        self.assertEqual(recs[0].attempt_id, b.fence.attempt_id)

    def test_a_released_lease_is_taken_over_at_once(self):
        """Release ends the lease of a fence its owner holds: the next Claim (of any owner)
        takes the submission over at once, as a new attempt, and the released attempt is
        fenced off. Fences the owner does not hold (another owner's, a settled one's) are
        reported lost and left alone."""
        s = admit(self.stub, conv='released', text='host').submission
        a = claim(self.stub, owner='owner-a', lease_ms=30000)
        self.assertEqual(a.submission.submission_id, s.submission_id)
        self.assertFalse(claim(self.stub, owner='owner-b').HasField('submission'),
                         'a 30 s lease was taken over before it was released')
        other = release(self.stub, 'owner-b', [a.fence])  # not owner-b's lease
        self.assertEqual((list(other.released), list(other.lost)), ([], [s.submission_id]))
        self.assertFalse(claim(self.stub, owner='owner-b').HasField('submission'))
        r = release(self.stub, 'owner-a', [a.fence])
        self.assertEqual((list(r.released), list(r.lost)), ([s.submission_id], []))
        self.assertLess(ts_ms(get(self.stub, s.submission_id).lease_expire_time),
                        time.time() * 1000)
        b = claim(self.stub, owner='owner-b', lease_ms=30000)
        self.assertEqual(b.submission.submission_id, s.submission_id)
        self.assertTrue(b.takeover)
        self.assertEqual(b.submission.attempt_count, 2)
        self.assertGreater(b.fence.epoch, a.fence.epoch)
        self.assertRpcError(STALE, append, self.stub, a.fence, [record(id_='late')])
        # released again by its old owner: lost, and B's lease is untouched
        again = release(self.stub, 'owner-a', [a.fence])
        self.assertEqual((list(again.released), list(again.lost)), ([], [s.submission_id]))
        self.assertGreater(ts_ms(get(self.stub, s.submission_id).lease_expire_time),
                           time.time() * 1000 + 20000)
        # released to end 1.5 s later: not claimable before then, claimable after
        later = release(self.stub, 'owner-b', [b.fence], expire_after_ms=1500)
        self.assertEqual(list(later.released), [s.submission_id])
        self.assertFalse(claim(self.stub, owner='owner-c').HasField('submission'),
                         'a lease released to end in 1.5 s was taken over at once')
        time.sleep(1.7)
        c = claim(self.stub, owner='owner-c', lease_ms=30000)
        self.assertEqual(c.submission.submission_id, s.submission_id)
        self.assertEqual(c.submission.attempt_count, 3)
        # a release never makes a lease last longer than it would have: one that ends in 1 s,
        # handed back to end in an hour, still ends in 1 s
        hb = heartbeat(self.stub, 'owner-c', [c.fence], lease_ms=1000)
        ends = ts_ms(hb.lease_expire_time)
        kept = release(self.stub, 'owner-c', [c.fence], expire_after_ms=3600000)
        self.assertEqual(list(kept.released), [s.submission_id])
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).lease_expire_time), ends)
        b = c
        settle(self.stub, b.fence, common_pb2.OUTCOME_COMPLETED)
        done = release(self.stub, 'owner-c', [b.fence])  # settled: nothing to hand back
        self.assertEqual((list(done.released), list(done.lost)), ([], [s.submission_id]))
        self.assertEqual(get(self.stub, s.submission_id).outcome, common_pb2.OUTCOME_COMPLETED)


if __name__ == '__main__':
    unittest.main()
