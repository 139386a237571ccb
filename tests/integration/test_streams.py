"""Streams cost no thread: thousands of idle Follow streams on one storaged, and thousands of
idle Watch(follow) streams on one agentd, served by the event-driven RPC_ASYNC mode
(docs/rpc.md), while unary calls (Get, Submit) keep their latency and a watched
conversation's records reach every follower promptly. The daemons' thread counts
(/proc/<pid>/status Threads) stay where they were without the streams; agentd holds one
storaged Follow per watched conversation, not one per watcher.

The streams are opened by a child process with grpc.aio (one event loop, no thread per
stream); it prints its measurements as JSON and exits without closing its channel (closing an
aio channel with thousands of finished calls hangs in grpcio 1.51), which ends its streams."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import unittest

import grpc

from cflue_harness import (
    StoragedTestCase, agent_pb2, channel_options, common_pb2, store_pb2,
    admit, claim, get, message, record)
from test_agentd import AgentdCase, new_conv

STREAMS = int(os.environ.get('STREAMS_N', '2000'))
HOT = STREAMS // 2  # followers of the one conversation that gets records
COLD_CONVERSATIONS = 10


def proc_status(pid, key):
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    return -1


async def follow_load(target, pid, submission_id, fence_bytes, streams, hot):
    """The child's part: open the streams, measure, append, measure delivery."""
    report = {}
    ch = grpc.aio.insecure_channel(target, options=channel_options())
    follow = ch.unary_stream('/cflue.v1.Store/Follow',
                             request_serializer=store_pb2.FollowRequest.SerializeToString,
                             response_deserializer=common_pb2.Record.FromString)
    get_ = ch.unary_unary('/cflue.v1.Store/Get',
                          request_serializer=store_pb2.GetRequest.SerializeToString,
                          response_deserializer=common_pb2.Submission.FromString)
    append_ = ch.unary_unary('/cflue.v1.Store/Append',
                             request_serializer=store_pb2.AppendRequest.SerializeToString,
                             response_deserializer=store_pb2.AppendResponse.FromString)
    got = [[] for _ in range(streams)]
    errors = []

    def conv(i):
        return 'hot' if i < hot else 'cold-%d' % (i % COLD_CONVERSATIONS)

    async def consume(i):
        call = follow(store_pb2.FollowRequest(conversation_id=conv(i), after_offset=-1),
                      timeout=120)
        try:
            async for r in call:
                got[i].append((time.monotonic(), r.offset))
        except grpc.aio.AioRpcError as e:
            errors.append([i, str(e.code()), e.details()])

    tasks = [asyncio.ensure_future(consume(i)) for i in range(streams)]
    await asyncio.sleep(3.0)  # every stream opened and went idle
    report['threads'] = proc_status(pid, 'Threads')
    report['rss'] = proc_status(pid, 'VmRSS')
    worst = 0.0
    for _ in range(20):
        t0 = time.monotonic()
        await get_(store_pb2.GetRequest(submission_id=submission_id), timeout=10)
        worst = max(worst, time.monotonic() - t0)
    report['get_worst_ms'] = worst * 1000
    fence = store_pb2.Fence.FromString(fence_bytes)
    req = store_pb2.AppendRequest(fence=fence)
    for rid in ('r1', 'r2', 'r3'):
        req.records.add().CopyFrom(record(id_=rid))
    t0 = time.monotonic()
    await append_(req, timeout=10)
    deadline = t0 + 20
    while time.monotonic() < deadline and not all(len(got[i]) >= 3 for i in range(hot)):
        await asyncio.sleep(0.02)
    arrived = [got[i][2][0] - t0 for i in range(hot) if len(got[i]) >= 3]
    report['delivered'] = len(arrived)
    report['last_ms'] = max(arrived) * 1000 if arrived else -1
    report['order_ok'] = all([o for _, o in got[i][:3]] == [0, 1, 2] for i in range(hot))
    report['cold_quiet'] = all(not got[i] for i in range(hot, streams))
    report['errors'] = errors[:5]
    report['threads_after'] = proc_status(pid, 'Threads')
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # no channel close, no loop teardown: the process exit ends the streams


