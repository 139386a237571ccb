"""W3C trace context (docs/operations.md, "Tracing"): a Submit's `traceparent` (or a trace
agentd starts) is kept with the submission in storaged, carried as gRPC metadata to storaged and
toold and as an HTTP header on the model's requests, and ends every log line written for the
work. Real storaged, toold and agentd processes; the offline model logs the headers it got.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_trace

What is checked:
 1. a Submit with a valid traceparent: its trace id in the Admission, the stored submission,
    every agentd line about the submission, storaged's lines for its calls, toold's tool.call
    lines and the traceparent of each model request, each hop with a parent-id of its own;
    the tracestate travels along;
 2. a Submit without one, or with a malformed one: accepted, and a new trace used the same way
    across the three daemons and the model;
 3. agentd killed mid-drive, another agentd taking the work over: the same trace id in the
    second agentd's lines, storaged's takeover claim, toold's lines and the model requests it
    makes, under a new span;
 4. Abort and GetSubmission carry the caller's trace to storaged; a subagent's submission is
    part of its parent's trace;
 5. storaged and toold on their own: a call's traceparent ends the lines logged for it (a
    Claim, which carries none, logs the trace its submission was admitted with; ExecuteBatch's
    parallel calls each log it); a malformed stored traceparent is refused.
"""

import os
import re
import time
import unittest
import uuid

import grpc

import cflue_harness as H
from cflue_harness import (Agentd, StoragedTestCase, TooldTestCase, admit_request, agent_pb2,
                           claim, common_pb2, store_pb2, tool_call, tools_pb2)
from test_agentd import (COMPLETED, AgentdCase, bind, body, kind, new_conv, request_system)

TID = '4bf92f3577b34da6a3ce929d0e0e4736'
PID = '00f067aa0ba902b7'
TRACEPARENT = '00-%s-%s-01' % (TID, PID)
TAIL = re.compile(r' trace_id=([0-9a-f]{32}) span_id=([0-9a-f]{16})$')
HEADER = re.compile(r'^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$')


def new_traceparent():
    """A valid traceparent of a trace of its own: (header, trace_id, parent_id)."""
    tid, pid = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return '00-%s-%s-01' % (tid, pid), tid, pid


def trace_of(line):
    """(trace_id, span_id) that ends a log line, or None."""
    m = TAIL.search(line)
    return m.groups() if m else None


def lines(text, *needles):
    """The lines of a log holding every needle."""
    return [l for l in text.splitlines() if all(n in l for n in needles)]


def header_trace(tp):
    """(trace_id, parent_id, flags) of a version-00 traceparent; fails on anything else."""
    m = HEADER.match(tp or '')
    assert m, 'not a version-00 traceparent: %r' % (tp,)
    return m.groups()


def agent_call(ad, method, req, metadata=(), timeout=10):
    """An Agent call with request metadata (the harness's own calls send none)."""
    req_cls, resp_cls, streaming = H.AGENT_METHODS[method]
    ch = ad._current_channel()
    c = ch.unary_unary('/cflue.v1.Agent/' + method, request_serializer=req_cls.SerializeToString,
                       response_deserializer=resp_cls.FromString)
    return c(req, timeout=timeout, metadata=list(metadata))


def submit(ad, agent, text, conv, metadata=()):
    return agent_call(ad, 'Submit', agent_pb2.SubmitRequest(
        agent=agent, conversation_id=conv, message=H.message(text)), metadata)


