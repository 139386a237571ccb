"""An agent's own tool servers (agent definition `tools:`; agentd/tool_servers.c and
agentd/tool_batch.c): their tools reach the model after the sandbox's and the framework's and
run on their server; a name reserved by the framework or offered twice is refused with both
sources named (at start-up, or by the submission when the server was down at start-up); a
server down when a submission starts, killed between turns or killed during a call is told to
the model as a `resources` signal, its calls get error results, and the submission completes.
Real storaged, toold and agentd, the C example server (examples/tool-server) and the Python one
(py_tool_server.py); the fake model plays the agents.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_tool_servers
"""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import cflue_harness as H
from test_agentd import COMPLETED, FAILED, AgentdCase, body, kind, new_conv, request_system

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE_BIN = os.path.join(H.BUILD_DIR, 'examples', 'tool-server', 'cflue-example-tools')
SANDBOX_TOOLS = ['read', 'write', 'edit', 'bash', 'grep', 'glob']


def free_port():
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ToolServer(object):
    """A tool server process on 127.0.0.1:port."""

    def __init__(self, cmd, port, env=None):
        self.port = port
        self.addr = '127.0.0.1:%d' % port
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.err, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.err.seek(0)
                raise AssertionError('tool server exited: %s' % self.err.read().decode())
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError('tool server did not listen on %d' % port)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self):
        self.kill()
        self.err.close()


def example_server(port=None):
    if not os.path.exists(EXAMPLE_BIN):
        raise unittest.SkipTest('example tool server not built: %s' % EXAMPLE_BIN)
    port = port or free_port()
    return ToolServer([EXAMPLE_BIN, '--listen', '127.0.0.1:%d' % port], port)


def py_server(tools, port=None, no_batch=False, log='', list_sleep=0, list_sleep_sandbox=''):
    port = port or free_port()
    cmd = [sys.executable, os.path.join(HERE, 'py_tool_server.py'), '--port', str(port),
           '--tools', json.dumps(tools), '--list-sleep', str(list_sleep),
           '--list-sleep-sandbox', list_sleep_sandbox]
    if no_batch:
        cmd.append('--no-batch')
    if log:
        cmd += ['--log', log]
    return ToolServer(cmd, port)


PNG = base64.b64encode(b'\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR').decode()


def tool(name, reply='ran', sleep=0, images=()):
    return {'name': name, 'description': 'The %s tool of the test server.' % name,
            'schema': {'type': 'object', 'properties': {'q': {'type': 'string'}}},
            'reply': reply, 'sleep': sleep, 'images': list(images)}


def agent_md(name, servers, toold=None, timeout_ms=120000):
    sandbox = ('sandbox:\n  tools: "%s"\n  workspace: "{conversation}"\n' % toold) if toold else ''
    return ('---\nname: %s\ndescription: Uses tool servers (%s).\n'
            'model: anthropic/claude-test-1\n%stools: [%s]\n'
            'durability:\n  max_attempts: 3\n  timeout_ms: %d\n---\n\nROLE %s.\n'
            % (name, name, sandbox, ', '.join('"%s"' % s for s in servers), timeout_ms, name))


def role(name, **step):
    step['match'] = dict(step.pop('match', {}), system_contains='ROLE %s.' % name)
    return step


def call(tool_name, **args):
    return {'name': tool_name, 'arguments': args}


class ServersCase(AgentdCase):
    """A stack whose agents use servers the test starts (kept in cls.servers, closed at the
    end) and whose definitions the test writes (install_agents restarts agentd on them)."""
    servers = ()

    @classmethod
    def _keep(cls, server):
        cls.servers.append(server)
        return server

    @classmethod
    def install_agents(cls, agents):
        for name, text in agents.items():
            with open(os.path.join(cls.stack.agents_dir, name + '.md'), 'w') as f:
                f.write(text)
        cls.stack.ad.stop()
        cls.stack.ad.start()

    @classmethod
    def tearDownClass(cls):
        for s in cls.servers:
            s.close()
        super(ServersCase, cls).tearDownClass()


