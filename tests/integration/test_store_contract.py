"""The store contract of flue (spec/flue-runtime.md sections 6.1 and 6.2), ported to
cflue.v1.Store. A flue "lane" is a cflue conversation; flue's dispatch/direct admissions are
submissions with source DISPATCH/PROMPT; cflue has no canonical readiness (every admitted row
is runnable at once), so flue's "runnable list" is observed through Claim. Cases that do not
apply are listed in NOT_APPLICABLE.md. Each test's docstring names the cases it ports.
"""

import json
import re
import sqlite3
import time
import unittest

import grpc
from cflue_harness import (
    ts_ms, error_reason, duration,
    ALREADY_EXISTS, FAILED_PRECONDITION, NOT_FOUND, INVALID_ARGUMENT,
    StoragedTestCase, common_pb2, store_pb2,
    admit, admit_request, append, claim, claim_joinable, copy_fence, fence, finalize_join,
    get, get_conversation, heartbeat, list_all, mark_input_applied, now_ms, read, read_all,
    record, request_abort, requeue, revert_join, scan_expired, settle, settle_queued)

QUEUED = common_pb2.SUBMISSION_STATUS_QUEUED
RUNNING = common_pb2.SUBMISSION_STATUS_RUNNING
TERMINALIZING = common_pb2.SUBMISSION_STATUS_TERMINALIZING
SETTLED = common_pb2.SUBMISSION_STATUS_SETTLED
JOINING = common_pb2.SUBMISSION_STATUS_JOINING
JOINED = common_pb2.SUBMISSION_STATUS_JOINED
COMPLETED = common_pb2.OUTCOME_COMPLETED
FAILED = common_pb2.OUTCOME_FAILED
ABORTED = common_pb2.OUTCOME_ABORTED
PROMPT = common_pb2.SOURCE_PROMPT
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
STALE = grpc.StatusCode.ABORTED  # a stale fence (reason STALE_FENCE)
DISPATCH = common_pb2.SOURCE_DISPATCH

IMAGE = {'name': 'pixel.png', 'mime_type': 'image/png', 'data': b'\x89PNG\r\n\x1a\n\x00\x01\xff'}


def ids(subs):
    return [s.submission_id for s in subs]


def status_name(st):
    return common_pb2.SubmissionStatus.Name(st)


class ContractCase(StoragedTestCase):

    def assertSettledBody(self, rec, outcome, error):
        """A submission_settled record's body names the outcome and the error. (The exact
        key set is checked once, in test_settlement_record_body_is_exact.)"""
        self.assertEqual(rec.WhichOneof('body'), 'submission_settled')
        body = rec.submission_settled
        name = common_pb2.Outcome.Name(body.outcome).replace('OUTCOME_', '').lower()
        self.assertEqual((name, body.error), (outcome, error), str(body))

    def assertStatus(self, sub_id, status):
        row = get(self.stub, sub_id)
        self.assertEqual(status_name(row.status), status_name(status),
                         'submission %s' % sub_id)
        return row

    def claim_ok(self, **kw):
        c = claim(self.stub, **kw)
        self.assertTrue(c.HasField('submission'), 'expected a claim, got nothing (%r)' % kw)
        return c

    def claim_none(self, **kw):
        c = claim(self.stub, **kw)
        self.assertFalse(c.HasField('submission'),
                         'expected nothing claimable, claimed %s' % c.submission.submission_id)

    def claimable_ids(self, owner='probe'):
        """flue's listRunnableSubmissions, observed: claims everything claimable."""
        out = []
        while True:
            c = claim(self.stub, owner=owner)
            if not c.HasField('submission'):
                return out
            out.append(c.submission.submission_id)

    def unsettled(self, conv):
        return get_conversation(self.stub, conv).unsettled

    def host_with_queue(self, n=2, conv='join-c', sources=None):
        """flue's join fixture: host-1 claimed by attempt-1, queued-N admitted behind it."""
        host = admit(self.stub, conv=conv, text='host').submission
        queued = []
        for i in range(n):
            src = sources[i] if sources else DISPATCH
            queued.append(admit(self.stub, conv=conv, text='queued-%d' % (i + 1),
                                source=src).submission)
        c = self.claim_ok(submission_id=host.submission_id)
        return c, [q.submission_id for q in queued]


class DispatchAdmissionTest(ContractCase):

    def test_admit_same_key_twice_is_deduplicated(self):
        """6.1 #1: admitting the same input twice returns the first result."""
        a = admit(self.stub, key='dispatch-1', source=DISPATCH)
        b = admit(self.stub, key='dispatch-1', source=DISPATCH)
        self.assertFalse(a.deduplicated)
        self.assertTrue(b.deduplicated)
        self.assertEqual(a.submission.submission_id, b.submission.submission_id)
        self.assertEqual(a.submission.conversation_id, b.submission.conversation_id)
        self.assertEqual(a.submission.sequence, b.submission.sequence)
        self.assertTrue(a.submission.submission_id.startswith('sub_'), a.submission.submission_id)
        self.assertTrue(a.submission.conversation_id.startswith('conv_'),
                        a.submission.conversation_id)
        self.assertEqual(a.submission.status, QUEUED)
        self.assertEqual(a.submission.outcome, common_pb2.OUTCOME_UNSPECIFIED)
        self.assertEqual(a.submission.agent, 'assistant')
        self.assertEqual(a.submission.idempotency_key, 'dispatch-1')
        self.assertEqual(a.submission.source, DISPATCH)
        self.assertEqual(a.offset, -1)
        self.assertEqual(len(list_all(self.stub)), 1)

    def test_same_key_different_payload_conflicts(self):
        """6.1 #2: same key with body `Different` is a conflict (ALREADY_EXISTS)."""
        admit(self.stub, key='dispatch-1', text='Hello', source=DISPATCH)
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            text='Different', source=DISPATCH)
        # every part of the payload counts: source, metadata, conversation, attachments
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            text='Hello', source=PROMPT)
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            text='Hello', source=DISPATCH, metadata={'a': 'b'})
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            text='Hello', source=DISPATCH, conv='explicit-conv')
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            text='Hello', source=DISPATCH, attachments=[IMAGE])
        self.assertEqual(len(list_all(self.stub)), 1)

    def test_attachment_round_trip(self):
        """6.1 #3: a dispatched user message with one image attachment round-trips (Admit
        response and Get)."""
        a = admit(self.stub, key='dispatch-1', text='look', source=DISPATCH,
                  attachments=[IMAGE])
        want = common_pb2.Message(text='look', attachments=[common_pb2.Attachment(**IMAGE)])
        self.assertEqual(a.submission.message, want)
        self.assertEqual(get(self.stub, a.submission.submission_id).message, want)

    def test_attachment_conflict(self):
        """6.1 #4: same key, image data `first-image` then `second-image` → conflict."""
        first = {'mime_type': 'image/png', 'data': b'first-image'}
        second = {'mime_type': 'image/png', 'data': b'second-image'}
        a = admit(self.stub, key='dispatch-1', source=DISPATCH, attachments=[first])
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            source=DISPATCH, attachments=[second])
        # the same name with another mime type is also different content
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='dispatch-1',
                            source=DISPATCH,
                            attachments=[{'mime_type': 'image/jpeg', 'data': b'first-image'}])
        again = admit(self.stub, key='dispatch-1', source=DISPATCH, attachments=[first])
        self.assertTrue(again.deduplicated)
        self.assertEqual(again.submission.submission_id, a.submission.submission_id)
        self.assertEqual(get(self.stub, a.submission.submission_id).message.attachments[0].data,
                         b'first-image')

    def test_large_attachment_round_trip(self):
        """6.1 #5: an attachment of 256 KiB + 1 bytes round-trips intact (Admit, Get, List,
        and after a restart), and an exact re-admission deduplicates."""
        data = bytes(i % 251 for i in range(256 * 1024 + 1))
        att = {'name': 'big.bin', 'mime_type': 'application/octet-stream', 'data': data}
        a = admit(self.stub, key='big', attachments=[att], text='')
        sid = a.submission.submission_id
        self.assertEqual(a.submission.message.attachments[0].data, data)
        self.assertEqual(get(self.stub, sid).message.attachments[0].data, data)
        self.assertEqual(list_all(self.stub)[0].message.attachments[0].data, data)
        self.storaged.restart()
        self.assertEqual(get(self.stub, sid).message.attachments[0].data, data)
        b = admit(self.stub, key='big', attachments=[att], text='')
        self.assertTrue(b.deduplicated)
        self.assertEqual(b.submission.submission_id, sid)
        # one byte different (last one) is a conflict
        att2 = dict(att, data=data[:-1] + bytes([(data[-1] + 1) % 256]))
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='big', attachments=[att2],
                            text='')


