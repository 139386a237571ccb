"""Scale-out: three agentd and two toold processes against one storaged on loopback, with the
fake model (its chaos brain: each submission's turn runs one bash call that appends a line to
the conversation's ledger file, then answers).

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_scale_out                       # short form: 600 submissions over 60 conversations
    CFLUE_SCALE_LONG=1 ... test_scale_out    # long form: 2,000 over 200

Checked over the whole run: every submission settles once, completed (exactly one
submission_settled record each); each conversation's submissions settle in the order they were
admitted; each conversation's sandbox lives on the one toold rendezvous hashing gives it and
every one of its tool calls reached that toold (its ledger there, its calls in that toold's log
only); every agentd took work; the daemons' /metrics (settlements, joins, tool calls) agree with
the ledger. The same workload then runs on one agentd and one toold, and the
throughput of both setups and their ratio are printed.
"""

import os
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import cflue_harness as H
from cflue_harness import Agentd, FakeModel, Storaged, Toold, common_pb2
import secret_scan
from test_agentd import kind
from test_agentd_placement import owner
from test_metrics import samples, scrape

LONG = os.environ.get('CFLUE_SCALE_LONG') == '1'
SUBMISSIONS, CONVERSATIONS = (2000, 200) if LONG else (600, 60)
CLIENTS = 16
LEDGER = 'chaos-ledger.txt'

AGENT = '''---
name: scale
description: Test agent of the scale-out test.
model: anthropic/claude-test-1
sandbox:
  tools: [%s]
  workspace: "{conversation}"
durability:
  max_attempts: 5
  timeout_ms: 300000
---

You append to the ledger as asked.
'''


class Setup(object):
    """storaged, n_toold toolds, the fake model and n_agentd agentds in one directory."""

    def __init__(self, n_agentd, n_toold):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix='cflue-scale-')
        self.daemons = []
        metrics = ['--metrics-listen', '127.0.0.1:0']
        self.sd = self.keep(Storaged(tcp=True, extra_args=metrics))
        self.toolds = [self.keep(Toold(tcp=True, extra_args=metrics)) for _ in range(n_toold)]
        self.fm = self.keep(FakeModel(extra_args=['--brain', 'chaos', '--quiet']))
        agents = os.path.join(self.dir, 'agents')
        os.makedirs(agents)
        with open(os.path.join(agents, 'scale.md'), 'w') as f:
            f.write(AGENT % ', '.join('"%s"' % td.target for td in self.toolds))
        env = {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url,
               'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}
        self.agentds = [self.keep(Agentd(self.sd.target, agents, env=env, owner_id='a%d' % i,
                                         extra_args=metrics))
                        for i in range(n_agentd)]

    def keep(self, d):
        self.daemons.append(d)
        return d

    def remove(self):
        for d in reversed(self.daemons):
            d.remove()
        secret_scan.discard(self.dir)


def run_workload(setup, tag):
    """Submits SUBMISSIONS over CONVERSATIONS from CLIENTS threads (each conversation's own in
    order, from one thread), round robin over the agentds; waits for all to settle. Returns
    ({conversation: [submission ids in admission order]}, seconds)."""
    convs = ['conv_%s_%03d' % (tag, i) for i in range(CONVERSATIONS)]
    per = SUBMISSIONS // CONVERSATIONS
    sids = {c: [] for c in convs}
    count = [0]
    lock = threading.Lock()

    def submit_all(c):
        for k in range(per):
            with lock:
                count[0] += 1
                ad = setup.agentds[count[0] % len(setup.agentds)]
            r = ad.submit('scale', 'chaos tag=%s.%d plan=l' % (c, k), conversation_id=c)
            sids[c].append(r.submission_id)

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(submit_all, convs))
    ad = setup.agentds[0]

    def wait(sid):
        deadline = time.monotonic() + 600
        while True:
            try:
                return ad.get_submission(sid, wait=True, timeout=60)
            except Exception:
                if time.monotonic() > deadline:
                    raise
    with ThreadPoolExecutor(CLIENTS) as pool:
        subs = list(pool.map(wait, [s for c in convs for s in sids[c]]))
    took = time.monotonic() - t0
    return sids, subs, took


