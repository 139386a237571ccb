"""agentd's engine (agentd/engine.c): drives waiting on the model hold no thread.

With the fake model answering each call after 1 s (--brain bench: `bash echo hello`, `read`
of a 165 KB file, a final answer), 300 conversations in flight on one agentd with its default
settings settle with a median Submit -> settled of at most 4.5 s (1.5x their 3 s of model
time) plus the CPU work of the run spread over the machine's cores (no schedule beats that;
drives holding threads through their model calls would take 225 s), and agentd's thread count
(/proc/PID/status) stays under 64 throughout. An Abort of a
drive parked on a 30 s model call settles it ABORTED within 2 s (the call is cancelled at
once, not waited for). Agentds started side by side on port 0 each have an owner of their
own, so none takes over another's running work.
"""
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import AGENTD_BIN, BenchBrainStack, proc_cpu_seconds  # noqa: E402
from cflue_harness import proc_status_field  # noqa: E402
from cflue_harness import common_pb2, store_pb2  # noqa: E402
import cflue_harness as H  # noqa: E402

AGENT = BenchBrainStack.AGENT


class EngineStack(BenchBrainStack):
    """BenchBrainStack with one agentd of default settings (agentd_args aside) and a 165 KB
    file to read."""

    def __init__(self, delay_ms, agentd_args=()):
        line = 'the engine test reads this line, one of many in a file of 165 KB\n'
        super(EngineStack, self).__init__(delay_ms, line * (165000 // len(line)),
                                          agentd_args=agentd_args, prefix='cflue-engine-it-')

    def settled(self, ids):
        """{submission_id: (settle time in epoch s, outcome)} for the settled ones of ids."""
        want, out, token = set(ids), {}, ''
        while True:
            resp = self.sd.stub.list(store_pb2.ListRequest(
                statuses=[common_pb2.SUBMISSION_STATUS_SETTLED], page_size=1000,
                page_token=token), timeout=30)
            for s in resp.submissions:
                if s.submission_id in want:
                    out[s.submission_id] = (s.settle_time.seconds + s.settle_time.nanos / 1e9,
                                            s.outcome)
            token = resp.next_page_token
            if not token:
                return out


def cpu_seconds(pids):
    """CPU seconds (user + system) the processes pids and this one have used so far."""
    return sum(os.times()[:2]) + sum(proc_cpu_seconds(p) for p in pids)


def thread_count(pid):
    return proc_status_field(pid, 'Threads')


class EngineLoadTest(unittest.TestCase):
    N = 300

    def setUp(self):
        self.stack = EngineStack(delay_ms=1000)

    def tearDown(self):
        self.stack.remove()

    def test_conversations_in_flight_settle_within_their_model_time(self):
        ad = self.stack.ad
        pid = ad.pid
        peak = [thread_count(pid)]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], thread_count(pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        pids = [pid, self.stack.sd.pid, self.stack.td.pid, self.stack.fm.proc.pid]
        cpu0 = cpu_seconds(pids)
        starts = {}
        lock = threading.Lock()

        def one(i):
            t = time.time()
            adm = ad.submit(AGENT, 'engine test %d: run the steps you are given' % i, timeout=30)
            with lock:
                starts[adm.submission_id] = t

        try:
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(one, range(self.N)))
            deadline = time.time() + 120
            done = {}
            while time.time() < deadline:
                done = self.stack.settled(starts)
                if len(done) == len(starts):
                    break
                time.sleep(0.5)
        finally:
            stop.set()
            sampler.join()
        # the CPU work of the run (daemons, fake model, this client) spread over every core:
        # no schedule settles the conversations faster than that
        floor = (cpu_seconds(pids) - cpu0) / (os.cpu_count() or 1)
        self.assertEqual(len(done), self.N, 'not all settled in 120 s')
        outcomes = set(o for _, o in done.values())
        self.assertEqual(outcomes, {common_pb2.OUTCOME_COMPLETED})
        lat = sorted(done[s][0] - starts[s] for s in done)
        med = statistics.median(lat)
        sys.stderr.write('\n%d conversations: Submit -> settled median %.2f s, max %.2f s; '
                         'agentd threads at most %d; CPU work %.2f s per core\n'
                         % (self.N, med, lat[-1], peak[0], floor))
        self.assertLess(peak[0], 64)
        # A regression guard, not a benchmark (bench/bench_engine.py measures the target): 1.5x
        # the model time plus three times what the run's CPU work takes on this machine's cores
        # (the median lands near twice that under a sanitizer, where CPU work dominates). Drives
        # that held a thread through their model calls would take N * 3 s / 4 workers = 225 s.
        self.assertLessEqual(med, 4.5 + 3 * floor)


