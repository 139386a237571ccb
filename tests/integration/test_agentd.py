"""End-to-end tests of agentd: real storaged, toold and agentd processes on loopback (unix
sockets and ephemeral ports, temp dirs), with tests/fake_model/fake_model.py as the model
provider (Anthropic Messages and OpenAI Chat Completions wire formats).

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v test_agentd

Each class starts its own stack in setUpClass. Tests in a class share the stack and use
their own conversations (client-chosen ids with a random suffix); every fake-model step is
bound to its conversation with "match": {"system_contains": <conversation id>} (agent
workspaces are "{conversation}", so the id is in the system prompt's working directory).
When a test fails, the tails of the daemons' stderr are printed.

Coverage (the acceptance list of the agentd issue):
 1. TestAgentdRun.test_run_anthropic_stream: read -> bash (truncated) -> edit -> answer;
    tool results seen by the model == tool_result records == toold's own output; Watch
    replay, resume from every offset, follow live.
 2. TestAgentdRun / TestAgentdNoStream: the same scenario through both wire formats,
    streaming and --no-stream.
 3. TestAgentdJoinsAndAbort.test_joins_during_long_tool_call
 4. TestAgentdJoinsAndAbort.test_abort_*
 5. TestAgentdCrash (kill -9 agentd, restart with the same --owner-id)
 6. TestAgentdTwoProcesses (two agentds, one storaged, 200 submissions, 20 conversations)
 7. TestAgentdBadInput
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid

import grpc

import cflue_harness as H
from cflue_harness import (Agentd, FakeModel, Storaged, Toold, agent_pb2, common_pb2,
                           read_all, _tail)
import secret_scan

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, 'agentd_fixtures')

COMPLETED = common_pb2.OUTCOME_COMPLETED
FAILED = common_pb2.OUTCOME_FAILED
ABORTED = common_pb2.OUTCOME_ABORTED
SETTLED = common_pb2.SUBMISSION_STATUS_SETTLED
RUNNING = common_pb2.SUBMISSION_STATUS_RUNNING
QUEUED = common_pb2.SUBMISSION_STATUS_QUEUED

# common.proto: AssistantMessage.turn is "the submission's model turn, from 1"
FIRST_TURN = 1

# every record type: the body oneof's field names
RECORD_KINDS = frozenset(f.name for f in common_pb2.Record.DESCRIPTOR.oneofs_by_name['body'].fields)

SPILL_RE = re.compile(r'\.cflue/spill/[A-Za-z0-9_.-]+')


def outcome_name(o):
    """'COMPLETED', 'FAILED', 'ABORTED' (the enum value's name without its prefix)."""
    return common_pb2.Outcome.Name(o)[len('OUTCOME_'):]


def status_name(st):
    return common_pb2.SubmissionStatus.Name(st)[len('SUBMISSION_STATUS_'):]


def new_conv(tag):
    return 'c-%s-%s' % (tag, uuid.uuid4().hex[:10])


def kind(rec):
    """A record's type: the name of its body's oneof field ('user_message', ...)."""
    return rec.WhichOneof('body')


def body(rec):
    """A record's typed body (UserMessage, AssistantMessage, ToolCallResult, ...)."""
    k = rec.WhichOneof('body')
    assert k is not None, 'record %d (%s) has no body' % (rec.offset, rec.id)
    return getattr(rec, k)


def call_args(call):
    """A ToolCallRequest's arguments as JSON."""
    return json.loads(call.arguments_json)


def load_scenario(name, conv, **subs):
    """A fixture scenario's steps with placeholders filled in and every step bound to conv."""
    with open(os.path.join(FIXTURES, 'scenarios', name + '.json')) as f:
        text = f.read()
    for k, v in subs.items():
        text = text.replace('@%s@' % k, str(v))
    steps = json.loads(text)['steps']
    return bind(steps, conv)


def bind(steps, conv):
    out = []
    for s in steps:
        s = dict(s)
        s.setdefault('match', {'system_contains': conv})
        out.append(s)
    return out


def long_text(words=400):
    return ' '.join('word%03d' % i for i in range(words))


def find_procs(needle):
    """PIDs of live (non-zombie) processes whose command line contains needle."""
    out = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open('/proc/%s/cmdline' % pid, 'rb') as f:
                cmd = f.read().replace(b'\0', b' ').decode('utf-8', 'replace')
            with open('/proc/%s/stat' % pid) as f:
                state = f.read().rsplit(')', 1)[1].split()[0]
        except (IOError, OSError, IndexError):
            continue
        if needle in cmd and state != 'Z' and int(pid) != os.getpid():
            out.append(int(pid))
    return out


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except (IOError, OSError):
        return ''


def pid_alive(pid):
    try:
        with open('/proc/%d/stat' % pid) as f:
            state = f.read().rsplit(')', 1)[1].split()[0]
        return state != 'Z'
    except (IOError, OSError, IndexError):
        return False


# ---- the model's view (fake model --log entries) ----

def request_system(entry):
    b = entry.get('body') or {}
    if not isinstance(b, dict):
        return ''
    if entry['provider'] == 'anthropic':
        s = b.get('system') or ''
        if isinstance(s, list):
            s = '\n'.join(x.get('text', '') for x in s if isinstance(x, dict))
        return s
    return '\n'.join(m.get('content') or '' for m in b.get('messages') or []
                     if isinstance(m, dict) and m.get('role') in ('system', 'developer')
                     and isinstance(m.get('content'), str))


def block_text(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return '\n'.join(b.get('text', '') for b in content
                         if isinstance(b, dict) and b.get('type') == 'text')
    return ''


def request_tail_tool_results(entry):
    """[(call_id, text, is_error or None)] after the last assistant message of a request."""
    msgs = entry['body']['messages']
    last = max([i for i, m in enumerate(msgs) if m.get('role') == 'assistant'] or [-1])
    out = []
    for m in msgs[last + 1:]:
        if entry['provider'] == 'anthropic':
            if m.get('role') == 'user' and isinstance(m.get('content'), list):
                for b in m['content']:
                    if b.get('type') == 'tool_result':
                        out.append((b.get('tool_use_id'), block_text(b.get('content')),
                                    bool(b.get('is_error'))))
        elif m.get('role') == 'tool':
            out.append((m.get('tool_call_id'), block_text(m.get('content')), None))
    return out


def request_user_texts(entry):
    """Every user-authored text of a request (not tool results)."""
    out = []
    for m in entry['body']['messages']:
        if m.get('role') != 'user':
            continue
        c = m.get('content')
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(b.get('text', '') for b in c if isinstance(b, dict)
                       and b.get('type') == 'text')
    return out


def request_assistant_calls(entry):
    """[[(id, name, args)] per assistant message] of a request."""
    out = []
    for m in entry['body']['messages']:
        if m.get('role') != 'assistant':
            continue
        calls = []
        if entry['provider'] == 'anthropic':
            for b in m.get('content') or []:
                if isinstance(b, dict) and b.get('type') == 'tool_use':
                    calls.append((b.get('id'), b.get('name'), b.get('input')))
        else:
            for tc in m.get('tool_calls') or []:
                fn = tc.get('function') or {}
                try:
                    args = json.loads(fn.get('arguments') or '{}')
                except ValueError:
                    args = fn.get('arguments')
                calls.append((tc.get('id'), fn.get('name'), args))
        out.append(calls)
    return out


# ---- the stack ----

class Stack(object):
    """storaged + toold + fake model + N agentd processes, all in temp dirs."""

    def __init__(self, agents=('runner-anthropic', 'runner-openai'), n_agentd=1,
                 agentd_args=(), owner_ids=None, with_toold=True, storaged_args=(),
                 storaged_env=None, agentd_env=None):
        self.dir = tempfile.mkdtemp(prefix='cflue-agentd-it-')
        self.daemons = []
        self.agentds = []
        try:
            self.sd = Storaged(workdir=self._sub('storaged'), extra_args=storaged_args,
                               env=storaged_env)
            self.daemons.append(('storaged', self.sd))
            self.td = None
            if with_toold:
                self.td = Toold(workdir=self._sub('toold'))
                self.daemons.append(('toold', self.td))
            self.fm = FakeModel(steps=[], workdir=self._sub('fake_model'))
            self.daemons.append(('fake_model', self.fm))
            self.agents_dir = self._sub('agents')
            for name in agents:
                with open(os.path.join(FIXTURES, 'agents', name + '.md')) as f:
                    text = f.read()
                if self.td is not None:
                    text = text.replace('@TOOLS@', self.td.target)
                with open(os.path.join(self.agents_dir, name + '.md'), 'w') as f:
                    f.write(text)
            # the declared skills the agents name (agents/skills/<name>/SKILL.md)
            shutil.copytree(os.path.join(FIXTURES, 'agents', 'skills'),
                            os.path.join(self.agents_dir, 'skills'))
            self.env = {'ANTHROPIC_BASE_URL': self.fm.anthropic_base_url,
                        'ANTHROPIC_API_KEY': 'test-anthropic-key',
                        'OPENAI_BASE_URL': self.fm.openai_base_url,
                        'OPENAI_API_KEY': 'test-openai-key'}
            self.env.update(agentd_env or {})
            for i in range(n_agentd):
                owner = owner_ids[i] if owner_ids else 'agentd-it-%d' % i
                ad = Agentd(self.sd.target, self.agents_dir, owner_id=owner, env=self.env,
                            extra_args=agentd_args, workdir=self._sub('agentd%d' % i))
                self.agentds.append(ad)
                self.daemons.append(('agentd%d' % i, ad))
        except BaseException:
            self.remove()
            raise

    def _sub(self, name):
        p = os.path.join(self.dir, name)
        os.makedirs(p, exist_ok=True)
        return p

    @property
    def ad(self):
        return self.agentds[0]

    def remove(self):
        for _, d in reversed(self.daemons):
            try:
                d.close()
            except Exception:
                pass
        secret_scan.discard(self.dir)

    def dump(self, out, lines=80):
        for name, d in self.daemons:
            out.write('\n==== %s stderr (%s) ====\n%s==== end of %s stderr ====\n'
                      % (name, d.dir, _tail(d.stderr_text(), lines), name))


class AgentdCase(unittest.TestCase):
    stack_kwargs = {}
    stack = None

    @classmethod
    def setUpClass(cls):
        super(AgentdCase, cls).setUpClass()
        cls.stack = Stack(**cls.stack_kwargs)

    @classmethod
    def tearDownClass(cls):
        if cls.stack is not None:
            cls.stack.remove()
            cls.stack = None
        super(AgentdCase, cls).tearDownClass()

    def run(self, result=None):
        if result is None:
            return super(AgentdCase, self).run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super(AgentdCase, self).run(result)
        finally:
            if len(result.failures) + len(result.errors) > before and self.stack is not None:
                sys.stderr.write('\n#### daemon logs for %s\n' % self.id())
                self.stack.dump(sys.stderr)

    # ---- shortcuts ----

    @property
    def ad(self):
        return self.stack.ad

    @property
    def fm(self):
        return self.stack.fm

    @property
    def td(self):
        return self.stack.td

    def workspace(self, conv, files=None):
        ws = self.td.workspace(conv, create=True)
        for name, content in (files or {}).items():
            with open(os.path.join(ws, name), 'w') as f:
                f.write(content)
        return ws

    def records(self, conv):
        """The conversation's records, read from storaged directly (ground truth)."""
        return read_all(self.stack.sd.stub, conv)

    def wait_settled(self, sid, timeout=30, ad=None):
        ad = ad or self.ad
        try:
            sub = ad.get_submission(sid, wait=True, timeout=timeout)
        except grpc.RpcError as e:
            cur = ad.get_submission(sid)
            self.fail('submission %s did not settle within %.0f s (%s); now: status=%s '
                      'attempts=%d' % (sid, timeout, e.code(),
                                       status_name(cur.status),
                                       cur.attempt_count))
        self.assertEqual(sub.status, SETTLED, sub)
        return sub

    def wait_for(self, what, fn, timeout=60, interval=0.05):
        v = H.poll_until(fn, timeout, interval)
        if not v:
            self.fail('timed out after %.0f s waiting for %s' % (timeout, what))
        return v

    def model_requests(self, conv):
        """The fake model's log entries of requests made for conv, in arrival order."""
        return [e for e in self.fm.requests()
                if 'rejected' not in e and conv in request_system(e)]

    def assert_settled_once(self, conv, sids):
        """Exactly one submission_settled record per submission; none for others. Every record
        decodes as one of the typed bodies."""
        recs = self.records(conv)
        for r in recs:
            self.assertIn(kind(r), RECORD_KINDS, 'record %d (%s) has no typed body' % (r.offset, r.id))
        settled = [body(r) for r in recs if kind(r) == 'submission_settled']
        counts = {}
        for r in recs:
            if kind(r) == 'submission_settled':
                counts[r.submission_id] = counts.get(r.submission_id, 0) + 1
        for sid in sids:
            self.assertEqual(counts.get(sid, 0), 1,
                             'submission %s has %d submission_settled records: %s'
                             % (sid, counts.get(sid, 0), settled))
        return recs

    def assert_consecutive(self, recs, first=0):
        self.assertEqual([r.offset for r in recs], list(range(first, first + len(recs))),
                         'offsets are not consecutive from %d' % first)


# ---------------------------------------------------------------------------------------------
# 1 + 2: a scripted run, both providers, streaming and not
# ---------------------------------------------------------------------------------------------

DATA_TXT = ''.join('data line %04d\n' % i for i in range(1, 2101))  # 2100 lines: read truncates
CALC_PY = 'def add(a, b):\n    return a - b\n'


class RunMixin(object):
    """Runs fixtures/scenarios/run.json and checks it end to end."""

    def run_scenario(self, agent, tag, stream, follow=False):
        conv = new_conv(tag)
        ws = self.workspace(conv, {'data.txt': DATA_TXT, 'calc.py': CALC_PY})
        steps = load_scenario('run', conv)
        if follow:
            steps[0]['delay_ms'] = 400  # keeps the run going while the follower attaches
        if stream:
            # the final answer streams slowly enough for agentd to pass some of it on as
            # assistant_delta records (at most one per 250 ms; a quick answer gets none)
            steps[-1]['chunk_delay_ms'] = 150
        self.fm.set_scenario(steps)
        live = {}
        adm = self.ad.submit(agent, 'Please fix calc.py (%s).' % conv, conversation_id=conv)
        self.assertEqual(adm.conversation_id, conv)
        self.assertFalse(adm.deduplicated)
        follower = None
        if follow:
            follower = Follower(self.ad, conv, -1, stop_on_settled=adm.submission_id)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.error, '')
        self.assertEqual(sub.kind, common_pb2.SUBMISSION_KIND_MESSAGE)
        live['settled_at_ms'] = H.ts_ms(sub.settle_time)
        self.assertLessEqual(H.ts_ms(sub.create_time), H.ts_ms(sub.start_time))
        self.assertLessEqual(H.ts_ms(sub.start_time), live['settled_at_ms'])
        self.assertTrue(sub.HasField('input_apply_time'), sub)
        sid = adm.submission_id

        # --- the records ---
        recs = self.assert_settled_once(conv, [sid])
        self.assert_consecutive(recs)
        types = [kind(r) for r in recs if kind(r) != 'assistant_delta']
        self.assertEqual(types, ['user_message', 'system_prompt',
                                 'assistant_message', 'tool_result',
                                 'assistant_message', 'tool_result',
                                 'assistant_message', 'tool_result',
                                 'assistant_message', 'submission_settled'],
                         [(r.offset, kind(r), r.id) for r in recs])
        by_id = {r.id: r for r in recs}
        self.assertIn('input:' + sid, by_id)
        self.assertIn('system:1', by_id)
        self.assertEqual(body(by_id['input:' + sid]).text, 'Please fix calc.py (%s).' % conv)
        assistants = [r for r in recs if kind(r) == 'assistant_message']
        for turn, r in enumerate(assistants):
            self.assertEqual(r.id, 'assistant:%s:%d' % (sid, FIRST_TURN + turn))
            self.assertEqual(r.submission_id, sid)
            self.assertEqual(body(r).turn, FIRST_TURN + turn)
            self.assertTrue(body(r).model, body(r))
            self.assertGreater(body(r).usage.output_tokens, 0, body(r))
        results = [r for r in recs if kind(r) == 'tool_result']
        expected_calls = [('read', {'path': 'data.txt'}),
                          ('bash', {'command': 'seq 1 2500; echo bash-done'}),
                          ('edit', {'path': 'calc.py', 'oldText': 'return a - b',
                                    'newText': 'return a + b'})]
        for turn, (name, args) in enumerate(expected_calls):
            b = body(assistants[turn])
            self.assertEqual(len(b.tool_calls), 1, b)
            call = b.tool_calls[0]
            self.assertEqual(call.name, name)
            self.assertEqual(call_args(call), args)
            # agentd records the provider-neutral (Anthropic-style) stop reason
            self.assertEqual(b.stop_reason, 'tool_use', b)
            res = results[turn]
            self.assertEqual(res.id, 'tool:%s:%d:%s' % (sid, FIRST_TURN + turn, call.id))
            rb = body(res)
            self.assertEqual(rb.name, name)
            self.assertEqual(rb.turn, FIRST_TURN + turn)
            self.assertEqual(rb.index, 0)
            self.assertEqual(rb.tool_call_id, call.id)
            self.assertFalse(rb.is_error, rb.text[:500])
            self.assertFalse(rb.outcome_unknown, rb)
        # the submission's usage is the sum of its model calls'
        self.assertEqual((sub.usage.input_tokens, sub.usage.output_tokens),
                         (sum(body(r).usage.input_tokens for r in assistants),
                          sum(body(r).usage.output_tokens for r in assistants)))
        # each record type this run produces, decoded as its typed body
        self.assertEqual(set(kind(r) for r in recs),
                         {'user_message', 'system_prompt', 'assistant_message', 'tool_result',
                          'submission_settled'} | ({'assistant_delta'} if stream else set()))
        self.assertTrue(body(by_id['system:1']).text, 'an empty system prompt')
        final = body(assistants[3])
        self.assertEqual(final.text, 'Fixed add() in calc.py: it subtracted instead of adding.')
        self.assertEqual(list(final.tool_calls), [])
        self.assertEqual(final.stop_reason, 'end_turn', final)
        self.assertEqual(body(assistants[0]).text, 'Let me read the data first.')
        settled = body(recs[-1])
        self.assertEqual(settled.outcome, COMPLETED, settled)
        self.assertEqual(settled.error, '')
        self.assertEqual(settled.answered_by, sid)
        self.assertEqual(recs[-1].id, 'settled:' + sid)
        self.assertEqual(recs[-1].submission_id, sid)
        # storaged stamps every record's commit time
        for r in recs:
            self.assertTrue(r.HasField('create_time'), r)

        # truncation: both the read (2100 lines) and the bash (2501 lines) were cut
        read_b, bash_b, edit_b = [body(r) for r in results]
        self.assertIn('[Showing lines 1-2000 of 2100. Use offset=2001 to continue.]',
                      read_b.text)
        self.assertTrue(read_b.truncation.truncated, read_b.truncation)
        self.assertEqual(read_b.truncation.by, common_pb2.TRUNCATED_BY_LINES, read_b.truncation)
        self.assertIn('[Output truncated', bash_b.text)
        self.assertTrue(bash_b.text.rstrip('\n').endswith('2500\nbash-done'),
                        bash_b.text[-200:])
        self.assertTrue(bash_b.truncation.truncated, bash_b.truncation)
        self.assertEqual(bash_b.truncation.total_lines, 2501)
        self.assertFalse(edit_b.HasField('truncation'), edit_b)
        with open(os.path.join(ws, 'calc.py')) as f:
            self.assertEqual(f.read(), 'def add(a, b):\n    return a + b\n')

        # --- what the model received ---
        reqs = self.model_requests(conv)
        self.assertEqual([e['step'] for e in reqs], [0, 1, 2, 3],
                         'expected one request per scenario step, got %s'
                         % [(e['n'], e['step']) for e in reqs])
        for e in reqs:
            self.assertEqual(e['stream'], stream, 'request #%d stream flag' % e['n'])
            self.assertEqual(e['provider'], 'anthropic' if 'anthropic' in agent else 'openai')
            self.assertIn('Please fix calc.py (%s).' % conv, request_user_texts(e))
        self.assertEqual(request_tail_tool_results(reqs[0]), [])
        for turn in range(3):
            got = request_tail_tool_results(reqs[turn + 1])
            rb = body(results[turn])
            call_id = body(assistants[turn]).tool_calls[0].id
            self.assertEqual(len(got), 1, got)
            self.assertEqual(got[0][0], call_id)
            self.assertEqual(got[0][1], rb.text,
                             'turn %d: the model received other text than the tool_result '
                             'record' % turn)
            if got[0][2] is not None:
                self.assertEqual(got[0][2], rb.is_error)
            # the history it was sent replays every earlier call with its id and arguments
            calls = request_assistant_calls(reqs[turn + 1])
            self.assertEqual(len(calls), turn + 1)
            for t in range(turn + 1):
                cb = body(assistants[t]).tool_calls[0]
                self.assertEqual(calls[t], [(cb.id, cb.name, call_args(cb))])

        # --- toold's own output for the same calls on an identical fresh workspace ---
        fresh = 'fresh-' + conv
        self.workspace(fresh, {'data.txt': DATA_TXT, 'calc.py': CALC_PY})
        direct_read = self.td.execute(fresh, 'read', {'path': 'data.txt'})
        self.assertEqual(read_b.text, direct_read.text)
        self.assertEqual(read_b.is_error, direct_read.is_error)
        # the recorded truncation is toold's, field for field
        self.assertEqual(read_b.truncation, direct_read.truncation)
        cli = subprocess.run([H.CLI_BIN, 'tool', self.td.target, 'read',
                              json.dumps({'path': 'data.txt'}), '--sandbox', fresh],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        self.assertEqual(cli.returncode, 0, cli.stderr)
        # `cflue tool` prints the result text followed by one newline
        self.assertEqual(cli.stdout.decode('utf-8'), read_b.text + '\n',
                         '`cflue tool` printed other text than the recorded read result')
        direct_bash = self.td.execute(fresh, 'bash', {'command': 'seq 1 2500; echo bash-done'})
        # the spill file name is unique per run; everything else must be identical
        self.assertEqual(SPILL_RE.sub('SPILL', bash_b.text),
                         SPILL_RE.sub('SPILL', direct_bash.text))
        self.assertEqual(bash_b.truncation.total_bytes, direct_bash.truncation.total_bytes)
        direct_edit = self.td.execute(fresh, 'edit', expected_calls[2][1])
        self.assertEqual(edit_b.text, direct_edit.text)

        # --- Watch: replay, resume from every offset ---
        full = self.ad.watch_all(conv, -1)
        # the same typed records, field for field (bodies, attempt ids, create times)
        self.assertEqual(list(full), list(recs))
        # and GetConversation, paged through with its page tokens, gives the same history
        self.assertEqual(self.ad.conversation_records(conv, page_size=3), list(recs))
        self.assert_consecutive(full)
        head = full[-1].offset
        for k in range(-1, head + 1):
            part = self.ad.watch_all(conv, k)
            self.assertEqual([r.offset for r in part], list(range(k + 1, head + 1)),
                             'Watch from %d' % k)
            self.assertEqual([r.id for r in part], [r.id for r in full[k + 1:]])
            self.assertEqual([r.id for r in full[:k + 1]] + [r.id for r in part],
                             [r.id for r in full])
        if stream:
            deltas = [r for r in recs if kind(r) == 'assistant_delta']
            texts = ''.join(body(r).text for r in deltas if body(r).turn == FIRST_TURN + 3)
            # best effort: a prefix of the text (the answer carries the rest, if any)
            self.assertTrue(texts and final.text.startswith(texts),
                            'the streamed deltas of the final turn: %r' % texts)
            # and each turn's deltas come before its message in the stream
            for r in recs:
                if kind(r) == 'assistant_message':
                    late = [d.offset for d in deltas
                            if body(d).turn == body(r).turn and d.offset > r.offset]
                    self.assertEqual(late, [], 'deltas after the message of turn %d'
                                     % body(r).turn)

        # --- Watch with follow ---
        if follower is not None:
            follower.join(10)
            self.assertIsNone(follower.error, follower.error)
            got = follower.records
            self.assertTrue(got and kind(got[-1]) == 'submission_settled', [kind(r) for r in got])
            self.assertEqual([(r.offset, r.id) for r in got],
                             [(r.offset, r.id) for r in full[:len(got)]])
            self.assertEqual(len(got), len(full))
            # delivered live: the input arrived well before the submission settled
            self.assertLess(follower.arrivals[0], live['settled_at_ms'] - 300,
                            'the first record reached the follower only at settlement')
            self.assertTrue(follower.still_open_after_last,
                            'the follow stream ended by itself instead of staying open')
        return conv, sid, recs


class Follower(threading.Thread):
    """Watch(follow=True) in a thread: collects records until stop_on_settled's
    submission_settled record, then checks the stream is still open and cancels it."""

    def __init__(self, ad, conv, after_offset, stop_on_settled):
        super(Follower, self).__init__(daemon=True)
        self.call = ad.watch(conv, after_offset, follow=True, timeout=60)
        self.stop_on = stop_on_settled
        self.records = []
        self.arrivals = []
        self.error = None
        self.still_open_after_last = None
        self.start()

    def run(self):
        try:
            for r in self.call:
                self.records.append(r)
                self.arrivals.append(int(time.time() * 1000))
                if kind(r) == 'submission_settled' and r.submission_id == self.stop_on:
                    time.sleep(0.3)
                    self.still_open_after_last = self.call.is_active()
                    self.call.cancel()
                    return
            self.still_open_after_last = False
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = '%s: %s' % (e.code(), e.details())


class TestAgentdRun(AgentdCase, RunMixin):
    """Acceptance 1 and 2 (streaming agentd)."""

    def test_run_anthropic_stream(self):
        self.run_scenario('runner-anthropic', 'run-a-s', stream=True, follow=True)

    def test_run_openai_stream(self):
        self.run_scenario('runner-openai', 'run-o-s', stream=True, follow=True)


class TestAgentdNoStream(AgentdCase, RunMixin):
    """Acceptance 2 with --no-stream."""
    stack_kwargs = {'agentd_args': ['--no-stream']}

    def test_run_anthropic_no_stream(self):
        self.run_scenario('runner-anthropic', 'run-a-n', stream=False)

    def test_run_openai_no_stream(self):
        self.run_scenario('runner-openai', 'run-o-n', stream=False)

    def test_garbage_no_stream(self):
        for agent in ('runner-anthropic', 'runner-openai'):
            with self.subTest(agent=agent):
                conv = new_conv('gbn')
                self.workspace(conv)
                self.fm.set_scenario(bind([{'garbage': '<html>not json</html>'}] * 4, conv))
                sid = self.ad.submit(agent, 'hello', conversation_id=conv).submission_id
                s = self.wait_settled(sid, timeout=20)
                self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
                self.assertIn('model call failed', s.error)
                self.assertIn(agent.split('-')[1], s.error.lower())
                self.assert_settled_once(conv, [sid])
        self.assertEqual(self.ad.health_check(), H.SERVING)


# ---------------------------------------------------------------------------------------------
# 3 + 4: joins and aborts
# ---------------------------------------------------------------------------------------------

class TestAgentdLargeBatch(AgentdCase):

    def test_an_answer_with_more_calls_than_a_batch_holds_runs_them_all_in_order(self):
        """A streamed answer with 1001 tool calls keeps them all (the Anthropic stream's blocks
        are not capped at a small table), and a batch holds at most 64 calls (tools.proto): they
        run in batches of 64, each once the one before it is over, so every call runs and calls
        on one path keep the answer's order (the last write wins)."""
        n = 1001
        conv = new_conv('batch')
        ws = self.workspace(conv)
        calls = [{'name': 'write', 'arguments': {'path': 'same.txt', 'content': 'write %d\n' % i}}
                 for i in range(n)]
        self.fm.set_scenario([{'tool_calls': calls}, {'text': 'all written'}])
        sid = self.ad.submit('runner-anthropic', 'write it %d times' % n, conversation_id=conv)
        sub = self.wait_settled(sid.submission_id, timeout=120)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
        self.assertEqual(sub.attempt_count, 1)
        results = [body(r) for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertEqual(sorted(r.index for r in results), list(range(n)))
        errors = [(r.index, r.text) for r in results if r.is_error]
        self.assertEqual(errors, [])
        with open(os.path.join(ws, 'same.txt')) as f:
            self.assertEqual(f.read(), 'write %d\n' % (n - 1))


class TestAgentdJoinsAndAbort(AgentdCase):

    def start_host_with_tool(self, scenario, tag):
        conv = new_conv(tag)
        ws = self.workspace(conv)
        self.fm.set_scenario(load_scenario(scenario, conv))
        host = self.ad.submit('runner-anthropic', 'host message %s' % conv, conversation_id=conv)
        self.wait_for('the host tool call to start',
                      lambda: os.path.exists(os.path.join(ws, 'started.txt')), timeout=60)
        return conv, ws, host.submission_id

    def test_joins_during_long_tool_call(self):
        conv, ws, host = self.start_host_with_tool('joins', 'join')
        texts = ['follow-up %d for %s' % (i, conv) for i in range(3)]
        joined = [self.ad.submit('runner-anthropic', t, conversation_id=conv).submission_id
                  for t in texts]
        # the tool is still running: all three arrived during the long call
        self.assertEqual(self.ad.get_submission(host).status, RUNNING)
        subs = {sid: self.wait_settled(sid, timeout=30) for sid in [host] + joined}
        for sid, s in subs.items():
            self.assertEqual(outcome_name(s.outcome), 'COMPLETED', (sid, s.error))
            self.assertTrue(s.answered_by, 'answered_by is empty for %s' % sid)
        recs = self.assert_settled_once(conv, [host] + joined)
        offsets = {r.id: r.offset for r in recs}
        host_final = [r for r in recs if kind(r) == 'assistant_message'
                      and r.submission_id == host][-1]
        reqs = self.model_requests(conv)
        seen_by_model = set()
        for e in reqs:
            seen_by_model.update(request_user_texts(e))
        for sid, text in zip(joined, texts):
            s = subs[sid]
            self.assertIn('input:' + sid, offsets, 'the input of %s is not in the stream' % sid)
            self.assertEqual(body(recs[offsets['input:' + sid]]).text, text)
            self.assertIn(text, seen_by_model, 'the model never saw %r' % text)
            if s.answered_by == host:
                self.assertEqual(s.joined_into, host)
                self.assertLess(offsets['input:' + sid], host_final.offset,
                                'joined input after the host\'s final answer')
                self.assertFalse([r for r in recs if kind(r) == 'assistant_message'
                                  and r.submission_id == sid])
            else:
                self.assertEqual(s.answered_by, sid)
                own = [r for r in recs if kind(r) == 'assistant_message' and r.submission_id == sid]
                self.assertTrue(own, '%s was neither joined nor answered on its own' % sid)
                self.assertGreater(offsets['input:' + sid], host_final.offset)
        self.assertEqual(subs[host].answered_by, host)
        # while a long tool call ran, every follow-up waited for it and then joined the host
        self.assertEqual([subs[s].answered_by for s in joined], [host] * 3,
                         'expected the three follow-ups to join the running host')

    def test_abort_one_of_two_queued(self):
        conv, ws, host = self.start_host_with_tool('abort_queued', 'abq')
        a = self.ad.submit('runner-anthropic', 'queued A %s' % conv, conversation_id=conv)
        b = self.ad.submit('runner-anthropic', 'queued B %s' % conv, conversation_id=conv)
        self.assertEqual(self.ad.get_submission(a.submission_id).status, QUEUED)
        resp = self.ad.abort(submission_id=a.submission_id)
        self.assertTrue(resp.aborted)
        self.assertEqual(list(resp.affected), [a.submission_id])
        sa = self.wait_settled(a.submission_id)
        sb = self.wait_settled(b.submission_id)
        sh = self.wait_settled(host)
        self.assertEqual(outcome_name(sa.outcome), 'ABORTED', sa.error)
        self.assertEqual(outcome_name(sb.outcome), 'COMPLETED', sb.error)
        self.assertEqual(outcome_name(sh.outcome), 'COMPLETED', sh.error)
        self.assertTrue(sb.answered_by)
        recs = self.assert_settled_once(conv, [host, a.submission_id, b.submission_id])
        self.assertFalse([r for r in recs if kind(r) == 'assistant_message'
                          and r.submission_id == a.submission_id],
                         'the aborted submission was answered')
        self.assertNotEqual(sa.answered_by, b.submission_id)
        self.assertNotEqual(sa.answered_by, host)
        self.assertIn('queued B %s' % conv,
                      [t for e in self.model_requests(conv) for t in request_user_texts(e)])

    def test_abort_during_model_stream(self):
        conv = new_conv('abs')
        self.workspace(conv)
        self.fm.set_scenario(load_scenario('abort_stream', conv, LONG_TEXT=long_text()))
        sid = self.ad.submit('runner-anthropic', 'talk a lot', conversation_id=conv).submission_id
        self.wait_for('streamed text', lambda: [r for r in self.records(conv)
                                                if kind(r) == 'assistant_delta'], timeout=60)
        t0 = time.monotonic()
        resp = self.ad.abort(submission_id=sid)
        self.assertEqual(list(resp.affected), [sid])
        s = self.wait_settled(sid, timeout=10)
        elapsed = time.monotonic() - t0
        self.assertEqual(outcome_name(s.outcome), 'ABORTED', s.error)
        self.assertLessEqual(elapsed, 2.0, 'settled %.2f s after Abort' % elapsed)
        self.assert_settled_once(conv, [sid])
        self.assertEqual(len(self.model_requests(conv)), 1)

    def test_abort_during_long_bash(self):
        conv = new_conv('abb')
        ws = self.workspace(conv)
        sleep_arg = '30.%04d' % random.randint(1000, 9999)
        self.fm.set_scenario(load_scenario('abort_bash', conv, SLEEP=sleep_arg))
        sid = self.ad.submit('runner-anthropic', 'run something long',
                             conversation_id=conv).submission_id
        pid_file = os.path.join(ws, 'sleep.pid')
        try:
            self.wait_for('the long bash to start',
                          lambda: read_text(pid_file).strip(),
                          timeout=60)
            # $! is written as soon as bash forks, maybe before the child has exec'd sleep (a
            # fixed 0.2 s was not always enough on a loaded machine)
            self.wait_for('sleep to run', lambda: find_procs('sleep ' + sleep_arg), timeout=60)
            t0 = time.monotonic()
            self.ad.abort(submission_id=sid)
            try:
                s = self.ad.get_submission(sid, wait=True, timeout=5)
            except grpc.RpcError as e:
                s = self.ad.get_submission(sid)
            elapsed = time.monotonic() - t0
            self.assertEqual(s.status, SETTLED,
                             'not settled %.1f s after Abort during a long bash (status %s)'
                             % (elapsed, status_name(s.status)))
            self.assertEqual(outcome_name(s.outcome), 'ABORTED', s.error)
            self.assertLessEqual(elapsed, 2.0, 'settled %.2f s after Abort' % elapsed)
            self.wait_for('the bash command to be gone',
                          lambda: not find_procs('sleep ' + sleep_arg), timeout=15)
            self.assert_settled_once(conv, [sid])
        finally:
            # never leave the 30 s command behind (only processes this test started)
            for pid in find_procs('sleep ' + sleep_arg):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass


# ---------------------------------------------------------------------------------------------
# 5: crashes (kill -9 agentd, restart with the same --owner-id)
# ---------------------------------------------------------------------------------------------

class TestAgentdCrash(AgentdCase):
    stack_kwargs = {'agentd_args': ['--lease-ms', '2000', '--heartbeat-ms', '500'],
                    'owner_ids': ['agentd-crash-owner']}

    def crash_and_restart(self):
        self.ad.kill()
        self.ad.start()

    def settled(self, conv, sid):
        """Waits for the single outcome; checks invariants that hold whatever it is."""
        s = self.wait_settled(sid, timeout=30)
        recs = self.assert_settled_once(conv, [sid])
        self.assert_consecutive(recs)
        assistants = [r for r in recs if kind(r) == 'assistant_message']
        self.assertEqual([body(r).turn for r in assistants],
                         list(range(FIRST_TURN, FIRST_TURN + len(assistants))),
                         'one assistant_message per turn')
        return s, recs, assistants

    def assert_completed(self, s):
        self.assertEqual(outcome_name(s.outcome), 'COMPLETED',
                         'after the restart: %s (attempt_count=%d)' % (s.error, s.attempt_count))

    def test_crash_during_model_stream(self):
        conv = new_conv('crs')
        self.workspace(conv)
        self.fm.set_scenario(load_scenario('crash_stream', conv, LONG_TEXT=long_text()))
        sid = self.ad.submit('runner-anthropic', 'stream then crash',
                             conversation_id=conv).submission_id
        self.wait_for('streamed text', lambda: [r for r in self.records(conv)
                                                if kind(r) == 'assistant_delta'], timeout=60)
        self.crash_and_restart()
        s, recs, assistants = self.settled(conv, sid)
        self.assertLessEqual(len(assistants), 1)
        self.assert_completed(s)
        self.assertEqual(len(assistants), 1)
        self.assertEqual(body(assistants[0]).text, 'The answer after the restart.')
        self.assertEqual([e['step'] for e in self.model_requests(conv)], [0, 1])
        self.assertGreaterEqual(s.attempt_count, 2)

    def test_crash_during_tool_batch(self):
        conv = new_conv('crt')
        ws = self.workspace(conv)
        self.fm.set_scenario(load_scenario('crash_tool', conv))
        sid = self.ad.submit('runner-anthropic', 'count then crash',
                             conversation_id=conv).submission_id
        counter = os.path.join(ws, 'counter')
        self.wait_for('the tool to run', lambda: os.path.exists(counter), timeout=60)
        time.sleep(0.2)
        self.crash_and_restart()
        s, recs, assistants = self.settled(conv, sid)
        with open(counter) as f:
            self.assertEqual(f.read(), 'x\n', 'the tool call ran again after the restart')
        results = [r for r in recs if kind(r) == 'tool_result']
        call = body(assistants[0]).tool_calls[0]
        self.assertEqual([r.id for r in results],
                         ['tool:%s:%d:%s' % (sid, FIRST_TURN, call.id)])
        rb = body(results[0])
        self.assertTrue(rb.is_error, rb)
        # the crash cut the call off: it may or may not have run, and the record says so
        self.assertTrue(rb.outcome_unknown, rb)
        self.assertEqual(rb.tool_call_id, call.id)
        self.assertIn('unknown', rb.text.lower(), rb.text)
        self.assert_completed(s)
        self.assertEqual(body(assistants[-1]).text,
                         'The tool call was interrupted; carrying on.')
        reqs = self.model_requests(conv)
        self.assertEqual([e['step'] for e in reqs], [0, 1])
        got = request_tail_tool_results(reqs[1])
        self.assertEqual(got, [(call.id, rb.text, True)])

    def test_crash_between_tool_result_and_model_call(self):
        conv = new_conv('crb')
        ws = self.workspace(conv)
        self.fm.set_scenario(load_scenario('crash_between', conv))
        sid = self.ad.submit('runner-anthropic', 'count, think, crash',
                             conversation_id=conv).submission_id
        self.wait_for('the second model call',
                      lambda: [e for e in self.model_requests(conv) if e['step'] == 1],
                      timeout=60)
        # stored while the model is asked (after agentd's --hold-writes-ms, 50 ms, the wait
        # for an answer that could have carried it), before the answer comes at 5 s
        self.wait_for('the tool result stored',
                      lambda: [r for r in self.records(conv) if kind(r) == 'tool_result'],
                      timeout=3)
        self.crash_and_restart()
        s, recs, assistants = self.settled(conv, sid)
        with open(os.path.join(ws, 'counter')) as f:
            self.assertEqual(f.read(), 'x\n', 'the recorded tool call ran again')
        results = [r for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, [(r.id, body(r)) for r in results])
        rb = body(results[0])
        self.assertFalse(rb.is_error, rb)
        self.assertFalse(rb.outcome_unknown, rb)
        self.assertEqual(rb.text.strip(), 'ran-once')
        self.assert_completed(s)
        self.assertEqual(len(assistants), 2)
        self.assertEqual(body(assistants[1]).text, 'The answer after the restart.')
        reqs = self.model_requests(conv)
        self.assertEqual([e['step'] for e in reqs], [0, 1, 2])
        self.assertEqual(request_tail_tool_results(reqs[2]), request_tail_tool_results(reqs[1]))


# ---------------------------------------------------------------------------------------------
# 6: two agentd processes, one storaged
# ---------------------------------------------------------------------------------------------

class TestAgentdTwoProcesses(AgentdCase):
    stack_kwargs = {'agents': ('plain',), 'n_agentd': 2, 'with_toold': False,
                    'owner_ids': ['agentd-left', 'agentd-right']}

    N_CONV = 20
    PER_CONV = 10

    def test_two_agentds_200_submissions(self):
        self.fm.set_scenario([])  # every request: the text "(scenario finished)", at once
        convs = [new_conv('two%02d' % i) for i in range(self.N_CONV)]
        submitted = {c: [] for c in convs}
        errors = []

        def submitter(k):
            # rounds 0-4: bursts (later messages join a running host); rounds 5-9: each
            # message only after the previous one of its conversation settled, so most of
            # them are claimed on their own by either process
            try:
                mine = [(i, c) for i, c in enumerate(convs) if i % 4 == k]
                for j in range(self.PER_CONV):
                    round_sids = []
                    for i, c in mine:
                        ad = self.stack.agentds[(i + j) % 2]
                        adm = ad.submit('plain', 'message %d of %s' % (j, c), conversation_id=c)
                        submitted[c].append(adm.submission_id)
                        round_sids.append(adm.submission_id)
                    if j >= self.PER_CONV // 2:
                        for n, sid in enumerate(round_sids):
                            self.stack.agentds[n % 2].get_submission(sid, wait=True, timeout=60)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        all_sids = [s for c in convs for s in submitted[c]]
        self.assertEqual(len(set(all_sids)), self.N_CONV * self.PER_CONV)
        subs = {}
        deadline = time.monotonic() + 90
        for sid in all_sids:
            subs[sid] = self.wait_settled(sid, timeout=max(1, deadline - time.monotonic()),
                                          ad=self.stack.agentds[len(subs) % 2])
        bad = [(sid, outcome_name(s.outcome), s.error) for sid, s in subs.items()
               if s.outcome != COMPLETED]
        self.assertEqual(bad, [], 'submissions that did not complete')
        problems = []
        for c in convs:
            recs = self.records(c)
            sids = submitted[c]
            order = sorted(sids, key=lambda s: subs[s].sequence)
            self.assertEqual(order, sids, 'admission order differs from submission order')
            settled = [r.submission_id for r in recs if kind(r) == 'submission_settled']
            if sorted(settled) != sorted(sids) or len(settled) != len(set(settled)):
                problems.append('%s: settlement records %s for %s' % (c, settled, sids))
            if settled != sids:
                problems.append('%s: settlement records out of order %s' % (c, settled))
            inputs = [r.submission_id for r in recs if kind(r) == 'user_message']
            if inputs != sids:
                problems.append('%s: user_message records out of order or missing: %s'
                                % (c, inputs))
            for sid in sids:
                mine = [r for r in recs if r.submission_id == sid
                        and kind(r) != 'submission_settled']
                turns = [body(r).turn for r in mine if kind(r) == 'assistant_message']
                if turns != list(range(FIRST_TURN, FIRST_TURN + len(turns))):
                    problems.append('%s: assistant turns %s' % (sid, turns))
                attempts = set(r.attempt_id for r in mine)
                if len(attempts) > 1 and subs[sid].attempt_count <= 1:
                    problems.append('%s: records from %d attempts (%s) without a takeover'
                                    % (sid, len(attempts), sorted(attempts)))
                if subs[sid].answered_by == sid and not turns:
                    problems.append('%s: answered by itself but has no assistant_message' % sid)
                if subs[sid].answered_by not in sids:
                    problems.append('%s: answered_by %r' % (sid, subs[sid].answered_by))
        self.assertEqual(problems, [], '\n'.join(problems[:40]))
        drove = [len(re.findall(r'\bdrive\b', ad.stderr_text())) for ad in self.stack.agentds]
        sys.stderr.write('\n[two agentds] drives per process: %s; joined: %d of %d\n'
                         % (drove, sum(1 for s in subs.values() if s.answered_by != s.submission_id),
                            len(subs)))
        for ad in self.stack.agentds:
            self.assertTrue(ad.alive())


# ---------------------------------------------------------------------------------------------
# 7: bad input
# ---------------------------------------------------------------------------------------------

class TestAgentdReadiness(AgentdCase):
    """Readiness means storaged answers: "readiness" and cflue.v1.Agent turn NOT_SERVING while it
    is down and SERVING again once it is back; "" and "liveness" stay SERVING throughout."""

    def wait_health(self, service, want):
        self.assertTrue(self.ad.wait_health(service, want), 'health of %r never became %d'
                        % (service, want))

    def test_readiness_follows_storaged_and_liveness_does_not(self):
        for service in ('', 'liveness', 'readiness', 'cflue.v1.Agent'):
            self.assertEqual(self.ad.health_check(service), H.SERVING, service)
        self.stack.sd.stop()
        try:
            self.wait_health('readiness', H.NOT_SERVING)
            self.assertEqual(self.ad.health_check('cflue.v1.Agent'), H.NOT_SERVING)
            self.assertEqual(self.ad.health_check(''), H.SERVING)
            self.assertEqual(self.ad.health_check('liveness'), H.SERVING)
            self.assertIn('event=not_ready need=storaged', self.ad.stderr_text())
        finally:
            self.stack.sd.start()
        self.wait_health('readiness', H.SERVING)
        self.assertEqual(self.ad.health_check('cflue.v1.Agent'), H.SERVING)
        self.assertIn('event=ready need=storaged', self.ad.stderr_text())
        with self.assertRaises(grpc.RpcError) as cm:
            self.ad.health_check('cflue.v1.Unknown')
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_an_agentd_started_without_storaged_is_alive_but_not_ready(self):
        lonely = H.Agentd('unix:' + os.path.join(self.stack.dir, 'nobody-listens.sock'),
                          self.stack.agents_dir, owner_id='agentd-lonely', env=self.stack.env,
                          workdir=self.stack._sub('agentd-lonely'))
        try:
            deadline = time.monotonic() + 60
            while lonely.health_check('readiness') != H.NOT_SERVING:
                self.assertLess(time.monotonic(), deadline, 'readiness stayed SERVING')
                time.sleep(0.1)
            self.assertEqual(lonely.health_check('liveness'), H.SERVING)
            self.assertIn('event=not_ready need=storaged', lonely.stderr_text())
        finally:
            lonely.close()


class TestAgentdModelWait(AgentdCase):
    """A model call told to come back later (retry-after) waits that long, however long, unless
    the next try could not start before the submission's time limit (here 20 s from its
    claim): then it fails at once, saying why, rather than parking until the limit."""
    stack_kwargs = {'agents': ('runner-anthropic',), 'storaged_args': ('--timeout-ms', '20000')}

    def converse(self, steps):
        conv = new_conv('wait')
        self.workspace(conv)
        self.fm.set_scenario(bind(steps, conv))
        t0 = time.monotonic()
        sid = self.ad.submit('runner-anthropic', 'hello', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        return sub, time.monotonic() - t0, [r for r in self.fm.requests()
                                            if conv in json.dumps(r.get('body', r))]

    def test_a_wait_past_the_time_limit_fails_at_once(self):
        # an hour (once read as nothing, and retried after half a second, three times)
        sub, took, asked = self.converse([{'error': {'status': 429, 'retry_after': 3600}}] * 4)
        self.assertEqual(outcome_name(sub.outcome), 'FAILED', sub)
        self.assertIn('past the submission\'s time limit', sub.error)
        self.assertLess(took, 15, 'it waited for the time limit')
        self.assertEqual(len(asked), 1, 'asked again within the wait it was told to keep')

    def test_a_wait_within_the_time_limit_is_kept(self):
        sub, took, asked = self.converse([{'error': {'status': 529, 'retry_after': 2}},
                                          {'text': 'done'}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertGreaterEqual(took, 2)
        self.assertEqual(len(asked), 2)


class TestAgentdBadInput(AgentdCase):

    def assertRpcError(self, code, fn, *args, **kwargs):
        try:
            r = fn(*args, **kwargs)
            if hasattr(r, '__iter__') and not hasattr(r, 'SerializeToString'):
                r = list(r)
        except grpc.RpcError as e:
            self.assertEqual(e.code(), code, e.details())
            return e
        self.fail('expected %s, got %r' % (code, r))

    def submit(self, agent, steps, text='hello'):
        conv = new_conv('bad')
        self.workspace(conv)
        self.fm.set_scenario(bind(steps, conv))
        t0 = time.monotonic()
        sid = self.ad.submit(agent, text, conversation_id=conv).submission_id
        return conv, sid, t0

    def test_empty_text_is_invalid_argument(self):
        e = self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.ad.submit,
                                'runner-anthropic', '')
        self.assertIn('text', e.details())

    def test_unknown_agent_is_not_found(self):
        e = self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.ad.submit, 'no-such-agent', 'hi')
        self.assertIn('no-such-agent', e.details())
        self.assertEqual(H.error_reason(e), 'UNKNOWN_AGENT')

    def test_reserved_metadata_key_is_invalid_argument(self):
        for key in ('cflue.x', 'cflue.kind'):
            with self.subTest(key=key):
                e = self.assertRpcError(
                    grpc.StatusCode.INVALID_ARGUMENT, self.ad.call, 'Submit',
                    agent_pb2.SubmitRequest(agent='runner-anthropic', message=H.message('hi'),
                                            metadata={key: 'v', 'channel': 'cli'}))
                self.assertEqual(H.error_reason(e), 'RESERVED_METADATA_KEY')
                self.assertIn(key, e.details())
        # keys outside the reserved prefix are kept with the submission
        conv = new_conv('meta')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'noted'}], conv))
        meta = {'channel': 'cli', 'cflue': 'not reserved', 'x.cflue.y': 'nor this'}
        adm = self.ad.call('Submit', agent_pb2.SubmitRequest(
            agent='runner-anthropic', conversation_id=conv, message=H.message('hi'),
            metadata=meta))
        s = self.wait_settled(adm.submission_id, timeout=20)
        self.assertEqual(dict(s.metadata), meta)
        self.assertEqual(s.kind, common_pb2.SUBMISSION_KIND_MESSAGE)
        self.assertEqual(outcome_name(s.outcome), 'COMPLETED', s.error)

    def settled_conversation(self, texts=('one',)):
        """A conversation with one settled submission per text, its records (Watch replay)."""
        conv = new_conv('pages')
        self.workspace(conv)
        steps = []
        for i, _ in enumerate(texts):
            steps += [{'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo %d' % i}}]},
                      {'text': 'answer %d' % i}]
        self.fm.set_scenario(bind(steps, conv))
        sids = []
        for t in texts:
            sid = self.ad.submit('runner-anthropic', t, conversation_id=conv).submission_id
            self.assertEqual(outcome_name(self.wait_settled(sid, timeout=20).outcome),
                             'COMPLETED')
            sids.append(sid)
        self.assert_settled_once(conv, sids)
        return conv, sids, self.ad.watch_all(conv)

    def test_get_conversation_pages_equal_the_watch_replay(self):
        conv, sids, replay = self.settled_conversation(('one', 'two'))
        self.assertGreater(len(replay), 8)
        for size in (1, 2, 3, len(replay), 1000):
            with self.subTest(page_size=size):
                views, token = [], ''
                while True:
                    view = self.ad.get_conversation(conv, True, size, token)
                    views.append(view)
                    self.assertLessEqual(len(view.records), size)
                    token = view.next_page_token
                    if not token:
                        break
                    self.assertEqual(len(view.records), size, 'a short page before the last')
                    self.assertLessEqual(len(views), len(replay) + 1, 'pages without end')
                self.assertEqual([r for v in views for r in v.records], replay)
                for v in views:
                    self.assertEqual(v.conversation_id, conv)
                    self.assertEqual(v.agent, 'runner-anthropic')
                    self.assertEqual(v.head_offset, replay[-1].offset)
        self.assertEqual(self.ad.conversation_records(conv), replay)
        # without include_records: the summary only
        view = self.ad.get_conversation(conv)
        self.assertEqual(list(view.records), [])
        self.assertEqual(view.next_page_token, '')
        self.assertEqual(sorted(s.submission_id for s in view.submissions), sorted(sids))
        for s in view.submissions:
            self.assertEqual(s.status, SETTLED)
            self.assertEqual(s.kind, common_pb2.SUBMISSION_KIND_MESSAGE)
        # Watch resumes after any offset; beyond the head is out of range
        self.assertEqual(self.ad.watch_all(conv, replay[3].offset), replay[4:])
        e = self.assertRpcError(grpc.StatusCode.OUT_OF_RANGE, self.ad.watch_all, conv,
                                replay[-1].offset + 5)
        self.assertEqual(H.error_reason(e), 'OFFSET_BEYOND_HEAD')

    def test_bad_page_tokens_are_invalid_argument(self):
        conv, _, replay = self.settled_conversation()
        other, _, _ = self.settled_conversation()
        token = self.ad.get_conversation(conv, True, 1).next_page_token
        self.assertTrue(token)
        agents_token = self.ad.list_agents(page_size=1).next_page_token
        self.assertTrue(agents_token)
        bad = [('garbled', conv, 'not a page token!'), ('garbled hex', conv, 'abc'),
               ('another conversation', other, token), ('a ListAgents token', conv, agents_token)]
        for what, c, tok in bad:
            with self.subTest(token=what):
                e = self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                        self.ad.get_conversation, c, True, 1, tok)
                self.assertEqual(H.error_reason(e), 'INVALID_PAGE_TOKEN')
        for what, tok in (('garbled', 'not a page token!'), ('a conversation token', token)):
            with self.subTest(list_agents=what):
                e = self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.ad.list_agents,
                                        1, tok)
                self.assertEqual(H.error_reason(e), 'INVALID_PAGE_TOKEN')
        # the good token still continues where it left off
        self.assertEqual(list(self.ad.get_conversation(conv, True, 1, token).records),
                         replay[1:2])

    def test_list_agents_pages(self):
        names = ['runner-anthropic', 'runner-openai']
        page = self.ad.list_agents()
        self.assertEqual(sorted(a.name for a in page.agents), names)
        self.assertEqual(page.next_page_token, '')
        first = self.ad.list_agents(page_size=1)
        self.assertEqual(len(first.agents), 1)
        self.assertTrue(first.next_page_token)
        second = self.ad.list_agents(1, first.next_page_token)
        self.assertEqual(len(second.agents), 1)
        self.assertEqual(sorted([first.agents[0].name, second.agents[0].name]), names)
        self.assertEqual(sorted(a.name for a in self.ad.list_all_agents(page_size=1)), names)
        for a in self.ad.list_all_agents():
            self.assertTrue(a.model, a)

    def test_abort_target_is_a_oneof(self):
        # no target at all
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, self.ad.call, 'Abort',
                            agent_pb2.AbortRequest())
        conv, sids, _ = self.settled_conversation()
        # a conversation target: nothing unsettled is left to stamp
        resp = self.ad.abort(conversation_id=conv)
        self.assertFalse(resp.aborted)
        self.assertEqual(list(resp.affected), [])
        resp = self.ad.abort(submission_id=sids[0])
        self.assertFalse(resp.aborted)
        self.assertEqual(list(resp.affected), [])

    def test_watch_unknown_conversation_is_not_found(self):
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, self.ad.watch_all, 'c-never-seen-1234')
        self.assertRpcError(grpc.StatusCode.NOT_FOUND,
                            lambda: list(self.ad.watch('c-never-seen-1234', -1, follow=True,
                                                       timeout=5)))

    def test_garbage_from_provider_fails(self):
        conv, sid, t0 = self.submit('runner-anthropic',
                                    [{'garbage': 'this is <html> not a model response'}] * 4)
        s = self.wait_settled(sid, timeout=20)
        self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
        self.assertIn('model call failed', s.error)
        self.assertIn('anthropic', s.error.lower())
        self.assert_settled_once(conv, [sid])
        self.assertTrue(self.ad.alive())
        self.assertEqual(self.ad.health_check(), H.SERVING)

    def test_an_empty_answer_leaves_the_conversation_usable(self):
        """An answer with no text and no calls (a reasoning model that spent its output on
        reasoning) completes its submission. On OpenAI it went back to the model with content
        null, which the API refuses: every later submission of the conversation failed."""
        for agent in ('runner-anthropic', 'runner-openai'):
            with self.subTest(agent=agent):
                conv, sid, _ = self.submit(agent, [{'text': ''}])
                self.assertEqual(outcome_name(self.wait_settled(sid, timeout=30).outcome),
                                 'COMPLETED')
                self.fm.set_scenario(bind([{'text': 'Here now.'}], conv))
                sid = self.ad.submit(agent, 'Still there?', conversation_id=conv).submission_id
                s = self.wait_settled(sid, timeout=30)
                self.assertEqual(outcome_name(s.outcome), 'COMPLETED', s.error)

    def test_broken_event_stream_fails(self):
        for agent in ('runner-anthropic', 'runner-openai'):
            with self.subTest(agent=agent):
                conv, sid, t0 = self.submit(agent, [
                    {'garbage': 'event: message_start\ndata: {"type": "message_start", broken\n\n'
                                'data: {not json at all\n\n'}] * 4)
                s = self.wait_settled(sid, timeout=20)
                self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
                self.assertIn('model call failed', s.error)
                self.assertIn(agent.split('-')[1], s.error.lower())
                self.assert_settled_once(conv, [sid])

    def check_invalid_tool_arguments(self, agent):
        conv, sid, t0 = self.submit(agent, [
            {'tool_calls': [{'name': 'read', 'arguments': '{"path": "x.txt", '}]},
            {'text': 'I see the arguments were broken.'}])
        s = self.wait_settled(sid, timeout=20)
        self.assertEqual(outcome_name(s.outcome), 'COMPLETED', s.error)
        recs = self.assert_settled_once(conv, [sid])
        results = [r for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, [kind(r) for r in recs])
        rb = body(results[0])
        self.assertTrue(rb.is_error, rb)
        self.assertFalse(rb.outcome_unknown, rb)
        reqs = self.model_requests(conv)
        self.assertEqual([e['step'] for e in reqs], [0, 1])
        got = request_tail_tool_results(reqs[1])
        self.assertEqual(len(got), 1)
        self.assertEqual(got[0][1], rb.text)
        if got[0][2] is not None:
            self.assertTrue(got[0][2])
        final = [r for r in recs if kind(r) == 'assistant_message'][-1]
        self.assertEqual(body(final).text, 'I see the arguments were broken.')

    def test_invalid_tool_arguments_anthropic(self):
        self.check_invalid_tool_arguments('runner-anthropic')

    def test_invalid_tool_arguments_openai(self):
        self.check_invalid_tool_arguments('runner-openai')

    def test_http_401_fails_fast(self):
        for agent in ('runner-anthropic', 'runner-openai'):
            with self.subTest(agent=agent):
                conv, sid, t0 = self.submit(agent, [{'error': {'status': 401}}] * 3)
                s = self.wait_settled(sid, timeout=20)
                elapsed = time.monotonic() - t0
                self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
                self.assertLess(elapsed, 3.0, 'a 401 took %.1f s to fail' % elapsed)
                self.assertEqual(len(self.model_requests(conv)), 1, 'the 401 was retried')
                self.assertTrue('credential' in s.error.lower() or 'api key' in s.error.lower(),
                                s.error)
                self.assertIn('401', s.error)

    def test_an_error_text_cut_inside_a_character_still_fails_once(self):
        # a provider's message quoting text cut mid-character: the failure is recorded as it
        # is (storaged refuses a Settle whose error is not UTF-8; the drive then tried again)
        for agent in ('runner-anthropic', 'runner-openai'):
            with self.subTest(agent=agent):
                msg = 'x' * 298 + '\u00e9' + ' quoted from the request'
                conv, sid, t0 = self.submit(agent, [{'error': {'status': 400, 'message': msg}}] * 3)
                s = self.wait_settled(sid, timeout=30)
                self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
                self.assertEqual(len(self.model_requests(conv)), 1, 'the 400 was asked again')
                self.assertEqual(s.attempt_count, 1)
                self.assertIn('xxx', s.error)

    def test_http_5xx_once_then_success(self):
        for agent, status in (('runner-anthropic', 529), ('runner-anthropic', 500),
                              ('runner-openai', 500), ('runner-openai', 529)):
            with self.subTest(agent=agent, status=status):
                conv, sid, t0 = self.submit(agent, [{'error': {'status': status}},
                                                    {'text': 'fine after %d' % status}])
                s = self.wait_settled(sid, timeout=20)
                self.assertEqual(outcome_name(s.outcome), 'COMPLETED', s.error)
                self.assertEqual([e['step'] for e in self.model_requests(conv)], [0, 1])
                recs = self.assert_settled_once(conv, [sid])
                final = [r for r in recs if kind(r) == 'assistant_message']
                self.assertEqual([body(r).text for r in final], ['fine after %d' % status])

    def test_a_provider_echoing_the_key_never_gets_it_recorded(self):
        for agent, key in (('runner-anthropic', 'test-anthropic-key'),
                           ('runner-openai', 'test-openai-key')):
            with self.subTest(agent=agent):
                conv, sid, t0 = self.submit(agent, [{'error': {
                    'status': 401, 'message': 'invalid api key %s for this org' % key}}] * 3)
                s = self.wait_settled(sid, timeout=20)
                self.assertEqual(outcome_name(s.outcome), 'FAILED', s.error)
                self.assertIn('401', s.error)
                self.assertNotIn(key, s.error)
                self.assertIn('[redacted]', s.error)

    def test_zz_no_key_in_any_log_or_record(self):
        """After every test of the class: neither provider key appears in a daemon's log or
        in any record or submission storaged holds."""
        keys = ('test-anthropic-key', 'test-openai-key')
        for name, d in self.stack.daemons:
            if name == 'fake_model':
                continue  # the provider itself: it is sent the key
            for key in keys:
                self.assertNotIn(key, d.stderr_text(), name)
        subs = H.list_all(self.stack.sd.stub)
        self.assertTrue(subs)
        for conv in sorted({x.conversation_id for x in subs}):
            for r in self.records(conv):
                for key in keys:
                    self.assertNotIn(key.encode(), r.SerializeToString(), conv)
        for x in subs:
            for key in keys:
                self.assertNotIn(key.encode(), x.SerializeToString())

    def test_zz_healthy_after_everything(self):
        self.assertTrue(self.ad.alive(), 'agentd exited')
        self.assertEqual(self.ad.health_check(), H.SERVING)
        names = sorted(a.name for a in self.ad.list_all_agents())
        self.assertEqual(names, ['runner-anthropic', 'runner-openai'])
        conv, sid, t0 = self.submit('runner-openai', [{'text': 'still here'}])
        s = self.wait_settled(sid, timeout=20)
        self.assertEqual(outcome_name(s.outcome), 'COMPLETED', s.error)
        self.assertNotIn('AddressSanitizer', self.ad.stderr_text())


if __name__ == '__main__':
    unittest.main()
