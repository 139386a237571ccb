"""agentd's failure paths: peers down for longer than the retry window, toold unreachable
when a drive starts, budgets that must end work as `failed`, Compact never joined into
running work, and a storaged whose every commit is slow. Real storaged, toold and agentd processes; the offline model.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_faults

The rule every test checks in the end: a submission settles `completed` only when its
stream ends with a finished answer: the last assistant message asks for no tool and every
tool call has a recorded result (the real one, or "outcome unknown" after an interruption).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

import grpc

import cflue_harness as H
from cflue_harness import agent_pb2, common_pb2, request_abort
from test_agentd import (COMPLETED, SETTLED, AgentdCase, bind, body, kind, load_scenario,
                         new_conv, outcome_name, request_system)

# agentd retries a Store call for max(lease, 5 s); these outages are longer than that.
LEASE_MS = 3000
OUTAGE_S = 9


def tool_calls(rec):
    return list(body(rec).tool_calls)


def gated_bash(effect):
    """A turn calling bash that waits for a file `go` in the workspace, then runs effect and
    prints tool-finished (FaultsBase.storaged_down_then_go opens the gate)."""
    return {'tool_calls': [{'name': 'bash', 'arguments': {
        'command': 'while [ ! -e go ]; do sleep 0.05; done; %s; echo tool-finished' % effect}}]}


class FaultsBase(AgentdCase):
    """The stack and helpers of the fault tests (no tests of its own)."""
    stack_kwargs = {
        'agents': ('runner-anthropic', 'capped', 'brief'),
        'agentd_args': ('--lease-ms', str(LEASE_MS), '--heartbeat-ms', '1000'),
    }

    def setUp(self):
        # every test starts with all daemons up and agentd reaching storaged (a failed test
        # may leave one down)
        for d in (self.stack.sd, self.stack.td):
            if not d.alive():
                d.start()
        self.wait_store_reachable()

    def wait_store_reachable(self):
        """Waits until agentd reaches storaged."""

        def store_reachable():
            try:
                self.ad.get_submission('sub_probe')
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.NOT_FOUND
            return True

        self.wait_for('agentd to reach storaged', store_reachable, timeout=60, interval=0.2)

    def submit_losing_its_answer(self, conv, key=''):
        """A Submit whose Admit storaged commits and dies before answering (the stack's
        storaged runs with storaged.reply.Admit=crash): the Submit fails UNAVAILABLE, and
        storaged is down. Returns storaged's output up to its crash."""
        with self.assertRaises(grpc.RpcError) as cm:
            self.ad.submit('runner-anthropic', 'hi (%s)' % conv, conversation_id=conv,
                           idempotency_key=key)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.stack.sd.proc.wait(10)
        text = self.stack.sd.stderr_text()
        self.assertIn('failpoint_crash point=storaged.reply.Admit', text)
        return text

    def host_with_follow_ups(self, tag, pad=''):
        """A host running a tool call (the `joins_gated` scenario) and two follow-ups submitted
        behind it meanwhile (their texts padded with pad); the call ends once both are admitted
        (queued behind the host), however long their Submits took. Returns (conversation, host,
        [follow-ups])."""
        conv = new_conv(tag)
        ws = self.workspace(conv)
        self.fm.set_scenario(load_scenario('joins_gated', conv))
        host = self.ad.submit('runner-anthropic', 'host message %s' % conv,
                              conversation_id=conv).submission_id
        self.wait_for('the host tool call to start',
                      lambda: os.path.exists(os.path.join(ws, 'started.txt')), timeout=60)
        joined = [self.ad.submit('runner-anthropic', 'follow-up %d for %s%s' % (i, conv, pad),
                                 conversation_id=conv).submission_id for i in range(2)]
        with open(os.path.join(ws, 'go'), 'w'):
            pass
        return conv, host, joined

    def storaged_down_then_go(self, conv, ws):
        """Once the gated call (gated_bash) is recorded, kills storaged and opens the gate: the
        tool finishes while storaged is down. Returns when storaged was killed (time.time())."""
        self.wait_record(conv, lambda r: kind(r) == 'assistant_message', 'the tool call')
        self.stack.sd.kill()
        down_at = time.time()
        with open(os.path.join(ws, 'go'), 'w'):
            pass
        return down_at

    def assert_outcome_true(self, conv, sid):
        """completed => the stream shows the finished answer, every call with its result."""
        recs = self.records(conv)
        by_id = {r.id: r for r in recs}
        assistants = [r for r in recs if kind(r) == 'assistant_message'
                      and r.submission_id == sid]
        self.assertTrue(assistants, 'no assistant message for %s' % sid)
        for a in assistants:
            for c in tool_calls(a):
                rid = 'tool:%s:%d:%s' % (sid, body(a).turn, c.id)
                self.assertIn(rid, by_id, 'call %s of %s has no result: %s'
                              % (c.id, a.id, [(r.offset, kind(r), r.id) for r in recs]))
                self.assertEqual(kind(by_id[rid]), 'tool_result')
                self.assertEqual(body(by_id[rid]).tool_call_id, c.id)
        self.assertEqual(tool_calls(assistants[-1]), [],
                         'settled completed while the last assistant message asks for tools')
        settled = [r for r in recs if kind(r) == 'submission_settled' and r.submission_id == sid]
        self.assertEqual(len(settled), 1)
        self.assertEqual(body(settled[0]).outcome, COMPLETED)
        self.assertGreater(settled[0].offset, assistants[-1].offset)
        return recs

    def wait_settled(self, sid, timeout=30, ad=None):
        """As AgentdCase.wait_settled, but a storaged that just came back may still refuse
        agentd's first calls (UNAVAILABLE): the wait is asked again until the timeout."""
        ad = ad or self.ad
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                sub = ad.get_submission(sid, wait=True,
                                        timeout=max(1, deadline - time.monotonic()))
                self.assertEqual(sub.status, SETTLED, sub)
                return sub
            except grpc.RpcError as e:
                last = e
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    break
                time.sleep(0.2)
        self.fail('submission %s did not settle within %.0f s (last: %s %s)'
                  % (sid, timeout, last and last.code(), last and last.details()))

    def assert_limit_ends_a_late_answer(self, tag):
        """The 'brief' agent's 4 s end a submission whose model answers after 5.5 s, asking
        for a tool: it fails saying so, not before its time, and the tool never runs."""
        conv = new_conv(tag)
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'delay_ms': 5500, 'tool_calls': [{'name': 'bash', 'arguments': {
                'command': 'echo late >> effects.txt'}}]},
            {'text': 'should not be asked'}], conv))
        t0 = time.monotonic()
        adm = self.ad.submit('brief', 'slow (%s)' % conv, conversation_id=conv)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'FAILED', sub.error)
        self.assertIn('time limit', sub.error)
        self.assertGreater(time.monotonic() - t0, 3, 'the limit ended it early')
        time.sleep(2)  # the late answer would have run its tool by now
        self.assertFalse(os.path.exists(os.path.join(ws, 'effects.txt')),
                         'a tool ran after the time limit')

    def wait_record(self, conv, pred, what, timeout=20):
        return self.wait_for(what, lambda: [r for r in self.records(conv) if pred(r)],
                             timeout=timeout)