class TraceCase(AgentdCase):
    """One stack; storaged logs every call (debug), so each Store call of the work shows."""
    stack_kwargs = {
        'agents': ('runner-anthropic', 'task-lead', 'task-helper', 'task-scout', 'task-deep'),
        'storaged_args': ('--log-level', 'debug'),
    }

    def run_two_turns(self, tag, metadata=()):
        """A submission of conv whose model asks for one bash call, then answers. Returns
        (admission, settled submission, conv, the call's id)."""
        conv = new_conv(tag)
        self.workspace(conv)
        # the answer comes after agentd's --hold-writes-ms (50 ms), so the tool result goes in
        # an Append of its own, not with the Settle: two Appends to compare
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo traced'}}]},
            {'text': 'Done.', 'delay_ms': 500},
        ], conv))
        adm = submit(self.ad, 'runner-anthropic', 'run it', conv, metadata)
        sub = self.wait_settled(adm.submission_id)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        calls = [c for r in self.records(conv) if kind(r) == 'assistant_message'
                 for c in body(r).tool_calls]
        self.assertEqual(len(calls), 1)
        return adm, sub, conv, calls[0].id

    def assert_traced(self, sid, conv, call_id, tid, caller_span=None, state=''):
        """Every agentd line about sid, storaged's lines about it and toold's line of the call
        end with trace tid; the model's requests for conv carried it (the tracestate too), and
        no hop reused the caller's span."""
        ad_log, sd_log, td_log = (self.ad.stderr_text(), self.stack.sd.stderr_text(),
                                  self.td.stderr_text())
        about = lines(ad_log, sid)
        self.assertTrue(lines(ad_log, 'event=drive ', sid), ad_log[-3000:])
        self.assertTrue(lines(ad_log, 'event=submit ', sid))
        for l in about:
            self.assertEqual((trace_of(l) or ('-',))[0], tid, l)
        for ev in ('event=store.admit ', 'event=store.settle '):
            got = lines(sd_log, ev, 'submission=' + sid)
            self.assertEqual(len(got), 1, ev)
            self.assertEqual(trace_of(got[0])[0], tid, got[0])
        # the drive's Appends, each a call of its own: a new parent-id each
        appends = [trace_of(l) for l in lines(sd_log, 'method=Append', 'trace_id=' + tid)]
        self.assertGreaterEqual(len(appends), 2)
        self.assertEqual(len(set(s for _, s in appends)), len(appends))
        # (a Claim carries no trace: storaged logs the submission's, with the caller's span)
        spans = [trace_of(l)[1] for l in lines(sd_log, 'trace_id=' + tid)
                 if 'event=store.claim ' not in l]
        tool = lines(td_log, 'event=tool.call ', 'call=' + call_id)
        self.assertEqual(len(tool), 1, td_log[-2000:])
        self.assertEqual(trace_of(tool[0])[0], tid, tool[0])
        spans.append(trace_of(tool[0])[1])
        reqs = [e for e in self.fm.requests() if conv in request_system(e)]
        self.assertEqual(len(reqs), 2)
        hops = []
        for e in reqs:
            t, p, flags = header_trace(e['headers'].get('traceparent'))
            self.assertEqual(t, tid, e['headers'])
            self.assertEqual(e['headers'].get('tracestate', ''), state)
            hops.append(p)
        self.assertEqual(len(set(hops)), 2, 'each model request is a span of its own')
        spans += hops
        if caller_span:
            self.assertNotIn(caller_span, spans, 'a hop reused the caller\'s parent-id: %s' % (
                lines(sd_log + td_log, 'span_id=' + caller_span),))

    def test_valid_traceparent_everywhere(self):
        tp, TID, PID = new_traceparent()
        md = [('traceparent', tp), ('tracestate', 'rojo=00f067aa0ba902b7, congo=t61')]
        adm, sub, conv, call_id = self.run_two_turns('tpv', md)
        self.assertEqual(header_trace(adm.traceparent)[0], TID)
        self.assertEqual(sub.traceparent, adm.traceparent)
        self.assertEqual(H.get(self.stack.sd.stub, adm.submission_id).tracestate,
                         'rojo=00f067aa0ba902b7,congo=t61')
        self.assert_traced(adm.submission_id, conv, call_id, TID, caller_span=PID,
                           state='rojo=00f067aa0ba902b7,congo=t61')
        # the Submit's own line: the caller's span (agentd records no span of its own)
        submit_line = lines(self.ad.stderr_text(), 'event=submit ', adm.submission_id)[0]
        self.assertEqual(trace_of(submit_line), (TID, PID))
        # a later version of the header is read as version 00
        _, tid2, pid2 = new_traceparent()
        later = '01-%s-%s-01-and-more' % (tid2, pid2)
        adm2, _, conv2, call2 = self.run_two_turns('tpl', [('traceparent', later)])
        self.assertEqual(header_trace(adm2.traceparent)[:2], (tid2, pid2))
        self.assert_traced(adm2.submission_id, conv2, call2, tid2, caller_span=pid2)

    def test_absent_or_malformed_starts_one(self):
        _, TID, PID = new_traceparent()
        seen = set()
        cases = [
            [],
            [('traceparent', '00-%s-%s-01' % (TID.upper(), PID))],  # uppercase
            [('traceparent', '00-%s-0000000000000000-01' % TID)],  # all-zero parent-id
            [('traceparent', 'garbage'), ('tracestate', 'k=v')],
            [('tracestate', 'k=v')],  # a tracestate alone is no trace
        ]
        for i, md in enumerate(cases):
            adm, sub, conv, call_id = self.run_two_turns('tpn%d' % i, md)
            tid, span, flags = header_trace(adm.traceparent)
            self.assertNotEqual(tid, TID)
            self.assertNotIn(tid, seen, 'each Submit starts a trace of its own')
            seen.add(tid)
            self.assertEqual(flags, '01')
            self.assertEqual(sub.traceparent, adm.traceparent)
            self.assertEqual(sub.tracestate, '')
            self.assert_traced(adm.submission_id, conv, call_id, tid)

    def test_abort_and_get_carry_the_callers_trace(self):
        conv = new_conv('tpa')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 20'}}]},
        ], conv))
        adm = submit(self.ad, 'runner-anthropic', 'wait', conv)
        own = header_trace(adm.traceparent)[0]
        self.wait_for('the model call', lambda: [e for e in self.fm.requests()
                                                 if conv in request_system(e)])
        caller, ctid, _ = new_traceparent()
        got = agent_call(self.ad, 'GetSubmission',
                         agent_pb2.GetSubmissionRequest(submission_id=adm.submission_id),
                         [('traceparent', caller)])
        self.assertEqual(got.traceparent, adm.traceparent)
        agent_call(self.ad, 'Abort', agent_pb2.AbortRequest(submission_id=adm.submission_id),
                   [('traceparent', caller)])
        sub = self.wait_settled(adm.submission_id)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_ABORTED)
        sd_log, ad_log = self.stack.sd.stderr_text(), self.ad.stderr_text()
        for method in ('Get', 'RequestAbort'):
            got = lines(sd_log, 'method=%s ' % method, 'trace_id=' + ctid)
            self.assertTrue(got, 'storaged logged no %s under the caller\'s trace' % method)
        self.assertTrue(lines(ad_log, 'event=abort ', 'trace_id=' + ctid))
        # the work itself stays in the submission's own trace
        self.assertEqual(trace_of(lines(sd_log, 'event=store.settle ',
                                        'submission=' + adm.submission_id)[0])[0], own)

    def test_subagent_is_part_of_the_trace(self):
        conv = new_conv('tps')
        self.workspace(conv)

        def role(name, **step):
            step['match'] = {'system_contains': 'ROLE %s.' % name}
            return step
        self.fm.set_scenario([
            role('lead', tool_calls=[{'name': 'task', 'arguments': {
                'agent': 'task-helper', 'prompt': 'Look it up.'}}]),
            role('helper', text='Found it.'),
            role('lead', text='All done.'),
        ])
        tp, TID, PID = new_traceparent()
        adm = submit(self.ad, 'task-lead', 'delegate', conv, [('traceparent', tp)])
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        started = [body(r) for r in self.records(conv) if kind(r) == 'task_started']
        self.assertEqual(len(started), 1)
        child = H.get(self.stack.sd.stub, started[0].child_submission_id)
        tid, span, _ = header_trace(child.traceparent)
        self.assertEqual(tid, TID)
        self.assertNotEqual(span, PID)
        for l in lines(self.ad.stderr_text(), child.submission_id):
            self.assertEqual((trace_of(l) or ('-',))[0], TID, l)
        helper = [e for e in self.fm.requests() if 'ROLE helper.' in request_system(e)]
        self.assertTrue(helper)
        for e in helper:
            self.assertEqual(header_trace(e['headers'].get('traceparent'))[0], TID)


    def submit_with_env(self, conv, variables):
        """cflue submit 'hello' to conv with variables added to its environment: (rc, out, err)."""
        from test_cli import run_cli
        env = dict(os.environ)
        os.environ.update(variables)
        try:
            return run_cli(['submit', '--agent', 'runner-anthropic', '--conversation', conv,
                            'hello', '--agentd', self.ad.target])
        finally:
            os.environ.clear()
            os.environ.update(env)

    def test_cli_sends_the_environments_trace(self):
        """cflue's agent commands send TRACEPARENT (and TRACESTATE) from the environment;
        submit names the trace, status shows it."""
        from test_cli import run_cli
        tp, tid, pid = new_traceparent()
        conv = new_conv('tpc')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'Traced from the shell.'}], conv))
        rc, out, err = self.submit_with_env(conv, {'TRACEPARENT': tp, 'TRACESTATE': 'shell=1'})
        self.assertEqual(rc, 0, out + err)
        m = re.search(r'submission (\S+) in conversation %s \(trace (\S+)\)' % conv, err)
        self.assertTrue(m, err)
        self.assertEqual(header_trace(m.group(2))[:2], (tid, pid))
        rc, out, err = run_cli(['status', m.group(1), '--agentd', self.ad.target])
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r'(?m)^trace +%s$' % re.escape(m.group(2)))
        self.assertEqual(H.get(self.stack.sd.stub, m.group(1)).tracestate, 'shell=1')
        req = [e for e in self.fm.requests() if conv in request_system(e)][0]
        self.assertEqual(header_trace(req['headers']['traceparent'])[0], tid)


    def test_cli_normalizes_or_drops_the_environments_trace(self):
        """A TRACEPARENT with blanks around it (which the spec allows, and gRPC refuses in a
        header) is sent normalized; one that does not parse is named on stderr and not sent:
        either way the command works."""
        tp, tid, pid = new_traceparent()
        for raw, expect in (('\t' + tp + ' ', tid), ('00-not-a-trace', None)):
            conv = new_conv('tpn')
            self.workspace(conv)
            self.fm.set_scenario(bind([{'text': 'Still answered.'}], conv))
            rc, out, err = self.submit_with_env(conv, {'TRACEPARENT': raw,
                                                       'TRACESTATE': 'caf\u00e9=1'})
            self.assertEqual(rc, 0, out + err)
            m = re.search(r'\(trace (\S+)\)', err)
            self.assertTrue(m, err)
            if expect:
                self.assertEqual(header_trace(m.group(1))[:2], (tid, pid))
            else:
                self.assertIn('TRACEPARENT ignored', err)
                self.assertNotEqual(header_trace(m.group(1))[0], tid)


