#!/usr/bin/python3
"""cflue's chaos harness: a bounded workload through the public Agent API while a nemesis
kills, pauses and cuts off the daemons, then a checker that counts broken promises.

    tests/chaos/run [--long] [--seed N] [--build-dir DIR] [--workdir DIR] [--keep]

See docs/chaos.md for the workload, the fault kinds, the invariants and the bound.
Exit status: 0 when there are no violations and every fault quota was met; 1 otherwise;
2 when the stack could not be started.
"""

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

FAILPOINTS = {
    'storaged.commit.before': 'storaged',
    'storaged.commit.after': 'storaged',
    'agentd.model.after': 'agentd',
    'agentd.tools.before_record': 'agentd',
    'agentd.settle.before': 'agentd',
    'agentd.settle.after': 'agentd',
    'toold.tool.after_run': 'toold',
}

FORMS = {
    # submissions, faults, outages >= 6 s, sigstops past the lease, toold down at drive start,
    # client threads, settle bound (s)
    'short': dict(submissions=500, faults=40, long_outages=5, sigstops=3, toold_starts=2,
                  clients=10, bound_s=90),
    # the sanitizer build's (CI's ASan stage): every kind of fault and failpoint, at half the
    # short form's counts; the daemons' code under ASan is the short form's
    'brief': dict(submissions=250, faults=20, long_outages=3, sigstops=2, toold_starts=1,
                  clients=10, bound_s=90),
    'long': dict(submissions=10000, faults=300, long_outages=30, sigstops=20, toold_starts=10,
                 clients=12, bound_s=90),
}

LEASE_MS = 3000
HEARTBEAT_MS = 1000
AGENT = 'chaos'
FAILPOINT_RE = re.compile(r'failpoint_crash\S*\s.*?point=([A-Za-z0-9_.]+)')


def log(msg):
    sys.stdout.write('[chaos %s] %s\n' % (time.strftime('%H:%M:%S'), msg))
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------