class FaultsCase(FaultsBase):
    # ---- storaged down past the retry window while a tool call runs ----

    def test_store_outage_during_tool_call_settles_only_a_finished_answer(self):
        conv = new_conv('outage')
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {
                'command': 'sleep 2; echo ran >> effects.txt; echo tool-finished'}}]},
            {'text': 'All done after the outage.'}], conv))
        adm = self.ad.submit('runner-anthropic', 'run it (%s)' % conv, conversation_id=conv)
        self.wait_record(conv, lambda r: kind(r) == 'assistant_message', 'the tool call')
        self.stack.sd.kill()
        time.sleep(OUTAGE_S)
        self.stack.sd.start()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        recs = self.assert_outcome_true(conv, adm.submission_id)
        self.assertGreaterEqual(sub.attempt_count, 2, 'the interrupted attempt was not counted')
        # the tool ran once at most, and the model heard about the call either way
        with open(os.path.join(ws, 'effects.txt')) as f:
            self.assertEqual(f.read(), 'ran\n')
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, results)
        # its result is the real one, or says the call may or may not have run
        if results[0].outcome_unknown:
            self.assertTrue(results[0].is_error, results[0])
        self.assertIn('drive_interrupted', self.ad.stderr_text())

    def test_results_written_beside_a_model_call_that_cannot_be_stored_stop_the_call(self):
        # A batch's last results go out beside the next model call. When storaged stays down
        # past the retry window, the drive stops at once: it does not wait for the model's
        # answer (30 s here), which could never be appended after results that are not stored.
        conv = new_conv('beside')
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            gated_bash('echo ran >> effects.txt'),
            {'text': 'An answer that comes too late.', 'delay_ms': 30000},
            {'text': 'Answered by the next attempt.'}], conv))
        adm = self.ad.submit('runner-anthropic', 'run it (%s)' % conv, conversation_id=conv)
        self.storaged_down_then_go(conv, ws)
        self.wait_for('the second model request', lambda: len(self.model_requests(conv)) >= 2,
                      timeout=30, interval=0.02)
        asked_at = time.monotonic()
        # the model was asked with the result the drive was still writing
        self.assertIn('tool-finished', json.dumps(self.model_requests(conv)[1]['body']['messages']))
        # (an earlier attempt may have been interrupted for another reason: toold just back)
        gave_up = 'event=drive_interrupted submission=%s' % adm.submission_id
        self.wait_for('the drive to give up', lambda: [
            line for line in self.ad.stderr_text().splitlines()
            if gave_up in line and 'recording to the conversation failed' in line],
            timeout=40, interval=0.1)
        self.assertLess(time.monotonic() - asked_at, 20, 'the drive waited for the late answer')
        self.stack.sd.start()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertGreaterEqual(sub.attempt_count, 2, 'the interrupted attempt was not counted')
        recs = self.assert_outcome_true(conv, adm.submission_id)
        answers = [body(r).text for r in recs if kind(r) == 'assistant_message' and body(r).text]
        self.assertEqual(answers, ['Answered by the next attempt.'])
        with open(os.path.join(ws, 'effects.txt')) as f:
            self.assertEqual(f.read(), 'ran\n')  # the tool was not run again
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, results)
        self.assertIn('store_retry submission=%s method=Append' % adm.submission_id,
                      self.ad.stderr_text())

    def test_an_input_that_cannot_be_stored_stops_the_first_model_call(self):
        # The input goes out beside the first model call. storaged, every commit of which takes
        # 2 s, is killed while the input's commit is under way and stays down past the retry
        # window: the drive stops at once instead of waiting for the model's answer (30 s
        # here), and the next attempt stores the input once, before its answer.
        conv = new_conv('input-lost')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'text': 'An answer that comes too late.', 'delay_ms': 30000},
            {'text': 'Answered by the next attempt.'}], conv))
        sd = self.stack.sd
        sd.stop()
        sd.env['CFLUE_FAILPOINTS'] = 'storaged.commit.before=sleep:2000'
        try:
            sd.start()
            self.wait_store_reachable()
            adm = self.ad.submit('runner-anthropic', 'hello (%s)' % conv, conversation_id=conv,
                                 timeout=30)
            self.wait_for('the first model request', lambda: self.model_requests(conv),
                          timeout=30, interval=0.01)
            sd.kill()
            asked_at = time.monotonic()
        finally:
            del sd.env['CFLUE_FAILPOINTS']
        self.assertEqual(len(self.model_requests(conv)), 1)
        gave_up = 'event=drive_interrupted submission=%s' % adm.submission_id
        self.wait_for('the drive to give up', lambda: gave_up in self.ad.stderr_text(),
                      timeout=40, interval=0.1)
        self.assertLess(time.monotonic() - asked_at, 20, 'the drive waited for the late answer')
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - asked_at)))  # past the retry window
        sd.start()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertGreaterEqual(sub.attempt_count, 2, 'the interrupted attempt was not counted')
        recs = self.assert_outcome_true(conv, adm.submission_id)
        self.assertEqual([kind(r) for r in recs if kind(r) in ('user_message', 'assistant_message')],
                         ['user_message', 'assistant_message'])
        self.assertEqual([body(r).text for r in recs if kind(r) == 'assistant_message'],
                         ['Answered by the next attempt.'])

    # ---- toold unreachable when a drive starts ----

    def test_toold_down_at_drive_start_never_reaches_the_model_without_tools(self):
        conv = new_conv('notools')
        self.workspace(conv, {'hello.txt': 'hi\n'})
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'cat hello.txt'}}]},
            {'text': 'It says hi.'}], conv))
        self.stack.td.kill()
        adm = self.ad.submit('runner-anthropic', 'read it (%s)' % conv, conversation_id=conv)
        time.sleep(4)  # several attempts to start the drive while toold is down
        self.assertEqual(self.model_requests(conv), [], 'the model was called without toold')
        self.assertFalse([r for r in self.records(conv) if kind(r) == 'system_prompt'],
                         'a system prompt was frozen without the sandbox')
        self.stack.td.start()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assert_outcome_true(conv, adm.submission_id)
        reqs = self.model_requests(conv)
        self.assertTrue(reqs)
        names = sorted(t['name'] for t in reqs[0]['body'].get('tools') or [])
        self.assertEqual(names, ['bash', 'edit', 'glob', 'grep', 'read', 'task', 'write'])
        system = request_system(reqs[0])
        self.assertIn('Working directory:', system)
        self.assertIn('hello.txt', system)
        self.assertIn('- bash:', system)
        results = [body(r) for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertEqual([r.text.strip() for r in results], ['hi'])

    def test_toold_down_during_the_first_of_two_batches_never_runs_the_second(self):
        """An answer of 70 calls goes as two batches (64 at most each, the second opened when
        the first is over). toold dies while the first one's gated call runs and stays down
        through the resumes that follow (4 s): the second batch never runs. The attempt that
        gets toold back records the calls left without a result as outcome unknown (the
        model is told so), runs none of them, and completes: every call has one result."""
        conv = new_conv('twobatches')
        ws = self.workspace(conv)
        gated = 'while [ ! -e go ]; do sleep 0.05; done; echo gated'
        calls = [{'name': 'bash', 'arguments': {'command': gated}}] + [
            {'name': 'write', 'arguments': {'path': 'same.txt', 'content': 'write %d\n' % i}}
            for i in range(1, 70)]
        self.fm.set_scenario(bind([{'tool_calls': calls}, {'text': 'all written'}], conv))
        adm = self.ad.submit('runner-anthropic', 'write it (%s)' % conv, conversation_id=conv)
        self.wait_record(conv, lambda r: kind(r) == 'tool_result' and body(r).index == 63,
                         'the first batch\'s last write')
        self.stack.td.kill()
        try:
            # the stream breaks at once (the drive is interrupted); 4 s of resumes that find
            # toold down (attempts 2 and 3, 1 and 2 s apart); with the agent's 8 attempts
            # (backoff doubling to 30 s), toold may take a minute to come back, as a busy
            # machine's TSan build once took too long for 5
            time.sleep(4)
            late = [body(r).index for r in self.records(conv) if kind(r) == 'tool_result'
                    and body(r).index >= 64 and not body(r).outcome_unknown]
            self.assertEqual(late, [], 'a call of the second batch ran')
        finally:
            with open(os.path.join(ws, 'go'), 'w'):
                pass
            self.stack.td.start()
        sub = self.wait_settled(adm.submission_id, timeout=90)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', (sub.error, sub.attempt_count))
        self.assertGreater(sub.attempt_count, 1)
        self.assert_outcome_true(conv, adm.submission_id)
        results = [body(r) for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertEqual(sorted(r.index for r in results), list(range(70)))
        self.assertEqual(sorted(r.index for r in results if r.outcome_unknown),
                         [0] + list(range(64, 70)))
        with open(os.path.join(ws, 'same.txt')) as f:
            self.assertEqual(f.read(), 'write 63\n', 'a call of the second batch ran')

    # ---- every attempt counts, whatever fails ----

    def test_every_interrupted_attempt_counts_against_max_attempts(self):
        conv = new_conv('attempts')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'never asked'}], conv))
        self.stack.td.kill()
        try:
            adm = self.ad.submit('capped', 'hello (%s)' % conv, conversation_id=conv)
            sub = self.wait_settled(adm.submission_id, timeout=60)
        finally:
            self.stack.td.start()
        self.assertEqual(outcome_name(sub.outcome), 'FAILED')
        self.assertIn('gave up after 3 attempts', sub.error)
        self.assertEqual(sub.attempt_count, 4)
        self.assertEqual(self.model_requests(conv), [])

    def test_work_for_an_agent_this_agentd_lacks_fails_with_a_clear_error(self):
        """Admitted straight into storaged (as another replica with other agents would): the
        drive reads the conversation, then settles it failed, naming why, with nothing
        written for it but the settlement."""
        conv = new_conv('ghost')
        adm = H.admit(self.stack.sd.stub, agent='ghost-agent', conv=conv, text='anyone there?')
        sub = self.wait_settled(adm.submission.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'FAILED')
        self.assertIn('no agent with that name', sub.error)
        self.assertEqual([kind(r) for r in self.records(conv)], ['submission_settled'])

    def test_abort_while_no_agentd_runs_settles_aborted_on_takeover(self):
        conv = new_conv('abort-takeover')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 5'}}]},
            {'text': 'should not be asked'}], conv))
        adm = self.ad.submit('runner-anthropic', 'nap (%s)' % conv, conversation_id=conv)
        self.wait_record(conv, lambda r: kind(r) == 'assistant_message', 'the tool call')
        self.ad.kill()
        request_abort(self.stack.sd.stub, submission_id=adm.submission_id)
        self.ad.start()
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'ABORTED', sub.error)
        self.assertEqual(sub.attempt_count, 2, 'the takeover did not settle the abort at once')
        # the interrupted call got its outcome-unknown result before the outcome
        results = [r for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1)
        self.assertTrue(body(results[0]).is_error)
        self.assertTrue(body(results[0]).outcome_unknown, body(results[0]))

    # ---- limits that are limits ----

    def test_time_limit_settles_failed_and_no_tool_runs_after_it(self):
        self.assert_limit_ends_a_late_answer('deadline')

    def test_time_limit_bounds_a_running_tool_call(self):
        conv = new_conv('deadline-tool')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 30'}}]},
            {'text': 'should not be asked'}], conv))
        t0 = time.monotonic()
        adm = self.ad.submit('brief', 'slow (%s)' % conv, conversation_id=conv)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertLess(time.monotonic() - t0, 15, 'the tool call outlived the time limit')
        self.assertEqual(outcome_name(sub.outcome), 'FAILED', sub.error)
        self.assertIn('time limit', sub.error)
        results = [body(r) for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, results)

    def test_time_limit_bounds_a_toold_that_does_not_answer(self):
        """A toold that takes the batch and answers nothing for 20 s (its connection alive):
        the sandbox's stream had no deadline, and the 'brief' agent's 4 s limit ended the
        submission only when toold answered. The stream ends a few seconds past the limit."""
        td = self.stack.td
        td.stop()
        td.env['CFLUE_FAILPOINTS'] = 'toold.bash.before_start=sleep:20000'
        try:
            td.start()
            conv = new_conv('slow-toold')
            self.workspace(conv)
            self.fm.set_scenario(bind([
                {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo ran'}}]},
                {'text': 'should not be asked'}], conv))
            t0 = time.monotonic()
            adm = self.ad.submit('brief', 'go (%s)' % conv, conversation_id=conv)
            sub = self.wait_settled(adm.submission_id, timeout=40)
            took = time.monotonic() - t0
        finally:
            del td.env['CFLUE_FAILPOINTS']
            td.stop()
            td.start()
        self.assertEqual(outcome_name(sub.outcome), 'FAILED', sub.error)
        self.assertIn('time limit', sub.error)
        self.assertLess(took, 16, 'the drive waited for toold past its limit')
        self.assertEqual(sub.attempt_count, 1, 'the time limit taken for a failing toold')
        [res] = [body(r) for r in self.records(conv) if kind(r) == 'tool_result']
        self.assertTrue(res.outcome_unknown, res)

    def test_turn_cap_settles_failed_saying_so(self):
        conv = new_conv('turns')
        self.workspace(conv)
        self.fm.set_scenario(bind(
            [{'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo %d' % i}}]}
             for i in range(6)], conv))
        adm = self.ad.submit('capped', 'loop (%s)' % conv, conversation_id=conv)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'FAILED', sub.error)
        self.assertIn('3 model turns', sub.error)
        recs = self.records(conv)
        self.assertEqual(len([r for r in recs if kind(r) == 'assistant_message']), 3)
        # the stream is consistent even though the work was cut short
        self.assertEqual(len([r for r in recs if kind(r) == 'tool_result']), 3)

    # ---- a returning peer is used again at once ----

    def test_storaged_back_after_a_long_outage_is_used_within_seconds(self):
        self.stack.sd.kill()
        # agentd's workers keep calling storaged (claims every second) while it is down, and
        # a Submit meanwhile is refused at once, UNAVAILABLE, naming storaged
        time.sleep(8)
        t0 = time.monotonic()
        with self.assertRaises(grpc.RpcError) as cm:
            self.ad.submit('runner-anthropic', 'while storaged is down', timeout=20)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE,
                         cm.exception.details())
        self.assertIn('storaged', cm.exception.details())
        self.assertLess(time.monotonic() - t0, 5.0)
        time.sleep(8)
        self.stack.sd.start()
        t0 = time.monotonic()
        conv = new_conv('back')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'back again'}], conv))
        deadline = t0 + 20
        adm = None
        while adm is None and time.monotonic() < deadline:
            try:
                adm = self.ad.submit('runner-anthropic', 'hi (%s)' % conv, conversation_id=conv,
                                     idempotency_key='back-' + conv)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE, e.details())
                time.sleep(0.1)
        took = time.monotonic() - t0
        self.assertIsNotNone(adm, 'agentd never reached storaged again')
        # gRPC's own reconnect backoff would be 6-10 s apart by now; agentd's is 1 s at most
        # (ThreadSanitizer's daemons, beside two other tests, get more for the Submit itself)
        self.assertLess(took, 5.0 if os.environ.get('CFLUE_TSAN') else 3.0,
                        'agentd took %.1f s to use storaged again' % took)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)


