"""TLS on every listener and client certificates between the daemons (issue 10, scope 4).

- storaged and toold with --tls-cert/--tls-key/--tls-client-ca serve a client that presents a
  certificate of the CA (health and a real Store / Tools call), and refuse at the handshake
  (UNAVAILABLE) a client without a certificate, one whose certificate another CA signed, one
  that does not trust the server's CA, and a plaintext one;
- --tls-cert/--tls-key alone: TLS without client certificates;
- flags that do not go together and files that are missing, not PEM or do not match stop a
  daemon (and cflue) at start with exit 2 and the flag named, and no key text is printed;
- agentd with --peer-ca/--peer-cert/--peer-key reaches an mTLS storaged and toold while
  serving TLS (and requiring client certificates) itself: `cflue --ca --cert --cert-key
  submit` runs a tool call and settles completed; without the client certificate agentd is
  alive but not ready, and Submit fails naming storaged;
- SIGHUP: a newly issued certificate is served to the next connection (its serial, read with
  Python's ssl module), a broken file keeps the old one serving and logs tls_reload_failed;
  toold takes SIGHUP for this too;
- scripts/run --tls: the README's example over TLS and mTLS, on the offline model.

The certificates come from a throw-away PKI made with openssl (cflue_harness.make_pki).
"""

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import unittest
import uuid

import grpc

from cflue_harness import (AGENTD_BIN, BUILD_DIR, CLI_BIN, HERE, NOT_SERVING, REPO, SERVING,
                           UNAVAILABLE, Agentd, FakeModel, Storaged, Toold, _tail, admit, get,
                           health_pb2, issue_cert, make_pki, tls_credentials, tls_peer_args,
                           tls_server_args)
import secret_scan

FIXTURES_DIR = os.path.join(HERE, 'agentd_fixtures')

PKI = None
_PKI_DIR = None


def setUpModule():
    global PKI, _PKI_DIR
    _PKI_DIR = tempfile.mkdtemp(prefix='cflue-tls-pki-')
    PKI = make_pki(_PKI_DIR)


def tearDownModule():
    shutil.rmtree(_PKI_DIR, ignore_errors=True)


def fresh_channel(target, creds=None):
    """A channel with its own connections (a local subchannel pool: never one that another
    channel already made, with another handshake)."""
    opts = [('grpc.use_local_subchannel_pool', 1)]
    if creds is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, creds, options=opts)