class ToolServersTest(ServersCase):
    stack_kwargs = {'agents': ('task-scout',)}

    @classmethod
    def setUpClass(cls):
        super(ToolServersTest, cls).setUpClass()
        cls.servers = []
        try:
            cls.example = cls._keep(example_server())
            cls.log = os.path.join(cls.stack.dir, 'py-calls.jsonl')
            cls.py = cls._keep(py_server([tool('lookup', 'found')], no_batch=True, log=cls.log))
            cls.fragile = cls._keep(example_server())
            cls.slow_log = os.path.join(cls.stack.dir, 'slow-calls.jsonl')
            cls.slow = cls._keep(py_server([tool('crunch', sleep=60)], log=cls.slow_log))
            cls.pics = cls._keep(py_server([tool('snap', 'snapped', images=[
                {'name': 'shot.png', 'mime_type': 'image/png', 'data': PNG},
                {'name': 'logo.svg', 'mime_type': 'image/svg+xml', 'data': 'PHN2Zy8+'}])]))
            cls.scan_log = os.path.join(cls.stack.dir, 'scan-calls.jsonl')
            cls.scans = cls._keep(py_server([tool('scan', 'scanned', images=[
                {'name': 'scan.png', 'mime_type': 'image/png', 'size': 4500 << 10}])],
                log=cls.scan_log))
            cls.odd = cls._keep(py_server([
                tool('bad name'),  # no provider takes it
                dict(tool('rawdesc'), description_hex=b'Ok \xff byte.'.hex()),
                dict(tool('chatty', 'x'), repeat=200000),
                dict(tool('wordy'), description='w' * 20000 + '. Then more.'),
                dict(tool('vast'), schema={'type': 'object', 'description': 's' * 70000})]))
            cls.crowd = cls._keep(py_server([tool('t%03d' % i) for i in range(130)]))
            cls.stuck = cls._keep(py_server([tool('crunch', sleep=60)]))  # hurried's alone
            cls.absent_port = free_port()  # nothing listens there
            cls.late_port = free_port()  # a server starts there after agentd
            toold = cls.stack.td.target
            cls.install_agents({
                'toolsmith': agent_md('toolsmith', [cls.example.addr, cls.py.addr], toold),
                'fragile': agent_md('fragile', [cls.fragile.addr]),
                'slowpoke': agent_md('slowpoke', [cls.slow.addr, cls.example.addr], toold),
                'absent': agent_md('absent', ['127.0.0.1:%d' % cls.absent_port,
                                              cls.example.addr]),
                'late': agent_md('late', ['127.0.0.1:%d' % cls.late_port], toold),
                'snapper': agent_md('snapper', [cls.pics.addr]),
                'scanner': agent_md('scanner', [cls.scans.addr]),
                'oddities': agent_md('oddities', [cls.odd.addr]),
                'crowded': agent_md('crowded', [cls.crowd.addr], toold),
                'hurried': agent_md('hurried', [cls.stuck.addr], timeout_ms=6000),
            })
        except BaseException:
            cls.tearDownClass()
            raise

    def run_agent(self, agent, steps, timeout=60, during=None):
        conv = new_conv(agent)
        self.workspace(conv)
        self.fm.set_scenario(steps)
        sid = self.ad.submit(agent, 'Use your tools.', conversation_id=conv).submission_id
        if during:
            during(conv)
        sub = self.wait_settled(sid, timeout=timeout)
        reqs = [e for e in self.fm.requests() if 'ROLE %s.' % agent in request_system(e)]
        return sub, self.records(conv), reqs

    def wait_for(self, what, pred, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        self.fail('timed out waiting for ' + what)

    def test_tools_reach_the_model_and_run_on_their_servers(self):
        sub, recs, reqs = self.run_agent('toolsmith', [
            role('toolsmith', tool_calls=[call('word_count', text='one two three'),
                                          call('lookup', q='cflue'),
                                          call('bash', command='echo from-the-sandbox')]),
            role('toolsmith', text='All three ran.')])
        self.assertEqual(sub.outcome, COMPLETED, sub)
        names = [t['name'] for t in reqs[0]['body']['tools']]
        self.assertEqual(names, SANDBOX_TOOLS + ['task', 'word_count', 'utc_now', 'lookup'])
        results = {body(r).index: body(r) for r in recs if kind(r) == 'tool_result'}
        self.assertFalse(results[0].is_error, results[0])
        self.assertIn('words: 3', results[0].text)
        # the Python server has no ExecuteBatch: agentd used Execute for its call
        self.assertFalse(results[1].is_error, results[1])
        self.assertTrue(results[1].text.startswith('found '), results[1])
        self.assertEqual(json.loads(results[1].text[len('found '):]), {'q': 'cflue'})
        self.assertIn('from-the-sandbox', results[2].text)
        with open(self.log) as f:
            [logged] = [json.loads(line) for line in f]
        self.assertEqual(logged['name'], 'lookup')
        self.assertEqual(logged['sandbox'], sub.conversation_id)
        self.assertGreater(logged['timeout_s'], 0)  # the submission's time left
        self.assertFalse([r for r in recs if kind(r) == 'signal'])

    def test_a_results_images_are_recorded_and_shown(self):
        """ToolResult.images: a PNG goes with the tool_result record and reaches the model as
        an image block of the tool_result; an SVG (no provider shows it) is a note in the
        text instead."""
        sub, recs, reqs = self.run_agent('snapper', [
            role('snapper', tool_calls=[call('snap', q='now')]),
            role('snapper', text='Saw it.')])
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [res] = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual([(i.name, i.mime_type, i.data) for i in res.images],
                         [('shot.png', 'image/png', base64.b64decode(PNG))])
        self.assertEqual(res.text, 'snapped {"q":"now"}\n[image 2 (image/svg+xml, 6 bytes) is '
                         'not shown: only PNG, JPEG, GIF and WebP images can be shown]')
        [block] = [b for m in reqs[1]['body']['messages'] if isinstance(m['content'], list)
                   for b in m['content'] if b.get('type') == 'tool_result']
        self.assertEqual(block['content'], [
            {'type': 'text', 'text': res.text},
            {'type': 'image', 'source': {'type': 'base64', 'media_type': 'image/png',
                                         'data': PNG}}])

    def test_a_servers_bad_names_bytes_and_long_texts_are_kept_from_the_model(self):
        """A server's tool named against every provider's pattern is left out (a provider
        refuses the whole request over it); a description that is not UTF-8 is offered with
        the bad byte replaced (it stopped the system prompt from being stored, and the
        submission was tried again to its attempt limit); a 200 KB result text is cut to
        51,200 bytes with a note (9 MiB failed the submission)."""
        sub, recs, reqs = self.run_agent('oddities', [
            role('oddities', tool_calls=[call('chatty', q='all of it')]),
            role('oddities', text='Read it.')])
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual(sub.attempt_count, 1)
        self.assertEqual([t['name'] for t in reqs[0]['body']['tools']],
                         ['task', 'rawdesc', 'chatty', 'wordy'])  # vast's schema is too long
        self.assertIn('Ok \ufffd byte.', request_system(reqs[0]))
        # a 20 KB description: its first 8,192 bytes offered, and 300 quoted in the prompt
        [wordy] = [t for t in reqs[0]['body']['tools'] if t['name'] == 'wordy']
        self.assertEqual(wordy['description'], 'w' * 8192 + ' [the rest of this description, '
                         '20012 bytes in all, is cut]')
        self.assertIn('\n- wordy: %s...\n' % ('w' * 300), request_system(reqs[0]))
        [res] = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertFalse(res.is_error, res.text[-200:])
        head, note = res.text.split('\n[cut: ')
        self.assertEqual(head, 'x' * 51200)
        full = len('x' * 200000 + ' ' + '{"q":"all of it"}')  # the reply, then the arguments
        self.assertEqual(note, 'the result has %d bytes; only the first 51200 are shown]' % full)
        self.assertIn('tool_skipped', self.ad.stderr_text())
        self.assertIn('tool=vast why="its parameter schema is over 65536 bytes"',
                      self.ad.stderr_text())

    def test_a_model_call_offers_at_most_128_tools(self):
        """A server listing 130 tools beside the sandbox's: a model call offers 128 tools in
        all, the server's last ones left out and logged (a provider refuses a whole request
        with more: every model call failed)."""
        sub, _, reqs = self.run_agent('crowded', [role('crowded', text='Plenty.')])
        self.assertEqual(sub.outcome, COMPLETED, sub)
        names = [t['name'] for t in reqs[0]['body']['tools']]
        self.assertEqual(names, SANDBOX_TOOLS + ['task'] + ['t%03d' % i for i in range(121)])
        self.assertIn('tool=t121 why="a model call offers at most 128 tools"',
                      self.ad.stderr_text())

    def test_a_second_batch_to_a_server_ends_at_the_time_limit(self):
        """65 calls to one server go as two batches, the second once the first is over. The
        first ran into the 6 s time limit; the second had no deadline at all (a second past a
        time left of 0 or less read as none) and the submission ran on for as long as the
        server took (60 s). It ends at the limit now, failed, every call answered."""
        t0 = time.monotonic()
        sub, recs, _ = self.run_agent('hurried', [
            role('hurried', tool_calls=[call('crunch', q=str(i)) for i in range(65)]),
            role('hurried', text='Not reached.')], timeout=50)
        self.assertLess(time.monotonic() - t0, 20)
        self.assertEqual(sub.outcome, FAILED, sub)
        self.assertIn('time limit', sub.error)
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual(sorted(r.index for r in results), list(range(65)))
        self.assertTrue(all(r.is_error for r in results))

    def test_large_results_of_one_turn_are_stored_in_several_appends(self):
        """Six results of 4.5 MiB images each (27 MiB together, past storaged's 16 MiB message
        limit), gathered while storaged is frozen, are all recorded once it is back: each
        Append carries at most 8 MiB."""
        sd = self.stack.sd.proc

        def freeze_while_the_tools_run(conv):
            self.wait_for('the first scan call',
                          lambda: os.path.exists(self.scan_log) and os.path.getsize(self.scan_log))
            sd.send_signal(signal.SIGSTOP)
            try:
                time.sleep(1.5)  # the six results arrive meanwhile
            finally:
                sd.send_signal(signal.SIGCONT)

        sub, recs, reqs = self.run_agent('scanner', [
            role('scanner', tool_calls=[call('scan', q=str(i)) for i in range(6)]),
            role('scanner', text='Scanned six.')], timeout=120, during=freeze_while_the_tools_run)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = sorted((body(r) for r in recs if kind(r) == 'tool_result'),
                         key=lambda r: r.index)
        self.assertEqual([(r.index, len(r.images), len(r.images[0].data)) for r in results],
                         [(i, 1, 4500 << 10) for i in range(6)])
        self.assertEqual(len(reqs), 2)

    def test_a_server_down_when_the_submission_starts_is_left_out_and_told(self):
        absent = '127.0.0.1:%d' % self.absent_port
        sub, recs, reqs = self.run_agent('absent', [
            role('absent', tool_calls=[call('lookup', q='x')]),
            role('absent', text='Managed without it.')])
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual([t['name'] for t in reqs[0]['body']['tools']],
                         ['task', 'word_count', 'utc_now'])
        [sig] = [body(r) for r in recs if kind(r) == 'signal']
        self.assertEqual(sig.kind, 'resources')
        self.assertIn('The tool server at %s cannot be reached' % absent, sig.text)
        self.assertIn(sig.text, json.dumps(reqs[0]['body']['messages']))
        [res] = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertTrue(res.is_error)
        self.assertIn("There is no tool named 'lookup'", res.text)

    def test_a_server_killed_between_turns_gives_error_results_and_a_signal(self):
        def kill_after_first_result(conv):
            self.wait_for('the first tool result', lambda: any(
                kind(r) == 'tool_result' for r in self.records(conv)))
            self.fragile.kill()

        sub, recs, reqs = self.run_agent('fragile', [
            role('fragile', tool_calls=[call('word_count', text='a b')]),
            role('fragile', delay_ms=2000, tool_calls=[call('word_count', text='c d e'),
                                                        call('utc_now')]),
            role('fragile', text='Finished without the server.')],
            during=kill_after_first_result)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual([(r.turn, r.is_error) for r in results],
                         [(1, False), (2, True), (2, True)])
        self.assertIn('words: 2', results[0].text)
        for r in results[1:]:
            self.assertIn('The tool server at %s failed before answering' % self.fragile.addr,
                          r.text)
        [sig] = [body(r) for r in recs if kind(r) == 'signal']  # once, for both calls
        self.assertEqual(sig.kind, 'resources')
        self.assertIn('%s stopped answering' % self.fragile.addr, sig.text)
        self.assertIn('word_count utc_now', sig.text)
        self.assertEqual(len(reqs), 3)
        self.assertIn('stopped answering', json.dumps(reqs[2]['body']['messages']))

    def test_a_server_killed_during_a_call_gives_an_error_result(self):
        def kill_during_the_call(conv):
            self.wait_for('the call to reach the server', lambda: os.path.exists(self.slow_log))
            self.slow.kill()

        sub, recs, _ = self.run_agent('slowpoke', [
            role('slowpoke', tool_calls=[call('crunch', q='big'),
                                         call('word_count', text='still works')]),
            role('slowpoke', text='crunch failed, word_count ran.')],
            during=kill_during_the_call)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = {body(r).index: body(r) for r in recs if kind(r) == 'tool_result'}
        self.assertTrue(results[0].is_error)
        self.assertIn('failed before answering', results[0].text)
        self.assertFalse(results[1].is_error, results[1])
        self.assertIn('words: 2', results[1].text)
        [sig] = [body(r) for r in recs if kind(r) == 'signal']
        self.assertIn('%s stopped answering' % self.slow.addr, sig.text)

    def test_a_clash_with_a_server_down_at_start_up_fails_the_submission(self):
        late = self._keep(py_server([tool('bash')], port=self.late_port))
        # agentd's channel to the server failed at start-up and reconnects within a second:
        # a submission in that second still finds it down (its tools left out, and told)
        deadline = time.monotonic() + 15
        while True:
            sub, recs, reqs = self.run_agent('late', [role('late', text='not listed yet')])
            if sub.outcome != COMPLETED or time.monotonic() > deadline:
                break
            [sig] = [body(r) for r in recs if kind(r) == 'signal']
            self.assertIn('cannot be reached', sig.text)
            time.sleep(0.3)
        self.assertEqual(sub.outcome, FAILED, sub)
        self.assertIn('duplicate tool name "bash"', sub.error)
        self.assertIn("the sandbox's toold at %s" % self.stack.td.target, sub.error)
        self.assertIn('the tool server at %s' % late.addr, sub.error)
        # the model never saw two tools by one name
        self.assertEqual([e for e in self.fm.requests()
                          if sub.conversation_id in request_system(e)], [])


class StartUpCheckTest(unittest.TestCase):
    """agentd refuses to start when a tool server that answers offers a reserved or taken
    name, and says which sources clash."""

    def setUp(self):
        if not os.path.exists(H.AGENTD_BIN):
            raise unittest.SkipTest('agentd not built')
        self.dir = tempfile.mkdtemp(prefix='cflue-toolcheck-')
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            s.close()
        subprocess.run(['rm', '-rf', self.dir])

    def start_agentd(self, agents):
        adir = os.path.join(self.dir, 'agents-%d' % len(os.listdir(self.dir)))
        os.makedirs(adir)
        for name, text in agents.items():
            with open(os.path.join(adir, name + '.md'), 'w') as f:
                f.write(text)
        return subprocess.run([H.AGENTD_BIN, '--listen', '127.0.0.1:0', '--store',
                               '127.0.0.1:%d' % free_port(), '--agents', adir],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30)

    def server(self, names):
        s = py_server([tool(n) for n in names])
        self.servers.append(s)
        return s

    def test_reserved_name(self):
        for name in ('task', 'activate_skill', 'read_skill_resource', 'finish', 'give_up'):
            with self.subTest(name=name):
                s = self.server([name])
                p = self.start_agentd({'bad': agent_md('bad', [s.addr])})
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertIn(b'agent bad: tool name "%s" is reserved by the framework, but the '
                              b'tool server at %s offers a tool by that name'
                              % (name.encode(), s.addr.encode()), p.stderr)

    def test_duplicate_between_servers(self):
        a, b = self.server(['lookup']), self.server(['other', 'lookup'])
        p = self.start_agentd({'bad': agent_md('bad', [a.addr, b.addr])})
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b'duplicate tool name "lookup": offered by the tool server at %s and by '
                      b'the tool server at %s' % (a.addr.encode(), b.addr.encode()), p.stderr)

    def test_duplicate_of_a_sandbox_tool(self):
        os.makedirs(os.path.join(self.dir, 'toold'))
        td = H.Toold(workdir=os.path.join(self.dir, 'toold'))
        self.servers.append(td)
        s = self.server(['grep'])
        p = self.start_agentd({'bad': agent_md('bad', [s.addr], td.target)})
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b'duplicate tool name "grep": offered by the sandbox\'s toold at %s and by '
                      b'the tool server at %s' % (td.target.encode(), s.addr.encode()), p.stderr)

    def test_bad_lists_are_refused_and_a_server_down_is_only_a_warning(self):
        port = free_port()
        p = self.start_agentd({'bad': agent_md('bad', ['127.0.0.1:%d' % port] * 2)})
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b'bad.md: tools[1]: 127.0.0.1:%d is listed twice' % port, p.stderr)
        p = self.start_agentd({'bad': agent_md('bad', ['127.0.0.1:%d' % (port + i)
                                                       for i in range(9)])})
        self.assertIn(b'bad.md: tools: 9 tool servers; at most 8', p.stderr)
        # a server that does not answer at start-up: agentd starts (and is stopped here)
        adir = os.path.join(self.dir, 'agents-ok')
        os.makedirs(adir)
        with open(os.path.join(adir, 'ok.md'), 'w') as f:
            f.write(agent_md('ok', ['127.0.0.1:%d' % port]))
        proc = subprocess.Popen([H.AGENTD_BIN, '--listen', '127.0.0.1:0', '--store',
                                 '127.0.0.1:%d' % free_port(), '--agents', adir],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            err = b''
            # readline blocks until a line comes, so only EOF (agentd gone) ends the loop early;
            # the deadline bounds a wait for success (a sanitizer build on a loaded machine)
            deadline = time.monotonic() + 60
            while b'event=listening' not in err and time.monotonic() < deadline:
                line = proc.stderr.readline()
                if not line:
                    break
                err += line
            self.assertIn(b'event=tool_server_unchecked', err)
            self.assertIn(b'event=listening', err)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            proc.stderr.close()


if __name__ == '__main__':
    unittest.main()