class FencedOffSecondBatchTest(AgentdCase):
    """An answer of 70 calls runs as two batches (64, then 6). Its agentd is frozen while the
    first batch's first call runs; another agentd takes the work over once the lease (3 s) has
    run out and writes same.txt itself. The frozen one, continued, opened its second batch
    with a lease it no longer held: its stale writes replaced the new attempt's file. The
    next batch waits until the results before it are stored, through the fence."""
    stack_kwargs = {'agents': ('runner-anthropic',), 'n_agentd': 2,
                    'agentd_args': ('--lease-ms', '3000', '--heartbeat-ms', '1000')}

    def test_a_fenced_off_attempt_opens_no_second_batch(self):
        a, b = self.stack.agentds
        conv = new_conv('stale')
        ws = self.workspace(conv)
        same = os.path.join(ws, 'same.txt')
        calls = ([{'name': 'bash', 'arguments': {'command': 'touch started; sleep 6'}}] +
                 [{'name': 'write', 'arguments': {'path': 'f%02d.txt' % i, 'content': 'x'}}
                  for i in range(1, 64)] +
                 [{'name': 'write', 'arguments': {'path': 'same.txt', 'content': 'STALE %d' % i}}
                  for i in range(64, 70)])
        self.fm.set_scenario(bind([
            {'tool_calls': calls},
            {'tool_calls': [{'name': 'write', 'arguments': {
                'path': 'same.txt', 'content': 'the attempt that holds the lease'}}]},
            {'text': 'finished'}], conv))
        sid = a.submit('runner-anthropic', 'go (%s)' % conv, conversation_id=conv).submission_id
        self.wait_for('the first call to start',
                      lambda: os.path.exists(os.path.join(ws, 'started')), timeout=30)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            sub = self.wait_settled(sid, timeout=60, ad=b)
            self.assertEqual(sub.outcome, COMPLETED, sub)
            with open(same) as f:
                self.assertEqual(f.read(), 'the attempt that holds the lease')
            # continued before toold's pings give its connection up (about 20 s)
            time.sleep(max(0, 9 - (time.monotonic() - t0)))
        finally:
            os.kill(a.pid, signal.SIGCONT)
        self.wait_for('the frozen attempt to learn it lost the work',
                      lambda: 'event=drive_stopped submission=%s' % sid in a.stderr_text(),
                      timeout=30)
        time.sleep(1)
        with open(same) as f:
            self.assertEqual(f.read(), 'the attempt that holds the lease')
        settled = [r for r in self.records(conv) if kind(r) == 'submission_settled']
        self.assertEqual(len(settled), 1)


