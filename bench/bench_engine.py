#!/usr/bin/python3
"""bench_engine - issue 8's engine acceptance numbers, in one command, against real daemons.

    /usr/bin/python3 bench/bench_engine.py [--quick | --smoke] [--build DIR] [--sections 1,2,3,4]
                                           [--cap SECONDS] [--json FILE]

Starts storaged, toold (driver local) and agentd from $CFLUE_BUILD_DIR (or --build; default
build/) with the offline model (tests/fake_model/fake_model.py), all on loopback in a temporary
directory, and runs the 3-call scenario: the model asks for `bash echo hello`, then `read` of a
165 KB file, then answers. Every section starts fresh daemons with default settings and prints
the issue's target beside what it measured:

  1. the model answering at once: Submit -> settled sequentially (median, p95) beside the fake
     model's own time for the same three requests; daemon CPU per conversation (each and
     summed, from /proc/PID/stat); conversations/s with 10 in flight, with the fake model's
     and this client's CPU shares; storaged calls per conversation (CFLUE_RPC_STATS=1, read at
     storaged's shutdown); model TCP connections per 100 conversations;
  2. the model answering each call after 1 s: N conversations in flight (median and max Submit
     -> settled, how many within 1.5x their model time, agentd's thread count throughout);
  3. W idle Watch(follow) streams on one agentd: Submit latency with and without them, agentd
     RSS per watcher;
  4. idle RSS of the three daemons after start and after K conversations.

A section that cannot reach its goal ends after --cap seconds and says how far it got.
--quick: N=100, W=500, K=1000 (about a minute on 2 cores). --smoke: the smallest sizes, only to
show that every section runs (ctest's bench/all_smoke, through bench/run --smoke); its figures
mean nothing. --json FILE also writes the key figures, each with its baseline and target, as
JSON (bench/benchjson.py), for bench/run.
"""
import argparse
import http.client
import json
import os
import re
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# --build must be known before the harness picks the build directory
if '--build' in sys.argv[:-1]:
    os.environ['CFLUE_BUILD_DIR'] = os.path.abspath(sys.argv[sys.argv.index('--build') + 1])
sys.path.insert(0, os.path.join(REPO, 'tests', 'integration'))

sys.path.insert(0, HERE)

import grpc  # noqa: E402
import cflue_harness as H  # noqa: E402
from benchjson import Report  # noqa: E402
from cflue.v1 import agent_pb2, common_pb2, store_pb2  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Every use of the protocol's message fields is in this block (the protos will change).
# ---------------------------------------------------------------------------------------------


def agent_callables(channel):
    """The Agent methods this bench calls, as gRPC callables on one channel."""
    def uu(name, req, resp):
        return channel.unary_unary('/cflue.v1.Agent/' + name,
                                   request_serializer=req.SerializeToString,
                                   response_deserializer=resp.FromString)
    return {
        'Submit': uu('Submit', agent_pb2.SubmitRequest, agent_pb2.Admission),
        'GetSubmission': uu('GetSubmission', agent_pb2.GetSubmissionRequest,
                            common_pb2.Submission),
        'GetConversation': uu('GetConversation', agent_pb2.GetConversationRequest,
                              agent_pb2.ConversationView),
        'Watch': channel.unary_stream('/cflue.v1.Agent/Watch',
                                      request_serializer=agent_pb2.WatchRequest.SerializeToString,
                                      response_deserializer=common_pb2.Record.FromString),
    }


def submit(calls, agent, text, timeout=30):
    """Submits text to a new conversation; returns (submission_id, conversation_id)."""
    adm = calls['Submit'](agent_pb2.SubmitRequest(agent=agent,
                                                  message=common_pb2.Message(text=text)),
                          timeout=timeout)
    return adm.submission_id, adm.conversation_id


def wait_settled(calls, submission_id, timeout=60):
    """Blocks in GetSubmission(wait) until the submission is settled; returns its outcome name
    ('COMPLETED', 'FAILED', 'ABORTED')."""
    s = calls['GetSubmission'](agent_pb2.GetSubmissionRequest(submission_id=submission_id,
                                                              wait=True), timeout=timeout)
    return common_pb2.Outcome.Name(s.outcome).replace('OUTCOME_', '')


def conversation_head(calls, conversation_id):
    """The offset of the conversation's newest record."""
    return calls['GetConversation'](agent_pb2.GetConversationRequest(
        conversation_id=conversation_id), timeout=10).head_offset


def watch(calls, conversation_id, from_offset, timeout):
    """Opens Watch(follow) after from_offset; returns the call (a future-like iterator)."""
    return calls['Watch'](agent_pb2.WatchRequest(conversation_id=conversation_id,
                                                 after_offset=from_offset, follow=True),
                          timeout=timeout)