class FollowStreamsTest(StoragedTestCase):

    def test_two_thousand_idle_follows(self):
        sd = self.storaged
        stub = sd.stub
        hot = admit(stub, conv='hot', text='x', key='hot-1')
        fence = claim(stub, owner='streams', conversation_id='hot').fence
        for k in range(COLD_CONVERSATIONS):
            admit(stub, conv='cold-%d' % k, text='x', key='cold-%d' % k)
        threads0 = proc_status(sd.pid, 'Threads')
        rss0 = proc_status(sd.pid, 'VmRSS')
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), '--follow-load', sd.target, str(sd.pid),
             hot.submission.submission_id, fence.SerializeToString().hex(), str(STREAMS),
             str(HOT)],
            stdout=subprocess.PIPE, timeout=120, check=True)
        report = json.loads(out.stdout.decode())
        print('\nstoraged: %d idle Follow streams: threads %d -> %d, RSS %d -> %d KiB '
              '(%.1f KiB per stream); Get worst %.1f ms; %d/%d hot followers had 3 records '
              'after %.0f ms; %.1f s in all'
              % (STREAMS, threads0, report['threads'], rss0, report['rss'],
                 (report['rss'] - rss0) / float(STREAMS), report['get_worst_ms'],
                 report['delivered'], HOT, report['last_ms'], time.monotonic() - t0))
        self.assertEqual(report['errors'], [])
        self.assertLessEqual(report['threads'] - threads0, 4)
        self.assertLessEqual(report['threads_after'] - threads0, 4)
        self.assertLess(report['get_worst_ms'], 1000)
        self.assertEqual(report['delivered'], HOT)
        self.assertLess(report['last_ms'], 5000)
        self.assertTrue(report['order_ok'])
        self.assertTrue(report['cold_quiet'])
        # the child's streams ended with it: storaged forgets them and keeps serving
        self.assertEqual(get(stub, hot.submission.submission_id).submission_id,
                         hot.submission.submission_id)


async def watch_load(target, pid, sd_pid, hot_conv, hot_head, cold_convs, streams, hot):
    """The child's part for agentd: open the Watch(follow) streams, measure, Submit to the hot
    conversation, measure delivery of its records up to the settlement."""
    report = {}
    ch = grpc.aio.insecure_channel(target, options=channel_options())
    watch = ch.unary_stream('/cflue.v1.Agent/Watch',
                            request_serializer=agent_pb2.WatchRequest.SerializeToString,
                            response_deserializer=common_pb2.Record.FromString)
    submit = ch.unary_unary('/cflue.v1.Agent/Submit',
                            request_serializer=agent_pb2.SubmitRequest.SerializeToString,
                            response_deserializer=agent_pb2.Admission.FromString)
    got = [[] for _ in range(streams)]
    errors = []

    async def consume(i):
        conv = hot_conv if i < hot else cold_convs[i % len(cold_convs)]
        call = watch(agent_pb2.WatchRequest(conversation_id=conv, after_offset=hot_head
                                            if i < hot else -1, follow=True), timeout=120)
        try:
            async for r in call:
                got[i].append((time.monotonic(), r.id))
        except grpc.aio.AioRpcError as e:
            errors.append([i, str(e.code()), e.details()])

    tasks = [asyncio.ensure_future(consume(i)) for i in range(streams)]
    await asyncio.sleep(4.0)  # every stream opened (and the cold ones replayed their history)
    report['threads'] = proc_status(pid, 'Threads')
    report['rss'] = proc_status(pid, 'VmRSS')
    report['sd_threads'] = proc_status(sd_pid, 'Threads')
    t0 = time.monotonic()
    adm = await submit(agent_pb2.SubmitRequest(agent='plain', conversation_id=hot_conv,
                                               message=message('are you there?')), timeout=10)
    report['submit_ms'] = (time.monotonic() - t0) * 1000
    settled = 'settled:' + adm.submission_id
    deadline = t0 + 30
    while time.monotonic() < deadline and not all(
            any(rid == settled for _, rid in got[i]) for i in range(hot)):
        await asyncio.sleep(0.02)
    arrived = [next(ts for ts, rid in got[i] if rid == settled) - t0 for i in range(hot)
               if any(rid == settled for _, rid in got[i])]
    report['delivered'] = len(arrived)
    report['first_ms'] = min(arrived) * 1000 if arrived else -1
    report['last_ms'] = max(arrived) * 1000 if arrived else -1
    report['same_records'] = len({tuple(rid for _, rid in got[i]) for i in range(hot)}) == 1
    report['errors'] = errors[:5]
    report['threads_after'] = proc_status(pid, 'Threads')
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