class CommandsGoneFirstTest(FaultsBase):
    """A command that ignores SIGTERM runs when its attempt is cut off; toold's runner kills it
    2 s after the stream drops (docs/toold.md). The next attempt's command ran while the old one
    still wrote: at once when agentd restarted with its owner id (its work taken back at once),
    0.5 s into it when toold restarted (the resume came after 1 s). An attempt that finds calls
    of an earlier one without results runs no command before 5 s after its claim."""

    OLD = ("trap '' TERM; touch started; "
           "while true; do echo old $(date +%s.%N) >> log; sleep 0.05; done")

    def run_cut(self, restart):
        conv = new_conv('overlap')
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': self.OLD}}]},
            {'tool_calls': [{'name': 'bash', 'arguments': {
                'command': 'echo new $(date +%s.%N) >> log'}}]},
            {'text': 'finished'}], conv))
        adm = self.ad.submit('runner-anthropic', 'go (%s)' % conv, conversation_id=conv)
        self.wait_for('the old command', lambda: os.path.exists(os.path.join(ws, 'started')),
                      timeout=30)
        time.sleep(0.5)
        restart()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        time.sleep(3)  # the old command, were it alive, would write on
        with open(os.path.join(ws, 'log')) as f:
            lines = [line.split() for line in f if line.strip()]
        new = [float(t) for k, t in lines if k == 'new']
        self.assertEqual(len(new), 1, lines[-5:])
        after = [float(t) for k, t in lines if k == 'old' and float(t) > new[0]]
        self.assertEqual(after, [], 'the old command wrote %d lines after the new one ran'
                         % len(after))

    def test_agentd_restarted_at_once(self):
        def restart():
            self.ad.kill()
            self.ad.start()
        self.run_cut(restart)

    def test_toold_restarted_at_once(self):
        def restart():
            self.stack.td.kill()
            self.stack.td.start()
        self.run_cut(restart)


class ShortOutageTest(FaultsBase):
    """storaged down or frozen for less than the retry window (a 60 s lease): the attempt rides
    it out. A tool result or a Settle made while storaged is away is tried again on a timer
    (holding no engine thread) until storaged is back."""
    stack_kwargs = {'agents': ('runner-anthropic',), 'agentd_args': ('--lease-ms', '60000')}

    def test_a_tool_result_written_during_a_short_outage_is_stored_by_the_same_attempt(self):
        conv = new_conv('blip')
        ws = self.workspace(conv)
        # the answer comes 1 s after the result: past agentd's --hold-writes-ms (50 ms), the
        # result's own Append meets the outage
        self.fm.set_scenario(bind([
            gated_bash('date +%s.%N >> effects.txt'),
            {'text': 'Done despite the blip.', 'delay_ms': 1000}], conv))
        adm = self.ad.submit('runner-anthropic', 'run it (%s)' % conv, conversation_id=conv)
        # the tool finishes once storaged is down (a 'sleep 1' in it could finish first when
        # the test saw the record late on a loaded machine), and storaged stays down a while
        # after that, for the result's Append to meet the outage
        down_at = self.storaged_down_then_go(conv, ws)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(ws, 'effects.txt')):
            self.assertLess(time.monotonic(), deadline, 'the tool never finished')
            time.sleep(0.05)
        time.sleep(max(1.0, 2.5 - (time.time() - down_at)))
        up_at = time.time()
        self.stack.sd.start()
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 1, 'the outage cost an attempt')
        with open(os.path.join(ws, 'effects.txt')) as f:
            ran = [float(x) for x in f.read().split()]
        self.assertEqual(len(ran), 1, ran)
        # the result came while storaged was down: its Append had to be tried again
        self.assertTrue(down_at < ran[0] < up_at, (down_at, ran, up_at))
        recs = self.assert_outcome_true(conv, adm.submission_id)
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, results)
        self.assertFalse(results[0].outcome_unknown)
        self.assertIn('tool-finished', results[0].text)
        log = self.ad.stderr_text()
        self.assertIn('store_retry submission=%s method=Append' % adm.submission_id, log)
        self.assertNotIn('drive_interrupted', log)

    def test_a_settle_made_during_a_short_outage_is_recorded_by_the_same_attempt(self):
        conv = new_conv('blipsettle')
        self.workspace(conv)
        # 4 s: the kill below must come before the answer (1.5 s was tight on a loaded machine)
        self.fm.set_scenario(bind([{'text': 'The answer, late.', 'delay_ms': 4000}], conv))
        adm = self.ad.submit('runner-anthropic', 'answer (%s)' % conv, conversation_id=conv)
        self.wait_for('the model call', lambda: self.model_requests(conv), timeout=20,
                      interval=0.02)
        asked_at = time.time()
        # the input is stored while the model is asked (after agentd's --hold-writes-ms, the
        # wait for an answer that could have carried it): the Settle alone meets the outage
        self.wait_for('the input stored', lambda: self.records(conv), timeout=3, interval=0.02)
        self.stack.sd.kill()
        time.sleep(6)
        up_at = time.time()
        self.stack.sd.start()
        # the answer came 4 s after the request, with storaged down: the Settle carrying it
        # was tried again until storaged was back
        self.assertGreater(up_at, asked_at + 5.0)
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 1, 'the outage cost an attempt')
        recs = self.assert_outcome_true(conv, adm.submission_id)
        answers = [body(r).text for r in recs if kind(r) == 'assistant_message']
        self.assertEqual(answers, ['The answer, late.'])
        self.assertEqual(len(self.model_requests(conv)), 1, 'the model was asked again')
        log = self.ad.stderr_text()
        self.assertIn('store_retry submission=%s method=Settle' % adm.submission_id, log)
        self.assertNotIn('drive_interrupted', log)


    def test_results_written_while_storaged_is_frozen_past_the_call_deadline_land_once(self):
        # Frozen (SIGSTOP), storaged answers nothing: the first result's Append runs into its
        # 15 s deadline and is tried again, carrying exactly that result (storaged may have it
        # already once it runs again); the second result, which came meanwhile, follows
        conv = new_conv('frozen')
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [
                {'name': 'bash', 'arguments': {'command': 'sleep 1; echo one >> runs.txt; '
                                                          'echo first-done'}},
                {'name': 'bash', 'arguments': {'command': 'sleep 4; echo two >> runs.txt; '
                                                          'echo second-done'}}]},
            {'text': 'Both ran.'}], conv))
        adm = self.ad.submit('runner-anthropic', 'run both (%s)' % conv, conversation_id=conv)
        self.wait_record(conv, lambda r: kind(r) == 'assistant_message', 'the tool calls')
        os.kill(self.stack.sd.pid, signal.SIGSTOP)
        try:
            time.sleep(20)
        finally:
            os.kill(self.stack.sd.pid, signal.SIGCONT)
        sub = self.wait_settled(adm.submission_id, timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 1, 'the freeze cost an attempt')
        with open(os.path.join(ws, 'runs.txt')) as f:
            self.assertEqual(sorted(f.read().split()), ['one', 'two'])
        recs = self.assert_outcome_true(conv, adm.submission_id)
        results = sorted(body(r).text.strip() for r in recs if kind(r) == 'tool_result')
        self.assertEqual(results, ['first-done', 'second-done'])
        log = self.ad.stderr_text()
        retries = [line for line in log.splitlines()
                   if 'store_retry submission=%s method=Append' % adm.submission_id in line]
        sys.stderr.write('\n' + '\n'.join(retries[:3]) + '\n')
        self.assertTrue(retries, 'no Append was tried again')
        self.assertIn('eadline', retries[0])  # the first try ran into its deadline
        self.assertNotIn('drive_interrupted', log)


class LostAdmitAnswerTest(FaultsBase):
    """storaged commits a Submit's Admit (which claims it for this agentd) and dies before
    answering (failpoint storaged.reply.Admit): the submission is RUNNING under this agentd's
    lease with no drive. The client's retry with the same idempotency key is deduplicated,
    and agentd takes the work back at once instead of waiting out the 30 s lease."""
    stack_kwargs = {'agents': ('runner-anthropic',),
                    'storaged_env': {'CFLUE_FAILPOINTS': 'storaged.reply.Admit=crash'}}

    def test_a_retried_submit_whose_claimed_admit_lost_its_answer_runs_at_once(self):
        conv = new_conv('lostadmit')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'Taken back at once.'}], conv))
        key = 'lost-admit-' + conv
        self.submit_losing_its_answer(conv, key)
        del self.stack.sd.env['CFLUE_FAILPOINTS']
        self.stack.sd.start()
        t0 = time.monotonic()
        adm = None
        while adm is None and time.monotonic() < t0 + 20:
            try:
                adm = self.ad.submit('runner-anthropic', 'hi (%s)' % conv,
                                     conversation_id=conv, idempotency_key=key)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE, e.details())
                time.sleep(0.1)
        self.assertIsNotNone(adm, 'agentd never reached storaged again')
        self.assertTrue(adm.deduplicated)
        sub = self.wait_settled(adm.submission_id, timeout=25)
        took = time.monotonic() - t0
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertLess(took, 10.0, 'the work waited %.1f s: the lease ran out first' % took)
        self.assertIn('take_back submission=%s' % adm.submission_id, self.ad.stderr_text())
        self.assert_outcome_true(conv, adm.submission_id)