def settled_times(store_stub, submission_ids):
    """Asks storaged for the settled submissions among submission_ids (one List page walk);
    returns {submission_id: (settled_at epoch ms, outcome name)}."""
    want, out, token = set(submission_ids), {}, ''
    while True:
        resp = store_stub.list(store_pb2.ListRequest(
            statuses=[common_pb2.SUBMISSION_STATUS_SETTLED], page_size=1000, page_token=token),
            timeout=30)
        for s in resp.submissions:
            if s.submission_id in want:
                settled_ms = s.settle_time.seconds * 1000 + s.settle_time.nanos // 1000000
                out[s.submission_id] = (settled_ms,
                                        common_pb2.Outcome.Name(s.outcome).replace('OUTCOME_', ''))
        if not resp.next_page_token:
            return out
        token = resp.next_page_token


# ---------------------------------------------------------------------------------------------
# The scenario
# ---------------------------------------------------------------------------------------------

AGENT = H.BenchBrainStack.AGENT
GO = 'BENCH-ENGINE-GO'          # the user message (must not contain "hello")
FILE_MARK = 'BENCH-FILE-165K'   # first line of the file the model reads
BIG_FILE = H.BenchBrainStack.BIG_FILE
BIG_BYTES = 165 * 1000
MODEL_HOW = "the fake model's bench brain (stateless; one asyncio thread)"


def big_file_text():
    lines = [FILE_MARK]
    n = 1
    while sum(len(x) + 1 for x in lines) < BIG_BYTES:
        lines.append('line %05d: the quick brown fox jumps over the lazy dog, again and again'
                     % n)
        n += 1
    text = '\n'.join(lines) + '\n'
    return text[:BIG_BYTES - 1] + '\n'


# ---------------------------------------------------------------------------------------------
# /proc
# ---------------------------------------------------------------------------------------------

NCPU = os.cpu_count() or 1


cpu_s = H.proc_cpu_seconds


def self_cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_kib(pid):
    return H.proc_status_field(pid, 'VmRSS')


def threads(pid):
    return H.proc_status_field(pid, 'Threads')


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Sampler(object):
    """Samples f() every period seconds on a thread; .max and .samples."""

    def __init__(self, f, period=0.1):
        self.f, self.period, self.samples = f, period, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self.f())
            except (OSError, ValueError):
                pass
            self._stop.wait(self.period)

    def stop(self):
        self._stop.set()
        self._t.join()
        return self

    @property
    def max(self):
        return max(self.samples) if self.samples else 0


# ---------------------------------------------------------------------------------------------
# Daemons
# ---------------------------------------------------------------------------------------------


class FakeModel(H.FakeModel):
    """The harness's fake model on a chosen port, logging only when asked (the log re-encodes
    every request body: a cost the real model does not have)."""

    def __init__(self, workdir, port=0, log=False, delay_ms=0):
        self.want_port, self.want_log = port, log
        super(FakeModel, self).__init__(steps=None, workdir=workdir, extra_args=[
            '--quiet', '--brain', 'bench', '--delay-ms', str(delay_ms)])

    def command(self):
        cmd = [H.FAKE_MODEL_PYTHON, H.FAKE_MODEL_PY, '--port', str(self.want_port)]
        if self.want_log:
            cmd += ['--log', self.log_path]
        return cmd + self.extra_args

    def stats(self):
        """GET /_stats ({"connections", "requests"}) or None when this fake model has none."""
        try:
            return self._http('GET', '/_stats')
        except Exception:
            return None


class StracedAgentd(H.Agentd):
    """agentd under `strace -f --seccomp-bpf -e trace=connect` (only connect(2) stops), to
    count its model connections when the fake model cannot."""

    def __init__(self, trace_path, *a, **kw):
        self.trace_path = trace_path
        super(StracedAgentd, self).__init__(*a, **kw)

    def command(self):
        return ['strace', '-f', '--seccomp-bpf', '-e', 'trace=connect', '-o', self.trace_path,
                '-qq'] + super(StracedAgentd, self).command()

    def close(self):
        # strace leaves its tracee running when it is killed: kill agentd first
        if self.proc is not None and self.proc.poll() is None:
            for kid in self._children():
                try:
                    os.kill(kid, 9)
                except OSError:
                    pass
        super(StracedAgentd, self).close()

    def _children(self):
        out = []
        try:
            for tid in os.listdir('/proc/%d/task' % self.proc.pid):
                with open('/proc/%d/task/%s/children' % (self.proc.pid, tid)) as f:
                    out += [int(x) for x in f.read().split()]
        except OSError:
            pass
        return out

    def connects_to(self, port):
        with open(self.trace_path, errors='replace') as f:
            return len(re.findall(r'connect\(\d+, \{sa_family=AF_INET, sin_port=htons\(%d\)'
                                  % port, f.read()))


