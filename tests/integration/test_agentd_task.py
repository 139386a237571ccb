"""The framework's `task` tool: subagents as child submissions (agentd/task.c). Real storaged,
toold and agentd processes; the fake model plays every agent, each step matched to one agent by
the `ROLE <name>.` line of its instructions.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_task

What is checked: a chain lead -> helper -> deep settles with each answer handed up as the
calling task's result; the child shares its parent's sandbox (a file the child writes is in the
parent's workspace); the call that would run at depth 5 gets delegation_depth_exceeded; two task
calls of one turn run at the same time; aborting the parent aborts the child; kill -9 of agentd
while a child waits on the model, then a restart: the child finishes and its real answer becomes
the parent's result (never "outcome unknown"); an agent without a sandbox is offered `task` and
nothing of a workspace; a subagent whose definition names no model runs with its parent's, and
cannot be submitted to directly.
"""

import json
import os
import time
import unittest

import cflue_harness as H
from cflue_harness import common_pb2
from test_agentd import (COMPLETED, SETTLED, AgentdCase, body, kind, new_conv,
                         request_system)
from test_cli import run_cli

ABORTED = common_pb2.OUTCOME_ABORTED


def role(name, **step):
    """A scenario step for the agent whose instructions say `ROLE name.`"""
    match = dict(step.pop('match', {}))
    match['system_contains'] = 'ROLE %s.' % name
    step['match'] = match
    return step


def task_call(agent, prompt, call_id=None):
    c = {'name': 'task', 'arguments': {'agent': agent, 'prompt': prompt}}
    if call_id:
        c['id'] = call_id
    return c