class LostAdmitAnswerNotRetriedTest(FaultsBase):
    """The same lost answer, and the client does not try again (it gave up, or its retry went
    to another agentd): agentd takes the work its Admit may have claimed back by itself, as
    after a Claim that got no answer, instead of leaving it to the 30 s lease."""
    stack_kwargs = {'agents': ('runner-anthropic',),
                    'storaged_env': {'CFLUE_FAILPOINTS': 'storaged.reply.Admit=crash'}}

    def test_a_claimed_admit_that_lost_its_answer_runs_without_a_retry(self):
        conv = new_conv('lostadmit1')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'Taken back without a retry.'}], conv))
        self.submit_losing_its_answer(conv)
        del self.stack.sd.env['CFLUE_FAILPOINTS']
        self.stack.sd.start()
        t0 = time.monotonic()
        subs = H.list_all(self.stack.sd.stub, conversation_id=conv)
        self.assertEqual(len(subs), 1, 'the Admit was not committed')
        sid = subs[0].submission_id
        sub = self.wait_settled(sid, timeout=40)
        took = time.monotonic() - t0
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertLess(took, 10.0, 'the work waited %.1f s: the lease ran out first' % took)
        self.assertIn('take_back submission=%s after=unanswered_claim' % sid,
                      self.ad.stderr_text())
        self.assert_outcome_true(conv, sid)


class TakeBackWhileAnAdmitIsAnsweredTest(FaultsBase):
    """A take-back runs while another Submit's Admit, which claimed its submission for this
    agentd, is committed and its answer not yet back (failpoints: storaged's List reads 3 s
    late, its Admit answers 9 s late). The take-back finds that submission RUNNING under this
    agentd with no drive; it must wait for the Admit's answer, which starts the drive, instead
    of taking the work over from it (an extra attempt, the first drive stopped at its first
    write)."""
    stack_kwargs = {'agents': ('runner-anthropic',),
                    'storaged_env': {'CFLUE_FAILPOINTS': 'storaged.reply.Admit=crash'}}

    def test_the_take_back_waits_for_the_admit_on_its_way(self):
        lost, slow = new_conv('tbw-lost'), new_conv('tbw-slow')
        self.workspace(slow)
        self.fm.set_scenario(bind([{'text': 'Done.'}], slow))
        log = self.submit_losing_its_answer(lost)  # a lost answer: a take-back is due
        found = re.search(r'event=store\.admit submission=(\S+) conversation=%s ' % lost, log)
        self.assertIsNotNone(found, 'storaged did not commit the lost Admit')
        # the claimer's List arrives within about a second of storaged's return and reads 3 s
        # later, after the slow Submit's commit and well before its answer, 9 s after it
        self.stack.sd.env['CFLUE_FAILPOINTS'] = ('storaged.read.List=sleep:3000,'
                                                 'storaged.reply.Admit=sleep:9000')
        self.stack.sd.start()
        # the lost Submit's work is settled at once (a Get: no List, which would wait), well
        # before the take-back's List reads, 3 s after it arrives: the List finds the slow
        # Submit's alone (a take-back of both would claim the lost one first, and wait behind
        # the slow Admit's answer in storaged's writer)
        a = H.get(self.stack.sd.stub, found.group(1))
        H.settle(self.stack.sd.stub, H.fence(a.submission_id, a.attempt_id, a.epoch),
                 common_pb2.OUTCOME_FAILED, 'settled by the test')
        adm = None
        t0 = time.monotonic()
        while adm is None and time.monotonic() < t0 + 20:
            try:
                adm = self.ad.submit('runner-anthropic', 'hi (%s)' % slow, conversation_id=slow,
                                     idempotency_key='tbw-' + slow, timeout=30)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE, e.details())
                time.sleep(0.1)
        self.assertIsNotNone(adm, 'agentd never reached storaged again')
        del self.stack.sd.env['CFLUE_FAILPOINTS']
        sub = self.wait_settled(adm.submission_id, timeout=40)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        # the scenario happened: the take-back's List saw the slow Submit's work undriven
        self.assertIn('take_back submission=%s after=unanswered_claim' % adm.submission_id,
                      self.ad.stderr_text())
        self.assertEqual(sub.attempt_count, 1, 'the take-back took the work over from the drive '
                         'its Admit was about to start')
        self.assert_outcome_true(slow, adm.submission_id)


class LostClaimAnswerTest(AgentdCase):
    """storaged commits the claimer's Claim and dies before answering (failpoint
    storaged.reply.Claim): the submission is RUNNING under agentd's lease with no drive.
    Once storaged is back, agentd finds it among its own and runs it at once, instead of
    waiting out a 20 s lease."""
    stack_kwargs = {'agents': ('runner-anthropic',), 'n_agentd': 0,
                    'storaged_env': {'CFLUE_FAILPOINTS': 'storaged.reply.Claim=crash'}}
    down_s = 0

    def test_work_whose_claim_lost_its_answer_runs_at_once(self):
        st = self.stack
        conv = new_conv('lostclaim')
        st.td.workspace(conv, create=True)
        st.fm.set_scenario(bind([{'text': 'Taken back after the lost Claim.'}], conv))
        sid = H.admit(st.sd.stub, agent='runner-anthropic', conv=conv,
                      text='hi (%s)' % conv).submission.submission_id
        ad = H.Agentd(st.sd.target, st.agents_dir, owner_id='agentd-lost-claim', env=st.env,
                      extra_args=('--lease-ms', '20000', '--heartbeat-ms', '2000'),
                      workdir=st._sub('agentd-lost-claim'))
        st.daemons.append(('agentd-lost-claim', ad))
        st.sd.proc.wait(30)
        self.assertIn('failpoint_crash point=storaged.reply.Claim', st.sd.stderr_text())
        time.sleep(self.down_s)  # the claimer's Claims and take-back Lists fail meanwhile
        del st.sd.env['CFLUE_FAILPOINTS']
        st.sd.start()
        t0 = time.monotonic()
        self.wait_for('the submission to settle',
                      lambda: H.get(st.sd.stub, sid).status == SETTLED, timeout=40)
        took = time.monotonic() - t0
        sub = H.get(st.sd.stub, sid)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertLess(took, 10.0, 'the work waited %.1f s: the lease ran out first' % took)
        self.assertIn('take_back submission=%s after=unanswered_claim' % sid, ad.stderr_text())


class LostClaimAnswerLongOutageTest(LostClaimAnswerTest):
    """The same with storaged down 6 s before it is back, far longer than the claimer's 1 s
    between tries: every Claim and take-back List meanwhile fails, and the first answered List
    still takes the work back."""
    down_s = 6


class LostJoinAnswerTest(FaultsBase):
    """storaged commits a ClaimJoinable (two follow-ups become JOINING into the running host)
    and dies before answering (failpoint storaged.reply.ClaimJoinable), and is back a moment
    later, within the retry window. The drive, parked on the call (no engine thread held),
    tries again on its timer, lists what is joining into it (the lost answer's deliveries
    come first), appends their inputs once and finalizes both joins: the host's one answer
    covers all three messages, and nothing is interrupted."""
    stack_kwargs = dict(FaultsBase.stack_kwargs, agents=('runner-anthropic',),
                        storaged_env={'CFLUE_FAILPOINTS': 'storaged.reply.ClaimJoinable=crash'})
    pad = ''

    def test_a_lost_claim_joinable_answer_is_retried_and_the_follow_ups_join_once(self):
        conv, host, joined = self.host_with_follow_ups('lostjoin', self.pad)
        self.stack.sd.proc.wait(15)  # the tool call ends, the drive claims the follow-ups
        self.assertIn('failpoint_crash point=storaged.reply.ClaimJoinable',
                      self.stack.sd.stderr_text())
        del self.stack.sd.env['CFLUE_FAILPOINTS']
        self.stack.sd.start()
        subs = {sid: self.wait_settled(sid, timeout=30) for sid in [host] + joined}
        for sid, sub in subs.items():
            self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', (sid, sub.error))
            self.assertEqual(sub.answered_by, host, sid)
        log = self.ad.stderr_text()
        self.assertIn('event=store_retry submission=%s method=ClaimJoinable' % host, log)
        self.assertNotIn('drive_interrupted', log)
        recs = self.records(conv)
        inputs = [r.id for r in recs if kind(r) == 'user_message']
        self.assertEqual(inputs, ['input:' + s for s in [host] + joined])
        self.assertEqual(len([r for r in recs if kind(r) == 'assistant_message'
                              and not tool_calls(r)]), 1, 'one answer for all three')
        self.assert_outcome_true(conv, host)