class DirectAdmissionTest(ContractCase):

    def test_direct_admission_round_trip(self):
        """6.1 #6: a direct (PROMPT) user message with an image: returned and re-read input
        equal the submitted input."""
        req = admit_request(agent='assistant', conv='agent-1', text='Hello', key='direct-1',
                            source=PROMPT, metadata={'channel': 'cli', 'user': 'u1'},
                            attachments=[IMAGE])
        a = self.stub.admit(req)
        for sub in (a.submission, get(self.stub, a.submission.submission_id)):
            self.assertEqual(sub.agent, req.agent)
            self.assertEqual(sub.conversation_id, 'agent-1')
            self.assertEqual(sub.message, req.message)
            self.assertEqual(sub.idempotency_key, 'direct-1')
            self.assertEqual(sub.source, PROMPT)
            self.assertEqual(dict(sub.metadata), {'channel': 'cli', 'user': 'u1'})
            self.assertEqual(sub.status, QUEUED)
            self.assertGreater(ts_ms(sub.create_time), 0)
            self.assertGreater(sub.sequence, 0)

    def test_direct_attachment_conflict(self):
        """6.1 #7: direct admission with `first-image`, then `second-image` under the same
        key → ALREADY_EXISTS."""
        admit(self.stub, conv='agent-1', key='direct-1', source=PROMPT,
              attachments=[{'mime_type': 'image/png', 'data': b'first-image'}])
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, conv='agent-1', key='direct-1',
                            source=PROMPT,
                            attachments=[{'mime_type': 'image/png', 'data': b'second-image'}])

    def test_admission_identity_rules(self):
        """cflue admission rules (no flue case): explicit conversations are created on first
        use and belong to their agent; the key is scoped to the agent; no key → always new;
        offset is the conversation head; the conversation as sent is part of the payload."""
        a = admit(self.stub, agent='assistant', conv='conv.explicit-1')
        self.assertEqual(a.submission.conversation_id, 'conv.explicit-1')
        self.assertEqual(a.offset, -1)
        conv = get_conversation(self.stub, 'conv.explicit-1')
        self.assertEqual(conv.agent, 'assistant')
        self.assertEqual(conv.head_offset, -1)
        self.assertEqual(conv.unsettled, 1)
        self.assertRpcError(FAILED_PRECONDITION, admit, self.stub, agent='other',
                            conv='conv.explicit-1')
        # no key: a new submission each time
        b = admit(self.stub, conv='conv.explicit-1')
        self.assertNotEqual(a.submission.submission_id, b.submission.submission_id)
        self.assertGreater(b.submission.sequence, a.submission.sequence)
        self.assertFalse(b.deduplicated)
        # key scope is (agent, key)
        k1 = admit(self.stub, agent='assistant', key='shared-key')
        k2 = admit(self.stub, agent='helper', key='shared-key')
        self.assertFalse(k2.deduplicated)
        self.assertNotEqual(k1.submission.submission_id, k2.submission.submission_id)
        self.assertNotEqual(k1.submission.conversation_id, k2.submission.conversation_id)
        # empty conversation + key twice: the same new conversation, not a second one
        k3 = admit(self.stub, agent='assistant', key='shared-key')
        self.assertTrue(k3.deduplicated)
        self.assertEqual(k3.submission.conversation_id, k1.submission.conversation_id)
        # the offset is the conversation head when admitted
        c = self.claim_ok(submission_id=a.submission.submission_id)
        append(self.stub, c.fence, [record(), record(), record()])
        d = admit(self.stub, conv='conv.explicit-1')
        self.assertEqual(d.offset, 2)
        self.assertEqual(d.submission.conversation_id, 'conv.explicit-1')


class OrderingTest(ContractCase):

    def test_fifo_per_conversation_across_sources(self):
        """6.1 #11: direct-1 then dispatch-1 in one conversation, direct-2 on agent-2 →
        claimable = [direct-1, direct-2]; claiming dispatch-1 returns nothing."""
        d1 = admit(self.stub, conv='agent-1', key='direct-1', source=PROMPT).submission
        p1 = admit(self.stub, conv='agent-1', key='dispatch-1', source=DISPATCH).submission
        d2 = admit(self.stub, agent='agent-2', key='direct-2', source=PROMPT).submission
        self.claim_none(submission_id=p1.submission_id)
        self.assertStatus(p1.submission_id, QUEUED)
        self.assertEqual(self.claimable_ids(), [d1.submission_id, d2.submission_id])
        self.assertStatus(p1.submission_id, QUEUED)

    def test_fifo_same_source(self):
        """6.1 #12: dispatch-1, dispatch-2 in one conversation, dispatch-3 (agent-2) →
        claimable = [dispatch-1, dispatch-3]."""
        s1 = admit(self.stub, conv='agent-1', key='dispatch-1', source=DISPATCH).submission
        s2 = admit(self.stub, conv='agent-1', key='dispatch-2', source=DISPATCH).submission
        s3 = admit(self.stub, agent='agent-2', key='dispatch-3', source=DISPATCH).submission
        self.assertEqual(self.claimable_ids(), [s1.submission_id, s3.submission_id])
        self.assertStatus(s2.submission_id, QUEUED)

    def test_same_name_different_agents(self):
        """6.1 #13: alpha/shared and beta/shared are independent lanes. In cflue a
        conversation id belongs to the agent that created it, so beta cannot admit into
        alpha's `shared` (FAILED_PRECONDITION); beta's own conversation runs concurrently."""
        a = admit(self.stub, agent='alpha', conv='shared', key='dispatch-1').submission
        self.assertRpcError(FAILED_PRECONDITION, admit, self.stub, agent='beta', conv='shared',
                            key='dispatch-2')
        b = admit(self.stub, agent='beta', conv='shared-beta', key='dispatch-2').submission
        ca = self.claim_ok(conversation_id='shared')
        cb = self.claim_ok(conversation_id='shared-beta')
        self.assertEqual(ca.submission.submission_id, a.submission_id)
        self.assertEqual(cb.submission.submission_id, b.submission_id)


class ClaimTest(ContractCase):

    def test_claims(self):
        """6.1 #14: three rows, two in one conversation: first claim RUNNING with attempt and
        start time; the second in the same conversation gets nothing; the other conversation
        claims; running = both; nothing left claimable. Claim fields and epochs."""
        a1 = admit(self.stub, conv='lane-a').submission
        a2 = admit(self.stub, conv='lane-a').submission
        b1 = admit(self.stub, conv='lane-b').submission
        t0 = now_ms()
        c1 = self.claim_ok(owner='test-owner', lease_ms=30000)
        t1 = now_ms()
        s = c1.submission
        self.assertEqual(s.submission_id, a1.submission_id)
        self.assertEqual(s.status, RUNNING)
        self.assertFalse(c1.takeover)
        self.assertTrue(s.attempt_id.startswith('att_'), s.attempt_id)
        self.assertEqual(s.owner_id, 'test-owner')
        self.assertEqual(s.attempt_count, 1)
        self.assertTrue(t0 <= ts_ms(s.start_time) <= t1, (t0, ts_ms(s.start_time), t1))
        self.assertTrue(t0 + 30000 <= ts_ms(s.lease_expire_time) <= t1 + 30000)
        self.assertEqual(c1.fence.submission_id, s.submission_id)
        self.assertEqual(c1.fence.attempt_id, s.attempt_id)
        self.assertEqual(c1.fence.epoch, s.epoch)
        self.assertGreater(c1.fence.epoch, 0)
        self.assertEqual(get_conversation(self.stub, 'lane-a').epoch, c1.fence.epoch)
        self.claim_none(conversation_id='lane-a')
        self.claim_none(submission_id=a2.submission_id)
        c2 = self.claim_ok()
        self.assertEqual(c2.submission.submission_id, b1.submission_id)
        running = list_all(self.stub, statuses=[RUNNING])
        self.assertEqual(ids(running), [a1.submission_id, b1.submission_id])
        self.claim_none()
        self.assertRpcError(NOT_FOUND, claim, self.stub, submission_id='sub_doesnotexist')

    def test_epoch_increases_per_conversation(self):
        """cflue fencing epochs (no flue case): each claim of a conversation gets a strictly
        higher epoch, including a re-claim after Requeue."""
        admit(self.stub, conv='lane-e')
        admit(self.stub, conv='lane-e')
        epochs = []
        c = self.claim_ok(conversation_id='lane-e')
        epochs.append(c.fence.epoch)
        requeue(self.stub, c.fence)
        c = self.claim_ok(conversation_id='lane-e')
        epochs.append(c.fence.epoch)
        settle(self.stub, c.fence)
        c = self.claim_ok(conversation_id='lane-e')
        epochs.append(c.fence.epoch)
        self.assertEqual(epochs, sorted(set(epochs)), epochs)
        self.assertEqual(get_conversation(self.stub, 'lane-e').epoch, epochs[-1])


