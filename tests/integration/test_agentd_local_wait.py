"""GetSubmission(wait) answered by agentd without storaged (agentd/settled_here.c).

A wait on a submission this agentd drives parks on the drive and is answered by its Settle; a
wait on one it settled a moment ago is answered from memory. storaged runs with
CFLUE_RPC_STATS=1 and logs its per-method call counts when it stops: the local waits cost it no
GetConversation and no Follow, and Gets only from agentd's abort polling (one per live drive
every 500 ms) and this test's own comparisons. A wait on a submission another agentd drives
takes the storaged path (which the counts show: the control that they count what we think).
A wait whose drive stops without settling (agentd SIGTERM) ends with an error at once, a wait
whose drive is interrupted (toold down) is answered once another drive settles it, and a
cancelled wait leaves nothing behind (a later wait is answered; agentd exits cleanly). Submits
waiting for a frozen storaged hold no RPC worker: a wait answered from memory goes through
beside twenty of them.
"""
import math
import os
import re
import signal
import sys
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import BenchBrainStack  # noqa: E402
from cflue_harness import agent_pb2, common_pb2, store_pb2  # noqa: E402

AGENT = BenchBrainStack.AGENT
COMPLETED = common_pb2.OUTCOME_COMPLETED
POLL_S = 0.5  # agentd's abort polling: one Get per live drive per tick (engine.c)


class Stack(BenchBrainStack):
    """BenchBrainStack with storaged counting its calls (CFLUE_RPC_STATS=1) and n_agentd
    agentds (owners a0, a1, ...)."""

    def __init__(self, delay_ms, n_agentd=1, store_env=None, agentd_args=()):
        super(Stack, self).__init__(delay_ms, 'a line of the file the bench brain reads\n' * 100,
                                    n_agentd=n_agentd, agentd_args=agentd_args,
                                    owner_ids=['a%d' % i for i in range(n_agentd)],
                                    store_env=dict(store_env or {}, CFLUE_RPC_STATS='1'),
                                    prefix='cflue-local-wait-it-')


def wait_for_drive(ads, submission_id, timeout=30):
    """Returns the agentd of ads whose drive of submission_id started (its 'drive' log line)."""
    pat = re.compile(r'event=drive submission=%s ' % re.escape(submission_id))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ad in ads:
            if pat.search(ad.stderr_text()):
                return ad
        time.sleep(0.02)
    raise AssertionError('no drive of %s started\n%s' % (
        submission_id, '\n'.join(ad.stderr_text() for ad in ads)))


def get_wait(ad, submission_id, timeout=60):
    return ad.call('GetSubmission', agent_pb2.GetSubmissionRequest(
        submission_id=submission_id, wait=True), timeout=timeout)


