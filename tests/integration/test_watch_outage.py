"""Idle watchers through a storaged outage longer than agentd's retry windows.

agentd serves Watch(follow) and GetSubmission(wait) without a thread per caller (agentd/
watch.c: one shared storaged Follow per watched conversation; settled_here.c parks a wait on a
drive of this process). Here, with real storaged, toold, agentd (--lease-ms 5000: every Store
call of a drive is retried for 5 s) and the fake model's bench brain:

1. 300 Watch(follow=true) streams (CFLUE_LONG=1: 1,200) sit on 30 finished conversations
   (from offset -1, the middle or the head), and 20 GetSubmission(wait) calls wait on running
   submissions: 10 whose drive sleeps in a tool call (parked on the drive here) and 10 queued
   behind them in the same conversations (the storaged path: a Follow).
2. storaged is killed (SIGKILL: "down") for 15 s, three times agentd's 5 s retry window, or
   frozen (SIGSTOP: "hung") for 22 s (a call to a frozen storaged only fails at its own 15 s
   timeout, so the window is outlasted past that); then started again on the same database,
   or resumed (SIGCONT). CFLUE_LONG=1: 30 s and 40 s. Either way the drives in flight are
   interrupted (agentd logs drive_fault) and resumed.
3. Every watcher either kept streaming or ended with a clear status (UNAVAILABLE, or
   DEADLINE_EXCEEDED from agentd's own 15 s Store timeout) - when storaged is killed, within
   KILL_END_S of the kill: the lost connection ends agentd's Follows at once, the bound only
   allows for a slow (sanitizer) build. An ended watcher resumes with Watch(after_offset=<the
   last offset it got>); then one new message per conversation is submitted, and every
   watcher's records (first stream and resumed ones together) are exactly the conversation's
   records in storaged after its starting offset: in order, no gap, no duplicate. Every
   GetSubmission(wait) returns the settled submission, or a clear error after which a retry
   returns it; none runs into its own 90 s deadline.
4. agentd answers health checks (SERVING) throughout and a Submit after storaged is back, its
   thread count stays within THREADS_SLACK of what it was before the watchers (it does not
   grow with 300 callers), and once every watcher is cancelled it holds no watcher and no
   feed: at SIGTERM it logs `watch.counts feeds=0 watchers=0` and exits 0.
"""
import os
import re
import signal
import sys
import threading
import time
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import SERVING, common_pb2, proc_status_field, read_all  # noqa: E402
from test_agentd_engine import AGENT, EngineStack  # noqa: E402

LONG = bool(os.environ.get('CFLUE_LONG'))
CONVERSATIONS = 40 if LONG else 30
WATCHERS = 1200 if LONG else 300
RUNNING = 10          # conversations with a long-running submission (and one queued behind it)
# storaged killed: 3x agentd's retry window. Frozen: a call to it hangs until its own 15 s
# timeout (STORE_TIMEOUT_MS), so the retry window is only outlasted past 15 s: 22 s.
OUTAGE_S = {'down': 30 if LONG else 15, 'hung': 40 if LONG else 22}
LEASE_MS = 5000       # agentd's retry window for a drive's Store calls (at least 5 s)
SLEEP_S = 3           # the running drives' tool call: they come back to storaged mid-outage
KILL_END_S = 5.0      # a killed storaged ends every watcher within this
WAIT_DEADLINE_S = 90  # each GetSubmission(wait) call's own deadline: none may run into it
STREAM_DEADLINE_S = 300
SETTLE_S = 75         # after storaged is back: interrupted drives resume (backoff <= 30 s)
THREADS_SLACK = 8
SUBMIT_BACK_S = 5.0   # a Submit succeeds this soon after storaged is back
CLEAR = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
SMALL = 'small.txt'