class LostJoinAnswerPagedTest(LostJoinAnswerTest):
    """The same with large follow-ups and a storaged of 1 MiB messages (pages of 512 KiB): the
    lost ClaimJoinable joins the first 300 KB follow-up only, the retry the second, and the
    List of what is joining takes two pages. Both are taken, in order (with the first page
    only, the second would go back to the queue and run after the host, answered apart). Both
    follow-ups are queued before the host's tool call ends (the call waits for them), so the
    pages are there on any machine."""
    stack_kwargs = dict(LostJoinAnswerTest.stack_kwargs,
                        storaged_args=('--max-message-bytes', str(1 << 20)))
    pad = ' ' + 'x' * 300000


class LongJoinOutageTest(FaultsBase):
    """The same lost ClaimJoinable answer, with storaged then down for longer than the retry
    window: the drive gives up and ends interrupted (no engine thread waited meanwhile). Once
    storaged is back, the next attempt puts the two deliveries the lost claim had made JOINING
    back in the queue (their inputs never landed), and every message is answered once."""
    stack_kwargs = LostJoinAnswerTest.stack_kwargs

    def test_storaged_gone_past_the_retry_window_after_a_claim_joinable(self):
        conv, host, joined = self.host_with_follow_ups('joinoutage')
        self.stack.sd.proc.wait(15)
        self.assertIn('failpoint_crash point=storaged.reply.ClaimJoinable',
                      self.stack.sd.stderr_text())
        self.wait_for('the host to give up', lambda: 'event=drive_interrupted submission=%s'
                      % host in self.ad.stderr_text(), timeout=30, interval=0.1)
        self.assertFalse(self.stack.sd.alive())
        self.assertIn('event=store_retry submission=%s method=ClaimJoinable' % host,
                      self.ad.stderr_text())
        del self.stack.sd.env['CFLUE_FAILPOINTS']
        self.stack.sd.start()
        subs = {sid: self.wait_settled(sid, timeout=60) for sid in [host] + joined}
        for sid, sub in subs.items():
            self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', (sid, sub.error))
            self.assertIn(sub.answered_by, [host] + joined, sid)
        self.assertEqual(subs[host].answered_by, host)
        self.assertGreaterEqual(subs[host].attempt_count, 2)
        log = self.ad.stderr_text()
        for sid in joined:
            self.assertIn('event=join_reverted submission=%s host=%s' % (sid, host), log)
        recs = self.records(conv)
        inputs = [r.id for r in recs if kind(r) == 'user_message']
        self.assertEqual(sorted(inputs), sorted('input:' + s for s in [host] + joined))
        self.assertEqual(inputs[0], 'input:' + host)
        for sid in [host] + joined:
            if subs[sid].answered_by == sid:
                self.assert_outcome_true(conv, sid)


class HalfJoinTakeoverTest(FaultsBase):
    """agentd dies with two follow-ups JOINING into the running host. The agentd that comes
    back takes the host over and settles both joins before the host goes on."""
    stack_kwargs = dict(FaultsBase.stack_kwargs, agents=('runner-anthropic',))

    def test_a_takeover_adopts_the_joins_whose_inputs_landed(self):
        """Died with the inputs stored and neither join final (agentd.join.finalize.before):
        both joins made final, one answer covers all three messages, each input stored once."""
        host, joined = self.crash_while_joining('agentd.join.finalize.before')
        subs = {sid: self.wait_settled(sid, timeout=30) for sid in [host] + joined}
        for sid, sub in subs.items():
            self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', (sid, sub.error))
            self.assertEqual(sub.answered_by, host, sid)
        log = self.ad.stderr_text()
        for sid in joined:
            self.assertIn('event=join_adopted submission=%s host=%s' % (sid, host), log)
        recs = self.records(self.conv)
        self.assertEqual([r.id for r in recs if kind(r) == 'user_message'],
                         ['input:' + s for s in [host] + joined])
        self.assertEqual(len([r for r in recs if kind(r) == 'assistant_message'
                              and not tool_calls(r)]), 1, 'one answer for all three')
        self.assert_outcome_true(self.conv, host)

    def test_a_takeover_puts_back_the_joins_whose_inputs_did_not_land(self):
        """The same, dying before the inputs were stored (agentd.join.inputs.before): both
        deliveries go back to the queue, and each is answered once, after the host."""
        host, joined = self.crash_while_joining('agentd.join.inputs.before')
        subs = {sid: self.wait_settled(sid, timeout=30) for sid in [host] + joined}
        for sid, sub in subs.items():
            self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', (sid, sub.error))
        log = self.ad.stderr_text()
        for sid in joined:
            self.assertIn('event=join_reverted submission=%s host=%s' % (sid, host), log)
        recs = self.records(self.conv)
        inputs = [r.id for r in recs if kind(r) == 'user_message']
        self.assertEqual(sorted(inputs), sorted('input:' + s for s in [host] + joined))
        self.assertEqual(inputs[0], 'input:' + host)
        for sid in [host] + joined:  # each answered by itself or by the one it joined
            self.assertIn(subs[sid].answered_by, [host] + joined)
            if subs[sid].answered_by == sid:
                self.assert_outcome_true(self.conv, sid)
        self.assertEqual(subs[host].answered_by, host)

    def crash_while_joining(self, point):
        """A host running a long tool call, two follow-ups queued behind it, agentd crashed at
        point while joining them and started again unarmed; returns (host, [follow-ups])."""
        self.ad.env['CFLUE_FAILPOINTS'] = point + '=crash'
        self.ad.stop()
        self.ad.start()
        conv, host, joined = self.host_with_follow_ups('halfjoin')
        self.ad.proc.wait(15)
        self.assertIn('failpoint_crash point=' + point, self.ad.stderr_text())
        del self.ad.env['CFLUE_FAILPOINTS']
        self.ad.start()
        self.conv = conv
        return host, joined


class RefusedRecordTest(AgentdCase):
    """A record storaged refuses for good (here: larger than its page budget) ends the work
    as failed at once: retrying cannot help."""
    # a 4 MiB message limit makes storaged's page budget 2 MiB: a 3 MiB message is admitted,
    # but its 3 MiB user_message record can never be stored
    stack_kwargs = {'agents': ('runner-anthropic',),
                    'storaged_args': ('--max-message-bytes', str(4 << 20))}

    def test_a_record_storaged_refuses_settles_failed_at_once(self):
        conv = new_conv('toolarge')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'never asked'}], conv))
        adm = self.ad.submit('runner-anthropic', 'x' * (3 << 20), conversation_id=conv)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'FAILED')
        self.assertIn('cannot go on', sub.error)
        self.assertEqual(sub.attempt_count, 1)
        self.assertEqual(self.model_requests(conv), [])


