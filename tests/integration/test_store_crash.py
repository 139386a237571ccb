"""Crash safety: 1,000 idempotent admissions while storaged is SIGKILLed and restarted at
random moments. Every acknowledged admission survives, none is duplicated, and each
conversation keeps its admission order."""

import collections
import random
import threading
import time
import unittest

import grpc

from cflue_harness import StoragedTestCase, admit_request, list_all

N = 1000
CONVERSATIONS = 20
CLIENT_THREADS = 4
MIN_KILLS = 4
BUDGET_S = 50.0
PACE_S = 0.015        # pause between two admissions of one client: spreads the run over
                      # several seconds so the kills land in the middle of the traffic
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def conv_of(i):
    return 'crash-c%d' % (i % CONVERSATIONS)


def request_for(i):
    return admit_request(agent='assistant', conv=conv_of(i), text='crash message %d' % i,
                         key='k-%d' % i, metadata={'i': str(i)})


class CrashTest(StoragedTestCase):

    def test_admissions_survive_sigkill(self):
        """1,000 keyed admissions over 20 conversations, retried on UNAVAILABLE /
        DEADLINE_EXCEEDED, while another thread SIGKILLs and restarts storaged at least 4
        times (0.2-0.8 s apart). Afterwards exactly 1,000 rows, each key once, every
        acknowledged key present with its acknowledged id, per-conversation sequences
        increasing in key order."""
        sd = self.storaged
        stub = sd.stub
        seed = int(time.time() * 1000) & 0xffffffff
        rng = random.Random(seed)
        acked = {}            # key -> submission_id of the OK answer
        deduped = [0]
        retries = [0]
        lock = threading.Lock()
        done = threading.Event()
        failures = []
        kills = [0]
        kill_cond = threading.Condition()
        t_start = time.monotonic()

        def allowed(count):
            # Spread the kills over the run: until MIN_KILLS kills happened, the clients may
            # not get more than (kills + 1) / (MIN_KILLS + 1) of the way through.
            with kill_cond:
                while (kills[0] < MIN_KILLS and
                       count >= (kills[0] + 1) * N // (MIN_KILLS + 1) and
                       not done.is_set()):
                    kill_cond.wait(0.5)

        def client(t):
            try:
                mine = [i for i in range(N) if (i % CONVERSATIONS) % CLIENT_THREADS == t]
                for i in mine:
                    with lock:
                        count = len(acked)
                    allowed(count)
                    req = request_for(i)
                    while True:
                        if time.monotonic() - t_start > BUDGET_S:
                            raise AssertionError('time budget exhausted at key k-%d' % i)
                        try:
                            resp = stub.admit(req, timeout=2)
                        except grpc.RpcError as e:
                            if e.code() in RETRY_CODES:
                                with lock:
                                    retries[0] += 1
                                time.sleep(0.02)
                                continue
                            raise AssertionError('k-%d: %s %s' % (i, e.code(), e.details()))
                        break
                    with lock:
                        acked['k-%d' % i] = resp.submission.submission_id
                        if resp.deduplicated:
                            deduped[0] += 1
                    time.sleep(PACE_S)
            except BaseException as e:  # reported by the main thread
                failures.append(e)

        def killer():
            try:
                while not done.is_set():
                    time.sleep(rng.uniform(0.2, 0.8))
                    if done.is_set() and kills[0] >= MIN_KILLS:
                        break
                    # kill only while admissions are flowing (some acknowledged since the
                    # last restart), so the kill hits requests in flight
                    with lock:
                        base = len(acked)
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline and not done.is_set():
                        with lock:
                            if len(acked) >= min(N, base + 5):
                                break
                        time.sleep(0.005)
                    sd.kill()
                    time.sleep(rng.uniform(0.0, 0.05))
                    sd.start()
                    with kill_cond:
                        kills[0] += 1
                        kill_cond.notify_all()
                    if kills[0] >= MIN_KILLS and done.is_set():
                        break
            except BaseException as e:
                failures.append(e)
                done.set()

        clients = [threading.Thread(target=client, args=(t,), daemon=True)
                   for t in range(CLIENT_THREADS)]
        kt = threading.Thread(target=killer, daemon=True)
        kt.start()
        for c in clients:
            c.start()
        for c in clients:
            c.join(BUDGET_S + 5)
        done.set()
        with kill_cond:
            kill_cond.notify_all()
        kt.join(30)
        elapsed = time.monotonic() - t_start
        print('\ncrash test: %d admissions, %d kills, %d retries, %d deduplicated, %.1f s '
              '(seed %d)' % (len(acked), kills[0], retries[0], deduped[0], elapsed, seed))
        self.assertFalse(kt.is_alive(), 'killer thread hung')
        for c in clients:
            self.assertFalse(c.is_alive(), 'client thread hung')
        if failures:
            raise failures[0]
        self.assertGreaterEqual(kills[0], MIN_KILLS)
        self.assertTrue(sd.alive())

        rows = list_all(stub, page=100)
        self.assertEqual(len(rows), N, 'expected %d submissions, found %d' % (N, len(rows)))
        keys = collections.Counter(r.idempotency_key for r in rows)
        dup = [k for k, n in keys.items() if n > 1]
        self.assertEqual(dup, [], 'keys stored more than once')
        self.assertEqual(set(keys), {'k-%d' % i for i in range(N)})
        self.assertEqual(len(acked), N)
        by_key = {r.idempotency_key: r for r in rows}
        for k, sid in acked.items():
            self.assertEqual(by_key[k].submission_id, sid, 'key %s acknowledged as another id'
                             % k)
        seqs = [r.sequence for r in rows]
        self.assertEqual(seqs, sorted(seqs))
        self.assertEqual(len(set(seqs)), N)
        for i in range(N):
            r = by_key['k-%d' % i]
            self.assertEqual(r.conversation_id, conv_of(i))
            self.assertEqual(r.message.text, 'crash message %d' % i)
            self.assertEqual(dict(r.metadata), {'i': str(i)})
            self.assertEqual(r.agent, 'assistant')
        for j in range(CONVERSATIONS):
            conv_seqs = [by_key['k-%d' % i].sequence for i in range(j, N, CONVERSATIONS)]
            self.assertTrue(all(a < b for a, b in zip(conv_seqs, conv_seqs[1:])),
                            'conversation crash-c%d out of order' % j)
            per_conv = list_all(stub, page=1000, conversation_id='crash-c%d' % j)
            self.assertEqual([r.idempotency_key for r in per_conv],
                             ['k-%d' % i for i in range(j, N, CONVERSATIONS)])
        sd.stop()


if __name__ == '__main__':
    unittest.main()