class Watcher(object):
    """One Watch(follow) caller on a thread: reads records, and after an error resumes from
    the last offset it got once storaged is back (retrying a refused resume)."""

    def __init__(self, test, conv, after):
        self.t = test
        self.conv = conv
        self.start_after = after
        self.offsets, self.ids = [], []
        self.ends = []  # (code, monotonic time, details) of every stream that ended
        self.call = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def last(self):
        return self.offsets[-1] if self.offsets else self.start_after

    def run(self):
        while True:
            with self.lock:
                if self.t.stop.is_set():
                    return
                self.call = self.t.ad.watch(self.conv, self.last(), follow=True,
                                            timeout=STREAM_DEADLINE_S)
            try:
                for r in self.call:
                    self.offsets.append(r.offset)
                    self.ids.append(r.id)
                self.ends.append((grpc.StatusCode.OK, time.monotonic(), 'ended'))
            except grpc.RpcError as e:
                if self.t.stop.is_set() and e.code() == grpc.StatusCode.CANCELLED:
                    return
                self.ends.append((e.code(), time.monotonic(), e.details()))
            if self.t.stop.is_set():
                return
            self.t.back.wait()
            time.sleep(0.2)

    def cancel(self):
        with self.lock:
            if self.call is not None:
                self.call.cancel()


class Waiter(object):
    """GetSubmission(wait) on a thread, retried after an error until it returns settled."""

    def __init__(self, test, submission_id):
        self.t = test
        self.sid = submission_id
        self.result = None
        self.errors = []  # (code, seconds the call took, details)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        deadline = time.monotonic() + max(OUTAGE_S.values()) + SETTLE_S + 30
        while time.monotonic() < deadline and not self.t.stop.is_set():
            t0 = time.monotonic()
            try:
                sub = self.t.ad.get_submission(self.sid, wait=True, timeout=WAIT_DEADLINE_S)
                if sub.status == common_pb2.SUBMISSION_STATUS_SETTLED:
                    self.result = sub
                    return
                self.errors.append(('not settled', time.monotonic() - t0, str(sub.status)))
            except grpc.RpcError as e:
                self.errors.append((e.code(), time.monotonic() - t0, e.details()))
            time.sleep(0.5)


