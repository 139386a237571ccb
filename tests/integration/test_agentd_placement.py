"""Sandbox placement over toold replicas (agentd/placement.c): each sandbox's calls all reach
the one replica rendezvous hashing gives it, whether the agent lists its replicas or names
them by DNS, and replicas that appear in DNS are taken on without a restart.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_placement

Real storaged, toold and agentd processes and the fake model. The DNS case runs agentd in a
mount namespace of its own whose /etc/hosts names the replicas (the system resolver reads it as
a cluster's DNS would answer for a headless Service), so it needs root and unshare(1).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

import cflue_harness as H
from cflue_harness import Agentd, FakeModel, Storaged, Toold, common_pb2
import secret_scan

M64 = (1 << 64) - 1
PER_REPLICA = 3  # conversations the list test places on each replica


def score(replica, sandbox):
    """The rendezvous weight placement.c gives sandbox on replica (FNV-1a, then splitmix64's
    finalizer), written again here so that the test checks agentd against an oracle."""
    h = 0xcbf29ce484222325
    for b in replica.encode() + b'\0' + sandbox.encode():
        h = ((h ^ b) * 0x100000001b3) & M64
    h ^= h >> 30
    h = (h * 0xbf58476d1ce4e5b9) & M64
    h ^= h >> 27
    h = (h * 0x94d049bb133111eb) & M64
    return h ^ (h >> 31)


def owner(names, sandbox):
    return max(sorted(names), key=lambda n: score(n, sandbox))


def spread(names, per):
    """Conversation ids, `per` of them owned by each of names: which ids land where depends on
    the replicas' ports, and ids taken in a fixed order put all of a few on one replica now and
    then, which would leave the spread untested."""
    mine = {n: [] for n in names}
    for i in range(1000 * per * len(names)):
        conv = 'conv_list_%03d' % i
        if len(mine[owner(names, conv)]) < per:
            mine[owner(names, conv)].append(conv)
        if min(len(v) for v in mine.values()) == per:
            return sorted(c for v in mine.values() for c in v)
    raise AssertionError('after %d ids, too few land on some replica: %s' % (i + 1, mine))


AGENT = '''---
name: spread
description: Test agent whose sandboxes are spread over toold replicas.
model: anthropic/claude-test-1
sandbox:
  tools: %s
  workspace: "{conversation}"
durability:
  max_attempts: 3
  timeout_ms: 60000
---

You write a file in your sandbox.
'''


class PlacementCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='cflue-place-')
        self.daemons = []
        self.sd = self.keep(Storaged())
        self.fm = self.keep(FakeModel())
        self.agents = os.path.join(self.dir, 'agents')
        os.makedirs(self.agents)

    def tearDown(self):
        for d in reversed(self.daemons):
            d.remove()
        secret_scan.discard(self.dir)

    def keep(self, d):
        self.daemons.append(d)
        return d

    def define(self, tools_yaml):
        with open(os.path.join(self.agents, 'spread.md'), 'w') as f:
            f.write(AGENT % tools_yaml)

    def model_env(self):
        return {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url,
                'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}

    def converse(self, ad, conv):
        """One conversation: a bash call writing placed.txt, then an answer."""
        self.fm.set_scenario([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo placed > placed.txt'}}]},
            {'text': 'written'},
        ])
        sid = ad.submit('spread', 'Write the file.', conversation_id=conv).submission_id
        sub = ad.get_submission(sid, wait=True, timeout=60)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)

    def where(self, toolds, conv):
        """The toolds (by index) whose workspace for conv exists, and whose log names it."""
        held = [i for i, td in enumerate(toolds)
                if os.path.exists(os.path.join(td.workspace(conv), 'placed.txt'))]
        logged = [i for i, td in enumerate(toolds) if 'sandbox=%s ' % conv in td.stderr_text()]
        return held, logged


class ListTest(PlacementCase):
    def test_each_sandbox_on_its_replica(self):
        toolds = [self.keep(Toold(tcp=True)) for _ in range(3)]
        names = [td.target for td in toolds]
        self.define('[%s]' % ', '.join('"%s"' % n for n in names))
        ad = self.keep(Agentd(self.sd.target, self.agents, env=self.model_env()))
        convs = spread(names, PER_REPLICA)
        for conv in convs:  # each replica gets its share: agentd uses them all
            self.converse(ad, conv)
            want = names.index(owner(names, conv))
            self.assertEqual(self.where(toolds, conv), ([want], [want]),
                             '%s on the replicas %s' % (conv, names))
        # a second agentd places alike (nothing but the names decides)
        ad2 = self.keep(Agentd(self.sd.target, self.agents, env=self.model_env()))
        conv = 'conv_list_second_agentd'
        self.converse(ad2, conv)
        want = names.index(owner(names, conv))
        self.assertEqual(self.where(toolds, conv), ([want], [want]),
                         '%s on the replicas %s' % (conv, names))

    def test_stop_signals_reach_only_the_main_thread(self):
        """The placement watch (a dns: address) starts while the definitions load, before the
        gRPC threads: it too blocks SIGTERM and SIGINT, so a burst of SIGTERMs is taken by the
        main thread's wait and ends in a clean stop, never in the default action."""
        self.define('"dns:no-such-toold.invalid:7102"')
        ad = self.keep(Agentd(self.sd.target, self.agents, env=self.model_env()))
        term = 1 << (signal.SIGTERM - 1)
        names, unblocked = [], []
        for tid in os.listdir('/proc/%d/task' % ad.pid):
            with open('/proc/%d/task/%s/status' % (ad.pid, tid)) as f:
                fields = dict(line.split(':', 1) for line in f if ':' in line)
            names.append(fields['Name'].strip())
            if int(tid) != ad.pid and not int(fields['SigBlk'].strip(), 16) & term:
                unblocked.append(names[-1])  # the main thread's wait is the one to take them
        self.assertIn('placement', names)
        self.assertEqual(unblocked, [], 'threads that would take a SIGTERM')
        for _ in range(5):
            ad.proc.send_signal(signal.SIGTERM)
        self.assertEqual(ad.proc.wait(30), 0, ad.stderr_text()[-2000:])
        ad.terminate()

    def test_a_name_with_no_replica_fails_the_submission_saying_so(self):
        self.define('"dns:no-such-toold.invalid:7102"')
        ad = self.keep(Agentd(self.sd.target, self.agents, env=self.model_env()))
        self.assertIn('event=toold_replicas_unresolved spec=dns:no-such-toold.invalid:7102',
                      ad.stderr_text())
        sid = ad.submit('spread', 'Write the file.', conversation_id='conv_none').submission_id
        sub = ad.get_submission(sid, wait=True, timeout=90)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_FAILED, sub)
        # each attempt was put back as a passing fault (toold unreachable), then given up on
        self.assertIn('gave up after 3 attempts', sub.error)
        self.assertIn('no toold replica is known behind dns:no-such-toold.invalid:7102',
                      ad.stderr_text())

    def test_a_bad_list_stops_the_start(self):
        self.define('["a:1", "a:1"]')
        ad = Agentd(self.sd.target, self.agents, env=self.model_env(), start=False)
        self.daemons.append(ad)
        with self.assertRaises(H.AgentdExited):
            ad.start()
        self.assertIn('sandbox.tools: replica 1: a:1 is listed twice', ad.stderr_text())


