"""Interop: an independent Python gRPC client drives storaged end to end (Admit, Claim,
Append, live Follow with resume, Settle, Follow until_settled, Health Check and Watch)."""

import json
import threading
import time
import unittest

import grpc

from cflue_harness import (
    ts_ms, error_reason, duration,
    NOT_SERVING, SERVING, StoragedTestCase, common_pb2, store_pb2,
    admit, append, claim, get, now_ms, read_all, record, settle)

WAIT_S = 30.0  # bounds waits for success only (a loaded CI machine, sanitizer builds)


class Follower(object):
    """Runs a Follow call on a thread, collecting records."""

    def __init__(self, stub, conversation_id, after_offset=-1, until_settled='',
                 timeout=30):
        self.call = stub.follow(store_pb2.FollowRequest(
            conversation_id=conversation_id, after_offset=after_offset,
            until_settled=until_settled), timeout=timeout)
        self.records = []
        self.error = None
        self.ended = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for r in self.call:
                with self.cond:
                    self.records.append(r)
                    self.cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        finally:
            with self.cond:
                self.ended = True
                self.cond.notify_all()

    def wait_for(self, n, timeout=WAIT_S):
        """Waits until at least n records arrived; returns a copy of them."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.records) < n and not self.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return list(self.records)

    def wait_end(self, timeout=WAIT_S):
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def cancel(self):
        self.call.cancel()
        self.wait_end()


class InteropTest(StoragedTestCase):

    def assertConsecutive(self, recs, first=0):
        self.assertEqual([r.offset for r in recs], list(range(first, first + len(recs))))

    def test_end_to_end_with_live_follow(self):
        """Admit, Claim, Append; Follow from -1 in a thread receives two live batches in
        order with consecutive offsets; cancel and resume from the last seen offset → no gap,
        no duplicate; Settle; the settlement record arrives live."""
        a = admit(self.stub, conv='interop', text='hello from python', key='py-1')
        sid = a.submission.submission_id
        self.assertEqual(a.offset, -1)
        c = claim(self.stub, owner='py-owner')
        self.assertEqual(c.submission.submission_id, sid)

        f1 = Follower(self.stub, 'interop', -1)
        time.sleep(0.3)  # let the stream go live before anything is appended
        self.assertEqual(f1.records, [])
        self.assertFalse(f1.ended, f1.error)
        b1 = [record('user_message', {'text': 'hello from python'}, id_='u1'),
              record('assistant_message', {'text': 'part 1'}, id_='a1'),
              record('assistant_message', {'text': 'part 2'}, id_='a2')]
        r1 = append(self.stub, c.fence, b1)
        self.assertEqual((r1.first_offset, r1.last_offset), (0, 2))
        got = f1.wait_for(3)
        self.assertEqual([x.id for x in got], ['u1', 'a1', 'a2'], f1.error)
        b2 = [record('tool_result', {'ok': True}, id_='t1'),
              record('assistant_message', {'text': 'done'}, id_='a3')]
        r2 = append(self.stub, c.fence, b2)
        self.assertEqual((r2.first_offset, r2.last_offset), (3, 4))
        got = f1.wait_for(5)
        self.assertEqual([x.id for x in got], ['u1', 'a1', 'a2', 't1', 'a3'])
        self.assertConsecutive(got)
        for x in got:
            self.assertEqual(x.attempt_id, c.fence.attempt_id)
            self.assertEqual(x.submission_id, sid)
            self.assertGreater(ts_ms(x.create_time), 0)
        self.assertIn('"ok": true', got[3].tool_result.text)

        f1.cancel()
        self.assertEqual(f1.error.code(), grpc.StatusCode.CANCELLED)
        seen = list(f1.records)
        last = seen[-1].offset
        # records appended while nobody follows
        append(self.stub, c.fence, [record(id_='gap-1'), record(id_='gap-2')])
        f2 = Follower(self.stub, 'interop', last)
        got2 = f2.wait_for(2)
        self.assertEqual([x.id for x in got2], ['gap-1', 'gap-2'])
        append(self.stub, c.fence, [record(id_='live-3')])
        got2 = f2.wait_for(3)
        st = settle(self.stub, c.fence, common_pb2.OUTCOME_COMPLETED)
        got2 = f2.wait_for(4)
        everything = seen + got2
        self.assertConsecutive(everything)
        self.assertEqual(len({x.id for x in everything}), len(everything))
        self.assertEqual(everything[-1].id, 'settled:' + sid)
        self.assertEqual(everything[-1].offset, st.record_offset)
        body = everything[-1].submission_settled
        self.assertEqual((body.outcome, body.error), (common_pb2.OUTCOME_COMPLETED, ''))
        self.assertEqual([x.SerializeToString() for x in read_all(self.stub, 'interop')],
                         [x.SerializeToString() for x in everything])
        f2.cancel()
        self.assertEqual(get(self.stub, sid).status, common_pb2.SUBMISSION_STATUS_SETTLED)

    def test_follow_resume_mid_history(self):
        """Cancel a Follow part-way through existing history and resume from the last
        offset seen: the union is the whole stream, once."""
        admit(self.stub, conv='resume')
        c = claim(self.stub)
        append(self.stub, c.fence, [record(body={'i': i}) for i in range(50)])
        call = self.stub.follow(store_pb2.FollowRequest(conversation_id='resume',
                                                        after_offset=-1), timeout=30)
        seen = []
        for r in call:
            seen.append(r)
            if len(seen) == 17:
                call.cancel()
                break
        f = Follower(self.stub, 'resume', seen[-1].offset)
        rest = f.wait_for(50 - 17)
        f.cancel()
        allr = seen + rest
        self.assertConsecutive(allr)
        self.assertEqual([json.loads(x.assistant_message.text[len('answer'):])['i']
                          for x in allr], list(range(50)))

    def test_follow_until_settled(self):
        """Follow with until_settled ends OK right after the settlement record, live or
        when the settlement is already in the history; records after it are not sent."""
        s1 = admit(self.stub, conv='until').submission.submission_id
        s2 = admit(self.stub, conv='until').submission.submission_id
        c = claim(self.stub)
        self.assertEqual(c.submission.submission_id, s1)
        f = Follower(self.stub, 'until', -1, until_settled=s1)
        time.sleep(0.2)
        append(self.stub, c.fence, [record(id_='r1'), record(id_='r2')])
        self.assertEqual(len(f.wait_for(2)), 2)
        self.assertFalse(f.ended)
        st = settle(self.stub, c.fence, common_pb2.OUTCOME_COMPLETED)
        self.assertTrue(f.wait_end(), 'Follow(until_settled) did not end after settlement')
        self.assertIsNone(f.error, f.error)
        self.assertEqual(f.call.code(), grpc.StatusCode.OK)
        self.assertEqual([x.id for x in f.records], ['r1', 'r2', 'settled:' + s1])
        self.assertEqual(f.records[-1].offset, st.record_offset)

        # the next submission writes more records after the settlement
        c2 = claim(self.stub)
        self.assertEqual(c2.submission.submission_id, s2)
        append(self.stub, c2.fence, [record(id_='r3')])
        # already settled, record in the history after after_offset: sent, then the end
        got = list(self.stub.follow(store_pb2.FollowRequest(
            conversation_id='until', after_offset=-1, until_settled=s1), timeout=10))
        self.assertEqual([x.id for x in got], ['r1', 'r2', 'settled:' + s1])
        got = list(self.stub.follow(store_pb2.FollowRequest(
            conversation_id='until', after_offset=0, until_settled=s1), timeout=10))
        self.assertEqual([x.id for x in got], ['r2', 'settled:' + s1])
        # already settled and its record at or before after_offset: ends at once
        for after in (st.record_offset, st.record_offset + 1):
            got = list(self.stub.follow(store_pb2.FollowRequest(
                conversation_id='until', after_offset=after, until_settled=s1), timeout=10))
            self.assertEqual(got, [])
        # a live follow of s2 ends after s2's settlement record
        f2 = Follower(self.stub, 'until', st.record_offset, until_settled=s2)
        self.assertEqual([x.id for x in f2.wait_for(1)], ['r3'])
        st2 = settle(self.stub, c2.fence, common_pb2.OUTCOME_FAILED, 'nope')
        self.assertTrue(f2.wait_end())
        self.assertIsNone(f2.error, f2.error)
        self.assertEqual([x.id for x in f2.records], ['r3', 'settled:' + s2])
        self.assertEqual(f2.records[-1].offset, st2.record_offset)
        body = f2.records[-1].submission_settled
        self.assertEqual((body.outcome, body.error), (common_pb2.OUTCOME_FAILED, 'nope'))

    def test_follow_until_settled_joined(self):
        """until_settled naming a joined delivery ends after the delivery's own settlement
        record written by the host's fan-out."""
        admit(self.stub, conv='until-join')
        d = admit(self.stub, conv='until-join').submission.submission_id
        c = claim(self.stub)
        self.stub.claim_joinable(store_pb2.ClaimJoinableRequest(host=c.fence))
        self.stub.finalize_join(store_pb2.JoinRequest(host=c.fence, submission_id=d))
        f = Follower(self.stub, 'until-join', -1, until_settled=d)
        time.sleep(0.2)
        settle(self.stub, c.fence, common_pb2.OUTCOME_COMPLETED)
        self.assertTrue(f.wait_end())
        self.assertIsNone(f.error, f.error)
        self.assertEqual(f.records[-1].id, 'settled:' + d)
        self.assertEqual(f.records[-1].submission_id, d)

    def test_health_check_and_watch_through_sigterm(self):
        """Health Check answers SERVING for "" and cflue.v1.Store (NOT_FOUND for others);
        Watch gets SERVING, then NOT_SERVING on SIGTERM, then the stream ends; exit 0."""
        sd = self.storaged
        self.assertEqual(sd.health_check(''), SERVING)
        self.assertEqual(sd.health_check('cflue.v1.Store'), SERVING)
        try:
            sd.health_check('cflue.v1.Unknown')
            self.fail('Check of an unknown service succeeded')
        except grpc.RpcError as e:
            self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND)

        watches = {}
        for svc in ('', 'cflue.v1.Store'):
            w = {'statuses': [], 'error': None, 'cond': threading.Condition()}
            w['call'] = sd.health_watch(svc, timeout=30)

            def run(w=w):
                try:
                    for resp in w['call']:
                        with w['cond']:
                            w['statuses'].append(resp.status)
                            w['cond'].notify_all()
                except grpc.RpcError as e:
                    w['error'] = e
            w['thread'] = threading.Thread(target=run, daemon=True)
            w['thread'].start()
            watches[svc] = w
        for svc, w in watches.items():
            with w['cond']:
                w['cond'].wait_for(lambda: w['statuses'], WAIT_S)
            self.assertEqual(w['statuses'][:1], [SERVING], 'watch %r' % svc)
        # a Follow that is live during shutdown must not block the graceful exit
        admit(self.stub, conv='shutdown')
        live = Follower(self.stub, 'shutdown', -1)
        time.sleep(0.1)
        t0 = time.monotonic()
        sd.stop()
        took = time.monotonic() - t0
        for svc, w in watches.items():
            w['thread'].join(WAIT_S)
            self.assertFalse(w['thread'].is_alive(), 'watch %r did not end' % svc)
            self.assertIn(NOT_SERVING, w['statuses'],
                          'watch %r saw %r (end: %r)' % (svc, w['statuses'], w['error']))
            self.assertEqual(w['statuses'][-1], NOT_SERVING)
        self.assertTrue(live.wait_end())
        self.assertLess(took, 15.0)

    def test_tcp_port_file_and_env(self):
        """TCP on port 0 with --port-file; flags read from CFLUE_* env (CFLUE_LEASE_MS is
        the default lease of a Claim with lease_ms 0)."""
        sd = self.start_storaged(tcp=True, env={'CFLUE_LEASE_MS': '1234'})
        self.assertGreater(sd.port, 0)
        self.assertTrue(sd.target.startswith('127.0.0.1:'))
        admit(sd.stub)
        t0 = now_ms()
        c = claim(sd.stub, lease_ms=0)
        t1 = now_ms()
        lease = ts_ms(c.submission.lease_expire_time)
        self.assertTrue(t0 + 1234 <= lease <= t1 + 1234, (t0, lease, t1))
        sd.stop()

    def test_flags(self):
        """--lease-ms and --timeout-ms set the Claim defaults (lease and deadline)."""
        sd = self.start_storaged(extra_args=['--lease-ms', '2345', '--timeout-ms', '60000'])
        admit(sd.stub)
        t0 = now_ms()
        c = claim(sd.stub, lease_ms=0)
        t1 = now_ms()
        s = c.submission
        self.assertTrue(t0 + 2345 <= ts_ms(s.lease_expire_time) <= t1 + 2345,
                        (t0, ts_ms(s.lease_expire_time), t1))
        self.assertTrue(t0 + 60000 <= ts_ms(s.deadline) <= t1 + 60000,
                        (t0, ts_ms(s.deadline), t1))
        sd.stop()

    def test_restart_keeps_everything(self):
        """SIGTERM then restart on the same db: submissions and records are intact and
        offsets continue."""
        sd = self.storaged
        s = admit(sd.stub, conv='durable', key='d-1').submission
        c = claim(sd.stub)
        append(sd.stub, c.fence, [record(id_='x')])
        sd.stop()
        sd.start()
        self.assertEqual(get(sd.stub, s.submission_id).status, common_pb2.SUBMISSION_STATUS_RUNNING)
        r = append(sd.stub, c.fence, [record(id_='y')])
        self.assertEqual(r.first_offset, 1)
        again = admit(sd.stub, conv='durable', key='d-1')
        self.assertTrue(again.deduplicated)
        self.assertEqual([x.id for x in read_all(sd.stub, 'durable')], ['x', 'y'])


if __name__ == '__main__':
    unittest.main()