class EngineManyLeasesTest(unittest.TestCase):
    """More drives in flight than one Heartbeat may carry (storaged takes at most 1000 fences a
    call): agentd renews them all, in several calls, so none of their leases runs out."""
    N = 1001

    def setUp(self):
        from test_agentd import Stack
        self.stack = Stack(agents=('runner-anthropic',),
                           agentd_args=('--lease-ms', '4000', '--heartbeat-ms', '500'))

    def tearDown(self):
        self.stack.remove()

    def test_every_lease_is_renewed_when_more_than_a_heartbeat_holds_are_held(self):
        # each drive's first call is told to come back in 10 s (it parks on a timer, holding its
        # 4 s lease and no connection); the retry is answered
        busy = {'error': {'status': 529, 'message': 'overloaded', 'retry_after': 10}}
        self.stack.fm.set_scenario([busy] * self.N + [{'text': 'ok'}] * self.N)
        ad = self.stack.ad
        with ThreadPoolExecutor(16) as ex:
            ids = list(ex.map(lambda i: ad.submit('runner-anthropic', 'lease %d' % i,
                                                  timeout=30).submission_id, range(self.N)))
        want, done, deadline = set(ids), {}, time.time() + 180
        while time.time() < deadline and len(done) < self.N:
            time.sleep(1)
            token = ''
            while True:
                resp = self.stack.sd.stub.list(store_pb2.ListRequest(
                    statuses=[common_pb2.SUBMISSION_STATUS_SETTLED], page_size=1000,
                    page_token=token), timeout=30)
                done.update((s.submission_id, s) for s in resp.submissions
                            if s.submission_id in want)
                token = resp.next_page_token
                if not token:
                    break
        self.assertEqual(len(done), self.N, 'not all settled in 180 s')
        failed = [s for s in done.values() if s.outcome != common_pb2.OUTCOME_COMPLETED]
        self.assertEqual(failed, [], '%d did not complete; the first: %s'
                         % (len(failed), failed[0].error if failed else ''))
        taken_over = [s.submission_id for s in done.values() if s.attempt_count != 1]
        self.assertEqual(taken_over, [], '%d leases ran out' % len(taken_over))
        log = ad.stderr_text()
        self.assertNotIn('lease_lost', log)
        self.assertNotIn('fences per heartbeat', log)