class TaskCase(AgentdCase):
    stack_kwargs = {
        'agents': ('task-lead', 'task-helper', 'task-scout', 'task-deep', 'task-solo',
                   'task-openai-lead', 'task-inherit', 'task-limited'),
        'agentd_args': ('--lease-ms', '3000', '--heartbeat-ms', '1000'),
    }

    def setUp(self):
        for d in [self.stack.sd, self.stack.td] + self.stack.agentds:
            if not d.alive():
                d.start()

    def get(self, sid):
        return H.get(self.stack.sd.stub, sid)

    def task_results(self, conv, sid=None):
        """The tool_result records of `task` calls in conv (of submission sid when given)."""
        return [body(r) for r in self.records(conv)
                if kind(r) == 'tool_result' and body(r).name == 'task'
                and (sid is None or r.submission_id == sid)]

    def children(self, conv):
        """The task_started records of conv, in order."""
        return [body(r) for r in self.records(conv) if kind(r) == 'task_started']

    def two_scouts_side_by_side(self, tag):
        """The lead asks two scouts in one turn, each answering after 1.5 s; both answers come
        back as the two calls' results, and each child was admitted before the other settled
        (they ran side by side). Returns (the lead's submission, the two children)."""
        conv = new_conv(tag)
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Look up alpha.'),
                                     task_call('task-scout', 'Look up beta.')]),
            role('scout', match={'last_user_contains': 'alpha'}, delay_ms=1500,
                 text='alpha is first.'),
            role('scout', match={'last_user_contains': 'beta'}, delay_ms=1500,
                 text='beta is second.'),
            role('lead', text='Both scouts answered.'),
        ])
        sid = self.ad.submit('task-lead', 'Ask two scouts.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = {r.index: r.text for r in self.task_results(conv, sid)}
        self.assertEqual(results, {0: 'alpha is first.', 1: 'beta is second.'})
        kids = [self.get(s.child_submission_id) for s in self.children(conv)]
        self.assertEqual(len(kids), 2)
        a, b = [(H.ts_ms(k.create_time), H.ts_ms(k.settle_time)) for k in kids]
        self.assertLess(a[0], b[1])
        self.assertLess(b[0], a[1])
        return sub, kids

    def cli_lines(self, argv):
        """Runs cflue (exit 0 expected); returns its output's lines, a line_of(text) giving the
        index of the first line holding text (failing when none does), and the output."""
        rc, out, err = run_cli(argv)
        self.assertEqual(rc, 0, err)
        lines = out.splitlines()

        def line_of(text):
            found = [i for i, line in enumerate(lines) if text in line]
            self.assertTrue(found, 'no line with %r in:\n%s' % (text, out))
            return found[0]
        return lines, line_of, out

    def final_text(self, conv, sid):
        texts = [body(r).text for r in self.records(conv)
                 if kind(r) == 'assistant_message' and r.submission_id == sid]
        return texts[-1] if texts else None


class ChainTest(TaskCase):
    def test_list_agents_reports_each_agents_subagents(self):
        info = {a.name: a for a in self.ad.list_all_agents()}
        self.assertEqual(list(info['task-lead'].subagents),
                         ['task-helper', 'task-scout', 'task-deep'])
        self.assertEqual(list(info['task-deep'].subagents), ['task-deep'])
        self.assertEqual(list(info['task-scout'].subagents), [])

    def test_lead_helper_deep_each_answer_handed_up(self):
        conv = new_conv('chain')
        ws = self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-helper', 'Write child.txt, then ask deep.')]),
            role('helper', tool_calls=[{'name': 'bash',
                                        'arguments': {'command': 'echo from-child > child.txt'}}]),
            role('helper', tool_calls=[task_call('task-deep', 'What is at the bottom?')]),
            role('deep', text='The bottom holds a grandchild answer.'),
            role('helper', text='Child answer: wrote child.txt; deep said the bottom holds a '
                                'grandchild answer.'),
            role('lead', text='All done: the helper wrote child.txt.'),
        ])
        sid = self.ad.submit('task-lead', 'Please delegate.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual(self.final_text(conv, sid), 'All done: the helper wrote child.txt.')

        # the child shares the lead's sandbox
        with open(os.path.join(ws, 'child.txt')) as f:
            self.assertEqual(f.read(), 'from-child\n')

        # lead -> helper: one child, depth 1, its answer the lead's task result
        [started] = self.children(conv)
        self.assertEqual((started.agent, started.depth, started.turn, started.index),
                         ('task-helper', 1, 1, 0))
        [res] = self.task_results(conv, sid)
        self.assertFalse(res.is_error, res)
        self.assertEqual(res.text, 'Child answer: wrote child.txt; deep said the bottom holds '
                                   'a grandchild answer.')
        child = self.get(started.child_submission_id)
        self.assertEqual(child.outcome, COMPLETED)
        self.assertEqual(child.conversation_id, started.child_conversation_id)
        self.assertEqual(child.delegation.parent_submission_id, sid)
        self.assertEqual(child.delegation.depth, 1)
        self.assertEqual(child.source, common_pb2.SOURCE_DISPATCH)

        # helper -> deep: depth 2, the deep answer the helper's result
        [grand] = self.children(started.child_conversation_id)
        self.assertEqual((grand.agent, grand.depth), ('task-deep', 2))
        [gres] = self.task_results(started.child_conversation_id)
        self.assertEqual(gres.text, 'The bottom holds a grandchild answer.')
        g = self.get(grand.child_submission_id)
        self.assertEqual(g.outcome, COMPLETED)
        self.assertEqual(g.delegation.parent_submission_id, started.child_submission_id)

        # the child's model saw the task prompt, the roster and the shared working directory,
        # not the lead's conversation
        child_reqs = [e for e in self.fm.requests()
                      if 'ROLE helper.' in request_system(e) and 'rejected' not in e]
        self.assertTrue(child_reqs)
        first = child_reqs[0]['body']
        self.assertEqual(first['messages'][0]['content'][0]['text']
                         if isinstance(first['messages'][0]['content'], list)
                         else first['messages'][0]['content'],
                         'Write child.txt, then ask deep.')
        self.assertIn(conv, request_system(child_reqs[0]))  # the lead's working directory
        self.assertNotIn('Please delegate.', str(first['messages']))
        self.assertIn('task-deep', request_system(child_reqs[0]))  # its own roster
        names = [t['name'] for t in first['tools']]
        self.assertEqual(names, ['read', 'write', 'edit', 'bash', 'grep', 'glob', 'task'])

        # `cflue watch` shows each subagent's conversation nested under the call
        lines, line_of, out = self.cli_lines(['watch', conv, '--agentd', self.ad.target])

        self.assertTrue(lines[line_of('=> task-helper')].startswith('  =>'), out)
        self.assertTrue(lines[line_of('> Write child.txt')].startswith('  | > '), out)
        self.assertTrue(lines[line_of('=> task-deep')].startswith('  |   =>'), out)
        self.assertTrue(lines[line_of('The bottom holds')].startswith('  |   | '), out)
        self.assertTrue(lines[line_of('All done')].startswith('All done'), out)
        self.assertLess(line_of('=> task-helper'), line_of('> Write child.txt'))
        self.assertLess(line_of('The bottom holds'), line_of('<- task: Child answer'))
        self.assertLess(line_of('<- task: Child answer'), line_of('All done'))

    def test_submit_follows_a_child_live_nested_under_the_call(self):
        conv = new_conv('live')
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Find the version.')]),
            role('scout', delay_ms=800, text='The version is 1.2.'),
            role('lead', text='Reported: 1.2.'),
        ])
        lines, line_of, out = self.cli_lines(['submit', '--agent', 'task-lead', '--conversation',
                                              conv, 'What version?', '--agentd', self.ad.target])

        self.assertTrue(lines[line_of('=> task-scout')].startswith('  =>'), out)
        self.assertTrue(lines[line_of('> Find the version.')].startswith('  | > '), out)
        self.assertTrue(lines[line_of('The version is 1.2.')].startswith('  | '), out)
        self.assertLess(line_of('The version is 1.2.'), line_of('Reported: 1.2.'))
        self.assertTrue(lines[line_of('Reported: 1.2.')].startswith('Reported'), out)

    def test_the_call_that_would_reach_depth_5_fails(self):
        conv = new_conv('depth')
        self.workspace(conv)
        steps = [role('lead', tool_calls=[task_call('task-deep', 'Go as deep as you can.')])]
        steps += [role('deep', tool_calls=[task_call('task-deep', 'Deeper.')]) for _ in range(4)]
        steps += [role('deep', text='level answer') for _ in range(4)]
        steps += [role('lead', text='The chain ended.')]
        self.fm.set_scenario(steps)
        sid = self.ad.submit('task-lead', 'Delegate deeply.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=90)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        # walk down: depths 1..4 exist, and the depth-4 child's own task call was refused
        c, depth = conv, 0
        while True:
            started = self.children(c)
            if not started:
                break
            [s] = started
            depth += 1
            self.assertEqual(s.depth, depth)
            c = s.child_conversation_id
        self.assertEqual(depth, 4)
        [refused] = self.task_results(c)
        self.assertTrue(refused.is_error, refused)
        self.assertIn('delegation_depth_exceeded', refused.text)
        self.assertEqual(self.children(c), [])  # no fifth child was admitted
        self.assertEqual(self.final_text(conv, sid), 'The chain ended.')


class ParallelTest(TaskCase):
    def test_two_task_calls_of_one_turn_overlap(self):
        _, kids = self.two_scouts_side_by_side('par')
        a, b = [(H.ts_ms(k.create_time), H.ts_ms(k.settle_time)) for k in kids]
        self.assertLess(max(a[1], b[1]) - min(a[0], b[0]), 2900,
                        'two 1.5 s children took as long as running one after the other')


class FanOutTest(TaskCase):
    def test_one_answer_starts_at_most_16_tasks(self):
        """An answer of 18 task calls: every one made a child (a hostile model's 4,096 calls
        made 4,096, each with its own copy of the attachments); the first 16 run, the last two
        get an error result."""
        conv = new_conv('fanout')
        self.workspace(conv)
        self.fm.set_scenario(
            [role('lead', tool_calls=[task_call('task-scout', 'Part %d.' % i)
                                      for i in range(18)])]
            + [role('scout', text='part done') for _ in range(16)]
            + [role('lead', text='Sixteen parts done.')])
        sid = self.ad.submit('task-lead', 'Fan out.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=120)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual(len(self.children(conv)), 16)
        results = {r.index: r for r in self.task_results(conv, sid)}
        self.assertEqual(sorted(results), list(range(18)))
        for i in range(16):
            self.assertEqual((results[i].is_error, results[i].text), (False, 'part done'))
        for i in (16, 17):
            self.assertTrue(results[i].is_error)
            self.assertIn('at most 16 tasks', results[i].text)


class FewDrivesTest(TaskCase):
    """--max-drives 2: a parent waiting on its children held a slot, so the lead and its
    first helper (itself waiting on a deep child) held both: the second helper and the deep
    child stayed queued, and nothing settled until the time limits. A drive waiting on its
    children holds no slot now."""
    stack_kwargs = dict(TaskCase.stack_kwargs, agentd_args=TaskCase.stack_kwargs['agentd_args']
                        + ('--max-drives', '2'))

    def test_parents_waiting_on_children_leave_room_for_them(self):
        conv = new_conv('fewdrives')
        self.workspace(conv)
        self.fm.set_scenario(
            [role('lead', tool_calls=[task_call('task-helper', 'Half %d.' % i)
                                      for i in range(2)])]
            + [role('helper', tool_calls=[task_call('task-deep', 'Go deeper.')])
               for _ in range(2)]
            + [role('deep', text='deep answer') for _ in range(2)]
            + [role('helper', text='helper answer') for _ in range(2)]
            + [role('lead', text='Both halves done.')])
        sid = self.ad.submit('task-lead', 'Split it.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual([r.text for r in self.task_results(conv, sid)], ['helper answer'] * 2)
        self.assertEqual(self.final_text(conv, sid), 'Both halves done.')

    def test_claiming_admits_hold_their_slots(self):
        """Four task calls in one answer: each Admit claimed its child while the room was
        checked before any of them was answered, so all four did, past --max-drives. Each
        claiming Admit holds a slot until it ends (so does the claimer's Claim): the lead's
        Submit claims the lead (or the claimer does), one Admit at most its child, and the
        other children wait for a claimer."""
        conv = new_conv('slots')
        self.workspace(conv)
        self.fm.set_scenario(
            [role('lead', tool_calls=[task_call('task-scout', 'Part %d.' % i)
                                      for i in range(4)])]
            + [role('scout', text='part done') for _ in range(4)]
            + [role('lead', text='Four parts done.')])
        before = self.ad.stderr_text().count('at=admit')
        sid = self.ad.submit('task-lead', 'Four parts.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        self.assertEqual(len(self.children(conv)), 4)
        self.assertLessEqual(self.ad.stderr_text().count('at=admit') - before, 2)


class OtherReplicaTest(TaskCase):
    """Children left to the ledger are driven by whichever agentd claims them: here agentd0 has
    one drive slot, the parent's while it asks (both children are admitted unclaimed), then,
    once it waits on them, one child's: the second agentd runs the other, side by side."""
    stack_kwargs = dict(TaskCase.stack_kwargs,
                        agentd_args=TaskCase.stack_kwargs['agentd_args'] + ('--max-drives', '1'))

    def test_children_run_on_another_agentd_side_by_side(self):
        other = H.Agentd(self.stack.sd.target, self.stack.agents_dir, owner_id='agentd-it-other',
                         env=self.stack.env, extra_args=('--lease-ms', '3000'),
                         workdir=self.stack._sub('agentd-other'))
        try:
            sub, kids = self.two_scouts_side_by_side('replica')
            self.assertEqual(sub.owner_id, 'agentd-it-0')
            owners = sorted(k.owner_id for k in kids)
            self.assertIn('agentd-it-other', owners)
            self.assertLessEqual(owners.count('agentd-it-0'), 1, owners)
        finally:
            other.close()


class AbortTest(TaskCase):
    def test_aborting_the_parent_aborts_the_child(self):
        conv = new_conv('abort')
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Take your time.')]),
            role('scout', delay_ms=30000, text='too late'),
        ])
        sid = self.ad.submit('task-lead', 'Delegate slowly.', conversation_id=conv).submission_id
        started = self.wait_for('the child to be admitted', lambda: self.children(conv),
                                timeout=20)[0]
        child = started.child_submission_id
        self.wait_for('the child to run', lambda: self.get(child).status ==
                      common_pb2.SUBMISSION_STATUS_RUNNING, timeout=20)
        t0 = time.monotonic()
        self.ad.abort(submission_id=sid)
        sub = self.wait_settled(sid, timeout=20)
        self.assertEqual(sub.outcome, ABORTED, sub)
        csub = self.wait_settled(child, timeout=20)
        self.assertEqual(csub.outcome, ABORTED, csub)
        self.assertLess(time.monotonic() - t0, 10, 'the child ran on after the abort')


class CrashTest(TaskCase):
    def test_kill_9_while_the_child_works_then_restart(self):
        conv = new_conv('crash')
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Survive a crash.')]),
            role('scout', delay_ms=4000, text='the answer before the crash'),
            role('scout', text='the answer after the crash'),
            role('lead', match={'last_user_contains': 'the answer after the crash'},
                 text='The scout survived.'),
        ])
        sid = self.ad.submit('task-lead', 'Delegate and crash.',
                             conversation_id=conv).submission_id
        started = self.wait_for('the child to be admitted', lambda: self.children(conv),
                                timeout=20)[0]
        child_conv = started.child_conversation_id
        self.wait_for('the child to ask the model',
                      lambda: [e for e in self.fm.requests()
                               if 'ROLE scout.' in request_system(e)], timeout=20)
        self.ad.kill()
        self.ad.start()
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [res] = self.task_results(conv, sid)
        self.assertFalse(res.outcome_unknown, res)
        self.assertFalse(res.is_error, res)
        self.assertEqual(res.text, 'the answer after the crash')
        self.assertEqual(self.final_text(conv, sid), 'The scout survived.')
        # one child, admitted once (the resumed parent found the same one)
        self.assertEqual(len({s.child_submission_id for s in self.children(conv)}), 1)
        csub = self.get(started.child_submission_id)
        self.assertEqual(csub.outcome, COMPLETED)
        self.assertGreaterEqual(csub.attempt_count, 2)
        settled = [r for r in self.records(child_conv) if kind(r) == 'submission_settled']
        self.assertEqual(len(settled), 1)


