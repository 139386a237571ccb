"""toold over gRPC: the tool list, batches and per-path locks, bounded memory on huge output,
bad input, the Sandbox service, the bwrap driver, process hygiene and shutdown.

The single-call behaviour of each tool is covered case by case in test_toold_cases.py
(tests/tools/cases); this file holds what needs several calls, threads, processes or a
particular daemon.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import unittest

import grpc

from cflue_harness import (INVALID_ARGUMENT, NOT_FOUND, SERVING, TooldTestCase, result_details,
                           sandbox_pb2, tools_pb2)
from cflue_harness import Toold, error_reason, poll_until, tool_call, truncation_dict  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
TOOL_ORDER = ['read', 'write', 'edit', 'bash', 'grep', 'glob']
TOOL_PARAMS = {
    'read': (['path', 'offset', 'limit'], ['path']),
    'write': (['path', 'content'], ['path', 'content']),
    'edit': (['path', 'oldText', 'newText', 'replaceAll'], ['path', 'oldText', 'newText']),
    'bash': (['command', 'timeout'], ['command']),
    'grep': (['pattern', 'path', 'include', 'literal'], ['pattern']),
    'glob': (['pattern', 'path'], ['pattern']),
}
NOT_FOUND_TEXT = 'Could not find'


# ---- /proc helpers ----

def _proc_status(pid):
    out = {}
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            k, _, v = line.partition(':')
            out[k] = v.strip()
    return out


def _kib(value):
    return int(value.split()[0])


def _stat_fields(pid):
    """(state, ppid) of a process, or None when it is gone."""
    try:
        with open('/proc/%s/stat' % pid) as f:
            data = f.read()
    except (IOError, OSError):
        return None
    rest = data[data.rindex(')') + 2:].split()
    return rest[0], int(rest[1])


def _cmdline(pid):
    try:
        with open('/proc/%s/cmdline' % pid, 'rb') as f:
            return f.read().split(b'\0')
    except (IOError, OSError):
        return []


def _pids():
    return [int(p) for p in os.listdir('/proc') if p.isdigit()]


def processes_running(argv):
    """Pids of live (non-zombie) processes whose argv is exactly argv."""
    want = [a.encode() for a in argv]
    out = []
    for pid in _pids():
        args = [a for a in _cmdline(pid) if a != b''] if _cmdline(pid) else []
        if args == want:
            st = _stat_fields(pid)
            if st and st[0] != 'Z':
                out.append(pid)
    return out


def wait_no_process(argv, timeout=30.0):
    """The processes with exactly argv still running after timeout ([] once there are none)."""
    poll_until(lambda: not processes_running(argv), timeout)
    return processes_running(argv)


def zombie_children(pid):
    out = []
    for p in _pids():
        st = _stat_fields(p)
        if st and st[1] == pid and st[0] == 'Z':
            out.append(p)
    return out


def wait_no_zombies(pid, timeout=30.0):
    """pid's zombie children once there are none, or those still left after timeout (toold
    reaps its children asynchronously: on a loaded machine a fixed short sleep was not enough)."""
    poll_until(lambda: not zombie_children(pid), timeout)
    return zombie_children(pid)


def _descends_from(pid, ancestor):
    for _ in range(64):
        st = _stat_fields(pid)
        if st is None or st[1] <= 1:
            return False
        if st[1] == ancestor:
            return True
        pid = st[1]
    return False


def wait_descendant(ancestor, argv, timeout=30.0):
    """A live process with exactly argv below ancestor, once there is one (None after timeout)."""
    return poll_until(lambda: next((pid for pid in processes_running(argv)
                                    if _descends_from(pid, ancestor)), None), timeout, 0.02)


class _Sampler(threading.Thread):
    """Samples VmRSS/VmHWM of a process every 10 ms until stopped."""

    def __init__(self, pid):
        super(_Sampler, self).__init__(daemon=True)
        self.pid = pid
        self.max_rss_kib = 0
        self.max_hwm_kib = 0
        self.samples = 0
        self._stop_ev = threading.Event()

    def run(self):
        while not self._stop_ev.is_set():
            self.sample()
            time.sleep(0.01)

    def sample(self):
        try:
            st = _proc_status(self.pid)
        except (IOError, OSError):
            return
        self.max_rss_kib = max(self.max_rss_kib, _kib(st['VmRSS']))
        self.max_hwm_kib = max(self.max_hwm_kib, _kib(st['VmHWM']))
        self.samples += 1

    def stop(self):
        self._stop_ev.set()
        self.join()
        self.sample()


class TooldBase(TooldTestCase):
    """A fresh local-driver toold per test (self.td) and helpers."""

    toold_kwargs = {}

    def setUp(self):
        self.td = self.start_toold(**self.toold_kwargs)

    def call(self, sandbox, name, args, **kw):
        return self.td.execute(sandbox, name, args, **kw)

    def assertOk(self, res, contains=None):
        self.assertFalse(res.is_error, 'unexpected error result: %r' % res.text)
        if contains is not None:
            self.assertIn(contains, res.text)

    def assertErrorResult(self, res, *words):
        self.assertTrue(res.is_error, 'expected an error result, got %r' % res.text[:500])
        self.assertTrue(res.text.strip(), 'error result without a message')
        for w in words:
            self.assertIn(w.lower(), res.text.lower(),
                          'error %r does not mention %r' % (res.text[:500], w))

    def assertHealthy(self):
        self.assertTrue(self.td.alive(), 'toold died\n' + self.td.stderr_text())
        self.assertEqual(self.td.health_check(), SERVING)
        res = self.call('health-probe', 'bash', {'command': 'echo alive'})
        self.assertEqual(res.text, 'alive')


# ---------------------------------------------------------------------------------------------
# (a) List
# ---------------------------------------------------------------------------------------------

class TestList(TooldBase):

    def test_list_order_and_schemas(self):
        resp = self.td.list_tools(sandbox='s1')
        self.assertEqual([t.name for t in resp.tools], TOOL_ORDER)
        for t in resp.tools:
            self.assertTrue(t.description.strip(), '%s has no description' % t.name)
            schema = json.loads(t.parameters_json)
            self.assertEqual(schema.get('type'), 'object', t.name)
            props, required = TOOL_PARAMS[t.name]
            self.assertEqual(sorted(schema['properties']), sorted(props), t.name)
            self.assertEqual(sorted(schema.get('required', [])), sorted(required), t.name)
            for p, spec in schema['properties'].items():
                self.assertIn(spec.get('type'), ('string', 'integer', 'number', 'boolean'),
                              '%s.%s' % (t.name, p))
        # the list does not depend on the sandbox name
        self.assertEqual([t.name for t in self.td.list_tools(sandbox='').tools], TOOL_ORDER)


# ---------------------------------------------------------------------------------------------
# (b) batches and per-path locks
# ---------------------------------------------------------------------------------------------

N_EDITS = 20


def _lines_file(n):
    return ''.join('line %02d original\n' % i for i in range(n))


def _edit(sandbox, i, path='f.txt'):
    return tool_call(sandbox, 'edit', {'path': path, 'oldText': 'line %02d original' % i,
                                       'newText': 'line %02d edited' % i}, call_id='e%d' % i)


class TestBatch(TooldBase):

    def write(self, sandbox, path, content):
        self.assertOk(self.call(sandbox, 'write', {'path': path, 'content': content}))

    def file(self, sandbox, path):
        with open(os.path.join(self.td.workspace(sandbox), path), 'rb') as f:
            return f.read().decode('utf-8')

    def test_parallel_edits_from_threads(self):
        sb = 'threads'
        self.write(sb, 'f.txt', _lines_file(N_EDITS))
        results = [None] * N_EDITS
        errors = []
        barrier = threading.Barrier(N_EDITS)

        def worker(i):
            try:
                barrier.wait(10)
                results[i] = self.td.execute_call(_edit(sb, i))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_EDITS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])
        for i, r in enumerate(results):
            self.assertOk(r)
        self.assertEqual(self.file(sb, 'f.txt'),
                         ''.join('line %02d edited\n' % i for i in range(N_EDITS)))

    def test_parallel_edits_in_one_batch(self):
        sb = 'batch'
        self.write(sb, 'f.txt', _lines_file(N_EDITS))
        out = self.td.execute_batch([_edit(sb, i) for i in range(N_EDITS)])
        self.assertEqual(sorted(r.index for r in out), list(range(N_EDITS)))
        for r in out:
            self.assertOk(r.result)
        self.assertEqual(self.file(sb, 'f.txt'),
                         ''.join('line %02d edited\n' % i for i in range(N_EDITS)))

    def test_conflicting_edits_first_by_index_wins(self):
        sb = 'conflict'
        for attempt in range(5):  # the outcome must not depend on scheduling
            self.write(sb, 'a.txt', 'x\n')
            out = self.td.execute_batch([
                tool_call(sb, 'edit', {'path': 'a.txt', 'oldText': 'x', 'newText': 'y'}),
                tool_call(sb, 'edit', {'path': './a.txt', 'oldText': 'x', 'newText': 'z'}),
            ])
            by_index = {r.index: r.result for r in out}
            self.assertEqual(sorted(by_index), [0, 1])
            self.assertOk(by_index[0])
            self.assertErrorResult(by_index[1], NOT_FOUND_TEXT)
            self.assertEqual(self.file(sb, 'a.txt'), 'y\n')

    def test_same_path_calls_apply_in_call_order(self):
        sb = 'chain'
        n = 12
        calls = [tool_call(sb, 'write', {'path': 'c.txt', 'content': 'v0'})]
        calls += [tool_call(sb, 'edit', {'path': 'c.txt', 'oldText': 'v%d' % i,
                                         'newText': 'v%d' % (i + 1)}) for i in range(n)]
        out = self.td.execute_batch(calls)
        self.assertEqual(len(out), n + 1)
        for r in out:
            self.assertOk(r.result)
        self.assertEqual(self.file(sb, 'c.txt'), 'v%d' % n)

    def test_write_then_edit_in_one_batch(self):
        sb = 'write-edit'
        out = self.td.execute_batch([
            tool_call(sb, 'write', {'path': 'f', 'content': 'A'}),
            tool_call(sb, 'edit', {'path': 'f', 'oldText': 'A', 'newText': 'B'}),
            tool_call(sb, 'edit', {'path': 'g', 'oldText': 'nothing', 'newText': 'x'}),
            tool_call(sb, 'write', {'path': 'h', 'content': 'H'}),
        ])
        by_index = {r.index: r.result for r in out}
        self.assertOk(by_index[0])
        self.assertOk(by_index[1])
        self.assertErrorResult(by_index[2])
        self.assertOk(by_index[3])
        self.assertEqual(self.file(sb, 'f'), 'B')
        self.assertEqual(self.file(sb, 'h'), 'H')

    def test_batch_streams_results_as_they_finish(self):
        sb = 'stream'
        t0 = time.monotonic()
        c = self.td.channel.unary_stream(
            '/cflue.v1.Tools/ExecuteBatch',
            request_serializer=tools_pb2.ToolBatch.SerializeToString,
            response_deserializer=tools_pb2.BatchResult.FromString)
        stream = c(tools_pb2.ToolBatch(calls=[
            tool_call(sb, 'bash', {'command': 'sleep 8; echo slow'}),
            tool_call(sb, 'bash', {'command': 'echo fast'}),
        ]), timeout=30)
        first = next(stream)
        t_first = time.monotonic() - t0
        rest = list(stream)
        self.assertEqual(first.index, 1)
        self.assertEqual(first.result.text, 'fast')
        # 8 s against 5 s: a loaded machine's slack (1.5 s against 1.2 s left it 0.3 s)
        self.assertLess(t_first, 5.0, 'the fast result waited for the slow one')
        self.assertEqual([(r.index, r.result.text) for r in rest], [(0, 'slow')])

    def test_different_files_run_concurrently(self):
        sb = 'concurrent'
        t0 = time.monotonic()
        out = self.td.execute_batch([
            tool_call(sb, 'bash', {'command': 'sleep 3; echo a > a.txt'}),
            tool_call(sb, 'bash', {'command': 'sleep 3; echo b > b.txt'}),
            tool_call(sb, 'bash', {'command': 'sleep 3; echo c > c.txt'}),
        ])
        self.assertEqual(len(out), 3)
        # one after the other takes 9 s; 3 s sleeps leave a loaded machine 4.5 s of slack (1 s
        # sleeps against 2.5 s left it 1.5 s)
        self.assertLess(time.monotonic() - t0, 7.5, 'batch calls did not run in parallel')

    def test_batch_limit(self):
        calls = [tool_call('lim', 'read', {'path': 'x'}) for _ in range(65)]
        with self.assertRaises(grpc.RpcError) as cm:
            self.td.execute_batch(calls)
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
        self.assertEqual(len(self.td.execute_batch(calls[:64])), 64)


# ---------------------------------------------------------------------------------------------
# grep engines: rg and the built-in PCRE2 engine print the same thing for the same tree
# ---------------------------------------------------------------------------------------------

def _make_tree(root, seed=1234):
    """A reproducible tree with hidden entries, ignore files, binaries, long and non-ASCII
    lines, CRLF, invalid UTF-8 and files without a final newline."""
    rnd = random.Random(seed)
    words = ['needle', 'hay', 'x1', 'caf\u00e9', 'a.b', 'axb', '123', 'Needle', 'neeedle',
             'it\'s', '(paren', 'tab\there']
    dirs = ['', 'src/', 'src/deep/', '.hidden/', 'build/', 'docs/', 'node_modules/pkg/',
            'sub/', 'sub/.cache/', 'sub/inner/', 'a-b/', 'a/']
    files = {'.gitignore': b'build/\n*.log\n!keep.log\nnode_modules\n',
             'sub/.gitignore': b'*.md\n', 'keep.log': b'needle kept\n',
             '.ignore': b'docs/secret.txt\n', 'docs/secret.txt': b'needle secret\n'}
    for i in range(300):
        d = rnd.choice(dirs)
        name = rnd.choice(['f', 'g', 'h', '.dot', 'A', '_u']) + str(i) + rnd.choice(
            ['.txt', '.py', '.log', '.md', ''])
        lines = [' '.join(rnd.choice(words) for _ in range(rnd.randint(0, 6)))
                 for _ in range(rnd.randint(0, 40))]
        if rnd.random() < 0.1:
            lines.insert(rnd.randint(0, len(lines)), 'needle ' + 'z\u00e9' * 400)
        data = '\n'.join(lines).encode()
        r = rnd.random()
        if r < 0.08:
            data = data[:20] + b'\x00' + data[20:]
        elif r < 0.16:
            data = data.replace(b'\n', b'\r\n')
        elif r < 0.22:
            data = data.replace(b'hay', b'h\xffy')
        if lines and rnd.random() < 0.8:
            data += b'\r\n' if r < 0.16 and 0.08 <= r else b'\n'
        files[d + name] = data
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'wb') as f:
            f.write(data)
    os.symlink('/', os.path.join(root, 'rootlink'))
    os.symlink('src', os.path.join(root, 'srclink'))


ENGINE_QUERIES = [
    {'pattern': 'needle'},
    {'pattern': 'ne+dle'},
    {'pattern': 'hay'},
    {'pattern': '^x1'},
    {'pattern': 'caf\u00e9 (hay|123)$'},
    {'pattern': '[0-9]{3}'},
    {'pattern': 'a.b', 'literal': True},
    {'pattern': '(paren', 'literal': True},
    {'pattern': "it's"},
    {'pattern': '\\bNeedle\\b'},
    {'pattern': 'tab\there'},
    {'pattern': 'needle', 'include': '*.py'},
    {'pattern': 'needle', 'path': 'sub'},
    {'pattern': 'hay', 'path': 'src/deep', 'include': 'f*'},
    {'pattern': 'z\u00e9z'},
    {'pattern': 'no such text anywhere'},
]


class TestEngineParity(TooldTestCase):

    def test_rg_and_pcre2_agree(self):
        if not shutil.which('rg'):
            self.skipTest('rg is not installed')
        servers = {e: self.start_toold(grep_engine=e) for e in ('rg', 'pcre2')}
        for td in servers.values():
            _make_tree(td.workspace('tree', create=True))
        for q in ENGINE_QUERIES:
            with self.subTest(query=q):
                out = {}
                for e, td in servers.items():
                    r = td.execute('tree', 'grep', q)
                    d = result_details(r)
                    self.assertEqual(d.get('engine'), e)
                    out[e] = (r.is_error, r.text, truncation_dict(r), d.get('matches'))
                self.assertFalse(out['rg'][0], out['rg'][1][:300])
                self.assertEqual(out['rg'], out['pcre2'])


# ---------------------------------------------------------------------------------------------
# (c) bounded memory: 1 GiB of output
# ---------------------------------------------------------------------------------------------

class TestHugeOutput(TooldBase):
    # the whole GiB is saved: room for saved output and a workspace that may hold it
    toold_kwargs = {'extra_args': ['--spill-max-mib', '2048', '--limit-disk-mib', '4096']}

    def test_one_gib_of_output(self):
        sb = 'huge'
        # 127 characters + '\n' per line: 2^30 bytes are exactly 2^23 lines, and 51,200 bytes
        # hold 400 of them (400*128-1 = 51,199), so the byte budget (not the 2000-line cap,
        # which plain `yes` output would hit first) decides the tail.
        line = '0' * 127
        cmd = "yes %s | head -c 1G" % line
        timeout_s = 120
        pid = self.td.pid
        sampler = _Sampler(pid)
        sampler.start()
        t0 = time.monotonic()
        try:
            res = self.call(sb, 'bash', {'command': cmd, 'timeout': timeout_s},
                            timeout=timeout_s + 30)
        finally:
            sampler.stop()
        elapsed = time.monotonic() - t0
        self.assertLess(elapsed, timeout_s)
        self.assertOk(res)
        d = result_details(res)
        self.assertEqual(d.get('exit_code'), 0)
        self.assertFalse(d.get('timed_out'))
        tr = truncation_dict(res)
        self.assertTrue(tr['truncated'])
        self.assertEqual(tr['by'], 'TRUNCATED_BY_BYTES')
        self.assertEqual(tr['total_bytes'], GiB)
        self.assertEqual(tr['total_lines'], GiB // 128)
        self.assertEqual(tr['shown_last_line'], GiB // 128)
        self.assertEqual(tr['shown_first_line'], GiB // 128 - 399)
        self.assertEqual(tr['next_offset'], GiB // 128 - 399)
        marker, _, tail = res.text.partition('\n')
        self.assertTrue(marker.startswith('[Output truncated'), marker)
        self.assertIn(d['spill_path'], marker)
        self.assertIn('offset=%d' % (GiB // 128 - 399), marker)
        self.assertEqual(tail, '\n'.join([line] * 400))
        self.assertEqual(len(tail.encode()), 51199)
        spill = os.path.join(self.td.workspace(sb), d['spill_path'])
        self.assertEqual(os.path.getsize(spill), GiB)
        with open(spill, 'rb') as f:
            f.seek(GiB - 256)
            self.assertEqual(f.read(), ((line + '\n') * 2).encode())
        rss_mib = sampler.max_rss_kib / 1024.0
        hwm_mib = sampler.max_hwm_kib / 1024.0
        self.assertGreater(sampler.samples, 5)
        self.assertLess(rss_mib, 64, 'toold VmRSS reached %.1f MiB' % rss_mib)
        self.assertLess(hwm_mib, 64, 'toold VmHWM reached %.1f MiB' % hwm_mib)
        os.unlink(spill)


# ---------------------------------------------------------------------------------------------
# (d) bad input
# ---------------------------------------------------------------------------------------------

class TestBadInput(TooldBase):

    def test_bad_arguments_are_error_results(self):
        sb = 'bad'
        cases = [
            ('read', '{"path": "a.txt"', ['json']),
            ('read', '{"path": "a.txt"} trailing', ['json']),
            ('read', '{"path": "a", "path": "b"}', ['json']),
            ('read', 'null', ['object']),
            ('read', '{"path": ["a"]}', ['path', 'string']),
            ('bash', '{"command": 42}', ['command', 'string']),
            ('bash', '{"command": "echo", "timeout": "soon"}', ['timeout', 'number']),
            ('edit', '{"path": "a", "oldText": "x", "newText": "y", "replaceAll": 1}',
             ['replaceAll', 'boolean']),
            ('grep', '{"pattern": "a(b"}', ['regular expression', 'position 3']),
            ('grep', '{"pattern": "[z"}', ['regular expression', 'position']),
            ('bash', '{"command": "echo", "timeout": -1}', ['timeout']),
            ('bash', '{"command": "echo", "timeout": 0}', ['timeout']),
            ('read', '{"path": "a\\u0000b"}', ['json']),
            ('nosuchtool', '{}', ['nosuchtool']),
            ('', '{}', []),
        ]
        for name, args, words in cases:
            with self.subTest(tool=name, args=args):
                res = self.call(sb, name, args)
                self.assertErrorResult(res, *words)
        self.assertHealthy()

    def test_raw_nul_bytes(self):
        sb = 'nul'
        self.assertOk(self.call(sb, 'write', {'path': 'a.txt', 'content': 'secret-a\n'}))
        # a raw NUL inside the JSON text (valid UTF-8 in a protobuf string)
        for name, args in [
            ('read', '{"path": "a.txt\x00../../etc/passwd"}'),
            ('read', '{"path": "a.txt\x00"}'),
            ('write', '{"path": "b.txt\x00x", "content": "x"}'),
            ('read', '\x00{"path": "a.txt"}'),
        ]:
            with self.subTest(args=repr(args)):
                res = self.call(sb, name, args)
                self.assertErrorResult(res)
                self.assertNotIn('secret-a', res.text)
        self.assertFalse(os.path.exists(os.path.join(self.td.workspace(sb), 'b.txt')))
        # a raw NUL in the sandbox name: not a valid name
        with self.assertRaises(grpc.RpcError) as cm:
            self.call('nul\x00x', 'read', {'path': 'a.txt'})
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
        self.assertHealthy()

    def test_huge_arguments(self):
        sb = 'huge-args'
        big = 'x' * (5 * MiB)
        res = self.call(sb, 'write', {'path': 'big.txt', 'content': big})
        self.assertOk(res)
        self.assertEqual(os.path.getsize(os.path.join(self.td.workspace(sb), 'big.txt')),
                         5 * MiB)
        res = self.call(sb, 'grep', {'pattern': big})
        self.assertErrorResult(res, '65536')
        res = self.call(sb, 'bash', {'command': 'echo ' + big})
        self.assertTrue(res.is_error or 'Exit code' in res.text,
                        'a 5 MB command line neither failed nor ran: %r' % res.text[:300])
        self.assertLess(len(res.text), 100000)
        res = self.call(sb, 'edit', {'path': 'big.txt', 'oldText': big, 'newText': 'small'})
        self.assertOk(res)
        with open(os.path.join(self.td.workspace(sb), 'big.txt')) as f:
            self.assertEqual(f.read(), 'small')
        self.assertHealthy()

    def test_bad_sandbox_names(self):
        bad = ['..', '.', 'a/b', '', '../x', 'a b', 'x' * 129, 'é']
        for name in bad:
            with self.subTest(sandbox=name):
                with self.assertRaises(grpc.RpcError) as cm:
                    self.call(name, 'bash', {'command': 'echo hi'})
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertEqual(error_reason(cm.exception), 'INVALID_SANDBOX_NAME')
                self.assertTrue(cm.exception.details())
                with self.assertRaises(grpc.RpcError) as cm:
                    self.td.execute_batch([tool_call(name, 'read', {'path': 'x'})])
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertEqual(error_reason(cm.exception), 'INVALID_SANDBOX_NAME')
                with self.assertRaises(grpc.RpcError) as cm:
                    self.td.sandbox('ReadFile', sandbox=name, path='x')
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertEqual(error_reason(cm.exception), 'INVALID_SANDBOX_NAME')
        # nothing was created outside the root, and the longest valid name works
        self.assertEqual(sorted(os.listdir(self.td.dir)),
                         sorted(['root', 'toold.sock', 'toold.stderr']))
        self.assertEqual(self.call('y' * 128, 'bash', {'command': 'echo ok'}).text, 'ok')
        self.assertHealthy()

    def test_timeout_duration_validated(self):
        """ToolCall.timeout and ExecRequest.timeout: a negative or malformed Duration is
        INVALID_ARGUMENT and nothing runs; unset is no limit (the server default for Exec)."""
        marker = os.path.join(self.td.workspace('t', create=True), 'ran')
        bad = {'negative': dict(seconds=-1), 'negative nanos': dict(nanos=-5000000),
               'mixed signs': dict(seconds=1, nanos=-1), 'nanos overflow': dict(nanos=10 ** 9)}
        for what, dur in bad.items():
            with self.subTest(duration=what):
                call = tool_call('t', 'bash', {'command': 'touch ran'})
                call.timeout.seconds = dur.get('seconds', 0)
                call.timeout.nanos = dur.get('nanos', 0)
                with self.assertRaises(grpc.RpcError) as cm:
                    self.td.execute_call(call)
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertIn('timeout', cm.exception.details())
                with self.assertRaises(grpc.RpcError) as cm:
                    self.td.execute_batch([tool_call('t', 'read', {'path': 'x'}), call])
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertIn('calls[1]', cm.exception.details())
                req = sandbox_pb2.ExecRequest(sandbox='t', command='touch ran')
                req.timeout.seconds = dur.get('seconds', 0)
                req.timeout.nanos = dur.get('nanos', 0)
                c = self.td.channel.unary_unary(
                    '/cflue.v1.Sandbox/Exec',
                    request_serializer=sandbox_pb2.ExecRequest.SerializeToString,
                    response_deserializer=sandbox_pb2.ExecResponse.FromString)
                with self.assertRaises(grpc.RpcError) as cm:
                    c(req, timeout=10)
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
                self.assertFalse(os.path.exists(marker))
        # a set sub-millisecond timeout is a limit, not "unset"
        call = tool_call('t', 'bash', {'command': 'sleep 30'})
        call.timeout.nanos = 500000
        t0 = time.monotonic()
        res = self.td.execute_call(call)
        self.assertLess(time.monotonic() - t0, 20)  # not sleep's 30 s (4 of 5 was too tight)
        self.assertIn('124', res.text)
        # unset: no limit from the caller
        self.assertOk(self.call('t', 'bash', {'command': 'echo fine'}), 'fine')
        self.assertHealthy()

    def test_undecodable_request(self):
        c = self.td.channel.unary_unary('/cflue.v1.Tools/Execute',
                                        request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        with self.assertRaises(grpc.RpcError) as cm:
            c(b'\xff\xff\xff\xff\x0f garbage', timeout=10)
        self.assertIn(cm.exception.code(), (INVALID_ARGUMENT, grpc.StatusCode.INTERNAL))
        self.assertHealthy()


# ---------------------------------------------------------------------------------------------
# (e) the Sandbox service
# ---------------------------------------------------------------------------------------------

ESCAPE_CODES = (INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


class TestSandboxService(TooldBase):
    sb = 'svc'

    def sbx(self, method, **fields):
        return self.td.sandbox(method, sandbox=self.sb, **fields)

    def host(self, rel=''):
        return os.path.join(self.td.workspace(self.sb, create=True), rel)

    def test_write_read_round_trip(self):
        data = os.urandom(3 * MiB) + b'\x00\n\xff'
        resp = self.sbx('WriteFile', path='deep/er/blob.bin', data=data)
        self.assertEqual(resp.bytes_written, len(data))
        self.assertTrue(os.path.isdir(self.host('deep/er')))
        self.assertEqual(self.sbx('ReadFile', path='deep/er/blob.bin').data, data)
        self.assertEqual(self.sbx('ReadFile', path='./deep/../deep/er/blob.bin').data, data)
        self.assertEqual(self.sbx('ReadFile', path=self.host('deep/er/blob.bin')).data, data)
        # overwrite, with a mode for a new file
        self.sbx('WriteFile', path='deep/er/blob.bin', data=b'small')
        self.assertEqual(self.sbx('ReadFile', path='deep/er/blob.bin').data, b'small')
        self.sbx('WriteFile', path='x.sh', data=b'#!/bin/sh\n', mode=0o755)
        self.assertEqual(os.stat(self.host('x.sh')).st_mode & 0o777, 0o755)
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadFile', path='missing.bin')
        self.assertEqual(cm.exception.code(), NOT_FOUND)

    def test_stat(self):
        self.sbx('WriteFile', path='five.txt', data=b'12345')
        os.symlink('five.txt', self.host('link.txt'))
        st = self.sbx('Stat', path='five.txt')
        self.assertEqual((st.name, st.type, st.size),
                         ('five.txt', sandbox_pb2.FILE_TYPE_REGULAR, 5))
        self.assertTrue(st.HasField('modify_time'))
        mtime_ns = os.stat(self.host('five.txt')).st_mtime_ns
        self.assertEqual(st.modify_time.ToNanoseconds(), mtime_ns)
        self.assertEqual(self.sbx('Stat', path='link.txt').type, sandbox_pb2.FILE_TYPE_SYMLINK)
        self.sbx('Mkdir', path='d')
        self.assertEqual(self.sbx('Stat', path='d').type, sandbox_pb2.FILE_TYPE_DIRECTORY)
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Stat', path='nope')
        self.assertEqual(cm.exception.code(), NOT_FOUND)

    def test_read_dir_sorted(self):
        for name in ['b.txt', 'a.txt', 'C.txt', '.hidden', '_u']:
            self.sbx('WriteFile', path='dir/' + name, data=b'x')
        self.sbx('Mkdir', path='dir/sub')
        entries = self.sbx('ReadDir', path='dir').entries
        names = [e.name for e in entries]
        self.assertEqual(names, sorted(['b.txt', 'a.txt', 'C.txt', '.hidden', '_u', 'sub'],
                                       key=lambda s: s.encode()))
        types = {e.name: e.type for e in entries}
        self.assertEqual(types['sub'], sandbox_pb2.FILE_TYPE_DIRECTORY)
        self.assertEqual(types['a.txt'], sandbox_pb2.FILE_TYPE_REGULAR)
        self.assertTrue(all(e.HasField('modify_time') for e in entries))
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadDir', path='dir/a.txt')
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
        self.assertEqual(error_reason(cm.exception), 'NOT_A_DIRECTORY')

    def test_names_that_are_not_utf8_are_shown_not_fatal(self):
        # a command may name a file with any bytes; a listing still reaches every client (a
        # protobuf string must be UTF-8), the bad bytes shown as U+FFFD
        os.makedirs(self.host('odd/.agents/skills/ok'), exist_ok=True)
        for name in (b'bad\xff.txt', b'good.txt'):
            with open(os.path.join(self.host('odd').encode(), name), 'w') as f:
                f.write('x')
        os.makedirs(os.path.join(self.host('odd/.agents/skills').encode(), b'sk\xfe'))
        for d in (b'ok', b'sk\xfe'):
            with open(os.path.join(self.host('odd/.agents/skills').encode(), d, b'SKILL.md'),
                      'w') as f:
                f.write('s')
        self.assertEqual([e.name for e in self.sbx('ReadDir', path='odd').entries],
                         ['.agents', 'bad\ufffd.txt', 'good.txt'])
        g = self.sbx('Glance', cwd='odd', max_entries=10, skills_dir='.agents/skills',
                     max_skills=10)
        self.assertEqual([e.name for e in g.entries], ['.agents', 'bad\ufffd.txt', 'good.txt'])
        self.assertEqual([k.dir for k in g.skills], ['ok'])

    def test_glance_reads_the_first_readable_note_and_lists_the_top(self):
        self.sbx('Mkdir', path='AGENTS.md')  # a directory by that name is skipped
        self.sbx('WriteFile', path='CLAUDE.md', data=b'# notes\n' + b'n' * 100)
        for i in range(5):
            self.sbx('WriteFile', path='f%d.txt' % i, data=b'x')
        g = self.sbx('Glance', files=['missing.md', 'AGENTS.md', 'CLAUDE.md', 'f0.txt'],
                     max_file_bytes=20, max_entries=3)
        self.assertEqual((g.file, g.file_data, g.file_truncated),
                         ('CLAUDE.md', (b'# notes\n' + b'n' * 100)[:20], True))
        names = sorted(os.listdir(self.host()), key=lambda s: s.encode())
        self.assertEqual([e.name for e in g.entries], names[:3])
        self.assertTrue(g.more_entries)
        self.assertEqual(g.working_directory, os.path.realpath(self.host()))
        types = {e.name: e.type for e in g.entries}
        self.assertEqual(types['AGENTS.md'], sandbox_pb2.FILE_TYPE_DIRECTORY)
        # the whole file (default limit) and the whole listing
        g = self.sbx('Glance', files=['CLAUDE.md'], max_entries=100)
        self.assertEqual((len(g.file_data), g.file_truncated, g.more_entries), (108, False, False))
        self.assertEqual(len(g.entries), len(names))
        # nothing asked: nothing read, nothing listed
        g = self.sbx('Glance')
        self.assertEqual((g.file, g.file_data, len(g.entries), len(g.tools)), ('', b'', 0, 0))
        # the tool set when asked: what Tools.List answers
        g = self.sbx('Glance', list_tools=True)
        listed = self.td.list_tools(self.sb)
        self.assertEqual(list(g.tools), list(listed.tools))
        self.assertEqual([t.name for t in g.tools],
                         ['read', 'write', 'edit', 'bash', 'grep', 'glob'])
        self.assertEqual(g.working_directory, listed.working_directory)

    def test_glance_never_reads_outside_the_sandbox(self):
        outside = os.path.join(self.td.dir, 'secret.txt')
        with open(outside, 'w') as f:
            f.write('SECRET')
        os.symlink(outside, self.host('AGENTS.md'))
        g = self.sbx('Glance', files=['AGENTS.md', '../secret.txt', outside, 'none.md'],
                     max_entries=10)
        self.assertEqual((g.file, g.file_data), ('', b''))
        self.assertEqual([e.type for e in g.entries if e.name == 'AGENTS.md'],
                         [sandbox_pb2.FILE_TYPE_SYMLINK])

    def test_glance_reads_skills(self):
        # nothing there: no skills, no error
        g = self.sbx('Glance', skills_dir='.agents/skills', max_skills=10)
        self.assertEqual((len(g.skills), g.more_skills), (0, False))
        for d in ('b-skill', 'a-skill', 'c-skill', 'no-skill-md', 'z-big'):
            self.sbx('Mkdir', path='.agents/skills/' + d, parents=True)
        for d in ('a-skill', 'b-skill', 'c-skill'):
            self.sbx('WriteFile', path='.agents/skills/%s/SKILL.md' % d, data=d.encode())
        self.sbx('WriteFile', path='.agents/skills/z-big/SKILL.md', data=b'x' * (70 << 10))
        self.sbx('WriteFile', path='.agents/skills/loose.md', data=b'not in a directory')
        outside = os.path.join(self.td.dir, 'outside-skill')
        os.makedirs(outside, exist_ok=True)
        with open(os.path.join(outside, 'SKILL.md'), 'w') as f:
            f.write('SECRET')
        os.symlink(outside, self.host('.agents/skills/linked'))
        g = self.sbx('Glance', skills_dir='.agents/skills', max_skills=100)
        self.assertEqual([(k.dir, k.path) for k in g.skills],
                         [('a-skill', '.agents/skills/a-skill/SKILL.md'),
                          ('b-skill', '.agents/skills/b-skill/SKILL.md'),
                          ('c-skill', '.agents/skills/c-skill/SKILL.md'),
                          ('z-big', '.agents/skills/z-big/SKILL.md')])
        self.assertEqual(g.skills[1].data, b'b-skill')
        self.assertEqual((len(g.skills[3].data), g.skills[3].truncated), (64 << 10, True))
        self.assertFalse(g.more_skills)
        # the first entries by name only
        g = self.sbx('Glance', skills_dir='.agents/skills', max_skills=2)
        self.assertEqual([k.dir for k in g.skills], ['a-skill', 'b-skill'])
        self.assertTrue(g.more_skills)
        # max_skills 0: none read
        g = self.sbx('Glance', skills_dir='.agents/skills')
        self.assertEqual(len(g.skills), 0)

    def test_glance_refuses_bad_limits(self):
        for fields in ({'files': ['a'] * 9}, {'max_file_bytes': -1},
                       {'max_file_bytes': (64 << 20) + 1}, {'max_entries': -1},
                       {'max_entries': 10001}, {'max_skills': -1}, {'max_skills': 257}):
            with self.assertRaises(grpc.RpcError) as cm:
                self.sbx('Glance', **fields)
            self.assertEqual(cm.exception.code(), INVALID_ARGUMENT, fields)
        with self.assertRaises(grpc.RpcError) as cm:
            self.td.sandbox('Glance', sandbox='../escape', files=['x'])
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)

    def test_file_errors_have_reasons(self):
        self.sbx('Mkdir', path='adir')
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadFile', path='adir')
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (INVALID_ARGUMENT, 'IS_A_DIRECTORY'))
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('WriteFile', path='adir', data=b'x')
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (INVALID_ARGUMENT, 'IS_A_DIRECTORY'))
        self.sbx('WriteFile', path='f.txt', data=b'x')
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Exec', command='pwd', cwd='f.txt')
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (INVALID_ARGUMENT, 'NOT_A_DIRECTORY'))
        with open(self.host('huge.bin'), 'wb') as f:  # sparse: costs no disk
            f.truncate(64 * MiB + 1)
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadFile', path='huge.bin')
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 'FILE_TOO_LARGE'))
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadFile', path='missing')
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (NOT_FOUND, 'NOT_FOUND'))

    def test_read_file_max_bytes(self):
        self.sbx('WriteFile', path='ten.txt', data=b'0123456789')
        self.assertEqual(self.sbx('ReadFile', path='ten.txt', max_bytes=10).data, b'0123456789')
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('ReadFile', path='ten.txt', max_bytes=9)
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 'FILE_TOO_LARGE'))
        self.assertIn('over 9 bytes', cm.exception.details())
        for bad in (-1, 64 * MiB + 1):
            with self.assertRaises(grpc.RpcError) as cm:
                self.sbx('ReadFile', path='ten.txt', max_bytes=bad)
            self.assertEqual(cm.exception.code(), INVALID_ARGUMENT, bad)

    def test_mkdir_and_remove(self):
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Mkdir', path='m/n/o')
        self.assertEqual(cm.exception.code(), NOT_FOUND)
        self.sbx('Mkdir', path='m/n/o', parents=True)
        self.assertTrue(os.path.isdir(self.host('m/n/o')))
        self.sbx('Mkdir', path='m/n/o', parents=True)  # existing: fine with parents
        with self.assertRaises(grpc.RpcError):
            self.sbx('Mkdir', path='m/n/o')  # existing without parents: an error
        self.sbx('WriteFile', path='m/n/o/f.txt', data=b'f')
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Remove', path='m')  # not empty, not recursive
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)),
                         (grpc.StatusCode.FAILED_PRECONDITION, 'DIRECTORY_NOT_EMPTY'))
        self.assertTrue(os.path.exists(self.host('m/n/o/f.txt')))
        self.sbx('Remove', path='m/n/o/f.txt')
        self.assertFalse(os.path.exists(self.host('m/n/o/f.txt')))
        self.sbx('WriteFile', path='m/n/o/g.txt', data=b'g')
        self.sbx('Remove', path='m', recursive=True)
        self.assertFalse(os.path.exists(self.host('m')))
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Remove', path='m')
        self.assertEqual(cm.exception.code(), NOT_FOUND)

    def test_exec(self):
        os.makedirs(self.host('data'))
        r = self.sbx('Exec', command='pwd')
        self.assertEqual(r.stdout, (self.host('') .rstrip('/') + '\n').encode())
        self.assertEqual(r.exit_code, 0)
        r = self.sbx('Exec', command='pwd', cwd='data')
        self.assertEqual(r.stdout, (self.host('data') + '\n').encode())
        r = self.sbx('Exec', command='echo "$LAYER/$PATH_SET"; cat',
                     env={'LAYER': 'command', 'PATH_SET': 'yes'}, stdin=b'from stdin\n')
        self.assertEqual(r.stdout, b'command/yes\nfrom stdin\n')
        # stdin larger than a pipe holds reaches the command whole, as it reads; one that
        # reads a part, or none, ends as usual
        big = bytes(range(256)) * 4096 * 3  # 3 MiB
        r = self.sbx('Exec', command='sleep 0.3; wc -c', stdin=big)
        self.assertEqual((r.stdout.strip(), r.exit_code), (str(len(big)).encode(), 0))
        r = self.sbx('Exec', command='head -c 5 | od -An -tx1', stdin=big)
        self.assertEqual((r.stdout.split(), r.exit_code), ([b'00', b'01', b'02', b'03', b'04'], 0))
        r = self.sbx('Exec', command='echo ignored', stdin=big, timeout_ms=20000)
        self.assertEqual((r.stdout, r.exit_code, r.timed_out), (b'ignored\n', 0, False))
        r = self.sbx('Exec', command="printf 'stdout text'; printf 'stderr text' >&2; exit 7")
        self.assertEqual(r.exit_code, 7)
        self.assertFalse(r.timed_out)
        both = r.stdout + r.stderr
        self.assertIn(b'stdout text', both)
        self.assertIn(b'stderr text', both)
        t0 = time.monotonic()
        r = self.sbx('Exec', command='echo before; sleep 30', timeout_ms=500)
        self.assertLess(time.monotonic() - t0, 20)  # not sleep's 30 s (4 of 5 was too tight)
        self.assertEqual((r.exit_code, r.timed_out), (124, True))
        self.assertIn(b'before', r.stdout)
        r = self.sbx('Exec', command='printf "\\x00\\xff"')
        self.assertEqual(r.stdout, b'\x00\xff')
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Exec', command='pwd', cwd='no/such/dir')
        self.assertEqual(cm.exception.code(), NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as cm:
            self.sbx('Exec', command='')
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)

    def test_escapes_refused(self):
        outside = os.path.join(self.td.dir, 'outside')
        os.makedirs(outside)
        canary = os.path.join(outside, 'canary.txt')
        with open(canary, 'w') as f:
            f.write('canary\n')
        ws = self.host('')
        os.symlink(canary, os.path.join(ws, 'outlink'))
        os.symlink(outside, os.path.join(ws, 'dirlink'))
        os.symlink('/', os.path.join(ws, 'rootlink'))
        rel_canary = os.path.relpath(canary, ws)
        attempts = [
            ('ReadFile', {'path': '../../outside/canary.txt'}),
            ('ReadFile', {'path': rel_canary}),
            ('ReadFile', {'path': canary}),
            ('ReadFile', {'path': '/etc/passwd'}),
            ('ReadFile', {'path': 'outlink'}),
            ('ReadFile', {'path': 'dirlink/canary.txt'}),
            ('ReadFile', {'path': 'rootlink/etc/passwd'}),
            ('WriteFile', {'path': rel_canary, 'data': b'pwned'}),
            ('WriteFile', {'path': canary, 'data': b'pwned'}),
            ('WriteFile', {'path': 'dirlink/new.txt', 'data': b'pwned'}),
            ('WriteFile', {'path': 'dirlink/a/b/new.txt', 'data': b'pwned'}),
            ('WriteFile', {'path': 'rootlink' + outside + '/new.txt', 'data': b'pwned'}),
            ('WriteFile', {'path': 'outlink', 'data': b'pwned'}),
            ('Stat', {'path': '../..'}),
            ('Stat', {'path': 'dirlink/canary.txt'}),
            ('ReadDir', {'path': 'dirlink'}),
            ('ReadDir', {'path': '/'}),
            ('Mkdir', {'path': 'dirlink/newdir', 'parents': True}),
            ('Mkdir', {'path': outside + '/newdir'}),
            ('Remove', {'path': 'dirlink/canary.txt'}),
            ('Remove', {'path': rel_canary}),
            ('Remove', {'path': '..', 'recursive': True}),
            ('Exec', {'command': 'pwd', 'cwd': '../..'}),
            ('Exec', {'command': 'pwd', 'cwd': 'dirlink'}),
            ('Exec', {'command': 'pwd', 'cwd': '/tmp'}),
        ]
        for method, fields in attempts:
            with self.subTest(method=method, fields={k: v for k, v in fields.items()
                                                     if k != 'data'}):
                with self.assertRaises(grpc.RpcError) as cm:
                    resp = self.sbx(method, **fields)
                    raise AssertionError('%s %r succeeded: %r' % (method, fields,
                                                                   str(resp)[:200]))
                self.assertIn(cm.exception.code(), ESCAPE_CODES + (NOT_FOUND,),
                              cm.exception.details())
                if cm.exception.code() == INVALID_ARGUMENT:
                    self.assertEqual(error_reason(cm.exception), 'PATH_OUTSIDE_SANDBOX',
                                     cm.exception.details())
                with open(canary) as f:
                    self.assertEqual(f.read(), 'canary\n')
                self.assertEqual(sorted(os.listdir(outside)), ['canary.txt'])
        # removing the link itself stays inside: the target survives
        self.sbx('Remove', path='outlink')
        self.assertFalse(os.path.lexists(os.path.join(ws, 'outlink')))
        with open(canary) as f:
            self.assertEqual(f.read(), 'canary\n')

    def test_raw_nul_in_path(self):
        self.sbx('WriteFile', path='a.txt', data=b'secret')
        for method, fields in [('ReadFile', {'path': 'a.txt\x00../../etc/passwd'}),
                               ('WriteFile', {'path': 'b.txt\x00c', 'data': b'x'}),
                               ('Stat', {'path': 'a.txt\x00'})]:
            with self.subTest(method=method):
                with self.assertRaises(grpc.RpcError) as cm:
                    self.sbx(method, **fields)
                self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
        self.assertFalse(os.path.exists(self.host('b.txt')))


class TestCallWorkingDirectory(TooldBase):
    """ToolCall.cwd, GlanceRequest.cwd and ListToolsRequest.cwd: a call scoped to a directory
    of the sandbox (a subagent given part of the workspace)."""
    sb = 'scoped'

    def setUp(self):
        super().setUp()
        self.root = os.path.realpath(self.td.workspace(self.sb, create=True))
        os.makedirs(os.path.join(self.root, 'pkg', 'sub'))
        with open(os.path.join(self.root, 'top.txt'), 'w') as f:
            f.write('needle at the top\n')
        with open(os.path.join(self.root, 'pkg', 'mod.py'), 'w') as f:
            f.write('needle in pkg\n')
        with open(os.path.join(self.root, 'pkg', 'AGENTS.md'), 'w') as f:
            f.write('pkg notes')

    def run_in(self, cwd, name, args):
        call = tool_call(self.sb, name, args)
        call.cwd = cwd
        return self.td.execute_call(call)

    def test_paths_and_commands_start_in_the_call_directory(self):
        self.assertOk(self.run_in('pkg', 'write', {'path': 'new.txt', 'content': 'made'}))
        with open(os.path.join(self.root, 'pkg', 'new.txt')) as f:
            self.assertEqual(f.read(), 'made')
        self.assertOk(self.run_in('pkg', 'read', {'path': 'mod.py'}), 'needle in pkg')
        self.assertOk(self.run_in('pkg', 'read', {'path': '../top.txt'}), 'needle at the top')
        self.assertOk(self.run_in('pkg/sub', 'read', {'path': os.path.join(self.root, 'top.txt')}),
                      'needle at the top')  # an absolute path inside the sandbox stays
        self.assertOk(self.run_in('pkg', 'edit', {'path': 'new.txt', 'oldText': 'made',
                                                  'newText': 'edited'}))
        with open(os.path.join(self.root, 'pkg', 'new.txt')) as f:
            self.assertEqual(f.read(), 'edited')
        res = self.run_in('pkg', 'bash', {'command': 'pwd; ls'})
        self.assertOk(res)
        self.assertEqual(res.text.split('\n')[0], os.path.join(self.root, 'pkg'))
        self.assertIn('mod.py', res.text)
        self.assertEqual(self.run_in(os.path.join(self.root, 'pkg'), 'bash',
                                     {'command': 'pwd'}).text, os.path.join(self.root, 'pkg'))

    def test_search_results_are_relative_to_the_call_directory(self):
        res = self.run_in('pkg', 'grep', {'pattern': 'needle'})
        self.assertOk(res)
        self.assertEqual(res.text, 'mod.py:1:needle in pkg')
        res = self.run_in('pkg', 'grep', {'pattern': 'needle', 'path': '..'})
        self.assertEqual(sorted(res.text.split('\n')),
                         ['../top.txt:1:needle at the top', 'mod.py:1:needle in pkg'])
        res = self.run_in('pkg/sub', 'glob', {'pattern': '*.txt', 'path': '../..'})
        self.assertEqual(res.text, '../../top.txt')
        res = self.run_in('pkg/sub', 'glob', {'pattern': '*.py', 'path': '..'})
        self.assertEqual(res.text, '../mod.py')
        res = self.run_in('', 'glob', {'pattern': '*.py'})
        self.assertEqual(res.text, 'pkg/mod.py')

    def test_a_working_directory_that_cannot_be_used_is_an_error_result(self):
        outside = os.path.join(self.td.dir, 'elsewhere')
        os.makedirs(outside, exist_ok=True)
        os.symlink(outside, os.path.join(self.root, 'link'))
        for cwd in ('missing', 'top.txt', '..', '/etc', 'link'):
            with self.subTest(cwd=cwd):
                res = self.run_in(cwd, 'bash', {'command': 'touch ran-%d' % len(cwd)})
                self.assertErrorResult(res, 'working directory')
        self.assertEqual(os.listdir(outside), [])
        self.assertFalse([n for n in os.listdir(self.root) if n.startswith('ran-')])

    def test_glance_and_list_look_from_the_directory(self):
        os.makedirs(os.path.join(self.root, 'pkg', '.agents', 'skills', 'tidy'))
        with open(os.path.join(self.root, 'pkg', '.agents', 'skills', 'tidy', 'SKILL.md'),
                  'w') as f:
            f.write('tidy')
        g = self.td.sandbox('Glance', sandbox=self.sb, cwd='pkg', files=['AGENTS.md'],
                            max_entries=10, skills_dir='.agents/skills', max_skills=5,
                            list_tools=True)
        self.assertTrue(g.cwd_applied)
        self.assertEqual(g.working_directory, os.path.join(self.root, 'pkg'))
        self.assertEqual((g.file, g.file_data), ('AGENTS.md', b'pkg notes'))
        self.assertEqual([e.name for e in g.entries], ['.agents', 'AGENTS.md', 'mod.py', 'sub'])
        self.assertEqual([k.path for k in g.skills], ['.agents/skills/tidy/SKILL.md'])
        plain = self.td.sandbox('Glance', sandbox=self.sb, max_entries=10)
        self.assertFalse(plain.cwd_applied)
        self.assertEqual(plain.working_directory, self.root)
        with self.assertRaises(grpc.RpcError) as cm:
            self.td.sandbox('Glance', sandbox=self.sb, cwd='nowhere')
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        c = self.td._current_channel().unary_unary(
            '/cflue.v1.Tools/List', request_serializer=tools_pb2.ListToolsRequest.SerializeToString,
            response_deserializer=tools_pb2.ListToolsResponse.FromString)
        listed = c(tools_pb2.ListToolsRequest(sandbox=self.sb, cwd='pkg/sub'), timeout=10)
        self.assertTrue(listed.cwd_applied)
        self.assertEqual(listed.working_directory, os.path.join(self.root, 'pkg', 'sub'))

    def test_batch_locks_one_file_named_from_two_directories(self):
        with open(os.path.join(self.root, 'pkg', 'n.txt'), 'w') as f:
            f.write('0')
        calls = []
        for i in range(10):
            call = tool_call(self.sb, 'edit', {'path': 'n.txt' if i % 2 else 'pkg/n.txt',
                                               'oldText': str(i), 'newText': str(i + 1)})
            call.cwd = 'pkg' if i % 2 else ''
            calls.append(call)
        results = self.td.execute_batch(calls)
        self.assertTrue(all(not r.result.is_error for r in results),
                        [r.result.text for r in results])
        with open(os.path.join(self.root, 'pkg', 'n.txt')) as f:
            self.assertEqual(f.read(), '10')


class TestReadDirPaging(TooldBase):
    """Sandbox.ReadDir pages: sorted by name (bytewise), the token names the last entry and
    belongs to one directory of one sandbox, and a directory that changes between pages never
    repeats or skips an entry that existed throughout."""

    sb = 'pages'

    def host(self, rel=''):
        return os.path.join(self.td.workspace(self.sb, create=True), rel)

    def read_dir(self, path, page_size=0, page_token='', sandbox=None):
        return self.td.sandbox('ReadDir', sandbox=sandbox or self.sb, path=path,
                               page_size=page_size, page_token=page_token)

    def all_pages(self, path, page_size):
        names, token, pages = [], '', 0
        while True:
            resp = self.read_dir(path, page_size, token)
            pages += 1
            self.assertLessEqual(len(resp.entries), page_size)
            names += [e.name for e in resp.entries]
            token = resp.next_page_token
            if not token:
                return names, pages

    def make_files(self, rel, names):
        d = self.host(rel)
        os.makedirs(d, exist_ok=True)
        for n in names:
            with open(os.path.join(d, n), 'wb'):
                pass

    def assertReason(self, cm, code, reason):
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)), (code, reason),
                         cm.exception.details())

    def test_pages_make_one_listing(self):
        rng = random.Random(8)
        alphabet = 'abcXYZ019._-é'
        names = set()
        while len(names) < 10000:
            names.add(''.join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
        names.discard('.')
        names.discard('..')
        while len(names) < 10000:
            names.add('n%d' % len(names))
        self.make_files('big', names)
        want = sorted(names, key=lambda n: n.encode())
        one = self.read_dir('big', page_size=10000)
        self.assertEqual([e.name for e in one.entries], want)
        self.assertEqual(one.next_page_token, '')
        paged, pages = self.all_pages('big', 1000)
        self.assertEqual(paged, want)
        self.assertEqual(pages, 10)
        # page_size 0 is 1000; more than 10000 is coerced to 10000
        first = self.read_dir('big')
        self.assertEqual(len(first.entries), 1000)
        self.assertTrue(first.next_page_token)
        self.make_files('big', ['\xfflast'])  # U+00FF: C3 BF, after every other name
        capped = self.read_dir('big', page_size=50000)
        self.assertEqual(len(capped.entries), 10000)
        rest = self.read_dir('big', page_size=50000, page_token=capped.next_page_token)
        self.assertEqual([e.name for e in rest.entries], ['\xfflast'])
        self.assertEqual(rest.next_page_token, '')

    def test_token_belongs_to_its_directory(self):
        self.make_files('d1', ['a', 'b', 'c'])
        self.make_files('d2', ['a', 'b', 'c'])
        os.makedirs(os.path.join(self.td.workspace('other-sandbox', create=True), 'd1'))
        token = self.read_dir('d1', page_size=1).next_page_token
        self.assertTrue(token)
        # the same directory written another way takes it
        self.assertEqual([e.name for e in self.read_dir('./d1/', 5, token).entries], ['b', 'c'])
        for path, sandbox in (('d2', None), ('.', None), ('d1', 'other-sandbox')):
            with self.subTest(path=path, sandbox=sandbox):
                with self.assertRaises(grpc.RpcError) as cm:
                    self.read_dir(path, 1, token, sandbox=sandbox)
                self.assertReason(cm, INVALID_ARGUMENT, 'INVALID_PAGE_TOKEN')
        for garbage in ('zz', token[:-1], token + '00', token.upper(), 'x' * 700):
            with self.subTest(token=garbage[:20]):
                with self.assertRaises(grpc.RpcError) as cm:
                    self.read_dir('d1', 1, garbage)
                self.assertReason(cm, INVALID_ARGUMENT, 'INVALID_PAGE_TOKEN')
        with self.assertRaises(grpc.RpcError) as cm:
            self.read_dir('d1', -1)
        self.assertEqual(cm.exception.code(), INVALID_ARGUMENT)
        self.assertHealthy()

    def test_memory_bounded_by_page(self):
        """A page of a directory of 200,000 entries costs toold what the page holds, not what
        the directory holds (collecting every entry would take tens of MB)."""
        d = self.host('huge')
        os.makedirs(d)
        for i in range(200000):
            os.close(os.open(os.path.join(d, 'entry-with-a-longish-name-%08d' % i),
                             os.O_CREAT | os.O_WRONLY, 0o644))
        self.read_dir('.', 10)  # warm up the handler path
        before = _kib(_proc_status(self.td.pid)['VmHWM'])
        resp = self.read_dir('huge', 10)
        self.assertEqual([e.name for e in resp.entries],
                         ['entry-with-a-longish-name-%08d' % i for i in range(10)])
        resp = self.read_dir('huge', 10, resp.next_page_token)
        self.assertEqual(resp.entries[0].name, 'entry-with-a-longish-name-00000010')
        grown = _kib(_proc_status(self.td.pid)['VmHWM']) - before
        self.assertLess(grown, 8 * 1024, 'peak RSS grew by %d KiB for a 10-entry page' % grown)

    def test_changes_between_pages(self):
        names = ['n%03d' % i for i in range(100)]
        self.make_files('live', names)
        d = self.host('live')
        seen, token = [], ''
        resp = self.read_dir('live', 10)
        seen += [e.name for e in resp.entries]
        token = resp.next_page_token
        self.assertEqual(seen, names[:10])
        removed = {'n005', 'n015', 'n050', 'n099'}  # one already listed, three not yet
        for n in removed:
            os.unlink(os.path.join(d, n))
        added = ['a000', 'n0095', 'n0505', 'zzz']  # one before the position, three after
        self.make_files('live', added)
        while token:
            resp = self.read_dir('live', 10, token)
            seen += [e.name for e in resp.entries]
            token = resp.next_page_token
        self.assertEqual(len(seen), len(set(seen)), 'an entry was listed twice')
        self.assertEqual(seen, sorted(seen, key=lambda n: n.encode()))
        throughout = [n for n in names if n not in removed]
        self.assertEqual([n for n in seen if n in throughout], throughout)
        self.assertFalse((removed - {'n005'}) & set(seen))
        self.assertNotIn('a000', seen)
        for n in ('n0095', 'n0505', 'zzz'):
            self.assertIn(n, seen)
        # a directory emptied under a token: an empty last page
        token = self.read_dir('live', 3).next_page_token
        for n in os.listdir(d):
            os.unlink(os.path.join(d, n))
        resp = self.read_dir('live', 3, token)
        self.assertEqual((list(resp.entries), resp.next_page_token), ([], ''))


# ---------------------------------------------------------------------------------------------
# (f) the bwrap driver
# ---------------------------------------------------------------------------------------------

def _bwrap_works():
    try:
        return subprocess.run(['bwrap', '--ro-bind', '/', '/', 'true'],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


BWRAP_OK = _bwrap_works()


@unittest.skipUnless(BWRAP_OK, 'bwrap --ro-bind / / true does not work on this machine')
class TestBwrapDriver(TooldBase):
    toold_kwargs = {'driver': 'bwrap'}
    sb = 'bw'

    def bash(self, command, **kw):
        res = self.call(self.sb, 'bash', {'command': command}, **kw)
        self.assertFalse(res.is_error, res.text)
        return res

    def test_workspace_writable(self):
        res = self.bash('echo inside > made.txt && cat made.txt && pwd')
        self.assertEqual(res.text, 'inside\n' + self.td.workspace(self.sb))
        with open(os.path.join(self.td.workspace(self.sb), 'made.txt')) as f:
            self.assertEqual(f.read(), 'inside\n')

    def test_system_read_only(self):
        for target in ['/etc/cflue-bwrap-test', '/usr/cflue-bwrap-test']:
            with self.subTest(target=target):
                res = self.bash('touch %s; echo "rc=$?"' % target)
                self.assertIn('rc=1', res.text)
                self.assertIn('Read-only file system', res.text)
                self.assertFalse(os.path.exists(target))
        res = self.bash('echo x > /tmp/cflue-bwrap-tmp && cat /tmp/cflue-bwrap-tmp')
        self.assertEqual(res.text, 'x')
        self.assertFalse(os.path.exists('/tmp/cflue-bwrap-tmp'))
        # toold's other files (its root, outside this workspace) are read-only too
        other = self.td.workspace('other', create=True)
        res = self.bash('touch %s/x; echo "rc=$?"' % other)
        self.assertIn('rc=1', res.text)
        self.assertFalse(os.path.exists(os.path.join(other, 'x')))

    def test_no_network(self):
        res = self.bash("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        self.assertEqual(res.text.split(), ['lo'])
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(('127.0.0.1', 0))
        srv.listen(5)
        srv.settimeout(0.5)
        port = srv.getsockname()[1]
        try:
            res = self.bash('(exec 3<>/dev/tcp/127.0.0.1/%d && echo connected) 2>/dev/null '
                            '|| echo refused' % port)
            self.assertEqual(res.text, 'refused')
            with self.assertRaises(socket.timeout):
                conn, _ = srv.accept()
                conn.close()
        finally:
            srv.close()

    def test_own_pid_namespace(self):
        res = self.bash('echo $$')
        self.assertLess(int(res.text), 10)
        res = self.bash('ps -eo pid=,comm=')
        comms = [line.split(None, 1)[1] for line in res.text.splitlines() if line.strip()]
        self.assertNotIn('toold', comms)
        self.assertLess(len(comms), 10, res.text)
        res = self.bash('kill -0 %d 2>/dev/null && echo visible || echo invisible' % self.td.pid)
        # the pid may exist inside by chance only if tiny; toold's own pid is not small here
        if self.td.pid > 10:
            self.assertEqual(res.text, 'invisible')

    def test_background_child_killed(self):
        res = self.bash('sleep 876.5 & echo started')
        self.assertEqual(res.text, 'started')
        self.assertEqual(wait_no_process(['sleep', '876.5']), [])
        res = self.call(self.sb, 'bash', {'command': 'sleep 876.5 & sleep 876.5', 'timeout': 1})
        self.assertEqual(result_details(res).get('exit_code'), 124)
        self.assertEqual(wait_no_process(['sleep', '876.5']), [])
        self.assertEqual(wait_no_zombies(self.td.pid), [])

    def test_grep_and_files_under_bwrap(self):
        self.assertFalse(self.call(self.sb, 'write', {'path': 'g/a.txt',
                                                      'content': 'needle\n'}).is_error)
        res = self.call(self.sb, 'grep', {'pattern': 'needle'})
        self.assertEqual(res.text, 'g/a.txt:1:needle')
        r = self.td.sandbox('Exec', sandbox=self.sb, command='cat /proc/net/dev | wc -l')
        self.assertEqual(r.exit_code, 0)
        self.assertEqual(r.stdout.strip(), b'3')


# ---------------------------------------------------------------------------------------------
# (g) process hygiene
# ---------------------------------------------------------------------------------------------

class TestProcessHygiene(TooldBase):

    def test_timeout_kills_everything_and_reaps(self):
        sb = 'hyg'
        t0 = time.monotonic()
        res = self.call(sb, 'bash', {'command': 'sleep 1000 & sleep 1000', 'timeout': 1})
        self.assertLess(time.monotonic() - t0, 20)  # the 1 s limit, not sleep's 1000 s
        self.assertFalse(res.is_error)
        d = result_details(res)
        self.assertEqual((d.get('exit_code'), d.get('timed_out')), (124, True))
        self.assertIn('124', res.text)
        self.assertEqual(wait_no_process(['sleep', '1000']), [])
        # a few more calls of every kind that spawn processes
        self.call(sb, 'bash', {'command': 'sleep 0.1 & echo x; (sleep 0.2 &)'})
        self.call(sb, 'grep', {'pattern': 'x'})
        self.td.sandbox('Exec', sandbox=sb, command='sleep 1000 & sleep 1000', timeout_ms=300)
        self.td.sandbox('Exec', sandbox=sb, command='true')
        self.assertEqual(wait_no_process(['sleep', '1000']), [])
        self.assertEqual(wait_no_zombies(self.td.pid), [])

    def test_cancelled_call_kills_its_command(self):
        sb = 'cancel'
        with self.assertRaises(grpc.RpcError) as cm:
            self.call(sb, 'bash', {'command': 'sleep 1000'}, timeout=1)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(wait_no_process(['sleep', '1000']), [])
        self.assertEqual(wait_no_zombies(self.td.pid), [])
        self.assertHealthy()

    def test_a_root_toold_makes_is_its_own_and_a_given_one_is_left_as_it_is(self):
        made = Toold(start=False)
        given = Toold(start=False)
        os.makedirs(given.root)
        os.chmod(given.root, 0o755)
        try:
            made.start()
            given.start()
            made.execute('s', 'bash', {'command': 'true'})
            self.assertEqual(os.stat(made.root).st_mode & 0o777, 0o700)
            self.assertEqual(os.stat(made.workspace('s')).st_mode & 0o777, 0o700)
            self.assertNotIn('event=root_not_private', made.stderr_text())
            self.assertEqual(os.stat(given.root).st_mode & 0o777, 0o755)
            self.assertIn('event=root_not_private', given.stderr_text())
        finally:
            made.close()
            given.close()

    def test_descriptors_toold_was_started_with_reach_no_command(self):
        # a launcher's descriptor left open (not close-on-exec) when it started toold
        r, w = os.pipe()
        os.set_inheritable(r, True)
        td = Toold(start=False)
        td.pass_fds = (r,)
        try:
            td.start()
            os.close(r)
            listing = 'ls /proc/$$/fd; true'  # the shell's own, listed by its child
            fds = td.execute('fds', 'bash', {'command': listing}).text.split()
            self.assertNotIn(str(r), fds)
            self.assertTrue(set(fds) <= {'0', '1', '2', '255'}, fds)
            out = td.sandbox('Exec', sandbox='fds', command=listing).stdout.decode().split()
            self.assertTrue(set(out) <= {'0', '1', '2', '255'}, out)
        finally:
            os.close(w)
            td.close()

    def test_cancelled_exec_kills_its_command(self):
        # Sandbox.Exec alike: not left to run to its own timeout (300 s), holding a call's place
        with self.assertRaises(grpc.RpcError) as cm:
            self.td.sandbox('Exec', sandbox='cancel', command='sleep 1000', timeout=1)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(wait_no_process(['sleep', '1000']), [])
        self.assertEqual(wait_no_zombies(self.td.pid), [])

    def test_caller_deadline_ends_command(self):
        t0 = time.monotonic()
        # 2.5 s: enough for bash to start and print under a sanitizer on a loaded machine (with
        # 800 ms it was sometimes killed before its first line, which is another test's case)
        res = self.call('deadline', 'bash', {'command': 'echo early; sleep 1000'},
                        timeout_ms=2500)
        self.assertLess(time.monotonic() - t0, 20)  # the 2.5 s deadline, not sleep's 1000 s
        self.assertFalse(res.is_error)
        self.assertTrue(res.text.startswith('early\n'))
        self.assertEqual(result_details(res).get('exit_code'), 124)
        self.assertEqual(wait_no_process(['sleep', '1000']), [])


# ---------------------------------------------------------------------------------------------
# (h) shutdown
# ---------------------------------------------------------------------------------------------

class TestShutdown(TooldBase):

    def test_sigterm_exits_zero(self):
        self.assertEqual(self.call('s', 'bash', {'command': 'echo hi'}).text, 'hi')
        self.assertEqual(self.td.terminate(), 0)

    def test_sigterm_during_a_call_exits_zero(self):
        box = {}

        def run():
            try:
                box['res'] = self.call('s', 'bash', {'command': 'sleep 1; echo done'})
            except grpc.RpcError as e:
                box['err'] = e

        t = threading.Thread(target=run)
        t.start()
        # the call's command is running (a fixed 0.3 s sleep could signal a loaded machine's
        # toold before the call reached it)
        self.assertIsNotNone(wait_descendant(self.td.pid, ['sleep', '1']), 'the call never ran')
        self.td.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.td.proc.wait(20), 0)
        t.join(20)
        self.assertEqual(wait_no_process(['sleep', '1']), [])

    def test_sigterm_lets_a_running_call_finish_within_grace(self):
        # --grace-ms (default 5 s) is "how long shutdown waits for calls": a call that ends
        # within it completes normally instead of being killed as if its caller had left.
        box = {}

        def run():
            try:
                box['res'] = self.call('s', 'bash', {'command': 'sleep 1; echo done'})
            except grpc.RpcError as e:
                box['err'] = e

        t = threading.Thread(target=run)
        t.start()
        # the call's command is running (a fixed 0.3 s sleep could signal a loaded machine's
        # toold before the call reached it)
        self.assertIsNotNone(wait_descendant(self.td.pid, ['sleep', '1']), 'the call never ran')
        self.td.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.td.proc.wait(20), 0)
        t.join(20)
        self.assertNotIn('err', box, box.get('err'))
        self.assertFalse(box['res'].is_error, box['res'].text)
        self.assertEqual(box['res'].text, 'done')


if __name__ == '__main__':
    unittest.main()