class CompactOrderTest(AgentdCase):
    """Compact on a conversation with running work runs after it, as its own submission."""
    stack_kwargs = {'agents': ('compactor',)}

    @classmethod
    def setUpClass(cls):
        from test_agentd_compaction import models_file
        cls.stack_kwargs = dict(cls.stack_kwargs, agentd_args=('--models', models_file()))
        super(CompactOrderTest, cls).setUpClass()

    def test_compact_during_a_running_submission_is_never_joined(self):
        conv = new_conv('compact')
        self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'seq 1 250'}}]},
            {'text': 'Listed.'},
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 2; echo slept'}}]},
            {'text': 'Slept.'},
            {'text': 'SUMMARY-ORDER: numbers were listed, then a nap.'}], conv))
        first = self.ad.submit('compactor', 'list numbers (%s)' % conv, conversation_id=conv)
        self.wait_settled(first.submission_id, timeout=30)
        second = self.ad.submit('compactor', 'now nap (%s)' % conv, conversation_id=conv)
        self.wait_for('the nap to start', lambda: len(
            [r for r in self.records(conv) if kind(r) == 'assistant_message']) >= 3)
        out = {}

        def compact():
            try:
                out['resp'] = self.ad.call(
                    'Compact', agent_pb2.CompactRequest(conversation_id=conv), timeout=60)
            except grpc.RpcError as e:
                out['err'] = e

        t = threading.Thread(target=compact)
        t.start()
        sub = self.wait_settled(second.submission_id, timeout=30)
        t.join(60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertNotIn('err', out, out.get('err') and out['err'].details())
        recs = self.records(conv)
        users = [body(r).text for r in recs if kind(r) == 'user_message']
        self.assertFalse([u for u in users if 'compact the conversation' in u],
                         'the Compact request entered the conversation as a message: %s' % users)
        for e in self.model_requests(conv):
            self.assertNotIn('compact the conversation', json.dumps(e['body']['messages']))
        comp = [r for r in recs if kind(r) == 'compaction']
        self.assertEqual(len(comp), 1)
        self.assertEqual(out['resp'].record_offset, comp[0].offset)
        # the compaction ran as a submission of its own kind, and its record belongs to it
        csid = out['resp'].submission_id
        self.assertTrue(csid)
        self.assertEqual(comp[0].submission_id, csid)
        self.assertNotIn(csid, (first.submission_id, second.submission_id))
        csub = self.ad.get_submission(csid)
        self.assertEqual(csub.kind, common_pb2.SUBMISSION_KIND_COMPACT, csub)
        self.assertEqual(csub.outcome, COMPLETED, csub)
        self.assertFalse(csub.HasField('message'), csub)
        self.assertEqual(body(comp[0]).trigger, common_pb2.COMPACTION_TRIGGER_REQUEST)
        settled = {r.submission_id: r.offset for r in recs if kind(r) == 'submission_settled'}
        self.assertGreater(comp[0].offset, settled[second.submission_id],
                           'the compaction ran before the running submission settled')
        self.assertGreater(out['resp'].tokens_before, out['resp'].tokens_after)

    def test_compact_with_nothing_to_compact_says_so(self):
        conv = new_conv('compact-empty')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'hi'}], conv))
        adm = self.ad.submit('compactor', 'hi (%s)' % conv, conversation_id=conv)
        self.wait_settled(adm.submission_id, timeout=30)
        with self.assertRaises(grpc.RpcError) as cm:
            self.ad.call('Compact', agent_pb2.CompactRequest(conversation_id=conv), timeout=30)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(H.error_reason(cm.exception), 'NOTHING_TO_COMPACT')
        self.assertIn('nothing to compact', cm.exception.details())
        # the Compact ran as its own submission (kind COMPACT) and settled failed; the
        # conversation got no compaction record and no message from it
        view = self.ad.get_conversation(conv)
        compacts = [s for s in view.submissions if s.kind == common_pb2.SUBMISSION_KIND_COMPACT]
        self.assertEqual(len(compacts), 1, view.submissions)
        csub = self.ad.get_submission(compacts[0].submission_id)
        self.assertEqual(csub.kind, common_pb2.SUBMISSION_KIND_COMPACT, csub)
        self.assertEqual(csub.status, SETTLED, csub)
        self.assertEqual(outcome_name(csub.outcome), 'FAILED', csub)
        self.assertIn('nothing to compact', csub.error)
        self.assertFalse(csub.HasField('message'), csub)
        self.assertIn(adm.submission_id, [s.submission_id for s in view.submissions])
        recs = self.records(conv)
        self.assertFalse([r for r in recs if kind(r) == 'compaction'])
        self.assertEqual([r.submission_id for r in recs if kind(r) == 'user_message'],
                         [adm.submission_id])

    def test_requests_ask_for_the_output_tokens_the_threshold_counts(self):
        conv = new_conv('max-tokens')
        self.workspace(conv)
        self.fm.set_scenario(bind([{'text': 'short'}], conv))
        adm = self.ad.submit('compactor', 'hi (%s)' % conv, conversation_id=conv)
        self.wait_settled(adm.submission_id, timeout=30)
        reqs = self.model_requests(conv)
        self.assertTrue(reqs)
        # the catalog says this model writes at most 500 tokens: ask for no more
        self.assertEqual({e['body']['max_tokens'] for e in reqs}, {500})


class SlowDiskCase(unittest.TestCase):
    """storaged on a disk whose every commit takes 2 s (a failpoint that sleeps), agentd with
    its default 30 s lease (renewals that slow still land in time); the bench brain's 3 calls."""

    def setUp(self):
        self.stack = H.BenchBrainStack(
            0, 'a line of the file the bench brain reads\n' * 10, prefix='cflue-slow-disk-it-',
            store_env={'CFLUE_FAILPOINTS': 'storaged.commit.before=sleep:2000'})

    def tearDown(self):
        self.stack.remove()

    def test_the_input_is_written_beside_the_first_model_call(self):
        # The first turn's input (and its stamp) goes out beside the model call, not before
        # it: the model is asked while the input's commit is under way, and the stream still
        # holds the input first.
        st = self.stack
        self.assertIn('event=failpoint_armed point=storaged.commit.before action=sleep_ms',
                      st.sd.stderr_text())
        adm = st.ad.submit(st.AGENT, 'hello', timeout=60)
        self.assertTrue(H.poll_until(st.fm.requests, 60, 0.01), 'the model was never asked')
        inputs = [r for r in H.read_all(st.sd.stub, adm.conversation_id)
                  if kind(r) == 'user_message']
        self.assertEqual(inputs, [], 'the model was asked only once the input was stored')
        sub = st.ad.get_submission(adm.submission_id, wait=True, timeout=180)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 1)
        kinds = [kind(r) for r in H.read_all(st.sd.stub, adm.conversation_id)
                 if kind(r) in ('user_message', 'assistant_message')]
        self.assertEqual(kinds, ['user_message'] + ['assistant_message'] * 3)
        self.assertEqual(len(st.fm.requests()), 3)


class DiskFullTest(unittest.TestCase):
    """storaged's disk fills up under running conversations (a real tmpfs, in storaged's own
    mount namespace) and is emptied 8 s later. Submit answers RESOURCE_EXHAUSTED, reason
    STORAGE_FULL, meanwhile; the conversations under way retry their writes (an outage
    shorter than their retry window, the lease: 30 s) and all complete, each in its one
    attempt, once there is room."""
    agentd_args = ()

    def setUp(self):
        H.require_namespace(self, H.private_mount_problem())
        self.stack = H.BenchBrainStack(500, 'a line of the file the bench brain reads\n' * 10,
                                       prefix='cflue-disk-full-it-',
                                       storaged_cls=H.TmpfsStoraged,
                                       agentd_args=self.agentd_args)

    def tearDown(self):
        self.stack.remove()

    def test_running_work_waits_for_room_and_completes(self):
        st = self.stack
        running = [st.ad.submit(st.AGENT, 'go %d' % i).submission_id for i in range(5)]
        self.assertTrue(H.poll_until(lambda: len(st.fm.requests()) >= 5, 30, 0.05),
                        'the conversations did not start')
        filled = st.sd.in_namespace('cat /dev/zero > %s/filler' % st.sd.mount_dir)
        self.assertIn('No space left', filled.stdout)
        big = 'x' * (200 << 10)  # past what the WAL already holds: it must grow
        refused = None
        for i in range(30):
            try:
                running.append(st.ad.submit(st.AGENT, 'go %d %s' % (i, big)).submission_id)
            except grpc.RpcError as e:
                refused = e
                break
        self.assertIsNotNone(refused, 'no Submit was refused on a full disk')
        self.assertEqual(refused.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details())
        self.assertEqual(H.error_reason(refused), 'STORAGE_FULL')
        time.sleep(8)
        self.assertEqual(st.sd.in_namespace('rm %s/filler' % st.sd.mount_dir).returncode, 0)
        for sid in running:
            sub = st.ad.get_submission(sid, wait=True, timeout=120)
            self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub)
            # their writes were retried (within the retry window): never interrupted
            self.assertEqual(sub.attempt_count, 1, sub)
        self.assertIn('event=store_retry', st.ad.stderr_text())
        self.assertIsNone(st.sd.proc.poll())
        self.assertIsNone(st.ad.proc.poll())

class LongDiskFullTest(DiskFullTest):
    """The same, with the disk full for longer than the lease (3 s, renewed every second):
    no heartbeat is stored meanwhile, and the writes are refused past the usual retry window.
    Time that storaged could not write counts against no lease, and a write refused for want
    of room is retried until there is room: the work still completes in its one attempt."""
    agentd_args = ('--lease-ms', '3000', '--heartbeat-ms', '1000')