class WatchStreamsTest(AgentdCase):
    stack_kwargs = {'agents': ('plain',)}

    def settle_one(self, conv, text):
        self.fm.set_scenario([{'text': 'ok: ' + text}])
        adm = self.ad.submit('plain', text, conversation_id=conv)
        sub = self.ad.get_submission(adm.submission_id, wait=True, timeout=60)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub.error)

    def test_two_thousand_idle_watchers(self):
        hot = new_conv('hot')
        self.settle_one(hot, 'first')
        cold = [new_conv('cold-%d' % k) for k in range(COLD_CONVERSATIONS)]
        for c in cold:
            self.settle_one(c, 'hello')
        head = self.ad.get_conversation(hot).head_offset
        self.fm.set_scenario([{'text': 'yes'}])
        ad_pid, sd_pid = self.ad.pid, self.stack.sd.pid
        threads0 = proc_status(ad_pid, 'Threads')
        sd_threads0 = proc_status(sd_pid, 'Threads')
        rss0 = proc_status(ad_pid, 'VmRSS')
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), '--watch-load', self.ad.target,
             str(ad_pid), str(sd_pid), hot, str(head), ','.join(cold), str(STREAMS), str(HOT)],
            stdout=subprocess.PIPE, timeout=120, check=True)
        report = json.loads(out.stdout.decode())
        print('\nagentd: %d idle Watch(follow) streams on %d conversations: threads %d -> %d '
              '(storaged %d -> %d), RSS %d -> %d KiB (%.1f KiB per watcher); Submit %.1f ms; '
              '%d/%d hot watchers had the settlement after %.0f-%.0f ms; %.1f s in all'
              % (STREAMS, COLD_CONVERSATIONS + 1, threads0, report['threads'], sd_threads0,
                 report['sd_threads'], rss0, report['rss'],
                 (report['rss'] - rss0) / float(STREAMS), report['submit_ms'],
                 report['delivered'], HOT, report['first_ms'], report['last_ms'],
                 time.monotonic() - t0))
        self.assertEqual(report['errors'], [])
        self.assertLessEqual(report['threads'] - threads0, 4)
        self.assertLessEqual(report['threads_after'] - threads0, 4)
        self.assertLessEqual(report['sd_threads'] - sd_threads0, 4)
        self.assertLess(report['submit_ms'], 1000)
        self.assertEqual(report['delivered'], HOT)
        self.assertLess(report['last_ms'], 10000)
        self.assertTrue(report['same_records'])


class WatchCacheTest(AgentdCase):
    """The records agentd keeps for watchers are bounded all together (--watch-cache-mib, here
    1 MiB), not 1 MiB for each watched conversation: eight conversations watched, each given
    a 300 KB answer, hold about one conversation's worth (they held 4.8 MiB). Every watcher
    still gets every record, and one that starts behind reads them from storaged."""
    stack_kwargs = {'agents': ('plain',),
                    'agentd_args': ('--watch-cache-mib', '1', '--metrics-listen', '127.0.0.1:0')}
    N = 8

    def watch(self, conv, after, got, done):
        """A Watch(follow) read on a thread into got; done is set at the settlement record.
        Returns the call (cancel it to end the watch)."""
        call = self.ad.watch(conv, after_offset=after, follow=True, timeout=60)

        def run():
            try:
                for r in call:
                    got.append(r.id)
                    if sum(i.startswith('settled:') for i in got) == 2:
                        done.set()  # the second submission's settlement
            except grpc.RpcError:
                pass
        threading.Thread(target=run, daemon=True).start()
        return call

    def test_the_records_kept_for_watchers_are_bounded_together(self):
        from test_metrics import samples, scrape
        convs = [new_conv('cache-%d' % i) for i in range(self.N)]
        self.fm.set_scenario([{'text': 'hi'}] * self.N)
        for c in convs:  # a conversation is watched once it exists
            sid = self.ad.submit('plain', 'hello', conversation_id=c).submission_id
            self.ad.get_submission(sid, wait=True, timeout=60)
        watched = []
        for c in convs:
            got, done = [], threading.Event()
            watched.append((got, done, self.watch(c, -1, got, done)))
        time.sleep(1)  # every Watch attached to its conversation's feed
        self.fm.set_scenario([{'text': 'x' * 300000}] * self.N)
        for c in convs:
            sid = self.ad.submit('plain', 'big answer', conversation_id=c).submission_id
            sub = self.ad.get_submission(sid, wait=True, timeout=60)
            self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub.error)
        for got, done, _ in watched:
            self.assertTrue(done.wait(30), got)
        _, text = scrape(self.ad)  # the watchers still attached
        cached = samples(text)[('cflue_agentd_watch_cache_bytes', '')]
        self.assertLessEqual(cached, 1.25 * (1 << 20))
        self.assertGreater(cached, 0)
        # every watcher had every record, and a watcher behind the cache reads them too
        want = self.records(convs[0])
        late, done = [], threading.Event()
        call = self.watch(convs[0], -1, late, done)
        self.assertTrue(done.wait(30))
        self.assertEqual(late, [r.id for r in want])
        self.assertEqual(watched[0][0], [r.id for r in want])
        for _, _, c in watched + [(None, None, call)]:
            c.cancel()


if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '--follow-load':
        a = sys.argv[2:]
        asyncio.run(follow_load(a[0], int(a[1]), a[2], bytes.fromhex(a[3]), int(a[4]),
                                int(a[5])))
    if len(sys.argv) > 1 and sys.argv[1] == '--watch-load':
        a = sys.argv[2:]
        asyncio.run(watch_load(a[0], int(a[1]), int(a[2]), a[3], int(a[4]), a[5].split(','),
                               int(a[6]), int(a[7])))
    unittest.main()