class TraceTakeoverCase(AgentdCase):
    """agentd A is killed mid-drive; agentd B (another owner) takes the work over once A's
    lease runs out."""
    LEASE_MS = 2000
    stack_kwargs = {
        'agents': ('runner-anthropic',),
        'agentd_args': ('--lease-ms', str(LEASE_MS), '--heartbeat-ms', '500'),
        'owner_ids': ['trace-a'],
    }

    def test_takeover_keeps_the_trace(self):
        conv = new_conv('tpt')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 4; echo slept'}}]},
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo after'}}]},
            {'text': 'Done after the takeover.'},
        ], conv))
        a = self.ad
        adm = submit(a, 'runner-anthropic', 'run through a crash', conv,
                     [('traceparent', TRACEPARENT)])
        sid = adm.submission_id
        # the first turn's call is recorded (it runs after that): kill A while it runs
        self.wait_for('the first call', lambda: [r for r in self.records(conv)
                                                 if kind(r) == 'assistant_message'])
        time.sleep(0.3)
        a_drive = lines(a.stderr_text(), 'event=drive ', sid)
        self.assertEqual(len(a_drive), 1)
        a.kill()
        b = Agentd(self.stack.sd.target, self.stack.agents_dir, owner_id='trace-b',
                   env=self.stack.env, extra_args=self.stack_kwargs['agentd_args'],
                   workdir=self.stack._sub('agentd-b'))
        self.stack.daemons.append(('agentd-b', b))
        sub = self.wait_settled(sid, timeout=60, ad=b)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        self.assertGreaterEqual(sub.attempt_count, 2)
        b_log, sd_log, td_log = b.stderr_text(), self.stack.sd.stderr_text(), self.td.stderr_text()
        b_drive = lines(b_log, 'event=drive ', sid)
        self.assertEqual(len(b_drive), 1, b_log[-3000:])
        self.assertIn('takeover=1', b_drive[0])
        self.assertEqual(trace_of(b_drive[0])[0], TID)
        self.assertNotEqual(trace_of(b_drive[0])[1], trace_of(a_drive[0])[1],
                            'a new drive is a new span')
        for l in lines(b_log, sid):
            self.assertEqual((trace_of(l) or ('-',))[0], TID, l)
        # storaged's takeover claim: the claimer knew no trace; the submission's is logged
        claims = lines(sd_log, 'event=store.claim ', 'submission=' + sid, 'takeover=1')
        self.assertEqual(len(claims), 1, sd_log[-3000:])
        self.assertEqual(trace_of(claims[0])[0], TID)
        self.assertEqual(trace_of(lines(sd_log, 'event=store.settle ',
                                        'submission=' + sid)[0])[0], TID)
        # B's tool call, and the model requests B made (steps 1 and 2), carry the trace
        calls = [c for r in self.records(conv) if kind(r) == 'assistant_message'
                 for c in body(r).tool_calls]
        after = lines(td_log, 'event=tool.call ', 'call=' + calls[-1].id)
        self.assertEqual(len(after), 1, td_log[-2000:])
        self.assertEqual(trace_of(after[0])[0], TID)
        reqs = [e for e in self.fm.requests() if conv in request_system(e)]
        self.assertEqual([e['step'] for e in reqs], [0, 1, 2])
        for e in reqs:
            self.assertEqual(header_trace(e['headers'].get('traceparent'))[0], TID)