class ReloadedBetweenAttemptsTest(TaskCase):
    def test_a_child_started_before_is_followed_whatever_the_definitions_say_now(self):
        """The lead's definition changes while agentd is down (another model, and the scout
        no longer among its subagents): the resumed lead's Admit of the same call was refused
        as an IDEMPOTENCY_CONFLICT (its delegation named the new model), or the call as naming
        no subagent; the model heard the task "could not be started" while the child ran on
        unobserved. The resumed lead follows the child it started."""
        path = os.path.join(self.stack.agents_dir, 'task-lead.md')
        with open(path) as f:
            original = f.read()
        conv = new_conv('rebound')
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Survive a reload.')]),
            role('scout', delay_ms=4000, text='the answer before the crash'),
            role('scout', text='the answer after the crash'),
            role('lead', match={'last_user_contains': 'the answer after the crash'},
                 text='The scout was followed.'),
        ])
        sid = self.ad.submit('task-lead', 'Delegate, then change.',
                             conversation_id=conv).submission_id
        started = self.wait_for('the child to be admitted', lambda: self.children(conv),
                                timeout=20)[0]
        self.wait_for('the child to ask the model',
                      lambda: [e for e in self.fm.requests()
                               if 'ROLE scout.' in request_system(e)], timeout=20)
        self.ad.kill()
        try:
            with open(path, 'w') as f:
                f.write(original.replace('model: anthropic/claude-test-1',
                                         'model: anthropic/claude-test-2').replace(
                    'agents: [task-helper, task-scout, task-deep]',
                    'agents: [task-helper, task-deep]'))
            self.ad.start()
            sub = self.wait_settled(sid, timeout=60)
        finally:
            with open(path, 'w') as f:
                f.write(original)
            self.ad.kill()
            self.ad.start()
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [res] = self.task_results(conv, sid)
        self.assertFalse(res.is_error, res)
        self.assertEqual(res.text, 'the answer after the crash')
        self.assertEqual(self.final_text(conv, sid), 'The scout was followed.')
        self.assertEqual({s.child_submission_id for s in self.children(conv)},
                         {started.child_submission_id})