class LifecycleTest(ContractCase):

    def test_mark_input_applied(self):
        """6.1 #15: MarkInputApplied by the owner succeeds; with a stale attempt it is
        refused; the row is RUNNING with input_applied_at set."""
        admit(self.stub)
        c = self.claim_ok()
        self.assertRpcError(STALE, mark_input_applied, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'))
        row = self.assertStatus(c.fence.submission_id, RUNNING)
        self.assertEqual(ts_ms(row.input_apply_time), 0)
        t0 = now_ms()
        s = mark_input_applied(self.stub, c.fence)
        self.assertEqual(s.status, RUNNING)
        self.assertGreaterEqual(ts_ms(s.input_apply_time), t0)
        self.assertRpcError(STALE, mark_input_applied, self.stub,
                            copy_fence(c.fence, epoch=c.fence.epoch + 1))
        row = self.assertStatus(c.fence.submission_id, RUNNING)
        self.assertEqual(ts_ms(row.input_apply_time), ts_ms(s.input_apply_time))

    def test_requeue(self):
        """6.1 #16: requeue with an imposter attempt is refused; each owner requeues (even
        the stamped one); both QUEUED; the stamped one lost input_applied_at, attempt,
        owner, lease and start."""
        admit(self.stub, conv='lane-a')
        admit(self.stub, conv='lane-b')
        ca = self.claim_ok()
        cb = self.claim_ok()
        mark_input_applied(self.stub, ca.fence)
        self.assertRpcError(STALE, requeue, self.stub,
                            copy_fence(ca.fence, attempt_id=cb.fence.attempt_id))
        self.assertRpcError(STALE, requeue, self.stub,
                            copy_fence(ca.fence, attempt_id='att_imposter'))
        self.assertStatus(ca.fence.submission_id, RUNNING)
        ra = requeue(self.stub, ca.fence)
        rb = requeue(self.stub, cb.fence)
        for r in (ra, rb, get(self.stub, ca.fence.submission_id),
                  get(self.stub, cb.fence.submission_id)):
            self.assertEqual(r.status, QUEUED)
            self.assertEqual(ts_ms(r.input_apply_time), 0)
            self.assertEqual(r.attempt_id, '')
            self.assertEqual(r.owner_id, '')
            self.assertEqual(ts_ms(r.lease_expire_time), 0)
            self.assertEqual(ts_ms(r.start_time), 0)
            self.assertEqual(r.attempt_count, 1)
        # requeue again with the old fence is stale
        self.assertRpcError(STALE, requeue, self.stub, ca.fence)

    def test_settle_clears_unsettled(self):
        """6.1 #17: admitted → unsettled; claim → one running; complete → nothing
        unsettled, SETTLED."""
        s = admit(self.stub, conv='lane').submission
        self.assertEqual(self.unsettled('lane'), 1)
        self.assertEqual(len(list_all(self.stub, statuses=[QUEUED, RUNNING, TERMINALIZING,
                                                           JOINING, JOINED])), 1)
        c = self.claim_ok()
        self.assertEqual(ids(list_all(self.stub, statuses=[RUNNING])), [s.submission_id])
        r = settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(r.submission.status, SETTLED)
        self.assertEqual(r.submission.outcome, COMPLETED)
        self.assertFalse(r.already_settled)
        self.assertEqual(self.unsettled('lane'), 0)
        self.assertEqual(list_all(self.stub, statuses=[QUEUED, RUNNING, TERMINALIZING,
                                                       JOINING, JOINED]), [])
        self.assertStatus(s.submission_id, SETTLED)

    def test_settled_at(self):
        """6.1 #18: settled_at is unset while running and set after completion; the
        settlement record is appended and answered_by is the submission itself."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).settle_time), 0)
        t0 = now_ms()
        r = settle(self.stub, c.fence, COMPLETED)
        row = get(self.stub, s.submission_id)
        self.assertGreaterEqual(ts_ms(row.settle_time), t0)
        self.assertEqual(row.answered_by, s.submission_id)
        self.assertEqual(row.error, '')
        self.assertEqual(r.record_offset, 0)
        recs = read_all(self.stub, 'lane')
        self.assertEqual(len(recs), 1)
        self.assertEqual(recs[0].offset, r.record_offset)
        self.assertEqual(recs[0].WhichOneof('body'), 'submission_settled')
        self.assertEqual(recs[0].id, 'settled:' + s.submission_id)
        self.assertEqual(recs[0].submission_id, s.submission_id)
        self.assertSettledBody(recs[0], 'completed', '')

    def test_settlement_record_body_is_exact(self):
        """cflue settlement record (no flue case): type submission_settled, id
        settled:<id>, a typed SubmissionSettled {outcome, error, answered_by}."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, FAILED, 'boom')
        rec = read_all(self.stub, 'lane')[-1]
        self.assertEqual(rec.id, 'settled:' + s.submission_id)
        self.assertEqual(rec.submission_id, s.submission_id)
        self.assertEqual(rec.WhichOneof('body'), 'submission_settled')
        self.assertEqual(rec.submission_settled, common_pb2.SubmissionSettled(
            outcome=FAILED, error='boom', answered_by=s.submission_id))

    def test_first_terminal_state_wins(self):
        """6.1 #19: complete with a stale attempt is refused; fail with "first failure"
        wins; later complete and fail are refused; the row keeps error `first failure`."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        self.assertRpcError(STALE, settle, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'), COMPLETED)
        r = settle(self.stub, c.fence, FAILED, 'first failure')
        self.assertEqual(r.submission.outcome, FAILED)
        self.assertRpcError(FAILED_PRECONDITION, settle, self.stub, c.fence, COMPLETED)
        self.assertRpcError(FAILED_PRECONDITION, settle, self.stub, c.fence, FAILED,
                            'second failure')
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.outcome, FAILED)
        self.assertEqual(row.error, 'first failure')
        again = settle(self.stub, c.fence, FAILED, 'first failure')
        self.assertTrue(again.already_settled)
        self.assertEqual(again.submission.error, 'first failure')
        recs = read_all(self.stub, 'lane')
        self.assertEqual(len(recs), 1)
        self.assertSettledBody(recs[0], 'failed', 'first failure')


class AbortTest(ContractCase):

    def test_abort_queued(self):
        """6.1 #20: abort of a queued conversation stamps the row; it stays QUEUED and
        claimable."""
        s = admit(self.stub, conv='lane', key='dispatch-1').submission
        t0 = now_ms()
        r = request_abort(self.stub, conversation_id='lane', reason='user pressed stop')
        self.assertEqual(list(r.affected), [s.submission_id])
        row = self.assertStatus(s.submission_id, QUEUED)
        self.assertGreaterEqual(ts_ms(row.abort_request_time), t0)
        c = self.claim_ok()
        self.assertEqual(c.submission.submission_id, s.submission_id)
        self.assertGreater(ts_ms(c.submission.abort_request_time), 0)

    def test_abort_running_and_queued(self):
        """6.1 #21: running head + two queued → all three affected; the head stays RUNNING
        with its attempt; the queued rows are stamped."""
        h = admit(self.stub, conv='lane').submission
        q1 = admit(self.stub, conv='lane').submission
        q2 = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        r = request_abort(self.stub, conversation_id='lane')
        self.assertEqual(sorted(r.affected),
                         sorted([h.submission_id, q1.submission_id, q2.submission_id]))
        head = self.assertStatus(h.submission_id, RUNNING)
        self.assertEqual(head.attempt_id, c.fence.attempt_id)
        self.assertGreater(ts_ms(head.abort_request_time), 0)
        for q in (q1, q2):
            self.assertGreater(ts_ms(self.assertStatus(q.submission_id, QUEUED).abort_request_time),
                               0)

    def test_abort_only_touches_its_conversation(self):
        """6.1 #22: aborting alpha's conversation affects only alpha's row."""
        a = admit(self.stub, agent='alpha', conv='shared').submission
        b = admit(self.stub, agent='beta', conv='shared-beta').submission
        r = request_abort(self.stub, conversation_id='shared')
        self.assertEqual(list(r.affected), [a.submission_id])
        self.assertEqual(ts_ms(get(self.stub, b.submission_id).abort_request_time), 0)

    def test_abort_twice_first_stamp_wins(self):
        """6.1 #23: aborting twice leaves abort_requested_at unchanged."""
        s = admit(self.stub, conv='lane').submission
        request_abort(self.stub, conversation_id='lane')
        first = ts_ms(get(self.stub, s.submission_id).abort_request_time)
        time.sleep(0.15)
        r = request_abort(self.stub, conversation_id='lane', reason='again')
        self.assertEqual(list(r.affected), [s.submission_id])
        request_abort(self.stub, submission_id=s.submission_id)
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).abort_request_time), first)

    def test_abort_settled_row(self):
        """6.1 #24: a settled row is not affected, not claimable, not expired."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok(lease_ms=100)
        settle(self.stub, c.fence, COMPLETED)
        time.sleep(0.15)
        self.assertEqual(list(request_abort(self.stub, conversation_id='lane').affected), [])
        self.assertEqual(list(request_abort(self.stub, submission_id=s.submission_id).affected),
                         [])
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).abort_request_time), 0)
        self.claim_none()
        self.claim_none(submission_id=s.submission_id)
        self.assertEqual(scan_expired(self.stub), [])

    def test_abort_terminalizing_row_not_stamped(self):
        """cflue RequestAbort rule (no flue case): a TERMINALIZING row is not stamped."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertEqual(list(request_abort(self.stub, conversation_id='lane').affected), [])
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).abort_request_time), 0)
        self.assertStatus(s.submission_id, TERMINALIZING)

    def test_abort_unknown(self):
        """6.1 #25: abort of an unknown conversation (cflue: NOT_FOUND, not an empty list);
        exactly one of conversation_id/submission_id."""
        self.assertRpcError(NOT_FOUND, request_abort, self.stub, conversation_id='nope')
        self.assertRpcError(NOT_FOUND, request_abort, self.stub, submission_id='sub_nope')
        s = admit(self.stub, conv='lane').submission
        # (both at once cannot be sent: they are one oneof)
        self.assertRpcError(INVALID_ARGUMENT, request_abort, self.stub)
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).abort_request_time), 0)