class Stack(object):
    def __init__(self, H, workdir, n_agentd=2, workers=6):
        self.H = H
        self.dir = workdir
        self.locks = {}
        self.down = set()       # daemons the nemesis keeps down on purpose
        self.armed = {}         # daemon name -> failpoint armed at its current start
        self.restarts = collections.Counter()
        self.sd = H.Storaged(workdir=self._sub('storaged'), start=False)
        self.td = H.Toold(workdir=self._sub('toold'), start=False)
        self.fm = ChaosModel(H, workdir=self._sub('fake_model'))
        models = os.path.join(self.dir, 'models.json')
        with open(models, 'w') as f:
            json.dump({'models': {'anthropic/chaos-1': {
                'context_window': 50000000, 'max_output_tokens': 4096,
                'input_usd_per_mtok': 0, 'output_usd_per_mtok': 0}}}, f)
        self.agents_dir = self._sub('agents')
        with open(os.path.join(self.agents_dir, AGENT + '.md'), 'w') as f:
            f.write('---\nname: %s\ndescription: chaos harness workload agent\n'
                    'model: anthropic/chaos-1\nsandbox:\n  tools: "%s"\n'
                    '  workspace: "{conversation}"\ndurability:\n  max_attempts: 40\n'
                    '  timeout_ms: 1800000\n---\n\nYou follow the plan in each message.\n'
                    % (AGENT, self.td.target if self.td.target else 'unix:' + self.td.sock))
        env = {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url,
               'ANTHROPIC_API_KEY': 'chaos-key'}
        self.agentds = []
        for i in range(n_agentd):
            self.agentds.append(H.Agentd('unix:' + self.sd.sock, self.agents_dir,
                                         owner_id='chaos-agentd-%d' % i, env=env,
                                         extra_args=['--lease-ms', str(LEASE_MS),
                                                     '--heartbeat-ms', str(HEARTBEAT_MS),
                                                     '--workers', str(workers),
                                                     '--models', models],
                                         workdir=self._sub('agentd%d' % i), start=False))
        self.daemons = collections.OrderedDict([('storaged', self.sd), ('toold', self.td)])
        for i, ad in enumerate(self.agentds):
            self.daemons['agentd%d' % i] = ad
        for name in self.daemons:
            self.locks[name] = threading.RLock()
        for name in self.daemons:
            self.start(name)

    def _sub(self, name):
        p = os.path.join(self.dir, name)
        os.makedirs(p, exist_ok=True)
        return p

    def start(self, name, failpoint=None):
        """(Re)starts a daemon, with a failpoint armed or none; retries a failed start."""
        d = self.daemons[name]
        with self.locks[name]:
            d.env.pop('CFLUE_FAILPOINTS', None)
            if failpoint:
                d.env['CFLUE_FAILPOINTS'] = failpoint
            self.armed[name] = failpoint
            last = None
            for _ in range(5):
                try:
                    d.kill()
                    d.start(timeout=20)
                    self.restarts[name] += 1
                    return True
                except Exception as e:  # a failpoint may fire during start-up
                    last = e
                    time.sleep(0.5)
            log('could not start %s: %s' % (name, str(last)[:300]))
            return False

    def kill(self, name):
        with self.locks[name]:
            self.daemons[name].kill()

    def alive(self, name):
        return self.daemons[name].alive()

    def failpoints_hit(self):
        hits = collections.Counter()
        for name, d in self.daemons.items():
            for m in FAILPOINT_RE.finditer(d.stderr_text()):
                hits[m.group(1)] += 1
        return hits

    def close(self):
        for d in list(self.daemons.values()) + [self.fm]:
            try:
                if d.proc is not None and d.proc.poll() is None:
                    os.kill(d.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            try:
                d.close()
            except Exception:
                pass

    def workspace_ledger(self, conv):
        path = os.path.join(os.path.realpath(self.td.root), conv, 'chaos-ledger.txt')
        try:
            with open(path, errors='replace') as f:
                return [l.rstrip('\n') for l in f if l.strip()]
        except (IOError, OSError):
            return []


def make_chaos_model(H):
    class _ChaosModel(H.FakeModel):
        """The fake model with the chaos brain and no request log (bodies get large)."""

        def command(self):
            return [H.FAKE_MODEL_PYTHON, H.FAKE_MODEL_PY, '--port', '0', '--brain', 'chaos',
                    '--quiet']
    return _ChaosModel


def ChaosModel(H, workdir):
    return make_chaos_model(H)(workdir=workdir)


# ---------------------------------------------------------------------------------------------
# the client (workload)
# ---------------------------------------------------------------------------------------------

class Client(object):
    """Drives the workload through the Agent API and logs every acknowledged Submit."""

    def __init__(self, H, stack, rng_seed, target, threads, log_path):
        self.H = H
        self.stack = stack
        self.seed = rng_seed
        self.target = target
        self.n_threads = threads
        self.lock = threading.Lock()
        self.acks = []
        self.unacked = []
        self.aborts = []
        self.watched = {}
        self.convs = []
        self.next_conv = 0
        self.stop_new = threading.Event()
        self.threads = []
        self.errors = collections.Counter()
        self.log_f = open(log_path, 'w')
        self.last_ack = time.monotonic()

    # -- calls with failover between the agentds --

    def _agentd(self, rng):
        ads = list(self.stack.agentds)
        rng.shuffle(ads)
        return ads

    def call(self, rng, fn, give_up_s=120):
        """fn(agentd) -> result; retried on any RPC error, on either agentd, until give_up_s."""
        deadline = time.monotonic() + give_up_s
        delay = 0.1
        while True:
            for ad in self._agentd(rng):
                try:
                    return fn(ad)
                except self.H.grpc.RpcError as e:
                    code = e.code()
                    with self.lock:
                        self.errors[code.name if code else 'none'] += 1
                    if code in (self.H.grpc.StatusCode.INVALID_ARGUMENT,
                                self.H.grpc.StatusCode.NOT_FOUND,
                                self.H.grpc.StatusCode.ALREADY_EXISTS):
                        raise
                except RuntimeError:  # channel not there yet
                    pass
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _record(self, entry):
        with self.lock:
            self.log_f.write(json.dumps(entry) + '\n')
            self.log_f.flush()

    def submit(self, rng, conv, tag, plan, resend=False):
        text = 'chaos tag=%s plan=%s' % (tag, plan)
        key = 'k-' + tag
        tries = [0]

        def fn(ad):
            tries[0] += 1
            return ad.submit(AGENT, text, conversation_id=conv, idempotency_key=key, timeout=8)
        adm = self.call(rng, fn)
        if adm is None:
            with self.lock:
                self.unacked.append(key)
            self._record({'event': 'submit_gave_up', 'key': key, 'conv': conv})
            return None
        entry = {'event': 'ack', 'key': key, 'tag': tag, 'conv': conv,
                 'sid': adm.submission_id, 'dedup': bool(adm.deduplicated),
                 'retried': tries[0] > 1, 'resend': resend, 't': time.time()}
        with self.lock:
            self.acks.append(entry)
            self.last_ack = time.monotonic()
        self._record(entry)
        return adm

    def abort(self, rng, conv=None, sid=None):
        def fn(ad):
            # the request's oneof target: the conversation when given, else the submission
            return ad.abort(submission_id=sid or '', conversation_id=conv or '', timeout=8)
        r = self.call(rng, fn, give_up_s=30)
        entry = {'event': 'abort', 'conv': conv, 'sid': sid, 't': time.time(),
                 'affected': list(r.affected) if r is not None else None}
        with self.lock:
            self.aborts.append(entry)
        self._record(entry)

    def watch(self, rng, conv):
        def fn(ad):
            return [(r.offset, r.id) for r in ad.watch_all(conv, -1, timeout=15)]
        got = self.call(rng, fn, give_up_s=20)
        if got is not None:
            with self.lock:
                self.watched[conv] = got

    def wait(self, rng, sid, timeout):
        def fn(ad):
            return ad.get_submission(sid, wait=True, timeout=timeout)
        return self.call(rng, fn, give_up_s=timeout)

    # -- the workload --

    def n_acked(self):
        with self.lock:
            return len(set(a['sid'] for a in self.acks))

    @staticmethod
    def plan(rng):
        steps = []
        for _ in range(rng.choice((0, 1, 1, 2, 2, 3, 4))):
            x = rng.random()
            if x < 0.35:
                steps.append('l')
            elif x < 0.55:
                steps.append('s%d' % rng.choice((500, 1000, 2000, 3000, 4000)))
            elif x < 0.70:
                steps.append('o%d' % rng.choice((20000, 60000, 200000, 1000000)))
            elif x < 0.80:
                steps.append('r')
            else:
                steps.append('p')
        return '.'.join(steps) or '-'

    def new_conv(self):
        with self.lock:
            n = self.next_conv
            self.next_conv += 1
        conv = 'cx%04d-%s' % (n, '%08x' % (self.seed & 0xffffffff))
        with self.lock:
            self.convs.append(conv)
        return conv, n

    def session(self, rng, conv, n, messages):
        last = None
        sent = []
        for j in range(messages):
            if self.stop_new.is_set():
                break
            tag = 'm%04d.%02d' % (n, j)
            plan = self.plan(rng)
            adm = self.submit(rng, conv, tag, plan)
            if adm is None:
                continue
            sent.append((tag, plan, adm.submission_id))
            last = adm.submission_id
            x = rng.random()
            if x < 0.08 and sent:
                # a duplicate of an acknowledged Submit: same key and payload
                t, p, _ = rng.choice(sent)
                self.submit(rng, conv, t, p, resend=True)
            if 0.08 <= x < 0.12:
                self.abort(rng, conv=conv)
            elif 0.12 <= x < 0.15:
                self.abort(rng, sid=last)
            y = rng.random()
            if y < 0.4:
                continue  # a burst: the next message probably joins
            elif y < 0.75:
                self.wait(rng, last, timeout=20)
            else:
                time.sleep(rng.uniform(0, 1.5))
        if rng.random() < 0.3:
            self.watch(rng, conv)

    def worker(self, k):
        rng = random.Random('%d-client-%d' % (self.seed, k))
        try:
            while not self.stop_new.is_set():
                conv, n = self.new_conv()
                self.session(rng, conv, n, rng.randint(3, 12))
        except Exception:
            log('client %d crashed:\n%s' % (k, traceback.format_exc()))
            with self.lock:
                self.errors['client_crash'] += 1

    def start(self):
        for k in range(self.n_threads):
            t = threading.Thread(target=self.worker, args=(k,), daemon=True)
            t.start()
            self.threads.append(t)

    def first_messages(self, rng, count):
        """The nemesis's 'toold unreachable at drive start': new conversations right now."""
        out = []
        for _ in range(count):
            conv, n = self.new_conv()
            adm = self.submit(rng, conv, 'm%04d.00' % n, rng.choice(('l', 'p', 'l.r', 's500.l')),
                              )
            if adm is not None:
                out.append(adm.submission_id)
        return out

    def join(self):
        for t in self.threads:
            t.join()


# ---------------------------------------------------------------------------------------------
# the nemesis
# ---------------------------------------------------------------------------------------------

class Nemesis(object):
    def __init__(self, stack, client, seed, form):
        self.stack = stack
        self.client = client
        self.rng = random.Random('%d-nemesis' % seed)
        self.form = form
        self.faults = collections.Counter()
        self.events = []
        self.outages = []
        self.sigstops = []
        self.stop = threading.Event()
        self.monitor_stop = threading.Event()
        self.paused = set()
        self.crashes = []  # daemons that died without us or an armed failpoint

    def note(self, kind, detail):
        self.faults[kind] += 1
        self.events.append((time.time(), kind, detail))
        log('fault %-22s %s' % (kind, detail))

    def schedule(self):
        """The fault kinds, in a seeded order that meets every quota."""
        f = self.form
        kinds = ['failpoint:' + p for p in FAILPOINTS]
        kinds += ['outage_long'] * f['long_outages']
        kinds += ['outage_short'] * max(2, f['long_outages'] // 2)
        kinds += ['sigstop'] * f['sigstops']
        kinds += ['toold_down_at_start'] * f['toold_starts']
        total = int(f['faults'] * 1.1) + 2
        while len(kinds) < total:
            kinds.append(self.rng.choice(['kill', 'kill', 'kill', 'outage_short',
                                          'failpoint:' + self.rng.choice(sorted(FAILPOINTS))]))
        self.rng.shuffle(kinds)
        return kinds

    def monitor(self):
        """Restarts daemons that died on their own (a failpoint fired)."""
        while not self.monitor_stop.is_set():
            for name in list(self.stack.daemons):
                with self.stack.locks[name]:
                    if name in self.stack.down or self.stack.alive(name):
                        continue
                    fp = self.stack.armed.get(name)
                    d = self.stack.daemons[name]
                    rc = d.proc.returncode if d.proc is not None else None
                    self.events.append((time.time(), 'died', '%s (armed %s)' % (name, fp)))
                    log('%s died (armed: %s, exit %s); restarting' % (name, fp, rc))
                    if not (fp and rc == -signal.SIGKILL):
                        tail = d.stderr_text().strip().splitlines()[-3:]
                        self.crashes.append('%s exited with %s (no failpoint armed for it): %s'
                                            % (name, rc, ' | '.join(tail)[-600:]))
                    self.stack.start(name)
            time.sleep(0.2)

    def agentd_names(self):
        return [n for n in self.stack.daemons if n.startswith('agentd')]

    def run(self):
        kinds = self.schedule()
        i = 0
        while not self.stop.is_set():
            if i < len(kinds):
                kind = kinds[i]
            elif self.client.n_acked() < self.client.target:
                kind = self.rng.choice(['kill', 'outage_short', 'sigstop'])
            else:
                break
            i += 1
            try:
                self.inject(kind)
            except Exception:
                log('nemesis error:\n' + traceback.format_exc())
            time.sleep(self.rng.uniform(1.0, 4.0))
        # faults stop: every daemon up, nothing armed
        for name in self.stack.daemons:
            if self.stack.armed.get(name) or not self.stack.alive(name):
                self.stack.start(name)

    def inject(self, kind):
        rng = self.rng
        names = list(self.stack.daemons)
        if kind == 'kill':
            name = rng.choice(names)
            with self.stack.locks[name]:  # the monitor must not restart it meanwhile
                self.stack.kill(name)
                time.sleep(rng.uniform(0, 0.5))
                self.stack.start(name)
            self.note('kill', name)
        elif kind.startswith('outage'):
            name = rng.choice(names)
            secs = rng.uniform(6, 15) if kind == 'outage_long' else rng.uniform(2, 5.9)
            self.outage(name, secs)
        elif kind == 'sigstop':
            name = rng.choice(self.agentd_names())
            d = self.stack.daemons[name]
            secs = (LEASE_MS + HEARTBEAT_MS) / 1000.0 + rng.uniform(1, 4)
            with self.stack.locks[name]:
                if not d.alive():
                    self.stack.start(name)
                pid = d.pid
                os.kill(pid, signal.SIGSTOP)
                self.stack.down.add(name)  # the monitor must not restart it meanwhile
            self.note('sigstop', '%s pid %d for %.1f s (lease %d ms)' % (name, pid, secs,
                                                                           LEASE_MS))
            time.sleep(secs)
            with self.stack.locks[name]:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
                self.stack.down.discard(name)
            self.sigstops.append(secs)
        elif kind == 'toold_down_at_start':
            secs = rng.uniform(3, 6)
            with self.stack.locks['toold']:
                self.stack.down.add('toold')
                self.stack.kill('toold')
            self.note('toold_down_at_start', 'toold down %.1f s while new conversations start'
                      % secs)
            t0 = time.monotonic()
            self.client.first_messages(rng, 3)
            time.sleep(max(0, secs - (time.monotonic() - t0)))
            with self.stack.locks['toold']:
                self.stack.down.discard('toold')
                self.stack.start('toold')
        elif kind.startswith('failpoint:'):
            point = kind.split(':', 1)[1]
            target = FAILPOINTS[point]
            name = rng.choice(self.agentd_names()) if target == 'agentd' else target
            n = rng.randint(1, 40) if point.startswith('storaged') else rng.randint(1, 4)
            spec = '%s=crash:%d' % (point, n)
            self.stack.start(name, failpoint=spec)
            self.note('failpoint_armed', '%s on %s (restarted)' % (spec, name))
            # wait (bounded) for it to fire; the monitor restarts the daemon unarmed
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline and self.stack.armed.get(name) == spec:
                time.sleep(0.2)
            if self.stack.armed.get(name) == spec:
                self.stack.start(name)  # did not fire in time: restart unarmed
                self.events.append((time.time(), 'failpoint_timeout', spec))
                log('failpoint %s did not fire within 25 s' % spec)
        else:
            raise ValueError(kind)

    def outage(self, name, secs):
        with self.stack.locks[name]:
            self.stack.down.add(name)
            self.stack.kill(name)
        self.note('outage_long' if secs >= 6 else 'outage_short',
                  '%s down %.1f s' % (name, secs))
        time.sleep(secs)
        with self.stack.locks[name]:
            self.stack.down.discard(name)
            self.stack.start(name)
        self.outages.append((name, secs))


# ---------------------------------------------------------------------------------------------
# reading the final state
# ---------------------------------------------------------------------------------------------

def _enum_name(enum, value, prefix):
    """An enum value's name without its prefix ('COMPLETED' for OUTCOME_COMPLETED)."""
    name = enum.Name(value)
    return name[len(prefix):] if name.startswith(prefix) else name


def read_ledger(H, stack):
    stub = stack.sd.stub
    subs = {}
    for s in H.list_all(stub, page=500):
        subs[s.submission_id] = {
            'submission_id': s.submission_id, 'conversation_id': s.conversation_id,
            'sequence': s.sequence,
            'status': _enum_name(H.common_pb2.SubmissionStatus, s.status, 'SUBMISSION_STATUS_'),
            'outcome': _enum_name(H.common_pb2.Outcome, s.outcome, 'OUTCOME_'), 'error': s.error,
            'answered_by': s.answered_by, 'joined_into': s.joined_into,
            'attempt_count': s.attempt_count, 'max_attempts': s.max_attempts,
            'abort_request_time_ms': H.ts_ms(s.abort_request_time),
            'settle_time_ms': H.ts_ms(s.settle_time)}
    return subs


def record_body(H, rec):
    """A record's type (its body's oneof name, None when unset) and the typed body as plain
    data for the checker: fields by their proto names, turn always present, a settlement's
    outcome by its name without the prefix ('COMPLETED'); a tool result's text left out
    (large, and never needed)."""
    from google.protobuf import json_format  # with the generated modules' path set up
    kind = rec.WhichOneof('body')
    if kind is None:
        return None, {}
    msg = getattr(rec, kind)
    body = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    if kind in ('assistant_delta', 'assistant_message', 'tool_result'):
        body['turn'] = msg.turn  # MessageToDict leaves out zero values
    if kind == 'tool_result':
        body.pop('text', None)
    if kind == 'submission_settled':
        body['outcome'] = _enum_name(H.common_pb2.Outcome, msg.outcome, 'OUTCOME_')
    return kind, body


def read_records(H, stack, conv):
    out = []
    for rec in H.read_all(stack.sd.stub, conv):
        kind, body = record_body(H, rec)
        out.append({'offset': rec.offset, 'id': rec.id, 'type': kind,
                    'submission_id': rec.submission_id, 'attempt_id': rec.attempt_id,
                    'create_time_ms': H.ts_ms(rec.create_time), 'body': body})
    return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description='cflue chaos harness (docs/chaos.md)')
    ap.add_argument('--long', action='store_true', help='the long form (10,000 submissions, '
                    '300 faults); the same as --form long')
    ap.add_argument('--form', choices=sorted(FORMS), default=None,
                    help='short (the default: 500 submissions, 40 faults), brief (half the '
                    'short form: the sanitizer build\'s) or long')
    ap.add_argument('--seed', type=int, default=None, help='seed of every random choice')
    ap.add_argument('--build-dir', default=None,
                    help='the C build ($CFLUE_BUILD_DIR, else <repo>/build)')
    ap.add_argument('--workdir', default=None, help='where the daemons keep their data')
    ap.add_argument('--keep', action='store_true', help='keep the work directory')
    ap.add_argument('--submissions', type=int, default=None, help='override the form')
    ap.add_argument('--faults', type=int, default=None, help='override the form')
    args = ap.parse_args(argv)

    if args.long and args.form not in (None, 'long'):
        ap.error('--long and --form %s disagree' % args.form)
    form_name = 'long' if args.long else args.form or 'short'
    form = dict(FORMS[form_name])
    if args.submissions is not None:
        form['submissions'] = args.submissions
    if args.faults is not None:
        form['faults'] = args.faults
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2 ** 31)
    if args.build_dir:
        os.environ['CFLUE_BUILD_DIR'] = os.path.abspath(args.build_dir)
    sys.path.insert(0, os.path.join(REPO, 'tests', 'integration'))
    sys.path.insert(0, HERE)
    import cflue_harness as H
    import checker

    workdir = args.workdir or tempfile.mkdtemp(prefix='cflue-chaos-')
    os.makedirs(workdir, exist_ok=True)
    log('form %s seed %d build %s workdir %s' % (form_name, seed,
                                                 H.BUILD_DIR, workdir))
    log('to replay: tests/chaos/run --form %s --seed %d' % (form_name, seed))
    t_start = time.monotonic()
    try:
        stack = Stack(H, workdir)
    except Exception as e:
        log('cannot start the stack: %s' % e)
        return 2
    client = Client(H, stack, seed, form['submissions'], form['clients'],
                    os.path.join(workdir, 'client-log.jsonl'))
    nem = Nemesis(stack, client, seed, form)
    mon = threading.Thread(target=nem.monitor, daemon=True)
    mon.start()
    rc = 1
    try:
        client.start()
        nem.run()
        client.stop_new.set()
        t_faults_stop = time.monotonic()
        log('faults stopped after %.0f s; %d submissions acknowledged; waiting for the clients'
            % (t_faults_stop - t_start, client.n_acked()))
        client.join()
        nem.monitor_stop.set()
        mon.join()
        for name in stack.daemons:
            if not stack.alive(name):
                stack.start(name)
        t0 = max(t_faults_stop, client.last_ack)
        bound = form['bound_s']
        acked = set(a['sid'] for a in client.acks)
        pending = set(acked)
        while True:
            try:
                subs = read_ledger(H, stack)
                pending = set(s for s in acked if s not in subs or subs[s]['status'] != 'SETTLED')
            except H.grpc.RpcError as e:
                log('List failed: %s' % e.code())
            if not pending or time.monotonic() - t0 > bound:
                break
            time.sleep(1)
        settle_s = time.monotonic() - t0
        log('after faults stopped: %s in %.1f s (bound %d s)'
            % ('all settled' if not pending else '%d unsettled' % len(pending), settle_s, bound))
        subs = read_ledger(H, stack)
        convs = sorted(set(s['conversation_id'] for s in subs.values()))
        records = {c: read_records(H, stack, c) for c in convs}
        side = {c: stack.workspace_ledger(c) for c in convs}
        violations, notes = checker.check(client.acks, subs, records, side, client.watched,
                                          sorted(pending))
        rc = report(stack, client, nem, form, subs, records, side, violations, notes,
                    time.monotonic() - t_start, settle_s, seed, form_name)
    finally:
        nem.stop.set()
        nem.monitor_stop.set()
        stack.close()
        if not args.keep and rc == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log('work directory kept: %s' % workdir)
    return rc