def free_port(ip):
    s = socket.socket()
    s.bind((ip, 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ReplicaToold(Toold):
    """A toold listening on ip:port (the replicas share a port, as pods do)."""

    def __init__(self, ip, port):
        self.LOOPBACK, self.fixed_port = ip, port
        Toold.__init__(self, tcp=True, start=False)

    def listen_args(self):
        return ['--listen', '%s:%d' % (self.LOOPBACK, self.fixed_port), '--port-file',
                self.port_file]


class NamespacedAgentd(Agentd):
    """agentd in a mount namespace of its own, with hosts bind-mounted on /etc/hosts."""

    def __init__(self, hosts, *args, **kwargs):
        self.hosts = hosts
        Agentd.__init__(self, *args, **kwargs)

    def command(self):
        return (['unshare', '-m', '--', 'sh', '-c', 'mount --bind "$0" /etc/hosts && exec "$@"',
                 self.hosts] + Agentd.command(self))


def private_hosts_problem():
    """Why this machine cannot give agentd a private /etc/hosts (None: it can). Root and
    unshare(1) are not enough in a container without CAP_SYS_ADMIN."""
    if os.geteuid() != 0 or not shutil.which('unshare'):
        return 'needs root and unshare(1) for a private /etc/hosts'
    probe = subprocess.run(['unshare', '-m', '--', 'true'], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    if probe.returncode != 0:
        return 'unshare -m fails here (%s): no private /etc/hosts' % probe.stderr.strip()
    return None


class DnsTest(PlacementCase):
    def setUp(self):
        H.require_namespace(self, private_hosts_problem())
        PlacementCase.setUp(self)

    def write_hosts(self, replicas):
        with open(self.hosts, 'w') as f:  # rewritten in place: the bind mount sees it
            f.write('127.0.0.1 localhost\n')
            for ip, name in replicas:
                f.write('%s %s.cflue.test tools.cflue.test\n' % (ip, name))

    def two_replicas(self):
        """Replicas toold-a and toold-b, both in DNS, on one port: (port, the two toolds,
        their hosts entries, their addresses as placement names them)."""
        self.hosts = os.path.join(self.dir, 'hosts')
        port = free_port('127.0.0.2')
        ips = {'toold-a': '127.0.0.2', 'toold-b': '127.0.0.3'}
        listed = []
        for name in ('toold-a', 'toold-b'):
            listed.append(self.keep(ReplicaToold(ips[name], port)))
            listed[-1].start()
        both = [(ips[n], n) for n in ('toold-a', 'toold-b')]
        self.write_hosts(both)
        return port, listed, both, ['%s.cflue.test:%d' % (n, port) for n in ('toold-a', 'toold-b')]

    def test_replicas_by_dns_and_one_added(self):
        self.hosts = os.path.join(self.dir, 'hosts')
        port = free_port('127.0.0.2')
        ips = {'toold-a': '127.0.0.2', 'toold-b': '127.0.0.3', 'toold-c': '127.0.0.4'}
        toolds = {}
        for name, ip in ips.items():
            toolds[name] = self.keep(ReplicaToold(ip, port))
            toolds[name].start()
        self.write_hosts([(ips['toold-a'], 'toold-a'), (ips['toold-b'], 'toold-b')])
        self.define('"dns:tools.cflue.test:%d"' % port)
        ad = self.keep(NamespacedAgentd(self.hosts, self.sd.target, self.agents,
                                        env=self.model_env()))
        order = ['toold-a', 'toold-b', 'toold-c']
        listed = [toolds[n] for n in order]

        def check(names, conv):
            self.converse(ad, conv)
            want = order.index(owner(['%s.cflue.test:%d' % (n, port) for n in names],
                                     conv).split('.')[0])
            self.assertEqual(self.where(listed, conv), ([want], [want]), conv)
            return want

        def pick(names, prefix, each=2):
            """Conversation names the oracle spreads over every replica of names, each of
            them `each` times (the port is random: fixed names could all land on one)."""
            full = ['%s.cflue.test:%d' % (n, port) for n in names]
            chosen, per = [], {}
            for i in range(1000):
                conv = '%s_%03d' % (prefix, i)
                o = owner(full, conv)
                if per.get(o, 0) < each:
                    per[o] = per.get(o, 0) + 1
                    chosen.append(conv)
            return chosen

        two = {check(['toold-a', 'toold-b'], c) for c in pick(['toold-a', 'toold-b'], 'conv_dns')}
        self.assertEqual(two, {0, 1})
        self.assertIn('event=toold_replicas spec=dns:tools.cflue.test:%d replicas=2' % port,
                      ad.stderr_text())
        # a third replica appears in DNS: taken on within a lookup period, no restart
        self.write_hosts([(ips[n], n) for n in order])
        deadline = time.monotonic() + 60
        while 'replicas=3' not in ad.stderr_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertIn('replicas=3 was=2', ad.stderr_text())
        three = {check(order, c) for c in pick(order, 'conv_dns3')}
        self.assertEqual(three, {0, 1, 2})

    def test_a_replica_out_of_dns_for_a_moment_keeps_its_sandboxes(self):
        """A rolling restart takes a toold pod out of DNS for a moment. Its sandboxes stay
        placed on it for --replica-linger-ms from the first lookup that misses it (here 8 s:
        it is given up at the second lookup after that one, 10 s later), so a conversation
        started meanwhile runs there once the replica is back, not on another replica without
        its workspace. While the pod is down, the conversation waits for it holding its lease,
        in one attempt: interrupted and retried instead, each retry a new attempt, it would
        have spent the agent's three before the pod was back. A DNS that answers nothing is no
        word on a replica: its linger starts again. A replica missing for longer is given up
        and its sandboxes go to the replicas left."""
        port, listed, both, full = self.two_replicas()
        self.define('"dns:tools.cflue.test:%d"' % port)
        ad = self.keep(NamespacedAgentd(self.hosts, self.sd.target, self.agents,
                                        env=self.model_env(),
                                        extra_args=('--replica-linger-ms', '8000')))
        on_b = [c for c in ('conv_linger_%03d' % i for i in range(200))
                if owner(full, c) == full[1]][:3]

        def wait_log(what, timeout=30):
            deadline = time.monotonic() + timeout
            while what not in ad.stderr_text():
                self.assertLess(time.monotonic(), deadline, 'no %s in agentd\'s log' % what)
                time.sleep(0.2)

        self.converse(ad, on_b[0])
        self.assertEqual(self.where(listed, on_b[0]), ([1], [1]))
        # b's pod restarts: out of DNS and down; a conversation of one of its sandboxes starts
        # meanwhile and waits; b is back a few seconds later: the conversation ran on b, in one
        # attempt
        self.write_hosts(both[:1])
        wait_log('event=toold_replica_missing spec=dns:tools.cflue.test:%d replica=%s'
                 % (port, full[1]))
        listed[1].stop()
        self.fm.set_scenario([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo placed > placed.txt'}}]},
            {'text': 'written'},
        ])
        sid = ad.submit('spread', 'Write the file.', conversation_id=on_b[1]).submission_id
        wait_log('event=sandbox_replica_wait submission=%s sandbox=%s replica=%s'
                 % (sid, on_b[1], full[1]))
        time.sleep(2)  # b must be back before the lookup 10 s after its first miss
        listed[1].start()
        self.write_hosts(both)
        sub = ad.get_submission(sid, wait=True, timeout=60)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
        self.assertEqual(sub.attempt_count, 1, sub)
        self.assertEqual(self.where(listed, on_b[1]), ([1], [1]))
        self.assertNotIn('toold_replica_dropped', ad.stderr_text())
        self.assertIn('event=sandbox_replica_back submission=%s' % sid, ad.stderr_text())
        # b leaves DNS, then the DNS answers nothing for longer than the linger (an outage):
        # that is no word on b, whose linger starts again once lookups answer without it
        missed = ad.stderr_text().count('event=toold_replica_missing')
        self.write_hosts(both[:1])
        deadline = time.monotonic() + 30
        while ad.stderr_text().count('event=toold_replica_missing') == missed:
            self.assertLess(time.monotonic(), deadline, 'b was not missed again')
            time.sleep(0.2)
        first_miss = time.monotonic()
        self.write_hosts([])
        wait_log('event=toold_replicas_unresolved spec=dns:tools.cflue.test:%d known=2' % port)
        time.sleep(12)
        self.assertNotIn('toold_replica_dropped', ad.stderr_text())
        # the lookups answer again without b: given up a linger later, its sandboxes go to a
        self.write_hosts(both[:1])
        wait_log('event=toold_replica_dropped spec=dns:tools.cflue.test:%d replica=%s'
                 % (port, full[1]))
        since_first_miss_ms = (time.monotonic() - first_miss) * 1000
        dropped = re.search(r'event=toold_replica_dropped spec=\S+ replica=\S+ missing_ms=(\d+)',
                            ad.stderr_text())
        self.assertLess(int(dropped.group(1)), since_first_miss_ms - 8000, dropped.group(0))
        self.converse(ad, on_b[2])
        self.assertEqual(self.where(listed, on_b[2]), ([0], [0]))

    def test_a_subagent_waits_for_its_parents_replica(self):
        """A subagent without a sandbox of its own works in its parent's, on the parent's
        replica. When that replica is restarting (out of DNS and down) as the child starts,
        the child waits for it in its first attempt, as the parent would (the parent hands it
        the dns: name with the address: Delegation.sandbox_placement), rather than spending
        an attempt on each retry."""
        port, listed, both, full = self.two_replicas()
        with open(os.path.join(self.agents, 'lead.md'), 'w') as f:
            f.write(LEAD % ('"dns:tools.cflue.test:%d"' % port))
        with open(os.path.join(self.agents, 'helper.md'), 'w') as f:
            f.write(HELPER)
        ad = self.keep(NamespacedAgentd(self.hosts, self.sd.target, self.agents,
                                        env=self.model_env(),
                                        extra_args=('--replica-linger-ms', '30000')))
        conv = [c for c in ('conv_child_%03d' % i for i in range(200))
                if owner(full, c) == full[1]][0]

        def wait_for(what, text, timeout=30):
            deadline = time.monotonic() + timeout
            while not re.search(what, text()):
                self.assertLess(time.monotonic(), deadline, 'no %s' % what)
                time.sleep(0.1)
            return re.search(what, text())

        # the lead starts on b; while its model call takes 12 s, b's pod restarts: out of DNS
        # (missed by a lookup, within 5 s) and down as the child starts
        self.fm.set_scenario([
            {'match': {'system_contains': 'ROLE lead.'}, 'delay_ms': 12000, 'tool_calls': [
                {'name': 'task', 'arguments': {'agent': 'helper', 'prompt': 'Write it.'}}]},
            {'match': {'system_contains': 'ROLE helper.'}, 'tool_calls': [
                {'name': 'bash', 'arguments': {'command': 'echo child > child.txt'}}]},
            {'match': {'system_contains': 'ROLE helper.'}, 'text': 'written'},
            {'match': {'system_contains': 'ROLE lead.'}, 'text': 'the helper wrote it'},
        ])
        asked = len(self.fm.requests())
        sid = ad.submit('lead', 'Have it written.', conversation_id=conv).submission_id
        deadline = time.monotonic() + 30
        while len(self.fm.requests()) == asked:  # the lead looked at b, and asks the model
            self.assertLess(time.monotonic(), deadline, 'the lead did not ask the model')
            time.sleep(0.05)
        self.write_hosts(both[:1])
        wait_for('event=toold_replica_missing spec=dns:tools.cflue.test:%d replica=%s'
                 % (port, re.escape(full[1])), ad.stderr_text)
        listed[1].stop()
        waiting = wait_for(r'event=sandbox_replica_wait submission=(\S+) sandbox=%s replica=%s'
                           % (conv, re.escape(full[1])), ad.stderr_text)
        child = waiting.group(1)
        self.assertNotEqual(child, sid, ad.stderr_text())
        listed[1].start()
        self.write_hosts(both)
        sub = ad.get_submission(sid, wait=True, timeout=60)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
        self.assertEqual(sub.attempt_count, 1, sub)
        kid = ad.get_submission(child, wait=True, timeout=10)
        self.assertEqual(kid.outcome, common_pb2.OUTCOME_COMPLETED, kid)
        self.assertEqual(kid.attempt_count, 1, kid)
        self.assertEqual(H.get(self.sd.stub, child).delegation.sandbox_placement,
                         'dns:tools.cflue.test:%d' % port)
        self.assertTrue(os.path.exists(os.path.join(listed[1].workspace(conv), 'child.txt')))
        self.assertIn('event=sandbox_replica_back submission=%s' % child, ad.stderr_text())


LEAD = '''---
name: lead
description: Test agent that has its helper work in its sandbox.
model: anthropic/claude-test-1
sandbox:
  tools: %s
  workspace: "{conversation}"
agents: [helper]
durability:
  max_attempts: 3
  timeout_ms: 60000
---

ROLE lead. You have your helper write the file.
'''

HELPER = '''---
name: helper
description: Writes a file in its lead's sandbox.
model: anthropic/claude-test-1
durability:
  max_attempts: 3
  timeout_ms: 60000
---

ROLE helper. You write the file you are asked to.
'''


if __name__ == '__main__':
    unittest.main()