class SettleQueuedTest(ContractCase):

    def test_settle_queued_failed(self):
        """6.1 #26: settling a queued row (no attempt) FAILED: SETTLED, error, settled_at;
        nothing unsettled; not claimable."""
        s = admit(self.stub, conv='lane').submission
        t0 = now_ms()
        r = settle_queued(self.stub, s.submission_id, FAILED, 'cannot run')
        self.assertEqual(r.submission.status, SETTLED)
        self.assertEqual(r.submission.outcome, FAILED)
        self.assertEqual(r.submission.error, 'cannot run')
        self.assertGreaterEqual(ts_ms(r.submission.settle_time), t0)
        self.assertEqual(self.unsettled('lane'), 0)
        self.claim_none()
        self.claim_none(submission_id=s.submission_id)
        recs = read_all(self.stub, 'lane')
        self.assertEqual([x.id for x in recs], ['settled:' + s.submission_id])
        self.assertEqual(r.record_offset, recs[0].offset)

    def test_settle_queued_aborted(self):
        """6.1 #27: an abort-stamped queued row settles ABORTED with its error."""
        s = admit(self.stub, conv='lane').submission
        request_abort(self.stub, conversation_id='lane')
        r = settle_queued(self.stub, s.submission_id, ABORTED, 'Submission was aborted.')
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.outcome, ABORTED)
        self.assertEqual(row.error, 'Submission was aborted.')
        self.assertEqual(r.submission.outcome, ABORTED)
        rec = read_all(self.stub, 'lane')[-1]
        self.assertSettledBody(rec, 'aborted', 'Submission was aborted.')

    def test_settle_queued_behind_running_head(self):
        """6.1 #28: QUEUED is the only gate: a queued row behind a running head can be
        settled without an attempt; the head is untouched."""
        h = admit(self.stub, conv='lane').submission
        q = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        r = settle_queued(self.stub, q.submission_id, COMPLETED, '')
        self.assertEqual(r.submission.status, SETTLED)
        self.assertEqual(r.submission.outcome, COMPLETED)
        self.assertEqual(self.assertStatus(h.submission_id, RUNNING).attempt_id,
                         c.fence.attempt_id)

    def test_settle_queued_vs_claim(self):
        """6.1 #29: a claimed row cannot be settled without its attempt (stays RUNNING);
        conversely a row settled first cannot be claimed and keeps its error."""
        a = admit(self.stub, conv='lane-a').submission
        b = admit(self.stub, conv='lane-b').submission
        c = self.claim_ok(submission_id=a.submission_id)
        self.assertRpcError(FAILED_PRECONDITION, settle_queued, self.stub, a.submission_id)
        self.assertEqual(self.assertStatus(a.submission_id, RUNNING).attempt_id,
                         c.fence.attempt_id)
        settle_queued(self.stub, b.submission_id, FAILED, 'never ran')
        self.claim_none(submission_id=b.submission_id)
        row = self.assertStatus(b.submission_id, SETTLED)
        self.assertEqual(row.error, 'never ran')

    def test_settle_queued_on_completed(self):
        """6.1 #30: a completed row cannot be settled again without an attempt; its error
        stays empty."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, COMPLETED)
        self.assertRpcError(FAILED_PRECONDITION, settle_queued, self.stub, s.submission_id,
                            FAILED, 'late')
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.outcome, COMPLETED)
        self.assertEqual(row.error, '')

    def test_settle_queued_on_joining_and_joined(self):
        """6.1 #31: JOINING and JOINED rows cannot be settled without an attempt."""
        c, (q1, q2) = self.host_with_queue(2)
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        self.assertRpcError(FAILED_PRECONDITION, settle_queued, self.stub, q1)
        self.assertRpcError(FAILED_PRECONDITION, settle_queued, self.stub, q2)
        self.assertStatus(q1, JOINED)
        self.assertStatus(q2, JOINING)

    def test_settle_unknown(self):
        """6.1 #32: settling an unknown id → NOT_FOUND."""
        self.assertRpcError(NOT_FOUND, settle_queued, self.stub, 'sub_unknown')


class SettlementObligationTest(ContractCase):

    def test_reserve(self):
        """6.1 #33: reserve with a stale attempt is refused; with the owner the row is
        TERMINALIZING showing the reserved outcome; no record yet."""
        s = admit(self.stub, conv='lane', key='direct-1', source=PROMPT).submission
        c = self.claim_ok()
        self.assertRpcError(STALE, settle, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'), COMPLETED,
                            reserve_only=True)
        self.assertStatus(s.submission_id, RUNNING)
        r = settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertEqual(r.submission.status, TERMINALIZING)
        self.assertEqual(r.submission.outcome, COMPLETED)
        self.assertEqual(r.submission.attempt_id, c.fence.attempt_id)
        self.assertFalse(r.already_settled)
        row = self.assertStatus(s.submission_id, TERMINALIZING)
        self.assertEqual(row.outcome, COMPLETED)
        self.assertEqual(ts_ms(row.settle_time), 0)
        self.assertEqual(read_all(self.stub, 'lane'), [])

    def test_reserved_outcome_wins(self):
        """6.1 #34 (as cflue words it): once reserved, the finishing Settle gets the
        reserved outcome whatever it asks for."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        r = settle(self.stub, c.fence, FAILED, 'changed my mind')
        self.assertEqual(r.submission.status, SETTLED)
        self.assertEqual(r.submission.outcome, COMPLETED)
        self.assertEqual(r.submission.error, '')
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.outcome, COMPLETED)
        rec = read_all(self.stub, 'lane')[-1]
        self.assertSettledBody(rec, 'completed', '')
        # repeating the Settle with the stored outcome is idempotent
        again = settle(self.stub, c.fence, COMPLETED)
        self.assertTrue(again.already_settled)
        self.assertEqual(again.submission.outcome, COMPLETED)
        self.assertEqual(len(read_all(self.stub, 'lane')), 1)

    def test_terminalizing_blocks_and_is_taken_over(self):
        """6.1 #35 (cflue semantics): direct-1 claimed with an expiring lease, direct-2
        queued behind; reserve → unsettled 2, direct-2 not claimable. Unlike flue, a
        TERMINALIZING row whose lease expired is listed by ScanExpired and is taken over by
        Claim (takeover=true); the takeover's Settle finishes the reserved outcome."""
        d1 = admit(self.stub, conv='lane', key='direct-1').submission
        d2 = admit(self.stub, conv='lane', key='direct-2').submission
        c = self.claim_ok(lease_ms=300)
        r = settle(self.stub, c.fence, FAILED, 'provider exploded: boom', reserve_only=True)
        self.assertEqual(r.submission.status, TERMINALIZING)
        self.assertEqual(self.unsettled('lane'), 2)
        self.claim_none(submission_id=d2.submission_id)
        self.assertEqual(list_all(self.stub, statuses=[RUNNING]), [])
        time.sleep(0.45)
        self.assertEqual(ids(scan_expired(self.stub)), [d1.submission_id])
        t = self.claim_ok(owner='recoverer')
        self.assertTrue(t.takeover)
        self.assertEqual(t.submission.submission_id, d1.submission_id)
        self.assertEqual(t.submission.status, TERMINALIZING)
        self.assertNotEqual(t.fence.attempt_id, c.fence.attempt_id)
        self.assertGreater(t.fence.epoch, c.fence.epoch)
        self.assertEqual(t.submission.attempt_count, 2)
        self.assertEqual(scan_expired(self.stub), [])
        # the old attempt can no longer finish it
        self.assertRpcError(STALE, settle, self.stub, c.fence, FAILED,
                            'provider exploded: boom')
        f = settle(self.stub, t.fence, COMPLETED)
        self.assertEqual(f.submission.status, SETTLED)
        self.assertEqual(f.submission.outcome, FAILED)
        self.assertEqual(f.submission.error, 'provider exploded: boom')
        c2 = self.claim_ok()
        self.assertEqual(c2.submission.submission_id, d2.submission_id)

    def test_pending_then_finalize(self):
        """6.1 #36: reserve → the TERMINALIZING list holds exactly it; finish → that list
        is empty and nothing is unsettled; the settlement record is at record_offset."""
        s = admit(self.stub, conv='lane', source=PROMPT).submission
        c = self.claim_ok()
        append(self.stub, c.fence, [record('assistant_message', {'text': 'hi'})])
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertEqual(ids(list_all(self.stub, statuses=[TERMINALIZING])), [s.submission_id])
        r = settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(r.submission.status, SETTLED)
        self.assertEqual(list_all(self.stub, statuses=[TERMINALIZING]), [])
        self.assertEqual(self.unsettled('lane'), 0)
        self.assertEqual(r.record_offset, 1)
        recs = read_all(self.stub, 'lane')
        self.assertEqual([x.offset for x in recs], [0, 1])
        self.assertEqual(recs[1].WhichOneof('body'), 'submission_settled')
        self.assertEqual(recs[1].id, 'settled:' + s.submission_id)
        self.assertEqual(recs[1].attempt_id, c.fence.attempt_id)

    def test_dispatch_reservation_pending(self):
        """6.1 #37: a dispatch (source DISPATCH) reservation appears among TERMINALIZING."""
        s = admit(self.stub, conv='lane', source=DISPATCH, key='dispatch-1').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        pending = list_all(self.stub, statuses=[TERMINALIZING])
        self.assertEqual(ids(pending), [s.submission_id])
        self.assertEqual(pending[0].source, DISPATCH)

    def test_dispatch_reserve_finalize(self):
        """6.1 #38: dispatch: stale reserve refused; owner reserve → TERMINALIZING; finish
        → SETTLED without error."""
        s = admit(self.stub, conv='lane', source=DISPATCH).submission
        c = self.claim_ok()
        self.assertRpcError(STALE, settle, self.stub,
                            copy_fence(c.fence, epoch=c.fence.epoch - 1), COMPLETED,
                            reserve_only=True)
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertStatus(s.submission_id, TERMINALIZING)
        settle(self.stub, c.fence, COMPLETED)
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.error, '')
        self.assertEqual(row.outcome, COMPLETED)

    def test_failed_reservation_error(self):
        """6.1 #39: a FAILED reservation finished → the row's error is the reserved one."""
        s = admit(self.stub, conv='lane').submission
        c = self.claim_ok()
        settle(self.stub, c.fence, FAILED, 'provider exploded: boom', reserve_only=True)
        r = settle(self.stub, c.fence, FAILED, 'provider exploded: boom')
        self.assertEqual(r.submission.error, 'provider exploded: boom')
        row = self.assertStatus(s.submission_id, SETTLED)
        self.assertEqual(row.outcome, FAILED)
        self.assertEqual(row.error, 'provider exploded: boom')
        rec = read_all(self.stub, 'lane')[-1]
        self.assertSettledBody(rec, 'failed', 'provider exploded: boom')


