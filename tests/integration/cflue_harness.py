"""Test harness for the storaged integration tests.

Finds the C build ($CFLUE_BUILD_DIR, default <repo>/build), puts its generated Python
message modules ($CFLUE_BUILD_DIR/py) on sys.path, and runs storaged in a fresh temporary
directory. Only the standard library, grpc and google.protobuf are used; methods are called
generically (no grpc_tools stubs).

    class MyTest(StoragedTestCase):
        def test_x(self):
            sd = self.storaged            # started lazily by the first access
            resp = admit(sd.stub, text='hi')

A StoragedTestCase prints the daemon's stderr when one of its tests fails or errors.
"""

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc

import secret_scan

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD_DIR = os.path.abspath(os.environ.get('CFLUE_BUILD_DIR') or os.path.join(REPO, 'build'))
PY_DIR = os.path.join(BUILD_DIR, 'py')
STORAGED_BIN = os.path.join(BUILD_DIR, 'storaged', 'storaged')

if PY_DIR not in sys.path:
    sys.path.insert(0, PY_DIR)

try:
    from cflue.v1 import common_pb2, store_pb2  # noqa: E402
    import health_pb2  # noqa: E402
except ImportError as e:  # pragma: no cover - reported clearly instead of a bare traceback
    raise ImportError('cannot import the generated Python modules from %s (build the project '
                      'first: cmake -S %s -B %s && cmake --build %s): %s'
                      % (PY_DIR, REPO, BUILD_DIR, BUILD_DIR, e))

MiB = 1024 * 1024
CLIENT_MAX_MESSAGE = 64 * MiB
# Bounds waits for success only (a daemon that exits early fails at once): generous, as an
# ASan/TSan build on a loaded CI machine can take well over 10 s to start
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Method name -> (request class, response class, streaming)
STORE_METHODS = {
    'Admit': (store_pb2.AdmitRequest, store_pb2.AdmitResponse, False),
    'Claim': (store_pb2.ClaimRequest, store_pb2.ClaimResponse, False),
    'Heartbeat': (store_pb2.HeartbeatRequest, store_pb2.HeartbeatResponse, False),
    'Release': (store_pb2.ReleaseRequest, store_pb2.ReleaseResponse, False),
    'MarkInputApplied': (store_pb2.MarkInputAppliedRequest, common_pb2.Submission, False),
    'Requeue': (store_pb2.FencedRequest, common_pb2.Submission, False),
    'ClaimJoinable': (store_pb2.ClaimJoinableRequest, store_pb2.ClaimJoinableResponse, False),
    'FinalizeJoin': (store_pb2.JoinRequest, common_pb2.Submission, False),
    'RevertJoin': (store_pb2.JoinRequest, common_pb2.Submission, False),
    'RequestAbort': (store_pb2.RequestAbortRequest, store_pb2.RequestAbortResponse, False),
    'Settle': (store_pb2.SettleRequest, store_pb2.SettleResponse, False),
    'ScanExpired': (store_pb2.ScanExpiredRequest, store_pb2.ListResponse, False),
    'Get': (store_pb2.GetRequest, common_pb2.Submission, False),
    'List': (store_pb2.ListRequest, store_pb2.ListResponse, False),
    'GetConversation': (store_pb2.ConversationRequest, store_pb2.Conversation, False),
    'Append': (store_pb2.AppendRequest, store_pb2.AppendResponse, False),
    'Read': (store_pb2.ReadRequest, store_pb2.ReadResponse, False),
    'Follow': (store_pb2.FollowRequest, common_pb2.Record, True),
}


def _snake(name):
    return re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()


def now_ms():
    return int(time.time() * 1000)


def channel_options(max_bytes=CLIENT_MAX_MESSAGE):
    return [
        ('grpc.max_send_message_length', max_bytes),
        ('grpc.max_receive_message_length', max_bytes),
        # reconnect quickly after a restart of the daemon
        ('grpc.initial_reconnect_backoff_ms', 50),
        ('grpc.max_reconnect_backoff_ms', 250),
        ('grpc.enable_retries', 0),
    ]


