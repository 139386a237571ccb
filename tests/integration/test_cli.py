"""The cflue command ends promptly on SIGTERM/SIGINT and at its deadline, whatever the server;
and it shows the typed records, submissions and errors of real daemons readably (CliOutputTest
against storaged, CliAgentTest against a whole stack with the offline model).

Defect (issue 7, item 7): rpc_global_init blocks SIGINT and SIGTERM in every thread, and
nothing in cflue waited for them, so a cflue whose call hung (a server that accepts the
connection and never answers) ignored SIGTERM until the call's own deadline, and `tool`,
`watch --follow`, `submit` and `store read --follow` had none. Each subcommand here runs
against:
  - a gRPC server (Python grpcio) that accepts every call and never answers it;
  - a listening socket that never speaks (no HTTP/2 handshake);
  - a real storaged stopped with SIGSTOP.
and must end on SIGTERM/SIGINT within about a second (exit 143/130, the call cancelled on
the server) and at --deadline-ms / CFLUE_DEADLINE_MS (exit 4), with a message saying which.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
import unittest
from concurrent import futures

import re
import uuid

import grpc

from cflue_harness import BUILD_DIR, Storaged, common_pb2, store_pb2

CFLUE_BIN = os.path.join(BUILD_DIR, 'cli', 'cflue')

STREAMING = ('/cflue.v1.Store/Follow', '/cflue.v1.Agent/Watch')

# "Promptly": a dozen cflue processes end together on a shared, often overloaded 2-core
# machine; the calls they replace took 10-15 s or never ended.
PROMPT_S = 3.0
# A deadline counts from cflue's start, which (loading libgrpc) can itself take seconds here;
# under ThreadSanitizer (scripts/test --tsan sets CFLUE_TSAN) every start is several times
# slower.
STARTUP_S = 12.0 if os.environ.get('CFLUE_TSAN') else 3.0


def commands(target):
    """(name, argv) of every subcommand that calls a server, all aimed at target."""
    return [
        ('health', ['health', target]),
        ('store get', ['store', 'get', 'sub-1', '--store', target]),
        ('store admit', ['store', 'admit', '--agent', 'a', 'hello', '--store', target]),
        ('store list', ['store', 'list', '--store', target]),
        ('store read', ['store', 'read', 'conv-1', '--store', target]),
        ('store read --follow', ['store', 'read', 'conv-1', '--follow', '--store', target]),
        ('tool', ['tool', target, 'bash', '{"command": "true"}']),
        ('submit', ['submit', '--agent', 'a', 'hi', '--agentd', target]),
        ('watch --follow', ['watch', 'conv-1', '--follow', '--agentd', target]),
        ('status', ['status', 'sub-1', '--agentd', target]),
        ('abort', ['abort', 'sub-1', '--agentd', target]),
        ('agents', ['agents', '--agentd', target]),
    ]


class _Hang(grpc.GenericRpcHandler):
    """Accepts every call and never answers it; counts calls started and calls that ended
    by cancellation (the client went away or cancelled)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = {}
        self.cancelled = {}

    def _note(self, table, method):
        with self.lock:
            table[method] = table.get(method, 0) + 1

    def _wait(self, method, context):
        self._note(self.started, method)
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(120)
        self._note(self.cancelled, method)

    def service(self, details):
        method = details.method
        if method in STREAMING:
            def stream(request, context):
                self._wait(method, context)
                return iter(())
            return grpc.unary_stream_rpc_method_handler(stream)

        def unary(request, context):
            self._wait(method, context)
            return b''
        return grpc.unary_unary_rpc_method_handler(unary)

    def counts(self):
        with self.lock:
            return sum(self.started.values()), sum(self.cancelled.values())


def _silent_socket():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('127.0.0.1', 0))
    s.listen(64)
    return s


class CliGuardTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(CFLUE_BIN):
            raise unittest.SkipTest('cflue not built: %s' % CFLUE_BIN)
        cls.hang = _Hang()
        cls.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                                 handlers=[cls.hang])
        port = cls.server.add_insecure_port('127.0.0.1:0')
        cls.server.start()
        cls.target = '127.0.0.1:%d' % port

    @classmethod
    def tearDownClass(cls):
        cls.server.stop(0)

    def spawn(self, argv, env_extra=None):
        env = dict(os.environ)
        env.pop('CFLUE_DEADLINE_MS', None)
        env.update(env_extra or {})
        return subprocess.Popen([CFLUE_BIN] + argv, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    def wait_all(self, procs, within_s):
        """Waits for every (name, proc, t0); returns {name: (rc, stderr, seconds)}. A process
        still running after within_s is killed and reported with rc None. (The output of a
        cflue here is far below a pipe's buffer, so polling cannot deadlock.)"""
        ended = {}
        deadline = time.monotonic() + within_s
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for name, p, t0 in procs:
                if name not in ended and p.poll() is not None:
                    ended[name] = time.monotonic() - t0
            time.sleep(0.01)
        out = {}
        for name, p, t0 in procs:
            if name not in ended:
                p.kill()
            _, err = p.communicate()
            out[name] = (p.returncode if name in ended else None,
                         err.decode('utf-8', 'replace'), ended.get(name, time.monotonic() - t0))
        return out

    def wait_started(self, before, n, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.hang.counts()[0] >= before + n:
                return
            time.sleep(0.02)
        self.fail('the server saw %d of %d calls' % (self.hang.counts()[0] - before, n))

    def check_signal(self, sig, code, word):
        cmds = commands(self.target)
        started0, cancelled0 = self.hang.counts()
        procs = [(name, self.spawn(argv), time.monotonic()) for name, argv in cmds]
        self.wait_started(started0, len(cmds))
        time.sleep(0.3)
        for name, p, _ in procs:
            self.assertIsNone(p.poll(), '%s ended before the signal' % name)
        t_sig = time.monotonic()
        for _, p, _ in procs:
            p.send_signal(sig)
        results = self.wait_all([(n, p, t_sig) for n, p, _ in procs], within_s=6.0)
        for name, (rc, err, took) in results.items():
            self.assertEqual(rc, code, '%s: exit %r after the signal (%.1f s); stderr: %s'
                             % (name, rc, took, err))
            self.assertLess(took, PROMPT_S, name)
            self.assertIn(word, err, name)
            self.assertIn('cancelled', err, name)
        # the calls were cancelled on the server, not left to run
        deadline = time.monotonic() + 30.0  # bounds a wait for success only
        while time.monotonic() < deadline:
            if self.hang.counts()[1] - cancelled0 >= len(cmds):
                break
            time.sleep(0.05)
        self.assertEqual(self.hang.counts()[1] - cancelled0, len(cmds))

    def test_sigterm_ends_every_command(self):
        self.check_signal(signal.SIGTERM, 143, 'SIGTERM')

    def test_sigint_ends_every_command(self):
        self.check_signal(signal.SIGINT, 130, 'SIGINT')

    def check_deadline(self, argv_extra, env_extra, deadline_ms):
        cmds = commands(self.target)
        procs = [(name, self.spawn(argv + argv_extra, env_extra), time.monotonic())
                 for name, argv in cmds]
        results = self.wait_all(procs, within_s=deadline_ms / 1000.0 + 10.0)
        for name, (rc, err, took) in results.items():
            self.assertEqual(rc, 4, '%s: exit %r after %.1f s; stderr: %s'
                             % (name, rc, took, err))
            self.assertGreater(took, deadline_ms / 1000.0 - 0.2, name)
            self.assertLess(took, deadline_ms / 1000.0 + STARTUP_S + PROMPT_S,
                            '%s: %s' % (name, err))
            self.assertIn('deadline of %d ms passed' % deadline_ms, err, name)

    def test_deadline_flag(self):
        self.check_deadline(['--deadline-ms', '1500'], None, 1500)

    def test_deadline_env(self):
        self.check_deadline([], {'CFLUE_DEADLINE_MS': '1200'}, 1200)

    def test_bad_deadline_is_a_usage_error(self):
        p = self.spawn(['health', self.target, '--deadline-ms', 'soon'])
        _, err = p.communicate(timeout=10)
        self.assertEqual(p.returncode, 2)
        self.assertIn('--deadline-ms', err.decode())

    def test_bad_flag_values_are_usage_errors(self):
        """Numbers in flags were read unchecked (`--after banana` as 0, `--after 3x` as 3,
        `tool --timeout-ms abc` as 0), `watch --agentd` without a value was "unknown flag",
        and `status` without a submission called the server. Each is a usage error (exit 2)
        that names the flag, before any call."""
        t = self.target
        cases = [
            (['store', 'read', 'conv-1', '--after', 'banana', '--store', t], "--after"),
            (['store', 'read', 'conv-1', '--after', '3x', '--store', t], "--after"),
            (['store', 'read', 'conv-1', '--after', '', '--store', t], "--after"),
            (['store', 'read', 'conv-1', '--after', '-2', '--store', t], "--after"),
            (['store', 'read', 'conv-1', '--after', '99999999999999999999', '--store', t],
             "--after"),
            (['store', 'read', 'conv-1', '--store', t, '--after'], "--after needs a value"),
            (['watch', 'conv-1', '--after', 'banana', '--agentd', t], "--after"),
            (['watch', 'conv-1', '--from', '3x', '--agentd', t], "--from"),
            (['tool', t, 'bash', '{"command": "true"}', '--timeout-ms', 'abc'], "--timeout-ms"),
            (['tool', t, 'bash', '{"command": "true"}', '--timeout-ms', '-1'], "--timeout-ms"),
            (['tool', t, 'bash', '{"command": "true"}', '--timeout-ms'],
             "--timeout-ms needs a value"),
            (['watch', 'conv-1', '--agentd'], "--agentd needs a value"),
            (['submit', '--agent', 'a', 'hi', '--agentd', t, '--conversation'],
             "--conversation needs a value"),
            (['status', '--agentd', t], "usage: cflue status"),
        ]
        started0, _ = self.hang.counts()
        for argv, want in cases:
            # bounded: before the fix some of these called the (silent) server
            p = self.spawn(argv + ['--deadline-ms', '3000'])
            _, err = p.communicate(timeout=30)
            err = err.decode('utf-8', 'replace')
            self.assertEqual(p.returncode, 2, '%s: exit %r; stderr: %s' % (argv, p.returncode, err))
            self.assertIn(want, err, argv)
            self.assertNotIn('unknown flag', err, argv)
        self.assertEqual(self.hang.counts()[0], started0, 'a usage error called the server')
        # the values that are numbers still work (-1: from the start)
        p = self.spawn(['store', 'read', 'conv-1', '--after', '-1', '--store', t,
                        '--deadline-ms', '1500'])
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 4, err)

    def test_silent_socket(self):
        """A socket that accepts and never speaks: every command ends by itself within its
        deadline, and at once on SIGTERM."""
        s = _silent_socket()
        try:
            target = '127.0.0.1:%d' % s.getsockname()[1]
            cmds = commands(target)
            procs = [(n, self.spawn(a + ['--deadline-ms', '3000']), time.monotonic())
                     for n, a in cmds]
            for name, (rc, err, took) in self.wait_all(procs, within_s=12.0).items():
                self.assertIsNotNone(rc, '%s still running after %.1f s' % (name, took))
                self.assertNotEqual(rc, 0, name)
                self.assertLess(took, 3.0 + STARTUP_S + PROMPT_S, name)
                self.assertIn('cflue:', err, name)
            procs = [(n, self.spawn(a), time.monotonic()) for n, a in cmds]
            time.sleep(0.3)
            t_sig = time.monotonic()
            for _, p, _ in procs:
                p.send_signal(signal.SIGTERM)
            results = self.wait_all([(n, p, t_sig) for n, p, _ in procs], within_s=6.0)
            for name, (rc, err, took) in results.items():
                self.assertIsNotNone(rc, '%s ignored SIGTERM' % name)
                self.assertNotEqual(rc, 0, name)
                self.assertLess(took, PROMPT_S, name)
        finally:
            s.close()

    def test_stopped_storaged(self):
        """A real storaged stopped with SIGSTOP: store commands end at their deadline or on
        SIGTERM; after SIGCONT the same commands work."""
        sd = Storaged(tcp=True)
        try:
            target = sd.target
            store_cmds = [(n, a) for n, a in commands(target) if n.startswith('store')]
            os.kill(sd.pid, signal.SIGSTOP)
            try:
                procs = [(n, self.spawn(a + ['--deadline-ms', '2000']), time.monotonic())
                         for n, a in store_cmds]
                for name, (rc, err, took) in self.wait_all(procs, within_s=12.0).items():
                    self.assertIsNotNone(rc, '%s still running after %.1f s' % (name, took))
                    self.assertNotEqual(rc, 0, name)
                    self.assertLess(took, 2.0 + STARTUP_S + PROMPT_S,
                                    '%s took %.1f s: %s' % (name, took, err))
                procs = [(n, self.spawn(a), time.monotonic()) for n, a in store_cmds]
                time.sleep(0.5)
                t_sig = time.monotonic()
                for _, p, _ in procs:
                    p.send_signal(signal.SIGTERM)
                for name, (rc, err, took) in self.wait_all(
                        [(n, p, t_sig) for n, p, _ in procs], within_s=6.0).items():
                    self.assertIsNotNone(rc, '%s ignored SIGTERM' % name)
                    self.assertNotEqual(rc, 0, name)
                    self.assertLess(took, PROMPT_S, name)
            finally:
                os.kill(sd.pid, signal.SIGCONT)
            p = self.spawn(['store', 'list', '--store', target, '--deadline-ms', '5000'])
            out, err = p.communicate(timeout=10)
            self.assertEqual(p.returncode, 0, err.decode())
        finally:
            sd.remove()


def run_cli(argv, timeout=60):
    """Runs cflue to its end; returns (exit code, stdout, stderr) as text."""
    p = subprocess.run([CFLUE_BIN] + argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=timeout)
    return p.returncode, p.stdout.decode('utf-8', 'replace'), p.stderr.decode('utf-8', 'replace')


# Text that, printed raw, would retitle the terminal window, clear the screen, turn it red,
# overwrite the line (carriage return), ring the bell, and start a C1 CSI (U+009B).
EVIL = 'A\x1b]0;TITLE\x07\x1b[2J\x1b[31mB\rC\x7f\x9b31m'
# valid UTF-8 around it must come through unchanged
KIND = 'h\u00e9llo \u2713 \u65e5\u672c \U0001f600\tend'


def controls(text):
    """The control characters in text that a terminal would act on: C0 but newline and tab,
    DEL, and C1 (U+0080..U+009F)."""
    return sorted(set(c for c in text if (ord(c) < 0x20 and c not in '\n\t') or
                      0x7f <= ord(c) <= 0x9f))


class ControlsMixin(object):

    def assertNoControls(self, text, what):
        self.assertEqual(controls(text), [], '%s printed control characters raw: %r'
                         % (what, text[:2000]))

    def assertShownVisibly(self, text, what):
        """EVIL shown visibly: its escapes written out as text."""
        self.assertNoControls(text, what)
        self.assertIn('A\\x1b]0;TITLE\\x07\\x1b[2J\\x1b[31mB\\x0dC\\x7f\\u009b31m', text,
                      what)


RECORD_LINE = re.compile(r'^(\d+) (\w+) (\S+)(.*)$')


def record_lines(out):
    """[(offset, type, submission, rest)] of `store read` / `conversation --records` output
    (tool call lines, indented, are left out)."""
    got = []
    for line in out.splitlines():
        m = RECORD_LINE.match(line)
        if m:
            got.append((int(m.group(1)), m.group(2), m.group(3), m.group(4)))
    return got


class CliOutputTest(unittest.TestCase, ControlsMixin):
    """`cflue store ...` against a real storaged: every record type printed by its typed body,
    Read and List paged to the end, times as ISO 8601, errors with their ErrorInfo reason."""

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(CFLUE_BIN):
            raise unittest.SkipTest('cflue not built: %s' % CFLUE_BIN)
        cls.sd = Storaged(tcp=True)
        stub = cls.sd.stub
        cls.conv = 'c-cli-' + uuid.uuid4().hex[:8]
        adm = stub.admit(store_pb2.AdmitRequest(agent='cli', conversation_id=cls.conv,
                                                message=common_pb2.Message(text='hello cli'),
                                                metadata={'channel': 'test'}))
        cls.sid = adm.submission.submission_id
        cl = stub.claim(store_pb2.ClaimRequest(owner_id='cli-test', submission_id=cls.sid))
        f = cl.fence
        c = common_pb2
        recs = [
            c.Record(id='input:' + cls.sid, submission_id=cls.sid,
                     user_message=c.UserMessage(text='hello cli', attachments=[
                         c.AttachmentRef(name='a.png', mime_type='image/png', size_bytes=7)])),
            c.Record(id='system:1', system_prompt=c.SystemPrompt(text='You are\na test.')),
            c.Record(id='delta:1', submission_id=cls.sid,
                     assistant_delta=c.AssistantDelta(turn=1, text='Let me')),
            c.Record(id='assistant:%s:1' % cls.sid, submission_id=cls.sid,
                     assistant_message=c.AssistantMessage(
                         turn=1, text='Let me look.', stop_reason='tool_use', model='fake/m1',
                         tool_calls=[c.ToolCallRequest(id='call-1', name='bash',
                                                       arguments_json='{"command": "ls"}')],
                         usage=c.Usage(input_tokens=11, output_tokens=22))),
            c.Record(id='tool:%s:1:call-1' % cls.sid, submission_id=cls.sid,
                     tool_result=c.ToolCallResult(
                         turn=1, index=0, tool_call_id='call-1', name='bash',
                         text='first line\nsecond\nthird\n', is_error=True, outcome_unknown=True,
                         truncation=c.Truncation(truncated=True, by=c.TRUNCATED_BY_LINES))),
            c.Record(id='signal:1', submission_id=cls.sid,
                     signal=c.Signal(kind='resources', text='disk is full')),
            c.Record(id='compaction:1', submission_id=cls.sid,
                     compaction=c.Compaction(summary='SUMMARY', first_kept_offset=3,
                                             tokens_before=900, tokens_after=90,
                                             trigger=c.COMPACTION_TRIGGER_THRESHOLD)),
        ]
        stub.append(store_pb2.AppendRequest(fence=f, records=recs))
        # enough deltas that Read needs more than one page of the CLI's 1000 records
        for b in range(11):
            stub.append(store_pb2.AppendRequest(fence=f, records=[
                c.Record(id='delta:x:%d' % (b * 100 + k), submission_id=cls.sid,
                         assistant_delta=c.AssistantDelta(turn=2, text='d%d' % (b * 100 + k)))
                for k in range(100)]))
        stub.settle(store_pb2.SettleRequest(fence=f, outcome=c.OUTCOME_COMPLETED,
                                            usage=c.Usage(input_tokens=11, output_tokens=22)))
        cls.n_records = len(recs) + 1100 + 1
        cls.store = ['--store', cls.sd.target]

    @classmethod
    def tearDownClass(cls):
        cls.sd.remove()

    def test_store_read_prints_every_record_type(self):
        rc, out, err = run_cli(['store', 'read', self.conv] + self.store)
        self.assertEqual(rc, 0, err)
        lines = record_lines(out)
        self.assertEqual([o for o, _, _, _ in lines], list(range(self.n_records)),
                         'store read did not page through every record')
        kinds = [k for _, k, _, _ in lines]
        self.assertEqual(kinds[:7], ['user_message', 'system_prompt', 'assistant_delta',
                                     'assistant_message', 'tool_result', 'signal', 'compaction'])
        self.assertEqual(kinds[-1], 'submission_settled')
        self.assertNotIn('unset', kinds)
        self.assertNotIn('unknown', kinds)
        text = {k: rest for _, k, _, rest in lines[:7]}
        self.assertIn('hello cli', text['user_message'])
        self.assertIn('a.png image/png 7 bytes', text['user_message'])
        self.assertIn('You are\\na test.', text['system_prompt'])  # one line per record
        self.assertIn('turn 1, fake/m1, stop tool_use, 11 in, 22 out: Let me look.',
                      text['assistant_message'])
        self.assertIn('    -> bash {"command": "ls"} (call-1)', out)
        self.assertIn('bash (call-1) error outcome-unknown truncated: first line ... '
                      '(2 more lines)', text['tool_result'])
        self.assertIn('resources: disk is full', text['signal'])
        self.assertIn('threshold, 900 -> 90 tokens, kept from offset 3: SUMMARY',
                      text['compaction'])
        off, kind, sub, rest = lines[-1]
        self.assertEqual((kind, sub, rest), ('submission_settled', self.sid,
                                             ' completed (answered by %s)' % self.sid))
        # --after resumes strictly after the offset
        rc, out, err = run_cli(['store', 'read', self.conv, '--after', '5'] + self.store)
        self.assertEqual(rc, 0, err)
        self.assertEqual([o for o, _, _, _ in record_lines(out)],
                         list(range(6, self.n_records)))

    def test_control_characters_are_shown_not_sent(self):
        """Terminal escape injection: a record's text (the model's answer, tool names and
        arguments, a tool result, a signal, a settlement error, a submission's text) printed
        raw reached the terminal as escape sequences. Every one shows visibly instead; valid
        UTF-8 is printed unchanged."""
        stub = self.sd.stub
        conv = 'c-cli-esc-' + uuid.uuid4().hex[:8]
        adm = stub.admit(store_pb2.AdmitRequest(agent='cli', conversation_id=conv,
                                                message=common_pb2.Message(text=EVIL + KIND)))
        sid = adm.submission.submission_id
        f = stub.claim(store_pb2.ClaimRequest(owner_id='cli-test', submission_id=sid)).fence
        c = common_pb2
        stub.append(store_pb2.AppendRequest(fence=f, records=[
            c.Record(id='assistant:%s:1' % sid, submission_id=sid,
                     assistant_message=c.AssistantMessage(
                         turn=1, text=EVIL + KIND, stop_reason='tool_use', model='m' + EVIL,
                         tool_calls=[c.ToolCallRequest(id='call' + EVIL, name='bash' + EVIL,
                                                       arguments_json='{"x": "%s"}' % EVIL)])),
            c.Record(id='tool:%s:1:call-1' % sid, submission_id=sid,
                     tool_result=c.ToolCallResult(turn=1, index=0, tool_call_id='call-1',
                                                  name='bash' + EVIL, text=EVIL + '\nmore')),
            c.Record(id='signal:1', submission_id=sid,
                     signal=c.Signal(kind='resources', text=EVIL)),
        ]))
        stub.settle(store_pb2.SettleRequest(fence=f, outcome=c.OUTCOME_FAILED, error=EVIL))
        rc, out, err = run_cli(['store', 'read', conv] + self.store)
        self.assertEqual(rc, 0, err)
        self.assertShownVisibly(out, 'store read')
        self.assertIn(KIND, out)
        self.assertEqual([k for _, k, _, _ in record_lines(out)],
                         ['assistant_message', 'tool_result', 'signal', 'submission_settled'])
        rc, out, err = run_cli(['store', 'get', sid] + self.store)
        self.assertEqual(rc, 0, err)
        self.assertShownVisibly(out, 'store get')
        self.assertIn(KIND, out)

    def test_output_that_cannot_be_written_fails(self):
        """SIGPIPE is blocked in cflue and write errors were ignored: `store read > /dev/full`
        exited 0 having written nothing. It exits 1 and says why, for a listing (checked each
        page) and for a short answer (checked at the end)."""
        for argv in (['store', 'read', self.conv], ['store', 'get', self.sid],
                     ['store', 'list', '--conversation', self.conv]):
            with open('/dev/full', 'w') as full:
                p = subprocess.run([CFLUE_BIN] + argv + self.store, stdin=subprocess.DEVNULL,
                                   stdout=full, stderr=subprocess.PIPE, timeout=60)
            err = p.stderr.decode('utf-8', 'replace')
            self.assertEqual(p.returncode, 1, '%s > /dev/full: %s' % (argv[:2], err))
            self.assertIn('cflue: cannot write the output: No space left on device', err,
                          argv[:2])

    def test_follow_ends_when_the_reader_goes_away(self):
        """`store read CONV --follow | head -c 10` kept following (and its call open) after
        head exited: SIGPIPE is blocked and the failed writes were ignored. The next record
        it cannot write ends it: the stream is cancelled, exit 1, quietly (EPIPE)."""
        stub = self.sd.stub
        conv = 'c-cli-pipe-' + uuid.uuid4().hex[:8]
        sid = stub.admit(store_pb2.AdmitRequest(agent='cli', conversation_id=conv,
                                                message=common_pb2.Message(text='hi'))) \
            .submission.submission_id
        f = stub.claim(store_pb2.ClaimRequest(owner_id='cli-test', submission_id=sid)).fence

        def delta(i):
            stub.append(store_pb2.AppendRequest(fence=f, records=[common_pb2.Record(
                id='delta:p:%d' % i, submission_id=sid,
                assistant_delta=common_pb2.AssistantDelta(turn=1, text='line %d' % i))]))
        for i in range(3):
            delta(i)
        p = subprocess.Popen([CFLUE_BIN, 'store', 'read', conv, '--follow'] + self.store,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        try:
            self.assertEqual(len(p.stdout.read(10)), 10)
            p.stdout.close()  # what head -c 10 does when it has its bytes
            deadline = time.monotonic() + 15.0
            i = 3
            while p.poll() is None and time.monotonic() < deadline:
                delta(i)
                i += 1
                time.sleep(0.2)
            self.assertIsNotNone(p.poll(), 'store read --follow still running after its '
                                 'reader went away (%d records appended since)' % (i - 3))
            err = p.stderr.read().decode('utf-8', 'replace')
            self.assertEqual(p.returncode, 1, err)
            self.assertNotIn('cannot write', err)  # EPIPE ends it quietly
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()

    def test_store_get_and_list(self):
        rc, out, err = run_cli(['store', 'get', self.sid] + self.store)
        self.assertEqual(rc, 0, err)
        fields = dict(re.split(r'\s{2,}', line.strip(), 1) for line in out.splitlines()
                      if re.search(r'\S\s{2,}\S', line))
        self.assertEqual(fields['kind'], 'message')
        self.assertEqual(fields['status'], 'settled')
        self.assertEqual(fields['outcome'], 'completed')
        self.assertEqual(fields['usage'], '11 in, 22 out, $0.0000')
        self.assertEqual(fields['metadata'], 'channel=test')
        for t in ('created', 'settled'):
            self.assertRegex(fields[t], r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$', t)
        rc, out, err = run_cli(['store', 'list', '--conversation', self.conv] + self.store)
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r'^\d+ %s %s completed\n$' % (self.sid, self.conv))

    def test_errors_carry_their_reason(self):
        rc, out, err = run_cli(['store', 'read', self.conv, '--after', '100000'] + self.store)
        self.assertEqual(rc, 1)
        self.assertIn('[OFFSET_BEYOND_HEAD]', err)
        self.assertIn('(gRPC status %d)' % grpc.StatusCode.OUT_OF_RANGE.value[0], err)
        rc, out, err = run_cli(['store', 'get', 'sub_missing'] + self.store)
        self.assertEqual(rc, 1)
        self.assertRegex(err, r'^cflue: .*\[[A-Z_]+\] \(gRPC status 5\)\n$')


class CliAgentTest(unittest.TestCase, ControlsMixin):
    """`cflue submit/watch/status/conversation/agents/compact/abort` against a whole stack."""

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(CFLUE_BIN):
            raise unittest.SkipTest('cflue not built: %s' % CFLUE_BIN)
        from test_agentd import Stack
        cls.stack = Stack()
        cls.agentd = ['--agentd', cls.stack.ad.target]

    @classmethod
    def tearDownClass(cls):
        cls.stack.remove()

    def test_submit_watch_status_and_history(self):
        from test_agentd import bind
        conv = 'c-cli-' + uuid.uuid4().hex[:8]
        self.stack.td.workspace(conv, create=True)
        self.stack.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'printf "a\\nb\\nc\\n"'}}]},
            {'text': 'All listed.'}], conv))
        rc, out, err = run_cli(['submit', '--agent', 'runner-anthropic', '--conversation', conv,
                                'list things'] + self.agentd)
        self.assertEqual(rc, 0, out + err)
        m = re.search(r'submission (\S+) in conversation %s' % conv, err)
        self.assertTrue(m, err)
        sid = m.group(1)
        self.assertIn('  -> bash {"command":', out)
        self.assertIn('  <- bash: a ...', out)
        self.assertIn('(2 more lines)', out)
        self.assertIn('All listed.', out)
        self.assertIn('[%s completed]' % sid, out)
        # watch replays the same view
        rc, wout, err = run_cli(['watch', conv] + self.agentd)
        self.assertEqual(rc, 0, err)
        self.assertIn('> list things', wout)
        self.assertIn('All listed.', wout)
        self.assertIn('[%s completed]' % sid, wout)
        # status: the typed submission
        rc, out, err = run_cli(['status', sid] + self.agentd)
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r'kind\s+message\n')
        self.assertRegex(out, r'outcome\s+completed\n')
        self.assertRegex(out, r'settled\s+\d{4}-\d\d-\d\dT')
        # conversation --records pages through GetConversation to the whole history
        replay = self.stack.ad.watch_all(conv)
        rc, out, err = run_cli(['conversation', conv, '--records'] + self.agentd)
        self.assertEqual(rc, 0, err)
        lines = record_lines(out)
        self.assertEqual([(o, k) for o, k, _, _ in lines],
                         [(r.offset, r.WhichOneof('body')) for r in replay])
        self.assertIn('submission       %s settled completed' % sid, out)
        # nothing left to abort; nothing old enough to compact
        rc, out, err = run_cli(['abort', '--conversation', conv] + self.agentd)
        self.assertEqual(rc, 0, err)
        self.assertIn('nothing to abort', out)
        rc, out, err = run_cli(['compact', conv] + self.agentd)
        self.assertEqual(rc, 1, out)
        self.assertIn('[NOTHING_TO_COMPACT]', err)

    def test_control_characters_are_shown_not_sent(self):
        """Terminal escape injection: the model's answer, its tool call, the tool's result and
        `cflue tool`'s output reached the terminal raw. They show visibly instead."""
        from test_agentd import bind
        conv = 'c-cli-' + uuid.uuid4().hex[:8]
        self.stack.td.workspace(conv, create=True)
        printf = "printf '%s\\n'" % EVIL.replace('\x1b', '\\033').replace('\x07', '\\007') \
            .replace('\r', '\\r').replace('\x7f', '\\177').replace('\x9b', '\\302\\233')
        self.stack.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': printf}}]},
            {'text': EVIL + KIND}], conv))
        rc, out, err = run_cli(['submit', '--agent', 'runner-anthropic', '--conversation', conv,
                                'say ' + EVIL] + self.agentd)
        self.assertEqual(rc, 0, out + err)
        self.assertShownVisibly(out, 'submit')
        self.assertIn(KIND, out)
        self.assertIn('> say A\\x1b]0;', out)           # the user's text
        self.assertIn('  <- bash: A\\x1b]0;TITLE', out)  # the tool result's head
        self.assertIn('  -> bash {"command":', out)
        rc, wout, err = run_cli(['watch', conv] + self.agentd)
        self.assertEqual(rc, 0, err)
        self.assertShownVisibly(wout, 'watch')
        # `cflue tool` prints the result text, and details on stderr, the same way
        rc, tout, terr = run_cli(['tool', self.stack.td.target, 'bash',
                                  json.dumps({'command': printf}), '--sandbox', conv])
        self.assertEqual(rc, 0, terr)
        self.assertShownVisibly(tout, 'tool')
        self.assertNoControls(terr, 'tool (stderr)')

    def test_watch_follow_ends_when_the_reader_goes_away(self):
        """`cflue watch CONV --follow | head -c 10` kept watching after head exited. The next
        record it cannot write ends it (exit 1, quietly)."""
        from test_agentd import bind
        conv = 'c-cli-' + uuid.uuid4().hex[:8]
        self.stack.td.workspace(conv, create=True)
        self.stack.fm.set_scenario(bind([{'text': 'first answer'}, {'text': 'second answer'}],
                                        conv))
        submit = ['submit', '--agent', 'runner-anthropic', '--conversation', conv]
        rc, out, err = run_cli(submit + ['one'] + self.agentd)
        self.assertEqual(rc, 0, out + err)
        p = subprocess.Popen([CFLUE_BIN, 'watch', conv, '--follow'] + self.agentd,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        try:
            self.assertEqual(len(p.stdout.read(10)), 10)
            p.stdout.close()
            time.sleep(0.3)
            rc, out, err = run_cli(submit + ['two'] + self.agentd)  # records it cannot write
            self.assertEqual(rc, 0, out + err)
            deadline = time.monotonic() + 10.0
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertIsNotNone(p.poll(), 'watch --follow still running after its reader '
                                 'went away')
            err = p.stderr.read().decode('utf-8', 'replace')
            self.assertEqual(p.returncode, 1, err)
            self.assertNotIn('cannot write', err)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()

    def test_an_answer_that_starts_over_is_shown_so(self):
        """A stream that broke off after some text is asked again: the watcher showed the
        abandoned text run into the new answer. It says the answer started over and prints
        the new text whole."""
        from test_agentd import bind
        conv = 'c-cli-' + uuid.uuid4().hex[:8]
        self.stack.td.workspace(conv, create=True)
        first = ' '.join('first%02d' % i for i in range(100))
        second = ' '.join('second%02d' % i for i in range(100))
        self.stack.fm.set_scenario(bind([
            {'text': first, 'chunk_delay_ms': 60, 'disconnect_after_chunks': 14},
            {'text': second, 'chunk_delay_ms': 60}], conv))
        rc, out, err = run_cli(['submit', '--agent', 'runner-anthropic', '--conversation', conv,
                                'tell me'] + self.agentd)
        self.assertEqual(rc, 0, out + err)
        self.assertIn('first00', out)  # shown while it streamed
        head, after = out.split('[the answer started over]\n')
        self.assertIn(second + '\n', after)
        self.assertNotIn('first', after)

    def test_agents_and_errors(self):
        rc, out, err = run_cli(['agents'] + self.agentd)
        self.assertEqual(rc, 0, err)
        self.assertEqual(sorted(line.split()[0] for line in out.splitlines()),
                         ['runner-anthropic', 'runner-openai'])
        rc, out, err = run_cli(['submit', '--agent', 'no-such-agent', 'hi'] + self.agentd)
        self.assertEqual(rc, 1)
        self.assertIn('[UNKNOWN_AGENT]', err)
        self.assertIn('(gRPC status 5)', err)
        rc, out, err = run_cli(['abort'] + self.agentd)
        self.assertEqual(rc, 2)


if __name__ == '__main__':
    unittest.main()