class DurabilityTest(ContractCase):

    def test_admission_budget(self):
        """6.1 #40: after admission attempt_count 0, max_attempts 10, timeout_at 0."""
        s = admit(self.stub).submission
        for row in (s, get(self.stub, s.submission_id)):
            self.assertEqual(row.attempt_count, 0)
            self.assertEqual(row.max_attempts, 10)
            self.assertEqual(ts_ms(row.deadline), 0)
            self.assertEqual(ts_ms(row.lease_expire_time), 0)
            self.assertEqual(row.attempt_id, '')
            self.assertEqual(row.epoch, 0)

    def test_claim_budget(self):
        """6.1 #41: after claim attempt_count 1, max_attempts 10, timeout_at = claim time +
        3,600,000."""
        admit(self.stub)
        t0 = now_ms()
        c = self.claim_ok()
        t1 = now_ms()
        s = c.submission
        self.assertEqual(s.attempt_count, 1)
        self.assertEqual(s.max_attempts, 10)
        self.assertTrue(t0 + 3600000 <= ts_ms(s.deadline) <= t1 + 3600000,
                        (t0, ts_ms(s.deadline), t1))

    def test_mark_input_applied_budgets(self):
        """6.1 #42: MarkInputApplied{max_attempts 5, timeout} installs them (timeout_at =
        started_at + timeout_ms); attempt_count stays 1; a later call keeps the first
        values."""
        admit(self.stub)
        c = self.claim_ok()
        s = mark_input_applied(self.stub, c.fence, max_attempts=5, timeout_ms=120000)
        self.assertEqual(s.max_attempts, 5)
        self.assertEqual(ts_ms(s.deadline), ts_ms(c.submission.start_time) + 120000)
        self.assertEqual(s.attempt_count, 1)
        first_applied = ts_ms(s.input_apply_time)
        self.assertGreater(first_applied, 0)
        time.sleep(0.15)
        s2 = mark_input_applied(self.stub, c.fence, max_attempts=7, timeout_ms=999999)
        self.assertEqual(s2.max_attempts, 5)
        self.assertEqual(ts_ms(s2.deadline), ts_ms(c.submission.start_time) + 120000)
        self.assertEqual(ts_ms(s2.input_apply_time), first_applied)
        row = get(self.stub, c.fence.submission_id)
        self.assertEqual((row.max_attempts, ts_ms(row.deadline), ts_ms(row.input_apply_time)),
                         (5, ts_ms(c.submission.start_time) + 120000, first_applied))

    def test_mark_input_applied_zero_keeps_defaults(self):
        """6.1 #42 (zero values): MarkInputApplied with 0/0 keeps max_attempts 10 and the
        claim's timeout_at."""
        admit(self.stub)
        c = self.claim_ok()
        s = mark_input_applied(self.stub, c.fence)
        self.assertEqual(s.max_attempts, 10)
        self.assertEqual(ts_ms(s.deadline), ts_ms(c.submission.deadline))

    def test_takeover_replaces_attempt(self):
        """6.1 #43, #45, #47 (replaceSubmissionAttempt → cflue takeover): an expired lease
        claimed again → RUNNING, attempt_count 2, new attempt id, new owner and lease."""
        admit(self.stub)
        c = self.claim_ok(owner='owner-1', lease_ms=200)
        time.sleep(0.3)
        t0 = now_ms()
        t = self.claim_ok(owner='owner-2', lease_ms=30000)
        s = t.submission
        self.assertTrue(t.takeover)
        self.assertEqual(s.status, RUNNING)
        self.assertEqual(s.attempt_count, 2)
        self.assertNotEqual(s.attempt_id, c.fence.attempt_id)
        self.assertTrue(s.attempt_id.startswith('att_'))
        self.assertEqual(s.owner_id, 'owner-2')
        self.assertGreaterEqual(ts_ms(s.lease_expire_time), t0 + 30000)
        self.assertGreaterEqual(ts_ms(s.start_time), t0)
        self.assertEqual(ts_ms(s.deadline), ts_ms(c.submission.deadline))

    def test_no_takeover_of_live_lease(self):
        """6.1 #46: replacing with a stale attempt → nothing; cflue: a RUNNING row with a
        live lease cannot be claimed again and is unchanged (attempt, count 1)."""
        s = admit(self.stub).submission
        c = self.claim_ok(owner='owner-1')
        self.claim_none(owner='owner-2', submission_id=s.submission_id)
        self.claim_none(owner='owner-2')
        row = get(self.stub, s.submission_id)
        self.assertEqual(row.attempt_id, c.fence.attempt_id)
        self.assertEqual(row.attempt_count, 1)
        self.assertEqual(row.owner_id, 'owner-1')

    def test_requeue_keeps_budget(self):
        """6.1 #44: claim, requeue, claim again → attempt_count 2, timeout_at unchanged
        from the first claim."""
        admit(self.stub)
        c1 = self.claim_ok()
        requeue(self.stub, c1.fence)
        time.sleep(0.15)
        c2 = self.claim_ok()
        self.assertEqual(c2.submission.attempt_count, 2)
        self.assertEqual(ts_ms(c2.submission.deadline), ts_ms(c1.submission.deadline))
        self.assertNotEqual(c2.fence.attempt_id, c1.fence.attempt_id)


class LeaseTest(ContractCase):

    def test_renew_by_owner(self):
        """6.1 #48: owner-a's heartbeat extends its lease."""
        s = admit(self.stub).submission
        c = self.claim_ok(owner='owner-a', lease_ms=5000)
        before = ts_ms(c.submission.lease_expire_time)
        time.sleep(0.15)
        h = heartbeat(self.stub, 'owner-a', [c.fence], lease_ms=30000)
        self.assertEqual(list(h.renewed), [s.submission_id])
        self.assertEqual(list(h.lost), [])
        after = ts_ms(get(self.stub, s.submission_id).lease_expire_time)
        self.assertGreater(after, before)
        self.assertGreater(ts_ms(h.lease_expire_time), before)

    def test_renew_by_other_owner(self):
        """6.1 #49: owner-b's heartbeat does not touch owner-a's lease (reported lost)."""
        s = admit(self.stub).submission
        c = self.claim_ok(owner='owner-a', lease_ms=5000)
        h = heartbeat(self.stub, 'owner-b', [c.fence], lease_ms=30000)
        self.assertEqual(list(h.renewed), [])
        self.assertEqual(list(h.lost), [s.submission_id])
        self.assertEqual(ts_ms(get(self.stub, s.submission_id).lease_expire_time),
                         ts_ms(c.submission.lease_expire_time))

    def test_renew_settled(self):
        """6.1 #50: heartbeat of a settled row is no error (reported lost)."""
        s = admit(self.stub).submission
        c = self.claim_ok(owner='owner-a')
        settle(self.stub, c.fence, COMPLETED)
        h = heartbeat(self.stub, 'owner-a', [c.fence])
        self.assertEqual(list(h.renewed), [])
        self.assertEqual(list(h.lost), [s.submission_id])

    def test_renew_terminalizing_and_default_lease(self):
        """cflue Heartbeat (no flue case): a TERMINALIZING row held by the owner is renewed;
        lease_ms 0 means the server default (30 s)."""
        s = admit(self.stub).submission
        c = self.claim_ok(owner='owner-a', lease_ms=1000)
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        t0 = now_ms()
        h = heartbeat(self.stub, 'owner-a', [c.fence], lease_ms=0)
        t1 = now_ms()
        self.assertEqual(list(h.renewed), [s.submission_id])
        lease = ts_ms(get(self.stub, s.submission_id).lease_expire_time)
        self.assertTrue(t0 + 30000 <= lease <= t1 + 30000, (t0, lease, t1))

    def test_expired_listed(self):
        """6.1 #51: a claim with an (almost) immediately expiring lease is listed expired."""
        s = admit(self.stub).submission
        self.claim_ok(lease_ms=100)
        time.sleep(0.15)
        self.assertEqual(ids(scan_expired(self.stub)), [s.submission_id])

    def test_future_lease_not_expired(self):
        """6.1 #52: a future lease is not expired."""
        admit(self.stub)
        self.claim_ok(lease_ms=30000)
        self.assertEqual(scan_expired(self.stub), [])

    def test_completed_not_expired(self):
        """6.1 #53: an expired lease on a completed row is not listed."""
        admit(self.stub)
        c = self.claim_ok(lease_ms=100)
        time.sleep(0.15)
        settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(scan_expired(self.stub), [])

    def test_empty_store_no_expired(self):
        """6.1 #54: an empty store has no expired rows."""
        self.assertEqual(scan_expired(self.stub), [])

    def test_scan_expired_limit(self):
        """cflue ScanExpired (no flue case): limit bounds the page; order is sequence."""
        subs = [admit(self.stub, conv='lane-%d' % i).submission for i in range(3)]
        for s in subs:  # (an unrestricted Claim would take the first expired one over)
            self.claim_ok(lease_ms=100, conversation_id=s.conversation_id)
        time.sleep(0.15)
        self.assertEqual(ids(scan_expired(self.stub)), ids(subs))
        self.assertEqual(ids(scan_expired(self.stub, limit=2)), ids(subs[:2]))