class Stack(H.BenchBrainStack):
    """The harness's stack on the bench brain in root/name, with this bench's fake model
    (logging only when asked) and one agentd (start_agentd: another kind)."""

    def __init__(self, root, name, model_log=False, store_env=None, model_delay_ms=0):
        self.model_log = model_log
        self.model_delay_ms = model_delay_ms
        super(Stack, self).__init__(model_delay_ms, big_file_text(), n_agentd=0,
                                    store_env=store_env, workdir=os.path.join(root, name))
        self.start_agentd()

    def start_model(self, delay_ms):
        return FakeModel(self._sub('fake_model'), log=self.model_log, delay_ms=delay_ms)

    def start_agentd(self, cls=H.Agentd, *pre):
        env = {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url, 'ANTHROPIC_API_KEY': 'bench'}
        self.ad = self._add(cls(*(pre + (self.sd.target, self.agents)), env=env,
                                workdir=self._sub('agentd%d' % len(self.daemons))))
        self.calls = agent_callables(self.ad.channel)
        return self.ad

    def restart_model(self, log=False):
        """A new fake model on the same port (agentd keeps its base URL)."""
        port = self.fm.port
        self.fm.close()
        self.daemons.remove(self.fm)
        self.fm = self._add(FakeModel(self._sub('fake_model2'), port=port, log=log,
                                      delay_ms=self.model_delay_ms))

    def pids(self):
        return {'storaged': self.sd.pid, 'agentd': self.ad.pid, 'toold': self.td.pid}

    def close(self):
        for d in reversed(self.daemons):
            try:
                d.close()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def one_conversation(calls, timeout=60):
    """Submit, then wait until settled; returns (seconds, Submit seconds, outcome)."""
    t0 = time.perf_counter()
    sid, _ = submit(calls, AGENT, GO + ': run the steps you are given.')
    t1 = time.perf_counter()
    outcome = wait_settled(calls, sid, timeout)
    return time.perf_counter() - t0, t1 - t0, outcome