class StoreOutageTest(TaskCase):
    """storaged goes away while a child works: for less than agentd's retry window (the lease,
    3 s here, at least 5 s), and for longer."""

    def run_through_outage(self, tag, outage_s):
        conv = new_conv(tag)
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Outlast %s.' % tag)]),
            role('scout', delay_ms=int(outage_s * 1000) + 1500, text='answer through %s' % tag),
        ] + [
            # the child's attempts that the outage interrupts ask again (how many depends on
            # timing: under TSan the first answer can come after the child's lease ran out)
            role('scout', text='answer through %s' % tag) for _ in range(3)
        ] + [
            role('lead', match={'last_user_contains': 'answer through %s' % tag},
                 text='Done after the outage.'),
        ])
        sid = self.ad.submit('task-lead', 'Delegate through an outage.',
                             conversation_id=conv).submission_id
        started = self.wait_for('the child to be admitted', lambda: self.children(conv),
                                timeout=20)[0]
        self.wait_for('the child to ask the model',
                      lambda: [e for e in self.fm.requests()
                               if 'Outlast %s.' % tag in str(e.get('body'))], timeout=20)
        self.stack.sd.kill()
        time.sleep(outage_s)
        self.stack.sd.start()
        sub = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                sub = self.ad.get_submission(sid, wait=True, timeout=10)
                if sub.status == SETTLED:
                    break
            except Exception:
                time.sleep(0.5)
        self.assertIsNotNone(sub)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [res] = self.task_results(conv, sid)
        self.assertFalse(res.outcome_unknown, res)
        self.assertEqual(res.text, 'answer through %s' % tag)
        self.assertEqual(len({s.child_submission_id for s in self.children(conv)}), 1)
        self.assertEqual(self.get(started.child_submission_id).outcome, COMPLETED)
        return sub

    def test_short_outage_the_parent_follows_again(self):
        sub = self.run_through_outage('short', 2)
        self.assertEqual(sub.attempt_count, 1, 'a short outage interrupted the parent')
        self.assertIn('event=task_retry', self.ad.stderr_text())

    def test_long_outage_the_next_attempt_waits_for_the_same_child(self):
        sub = self.run_through_outage('long', 9)
        self.assertGreaterEqual(sub.attempt_count, 2)
        self.assertIn('event=task_resume', self.ad.stderr_text())