class JoinTest(ContractCase):

    def test_claim_joinable(self):
        """6.1 #55: two queued behind the host → [queued-1, queued-2] JOINING into the host;
        a second call returns []."""
        c, qs = self.host_with_queue(2)
        got = claim_joinable(self.stub, c.fence)
        self.assertEqual(ids(got), qs)
        for s in got:
            self.assertEqual(s.status, JOINING)
            self.assertEqual(s.joined_into, c.fence.submission_id)
        for q in qs:
            self.assertEqual(self.assertStatus(q, JOINING).joined_into, c.fence.submission_id)
        self.assertEqual(claim_joinable(self.stub, c.fence), [])

    def test_claim_joinable_limit(self):
        """cflue ClaimJoinable limit (no flue case)."""
        c, qs = self.host_with_queue(3)
        self.assertEqual(ids(claim_joinable(self.stub, c.fence, limit=2)), qs[:2])
        self.assertEqual(ids(claim_joinable(self.stub, c.fence, limit=2)), qs[2:])

    def test_claim_joinable_stale_or_settled_host(self):
        """6.1 #56: a stale host attempt is refused (cflue: FAILED_PRECONDITION); after the
        host completes, ClaimJoinable is refused and queued-1 stays QUEUED."""
        c, (q1,) = self.host_with_queue(1)
        self.assertRpcError(STALE, claim_joinable, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'))
        self.assertStatus(q1, QUEUED)
        settle(self.stub, c.fence, COMPLETED)
        self.assertRpcError(FAILED_PRECONDITION, claim_joinable, self.stub, c.fence)
        self.assertEqual(self.assertStatus(q1, QUEUED).joined_into, '')

    def test_claim_joinable_mixed_sources(self):
        """6.1 #57: queued-1 (dispatch), direct-mid (prompt), queued-behind (dispatch) → all
        three claimed in order with their sources."""
        c, qs = self.host_with_queue(3, sources=[DISPATCH, PROMPT, DISPATCH])
        got = claim_joinable(self.stub, c.fence)
        self.assertEqual(ids(got), qs)
        self.assertEqual([s.source for s in got], [DISPATCH, PROMPT, DISPATCH])

    def test_claim_joinable_stops_at_abort_stamp(self):
        """6.1 #58 (unready-mid → abort-stamped mid): queued-1, abort-stamped mid,
        queued-behind → only queued-1 is claimed; the others stay QUEUED."""
        c, (q1, mid, behind) = self.host_with_queue(3)
        request_abort(self.stub, submission_id=mid)
        self.assertEqual(ids(claim_joinable(self.stub, c.fence)), [q1])
        self.assertStatus(mid, QUEUED)
        self.assertStatus(behind, QUEUED)

    def test_claim_joinable_abort_stamped_head(self):
        """6.1 #60: an abort-stamped queued head plus one behind → []."""
        c, (q1, q2) = self.host_with_queue(2)
        request_abort(self.stub, submission_id=q1)
        self.assertEqual(claim_joinable(self.stub, c.fence), [])
        self.assertStatus(q1, QUEUED)
        self.assertStatus(q2, QUEUED)

    def test_finalize_join(self):
        """6.1 #61: finalize with a stale host → refused; with the host → JOINED,
        input_applied_at set, answered_by the host; finalize again → refused."""
        c, (q1,) = self.host_with_queue(1)
        claim_joinable(self.stub, c.fence)
        self.assertRpcError(STALE, finalize_join, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'), q1)
        self.assertStatus(q1, JOINING)
        s = finalize_join(self.stub, c.fence, q1)
        self.assertEqual(s.status, JOINED)
        self.assertGreater(ts_ms(s.input_apply_time), 0)
        self.assertEqual(s.answered_by, c.fence.submission_id)
        self.assertEqual(s.joined_into, c.fence.submission_id)
        self.assertRpcError(FAILED_PRECONDITION, finalize_join, self.stub, c.fence, q1)
        self.assertStatus(q1, JOINED)

    def test_finalize_join_not_joining(self):
        """cflue FinalizeJoin/RevertJoin (no flue case): a QUEUED row not joining the host
        cannot be finalized or reverted."""
        c, (q1,) = self.host_with_queue(1)
        self.assertRpcError(FAILED_PRECONDITION, finalize_join, self.stub, c.fence, q1)
        self.assertRpcError(FAILED_PRECONDITION, revert_join, self.stub, c.fence, q1)
        self.assertStatus(q1, QUEUED)

    def test_revert_join(self):
        """6.1 #62: revert with a stale host → refused; with the host → QUEUED, no
        joined_into, no input_applied_at."""
        c, (q1,) = self.host_with_queue(1)
        claim_joinable(self.stub, c.fence)
        self.assertRpcError(STALE, revert_join, self.stub,
                            copy_fence(c.fence, epoch=c.fence.epoch + 5), q1)
        self.assertStatus(q1, JOINING)
        s = revert_join(self.stub, c.fence, q1)
        self.assertEqual(s.status, QUEUED)
        self.assertEqual(s.joined_into, '')
        self.assertEqual(ts_ms(s.input_apply_time), 0)
        row = self.assertStatus(q1, QUEUED)
        self.assertEqual(row.joined_into, '')
        self.assertEqual(ts_ms(row.input_apply_time), 0)

    def test_list_joined(self):
        """6.1 #63: claim two, finalize the first → List(joined_into=host) =
        [(queued-1, JOINED), (queued-2, JOINING)]."""
        c, (q1, q2) = self.host_with_queue(2)
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        got = list_all(self.stub, joined_into=c.fence.submission_id)
        self.assertEqual([(s.submission_id, s.status) for s in got],
                         [(q1, JOINED), (q2, JOINING)])

    def test_host_completes_fan_out(self):
        """6.1 #64: host completes → queued-1 (JOINED) settled COMPLETED without error,
        answered by the host, with its own settlement record; queued-2 (JOINING) back to
        QUEUED."""
        c, (q1, q2) = self.host_with_queue(2)
        host = c.fence.submission_id
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        r = settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(list(r.settled_with), [q1])
        row = self.assertStatus(q1, SETTLED)
        self.assertEqual(row.outcome, COMPLETED)
        self.assertEqual(row.error, '')
        self.assertEqual(row.answered_by, host)
        self.assertGreater(ts_ms(row.settle_time), 0)
        back = self.assertStatus(q2, QUEUED)
        self.assertEqual(back.joined_into, '')
        self.assertEqual(ts_ms(back.input_apply_time), 0)
        recs = read_all(self.stub, 'join-c')
        self.assertEqual(sorted(x.id for x in recs), sorted(['settled:' + host,
                                                             'settled:' + q1]))
        for x in recs:
            self.assertEqual(x.WhichOneof('body'), 'submission_settled')
            self.assertSettledBody(x, 'completed', '')
        by_id = {x.id: x for x in recs}
        self.assertEqual(by_id['settled:' + q1].submission_id, q1)
        self.assertEqual(by_id['settled:' + host].submission_id, host)
        self.assertEqual(by_id['settled:' + host].offset, r.record_offset)
        # queued-2 is now the head of the conversation
        self.assertEqual(self.claim_ok().submission.submission_id, q2)

    def test_host_fails_fan_out(self):
        """6.1 #65: host fails with `host exploded` → the joined row settles FAILED with
        that error."""
        c, (q1,) = self.host_with_queue(1)
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        r = settle(self.stub, c.fence, FAILED, 'host exploded')
        self.assertEqual(list(r.settled_with), [q1])
        row = self.assertStatus(q1, SETTLED)
        self.assertEqual(row.outcome, FAILED)
        self.assertEqual(row.error, 'host exploded')
        rec = [x for x in read_all(self.stub, 'join-c') if x.id == 'settled:' + q1][0]
        self.assertSettledBody(rec, 'failed', 'host exploded')

    def test_host_reserve_finalize_fan_out(self):
        """6.1 #66: a host settled through reserve + finish settles its joined row
        COMPLETED without error (the fan-out happens when it finishes)."""
        c, (q1,) = self.host_with_queue(1, sources=[DISPATCH])
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertStatus(q1, JOINED)
        r = settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(list(r.settled_with), [q1])
        row = self.assertStatus(q1, SETTLED)
        self.assertEqual(row.outcome, COMPLETED)
        self.assertEqual(row.error, '')

    def test_joined_row_blocks_later_work(self):
        """6.1 #67: a joined row blocks later work: `later` admitted behind → nothing
        claimable, unsettled; after the host completes → claimable = [later]."""
        c, (q1,) = self.host_with_queue(1)
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        later = admit(self.stub, conv='join-c', text='later').submission
        self.claim_none()
        self.claim_none(submission_id=later.submission_id)
        self.assertEqual(self.unsettled('join-c'), 3)
        settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(self.claimable_ids(), [later.submission_id])

    def test_abort_with_joins(self):
        """6.1 #68: abort with the host running, one joined, one joining → all three."""
        c, (q1, q2) = self.host_with_queue(2)
        claim_joinable(self.stub, c.fence)
        finalize_join(self.stub, c.fence, q1)
        r = request_abort(self.stub, conversation_id='join-c')
        self.assertEqual(sorted(r.affected), sorted([c.fence.submission_id, q1, q2]))
        self.assertStatus(c.fence.submission_id, RUNNING)
        self.assertStatus(q1, JOINED)
        self.assertStatus(q2, JOINING)


class EdgeCaseTest(ContractCase):

    def test_fresh_store(self):
        """6.1 #69: a fresh store has nothing unsettled (and nothing at all)."""
        self.assertEqual(list_all(self.stub), [])
        self.assertEqual(scan_expired(self.stub), [])
        self.claim_none()

    def test_unknown_id(self):
        """6.1 #70: an unknown id → NOT_FOUND (Get, GetConversation)."""
        self.assertRpcError(NOT_FOUND, get, self.stub, 'sub_unknown')
        self.assertRpcError(NOT_FOUND, get_conversation, self.stub, 'conv_unknown')

    def test_list_filters_and_paging(self):
        """cflue List (no flue case): filters by conversation and status, pages with
        after_sequence/next_sequence (next_sequence 0 when the page is not full)."""
        a = [admit(self.stub, conv='lane-a').submission for _ in range(3)]
        b = [admit(self.stub, conv='lane-b').submission for _ in range(2)]
        every = list_all(self.stub)
        self.assertEqual(ids(every), ids(a + b))
        seqs = [s.sequence for s in every]
        self.assertEqual(seqs, sorted(seqs))
        page = self.stub.list(store_pb2.ListRequest(page_size=2))
        self.assertEqual(len(page.submissions), 2)
        self.assertTrue(page.next_page_token)
        page2 = self.stub.list(store_pb2.ListRequest(page_size=10,
                                                     page_token=page.next_page_token))
        self.assertEqual(len(page2.submissions), 3)
        self.assertEqual(page2.next_page_token, '')
        # a token only continues the listing (filters) it came from
        e = self.assertRpcError(INVALID_ARGUMENT, self.stub.list, store_pb2.ListRequest(
            page_size=2, conversation_id='lane-a', page_token=page.next_page_token))
        self.assertEqual(error_reason(e), 'INVALID_PAGE_TOKEN')
        self.assertEqual(ids(list_all(self.stub, page=1, conversation_id='lane-b')), ids(b))
        self.claim_ok(conversation_id='lane-a')
        self.assertEqual(ids(list_all(self.stub, statuses=[RUNNING])), ids(a[:1]))
        self.assertEqual(ids(list_all(self.stub, statuses=[QUEUED], conversation_id='lane-a')),
                         ids(a[1:]))
        self.assertEqual(get_conversation(self.stub, 'lane-a').unsettled, 3)

    def test_schema_version_stamp_and_refusal(self):
        """6.1 #71-73 (format_version → cflue schema_version): a fresh db is stamped
        meta.schema_version = 9; a db stamped 10 makes storaged exit non-zero with a message
        naming the version; the stamp is left unchanged."""
        sd = self.storaged
        admit(sd.stub)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            self.assertEqual(str(v), '9')
            con.execute("UPDATE meta SET value = '10' WHERE key = 'schema_version'")
            con.commit()
        finally:
            con.close()
        rc, err = sd.run_to_exit(timeout=10)
        self.assertNotEqual(rc, 0, 'storaged accepted a db with schema_version 10')
        lines = [l for l in err.splitlines()
                 if 'schema' in l.lower() and re.search(r'(?<![0-9.:-])10(?![0-9.:-])', l)]
        self.assertTrue(lines, 'no stderr line names schema version 10:\n' + err)
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            self.assertEqual(str(v), '10')
        finally:
            con.close()


class StreamContractTest(ContractCase):
    """6.2 defineConversationStreamStoreContractTests, ported to Append/Read."""

    def running(self, conv='contract', **kw):
        s = admit(self.stub, conv=conv, **kw).submission
        return self.claim_ok(submission_id=s.submission_id)

    def test_append_batch_and_read(self):
        """6.2 #3: append a two-record batch at the start → offsets 0 and 1; Read from the
        start returns both, no next_page_token, head 1; storaged stamps attempt, time and
        submission."""
        c = self.running()
        t0 = now_ms()
        r = append(self.stub, c.fence, [record('user_message', {'text': 'hi'}, id_='r1'),
                                        record('assistant_message', {'text': 'yo'}, id_='r2')])
        t1 = now_ms()
        self.assertEqual((r.first_offset, r.last_offset, r.deduplicated), (0, 1, False))
        rd = read(self.stub, 'contract', -1)
        self.assertEqual([x.offset for x in rd.records], [0, 1])
        self.assertEqual([x.id for x in rd.records], ['r1', 'r2'])
        self.assertEqual([(x.WhichOneof('body'), getattr(x, x.WhichOneof('body')).text)
                          for x in rd.records],
                         [('user_message', 'hi'), ('assistant_message', 'yo')])
        self.assertEqual((rd.next_page_token, rd.head_offset), ('', 1))
        for x in rd.records:
            self.assertEqual(x.attempt_id, c.fence.attempt_id)
            self.assertEqual(x.submission_id, c.fence.submission_id)
            self.assertTrue(t0 <= ts_ms(x.create_time) <= t1, (t0, ts_ms(x.create_time), t1))
        self.assertEqual(get_conversation(self.stub, 'contract').head_offset, 1)

    def test_read_after_last(self):
        """6.2 #4: reading after the last offset → no records, no next_page_token; beyond the
        head is OUT_OF_RANGE (OFFSET_BEYOND_HEAD)."""
        c = self.running()
        append(self.stub, c.fence, [record(id_='r1'), record(id_='r2')])
        rd = read(self.stub, 'contract', 1)
        self.assertEqual(list(rd.records), [])
        self.assertEqual(rd.next_page_token, '')
        self.assertEqual(rd.head_offset, 1)
        e = self.assertRpcError(OUT_OF_RANGE, read, self.stub, 'contract', 2)
        self.assertEqual(error_reason(e), 'OFFSET_BEYOND_HEAD')
        empty = self.running(conv='empty')
        rd = read(self.stub, 'empty', -1)
        self.assertEqual((len(rd.records), rd.next_page_token, rd.head_offset), (0, '', -1))
        self.assertTrue(empty.HasField('submission'))

    def test_read_paging(self):
        """cflue Read page_size (no flue case): pages are bounded; next_page_token on all but
        the last; a token of another conversation is INVALID_PAGE_TOKEN."""
        c = self.running()
        append(self.stub, c.fence, [record(body={'i': i}) for i in range(5)])
        p1 = read(self.stub, 'contract', -1, limit=2)
        self.assertEqual([x.offset for x in p1.records], [0, 1])
        self.assertTrue(p1.next_page_token)
        p2 = read(self.stub, 'contract', -1, limit=3, page_token=p1.next_page_token)
        self.assertEqual([x.offset for x in p2.records], [2, 3, 4])
        self.assertEqual(p2.next_page_token, '')
        self.assertEqual(p2.head_offset, 4)
        # walking pages of any size gives exactly one big read
        whole = read(self.stub, 'contract', -1, limit=1000).records
        for size in (1, 2, 4):
            self.assertEqual(list(whole), read_all(self.stub, 'contract', page_size=size))
        other = self.running(conv='other')
        append(self.stub, other.fence, [record(id_='o1'), record(id_='o2')])
        e = self.assertRpcError(INVALID_ARGUMENT, read, self.stub, 'other', -1,
                                page_token=p1.next_page_token)
        self.assertEqual(error_reason(e), 'INVALID_PAGE_TOKEN')

    def test_exact_retry_deduplicates(self):
        """6.2 #5: an exact retry of the same append → same offsets, deduplicated, stored
        once."""
        c = self.running()
        batch = [record('user_message', {'text': 'hi'}, id_='r1'),
                 record('assistant_message', {'text': 'yo'}, id_='r2')]
        a = append(self.stub, c.fence, batch)
        b = append(self.stub, c.fence, batch)
        self.assertEqual((b.first_offset, b.last_offset, b.deduplicated),
                         (a.first_offset, a.last_offset, True))
        self.assertEqual(len(read_all(self.stub, 'contract')), 2)
        self.assertEqual(get_conversation(self.stub, 'contract').head_offset, 1)

    def test_conflicting_retry(self):
        """6.2 #7: the same record id with different content → ALREADY_EXISTS; nothing
        stored; the head does not move."""
        c = self.running()
        append(self.stub, c.fence, [record('user_message', {'text': 'hi'}, id_='r1')])
        self.assertRpcError(ALREADY_EXISTS, append, self.stub, c.fence,
                            [record('user_message', {'text': 'other'}, id_='r1')])
        self.assertRpcError(ALREADY_EXISTS, append, self.stub, c.fence,
                            [record('tool_result', {'text': 'hi'}, id_='r1')])
        recs = read_all(self.stub, 'contract')
        self.assertEqual([x.id for x in recs], ['r1'])
        self.assertEqual(get_conversation(self.stub, 'contract').head_offset, 0)

    def test_generated_ids_and_empty_body(self):
        """cflue Append (no flue case): records without id get `rec_` ids; a body with every
        field at its default round-trips; offsets continue from the head."""
        c = self.running()
        append(self.stub, c.fence, [record(id_='a')])
        r = append(self.stub, c.fence, [record('system_prompt', {'text': ''}),
                                        record('system_prompt', {'text': '{}'})])
        self.assertEqual((r.first_offset, r.last_offset), (1, 2))
        recs = read_all(self.stub, 'contract')
        self.assertTrue(recs[1].id.startswith('rec_'), recs[1].id)
        self.assertTrue(recs[2].id.startswith('rec_'), recs[2].id)
        self.assertNotEqual(recs[1].id, recs[2].id)
        self.assertEqual(recs[1].WhichOneof('body'), 'system_prompt')
        self.assertEqual(recs[1].system_prompt.text, '')
        self.assertEqual(recs[2].system_prompt.text, '{}')

    def test_big_record(self):
        """6.2 #8-10: one record of 2,500,000 characters round-trips; a following append
        reads back after it; its exact retry deduplicates; a same-length retry differing by
        one character is ALREADY_EXISTS and the stream is unchanged."""
        c = self.running()
        text = ''.join(chr(ord('a') + (i % 26)) for i in range(2500000))
        big = record('assistant_message', {'text': text}, id_='big')
        a = append(self.stub, c.fence, [big], timeout=30)
        self.assertEqual((a.first_offset, a.last_offset), (0, 0))
        append(self.stub, c.fence, [record(id_='after')])
        recs = read_all(self.stub, 'contract')
        self.assertEqual([x.id for x in recs], ['big', 'after'])
        self.assertEqual(recs[0].assistant_message.text, text)
        after = read(self.stub, 'contract', 0)
        self.assertEqual([x.id for x in after.records], ['after'])
        b = append(self.stub, c.fence, [big], timeout=30)
        self.assertEqual((b.first_offset, b.deduplicated), (0, True))
        changed = text[:-1] + ('b' if text[-1] != 'b' else 'c')
        self.assertRpcError(ALREADY_EXISTS, append, self.stub, c.fence,
                            [record('assistant_message', {'text': changed}, id_='big')],
                            timeout=30)
        self.assertEqual(get_conversation(self.stub, 'contract').head_offset, 1)
        self.assertEqual(read(self.stub, 'contract', -1, limit=1).records[0]
                         .assistant_message.text, text)

    def test_stale_epoch_append_refused(self):
        """6.2 #11 (producer re-acquisition → claim epochs) and #6: after a takeover, the
        stale attempt's append — and its exact retry of an earlier batch — is refused."""
        s = admit(self.stub, conv='contract').submission
        c = self.claim_ok(submission_id=s.submission_id, owner='coordinator-1', lease_ms=200)
        batch = [record(id_='r1')]
        append(self.stub, c.fence, batch)
        time.sleep(0.3)
        t = self.claim_ok(owner='coordinator-2')
        self.assertTrue(t.takeover)
        self.assertRpcError(STALE, append, self.stub, c.fence, [record(id_='r2')])
        self.assertRpcError(STALE, append, self.stub, c.fence, batch)
        self.assertEqual([x.id for x in read_all(self.stub, 'contract')], ['r1'])
        append(self.stub, t.fence, [record(id_='r2')])
        self.assertEqual([x.id for x in read_all(self.stub, 'contract')], ['r1', 'r2'])

    def test_append_while_terminalizing(self):
        """6.2 #12 (settlement-record append → cflue): a TERMINALIZING row's holder may
        still append; a stale attempt may not; once SETTLED no append is accepted."""
        c = self.running()
        settle(self.stub, c.fence, COMPLETED, reserve_only=True)
        self.assertRpcError(STALE, append, self.stub,
                            copy_fence(c.fence, attempt_id='att_stale'), [record()])
        r = append(self.stub, c.fence, [record(id_='late')])
        self.assertEqual(r.first_offset, 0)
        s = settle(self.stub, c.fence, COMPLETED)
        self.assertEqual(s.record_offset, 1)
        self.assertRpcError(FAILED_PRECONDITION, append, self.stub, c.fence,
                            [record(id_='after-settle')])
        self.assertEqual([x.id for x in read_all(self.stub, 'contract')],
                         ['late', 'settled:' + c.fence.submission_id])

    def test_running_attempt_appends(self):
        """6.2 #13: a running claimed attempt appends an owned record."""
        c = self.running()
        r = append(self.stub, c.fence, [record('assistant_message', {'text': 'ok'},
                                               submission_id=c.fence.submission_id)])
        self.assertEqual(r.first_offset, 0)
        rec = read_all(self.stub, 'contract')[0]
        self.assertEqual(rec.submission_id, c.fence.submission_id)

    def test_record_of_foreign_submission(self):
        """6.2 #14: a record naming a submission of another agent's conversation is refused;
        no record stored."""
        c = self.running()
        other = admit(self.stub, agent='other-agent', conv='other-contract').submission
        self.assertRpcError(FAILED_PRECONDITION, append, self.stub, c.fence,
                            [record(submission_id=other.submission_id)])
        self.assertEqual(read_all(self.stub, 'contract'), [])
        self.assertEqual(read_all(self.stub, 'other-contract'), [])

    def test_fence_attempt_mismatch(self):
        """6.2 #15: the fence names attempt-2 while the row holds attempt-1 → refused; a
        wrong epoch with the right attempt → refused."""
        a = self.running(conv='contract')
        b = self.running(conv='contract-b')
        self.assertRpcError(STALE, append, self.stub,
                            copy_fence(a.fence, attempt_id=b.fence.attempt_id), [record()])
        self.assertRpcError(STALE, append, self.stub,
                            copy_fence(a.fence, epoch=a.fence.epoch + 1), [record()])
        # an empty attempt id is a missing field or a stale fence; either way refused
        self.assertRpcError((FAILED_PRECONDITION, INVALID_ARGUMENT), append, self.stub,
                            copy_fence(a.fence, attempt_id=''), [record()])
        self.assertEqual(read_all(self.stub, 'contract'), [])

    def test_unknown_submission(self):
        """6.2 #16: a fence or record naming unknown submission `ghost` is refused."""
        c = self.running()
        self.assertRpcError((FAILED_PRECONDITION, NOT_FOUND), append, self.stub,
                            fence('ghost', c.fence.attempt_id, c.fence.epoch), [record()])
        self.assertRpcError(FAILED_PRECONDITION, append, self.stub, c.fence,
                            [record(submission_id='ghost')])
        self.assertEqual(read_all(self.stub, 'contract'), [])

    def test_host_appends_for_joined_delivery(self):
        """6.2 #17: host running; delivery JOINING → the host appends a record owned by the
        delivery (accepted, stamped with the host attempt); after FinalizeJoin (JOINED)
        another one is accepted."""
        c, (d,) = self.host_with_queue(1, conv='contract')
        claim_joinable(self.stub, c.fence)
        append(self.stub, c.fence, [record('user_message', {'text': 'queued-1'},
                                           submission_id=d, id_='in-' + d)])
        finalize_join(self.stub, c.fence, d)
        append(self.stub, c.fence, [record('assistant_message', {'text': 'ack'},
                                           submission_id=d)])
        recs = read_all(self.stub, 'contract')
        self.assertEqual([x.submission_id for x in recs], [d, d])
        self.assertEqual([x.attempt_id for x in recs], [c.fence.attempt_id] * 2)

    def test_host_cannot_append_for_unclaimed_delivery(self):
        """6.2 #18: a delivery queued but never claimed → the host's append of its record is
        refused."""
        c, (d,) = self.host_with_queue(1, conv='contract')
        self.assertRpcError(FAILED_PRECONDITION, append, self.stub, c.fence,
                            [record(submission_id=d)])
        self.assertEqual(read_all(self.stub, 'contract'), [])

    def test_read_after_first_append(self):
        """6.2 #19: two appends → reading after the first returns only the second."""
        c = self.running()
        a = append(self.stub, c.fence, [record(id_='one')])
        append(self.stub, c.fence, [record(id_='two')])
        rd = read(self.stub, 'contract', a.last_offset)
        self.assertEqual([x.id for x in rd.records], ['two'])
        self.assertEqual([x.offset for x in rd.records], [a.last_offset + 1])

if __name__ == '__main__':
    unittest.main()