class EngineReclaimManyTest(unittest.TestCase):
    """A restarted agentd (same --owner-id) takes back all of its earlier work at once, however
    much of it there is, not the first part and the rest when the leases run out (120 s)."""
    N = 300

    def setUp(self):
        from test_agentd import Stack
        self.stack = Stack(agents=('runner-anthropic',), owner_ids=['reclaim-many'],
                           agentd_args=('--lease-ms', '120000'))

    def tearDown(self):
        self.stack.remove()

    def park_kill_and_restart(self, n, storaged_down_s=0):
        """n drives parked on the model (told to come back in 100 s, within the agent's 120 s
        time limit: a longer wait fails the call at once), agentd killed and started
        again, storaged away for storaged_down_s meanwhile; returns the submissions once
        settled and the seconds from the restart (or storaged's return) until then."""
        busy = {'error': {'status': 529, 'message': 'overloaded', 'retry_after': 100}}
        self.stack.fm.set_scenario([busy] * n + [{'text': 'ok'}] * n)
        ad, fm = self.stack.ad, self.stack.fm
        with ThreadPoolExecutor(16) as ex:
            ids = list(ex.map(lambda i: ad.submit('runner-anthropic', 'reclaim %d' % i,
                                                  timeout=30).submission_id, range(n)))
        self.assertTrue(H.poll_until(lambda: len(fm.requests()) >= n, 60, 0.2),
                        'not every drive asked the model')
        ad.kill()
        if storaged_down_s:
            self.stack.sd.kill()
        restarted_ms = int(time.time() * 1000)
        ad.start()
        if storaged_down_s:
            time.sleep(storaged_down_s)
            self.stack.sd.start()
            # a wait through agentd fails at once while agentd cannot reach storaged yet
            self.assertTrue(ad.wait_health('readiness', H.SERVING), 'agentd never got back')
        t0 = time.time()
        with ThreadPoolExecutor(16) as ex:
            subs = list(ex.map(lambda s: ad.get_submission(s, wait=True, timeout=90), ids))
        took = time.time() - t0
        self.assertEqual([s.submission_id for s in subs
                          if s.outcome != common_pb2.OUTCOME_COMPLETED], [])
        self.assertEqual(ad.stderr_text().count('event=reclaimed '), n)
        # each attempt that settled them carries the new process's start (owner_started_at,
        # by agentd's clock), which a later restart reclaims by
        con = sqlite3.connect('file:%s?mode=ro' % self.stack.sd.db, uri=True)
        try:
            starts = dict(con.execute('SELECT submission_id, owner_started_at FROM submissions'))
        finally:
            con.close()
        late = [(i, starts[i]) for i in ids
                if not restarted_ms <= starts[i] <= restarted_ms + 30000]
        self.assertEqual(late, [], 'restarted at %d' % restarted_ms)
        return subs, took

    def test_every_own_submission_is_taken_back_at_the_restart(self):
        _, took = self.park_kill_and_restart(self.N)
        # the leases were 120 s: one not taken back would settle only once its lease ran out
        self.assertLess(took, 60, 'the last one settled %.1f s after the restart' % took)

    def test_storaged_away_at_the_restart_delays_the_taking_back_only(self):
        # storaged is down when agentd starts, for longer than agentd's retry window (5 s):
        # the claims that fail meanwhile keep the taking back on until one gets an answer
        _, took = self.park_kill_and_restart(20, storaged_down_s=8)
        self.assertLess(took, 60, 'the last one settled %.1f s after storaged came back' % took)


class EngineToolBatchTest(unittest.TestCase):
    """A tool batch holds no engine thread: with one engine thread, conversations whose first
    command sleeps run their commands side by side."""
    N = 4
    SLEEP_S = 2

    def setUp(self):
        self.stack = EngineStack(delay_ms=0, agentd_args=('--workers', '1'))

    def tearDown(self):
        self.stack.remove()

    def test_commands_of_many_drives_run_at_once_on_one_engine_thread(self):
        ad = self.stack.ad
        t0 = time.time()
        ids = [ad.submit(AGENT, 'engine test %d: sleep=%d' % (i, self.SLEEP_S)).submission_id
               for i in range(self.N)]
        subs = [ad.get_submission(s, wait=True, timeout=60) for s in ids]
        took = time.time() - t0
        self.assertEqual(set(s.outcome for s in subs), {common_pb2.OUTCOME_COMPLETED},
                         [s.error for s in subs])
        # the commands really slept (each result came after its sleep)
        self.assertGreaterEqual(took, self.SLEEP_S)
        # one after another they would take N * SLEEP_S = 8 s; side by side about SLEEP_S
        self.assertLess(took, (self.N - 1) * self.SLEEP_S,
                        'the batches ran one after another: %.1f s' % took)