class TimeLimitTest(TaskCase):
    def test_parent_time_limit_ends_the_wait_and_aborts_the_child(self):
        conv = new_conv('limit')
        self.workspace(conv)
        self.fm.set_scenario([
            role('lead', tool_calls=[task_call('task-scout', 'Take forever.')]),
            role('scout', delay_ms=60000, text='never'),
        ])
        # the lead's own definition allows 120 s; this conversation's first message gets 3 s
        # through a definition copy with a short timeout
        path = os.path.join(self.stack.agents_dir, 'task-lead.md')
        with open(path) as f:
            text = f.read()
        quick = text.replace('name: task-lead', 'name: task-lead-quick').replace(
            'timeout_ms: 120000', 'timeout_ms: 3000')
        with open(os.path.join(self.stack.agents_dir, 'task-lead-quick.md'), 'w') as f:
            f.write(quick)
        self.ad.stop()
        self.ad.start()
        try:
            sid = self.ad.submit('task-lead-quick', 'Delegate with a deadline.',
                                 conversation_id=conv).submission_id
            sub = self.wait_settled(sid, timeout=30)
        finally:
            os.unlink(os.path.join(self.stack.agents_dir, 'task-lead-quick.md'))
            self.ad.stop()
            self.ad.start()
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_FAILED, sub)
        self.assertIn('time limit', sub.error)
        [res] = self.task_results(conv, sid)
        self.assertTrue(res.is_error, res)
        self.assertIn('time limit', res.text)
        [started] = self.children(conv)
        child = self.wait_settled(started.child_submission_id, timeout=20)
        self.assertEqual(child.outcome, ABORTED, child)