class WatchOutageBase(object):
    MODE = None  # 'hung' or 'down'

    def setUp(self):
        self.stack = EngineStack(delay_ms=0, agentd_args=('--lease-ms', str(LEASE_MS)))
        with open(os.path.join(self.stack.td.workspace('bench'), SMALL), 'w') as f:
            f.write('a small file for the outage test\n')
        self.ad, self.sd = self.stack.ad, self.stack.sd
        self.stop = threading.Event()
        self.back = threading.Event()
        self.watchers, self.waiters = [], []

    def tearDown(self):
        self.stop.set()
        self.back.set()
        if self.sd.alive():
            try:
                os.kill(self.sd.pid, signal.SIGCONT)
            except OSError:
                pass
        for w in self.watchers:
            w.cancel()
        self.stack.remove()

    # ---- helpers ----

    def submit(self, text, conv='', retry_s=0):
        """Submit (idempotent: keyed by conversation and text); UNAVAILABLE is retried for retry_s seconds."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return self.ad.submit(AGENT, '%s read=%s' % (text, SMALL), conversation_id=conv,
                                      idempotency_key='%s-%s' % (conv, text.replace(' ', '-')),
                                      timeout=30)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_settled(self, ids, timeout):
        out = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(out) < len(ids):
            for sid in ids:
                if sid in out:
                    continue
                try:
                    sub = self.ad.get_submission(sid, wait=True,
                                                 timeout=max(1, deadline - time.monotonic()))
                    out[sid] = sub
                except grpc.RpcError:
                    time.sleep(0.5)
        missing = [s for s in ids if s not in out]
        self.assertEqual(missing, [], 'not settled in %d s' % timeout)
        return out

    def records(self, conv):
        return read_all(self.sd.stub, conv)

    def sample(self, samples, until):
        """Threads and a health check of agentd every 0.25 s until the time until (or stop)."""
        while time.monotonic() < until and not self.stop.is_set():
            t0 = time.monotonic()
            try:
                st = self.ad.health_check('', timeout=2)
            except grpc.RpcError as e:
                st = e.code()
            samples.append((t0, proc_status_field(self.ad.pid, 'Threads'), st,
                            time.monotonic() - t0))
            time.sleep(max(0, 0.25 - (time.monotonic() - t0)))

    # ---- the test ----

    def run_outage(self):
        ad, sd = self.ad, self.sd
        t0 = time.monotonic()
        # 30 finished conversations (input, prompt, 3 answers, 2 tool results, settlement)
        adms = [self.submit('outage setup %d' % i) for i in range(CONVERSATIONS)]
        done = self.wait_settled([a.submission_id for a in adms], 60)
        self.assertEqual({s.outcome for s in done.values()}, {common_pb2.OUTCOME_COMPLETED},
                         [s.error for s in done.values()])
        convs = [a.conversation_id for a in adms]
        heads = {c: ad.get_conversation(c).head_offset for c in convs}
        threads0 = proc_status_field(ad.pid, 'Threads')

        # 300 idle watchers, from the start, the middle or the head
        for i in range(WATCHERS):
            c = convs[i % CONVERSATIONS]
            after = (-1, heads[c] // 2, heads[c])[(i // CONVERSATIONS) % 3]
            self.watchers.append(Watcher(self, c, after))
        for w in self.watchers:
            w.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                w.last() == heads[w.conv] for w in self.watchers):
            time.sleep(0.1)
        behind = [(w.conv, w.last(), heads[w.conv], w.ends[:1]) for w in self.watchers
                  if w.last() != heads[w.conv]]
        self.assertEqual(behind, [], 'watchers that did not catch up')

        # 10 running submissions (a tool call sleeping SLEEP_S) and 10 queued behind them
        running = [self.submit('outage run sleep=%d' % SLEEP_S, convs[k]).submission_id
                   for k in range(RUNNING)]
        queued = [self.submit('outage queued %d' % k, convs[k]).submission_id
                  for k in range(RUNNING)]
        for sid in running + queued:
            self.waiters.append(Waiter(self, sid))
        for w in self.waiters:
            w.thread.start()
        time.sleep(1.0)  # the drives are in their tool call, the waits parked

        samples = []
        t_stop = time.monotonic()
        if self.MODE == 'hung':
            os.kill(sd.pid, signal.SIGSTOP)
        else:
            sd.kill()
        self.sample(samples, t_stop + OUTAGE_S[self.MODE])
        if self.MODE == 'hung':
            os.kill(sd.pid, signal.SIGCONT)
        else:
            sd.start()
        t_back = time.monotonic()
        self.back.set()
        outage = [s for s in samples]

        # agentd answers a Submit now that storaged is back (once its channel reconnected: it
        # backs off at most 1 s, RECONNECT_MAX_MS), and the conversations grow
        self.submit('outage after 0', convs[0], retry_s=SUBMIT_BACK_S)
        t_submit = time.monotonic() - t_back
        fresh = [self.submit('outage after %d' % i, c).submission_id for i, c in enumerate(convs)]
        sampler = threading.Thread(target=self.sample,
                                   args=(samples, time.monotonic() + SETTLE_S), daemon=True)
        sampler.start()
        try:
            self.wait_settled(fresh + running + queued, SETTLE_S)
            t_settled = time.monotonic()
            for w in self.waiters:
                w.thread.join(max(0.1, t_back + SETTLE_S - time.monotonic()))
            final = {c: self.records(c) for c in convs}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                    w.last() == final[w.conv][-1].offset for w in self.watchers):
                time.sleep(0.1)
        finally:
            self.stop.set()
            for w in self.watchers:
                w.cancel()
        for w in self.watchers:
            w.thread.join(10)
        sampler.join()

        # ---- the watchers ----
        stuck = [w.conv for w in self.watchers if w.thread.is_alive()]
        self.assertEqual(stuck, [], 'watcher threads that did not end after cancel')
        ended = [w for w in self.watchers if w.ends]
        unclear = [(w.conv, e) for w in ended for e in w.ends if e[0] not in CLEAR]
        self.assertEqual(unclear, [], 'watchers ended without a clear status')
        if self.MODE == 'down':
            first_ends = [w.ends[0][1] - t_stop for w in ended]
            late = [t for t in first_ends if t > KILL_END_S or t < 0]
            self.assertEqual(len(ended), WATCHERS, 'a killed storaged left watchers open')
            self.assertEqual(late, [], 'watchers ended late (s after the kill)')
        wrong = []
        for w in self.watchers:
            want = [r for r in final[w.conv] if r.offset > w.start_after]
            if (w.offsets != [r.offset for r in want] or w.ids != [r.id for r in want]):
                seen = w.offsets
                wrong.append((w.conv, w.start_after, 'dups', len(seen) - len(set(seen)),
                              'got', len(seen), 'want', len(want),
                              'ends', [(str(e[0]), round(e[1] - t_stop, 2)) for e in w.ends]))
        self.assertEqual(wrong, [], 'watchers whose records are not the conversation\'s')

        # ---- the waits ----
        for w in self.waiters:
            self.assertIsNotNone(w.result, (w.sid, w.errors))
            self.assertEqual(w.result.submission_id, w.sid)
            for code, took, details in w.errors:
                self.assertIn(code, CLEAR, (w.sid, w.errors))
                self.assertLess(took, WAIT_DEADLINE_S - 1, 'a wait ran into its deadline')

        # ---- agentd ----
        self.assertTrue(ad.alive(), ad.stderr_text()[-4000:])
        bad = [(round(t - t_stop, 2), st, round(took, 2)) for t, _, st, took in outage
               if st != SERVING]
        self.assertEqual(bad, [], 'agentd health during the outage')
        peak = max(n for _, n, _, _ in samples)
        time.sleep(1.0)  # the cancels reach agentd
        threads1 = proc_status_field(ad.pid, 'Threads')
        sys.stderr.write(
            '\n%s: %d watchers on %d conversations, %d waits; storaged %s for %d s: %d watchers '
            'ended (%d resumes in all), first end %.2f s after, waits with errors %d; agentd '
            'threads %d before, %d at most, %d after; set up %.1f s, first Submit %.2f s and all '
            'settled %.1f s after storaged came back; waits: %s\n'
            % (self.MODE, WATCHERS, CONVERSATIONS, len(self.waiters), self.MODE, OUTAGE_S[self.MODE],
               len(ended), sum(len(w.ends) for w in self.watchers),
               min([w.ends[0][1] - t_stop for w in ended] or [-1]),
               sum(1 for w in self.waiters if w.errors), threads0, peak, threads1,
               t_stop - t0, t_submit, t_settled - t_back,
               sorted(set((str(c), d) for w in self.waiters for c, _, d in w.errors))))
        self.assertLessEqual(peak, threads0 + THREADS_SLACK)
        self.assertLessEqual(threads1, threads0 + THREADS_SLACK)
        self.assertEqual(ad.stop(), 0)
        log = ad.stderr_text()
        events = {k: len(re.findall(r'\b%s\b' % k, log)) for k in
                  ('drive_fault', 'resumed', 'reclaimed', 'lease_lost', 'claims_failing',
                   'watch.feed_ended')}
        sys.stderr.write('agentd events: %s\n' % events)
        # the outage outlasted the retry window: the running drives were interrupted
        self.assertGreaterEqual(events['drive_fault'], 1, events)
        counts = re.findall(r'watch\.counts.*?feeds=(\d+) watchers=(\d+)', log)
        self.assertEqual(counts, [('0', '0')], 'what agentd held at stop')


class WatchOutageHungTest(WatchOutageBase, unittest.TestCase):
    MODE = 'hung'

    def test_watchers_through_a_frozen_storaged(self):
        self.run_outage()


class WatchOutageDownTest(WatchOutageBase, unittest.TestCase):
    MODE = 'down'

    def test_watchers_through_a_killed_storaged(self):
        self.run_outage()


if __name__ == '__main__':
    unittest.main()