class LocalWaitTest(unittest.TestCase):
    def tearDown(self):
        self.stack.remove()

    def test_waits_on_own_drives_and_settlements_cost_storaged_nothing(self):
        self.stack = Stack(delay_ms=300)
        ad = self.stack.ad
        subs, bound, test_gets = {}, 0, 0
        for i in range(3):
            t0 = time.monotonic()
            adm = ad.submit(AGENT, 'local wait %d' % i)
            wait_for_drive([ad], adm.submission_id)
            sub = get_wait(ad, adm.submission_id)
            # one abort poll per tick while the drive was live, and one from a snapshot
            # taken just before it ended
            bound += math.ceil((time.monotonic() - t0) / POLL_S) + 2
            self.assertEqual(sub.submission_id, adm.submission_id)
            self.assertEqual(sub.status, common_pb2.SUBMISSION_STATUS_SETTLED)
            self.assertEqual(sub.outcome, COMPLETED, sub.error)
            self.assertGreater(sub.usage.input_tokens, 0)
            self.assertGreater(sub.usage.output_tokens, 0)
            # exactly what storaged answers
            self.assertEqual(sub, self.stack.sd.stub.get(
                store_pb2.GetRequest(submission_id=adm.submission_id), timeout=10))
            test_gets += 1
            subs[adm.submission_id] = sub
        # no drive is live any more: abort polling stops; waits now come from the ring
        time.sleep(2 * POLL_S + 0.2)
        ring_waits = 0
        for _ in range(10):
            for sid, sub in subs.items():
                self.assertEqual(get_wait(ad, sid, timeout=10), sub)
                ring_waits += 1
        counts = self.stack.store_counts()
        self.assertEqual(counts.get('GetConversation', 0), 0, counts)
        self.assertEqual(counts.get('Follow', 0), 0, counts)
        # the storaged path would cost 2 Gets per wait on a live drive and 1 per ring wait
        self.assertLessEqual(counts.get('Get', 0) - test_gets, bound, counts)
        self.assertLess(bound, ring_waits + 2 * len(subs))

    def test_wait_on_another_agentds_drive_takes_the_storaged_path(self):
        self.stack = Stack(delay_ms=300, n_agentd=2)
        a, b = self.stack.ads
        answers = []
        for i in range(2):
            adm = a.submit(AGENT, 'elsewhere %d' % i)
            driver = wait_for_drive([a, b], adm.submission_id)
            other = b if driver is a else a
            sub = get_wait(other, adm.submission_id)
            self.assertEqual(sub.outcome, COMPLETED, sub.error)
            self.assertGreater(sub.usage.input_tokens, 0)
            self.assertEqual(get_wait(driver, adm.submission_id, timeout=10), sub)
            self.assertEqual(get_wait(other, adm.submission_id, timeout=10), sub)
            answers.append(sub)
        self.assertEqual(len({s.submission_id for s in answers}), 2)
        counts = self.stack.store_counts()
        # the waits through the agentd that did not drive: Get, GetConversation, Follow
        self.assertGreaterEqual(counts.get('GetConversation', 0), 2, counts)
        self.assertGreaterEqual(counts.get('Follow', 0), 2, counts)

    def test_wait_on_a_drive_stopped_by_sigterm_ends_with_an_error(self):
        self.stack = Stack(delay_ms=30000)
        ad = self.stack.ad
        adm = ad.submit(AGENT, 'slow')
        wait_for_drive([ad], adm.submission_id)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(get_wait, ad, adm.submission_id, 120)
            time.sleep(0.5)
            self.assertFalse(fut.done())
            t0 = time.monotonic()
            self.assertEqual(ad.terminate(), 0, ad.stderr_text())
            with self.assertRaises(grpc.RpcError) as cm:
                fut.result(timeout=30)
            self.assertLess(time.monotonic() - t0, 20)
            self.assertIn(cm.exception.code(),
                          (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED),
                          cm.exception.details())
        self.assertIn('event=drive_stopped submission=%s' % adm.submission_id, ad.stderr_text())

    def test_wait_on_an_interrupted_drive_is_answered_when_it_settles_later(self):
        self.stack = Stack(delay_ms=1000)
        ad, td = self.stack.ad, self.stack.td
        adm = ad.submit(AGENT, 'interrupted')
        wait_for_drive([ad], adm.submission_id)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(get_wait, ad, adm.submission_id, 120)
            td.kill()  # the first turn's tool call fails: the drive ends interrupted
            deadline = time.monotonic() + 60
            while 'event=drive_interrupted submission=%s' % adm.submission_id \
                    not in ad.stderr_text():
                self.assertLess(time.monotonic(), deadline, ad.stderr_text())
                time.sleep(0.05)
            # the drive's end hands its waiter to storaged a moment after it logs the
            # interruption (asserting it at once failed under ASan on a loaded machine)
            handed = 'event=here.unsettled submission=%s waiters=1' % adm.submission_id
            while handed not in ad.stderr_text():
                self.assertLess(time.monotonic(), deadline, ad.stderr_text())
                time.sleep(0.05)
            self.assertFalse(fut.done())
            td.start()  # the resumed drive settles it; the wait hears it through storaged
            sub = fut.result(timeout=90)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        self.assertGreater(sub.usage.input_tokens, 0)

    def test_a_cancelled_wait_leaves_nothing_behind(self):
        self.stack = Stack(delay_ms=1000)
        ad = self.stack.ad
        adm = ad.submit(AGENT, 'cancelled')
        wait_for_drive([ad], adm.submission_id)
        with self.assertRaises(grpc.RpcError) as cm:
            get_wait(ad, adm.submission_id, timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        # and a caller that cancels its call
        fut = ad._current_channel().unary_unary(
            '/cflue.v1.Agent/GetSubmission',
            request_serializer=agent_pb2.GetSubmissionRequest.SerializeToString,
            response_deserializer=common_pb2.Submission.FromString).future(
                agent_pb2.GetSubmissionRequest(submission_id=adm.submission_id, wait=True),
                timeout=60)
        time.sleep(0.2)
        self.assertTrue(fut.cancel())
        sub = get_wait(ad, adm.submission_id)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        self.assertEqual(get_wait(ad, adm.submission_id, timeout=10), sub)
        counts = self.stack.store_counts()  # agentd exits 0 (under ASan: no leak)
        self.assertEqual(counts.get('Follow', 0), 0, counts)

    def test_submits_waiting_on_a_frozen_storaged_hold_no_worker(self):
        # Submit waits for its Admit without a thread: with storaged frozen, more Submits
        # than agentd has RPC workers (8) are in flight, and a wait on a submission settled
        # here (answered from memory, on a worker) is still answered at once
        self.stack = Stack(delay_ms=0)
        ad, sd = self.stack.ad, self.stack.sd
        adm = ad.submit(AGENT, 'settled before the freeze')
        settled = get_wait(ad, adm.submission_id)
        self.assertEqual(settled.outcome, COMPLETED, settled.error)
        os.kill(sd.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(20) as pool:
                futs = [pool.submit(ad.submit, AGENT, 'frozen %d' % i, timeout=60)
                        for i in range(20)]
                time.sleep(1.0)
                self.assertFalse(any(f.done() for f in futs))
                t0 = time.monotonic()
                self.assertEqual(get_wait(ad, adm.submission_id, timeout=5), settled)
                self.assertLess(time.monotonic() - t0, 2.0)
                os.kill(sd.pid, signal.SIGCONT)
                ids = [f.result(timeout=60).submission_id for f in futs]
        finally:
            os.kill(sd.pid, signal.SIGCONT)
        self.assertEqual(len(set(ids)), 20)
        for sid in ids:
            self.assertEqual(get_wait(ad, sid).outcome, COMPLETED)

    def assert_callers_that_gave_up_hold_no_worker(self, call):
        """With storaged frozen, 8 calls call(ad, i) whose callers give up after 1 s end
        DEADLINE_EXCEEDED and hold agentd's RPC workers (8) no longer than that: a wait
        answered from memory comes through right after them."""
        self.stack = Stack(delay_ms=0)
        ad, sd = self.stack.ad, self.stack.sd
        adm = ad.submit(AGENT, 'settled before the freeze')
        settled = get_wait(ad, adm.submission_id)
        os.kill(sd.pid, signal.SIGSTOP)
        try:
            def gives_up(i):
                with self.assertRaises(grpc.RpcError) as cm:
                    call(ad, i)
                return cm.exception.code()

            with ThreadPoolExecutor(8) as pool:
                codes = set(pool.map(gives_up, range(8)))
            self.assertEqual(codes, {grpc.StatusCode.DEADLINE_EXCEEDED})
            t0 = time.monotonic()
            self.assertEqual(get_wait(ad, adm.submission_id, timeout=10), settled)
            self.assertLess(time.monotonic() - t0, 3.0)
        finally:
            os.kill(sd.pid, signal.SIGCONT)

    def test_waits_that_gave_up_hold_no_worker(self):
        # waits on the storaged path (it waited out their 15 s Store calls before)
        self.assert_callers_that_gave_up_hold_no_worker(
            lambda ad, i: get_wait(ad, 'sub_01NOWHERE%02d' % i, timeout=1))

    def test_aborts_and_reads_that_gave_up_hold_no_worker(self):
        # Abort and GetConversation, whose Store calls took 15 s whatever the caller's deadline
        def call(ad, i):
            conv = 'c-nowhere-%d' % i
            if i % 2:
                ad.call('Abort', agent_pb2.AbortRequest(conversation_id=conv), timeout=1)
            else:
                ad.call('GetConversation', agent_pb2.GetConversationRequest(
                    conversation_id=conv), timeout=1)
        self.assert_callers_that_gave_up_hold_no_worker(call)

    def test_submits_waiting_on_storaged_hold_a_bounded_memory(self):
        # with storaged frozen, Submits of 4 MiB each were all held (their requests and Admits:
        # 100 of them took agentd from 19 to 836 MiB); past --submit-memory-mib (16 here) of
        # messages in flight a Submit is refused as busy at once. One at a time, each caller
        # giving up after 1 s while its Admit goes on waiting for storaged.
        self.stack = Stack(delay_ms=0, agentd_args=('--submit-memory-mib', '16'))
        ad, sd = self.stack.ad, self.stack.sd
        os.kill(sd.pid, signal.SIGSTOP)
        try:
            blob = b'\0' * ((4 << 20) - 1024)
            ends = []
            while len(ends) < 10 and grpc.StatusCode.RESOURCE_EXHAUSTED not in ends:
                req = agent_pb2.SubmitRequest(agent=AGENT, message=common_pb2.Message(
                    text='big %d' % len(ends), attachments=[common_pb2.Attachment(
                        name='b.bin', mime_type='application/octet-stream', data=blob)]))
                with self.assertRaises(grpc.RpcError) as cm:
                    ad.call('Submit', req, timeout=2)
                ends.append(cm.exception.code())
            # four held (16 MiB; on a slow machine a caller may give up before agentd has its
            # request, which then holds nothing), then refused
            self.assertEqual(ends[-1], grpc.StatusCode.RESOURCE_EXHAUSTED, ends)
            self.assertGreaterEqual(len(ends), 5, ends)
            self.assertIn('MiB of messages', cm.exception.details())
        finally:
            os.kill(sd.pid, signal.SIGCONT)

    def test_a_wait_whose_follow_storaged_refuses_ends_with_its_error(self):
        # storaged out of streams (1 MiB of stream memory: 64) answers a wait's Follow with
        # RESOURCE_EXHAUSTED while it still answers Get: the wait ends with that error at once,
        # instead of looking again and opening another Follow in a loop until its deadline
        self.stack = Stack(delay_ms=30000, store_env={'CFLUE_MAX_STREAM_MEMORY': '1'})
        ad, sd = self.stack.ad, self.stack.sd
        first = ad.submit(AGENT, 'its model call takes 30 s')
        queued = ad.submit(AGENT, 'queued behind it', conversation_id=first.conversation_id)
        head = ad.get_conversation(first.conversation_id).head_offset
        held = [sd.stub.follow(store_pb2.FollowRequest(conversation_id=first.conversation_id,
                                                       after_offset=head), timeout=60)
                for _ in range(80)]
        try:
            self.wait_for_refusals(held)
            t0 = time.monotonic()
            with self.assertRaises(grpc.RpcError) as cm:
                get_wait(ad, queued.submission_id, timeout=20)
            took = time.monotonic() - t0
        finally:
            for c in held:
                c.cancel()
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                         cm.exception.details())
        self.assertLess(took, 5.0)
        self.assertLess(len(re.findall(r'event=watch\.feed_ended', ad.stderr_text())), 3)

    def wait_for_refusals(self, calls):
        """Waits until some of storaged's Follows were refused (its streams are all taken)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls):
                return
            time.sleep(0.05)
        self.fail('storaged refused none of %d Follows' % len(calls))


if __name__ == '__main__':
    unittest.main()