def run_conversations(calls, n, in_flight, cap_s=None):
    """n conversations, in_flight at a time; returns (latencies, submit latencies, outcomes
    {name: count}, wall seconds). Stops starting new ones after cap_s."""
    lat, sub, outcomes = [], [], {}
    lock = threading.Lock()
    left = [n]
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                if left[0] <= 0 or (cap_s and time.perf_counter() - t0 > cap_s):
                    return
                left[0] -= 1
            # a conversation that cannot settle (a daemon died) waits at most until the cap
            wait_s = 60 if not cap_s else max(1.0, min(60.0, cap_s - (time.perf_counter() - t0)))
            try:
                dt, ds, oc = one_conversation(calls, timeout=wait_s)
            except grpc.RpcError as e:
                dt, ds, oc = None, None, 'rpc ' + e.code().name
            with lock:
                outcomes[oc] = outcomes.get(oc, 0) + 1
                if dt is not None:
                    lat.append(dt)
                    sub.append(ds)

    ts = [threading.Thread(target=worker) for _ in range(in_flight)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat, sub, outcomes, time.perf_counter() - t0


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float('nan')
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def ms(x):
    return '%.2f ms' % (x * 1000)


def verdict(ok):
    return 'meets target' if ok else 'MISSES target'


REPORT = Report('bench_engine')


def size(a, smoke, quick, full):
    """The size of a workload for --smoke, --quick or the full run."""
    return smoke if a.smoke else quick if a.quick else full


def fig(section, id, label, value, unit, baseline=None, baseline_label=None, ratio=None,
        target=None, meets=None):
    """Records one figure for --json (section N: id 'sN.id')."""
    REPORT.add('s%d.%s' % (section, id), label, value, unit, baseline, baseline_label, ratio,
               target, meets)


def line(label, value, target=None, ok=None):
    s = '  %-46s %s' % (label, value)
    if target is not None:
        s = '%-80s target %s' % (s, target)
        if ok is not None:
            s += '  [%s]' % verdict(ok)
    print(s)
    sys.stdout.flush()


def outcomes_text(outcomes):
    return ', '.join('%s %d' % kv for kv in sorted(outcomes.items()))


def model_requests(stack):
    try:
        return stack.fm.health().get('requests', 0)
    except Exception:
        return 0


# ---------------------------------------------------------------------------------------------
# Section 1: the model answering at once
# ---------------------------------------------------------------------------------------------


def replay_model_time(stack, bodies, reps=20):
    """The fake model's own time for one conversation: the three requests agentd sent, sent
    again directly (one keep-alive connection), median of reps each, summed."""
    conn = http.client.HTTPConnection('127.0.0.1', stack.fm.port, timeout=30)
    total = 0.0
    for body in bodies:
        data = json.dumps(body).encode()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.request('POST', '/v1/messages', body=data, headers={
                'content-type': 'application/json', 'x-api-key': 'bench',
                'anthropic-version': '2023-06-01'})
            r = conn.getresponse()
            r.read()
            samples.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError('the fake model answered a replay with %d' % r.status)
        total += statistics.median(samples)
    conn.close()
    return total


def tools_own_time(stack, reps=20):
    """The tools' own time for one conversation: its two calls (`bash echo hello`, `read` of the
    file) sent to toold directly with Tools.Execute, median of reps each, summed."""
    total = 0.0
    for name, args in (('bash', {'command': 'echo hello'}), ('read', {'path': BIG_FILE})):
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            stack.td.execute(AGENT, name, args)
            samples.append(time.perf_counter() - t0)
        total += statistics.median(samples)
    return total


def children_cpu_s(pid):
    """cutime + cstime: the CPU of the process's children it reaped (for toold: the commands
    its tools ran, toold-runner and bash), in seconds."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / float(os.sysconf('SC_CLK_TCK'))


def phase_cpu(stack, extra_pids=()):
    pids = dict(stack.pids())
    pids['fake model'] = stack.fm.proc.pid
    for k, v in extra_pids:
        pids[k] = v
    out = {k: cpu_s(p) for k, p in pids.items()}
    out['commands'] = children_cpu_s(stack.td.pid)
    return out


def cpu_delta(a, b):
    return {k: b[k] - a[k] for k in a}


def store_calls_from_log(text):
    calls = {}
    for m in re.finditer(r'event=rpc_stats method=/cflue\.v1\.Store/(\w+) calls=(\d+)', text):
        calls[m.group(1)] = calls.get(m.group(1), 0) + int(m.group(2))
    return calls


def section1(root, a):
    print('\n== 1. fake model answering at once (3-call scenario) ==')
    n_seq, n_tp = size(a, (5, 20), (100, 300), (300, 2000))
    stack = Stack(root, 's1', model_log=True, store_env={'CFLUE_RPC_STATS': '1'})
    conversations = 0
    try:
        # warm up, and capture the three requests agentd sends for one conversation
        for _ in range(3):
            _, _, oc = one_conversation(stack.calls, timeout=a.cap)
            conversations += 1
        reqs = [r for r in stack.fm.requests() if r.get('step') not in (None, 'finished')]
        bodies = [r['body'] for r in reqs[-3:]]
        stack.restart_model(log=False)
        model_conv = replay_model_time(stack, bodies)
        tools_conv = tools_own_time(stack)
        stats0 = stack.fm.stats()

        req0 = model_requests(stack)
        c0 = phase_cpu(stack)
        lat, _, outcomes, wall = run_conversations(stack.calls, n_seq, 1, cap_s=a.cap)
        c1 = phase_cpu(stack)
        conversations += n_seq
        reqs_per_conv = (model_requests(stack) - req0) / float(max(1, n_seq))
        cpu = cpu_delta(c0, c1)
        med = statistics.median(lat)
        print('  model: %s; %d sequential conversations (%s), %.2f model requests each'
              % (MODEL_HOW, n_seq, outcomes_text(outcomes), reqs_per_conv))
        line('Submit -> settled median, sequential', ms(med), '<= 8 ms', med <= 0.008)
        fig(1, 'settle_median', 'Submit -> settled median, sequential', med * 1000, 'ms',
            (model_conv + tools_conv) * 1000, "model's + tools' own time", target='<= 8 ms',
            meets=med <= 0.008)
        line('Submit -> settled p95, sequential', ms(pct(lat, 95)))
        line("fake model's own time per conversation", ms(model_conv) +
             ' (its 3 requests replayed directly, median of 20 each)')
        line("tools' own time per conversation", ms(tools_conv) +
             ' (bash echo hello and the read, sent to toold directly, median of 20 each)')
        line('engine time per conversation (median - model - tools)',
             ms(med - model_conv - tools_conv))
        daemon_total = 0.0
        for k in ('storaged', 'agentd', 'toold'):
            per = cpu[k] / n_seq
            daemon_total += per
            line('%s CPU per conversation' % k, ms(per))
        line('daemon CPU per conversation, summed', ms(daemon_total), '<= 4 ms',
             daemon_total <= 0.004)
        fig(1, 'daemon_cpu', 'daemon CPU per conversation', daemon_total * 1000, 'ms',
            cpu['commands'] / n_seq * 1000, "its tools' commands' CPU", target='<= 4 ms',
            meets=daemon_total <= 0.004)
        line('fake model CPU per conversation', ms(cpu['fake model'] / n_seq))
        line("tools' commands CPU per conversation", ms(cpu['commands'] / n_seq) +
             ' (toold-runner and bash, reaped by toold)')

        # throughput with 10 in flight
        c0 = phase_cpu(stack, [('client', os.getpid())])
        s0 = self_cpu_s()
        lat, _, outcomes, wall = run_conversations(stack.calls, n_tp, 10, cap_s=a.cap)
        c1 = phase_cpu(stack)
        client = self_cpu_s() - s0
        conversations += n_tp
        cpu = cpu_delta({k: v for k, v in c0.items() if k != 'client'}, c1)
        rate = len(lat) / wall
        share = lambda s: '%.0f%%' % (100.0 * s / (wall * NCPU))  # noqa: E731
        print('  %d conversations, 10 in flight, %.1f s (%s)'
              % (n_tp, wall, outcomes_text(outcomes)))
        line('conversations/s, 10 in flight', '%.1f/s' % rate, '>= 200/s', rate >= 200)
        fig(1, 'rate', 'conversations/s, 10 in flight', rate, '/s', target='>= 200/s',
            meets=rate >= 200)
        line('  CPU shares of %d cores' % NCPU,
             'fake model %s, client %s, storaged %s, agentd %s, toold %s, its commands %s'
             % (share(cpu['fake model']), share(client), share(cpu['storaged']),
                share(cpu['agentd']), share(cpu['toold']), share(cpu['commands'])))
        line('  Submit -> settled median / p95 at 10 in flight',
             '%s / %s' % (ms(statistics.median(lat)), ms(pct(lat, 95))))
        line('  daemon CPU per conversation, summed',
             ms(sum(cpu[k] for k in ('storaged', 'agentd', 'toold')) / max(1, len(lat))))

        # model connections
        stats1 = stack.fm.stats()
        # drives wait on the model without holding a thread, so up to 10 calls (one per
        # conversation in flight) run at once, each on its own HTTP/1.1 keep-alive connection
        concurrent = 10
        if stats0 is not None and stats1 is not None and 'connections' in stats1:
            conns = stats1['connections'] - stats0['connections']
            how = 'fake model GET /_stats over the two phases above'
            nconv = n_seq + n_tp
        else:
            # count agentd's connect(2) calls to the model port under strace, in a short phase
            n_c = 100
            trace = os.path.join(stack.dir, 'agentd.strace')
            stack.ad.close()
            stack.daemons.remove(stack.ad)
            stack.start_agentd(StracedAgentd, trace)
            lat_c, _, oc_c, _ = run_conversations(stack.calls, n_c, 10, cap_s=a.cap)
            conversations += n_c
            conns = stack.ad.connects_to(stack.fm.port)
            nconv = n_c
            how = ('connect(2) calls of agentd to the model port under strace -f --seccomp-bpf, '
                   '%d conversations at 10 in flight (the fake model has no /_stats)' % n_c)
        per100 = 100.0 * conns / max(1, nconv)
        line('model TCP connections per 100 conversations',
             '%.1f (%d for %d conversations)' % (per100, conns, nconv),
             '<= model calls at once (%d), not 300' % concurrent, conns <= concurrent)
        fig(1, 'model_connections', 'model connections, %d conversations' % nconv, conns, '',
            target='<= %d' % concurrent, meets=conns <= concurrent)
        print('    (%s)' % how)

        # storaged calls: its counters, logged when it stops
        stack.ad.terminate()
        stack.sd.terminate()
        calls = store_calls_from_log(stack.sd.stderr_text())
        total = sum(calls.values())
        per = total / float(conversations)
        line('storaged calls per conversation (all methods)', '%.1f' % per, '<= 8', per <= 8)
        fig(1, 'store_calls', 'storaged calls per conversation', per, '', target='<= 8',
            meets=per <= 8)
        top = sorted(calls.items(), key=lambda kv: -kv[1])
        print('    ' + ', '.join('%s %.1f' % (k, v / float(conversations)) for k, v in top if v))
        print('    (CFLUE_RPC_STATS over storaged\'s life: %d conversations including warm-up; '
              'the client waits with GetSubmission(wait): no storaged call when the agentd it '
              'asks drives the submission)' % conversations)
    finally:
        stack.close()


# ---------------------------------------------------------------------------------------------
# Section 2: the model answering after 1 s, N in flight
# ---------------------------------------------------------------------------------------------


def section2(root, a):
    n = size(a, 10, 100, 1000)
    delay_ms = 1000
    model_s = 3 * delay_ms / 1000.0
    print('\n== 2. fake model answering each call after 1 s: %d conversations in flight ==' % n)
    stack = Stack(root, 's2', model_delay_ms=delay_ms)
    try:
        pid = stack.ad.pid
        thr = Sampler(lambda: threads(pid))
        starts = {}
        lock = threading.Lock()
        cpu0, client0 = phase_cpu(stack), self_cpu_s()
        t0 = time.perf_counter()

        def one(_):
            w = time.time()
            try:
                sid, _ = submit(stack.calls, AGENT, GO + ': run the steps you are given.')
            except grpc.RpcError as e:
                return e.code().name
            with lock:
                starts[sid] = w
            return None

        with ThreadPoolExecutor(16) as ex:
            refused = [r for r in ex.map(one, range(n)) if r]
        submit_s = time.perf_counter() - t0
        done = {}
        while time.perf_counter() - t0 < a.cap:
            done = settled_times(stack.sd.stub, starts.keys())
            if len(done) >= len(starts):
                break
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        cpu, client = cpu_delta(cpu0, phase_cpu(stack)), self_cpu_s() - client0
        thr.stop()
        lat = [(done[s][0] / 1000.0 - starts[s]) for s in done]
        outcomes = {}
        for s in done:
            outcomes[done[s][1]] = outcomes.get(done[s][1], 0) + 1
        within = sum(1 for x in lat if x <= 1.5 * model_s)
        print('  model: %s, --delay-ms %d; all %d submitted in %.1f s%s'
              % (MODEL_HOW, delay_ms, len(starts), submit_s,
                 ('; Submit refused %d times' % len(refused)) if refused else ''))
        if len(done) < n:
            print('  did not finish: %d of %d settled after %.0f s (cap --cap %d s)'
                  % (len(done), n, wall, a.cap))
        else:
            print('  all %d settled in %.1f s (%s)' % (n, wall, outcomes_text(outcomes)))
        med = statistics.median(lat) if lat else float('nan')
        line('Submit -> settled median (of those settled)', '%.2f s' % med, '<= %.1f s'
             % (1.5 * model_s), len(done) == n and med <= 1.5 * model_s)
        fig(2, 'settle_median', 'Submit -> settled median, %d in flight, 1 s model' % n, med, 's',
            model_s, "the model's time (3 x 1 s)", target='<= 1.5x',
            meets=len(done) == n and med <= 1.5 * model_s)
        line('Submit -> settled max (of those settled)', '%.2f s' % (max(lat) if lat else 0))
        line('settled within 1.5x model time (%.1f s)' % (1.5 * model_s), '%d of %d' % (within, n),
             '%d of %d' % (n, n), within == n)
        fig(2, 'within', 'settled within 1.5x the model time, of %d' % n, within, '',
            target='%d' % n, meets=within == n)
        line("agentd threads, max sampled every 0.1 s", '%d' % thr.max, '< 64', thr.max < 64)
        line('  CPU per conversation, everything counted',
             ', '.join('%s %s' % (k, ms(v / max(1, n))) for k, v in
                       [('fake model', cpu['fake model']), ('client', client)] +
                       [(k, cpu[k]) for k in ('storaged', 'agentd', 'toold', 'commands')]))
        fig(2, 'threads', 'agentd threads, %d in flight' % n, thr.max, '', target='< 64',
            meets=thr.max < 64)
        print("    (settle times: storaged's settled_at_ms, polled with Store.List every 0.5 s)")
    finally:
        stack.close()


# ---------------------------------------------------------------------------------------------
# Section 3: idle watchers
# ---------------------------------------------------------------------------------------------


def submit_latencies(stack, n, cap_s=120):
    lat, sub, outcomes, _ = run_conversations(stack.calls, n, 1, cap_s=cap_s)
    return statistics.median(sub), statistics.median(lat), outcomes


def section3(root, a):
    w = size(a, 20, 500, 10000)
    n_lat = size(a, 5, 30, 30)
    print('\n== 3. %d idle Watch(follow) streams on one agentd ==' % w)
    nofile = raise_nofile()
    stack = Stack(root, 's3')
    channels, watchers = [], []
    try:
        convs = []
        for _ in range(10):
            sid, conv = submit(stack.calls, AGENT, GO + ': run the steps you are given.')
            wait_settled(stack.calls, sid)
            convs.append((conv, conversation_head(stack.calls, conv)))
        sub0, lat0, _ = submit_latencies(stack, n_lat)
        time.sleep(1)
        pid = stack.ad.pid
        rss0, rss_sd0, thr0 = rss_kib(pid), rss_kib(stack.sd.pid), threads(pid)

        per_channel = 500
        t0 = time.perf_counter()
        refused_at, why = None, ''
        for i in range(w):
            if i % per_channel == 0:
                ch = grpc.insecure_channel(stack.ad.target, options=H.channel_options() + [
                    ('grpc.use_local_subchannel_pool', 1)])
                channels.append((ch, agent_callables(ch)))
            conv, head = convs[i % len(convs)]
            watchers.append(watch(channels[-1][1], conv, head, timeout=a.cap + 600))
            if i % 100 == 99 or i == w - 1:
                time.sleep(0.2)
                dead = [c for c in watchers if c.done()]
                if dead:
                    refused_at = len(watchers) - len(dead)
                    why = '%s: %s' % (dead[0].code().name, dead[0].details())
                    break
            if time.perf_counter() - t0 > a.cap:
                break
        time.sleep(2)
        live = [c for c in watchers if not c.done()]
        dead = [c for c in watchers if c.done()]
        if dead and not why:
            why = '%s: %s' % (dead[0].code().name, dead[0].details())
        rss1, rss_sd1, thr1 = rss_kib(pid), rss_kib(stack.sd.pid), threads(pid)
        if refused_at is not None or dead:
            print('  streams refused after %d (of %d opened: %d live, %d ended; first ended '
                  'with %s)' % (refused_at if refused_at is not None else len(live),
                                len(watchers), len(live), len(dead), why))
        else:
            print('  %d watchers open in %.1f s on %d channels (RLIMIT_NOFILE %d)'
                  % (len(live), time.perf_counter() - t0, len(channels), nofile))
        alive = stack.ad.alive() and stack.sd.alive()
        if alive:
            sub1, lat1, oc1 = submit_latencies(stack, n_lat)
            line('Submit median without / with %d live watchers' % len(live),
                 '%s / %s' % (ms(sub0), ms(sub1)), 'within 1.5x', sub1 <= 1.5 * sub0 + 0.001)
            line('Submit -> settled median without / with', '%s / %s (%s)'
                 % (ms(lat0), ms(lat1), outcomes_text(oc1)), 'within 1.5x',
                 lat1 <= 1.5 * lat0 + 0.001)
            fig(3, 'submit', 'Submit median, %d idle watchers' % len(live), sub1 * 1000, 'ms',
                sub0 * 1000, 'without them', target='<= 1.5x', meets=sub1 <= 1.5 * sub0 + 0.001)
            fig(3, 'settle', 'Submit -> settled median, %d watchers' % len(live), lat1 * 1000,
                'ms', lat0 * 1000, 'without them', target='<= 1.5x',
                meets=lat1 <= 1.5 * lat0 + 0.001)
        else:
            print('  a daemon died with the watchers open: agentd %s, storaged %s'
                  % (stack.ad.alive(), stack.sd.alive()))
            REPORT.error('section 3: a daemon died with the watchers open')
        per = (rss1 - rss0) * 1024.0 / max(1, len(live))
        line('agentd RSS per live idle watcher', '%.1f KiB' % (per / 1024.0), '<= 16 KiB',
             len(live) == w and per <= 16 * 1024)
        fig(3, 'rss_per_watcher', 'agentd RSS per idle watcher, of %d' % w, per / 1024.0, 'KiB',
            target='<= 16 KiB', meets=len(live) == w and per <= 16 * 1024)
        line('  agentd RSS / threads before -> with watchers', '%d -> %d KiB, %d -> %d threads'
             % (rss0, rss1, thr0, thr1))
        line('  storaged RSS before -> with watchers', '%d -> %d KiB' % (rss_sd0, rss_sd1))
    finally:
        for c in watchers:
            c.cancel()
        for ch, _ in channels:
            ch.close()
        stack.close()


# ---------------------------------------------------------------------------------------------
# Section 4: idle RSS
# ---------------------------------------------------------------------------------------------


# the daemons give free memory back every 10 s (common/daemon.c), and agentd forgets the
# submissions it settled after 10 to 20 s (agentd/settled_here.c): "idle" is measured after both
IDLE_WAIT_S = 22
# conversations that fill the daemons' caches, connections and thread stacks first: the RSS
# after them is the one to compare with after the whole run (growth past them is per-work)
WARM_UP = 100


def pss_kib(pid):
    """Proportional set size: each shared page (the gRPC and curl libraries the three daemons
    map alike) counted as a share of the processes that map it."""
    try:
        with open('/proc/%d/smaps_rollup' % pid) as f:
            for ln in f:
                if ln.startswith('Pss:'):
                    return int(ln.split()[1])
    except OSError:
        pass
    return 0


PAGE = os.sysconf('SC_PAGE_SIZE')
PAGEMAP_PRESENT = 1 << 63
PAGEMAP_PFN = (1 << 55) - 1


def frames(pid):
    """The physical frames of pid's resident pages (/proc/PID/pagemap), or None where the
    frame numbers are hidden (they read as 0 without CAP_SYS_ADMIN)."""
    found = set()
    try:
        with open('/proc/%d/maps' % pid) as maps, open('/proc/%d/pagemap' % pid, 'rb') as pm:
            for ln in maps:
                lo, hi = (int(x, 16) for x in ln.split()[0].split('-'))
                if lo >= 1 << 47:  # [vsyscall]: not in the pagemap
                    continue
                pm.seek(lo // PAGE * 8)
                data = pm.read((hi - lo) // PAGE * 8)
                for (entry,) in struct.iter_unpack('<Q', data):
                    if entry & PAGEMAP_PRESENT:
                        found.add(entry & PAGEMAP_PFN)
    except OSError:
        return None
    return None if not found or found == {0} else found


def together_kib(pids):
    """The daemons' resident memory counted once: each physical page any of them maps, once
    (the libraries all three map are resident once, not three times). None where the frames
    are hidden (not root)."""
    union = set()
    for p in pids.values():
        f = frames(p)
        if f is None:
            return None
        union |= f
    return len(union) * PAGE // 1024


def memory(pids):
    """{name: (RSS, private anonymous RSS, PSS)} in KiB."""
    return {n: (rss_kib(p), H.proc_status_field(p, 'RssAnon'), pss_kib(p))
            for n, p in pids.items()}


def section4(root, a):
    k = size(a, 20, 1000, 10000)
    idle_wait = 1 if a.smoke else IDLE_WAIT_S
    print('\n== 4. idle RSS of the three daemons, after start and after %d conversations ==' % k)
    stack = Stack(root, 's4')
    try:
        time.sleep(idle_wait)
        pids = stack.pids()
        mem0 = memory(pids)
        tog0 = together_kib(pids)
        before = {n: m[0] for n, m in mem0.items()}
        done, outcomes, t0 = 0, {}, time.perf_counter()
        chunk = 500
        cap = max(a.cap, 600)
        warm, mem_w = min(WARM_UP, k // 2), None
        while done < k and time.perf_counter() - t0 < cap:
            if done >= warm and mem_w is None:
                time.sleep(idle_wait)
                mem_w = memory(pids)
            m = min(chunk, k - done, max(1, warm - done) if done < warm else chunk)
            lat, _, oc, _ = run_conversations(stack.calls, m, 10,
                                              cap_s=cap - (time.perf_counter() - t0))
            done += sum(oc.values())
            for kk, v in oc.items():
                outcomes[kk] = outcomes.get(kk, 0) + v
        wall = time.perf_counter() - t0
        time.sleep(idle_wait)
        mem1 = memory(pids)
        tog1 = together_kib(pids)
        after = {n: m[0] for n, m in mem1.items()}
        if done < k:
            print('  did not finish: %d of %d conversations after %.0f s' % (done, k, wall))
        else:
            print('  %d conversations at 10 in flight in %.0f s (%s)'
                  % (done, wall, outcomes_text(outcomes)))
        for n in ('storaged', 'agentd', 'toold'):
            line('%s RSS idle after start -> after' % n, '%.1f -> %.1f MiB (%+.1f)'
                 % (before[n] / 1024.0, after[n] / 1024.0, (after[n] - before[n]) / 1024.0))
        b, f = sum(before.values()) / 1024.0, sum(after.values()) / 1024.0
        line('summed, after start', '%.1f MiB' % b, '<= 30 MiB', b <= 30)
        line('summed, after %d conversations' % done, '%.1f MiB (%+.1f MiB)' % (f, f - b),
             '<= 30 MiB, within +-1 MiB', f <= 30 and abs(f - b) <= 1)
        fig(4, 'rss_start', "daemons' RSS summed, idle after start", b, 'MiB',
            target='<= 30 MiB', meets=b <= 30)
        fig(4, 'rss_after', "daemons' RSS summed, idle after %d conv." % done, f, 'MiB', b,
            'after start', target='<= 30 MiB, +-1', meets=f <= 30 and abs(f - b) <= 1)
        if tog0 is None or tog1 is None:
            line('  together (each physical page once)', 'not measured: reading page frames '
                 'needs root')
        else:
            line('  together (each physical page once), start -> after', '%.1f -> %.1f MiB '
                 '(%+.1f)' % (tog0 / 1024.0, tog1 / 1024.0, (tog1 - tog0) / 1024.0))
            fig(4, 'rss_together', "daemons' pages counted once, idle after %d conv." % done,
                tog1 / 1024.0, 'MiB', f, 'RSS summed')
        if mem_w is not None:
            w = sum(m[0] for m in mem_w.values()) / 1024.0
            line('  summed, after the first %d -> after %d' % (warm, done), '%.1f -> %.1f MiB '
                 '(%+.1f: what the work adds past the caches and stacks it first fills)'
                 % (w, f, f - w))
            fig(4, 'rss_past_warm_up', "daemons' RSS summed, idle after %d conv." % done, f,
                'MiB', w, 'after the first %d' % warm)
        for i, what in ((1, 'private (RssAnon)'), (2, 'PSS (shared pages shared out)')):
            b2 = sum(m[i] for m in mem0.values()) / 1024.0
            f2 = sum(m[i] for m in mem1.values()) / 1024.0
            line('  summed %s, start -> after' % what, '%.1f -> %.1f MiB (%+.1f)'
                 % (b2, f2, f2 - b2))
    finally:
        stack.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true', help='N=100, W=500, K=1000')
    ap.add_argument('--smoke', action='store_true',
                    help='the smallest sizes: shows that every section runs, nothing more')
    ap.add_argument('--json', help='also write the key figures here as JSON')
    ap.add_argument('--build', help='build directory (default $CFLUE_BUILD_DIR or build/)')
    ap.add_argument('--sections', default='1,2,3,4')
    ap.add_argument('--cap', type=int, default=120,
                    help='seconds a section that cannot reach its goal may run (default 120)')
    a = ap.parse_args()
    for b in (H.STORAGED_BIN, H.AGENTD_BIN):
        if not os.path.exists(b):
            sys.exit('bench_engine: %s is not built (set CFLUE_BUILD_DIR or --build)' % b)
    print('bench_engine %s: build %s, %d cores, %s' % ('--smoke' if a.smoke else
                                                       '--quick' if a.quick else '(full)',
                                                       H.BUILD_DIR, NCPU,
                                                       time.strftime('%Y-%m-%d %H:%M')))
    root = tempfile.mkdtemp(prefix='cflue-bench-engine-')
    t0 = time.time()
    try:
        for s in a.sections.split(','):
            try:
                {'1': section1, '2': section2, '3': section3, '4': section4}[s.strip()](root, a)
            except (H.StoragedExited, H.AgentdExited, H.TooldExited, H.FakeModelExited,
                    AssertionError, RuntimeError, grpc.RpcError) as e:
                print('  section %s stopped: %s' % (s, str(e).split('\n')[0]))
                REPORT.error('section %s stopped: %s' % (s, str(e).split('\n')[0]))
    except BaseException as e:
        REPORT.error('%s: %s' % (type(e).__name__, e))
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
        REPORT.write(a.json)
    print('\ntotal %.0f s' % (time.time() - t0))


if __name__ == '__main__':
    main()