class CwdTest(TaskCase):
    """task's cwd: the child works in a directory of its parent's sandbox."""

    def test_the_child_works_and_looks_from_its_directory(self):
        conv = new_conv('cwd')
        ws = os.path.realpath(self.workspace(conv))
        os.makedirs(os.path.join(ws, 'pkg', 'lib'))
        with open(os.path.join(ws, 'pkg', 'AGENTS.md'), 'w') as f:
            f.write('PKG-NOTES: run the pkg tests with make.')
        with open(os.path.join(ws, 'AGENTS.md'), 'w') as f:
            f.write('ROOT-NOTES')
        scoped = dict(task_call('task-helper', 'Work in pkg.'))
        scoped['arguments'] = dict(scoped['arguments'], cwd='pkg')
        deeper = dict(task_call('task-deep', 'And below.'))
        deeper['arguments'] = dict(deeper['arguments'], cwd='lib')
        self.fm.set_scenario([
            role('lead', tool_calls=[scoped]),
            role('helper', tool_calls=[
                {'name': 'bash', 'arguments': {'command': 'pwd > here.txt'}},
                {'name': 'write', 'arguments': {'path': 'made.txt', 'content': 'x'}}]),
            role('helper', tool_calls=[deeper]),
            role('deep', tool_calls=[{'name': 'bash', 'arguments': {'command': 'pwd'}}]),
            role('deep', text='deep done'),
            role('helper', tool_calls=[task_call('task-deep', 'Where am I?')]),
            role('deep', tool_calls=[{'name': 'bash', 'arguments': {'command': 'pwd'}}]),
            role('deep', text='deep done again'),
            role('helper', text='helper done'),
            role('lead', text='lead done'),
        ])
        sid = self.ad.submit('task-lead', 'Delegate into pkg.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        with open(os.path.join(ws, 'pkg', 'here.txt')) as f:
            self.assertEqual(f.read().strip(), os.path.join(ws, 'pkg'))
        self.assertTrue(os.path.exists(os.path.join(ws, 'pkg', 'made.txt')))
        self.assertFalse(os.path.exists(os.path.join(ws, 'made.txt')))
        [started] = self.children(conv)
        child = self.get(started.child_submission_id)
        self.assertEqual(child.delegation.cwd, 'pkg')
        self.assertEqual(child.delegation.sandbox_placement, '')  # one toold: its address
        helper = [e for e in self.fm.requests() if 'ROLE helper.' in request_system(e)][0]
        system = request_system(helper)
        self.assertIn('Working directory: %s/pkg' % ws, system)
        self.assertIn('PKG-NOTES', system)
        self.assertNotIn('ROOT-NOTES', system)
        # the grandchildren: one given lib (below pkg), one given nothing (pkg, as its parent)
        grands = [self.get(g.child_submission_id)
                  for g in self.children(started.child_conversation_id)]
        self.assertEqual([g.delegation.cwd for g in grands], ['pkg/lib', 'pkg'])
        for g in grands:
            [pwd] = [body(r) for r in self.records(g.conversation_id) if kind(r) == 'tool_result']
            self.assertEqual(pwd.text.strip(), os.path.join(ws, g.delegation.cwd))

    def test_a_cwd_that_cannot_be_used_makes_no_child_or_fails_it(self):
        conv = new_conv('badcwd')
        ws = os.path.realpath(self.workspace(conv))
        calls = []
        for i, cwd in enumerate(['../elsewhere', '/etc', 'missing']):
            c = task_call('task-scout', 'Look.', call_id='call_cwd_%d' % i)
            c['arguments'] = dict(c['arguments'], cwd=cwd)
            calls.append(c)
        self.fm.set_scenario([role('lead', tool_calls=calls), role('lead', text='noted')])
        sid = self.ad.submit('task-lead', 'Try.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = {r.index: r for r in self.task_results(conv, sid)}
        self.assertTrue(results[0].is_error and 'outside the sandbox' in results[0].text,
                        results[0])
        self.assertTrue(results[1].is_error and 'inside the sandbox' in results[1].text,
                        results[1])
        # a directory that is not there: the child is made, and fails saying why
        self.assertTrue(results[2].is_error, results[2])
        self.assertIn('missing', results[2].text)
        [started] = self.children(conv)
        self.assertEqual(self.get(started.child_submission_id).outcome,
                         common_pb2.OUTCOME_FAILED)
        self.assertEqual(sorted(os.listdir(ws)), [])


HOG = ('python3 -c "x=[bytearray(256<<20)]; x[0][::4096]=b\'y\'*(len(x[0])//4096); '
       'print(\'kept\')"')


class SandboxLimitsTest(TaskCase):
    """sandbox.limits: the agent's commands, and those of a child in its sandbox, run under
    the tighter limits of the agent's definition."""

    def test_the_agent_and_its_child_run_under_its_limits(self):
        conv = new_conv('limited')
        self.workspace(conv)
        self.fm.set_scenario([
            role('limited', tool_calls=[{'name': 'bash', 'arguments': {'command': HOG}}]),
            role('limited', tool_calls=[task_call('task-helper', 'Run it too.')]),
            role('helper', tool_calls=[{'name': 'bash', 'arguments': {'command': HOG}}]),
            role('helper', text='stopped here too'),
            role('limited', text='done'),
        ])
        sid = self.ad.submit('task-limited', 'Use a lot of memory.',
                             conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [mine] = [body(r) for r in self.records(conv)
                  if kind(r) == 'tool_result' and body(r).name == 'bash']
        self.assertIn('limit of 64 MiB', mine.text)
        self.assertNotIn('kept', mine.text)
        [started] = self.children(conv)
        child = self.get(started.child_submission_id)
        self.assertEqual((child.delegation.sandbox_limits.memory_bytes,
                          child.delegation.sandbox_limits.processes), (64 << 20, 20))
        [theirs] = [body(r) for r in self.records(started.child_conversation_id)
                    if kind(r) == 'tool_result' and body(r).name == 'bash']
        self.assertIn('limit of 64 MiB', theirs.text)
        # the same command in a sandbox of an agent without limits: toold's own 1 GiB
        conv = new_conv('unlimited')
        self.workspace(conv)
        self.fm.set_scenario([
            role('helper', tool_calls=[{'name': 'bash', 'arguments': {'command': HOG}}]),
            role('helper', text='kept'),
            role('lead', tool_calls=[task_call('task-helper', 'Run it.')]),
            role('lead', text='done'),
        ])
        sid = self.ad.submit('task-lead', 'Use memory.', conversation_id=conv).submission_id
        self.assertEqual(self.wait_settled(sid, timeout=60).outcome, COMPLETED)
        [started] = self.children(conv)
        self.assertFalse(self.get(started.child_submission_id).delegation.HasField(
            'sandbox_limits'))
        [theirs] = [body(r) for r in self.records(started.child_conversation_id)
                    if kind(r) == 'tool_result' and body(r).name == 'bash']
        self.assertIn('kept', theirs.text)


class NoSandboxTest(TaskCase):
    def test_agent_without_sandbox_has_task_and_no_workspace(self):
        conv = new_conv('solo')
        self.fm.set_scenario([
            role('solo', tool_calls=[task_call('task-scout', 'Anyone there?')]),
            role('solo', text='Nobody to delegate to.'),
        ])
        sid = self.ad.submit('task-solo', 'Try to delegate.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        reqs = [e for e in self.fm.requests() if 'ROLE solo.' in request_system(e)]
        self.assertEqual(len(reqs), 2)
        self.assertEqual([t['name'] for t in reqs[0]['body']['tools']], ['task'])
        system = request_system(reqs[0])
        self.assertNotIn('Working directory', system)
        self.assertIn('No subagents are declared', system)
        [res] = self.task_results(conv, sid)
        self.assertTrue(res.is_error, res)  # a clear error result; no child was made
        self.assertIn('task-scout', res.text)
        self.assertEqual(self.children(conv), [])


class AttachmentsTest(TaskCase):
    def test_files_of_the_conversation_are_handed_to_the_child(self):
        png = bytes.fromhex('89504e470d0a1a0a') + b'chart-bytes'
        conv = new_conv('attach')
        self.workspace(conv)
        handed = task_call('task-scout', 'Describe the chart.')
        handed['arguments']['attachments'] = [{'id': 'chart.png'}, {'id': 'chart.png'}]
        unknown = task_call('task-scout', 'Describe the other one.')
        unknown['arguments']['attachments'] = [{'id': 'nope.png'}]
        self.fm.set_scenario([
            role('lead', tool_calls=[handed, unknown]),
            role('scout', text='A chart of growth.'),
            role('lead', text='The scout described it.'),
        ])
        sid = self.ad.submit('task-lead', 'Look at the chart.', conversation_id=conv,
                             attachments=[{'name': 'chart.png', 'mime_type': 'image/png',
                                           'data': png}]).submission_id
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        results = {r.index: r for r in self.task_results(conv, sid)}
        self.assertEqual(results[0].text, 'A chart of growth.')
        self.assertTrue(results[1].is_error, results[1])
        self.assertIn('"nope.png" is not a file attached to this conversation', results[1].text)
        [child] = self.children(conv)  # the unknown name made no child
        msg = self.get(child.child_submission_id).message
        self.assertEqual([(a.name, a.data) for a in msg.attachments], [('chart.png', png)])
        [req] = [e for e in self.fm.requests()
                 if 'ROLE scout.' in request_system(e) and 'Describe the chart.' in str(e)]
        self.assertIn('"type": "image"', json.dumps(req['body']['messages']))


class InheritedModelTest(TaskCase):
    def test_a_subagent_without_a_model_runs_with_its_parents(self):
        conv = new_conv('inherit')
        self.fm.set_scenario([
            role('openai-lead', tool_calls=[task_call('task-inherit', 'Look it up.')]),
            role('inherit', text='Found it with the parent model.'),
            role('openai-lead', text='The subagent found it.'),
        ])
        sid = self.ad.submit('task-openai-lead', 'Delegate.',
                             conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        [res] = self.task_results(conv, sid)
        self.assertIn('Found it with the parent model.', res.text)
        [child] = self.children(conv)
        [req] = [e for e in self.fm.requests() if 'ROLE inherit.' in request_system(e)]
        self.assertEqual(req['provider'], 'openai')
        self.assertEqual(req['body']['model'], 'gpt-test-1')
        answers = [body(r) for r in self.records(child.child_conversation_id)
                   if kind(r) == 'assistant_message']
        self.assertEqual([a.model for a in answers], ['openai/gpt-test-1'])
        self.assertEqual(H.get(self.stack.sd.stub, child.child_submission_id).delegation.model,
                         'openai/gpt-test-1')
        # its conversation cannot be compacted on its own: no model to summarize with
        with self.assertRaises(H.grpc.RpcError) as cm:
            self.ad.call('Compact', H.agent_pb2.CompactRequest(
                conversation_id=child.child_conversation_id), timeout=10)
        self.assertEqual(cm.exception.code(), H.grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn('names no model', cm.exception.details())

    def test_submitting_to_a_model_less_agent_directly_is_refused(self):
        with self.assertRaises(H.grpc.RpcError) as cm:
            self.ad.submit('task-inherit', 'Hello.')
        self.assertEqual(cm.exception.code(), H.grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn('names no model', cm.exception.details())
        info = [a for a in self.ad.list_all_agents() if a.name == 'task-inherit'][0]
        self.assertEqual(info.model, '')


if __name__ == '__main__':
    unittest.main()