def report(stack, client, nem, form, subs, records, side, violations, notes, elapsed, settle_s,
           seed, form_name):
    out = []
    p = out.append
    acked = set(a['sid'] for a in client.acks)
    p('==== chaos %s form, seed %d, %.0f s ====' % (form_name, seed, elapsed))
    outcomes = collections.Counter(subs[s]['outcome'] for s in acked if s in subs)
    joined = sum(1 for s in acked if s in subs and subs[s]['answered_by'] not in ('', s))
    p('submissions checked: %d acknowledged (%d in the ledger), %d conversations, %d joined, '
      'outcomes %s' % (len(acked), len(subs), len(records), joined, dict(outcomes)))
    failed = sorted(s for s in acked if s in subs and subs[s]['outcome'] == 'FAILED')
    for sid in failed[:5]:  # not a violation, but worth a look: why did it fail?
        p('  failed: %s after %d of %d attempts: %s'
          % (sid, subs[sid]['attempt_count'], subs[sid]['max_attempts'], subs[sid]['error']))
    p('client: %d acks (%d deliberate duplicates, %d after retries), %d Submits given up, '
      '%d aborts, %d watches, RPC errors %s'
      % (len(client.acks), sum(1 for a in client.acks if a['resend']),
         sum(1 for a in client.acks if a['retried']), len(client.unacked), len(client.aborts),
         len(client.watched), dict(client.errors)))
    n_faults = sum(v for k, v in nem.faults.items() if k != 'failpoint_armed')
    hits = stack.failpoints_hit()
    n_faults += sum(hits.values())
    p('faults injected: %d  by kind: %s' % (n_faults, dict(sorted(nem.faults.items()))))
    p('failpoints hit: %s' % dict(sorted(hits.items())))
    long_outages = sum(1 for _, s in nem.outages if s >= 6)
    p('outages: %d (%d of 6 s or more; longest %.1f s); sigstops past the lease: %d'
      % (len(nem.outages), long_outages, max([s for _, s in nem.outages] or [0]),
         len(nem.sigstops)))
    p('daemon starts: %s' % dict(stack.restarts))
    lines = sum(len(v) for v in side.values())
    p('side-effect ledger: %d command runs in %d workspaces' % (lines, len(side)))
    p('settled %.1f s after faults stopped (bound %d s)' % (settle_s, form['bound_s']))
    quota = []
    if len(acked) < form['submissions']:
        quota.append('submissions %d < %d' % (len(acked), form['submissions']))
    if n_faults < form['faults']:
        quota.append('faults %d < %d' % (n_faults, form['faults']))
    if long_outages < form['long_outages']:
        quota.append('outages of 6 s or more %d < %d' % (long_outages, form['long_outages']))
    if len(nem.sigstops) < form['sigstops']:
        quota.append('sigstops %d < %d' % (len(nem.sigstops), form['sigstops']))
    missing = [fp for fp in FAILPOINTS if not hits.get(fp)]
    if missing:
        quota.append('failpoints never hit: %s' % ', '.join(missing))
    import checker
    total = 0
    p('violations:')
    for cat, desc in checker.CATEGORIES:
        lst = violations.get(cat, [])
        total += len(lst)
        p('  %-26s %5d  %s' % (cat, len(lst), desc))
        for ex in lst[:8]:
            p('      e.g. ' + ex)
    for cat, lst in sorted(notes.items()):
        p('  note %-21s %5d' % (cat, len(lst)))
        for ex in lst[:5]:
            p('      e.g. ' + ex)
    p('  %-26s %5d  %s' % ('daemon_crash', len(nem.crashes),
                             'a daemon died on its own (not killed, no failpoint armed)'))
    for ex in nem.crashes[:8]:
        p('      e.g. ' + ex)
    total += len(nem.crashes)
    p('total violations: %d' % total)
    if quota:
        p('fault quotas NOT met: ' + '; '.join(quota))
    ok = total == 0 and not quota
    p('RESULT: %s' % ('PASS' if ok else 'FAIL'))
    text = '\n'.join(out)
    sys.stdout.write(text + '\n')
    sys.stdout.flush()
    try:
        with open(os.path.join(stack.dir, 'report.txt'), 'w') as f:
            f.write(text + '\n')
            for cat, lst in sorted(violations.items()):
                f.write('\n== %s ==\n' % cat)
                f.write('\n'.join(lst) + '\n')
            for cat, lst in sorted(notes.items()):
                f.write('\n== note %s ==\n' % cat)
                f.write('\n'.join(lst) + '\n')
    except IOError:
        pass
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