class ScaleOutTest(unittest.TestCase):
    def test_three_agentd_two_toold(self):
        wide = Setup(3, 2)
        try:
            sids, subs, took = run_workload(wide, 'w')
            self.check(wide, sids, subs)
        finally:
            wide.remove()
        narrow = Setup(1, 1)
        try:
            _, subs1, took1 = run_workload(narrow, 'n')
            self.assertTrue(all(s.outcome == common_pb2.OUTCOME_COMPLETED for s in subs1))
        finally:
            narrow.remove()
        print('\nscale-out: %d submissions over %d conversations, %d client threads'
              % (SUBMISSIONS, CONVERSATIONS, CLIENTS))
        print('  3 agentd + 2 toold: %6.1f s  %6.1f submissions/s' % (took, SUBMISSIONS / took))
        print('  1 agentd + 1 toold: %6.1f s  %6.1f submissions/s' % (took1, SUBMISSIONS / took1))
        print('  throughput ratio (3+2 / 1+1): %.2fx on %d cores' % (took1 / took,
                                                                     os.cpu_count() or 0))

    def check(self, setup, sids, subs):
        for s in subs:
            self.assertEqual((s.status, s.outcome), (common_pb2.SUBMISSION_STATUS_SETTLED,
                                                     common_pb2.OUTCOME_COMPLETED), s)
        names = [td.target for td in setup.toolds]
        logs = [td.stderr_text() for td in setup.toolds]
        owners_seen = set()
        for conv, mine in sids.items():
            recs = H.read_all(setup.sd.stub, conv)
            settled = [r.submission_id for r in recs if kind(r) == 'submission_settled']
            self.assertEqual(sorted(settled), sorted(mine), conv)  # each once
            self.assertEqual(settled, mine, '%s settled out of admission order' % conv)
            want = names.index(owner(names, conv))
            held = [i for i, td in enumerate(setup.toolds)
                    if os.path.exists(os.path.join(td.workspace(conv), LEDGER))]
            logged = [i for i, log in enumerate(logs) if 'sandbox=%s ' % conv in log]
            self.assertEqual((held, logged), ([want], [want]), conv)
            runs = sum(1 for r in recs if kind(r) == 'tool_result')
            with open(os.path.join(setup.toolds[want].workspace(conv), LEDGER)) as f:
                self.assertEqual(len(f.read().splitlines()), runs, conv)
            owners_seen.add(want)
        self.assertEqual(owners_seen, {0, 1})
        self.check_metrics(setup, sids)
        took_work = [ad for ad in setup.agentds if 'event=drive ' in ad.stderr_text()]
        self.assertEqual(len(took_work), len(setup.agentds),
                         'an agentd drove nothing: %s' % [ad.owner_id for ad in setup.agentds])


    def check_metrics(self, setup, sids):
        """The daemons' /metrics agree with what the ledger holds."""
        def total(daemons, name, labels=''):
            return sum(samples(scrape(d)[1]).get((name, labels), 0) for d in daemons)
        n = sum(len(v) for v in sids.values())
        self.assertEqual(total([setup.sd], 'cflue_store_submissions',
                               '{status="settled",outcome="completed"}'), n)
        # each submission settled by the drive that ran it, or as one joined into another
        settled = total(setup.agentds, 'cflue_agentd_settled_total', '{outcome="completed"}')
        joined = total(setup.agentds, 'cflue_agentd_joined_total')
        self.assertEqual(settled + joined, n)
        runs = sum(1 for c in sids for r in H.read_all(setup.sd.stub, c)
                   if kind(r) == 'tool_result')
        self.assertEqual(total(setup.toolds, 'cflue_toold_tool_calls_total',
                               '{tool="bash",error="false"}'), runs)
        self.assertEqual(total(setup.agentds, 'cflue_agentd_tool_results_total',
                               '{tool="bash",error="false"}'), runs)


if __name__ == '__main__':
    unittest.main()
