"""Prometheus /metrics on each daemon (--metrics-listen; common/metrics.c, metrics_http.c):
`promtool check metrics` (Debian's prometheus) passes on each, and the series move as the work
they count happens.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_metrics

Real storaged, toold and agentd with the fake model: conversations that run bash, a model
error that is retried, and a command stopped by a limit; then each daemon's series are read.
"""

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import cflue_harness as H
from cflue_harness import Agentd, FakeModel, Storaged, Toold, common_pb2
import secret_scan

CONVERSATIONS = 3
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')

AGENT = '''---
name: measured
description: Test agent of the metrics test.
model: anthropic/claude-test-1
sandbox:
  tools: "%s"
  workspace: "{conversation}"
durability:
  max_attempts: 3
  timeout_ms: 60000
---

You run what you are asked.
'''


def metrics_port(daemon):
    m = re.search(r'event=metrics_listening addr=\S+ port=(\d+)', daemon.stderr_text())
    assert m, 'no metrics_listening line:\n' + daemon.stderr_text()[-2000:]
    return int(m.group(1))


def mapped_libraries(pid):
    """The file names mapped into process pid."""
    with open('/proc/%d/maps' % pid) as f:
        return ' '.join(os.path.basename(line.split()[-1]) for line in f if '/' in line)


def scrape(daemon, path='/metrics'):
    url = 'http://127.0.0.1:%d%s' % (metrics_port(daemon), path)
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers.get('Content-Type'), r.read().decode()


def samples(text):
    """{(name, 'labels'): value} of every sample line."""
    out = {}
    for line in text.splitlines():
        if line.startswith('#') or not line:
            continue
        m = SAMPLE.match(line)
        assert m, 'not a sample line: %r' % line
        out[(m.group(1), m.group(2) or '')] = float(m.group(3))
    return out


METRICS = ['--metrics-listen', '127.0.0.1:0']