class StoreTraceTest(StoragedTestCase):
    """storaged alone: the lines of a call carry its traceparent; a Claim (which carries none)
    logs the trace the submission was admitted with; a malformed traceparent is refused."""

    def test_lines_carry_the_calls_trace(self):
        sd = self.start_storaged()
        req = admit_request(conv='traced-conv')
        req.traceparent = TRACEPARENT
        caller = '00-%s-%s-00' % ('12' * 16, '34' * 8)
        sid = sd.stub.admit(req, metadata=[('traceparent', caller)]).submission.submission_id
        c = claim(sd.stub, submission_id=sid)
        self.assertEqual(c.submission.traceparent, TRACEPARENT)
        log = sd.stderr_text()
        admitted = lines(log, 'event=store.admit ', sid)
        self.assertEqual(trace_of(admitted[0]), ('12' * 16, '34' * 8))  # the call's
        claimed = lines(log, 'event=store.claim ', sid)
        self.assertEqual(trace_of(claimed[0]), (TID, PID))  # the submission's
        untraced = H.admit(sd.stub, conv='plain').submission.submission_id
        self.assertIsNone(trace_of(lines(sd.stderr_text(), 'event=store.admit ', untraced)[0]))

    def test_malformed_traceparent_refused(self):
        sd = self.start_storaged()
        for tp in ('01-%s-%s-01' % (TID, PID), '00-%s-%s-01' % (TID.upper(), PID),
                   '00-%s-%s-01' % ('0' * 32, PID), 'garbage'):
            req = admit_request(conv='bad-trace')
            req.traceparent = tp
            self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, sd.stub.admit, req)
        req = admit_request(conv='bad-trace')
        req.tracestate = 'k=v'
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, sd.stub.admit, req)
        req.traceparent = TRACEPARENT
        req.tracestate = 'k=' + 'v' * 600
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, sd.stub.admit, req)