def health(ch, service='', timeout=5):
    c = ch.unary_unary('/grpc.health.v1.Health/Check',
                       request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                       response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return c(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def peer_serial(port, pki, client=True):
    """The serial number (hex, as Python's ssl shows it) of the certificate a server on
    127.0.0.1:port presents to a new connection (verified against pki.ca for 127.0.0.1)."""
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.set_alpn_protocols(['h2'])
    if client:
        ctx.load_cert_chain(pki.client, pki.client_key)
    with socket.create_connection(('127.0.0.1', port), timeout=5) as s:
        with ctx.wrap_socket(s, server_hostname='127.0.0.1') as t:
            return t.getpeercert()['serialNumber']


def key_lines(path):
    """The base64 lines of a PEM key: none may ever show in a log."""
    with open(path) as f:
        return [l.strip() for l in f if l.strip() and not l.startswith('-----')]


def run_cli(argv, timeout=60, env=None):
    p = subprocess.run([CLI_BIN] + argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=timeout, env=env)
    return p.returncode, p.stdout.decode('utf-8', 'replace'), p.stderr.decode('utf-8', 'replace')


def wait_log(daemon, text, timeout=60):
    deadline = time.monotonic() + timeout
    while text not in daemon.stderr_text():
        if time.monotonic() > deadline:
            raise AssertionError('%s never logged %r\n%s' % (daemon.NAME, text,
                                                             _tail(daemon.stderr_text(), 40)))
        time.sleep(0.05)


class TlsCase(unittest.TestCase):
    """Starts daemons with self.start(...) and prints their stderr when a test fails."""

    def run(self, result=None):
        self._started = []
        if result is None:
            return super(TlsCase, self).run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super(TlsCase, self).run(result)
        finally:
            failed = len(result.failures) + len(result.errors) > before
            for d in reversed(self._started):
                d.close()
                if failed and hasattr(d, 'NAME'):
                    print('\n==== %s stderr ====\n%s' % (d.NAME, _tail(d.stderr_text(), 60)))
                d.remove()

    def start(self, daemon, credentials=None):
        self._started.append(daemon)
        daemon.credentials = credentials
        return daemon.start()

    def assertRefused(self, ch, what):
        with self.assertRaises(grpc.RpcError, msg=what) as cm:
            health(ch, timeout=5)
        self.assertEqual(cm.exception.code(), UNAVAILABLE, '%s: %s' % (what,
                                                                      cm.exception.details()))
        ch.close()

    def assertRefusesStrangers(self, target):
        """Without a client certificate, with another CA's, trusting another CA, plaintext:
        each refused at the handshake."""
        other = PKI.read(PKI.other_ca)
        for what, creds in [
                ('no client certificate', tls_credentials(PKI, client=False)),
                ("the other CA's client certificate",
                 tls_credentials(PKI, cert=PKI.other_client, key=PKI.other_client_key)),
                ("a client trusting the other CA",
                 grpc.ssl_channel_credentials(other, PKI.read(PKI.client_key),
                                              PKI.read(PKI.client))),
                ('plaintext', None)]:
            self.assertRefused(fresh_channel(target, creds), what)

    def assertNoKeyLogged(self, daemon):
        text = daemon.stderr_text()
        for path in (PKI.server_key, PKI.client_key):
            for line in key_lines(path):
                self.assertNotIn(line, text)


class StoragedTlsTest(TlsCase):

    def test_mtls_serves_its_clients_and_refuses_the_rest(self):
        sd = self.start(Storaged(tcp=True, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        self.assertEqual(sd.health_check('cflue.v1.Store'), SERVING)
        adm = admit(sd.stub, agent='assistant', text='over mTLS')
        self.assertEqual(get(sd.stub, adm.submission.submission_id).submission_id,
                         adm.submission.submission_id)
        self.assertRefusesStrangers(sd.target)
        self.assertEqual(sd.health_check(), SERVING)  # the refusals changed nothing
        self.assertRegex(sd.stderr_text(), r'event=tls tls=on mtls=on .*serial=1001 ')
        self.assertNoKeyLogged(sd)

    def test_tls_without_client_certificates(self):
        sd = self.start(Storaged(tcp=True, extra_args=tls_server_args(PKI, mtls=False),
                                 start=False), tls_credentials(PKI, client=False))
        admit(sd.stub, agent='assistant', text='over TLS')
        self.assertRefused(fresh_channel(sd.target), 'plaintext')
        self.assertIn('event=tls tls=on mtls=off', sd.stderr_text())

    def test_plaintext_stays_the_default(self):
        sd = self.start(Storaged(tcp=True, start=False))
        admit(sd.stub, agent='assistant', text='plain')
        self.assertIn('event=tls tls=off mtls=off peer_tls=off', sd.stderr_text())

    def test_unix_socket_with_tls(self):
        sd = self.start(Storaged(tcp=False, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        admit(sd.stub, agent='assistant', text='over a unix socket')
        self.assertRefused(fresh_channel(sd.target, tls_credentials(PKI, client=False)),
                           'no client certificate')

    def test_bad_flags_and_files_stop_the_start(self):
        missing = os.path.join(_PKI_DIR, 'missing.pem')
        junk = os.path.join(_PKI_DIR, 'junk.pem')
        with open(junk, 'w') as f:
            f.write('not a certificate\n')
        cases = [
            (['--tls-cert', PKI.server], '--tls-cert and --tls-key go together'),
            (['--tls-key', PKI.server_key], '--tls-cert and --tls-key go together'),
            (['--tls-client-ca', PKI.ca], '--tls-client-ca needs --tls-cert'),
            (['--tls-cert', missing, '--tls-key', PKI.server_key],
             "--tls-cert: %s: cannot read" % missing),
            (['--tls-cert', junk, '--tls-key', PKI.server_key], 'holds no PEM certificate'),
            (['--tls-cert', PKI.server, '--tls-key', PKI.server], 'holds no PEM private key'),
            (['--tls-cert', PKI.server, '--tls-key', PKI.client_key], 'does not match'),
            (tls_server_args(PKI, mtls=False) + ['--tls-client-ca', junk],
             '--tls-client-ca: \'%s\' holds no PEM certificate' % junk),
        ]
        for args, want in cases:
            sd = Storaged(tcp=True, extra_args=args, start=False)
            self._started.append(sd)
            rc, err = sd.run_to_exit()
            self.assertEqual(rc, 2, '%s: %s' % (args, err))
            self.assertIn(want, err, args)
            self.assertNoKeyLogged(sd)
        # agentd's peer flags, and cflue's
        agents = tempfile.mkdtemp(prefix='cflue-tls-agents-')
        self.addCleanup(shutil.rmtree, agents, True)
        p = subprocess.run([AGENTD_BIN, '--agents', agents, '--peer-cert', PKI.client,
                            '--peer-key', PKI.client_key], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(b'--peer-ca is required', p.stderr)
        rc, out, err = run_cli(['--cert', PKI.client, '--cert-key', PKI.client_key, 'health',
                                '127.0.0.1:1'])
        self.assertEqual(rc, 2, err)
        self.assertIn('--ca is required', err)
        rc, out, err = run_cli(['--ca', PKI.ca, '--cert', PKI.client, 'health', '127.0.0.1:1'])
        self.assertEqual(rc, 2, err)
        self.assertIn('--cert and --cert-key go together', err)


class TooldTlsTest(TlsCase):

    def test_mtls_serves_its_clients_and_refuses_the_rest(self):
        td = self.start(Toold(tcp=True, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        td.workspace('tls', create=True)
        res = td.execute('tls', 'write', {'path': 'a.txt', 'content': 'over mTLS\n'})
        self.assertFalse(res.is_error, res.text)
        self.assertIn('over mTLS', td.execute('tls', 'read', {'path': 'a.txt'}).text)
        self.assertRefusesStrangers(td.target)
        self.assertIn('event=tls tls=on mtls=on', td.stderr_text())
        self.assertNoKeyLogged(td)


class ReloadTest(TlsCase):
    """SIGHUP rereads --tls-cert and --tls-key; new connections get what changed."""

    def tls_files(self, workdir):
        cert, key = os.path.join(workdir, 'server.pem'), os.path.join(workdir, 'server.key')
        shutil.copy(PKI.server, cert)
        shutil.copy(PKI.server_key, key)
        return cert, key

    def reissue(self, workdir, serial):
        """A new server certificate and key (serial given) put in place of the old pair."""
        staging = tempfile.mkdtemp(dir=workdir)
        cert, key = issue_cert(_PKI_DIR, 'server', serial, cn='localhost', out_dir=staging)
        os.replace(key, os.path.join(workdir, 'server.key'))
        os.replace(cert, os.path.join(workdir, 'server.pem'))
        shutil.rmtree(staging)

    def test_storaged_reload_then_a_broken_file(self):
        workdir = tempfile.mkdtemp(prefix='cflue-tls-reload-')
        cert, key = self.tls_files(workdir)
        sd = self.start(Storaged(tcp=True, workdir=workdir, start=False,
                                 extra_args=['--tls-cert', cert, '--tls-key', key,
                                             '--tls-client-ca', PKI.ca]),
                        tls_credentials(PKI))
        self.assertEqual(peer_serial(sd.port, PKI), '1001')
        self.reissue(workdir, 0x1002)
        sd.proc.send_signal(signal.SIGHUP)
        wait_log(sd, 'event=tls_reloaded cert=%s serial=1002' % cert)
        self.assertEqual(peer_serial(sd.port, PKI), '1002')
        self.assertEqual(health(fresh_channel(sd.target, tls_credentials(PKI))), SERVING)
        admit(sd.stub, agent='assistant', text='the connection open before the reload')
        # a broken certificate: the previous one stays, and the error is logged
        with open(cert, 'w') as f:
            f.write('-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n')
        sd.proc.send_signal(signal.SIGHUP)
        wait_log(sd, 'event=tls_reload_failed cert=%s' % cert)
        self.assertEqual(peer_serial(sd.port, PKI), '1002')
        self.assertEqual(health(fresh_channel(sd.target, tls_credentials(PKI))), SERVING)
        # a key that does not match its certificate is refused the same way
        self.reissue(workdir, 0x1003)
        shutil.copy(PKI.client_key, key)
        sd.proc.send_signal(signal.SIGHUP)
        wait_log(sd, 'does not match the certificate')
        self.assertEqual(peer_serial(sd.port, PKI), '1002')
        # a FIFO in the key's place is refused at once (opening it would wait for a writer, and
        # no later reload would run), and the next good pair is taken
        os.unlink(key)
        os.mkfifo(key)
        sd.proc.send_signal(signal.SIGHUP)
        wait_log(sd, '%s: not a regular file' % key)
        os.unlink(key)
        self.reissue(workdir, 0x1004)
        sd.proc.send_signal(signal.SIGHUP)
        wait_log(sd, 'event=tls_reloaded cert=%s serial=1004' % cert)
        self.assertEqual(peer_serial(sd.port, PKI), '1004')
        self.assertTrue(sd.alive())
        self.assertNoKeyLogged(sd)
        sd.stop()

    def test_toold_takes_sighup(self):
        workdir = tempfile.mkdtemp(prefix='cflue-tls-reload-')
        cert, key = self.tls_files(workdir)
        td = self.start(Toold(tcp=True, workdir=workdir, start=False,
                              extra_args=['--tls-cert', cert, '--tls-key', key]),
                        tls_credentials(PKI, client=False))
        self.assertEqual(peer_serial(td.port, PKI, client=False), '1001')
        td.proc.send_signal(signal.SIGHUP)
        wait_log(td, 'event=tls_unchanged')
        self.reissue(workdir, 0x1004)
        td.proc.send_signal(signal.SIGHUP)
        wait_log(td, 'event=tls_reloaded')
        self.assertEqual(peer_serial(td.port, PKI, client=False), '1004')
        self.assertEqual(health(fresh_channel(td.target, tls_credentials(PKI, client=False))),
                         SERVING)
        td.stop()


def bind(steps, conv):
    return [dict(s, match={'system_contains': conv}) for s in steps]


class AgentdTlsTest(TlsCase):
    """agentd between an mTLS storaged and toold, serving TLS with client certificates."""

    def agents_dir(self, tools_target):
        d = tempfile.mkdtemp(prefix='cflue-tls-agents-')
        self.addCleanup(shutil.rmtree, d, True)
        with open(os.path.join(FIXTURES_DIR, 'agents', 'runner-anthropic.md')) as f:
            text = f.read().replace('@TOOLS@', tools_target)
        with open(os.path.join(d, 'runner-anthropic.md'), 'w') as f:
            f.write(text)
        return d

    def model_env(self, fm):
        return {'ANTHROPIC_BASE_URL': fm.anthropic_base_url,
                'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}

    def test_submit_end_to_end_over_mtls(self):
        sd = self.start(Storaged(tcp=True, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        td = self.start(Toold(tcp=True, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        fm = FakeModel(steps=[])
        self._started.append(fm)
        ad = self.start(Agentd(sd.target, self.agents_dir(td.target), env=self.model_env(fm),
                               extra_args=tls_server_args(PKI) + tls_peer_args(PKI),
                               start=False), tls_credentials(PKI))
        self.assertTrue(ad.wait_health('readiness', SERVING))
        self.assertRegex(ad.stderr_text(),
                         r'event=tls tls=on mtls=on peer_tls=on peer_cert=on ')
        conv = 'c-tls-' + uuid.uuid4().hex[:8]
        td.workspace(conv, create=True)
        fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo tls-ok'}}]},
            {'text': 'Done over TLS.'}], conv))
        cli_tls = ['--ca', PKI.ca, '--cert', PKI.client, '--cert-key', PKI.client_key]
        rc, out, err = run_cli(cli_tls + ['submit', '--agent', 'runner-anthropic',
                                          '--conversation', conv, 'say it',
                                          '--agentd', ad.target])
        self.assertEqual(rc, 0, out + err)
        self.assertIn('<- bash: tls-ok', out)
        self.assertIn('Done over TLS.', out)
        self.assertRegex(out, r'\[sub_\S+ completed\]')
        # the variables work as the flags do
        env = dict(os.environ, CFLUE_CA=PKI.ca, CFLUE_CERT=PKI.client,
                   CFLUE_CERT_KEY=PKI.client_key)
        rc, out, err = run_cli(['health', ad.target], env=env)
        self.assertEqual((rc, out.strip()), (0, 'SERVING'), err)
        # plaintext, or TLS without a client certificate, is refused
        rc, out, err = run_cli(['health', ad.target])
        self.assertEqual(rc, 1, out + err)
        self.assertIn('(gRPC status 14)', err)
        rc, out, err = run_cli(['--ca', PKI.ca, 'status', 'sub_x', '--agentd', ad.target])
        self.assertEqual(rc, 1, out + err)
        self.assertIn('(gRPC status 14)', err)
        for d in (ad, td, sd):
            self.assertNoKeyLogged(d)

    def test_without_its_client_certificate_agentd_is_not_ready(self):
        sd = self.start(Storaged(tcp=True, extra_args=tls_server_args(PKI), start=False),
                        tls_credentials(PKI))
        fm = FakeModel(steps=[])
        self._started.append(fm)
        ad = self.start(Agentd(sd.target, self.agents_dir('127.0.0.1:1'),
                               env=self.model_env(fm),
                               extra_args=tls_peer_args(PKI, cert=False), start=False))
        self.assertEqual(ad.health_check('liveness'), SERVING)
        self.assertTrue(ad.wait_health('readiness', NOT_SERVING))
        self.assertIn('event=tls tls=off mtls=off peer_tls=on peer_cert=off', ad.stderr_text())
        with self.assertRaises(grpc.RpcError) as cm:
            ad.submit('runner-anthropic', 'hello', timeout=30)
        self.assertEqual(cm.exception.code(), UNAVAILABLE, cm.exception.details())
        self.assertIn('storaged', cm.exception.details())


def free_port_base(n=4):
    """A port P with P..P+n-1 free on 127.0.0.1 now."""
    for _ in range(50):
        base = 20000 + (uuid.uuid4().int % 30000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(('127.0.0.1', p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError('no free ports')


class RunTlsTest(unittest.TestCase):
    """The README's first command, over TLS and mTLS (scripts/run --tls), on the offline
    model."""

    def test_scripts_run_tls(self):
        data = tempfile.mkdtemp(prefix='cflue-run-tls-')
        self.addCleanup(shutil.rmtree, data, True)
        env = dict(os.environ, CFLUE_BUILD_DIR=BUILD_DIR, CFLUE_DATA=data,
                   CFLUE_PORT_BASE=str(free_port_base()))
        for k in ('ANTHROPIC_API_KEY', 'OPENAI_API_KEY', 'ANTHROPIC_BASE_URL',
                  'OPENAI_BASE_URL', 'CFLUE_CA', 'CFLUE_CERT', 'CFLUE_CERT_KEY'):
            env.pop(k, None)
        p = subprocess.run([os.path.join(REPO, 'scripts', 'run'), '--tls'], cwd=REPO, env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=120)
        out = p.stdout.decode('utf-8', 'replace')
        logs = ''
        for name in ('storaged', 'toold', 'agentd'):
            try:
                with open(os.path.join(data, name + '.log')) as f:
                    logs += f.read()
            except IOError:
                pass
        self.assertEqual(p.returncode, 0, out + logs)
        self.assertIn('== TLS:', out)
        self.assertIn('over TLS with client certificates', out)
        self.assertRegex(out, r'\[sub_\S+ completed\]')
        after = out.split("== the example project's tests after:")[1]
        self.assertEqual(after.strip().splitlines()[0], 'OK', out)
        self.assertEqual(len(re.findall(r'event=tls tls=on mtls=on', logs)), 3, logs)
        self.assertIn('peer_tls=on peer_cert=on', logs)
        self.assertNotIn('level=error', logs)
        for line in key_lines(os.path.join(data, 'tls', 'client.key')) + \
                key_lines(os.path.join(data, 'tls', 'server.key')):
            self.assertNotIn(line, out + logs)


if __name__ == '__main__':
    unittest.main()