class EngineAbortTest(unittest.TestCase):
    def setUp(self):
        self.stack = EngineStack(delay_ms=30000)

    def tearDown(self):
        self.stack.remove()

    def parked_on_the_model(self, ad, n=1):
        """Submits n conversations through ad; returns their ids once the model has them all
        (each parked on its first model call: 30 s)."""
        ids = [ad.submit(AGENT, 'engine test %d: run the steps you are given' % i).submission_id
               for i in range(n)]
        deadline = time.time() + 60
        while time.time() < deadline and len(self.stack.fm.requests()) < n:
            time.sleep(0.05)
        self.assertEqual(len(self.stack.fm.requests()), n, 'the model was not asked')
        time.sleep(0.3)
        return ids

    def assert_aborted_soon(self, ad, sid, t0, within_s):
        sub = ad.get_submission(sid, wait=True, timeout=10)
        took = time.time() - t0
        self.assertEqual(sub.status, common_pb2.SUBMISSION_STATUS_SETTLED)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_ABORTED)
        self.assertLess(took, within_s, 'the abort took %.2f s' % took)

    def test_abort_of_a_drive_parked_on_the_model_settles_at_once(self):
        ad = self.stack.ad
        sid = self.parked_on_the_model(ad)[0]
        t0 = time.time()
        ad.abort(submission_id=sid)
        self.assert_aborted_soon(ad, sid, t0, 2.0)

    def test_abort_through_another_agentd_reaches_the_drive_within_a_tick(self):
        # agentd B has never seen the submission: the durable intent is all it leaves, and the
        # driving agentd finds it with one List of its aborted work per 500 ms tick
        ids = self.parked_on_the_model(self.stack.ad, n=20)
        other = self.stack.add_agentd()
        t0 = time.time()
        other.abort(submission_id=ids[7])
        self.assert_aborted_soon(self.stack.ad, ids[7], t0, 3.0)
        # the other drives go on (still parked on the model)
        for sid in ids[:7] + ids[8:]:
            self.assertNotEqual(self.stack.ad.get_submission(sid).status,
                                common_pb2.SUBMISSION_STATUS_SETTLED)

    def test_a_second_agentd_on_port_0_takes_none_of_the_first_ones_work(self):
        # Both listen on 127.0.0.1:0, so the listen address names neither: a default owner
        # made of host and address alone was the same for both, and the second one's start
        # took the first one's running work over as its own
        ids = self.parked_on_the_model(self.stack.ad, n=3)
        before = {s: self.stack.sd.stub.get(store_pb2.GetRequest(submission_id=s), timeout=10)
                  for s in ids}
        self.stack.add_agentd()
        time.sleep(1.0)  # a takeover would come with the second agentd's first Claim
        owners = set()
        for sid, old in before.items():
            now = self.stack.sd.stub.get(store_pb2.GetRequest(submission_id=sid), timeout=10)
            self.assertEqual((now.status, now.attempt_id, now.owner_id, now.attempt_count),
                             (old.status, old.attempt_id, old.owner_id, old.attempt_count))
            owners.add(now.owner_id)
        self.assertEqual(len(owners), 1)
        logged = [re.search(r'owner=(\S+)', ad.stderr_text()).group(1)
                  for ad in (self.stack.ad, self.stack.daemons[-1])]
        self.assertEqual(logged[0], owners.pop())
        self.assertNotEqual(logged[0], logged[1])

    def test_an_owner_id_storaged_would_refuse_is_refused_at_start(self):
        for bad in ('a/b', 'x' * 129, '..'):
            p = subprocess.run([AGENTD_BIN, '--listen', '127.0.0.1:0', '--store',
                                self.stack.sd.target, '--agents', self.stack.agents,
                                '--owner-id', bad], capture_output=True, timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(b'--owner-id must be 1 to 128 characters', p.stderr)


if __name__ == '__main__':
    unittest.main()