class HungPeerTest(unittest.TestCase):
    """A storaged that hangs (SIGSTOP: its connections stay open, nothing answers, as when
    its host is cut off without a reset) and is replaced by a new process at the same
    address. agentd's connection pings (HTTP/2 keepalive: 10 s, then 10 s for the answer)
    drop the dead connection, and its next call reaches the new process, within seconds
    rather than once TCP gives up (about 15 minutes)."""
    WITHIN_S = 45

    def setUp(self):
        from test_agentd import Stack
        self.stack = Stack(agents=('runner-anthropic',))
        self.replacement = None

    def tearDown(self):
        self.stack.sd.kill()  # a stopped process takes SIGKILL
        if self.replacement is not None:
            self.replacement.close()
        self.stack.remove()

    def test_a_hung_storaged_replaced_at_its_address_is_reached_within_seconds(self):
        st = self.stack
        st.fm.set_scenario([{'text': 'before'}, {'text': 'after'}])
        first = st.ad.submit('runner-anthropic', 'before the hang')
        done = st.ad.get_submission(first.submission_id, wait=True, timeout=30)
        self.assertEqual(done.outcome, common_pb2.OUTCOME_COMPLETED, done)
        # this process's own channel would share agentd's fate (gRPC pools connections by
        # address): close it before the hang
        st.sd.drop_channel()
        os.kill(st.sd.pid, signal.SIGSTOP)
        os.unlink(st.sd.sock)  # the hung process keeps its socket; the path is free
        self.replacement = H.Storaged(workdir=st._sub('storaged-new'), start=False)
        self.replacement.sock = st.sd.sock
        self.replacement.start()
        t0, errors = time.time(), []
        while time.time() - t0 < self.WITHIN_S:
            try:
                adm = st.ad.submit('runner-anthropic', 'after the hang', timeout=10)
                break
            except grpc.RpcError as e:
                errors.append('%.1f s: %s' % (time.time() - t0, e.code()))
        else:
            self.fail('agentd never reached the new storaged: %s' % errors)
        sub = st.ad.get_submission(adm.submission_id, wait=True, timeout=30)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
        self.assertEqual(H.get(self.replacement.stub, adm.submission_id).outcome,
                         common_pb2.OUTCOME_COMPLETED)


class HungToolPeerTest(unittest.TestCase):
    """A toold that hangs (SIGSTOP) while the only call on agentd's connection to it is a
    command that has been running, silent, for longer than the connection's two pings
    without data, and is replaced by a new process at the same address. gRPC sends no more
    pings on such a connection by itself; agentd's probe (a health Check once the connection
    has started nothing for a keepalive period) lets them go on, so the dead connection is
    dropped, the drive is interrupted and resumes on the new toold: the call gets the
    outcome-unknown result and the model answers. Without the probe the drive waits on the
    hung connection for good. agentd's keepalive is shortened to 3 s (--keepalive-ms), so the
    whole story takes seconds."""
    KEEPALIVE_MS = 3000

    def setUp(self):
        from test_agentd import Stack
        self.stack = Stack(agents=('runner-anthropic',),
                           agentd_args=('--keepalive-ms', str(self.KEEPALIVE_MS)))
        self.replacement = None

    def tearDown(self):
        self.stack.td.kill()  # a stopped process takes SIGKILL
        if self.replacement is not None:
            self.replacement.close()
        self.stack.remove()

    def test_a_toold_hung_under_a_long_silent_call_is_left_and_the_work_resumes(self):
        st = self.stack
        conv = new_conv('hung-toold')
        ws = st.td.workspace(conv, create=True)
        st.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {
                'command': 'echo started > started.txt; sleep 600'}}]},
            {'text': 'answered after the lost call'}], conv))
        adm = st.ad.submit('runner-anthropic', 'a long command (%s)' % conv,
                           conversation_id=conv)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(ws, 'started.txt')):
            self.assertLess(time.monotonic(), deadline, 'the command never started')
            time.sleep(0.05)
        # past the two pings gRPC sends without data (one keepalive apart), with margin; the
        # connection lives on meanwhile (the probes keep its pings within toold's policy)
        time.sleep(4 * self.KEEPALIVE_MS / 1000.0)
        self.assertNotIn('drive_interrupted', st.ad.stderr_text())
        self.assertNotEqual(st.ad.get_submission(adm.submission_id).status, SETTLED)
        st.td.drop_channel()  # this process's own channel would share agentd's connection
        os.kill(st.td.pid, signal.SIGSTOP)
        os.unlink(st.td.sock)
        self.replacement = H.Toold(workdir=st._sub('toold-new'), start=False)
        self.replacement.sock = st.td.sock
        self.replacement.start()
        hung_at = time.monotonic()
        sub = st.ad.get_submission(adm.submission_id, wait=True, timeout=40)
        lost_after = time.monotonic() - hung_at
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub)
        recs = H.read_all(st.sd.stub, conv)
        results = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertEqual(len(results), 1, results)
        self.assertTrue(results[0].outcome_unknown, results[0])
        texts = [body(r).text for r in recs if kind(r) == 'assistant_message']
        self.assertIn('answered after the lost call', texts)
        # noticed through the pings: a few keepalive periods, not the command's 600 s
        self.assertLess(lost_after, 30, 'the hung toold was noticed after %.1f s' % lost_after)
        self.assertIn('drive_interrupted', st.ad.stderr_text())


# A client holding n idle Watch(follow) streams of a conversation: prints "open" once each has
# its first record, then waits.
WATCHING_CLIENT = r'''
import sys, time, grpc
from cflue_harness import agent_pb2, common_pb2
target, conv, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
watch = grpc.insecure_channel(target).unary_stream(
    '/cflue.v1.Agent/Watch', request_serializer=agent_pb2.WatchRequest.SerializeToString,
    response_deserializer=common_pb2.Record.FromString)
streams = [watch(agent_pb2.WatchRequest(conversation_id=conv, after_offset=-1, follow=True))
           for _ in range(n)]
for s in streams:
    next(s)
print('open', flush=True)
time.sleep(3600)
'''


class LostClientTest(unittest.TestCase):
    """A client lost without a reset (frozen with SIGSTOP: its kernel keeps the connection open
    and nothing answers, as when its host is gone or a NAT drops the idle connection silently)
    while it holds idle Watch(follow) streams. agentd pings each connection with a call in
    flight (every --keepalive-ms of silence, 2 s here) and drops the one whose ping goes
    unanswered, which ends its streams and gives back their share of --max-stream-memory:
    with 1 MiB (64 streams), all held by the frozen client, a new Watch is refused
    RESOURCE_EXHAUSTED at first and served within seconds. Without the server's pings the
    streams would be held for good."""
    STREAMS = 64  # 1 MiB at 16 KiB a stream

    def setUp(self):
        from test_agentd import Stack
        self.stack = Stack(agents=('runner-anthropic',),
                           agentd_args=('--keepalive-ms', '2000', '--max-stream-memory', '1'))
        self.client = None

    def tearDown(self):
        if self.client is not None:
            self.client.kill()  # a stopped process takes SIGKILL
            self.client.wait()
        self.stack.remove()

    def test_streams_of_a_client_lost_silently_are_ended(self):
        st = self.stack
        conv = new_conv('lost-client')
        st.fm.set_scenario(bind([{'text': 'watched'}], conv))
        adm = st.ad.submit('runner-anthropic', 'hello (%s)' % conv, conversation_id=conv)
        st.ad.get_submission(adm.submission_id, wait=True, timeout=30)
        self.client = subprocess.Popen(
            [sys.executable, '-c', WATCHING_CLIENT, st.ad.target, conv, str(self.STREAMS)],
            stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.abspath(__file__)))
        self.assertEqual(self.client.stdout.readline().strip(), b'open')
        with self.assertRaises(grpc.RpcError) as cm:
            st.ad.watch_all(conv)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                         cm.exception.details())
        os.kill(self.client.pid, signal.SIGSTOP)
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < 30:
            try:
                self.assertTrue(st.ad.watch_all(conv))
                break
            except grpc.RpcError as e:
                last = e
                self.assertEqual(e.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, e.details())
                time.sleep(0.2)
        else:
            self.fail('the frozen client\'s streams were still held after 30 s: %s' % last)
        # two keepalive periods and the client's silence, not the streams' life
        self.assertLess(time.monotonic() - t0, 15)


if __name__ == '__main__':
    unittest.main()