class MadeUpToolTest(unittest.TestCase):
    """Each tool name a model called became a label set of the tool results family (capped at
    512 sets): a model that made up a few hundred names left every real tool first seen later
    uncounted until agentd restarted. A name the agent does not offer is counted as
    tool="unknown"."""

    def test_made_up_tool_names_are_counted_as_unknown(self):
        work = tempfile.mkdtemp(prefix='cflue-metrics-made-up-')
        daemons = []
        try:
            sd = Storaged(extra_args=METRICS)
            daemons.append(sd)
            td = Toold(tcp=True)
            daemons.append(td)
            fm = FakeModel()
            daemons.append(fm)
            agents = os.path.join(work, 'agents')
            os.makedirs(agents)
            with open(os.path.join(agents, 'measured.md'), 'w') as f:
                f.write(AGENT % td.target)
            env = {'ANTHROPIC_BASE_URL': fm.anthropic_base_url,
                   'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}
            ad = Agentd(sd.target, agents, env=env, extra_args=METRICS)
            daemons.append(ad)
            made_up = [{'name': 'made_up_%d' % i, 'arguments': {}} for i in range(3)]
            fm.set_scenario([{'tool_calls': made_up + [
                {'name': 'bash', 'arguments': {'command': 'true'}}]}, {'text': 'done'}])
            sid = ad.submit('measured', 'Call things.', conversation_id='conv_made_up')
            sub = ad.get_submission(sid.submission_id, wait=True, timeout=60)
            self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
            s = samples(scrape(ad)[1])
            self.assertEqual(s[('cflue_agentd_tool_results_total',
                                '{tool="unknown",error="true"}')], 3)
            self.assertEqual(s[('cflue_agentd_tool_results_total',
                                '{tool="bash",error="false"}')], 1)
            self.assertFalse([k for k in s if 'made_up' in k[1]], s)
        finally:
            for d in reversed(daemons):
                d.remove()
            secret_scan.discard(work)


class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix='cflue-metrics-')
        cls.daemons = []
        try:
            cls.sd = cls.keep(Storaged(extra_args=METRICS))
            cls.td = cls.keep(Toold(tcp=True, extra_args=METRICS + ['--limit-procs', '16']))
            cls.fm = cls.keep(FakeModel())
            agents = os.path.join(cls.dir, 'agents')
            os.makedirs(agents)
            with open(os.path.join(agents, 'measured.md'), 'w') as f:
                f.write(AGENT % cls.td.target)
            env = {'ANTHROPIC_BASE_URL': cls.fm.anthropic_base_url,
                   'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}
            cls.ad = cls.keep(Agentd(cls.sd.target, agents, env=env, extra_args=METRICS))
            cls.run_work()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def keep(cls, d):
        cls.daemons.append(d)
        return d

    @classmethod
    def tearDownClass(cls):
        for d in reversed(cls.daemons):
            d.remove()
        secret_scan.discard(cls.dir)

    @classmethod
    def run_work(cls):
        for i in range(CONVERSATIONS):
            steps = [{'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo %d' % i}}]},
                     {'text': 'done %d' % i}]
            if i == 0:  # one retried model error: an HTTP 529 before the answer
                steps.insert(0, {'error': {'status': 529, 'message': 'overloaded'}})
            cls.fm.set_scenario(steps)
            sid = cls.ad.submit('measured', 'Run it.', conversation_id='conv_m_%d' % i)
            sub = cls.ad.get_submission(sid.submission_id, wait=True, timeout=60)
            assert sub.outcome == common_pb2.OUTCOME_COMPLETED, sub
        bomb = 'for i in $(seq 40); do sleep 5 & done; wait'
        res = cls.td.execute('bombed', 'bash', {'command': bomb})
        assert 'processes' in res.details_json, res.details_json

    def check_promtool(self, text):
        if not shutil.which('promtool'):
            self.fail('promtool is not installed (scripts/setup installs Debian prometheus)')
        r = subprocess.run(['promtool', 'check', 'metrics'], input=text.encode(),
                           capture_output=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout.decode() + r.stderr.decode())

    def test_storaged(self):
        ctype, text = scrape(self.sd)
        self.assertEqual(ctype, 'text/plain; version=0.0.4; charset=utf-8')
        self.check_promtool(text)
        s = samples(text)
        self.assertEqual(s[('cflue_store_submissions',
                            '{status="settled",outcome="completed"}')], CONVERSATIONS)
        self.assertEqual(s[('cflue_store_settle_seconds_count', '')], CONVERSATIONS)
        self.assertGreaterEqual(s[('cflue_store_claims_total', '{kind="first"}')], CONVERSATIONS)
        self.assertGreaterEqual(s[('cflue_rpc_server_handled_total',
                                   '{method="/cflue.v1.Store/Admit",code="OK"}')], CONVERSATIONS)
        self.assertGreater(s[('process_resident_memory_bytes', '')], 1 << 20)

    def test_agentd(self):
        _, text = scrape(self.ad)
        self.check_promtool(text)
        s = samples(text)
        self.assertEqual(s[('cflue_agentd_settled_total', '{outcome="completed"}')],
                         CONVERSATIONS)
        self.assertEqual(s[('cflue_agentd_drives_total', '{takeover="false"}')], CONVERSATIONS)
        # two answers per conversation, and the one 529 before the first
        self.assertEqual(s[('cflue_agentd_model_call_seconds_count',
                            '{provider="anthropic",result="ok"}')], 2 * CONVERSATIONS)
        self.assertEqual(s[('cflue_agentd_model_errors_total',
                            '{provider="anthropic",kind="http_529"}')], 1)
        self.assertGreater(s[('cflue_agentd_model_tokens_total',
                              '{provider="anthropic",direction="output"}')], 0)
        self.assertEqual(s[('cflue_agentd_tool_results_total', '{tool="bash",error="false"}')],
                         CONVERSATIONS)
        self.assertEqual(s[('cflue_agentd_turn_seconds_count', '')], 2 * CONVERSATIONS)
        self.assertGreaterEqual(s[('cflue_rpc_server_handled_total',
                                   '{method="/cflue.v1.Agent/Submit",code="OK"}')], CONVERSATIONS)

    def test_toold(self):
        _, text = scrape(self.td)
        self.check_promtool(text)
        s = samples(text)
        self.assertEqual(s[('cflue_toold_tool_calls_total', '{tool="bash",error="false"}')],
                         CONVERSATIONS + 1)
        self.assertEqual(s[('cflue_toold_limit_stops_total', '{limit="processes"}')], 1)
        self.assertEqual(s[('cflue_toold_tool_call_seconds_count', '{tool="bash"}')],
                         CONVERSATIONS + 1)

    def test_other_paths_and_methods(self):
        port = metrics_port(self.sd)
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen('http://127.0.0.1:%d/' % port, timeout=10)
        self.assertEqual(cm.exception.code, 404)
        req = urllib.request.Request('http://127.0.0.1:%d/metrics' % port, data=b'x',
                                     method='POST')
        with self.assertRaises(urllib.error.HTTPError) as cm:
            urllib.request.urlopen(req, timeout=10)
        self.assertEqual(cm.exception.code, 405)

    def test_scrapes_past_1024_open_descriptors(self):
        """select() takes no descriptor past 1024: with 1,100 gRPC connections open every
        scrape was reset ("not less than FD_SETSIZE"), metrics gone just when the daemon was
        busiest. The endpoint polls with epoll or poll."""
        sd = Storaged(extra_args=METRICS)
        conns = []
        try:
            for _ in range(1100):
                c = socket.socket(socket.AF_UNIX)
                c.connect(sd.sock)
                conns.append(c)
            H.poll_until(lambda: len(os.listdir('/proc/%d/fd' % sd.pid)) > 1100, 10, 0.05)
            self.assertGreater(len(os.listdir('/proc/%d/fd' % sd.pid)), 1100)
            _, text = scrape(sd)
            self.assertIn('cflue_', text)
        finally:
            for c in conns:
                c.close()
            sd.close()
            sd.remove()

    def test_one_client_cannot_take_every_connection(self):
        """64 connections from one address that sent half a request held every slot: each
        scrape was refused until they timed out (for ever, with a header line every few
        seconds). One address holds at most 8; a scraper from another is served. The
        library's complaints go to our log, one line a second at most."""
        sd = Storaged(extra_args=METRICS)
        port = metrics_port(sd)
        conns = []
        try:
            for _ in range(64):
                c = socket.create_connection(('127.0.0.1', port), timeout=5)
                try:
                    c.sendall(b'GET /metrics HTTP/1.1\r\nHost: x\r\n')
                except OSError:
                    pass  # refused past the address's share
                conns.append(c)
            scraper = socket.create_connection(('127.0.0.1', port), timeout=10,
                                               source_address=('127.0.0.2', 0))
            scraper.sendall(b'GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
            answer = b''
            while True:
                chunk = scraper.recv(65536)
                if not chunk:
                    break
                answer += chunk
            scraper.close()
            self.assertTrue(answer.startswith(b'HTTP/1.1 200'), answer[:200])
        finally:
            for c in conns:
                c.close()
        time.sleep(0.5)
        sd.close()
        raw = [line for line in sd.stderr_text().splitlines()
               if line and not line.startswith('ts=') and not line.startswith('----')]
        self.assertEqual(raw, [], 'lines outside the log format')
        self.assertLessEqual(sd.stderr_text().count('event=metrics_http '), 2)
        sd.remove()

    def test_every_address_is_ipv6_and_ipv4(self):
        """':PORT', '[::]:PORT' and '0.0.0.0:PORT' take every address, as gRPC's listeners do:
        an IPv6-only pod is scraped at its IPv6 address, an IPv4 one at its IPv4 address."""
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(('::1', 0))
            has_v6 = True
        except OSError:
            has_v6 = False
        for addr in (':0', '[::]:0', '0.0.0.0:0'):
            sd = Storaged(extra_args=['--metrics-listen', addr])
            try:
                port = metrics_port(sd)
                hosts = ['127.0.0.1'] + (['[::1]'] if has_v6 else [])
                for host in hosts:
                    url = 'http://%s:%d/metrics' % (host, port)
                    with urllib.request.urlopen(url, timeout=10) as r:
                        self.assertEqual(r.status, 200, (addr, host))
            finally:
                sd.close()
                sd.remove()
        if not has_v6:
            self.skipTest('no IPv6 loopback here: only IPv4 was tried')

    def test_the_library_is_loaded_for_the_listener_only(self):
        """libmicrohttpd (and the GnuTLS it links) is mapped by a daemon serving /metrics
        only: one without --metrics-listen, the default, does not pay for it."""
        for d in (self.sd, self.td, self.ad):
            self.assertIn('libmicrohttpd', mapped_libraries(d.pid), d)
        sd = Storaged()
        td = Toold()
        try:
            for d in (sd, td):
                libs = mapped_libraries(d.pid)
                self.assertNotIn('libmicrohttpd', libs, d)
                self.assertNotIn('libgnutls', libs, d)
        finally:
            for d in (sd, td):
                d.close()
                d.remove()

    def test_a_missing_library_stops_the_start_with_its_name(self):
        """When libmicrohttpd cannot be loaded (here: read as an empty file, in a mount
        namespace of bubblewrap's), a daemon asked to serve /metrics says so and exits 1."""
        bwrap = shutil.which('bwrap')
        if not bwrap:
            self.fail('bubblewrap is not installed (scripts/setup installs it)')
        with open(os.path.join(H.BUILD_DIR, 'dlopened-libraries')) as f:
            lib = f.read().split()[0]
        r = subprocess.run([bwrap, '--dev-bind', '/', '/', '--ro-bind', '/dev/null', lib,
                            H.STORAGED_BIN, '--listen', '127.0.0.1:0',
                            '--db', os.path.join(self.dir, 'no-metrics.db'),
                            '--metrics-listen', '127.0.0.1:0'],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('--metrics-listen needs libmicrohttpd (%s), which cannot be loaded'
                      % os.path.basename(lib), r.stderr)
        self.assertIn('event=metrics_listen_failed', r.stderr)

    def test_a_bad_address_stops_the_start(self):
        sd = Storaged(start=False, extra_args=['--metrics-listen', 'nowhere'])
        try:
            with self.assertRaises(H.StoragedExited):
                sd.start()
            self.assertIn("--metrics-listen 'nowhere' is not HOST:PORT", sd.stderr_text())
        finally:
            sd.remove()


if __name__ == '__main__':
    unittest.main()