class StoreStub(object):
    """One method per cflue.v1.Store RPC: admit(req, timeout=5) ... follow(req) (iterator).

    The stub follows its Storaged across restarts (it always uses the current channel)."""

    def __init__(self, channel_getter):
        self._channel_getter = channel_getter
        self._lock = threading.Lock()
        self._channel = None
        self._callables = {}

    def _callable(self, name):
        ch = self._channel_getter()
        with self._lock:
            if ch is not self._channel:
                self._channel = ch
                self._callables = {}
            c = self._callables.get(name)
            if c is None:
                req_cls, resp_cls, streaming = STORE_METHODS[name]
                path = '/cflue.v1.Store/' + name
                if streaming:
                    c = ch.unary_stream(path, request_serializer=req_cls.SerializeToString,
                                        response_deserializer=resp_cls.FromString)
                else:
                    c = ch.unary_unary(path, request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
                self._callables[name] = c
            return c

    def raw(self, method, data, timeout=5, streaming=False, response_cls=None):
        """Calls a full method path with raw request bytes; returns the raw response bytes
        (or a list of them for a stream)."""
        ch = self._channel_getter()
        deser = response_cls.FromString if response_cls is not None else (lambda b: b)
        if streaming:
            it = ch.unary_stream(method, request_serializer=lambda b: b,
                                 response_deserializer=deser)(data, timeout=timeout)
            return list(it)
        return ch.unary_unary(method, request_serializer=lambda b: b,
                              response_deserializer=deser)(data, timeout=timeout)


def _make_method(name):
    streaming = STORE_METHODS[name][2]
    if streaming:
        def method(self, req, timeout=None, metadata=None):
            return self._callable(name)(req, timeout=timeout, metadata=metadata)
    else:
        def method(self, req, timeout=5, metadata=None, with_call=False):
            c = self._callable(name)
            if with_call:
                return c.with_call(req, timeout=timeout, metadata=metadata)
            return c(req, timeout=timeout, metadata=metadata)
    method.__name__ = _snake(name)
    method.__doc__ = '/cflue.v1.Store/%s' % name
    return method


for _name in STORE_METHODS:
    setattr(StoreStub, _snake(_name), _make_method(_name))


_LIVE = set()


@atexit.register
def _kill_leftovers():
    for sd in list(_LIVE):
        try:
            sd.kill()
        except Exception:
            pass


def _ignore_state(state):
    pass


class Daemon(object):
    """What the daemon wrappers share: start (unix socket, or TCP port 0 with --port-file) with
    stderr captured to a file, wait until grpc.health.v1 says SERVING, one channel that follows
    restarts, and SIGKILL / SIGTERM / cleanup. Subclasses set NAME and EXITED, call
    _init_daemon and define command()."""

    NAME = 'daemon'
    EXITED = RuntimeError
    LOOPBACK = '127.0.0.1'  # the address a TCP daemon is reached at (with its port file's port)
    # grpc.ChannelCredentials for a daemon serving TLS (set before start(); see tls_credentials)
    credentials = None

    def _init_daemon(self, workdir, prefix, tcp, env, extra_args):
        self.dir = workdir or tempfile.mkdtemp(prefix=prefix)
        secret_scan.watch(self.dir)
        self.tcp = tcp
        self.sock = os.path.join(self.dir, self.NAME + '.sock')
        self.port_file = os.path.join(self.dir, 'port')
        self.stderr_path = os.path.join(self.dir, self.NAME + '.stderr')
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.proc = None
        self.port = None
        self.target = None
        self.channel = None
        self.starts = 0
        self._chan_lock = threading.Lock()

    def listen_args(self):
        if self.tcp:
            return ['--listen', '127.0.0.1:0', '--port-file', self.port_file]
        return ['--listen', 'unix:' + self.sock]

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def _spawn(self):
        if self.tcp and os.path.exists(self.port_file):
            os.unlink(self.port_file)
        env = dict(os.environ)
        env.update(self.env)
        secret_scan.note_env(env)
        self.starts += 1
        with open(self.stderr_path, 'ab') as f:
            f.write(('---- start #%d: %s\n' % (self.starts, ' '.join(self.command())))
                    .encode())
            f.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=f, stderr=f, env=env,
                                         pass_fds=getattr(self, 'pass_fds', ()))

    def start(self, timeout=READY_TIMEOUT_S):
        self._spawn()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        target = self._wait_target(deadline)
        with self._chan_lock:
            if self.channel is None or target != self.target:
                old = self.channel
                self.target = target
                if self.credentials is not None:
                    self.channel = grpc.secure_channel(target, self.credentials,
                                                       options=channel_options())
                else:
                    self.channel = grpc.insecure_channel(target, options=channel_options())
                # A connectivity subscription keeps a thread polling the channel. Without
                # it, a sync client whose fail-fast calls are refused while the channel is
                # in backoff does not drive the next connection's HTTP/2 handshake, and
                # the reconnect to a (re)started daemon stalls for ~5 s.
                self.channel.subscribe(_ignore_state, try_to_connect=True)
                if old is not None:
                    old.unsubscribe(_ignore_state)
                    old.close()
        self._wait_serving(deadline, timeout)
        return self

    def _wait_target(self, deadline):
        if not self.tcp:
            return 'unix:' + self.sock
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with open(self.port_file) as f:
                    txt = f.read().strip()
                if txt:
                    self.port = int(txt)
                    return '%s:%d' % (self.LOOPBACK, self.port)
            except (IOError, ValueError):
                pass
            time.sleep(0.02)
        raise AssertionError('%s did not write its port file within the timeout\n%s'
                             % (self.NAME, self.stderr_text()))

    def _check_alive(self):
        rc = self.proc.poll()
        if rc is not None:
            _LIVE.discard(self)
            raise self.EXITED('%s exited with code %d during start-up\n%s'
                              % (self.NAME, rc, self.stderr_text()))

    def _wait_serving(self, deadline, timeout=READY_TIMEOUT_S):
        last = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                st = self.health_check('', timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                if st == SERVING:
                    return
                last = 'status %s' % st
            except grpc.RpcError as e:
                last = '%s: %s' % (e.code(), e.details())
            time.sleep(0.02)
        raise AssertionError('%s not SERVING within %.0f s (last: %s)\n%s'
                             % (self.NAME, timeout, last, self.stderr_text()))

    def _current_channel(self):
        with self._chan_lock:
            if self.channel is None:
                raise RuntimeError('%s never started' % self.NAME)
            return self.channel

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        _LIVE.discard(self)

    def terminate(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM; returns the exit code (None if it did not exit in time; then SIGKILL)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        _LIVE.discard(self)
        return self.proc.returncode

    def stop(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM and assert a graceful exit with code 0."""
        rc = self.terminate(timeout)
        if rc != 0:
            raise AssertionError('%s did not exit 0 on SIGTERM (exit code %r)\n%s'
                                 % (self.NAME, rc, self.stderr_text()))
        return rc

    def restart(self, timeout=READY_TIMEOUT_S):
        """kill -9, then start again with the same command line (and the same data)."""
        self.kill()
        return self.start(timeout)

    def close(self):
        """Kills the process (if any) and closes the channel; keeps the directory."""
        self.kill()
        self.drop_channel()

    def drop_channel(self):
        """Closes this test process's channel to the daemon (the next start makes one)."""
        with self._chan_lock:
            if self.channel is not None:
                self.channel.unsubscribe(_ignore_state)
                self.channel.close()
                self.channel = None

    def remove(self):
        self.close()
        secret_scan.discard(self.dir)

    def stderr_text(self):
        try:
            with open(self.stderr_path, 'rb') as f:
                return f.read().decode('utf-8', 'replace')
        except IOError:
            return '(no stderr captured)'

    def health_check(self, service='', timeout=5):
        c = self._current_channel().unary_unary(
            '/grpc.health.v1.Health/Check',
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        return c(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status

    def wait_health(self, service, want, timeout=60):
        """Waits until Health/Check of service answers want; False when it never did."""
        deadline = time.monotonic() + timeout
        while self.health_check(service) != want:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def health_watch(self, service='', timeout=None):
        c = self._current_channel().unary_stream(
            '/grpc.health.v1.Health/Watch',
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        return c(health_pb2.HealthCheckRequest(service=service), timeout=timeout)


class StoragedExited(Exception):
    pass


class Storaged(Daemon):
    """A storaged process in a fresh temp dir.

    tcp=False: listens on unix:<dir>/store.sock; tcp=True: 127.0.0.1:0 with --port-file.
    extra_args/env are added to the command line and the environment.
    """

    NAME = 'storaged'
    EXITED = StoragedExited

    def __init__(self, tcp=False, extra_args=(), env=None, db=None, workdir=None,
                 start=True):
        if not os.path.exists(STORAGED_BIN):
            raise unittest.SkipTest('storaged binary not built: %s' % STORAGED_BIN)
        self._init_daemon(workdir, 'cflue-it-', tcp, env, extra_args)
        self.db = db or os.path.join(self.dir, 'store.db')
        if os.path.dirname(os.path.abspath(self.db)) != os.path.abspath(self.dir):
            secret_scan.watch(self.db)
            secret_scan.watch(self.db + '-wal')
        self.stub = StoreStub(self._current_channel)
        if start:
            self.start()


    def command(self):
        return [STORAGED_BIN] + self.listen_args() + ['--db', self.db] + self.extra_args

    def run_to_exit(self, timeout=READY_TIMEOUT_S):
        """Starts the daemon expecting it to exit by itself; returns (exit code, stderr of
        this run). Fails if it is still running after timeout."""
        start_len = os.path.getsize(self.stderr_path) if os.path.exists(self.stderr_path) else 0
        self._spawn()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError('storaged still running after %.0f s\n%s'
                                 % (timeout, self.stderr_text()))
        with open(self.stderr_path, 'rb') as f:
            f.seek(start_len)
            return rc, f.read().decode('utf-8', 'replace')

# ---- /proc ----

def proc_cpu_seconds(pid):
    """utime + stime of a process (all its threads, live and exited), in seconds; 0 when it
    is gone."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def proc_status_field(pid, name):
    """A numeric field of /proc/PID/status ('Threads', 'VmRSS' in KiB); 0 when it is gone."""
    try:
        with open('/proc/%d/status' % pid) as f:
            for line in f:
                if line.startswith(name + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---- request builders ----

def message(text='Hello', attachments=()):
    m = common_pb2.Message(text=text)
    for a in attachments:
        if isinstance(a, common_pb2.Attachment):
            m.attachments.append(a)
        else:
            m.attachments.append(common_pb2.Attachment(**a))
    return m


def admit_request(agent='assistant', conv='', text='Hello', key='', source=0, metadata=None,
                  attachments=(), kind=0):
    """An AdmitRequest; kind SUBMISSION_KIND_COMPACT sends no message."""
    req = store_pb2.AdmitRequest(agent=agent, conversation_id=conv, idempotency_key=key,
                                 source=source, kind=kind)
    if kind != common_pb2.SUBMISSION_KIND_COMPACT:
        req.message.CopyFrom(message(text, attachments))
    for k, v in (metadata or {}).items():
        req.metadata[k] = v
    return req


def admit(stub, agent='assistant', conv='', text='Hello', key='', source=0, metadata=None,
          attachments=(), timeout=5, kind=0):
    """Admits a submission; returns the AdmitResponse."""
    return stub.admit(admit_request(agent, conv, text, key, source, metadata, attachments, kind),
                      timeout=timeout)


def duration(ms):
    """A google.protobuf.Duration of ms milliseconds."""
    from google.protobuf import duration_pb2
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(ms))
    return d


def timestamp(ms):
    """A google.protobuf.Timestamp of ms epoch milliseconds."""
    from google.protobuf import timestamp_pb2
    t = timestamp_pb2.Timestamp()
    t.FromMilliseconds(int(ms))
    return t


def ts_ms(ts):
    """Epoch milliseconds of a Timestamp field (0 when unset or None)."""
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return 0
    return ts.ToMilliseconds()


def error_reason(rpc_error):
    """The google.rpc.ErrorInfo reason (domain cflue.dev) of a grpc.RpcError, read from the
    'grpc-status-details-bin' trailer; '' when there is none."""
    from google.rpc import error_details_pb2, status_pb2
    trailers = rpc_error.trailing_metadata() if hasattr(rpc_error, 'trailing_metadata') else None
    for key, value in trailers or ():
        if key != 'grpc-status-details-bin':
            continue
        st = status_pb2.Status()
        st.ParseFromString(value)
        fallback = ''
        for d in st.details:
            info = error_details_pb2.ErrorInfo()
            if d.Unpack(info):
                if info.domain == 'cflue.dev':
                    return info.reason
                fallback = fallback or info.reason
        return fallback
    return ''


def claim(stub, owner='test-owner', lease_ms=30000, submission_id='', conversation_id='',
          timeout=5):
    """Claims work; returns the ClaimResponse (check HasField('submission')). lease_ms 0 or
    None leaves lease_duration unset (the server default)."""
    req = store_pb2.ClaimRequest(owner_id=owner, submission_id=submission_id,
                                 conversation_id=conversation_id)
    if lease_ms:
        req.lease_duration.CopyFrom(duration(lease_ms))
    return stub.claim(req, timeout=timeout)


def fence(submission_id, attempt_id='', epoch=0):
    return store_pb2.Fence(submission_id=submission_id, attempt_id=attempt_id, epoch=epoch)


def copy_fence(f, **changes):
    nf = store_pb2.Fence()
    nf.CopyFrom(f)
    for k, v in changes.items():
        setattr(nf, k, v)
    return nf


def settle(stub, fence_, outcome=common_pb2.OUTCOME_COMPLETED, error='', reserve_only=False,
           timeout=5, usage=None):
    """Settles; usage is a dict {input_tokens, output_tokens, cost_usd} or a Usage."""
    req = store_pb2.SettleRequest(fence=fence_, outcome=outcome, error=error,
                                  reserve_only=reserve_only)
    if usage is not None:
        req.usage.CopyFrom(usage if isinstance(usage, common_pb2.Usage)
                           else common_pb2.Usage(**usage))
    return stub.settle(req, timeout=timeout)


def settle_queued(stub, submission_id, outcome=common_pb2.OUTCOME_FAILED, error='cannot run'):
    return settle(stub, fence(submission_id), outcome, error)


# The record types (Record.body oneof) and a valid body of each, which record() starts from.
RECORD_DEFAULTS = {
    'user_message': {'text': 'hello'},
    'system_prompt': {'text': 'you are a test'},
    'assistant_delta': {'turn': 1, 'text': 'par'},
    'assistant_message': {'turn': 1, 'text': 'answer'},
    'tool_result': {'turn': 1, 'index': 0, 'tool_call_id': 'call_1', 'name': 'bash'},
    'signal': {'kind': 'note'},
    'compaction': {'summary': 'so far', 'first_kept_offset': 0,
                   'trigger': 'COMPACTION_TRIGGER_THRESHOLD'},
    'submission_settled': {'outcome': 'OUTCOME_COMPLETED'},
    'task_started': {'turn': 1, 'index': 0, 'tool_call_id': 'call_1', 'agent': 'helper',
                     'child_submission_id': 'sub_child', 'child_conversation_id': 'conv_child',
                     'depth': 1},
}


def record(type_='assistant_message', body=None, id_='', submission_id='', body_json=None):
    """A Record with a typed body. type_ is a Record.body field name; body (a dict in the JSON
    form of that message, or the message itself) overrides RECORD_DEFAULTS[type_]; keys the
    message does not have are kept as JSON in its `text` (so bodies that differ stay different).
    body_json, when given, is the body's text verbatim. Any other type_ gives a Signal of that
    kind whose text is json.dumps(body)."""
    from google.protobuf import json_format
    if body_json is not None:
        body = dict(body or {}, text=body_json)
    rec = common_pb2.Record(id=id_, submission_id=submission_id)
    if type_ not in RECORD_DEFAULTS:
        rec.signal.kind = type_
        rec.signal.text = json.dumps(body if body is not None else {})
        return rec
    target = getattr(rec, type_)
    if body is not None and not isinstance(body, dict):
        target.CopyFrom(body)
        return rec
    fields = dict(RECORD_DEFAULTS[type_])
    known = set(f.name for f in target.DESCRIPTOR.fields) | set(
        f.json_name for f in target.DESCRIPTOR.fields)
    extra = dict((k, v) for k, v in (body or {}).items() if k not in known)
    fields.update((k, v) for k, v in (body or {}).items() if k in known)
    if extra and 'text' in known:
        fields['text'] = fields.get('text', '') + json.dumps(extra, sort_keys=True)
    json_format.ParseDict(fields, target)
    return rec


def body_of(rec):
    """(type, body message) of a Record."""
    kind = rec.WhichOneof('body')
    return kind, (getattr(rec, kind) if kind else None)


def append(stub, fence_, records, timeout=10):
    return stub.append(store_pb2.AppendRequest(fence=fence_, records=records), timeout=timeout)


def read(stub, conversation_id, after_offset=-1, page_size=0, page_token='', timeout=10,
         limit=None):
    """One Read page (limit is an old name of page_size)."""
    return stub.read(store_pb2.ReadRequest(conversation_id=conversation_id,
                                           after_offset=after_offset,
                                           page_size=page_size if limit is None else limit,
                                           page_token=page_token),
                     timeout=timeout)


def poll_until(fn, timeout, interval=0.05):
    """fn()'s first true value, asking every interval seconds; after timeout seconds, fn()'s
    last (false) value."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def read_all(stub, conversation_id, after_offset=-1, page_size=1000):
    """Every record after after_offset, walking next_page_token."""
    out = []
    token = ''
    while True:
        r = read(stub, conversation_id, after_offset, page_size=page_size, page_token=token)
        out.extend(r.records)
        if not r.next_page_token:
            return out
        if r.next_page_token == token or not r.records:
            raise AssertionError('Read next_page_token did not advance')
        token = r.next_page_token


def get(stub, submission_id):
    return stub.get(store_pb2.GetRequest(submission_id=submission_id))


def get_conversation(stub, conversation_id):
    return stub.get_conversation(store_pb2.ConversationRequest(conversation_id=conversation_id))


def list_all(stub, page=100, **filters):
    """Every submission matching the filters, walking next_page_token."""
    out = []
    token = ''
    while True:
        req = store_pb2.ListRequest(page_size=page, page_token=token, **filters)
        r = stub.list(req, timeout=10)
        out.extend(r.submissions)
        if not r.next_page_token:
            return out
        if r.next_page_token == token:
            raise AssertionError('List next_page_token did not advance')
        token = r.next_page_token


def request_abort(stub, conversation_id='', submission_id='', reason='stop'):
    """RequestAbort of a conversation or of one submission (whichever is given)."""
    req = store_pb2.RequestAbortRequest(reason=reason)
    if conversation_id:
        req.conversation_id = conversation_id
    if submission_id:
        req.submission_id = submission_id
    return stub.request_abort(req)


def heartbeat(stub, owner, fences, lease_ms=30000, timeout=None):
    req = store_pb2.HeartbeatRequest(owner_id=owner, fences=fences)
    if lease_ms:
        req.lease_duration.CopyFrom(duration(lease_ms))
    return stub.heartbeat(req, timeout=timeout)


def release(stub, owner, fences, expire_after_ms=0):
    req = store_pb2.ReleaseRequest(owner_id=owner, fences=fences)
    if expire_after_ms:
        req.expire_after.CopyFrom(duration(expire_after_ms))
    return stub.release(req)


def backup_call(sd):
    """Store.Backup on sd's channel: call it with a BackupRequest for the stream of chunks."""
    return sd.channel.unary_stream(
        '/cflue.v1.Store/Backup', request_serializer=store_pb2.BackupRequest.SerializeToString,
        response_deserializer=store_pb2.BackupChunk.FromString)


def scan_expired(stub, limit=0):
    """The first page of ScanExpired (limit is its page_size)."""
    return list(stub.scan_expired(store_pb2.ScanExpiredRequest(page_size=limit)).submissions)


def claim_joinable(stub, host, limit=0):
    return list(stub.claim_joinable(store_pb2.ClaimJoinableRequest(host=host, limit=limit))
                .submissions)


def finalize_join(stub, host, submission_id):
    return stub.finalize_join(store_pb2.JoinRequest(host=host, submission_id=submission_id))


def revert_join(stub, host, submission_id):
    return stub.revert_join(store_pb2.JoinRequest(host=host, submission_id=submission_id))


def mark_input_applied(stub, fence_, max_attempts=0, timeout_ms=0):
    req = store_pb2.MarkInputAppliedRequest(fence=fence_, max_attempts=max_attempts)
    if timeout_ms:
        req.timeout.CopyFrom(duration(timeout_ms))
    return stub.mark_input_applied(req)


def requeue(stub, fence_):
    return stub.requeue(store_pb2.FencedRequest(fence=fence_))


# ---- test case base ----

class StoragedTestCase(unittest.TestCase):
    """Gives each test a fresh storaged (self.storaged, created on first use) and prints the
    captured stderr of every daemon the test started when the test fails."""

    storaged_kwargs = {}
    # True: one daemon for the whole class (started in setUpClass), shared by its tests
    shared_storaged = False
    _shared = None

    @classmethod
    def setUpClass(cls):
        super(StoragedTestCase, cls).setUpClass()
        cls._shared = None
        if cls.shared_storaged:
            cls._shared = Storaged(**cls.storaged_kwargs)

    @classmethod
    def tearDownClass(cls):
        if cls._shared is not None:
            cls._shared.remove()
            cls._shared = None
        super(StoragedTestCase, cls).tearDownClass()

    def run(self, result=None):
        self._daemons = []
        if result is None:
            return super(StoragedTestCase, self).run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super(StoragedTestCase, self).run(result)
        finally:
            failed = len(result.failures) + len(result.errors) > before
            shown = list(self._daemons)
            if failed and type(self)._shared is not None:
                shown.append(type(self)._shared)
            for sd in shown:
                if sd in self._daemons:
                    sd.close()
                if failed:
                    sys.stderr.write('\n==== storaged stderr for %s (%s) ====\n%s'
                                     '==== end of storaged stderr ====\n'
                                     % (self.id(), sd.dir, _tail(sd.stderr_text())))
                if sd in self._daemons:
                    secret_scan.discard(sd.dir)

    def start_storaged(self, **kwargs):
        sd = Storaged(start=False, **kwargs)
        self._daemons.append(sd)
        sd.start()
        return sd

    @property
    def storaged(self):
        if type(self)._shared is not None:
            return type(self)._shared
        sd = getattr(self, '_storaged', None)
        if sd is None:
            sd = self.start_storaged(**self.storaged_kwargs)
            self._storaged = sd
        return sd

    @property
    def stub(self):
        return self.storaged.stub

    def assertRpcError(self, code, fn, *args, **kwargs):
        """Calls fn and asserts it raises an RpcError with the given status code (or one of a
        tuple of codes). Returns the error."""
        details_has = kwargs.pop('details_has', None)
        try:
            result = fn(*args, **kwargs)
        except grpc.RpcError as e:
            codes = code if isinstance(code, tuple) else (code,)
            self.assertIn(e.code(), codes, 'expected %s, got %s: %s'
                          % ('/'.join(c.name for c in codes), e.code(), e.details()))
            if details_has is not None:
                for word in ([details_has] if isinstance(details_has, str) else details_has):
                    self.assertIn(word.lower(), (e.details() or '').lower(),
                                  'details %r do not name %r' % (e.details(), word))
            return e
        self.fail('expected %s, call succeeded with %r'
                  % (code if isinstance(code, tuple) else code.name, _short(result)))


def _short(msg):
    s = str(msg)
    return s if len(s) < 2000 else s[:2000] + '...'


def _tail(text, max_lines=400):
    lines = text.splitlines(True)
    if len(lines) > max_lines:
        return '... (%d lines omitted)\n' % (len(lines) - max_lines) + ''.join(lines[-max_lines:])
    return ''.join(lines)


OK = grpc.StatusCode.OK
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED


# ---------------------------------------------------------------------------------------------
# toold: the sandbox tools daemon (cflue.v1.Tools and cflue.v1.Sandbox)
# ---------------------------------------------------------------------------------------------

TOOLD_BIN = os.path.join(BUILD_DIR, 'toold', 'toold')
CLI_BIN = os.path.join(BUILD_DIR, 'cli', 'cflue')

try:
    from cflue.v1 import tools_pb2, sandbox_pb2  # noqa: E402
except ImportError:  # pragma: no cover - only the toold tests need them
    tools_pb2 = sandbox_pb2 = None

# Method name -> (request class, response class, streaming); filled when the modules exist.
SANDBOX_METHODS = {}
if sandbox_pb2 is not None:
    SANDBOX_METHODS = {
        'ReadFile': (sandbox_pb2.ReadFileRequest, sandbox_pb2.ReadFileResponse),
        'WriteFile': (sandbox_pb2.WriteFileRequest, sandbox_pb2.WriteFileResponse),
        'Stat': (sandbox_pb2.PathRequest, sandbox_pb2.FileInfo),
        'ReadDir': (sandbox_pb2.ReadDirRequest, sandbox_pb2.ReadDirResponse),
        'Mkdir': (sandbox_pb2.MkdirRequest, sandbox_pb2.MkdirResponse),
        'Remove': (sandbox_pb2.RemoveRequest, sandbox_pb2.RemoveResponse),
        'Exec': (sandbox_pb2.ExecRequest, sandbox_pb2.ExecResponse),
        'Glance': (sandbox_pb2.GlanceRequest, sandbox_pb2.GlanceResponse),
    }


class TooldExited(Exception):
    pass


class Toold(Daemon):
    """A toold process serving workspaces under <dir>/root.

    Listens on unix:<dir>/toold.sock (tcp=False) or 127.0.0.1:0 with --port-file (tcp=True).
    driver: 'local' or 'bwrap'; grep_engine: None (toold's default) or auto|rg|pcre2|grep;
    extra_args/env are added to the command line and the environment.

        td = Toold()
        res = td.execute('sb1', 'read', {'path': 'a.txt'})   # a tools_pb2.ToolResult
        td.workspace('sb1')                                   # host path of the workspace
        td.stop()                                             # SIGTERM, asserts exit 0
    """

    NAME = 'toold'
    EXITED = TooldExited

    def __init__(self, driver='local', grep_engine=None, extra_args=(), env=None, tcp=False,
                 workdir=None, start=True):
        if not os.path.exists(TOOLD_BIN):
            raise unittest.SkipTest('toold binary not built: %s' % TOOLD_BIN)
        if tools_pb2 is None:
            raise unittest.SkipTest('generated tools_pb2/sandbox_pb2 missing in %s' % PY_DIR)
        self._init_daemon(workdir, 'cflue-toold-', tcp, env, extra_args)
        self.root = os.path.join(self.dir, 'root')
        secret_scan.skip(self.root)
        self.driver = driver
        self.grep_engine = grep_engine
        if start:
            self.start()


    def command(self):
        cmd = [TOOLD_BIN] + self.listen_args() + ['--root', self.root, '--driver', self.driver]
        if self.grep_engine:
            cmd += ['--grep-engine', self.grep_engine]
        return cmd + self.extra_args

    def workspace(self, sandbox, create=False):
        """The host path of a sandbox's workspace (root resolved like toold does)."""
        path = os.path.join(os.path.realpath(self.root), sandbox)
        if create:
            os.makedirs(path, exist_ok=True)
        return path

    # ---- the Tools and Sandbox services ----

    def list_tools(self, sandbox='', timeout=10):
        c = self._current_channel().unary_unary(
            '/cflue.v1.Tools/List',
            request_serializer=tools_pb2.ListToolsRequest.SerializeToString,
            response_deserializer=tools_pb2.ListToolsResponse.FromString)
        return c(tools_pb2.ListToolsRequest(sandbox=sandbox), timeout=timeout)

    def execute_call(self, call, timeout=120, channel=None):
        """Runs one tools_pb2.ToolCall; returns the ToolResult."""
        ch = channel or self._current_channel()
        c = ch.unary_unary('/cflue.v1.Tools/Execute',
                           request_serializer=tools_pb2.ToolCall.SerializeToString,
                           response_deserializer=tools_pb2.ToolResult.FromString)
        return c(call, timeout=timeout)

    def execute(self, sandbox, name, arguments, timeout_ms=0, call_id='', timeout=120,
                channel=None):
        """Runs a tool; arguments is a dict (sent as JSON) or a str (sent as is)."""
        return self.execute_call(tool_call(sandbox, name, arguments, timeout_ms, call_id),
                                 timeout=timeout, channel=channel)

    def execute_batch(self, calls, timeout=120):
        """Runs a ToolBatch; returns the list of BatchResult in arrival order."""
        c = self._current_channel().unary_stream(
            '/cflue.v1.Tools/ExecuteBatch',
            request_serializer=tools_pb2.ToolBatch.SerializeToString,
            response_deserializer=tools_pb2.BatchResult.FromString)
        return list(c(tools_pb2.ToolBatch(calls=calls), timeout=timeout))

    # ---- Sandbox ----

    def sandbox(self, method, timeout=60, **fields):
        """Calls /cflue.v1.Sandbox/<method> with a request built from fields (timeout_ms=N sets
        the request's Duration `timeout`; `timeout` is the RPC's own deadline in seconds)."""
        req_cls, resp_cls = SANDBOX_METHODS[method]
        timeout_ms = fields.pop('timeout_ms', 0)
        req = set_timeout_ms(req_cls(**fields), timeout_ms)
        c = self._current_channel().unary_unary(
            '/cflue.v1.Sandbox/' + method, request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString)
        return c(req, timeout=timeout)


def set_timeout_ms(msg, timeout_ms):
    """Sets msg.timeout (a Duration) to timeout_ms milliseconds; 0 or None leaves it unset."""
    if timeout_ms:
        msg.timeout.FromMilliseconds(timeout_ms)
    return msg


def tool_call(sandbox, name, arguments, timeout_ms=0, call_id=''):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = tools_pb2.ToolCall(sandbox=sandbox, name=name, arguments_json=args, call_id=call_id)
    return set_timeout_ms(call, timeout_ms)


def result_details(res):
    return json.loads(res.details_json) if res.details_json else {}


def truncation_dict(res):
    t = res.truncation
    return {'truncated': t.truncated, 'by': common_pb2.TruncatedBy.Name(t.by),
            'total_lines': t.total_lines, 'total_bytes': t.total_bytes,
            'shown_first_line': t.shown_first_line, 'shown_last_line': t.shown_last_line,
            'next_offset': t.next_offset, 'line_too_long': t.line_too_long}


class TooldTestCase(unittest.TestCase):
    """Starts toold daemons through self.start_toold(...) and prints their stderr when a test
    fails; every daemon a test started is killed and removed afterwards."""

    def run(self, result=None):
        self._toolds = []
        if result is None:
            return super(TooldTestCase, self).run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super(TooldTestCase, self).run(result)
        finally:
            failed = len(result.failures) + len(result.errors) > before
            for td in self._toolds:
                td.close()
                if failed:
                    sys.stderr.write('\n==== toold stderr for %s (%s) ====\n%s'
                                     '==== end of toold stderr ====\n'
                                     % (self.id(), td.dir, _tail(td.stderr_text(), 60)))
                secret_scan.discard(td.dir)

    def start_toold(self, **kwargs):
        td = Toold(start=False, **kwargs)
        self._toolds.append(td)
        td.start()
        return td


# ---------------------------------------------------------------------------------------------
# agentd (cflue.v1.Agent) and the offline model server (tests/fake_model/fake_model.py)
# ---------------------------------------------------------------------------------------------

AGENTD_BIN = os.path.join(BUILD_DIR, 'agentd', 'agentd')
FAKE_MODEL_PY = os.path.join(REPO, 'tests', 'fake_model', 'fake_model.py')
FAKE_MODEL_PYTHON = '/usr/bin/python3' if os.path.exists('/usr/bin/python3') else sys.executable

try:
    from cflue.v1 import agent_pb2  # noqa: E402
except ImportError:  # pragma: no cover - only the agentd tests need it
    agent_pb2 = None

# Method name -> (request class, response class, streaming); filled when the module exists.
AGENT_METHODS = {}
if agent_pb2 is not None:
    AGENT_METHODS = {
        'Submit': (agent_pb2.SubmitRequest, agent_pb2.Admission, False),
        'Watch': (agent_pb2.WatchRequest, common_pb2.Record, True),
        'GetSubmission': (agent_pb2.GetSubmissionRequest, common_pb2.Submission, False),
        'Abort': (agent_pb2.AbortRequest, agent_pb2.AbortResponse, False),
        'Compact': (agent_pb2.CompactRequest, agent_pb2.CompactResponse, False),
        'ListAgents': (agent_pb2.ListAgentsRequest, agent_pb2.ListAgentsResponse, False),
        'GetConversation': (agent_pb2.GetConversationRequest, agent_pb2.ConversationView, False),
    }


class FakeModelExited(Exception):
    pass


class FakeModel(object):
    """tests/fake_model/fake_model.py on 127.0.0.1:<ephemeral>, logging every request.

        fm = FakeModel(steps=[{"text": "hi"}])   # or steps=None for the demo brain
        fm.anthropic_base_url / fm.openai_base_url
        fm.set_scenario([...])                    # replaces the script of the running server
        fm.requests()                             # the parsed --log entries so far
    """

    def __init__(self, steps=None, require_key=None, extra_args=(), workdir=None, start=True):
        if not os.path.exists(FAKE_MODEL_PY):
            raise unittest.SkipTest('fake model server missing: %s' % FAKE_MODEL_PY)
        self.dir = workdir or tempfile.mkdtemp(prefix='cflue-fake-')
        self.log_path = os.path.join(self.dir, 'requests.jsonl')
        self.stdout_path = os.path.join(self.dir, 'fake.stdout')
        self.stderr_path = os.path.join(self.dir, 'fake.stderr')
        self.scenario_path = None
        if steps is not None:
            self.scenario_path = os.path.join(self.dir, 'scenario.json')
            with open(self.scenario_path, 'w') as f:
                json.dump({'steps': list(steps)}, f)
        self.require_key = require_key
        self.extra_args = list(extra_args)
        self.proc = None
        self.port = None
        if start:
            self.start()

    def command(self):
        cmd = [FAKE_MODEL_PYTHON, FAKE_MODEL_PY, '--port', '0', '--log', self.log_path]
        if self.scenario_path:
            cmd += ['--scenario', self.scenario_path]
        if self.require_key is not None:
            cmd += ['--require-key', self.require_key]
        return cmd + self.extra_args

    def start(self, timeout=READY_TIMEOUT_S):
        with open(self.stdout_path, 'wb') as out, open(self.stderr_path, 'ab') as err:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err)
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                _LIVE.discard(self)
                raise FakeModelExited('fake model exited with code %d\n%s'
                                      % (rc, self.stderr_text()))
            with open(self.stdout_path, 'rb') as f:
                m = re.match(br'listening on (\d+)\n', f.read())
            if m:
                self.port = int(m.group(1))
                return self
            time.sleep(0.02)
        raise AssertionError('fake model did not print its port in time\n' + self.stderr_text())

    @property
    def base_url(self):
        return 'http://127.0.0.1:%d' % self.port

    @property
    def anthropic_base_url(self):
        return self.base_url

    @property
    def openai_base_url(self):
        return self.base_url + '/v1'

    def _http(self, method, path, body=None, timeout=10):
        import urllib.request
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={'content-type': 'application/json'})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())

    def set_scenario(self, steps, context_window=None):
        """Replace the script; with context_window, larger requests are refused as too long."""
        body = {'steps': list(steps)}
        if context_window is not None:
            body['context_window'] = context_window
        return self._http('POST', '/_fake/scenario', body)

    def health(self):
        return self._http('GET', '/_fake/health')

    def requests(self):
        """Every request logged so far, in arrival order (parsed JSON lines). A line without
        its newline is still being written (a large request goes out in several writes): it
        and what follows are left for the next call. Read on past it, the file, grown
        meanwhile, would give the rest of that line as a line of its own."""
        out = []
        try:
            with open(self.log_path, 'rb') as f:
                for line in f:
                    if not line.endswith(b'\n'):
                        break
                    out.append(json.loads(line.decode('utf-8')))
        except IOError:
            pass
        return out

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        _LIVE.discard(self)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def remove(self):
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def stderr_text(self):
        try:
            with open(self.stderr_path, 'rb') as f:
                return f.read().decode('utf-8', 'replace')
        except IOError:
            return '(no stderr captured)'


class AgentdExited(Exception):
    pass


class Agentd(Daemon):
    """An agentd process on 127.0.0.1:<ephemeral> (--port-file), serving the agent
    definitions in agents_dir against the storaged at store_target.

    restart() kills it with SIGKILL and starts it again with the same flags (same --owner-id);
    its port changes, and the Agent methods follow the current channel.

        ad = Agentd(sd.target, agents_dir, owner_id='a1', env={'ANTHROPIC_BASE_URL': ...})
        adm = ad.submit('coder', 'fix it')
        ad.get_submission(adm.submission_id, wait=True, timeout=30)
    """

    NAME = 'agentd'
    EXITED = AgentdExited

    def __init__(self, store_target, agents_dir, owner_id='', env=None, extra_args=(),
                 workdir=None, start=True):
        if not os.path.exists(AGENTD_BIN):
            raise unittest.SkipTest('agentd binary not built: %s' % AGENTD_BIN)
        if agent_pb2 is None:
            raise unittest.SkipTest('generated agent_pb2 missing in %s' % PY_DIR)
        # TCP on port 0: each restart gets a new port, and the channel follows it
        self._init_daemon(workdir, 'cflue-agentd-', True, env, extra_args)
        self.store_target = store_target
        self.agents_dir = agents_dir
        self.owner_id = owner_id
        if start:
            self.start()

    def command(self):
        cmd = [AGENTD_BIN] + self.listen_args() + ['--store', self.store_target, '--agents',
                                                    self.agents_dir]
        if self.owner_id:
            cmd += ['--owner-id', self.owner_id]
        return cmd + self.extra_args

    def call(self, method, req, timeout=10):
        """Calls /cflue.v1.Agent/<method>; a streaming method returns the call iterator."""
        req_cls, resp_cls, streaming = AGENT_METHODS[method]
        ch = self._current_channel()
        path = '/cflue.v1.Agent/' + method
        if streaming:
            return ch.unary_stream(path, request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)(req, timeout=timeout)
        return ch.unary_unary(path, request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)(req, timeout=timeout)

    def submit(self, agent, text, conversation_id='', idempotency_key='', attachments=(),
               timeout=10):
        return self.call('Submit', agent_pb2.SubmitRequest(
            agent=agent, conversation_id=conversation_id, message=message(text, attachments),
            idempotency_key=idempotency_key), timeout=timeout)

    def watch(self, conversation_id, after_offset=-1, follow=False, timeout=30):
        """The Watch call (an iterator of Records; cancel() it to stop a follow)."""
        return self.call('Watch', agent_pb2.WatchRequest(
            conversation_id=conversation_id, after_offset=after_offset, follow=follow),
            timeout=timeout)

    def watch_all(self, conversation_id, after_offset=-1, timeout=30):
        return list(self.watch(conversation_id, after_offset, False, timeout))

    def get_submission(self, submission_id, wait=False, timeout=10):
        return self.call('GetSubmission', agent_pb2.GetSubmissionRequest(
            submission_id=submission_id, wait=wait), timeout=timeout)

    def abort(self, submission_id='', conversation_id='', timeout=10):
        """Abort of one submission, or (conversation_id given) of a conversation: the request's
        oneof target holds the one given."""
        req = agent_pb2.AbortRequest()
        if conversation_id:
            req.conversation_id = conversation_id
        else:
            req.submission_id = submission_id
        return self.call('Abort', req, timeout=timeout)

    def list_agents(self, page_size=0, page_token='', timeout=10):
        """One page of ListAgents."""
        return self.call('ListAgents', agent_pb2.ListAgentsRequest(
            page_size=page_size, page_token=page_token), timeout=timeout)

    def list_all_agents(self, page_size=0, timeout=10):
        """Every agent, paged through ListAgents to the end."""
        out, token = [], ''
        while True:
            page = self.list_agents(page_size, token, timeout)
            out.extend(page.agents)
            token = page.next_page_token
            if not token:
                return out

    def get_conversation(self, conversation_id, include_records=False, page_size=0,
                         page_token='', timeout=10):
        """One GetConversation view (with include_records, one page of records)."""
        return self.call('GetConversation', agent_pb2.GetConversationRequest(
            conversation_id=conversation_id, include_records=include_records,
            page_size=page_size, page_token=page_token), timeout=timeout)

    def conversation_records(self, conversation_id, page_size=0, timeout=10):
        """A conversation's whole history, paged through GetConversation to the end."""
        out, token = [], ''
        while True:
            view = self.get_conversation(conversation_id, True, page_size, token, timeout)
            out.extend(view.records)
            token = view.next_page_token
            if not token:
                return out


# ---- a whole stack on the fake model's bench brain ----

def private_mount_problem():
    """Why storaged cannot be given a tmpfs of its own here (None: it can)."""
    if os.geteuid() != 0 or not shutil.which('unshare') or not shutil.which('nsenter'):
        return 'needs root, unshare(1) and nsenter(1) for a private tmpfs'
    probe = subprocess.run(['unshare', '-m', '--', 'mount', '-t', 'tmpfs', 'tmpfs', '/mnt'],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if probe.returncode != 0:
        return 'cannot mount a tmpfs in a mount namespace here (%s)' % probe.stderr.strip()
    return None



def require_namespace(case, problem):
    """Skips the test case when problem (why a namespace cannot be made here) is set; fails it
    instead where it can be made (CI's machines, as root): there a skip would hide a failure."""
    if problem:
        if os.environ.get('CI') == 'true' and os.geteuid() == 0:
            case.fail(problem)
        case.skipTest(problem)

class TmpfsNamespace(object):
    """A mount namespace holding a tmpfs of size_mib MiB at <workdir>/disk (self.dir), kept by
    a shell waiting on its stdin until close() (or until this process is gone and the pipe with
    it): its files outlive each daemon started in it (command()), and its size can change
    (resize) between runs."""

    def __init__(self, workdir, size_mib):
        self.workdir = workdir
        self.dir = os.path.join(workdir, 'disk')
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            ['unshare', '-m', '--', 'sh', '-c',
             'mount -t tmpfs -o size=%dm tmpfs "$0" && echo mounted && read _' % size_mib,
             self.dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != 'mounted':
            why = self.proc.stderr.read()
            self.close()
            raise AssertionError('cannot mount a tmpfs: %s' % why)

    def path(self, name):
        return os.path.join(self.dir, name)

    def command(self, argv):
        """argv run in the namespace (nsenter execs it: the pid is the command's own)."""
        return ['nsenter', '-t', str(self.proc.pid), '-m', '--'] + list(argv)

    def run(self, script, *args):
        """Runs a shell script in the namespace ($0, $1...: args); returns its stdout, fails
        when it does."""
        r = subprocess.run(self.command(['sh', '-c', script] + list(args)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise AssertionError('%s: exit %d: %s' % (script, r.returncode, r.stderr))
        return r.stdout

    def resize(self, size_mib):
        self.run('mount -o remount,size=%dm "$0"' % size_mib, self.dir)

    def close(self):
        """Ends the namespace (the tmpfs goes once no daemon started in it is left)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class NamespacedStoraged(Storaged):
    """storaged run in a TmpfsNamespace (its database there: db=ns.path('store.db'))."""

    def __init__(self, ns, **kwargs):
        self.ns = ns
        Storaged.__init__(self, **kwargs)

    def command(self):
        return self.ns.command(Storaged.command(self))


class TmpfsStoraged(NamespacedStoraged):
    """storaged on a small tmpfs of its own (a disk that can fill up): a TmpfsNamespace of SIZE_MIB
    MiB made for it, its database there (mount_dir), ended by close() (so by the test cases' and
    the stacks' clean-up) with everything on it."""

    SIZE_MIB = 4

    def __init__(self, **kwargs):
        workdir = kwargs.pop('workdir', None) or tempfile.mkdtemp(prefix='cflue-full-')
        ns = TmpfsNamespace(os.path.join(workdir, 'ns'), self.SIZE_MIB)
        self.mount_dir = ns.dir
        NamespacedStoraged.__init__(self, ns, workdir=workdir, db=ns.path('store.db'), **kwargs)

    def in_namespace(self, script):
        """Runs a shell script where the tmpfs is; returns the finished process (stdout holds
        its output and errors), whatever its exit code."""
        return subprocess.run(self.ns.command(['sh', '-c', script]), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)

    def close(self):
        NamespacedStoraged.close(self)
        self.ns.close()


class BenchBrainStack(object):
    """storaged + toold (its workspace 'bench' holding BIG_FILE) + the fake model playing its
    bench brain (`bash echo hello`, `read` of BIG_FILE, a short answer; --delay-ms delay_ms) +
    n_agentd agentds running the agent AGENT against them, each daemon in a directory of one
    temporary directory (remove() stops them and deletes it). store_env, tool_env: storaged's
    and toold's extra environment; owner_ids: the agentds' --owner-id (default: none, the agentd's own);
    agentd_args: extra flags of the first n_agentd agentds; workdir: the directory to use
    instead of a new temporary one; storaged_cls: the kind of storaged (TmpfsStoraged, say)."""

    AGENT = 'bench'
    BIG_FILE = 'big.txt'

    def __init__(self, delay_ms, big_text, n_agentd=1, owner_ids=None, agentd_args=(),
                 store_env=None, prefix='cflue-stack-', workdir=None, tool_env=None,
                 storaged_cls=None):
        self.dir = workdir or tempfile.mkdtemp(prefix=prefix)
        os.makedirs(self.dir, exist_ok=True)
        secret_scan.watch(self.dir)
        self.daemons = []
        try:
            self.sd = self._add((storaged_cls or Storaged)(workdir=self._sub('storaged'),
                                                           env=store_env))
            self.td = Toold(workdir=self._sub('toold'), env=tool_env, start=False)
            with open(os.path.join(self.td.workspace('bench', create=True), self.BIG_FILE),
                      'w') as f:
                f.write(big_text)
            self._add(self.td.start())
            self.fm = self._add(self.start_model(delay_ms))
            self.agents = self._sub('agents')
            with open(os.path.join(self.agents, self.AGENT + '.md'), 'w') as f:
                f.write('---\nname: %s\ndescription: a test on the bench brain\n'
                        'model: anthropic/bench-1\nsandbox:\n  tools: "%s"\n'
                        '  workspace: bench\n---\n\nAnswer briefly.\n'
                        % (self.AGENT, self.td.target))
            self.ads = [self.add_agentd(agentd_args, owner_ids[i] if owner_ids else '')
                        for i in range(n_agentd)]
            self.ad = self.ads[0] if self.ads else None
        except BaseException:
            self.remove()
            raise

    def start_model(self, delay_ms):
        """The fake model playing the bench brain (a subclass may start another kind)."""
        return FakeModel(workdir=self._sub('fake_model'),
                         extra_args=['--brain', 'bench', '--delay-ms', str(delay_ms), '--quiet'])

    def add_agentd(self, agentd_args=(), owner_id=''):
        """One more agentd on this stack's storaged, toold and model."""
        env = {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url,
               'ANTHROPIC_API_KEY': secret_scan.secret('anthropic-key')}
        return self._add(Agentd(self.sd.target, self.agents, env=env, owner_id=owner_id,
                                workdir=self._sub('agentd%d' % len(self.daemons)),
                                extra_args=tuple(agentd_args)))

    def _sub(self, name):
        p = os.path.join(self.dir, name)
        os.makedirs(p, exist_ok=True)
        return p

    def _add(self, d):
        self.daemons.append(d)
        return d

    def store_counts(self):
        """Stops the agentds, then storaged (started with store_env CFLUE_RPC_STATS=1); returns
        storaged's {method: calls}, as it logged them."""
        for ad in self.ads:
            if ad.alive():
                ad.stop()
        self.sd.stop()
        counts = {}
        for m in re.finditer(r'event=rpc_stats method=/cflue\.v1\.Store/(\w+) calls=(\d+)',
                             self.sd.stderr_text()):
            counts[m.group(1)] = int(m.group(2))
        if not counts:
            raise AssertionError('storaged logged no rpc_stats\n' + self.sd.stderr_text())
        return counts

    def remove(self):
        for d in reversed(self.daemons):
            try:
                d.close()
            except Exception:
                pass
        secret_scan.discard(self.dir)


# ---------------------------------------------------------------------------------------------
# TLS: a throw-away PKI made with the openssl command (the --tls-* and --peer-* flags)
# ---------------------------------------------------------------------------------------------

OPENSSL_BIN = shutil.which('openssl')


def _openssl(*args, cwd=None):
    if OPENSSL_BIN is None:
        raise unittest.SkipTest('the openssl command is not installed (scripts/setup)')
    r = subprocess.run([OPENSSL_BIN] + list(args), cwd=cwd, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise AssertionError('openssl %s failed:\n%s' % (' '.join(args),
                                                           r.stdout.decode('utf-8', 'replace')))


class Pki(object):
    """Paths of a test PKI in dir: ca (ca.pem, its key ca.key), a server certificate for
    127.0.0.1 and localhost (server.pem, server.key), a client certificate (client.pem,
    client.key: the CLI's and agentd's), and a second CA that has nothing to do with the first (other-ca.pem) with a
    client certificate of its own (other-client.pem, other-client.key). Keys are EC P-256,
    unencrypted; certificates last two days."""

    def __init__(self, dir):
        self.dir = dir
        for name in ('ca', 'server', 'client', 'other-ca', 'other-client'):
            setattr(self, name.replace('-', '_'), os.path.join(dir, name + '.pem'))
            setattr(self, name.replace('-', '_') + '_key', os.path.join(dir, name + '.key'))

    def read(self, path):
        with open(path, 'rb') as f:
            return f.read()


def _new_ca(dir, name, cn):
    _openssl('req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1',
             '-nodes', '-keyout', name + '.key', '-out', name + '.pem', '-days', '2',
             '-subj', '/CN=' + cn, '-addext', 'basicConstraints=critical,CA:TRUE',
             '-addext', 'keyUsage=critical,keyCertSign,cRLSign', cwd=dir)


def issue_cert(dir, name, serial, ca='ca', cn=None, server=True, out_dir=None):
    """Issues NAME.pem and NAME.key in out_dir (default dir) signed by the CA dir/CA.pem, with
    the serial number given (an int). A server certificate names IP 127.0.0.1 and DNS
    localhost; a client certificate is for client authentication only. Returns (cert, key)."""
    out_dir = out_dir or dir
    cert = os.path.join(out_dir, name + '.pem')
    key = os.path.join(out_dir, name + '.key')
    csr = os.path.join(out_dir, name + '.csr')
    ext = os.path.join(out_dir, name + '.ext')
    with open(ext, 'w') as f:
        if server:
            f.write('subjectAltName=IP:127.0.0.1,DNS:localhost\n'
                    'extendedKeyUsage=serverAuth,clientAuth\n')
        else:
            f.write('subjectAltName=DNS:%s\nextendedKeyUsage=clientAuth\n' % (cn or name))
    _openssl('req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
             '-keyout', key, '-out', csr, '-subj', '/CN=' + (cn or name), cwd=dir)
    _openssl('x509', '-req', '-in', csr, '-CA', ca + '.pem', '-CAkey', ca + '.key',
             '-set_serial', str(serial), '-days', '2', '-extfile', ext, '-out', cert, cwd=dir)
    os.unlink(csr)
    os.unlink(ext)
    return cert, key


def make_pki(dir):
    """Makes the test PKI of Pki in dir (created if missing); returns the Pki. One server
    certificate serves every daemon (they all listen on 127.0.0.1)."""
    os.makedirs(dir, exist_ok=True)
    _new_ca(dir, 'ca', 'cflue-test-ca')
    _new_ca(dir, 'other-ca', 'cflue-other-ca')
    issue_cert(dir, 'server', 0x1001, cn='localhost')
    issue_cert(dir, 'client', 0x2001, server=False)
    issue_cert(dir, 'other-client', 0x3001, ca='other-ca', server=False)
    return Pki(dir)


def tls_credentials(pki, client=True, ca=None, cert=None, key=None):
    """grpc.ssl_channel_credentials trusting pki.ca (or ca), presenting pki's client
    certificate (client=False: none; cert/key: another pair)."""
    root = pki.read(ca or pki.ca)
    if not client:
        return grpc.ssl_channel_credentials(root)
    return grpc.ssl_channel_credentials(root, pki.read(key or pki.client_key),
                                        pki.read(cert or pki.client))


def tls_server_args(pki, mtls=True):
    """A daemon's flags to serve TLS with pki's server certificate (and require its clients'
    certificates when mtls)."""
    args = ['--tls-cert', pki.server, '--tls-key', pki.server_key]
    return args + (['--tls-client-ca', pki.ca] if mtls else [])


def tls_peer_args(pki, cert=True):
    """agentd's flags to reach TLS peers verified by pki.ca, presenting pki's client
    certificate (cert=False: none)."""
    args = ['--peer-ca', pki.ca]
    return args + (['--peer-cert', pki.client, '--peer-key', pki.client_key] if cert else [])


# ---------- wall clocks set apart (libfaketime) ----------

FAKETIME_LIB = '/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1'


def clock_apart_env(offset):
    """The environment of a daemon whose wall clock reads `offset` (libfaketime's syntax: '+1h',
    '-1h') from the host's, as on a host whose clock is off; its monotonic clock is the host's."""
    asan = os.environ.get('ASAN_OPTIONS', '')
    return {'LD_PRELOAD': FAKETIME_LIB, 'FAKETIME': offset, 'FAKETIME_DONT_FAKE_MONOTONIC': '1',
            # an ASan build checks that its runtime is the first library loaded: here it is not
            'ASAN_OPTIONS': (asan + ':' if asan else '') + 'verify_asan_link_order=0'}


def settable_clock_env(path):
    """The environment of a daemon whose wall clock reads the offset written in the file at
    `path` (libfaketime's syntax) from the host's, read again every second: a clock that can
    be set while the daemon runs (set_clock)."""
    env = clock_apart_env('+0')
    del env['FAKETIME']
    env.update({'FAKETIME_TIMESTAMP_FILE': path, 'FAKETIME_CACHE_DURATION': '1'})
    return env


# libfaketime reads the offset file again once its copy is more than a second old, counted in
# whole seconds: a daemon sees a new offset within two seconds.
CLOCK_READ_S = 2.2


def set_clock(path, offset):
    """Sets the clock of the daemons started with settable_clock_env(path) to `offset` from the
    host's; they read it within CLOCK_READ_S."""
    with open(path + '.new', 'w') as f:
        f.write(offset + '\n')
    os.rename(path + '.new', path)


def skip_without_faketime():
    if not os.path.exists(FAKETIME_LIB):
        raise unittest.SkipTest('libfaketime is not installed (scripts/setup installs it)')
    if os.environ.get('CFLUE_TSAN'):
        # libfaketime's pthread_cond_timedwait takes the mutex back behind ThreadSanitizer's
        # back: it reports a double lock at every timed wait. The other stages run these.
        raise unittest.SkipTest('libfaketime and ThreadSanitizer do not go together')