class TooldTraceTest(TooldTestCase):
    """toold alone: Execute's and ExecuteBatch's tool.call lines carry the call's trace (the
    batch's calls run on threads of their own); a call without one logs none."""

    def test_tool_lines_carry_the_calls_trace(self):
        td = self.start_toold()
        td.workspace('tr', create=True)
        ch = td._current_channel()
        execute = ch.unary_unary('/cflue.v1.Tools/Execute',
                                 request_serializer=tools_pb2.ToolCall.SerializeToString,
                                 response_deserializer=tools_pb2.ToolResult.FromString)
        batch = ch.unary_stream('/cflue.v1.Tools/ExecuteBatch',
                                request_serializer=tools_pb2.ToolBatch.SerializeToString,
                                response_deserializer=tools_pb2.BatchResult.FromString)
        md = [('traceparent', TRACEPARENT)]
        execute(tool_call('tr', 'bash', {'command': 'echo one'}, call_id='c-one'), timeout=30,
                metadata=md)
        calls = [tool_call('tr', 'bash', {'command': 'echo %d' % i}, call_id='c-b%d' % i)
                 for i in range(3)]
        self.assertEqual(len(list(batch(tools_pb2.ToolBatch(calls=calls), timeout=30,
                                        metadata=md))), 3)
        execute(tool_call('tr', 'bash', {'command': 'echo two'}, call_id='c-plain'), timeout=30)
        log = td.stderr_text()
        for cid in ('c-one', 'c-b0', 'c-b1', 'c-b2'):
            got = lines(log, 'event=tool.call ', 'call=' + cid)
            self.assertEqual(len(got), 1, log[-2000:])
            self.assertEqual(trace_of(got[0]), (TID, PID), got[0])
        plain = lines(log, 'event=tool.call ', 'call=c-plain')
        self.assertIsNone(trace_of(plain[0]))


if __name__ == '__main__':
    unittest.main()
