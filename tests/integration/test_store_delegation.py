"""Subagent delegation in storaged (AdmitRequest.delegation, Submission.delegation, TaskStarted
records): a delegated Admit is checked and stored with its parent, returned on every read, and
deduplicated like any other; whatever stops a parent (an abort intent, settling failed or
aborted) stamps an abort intent on its unsettled descendants in the same transaction, and a
child admitted under a parent that was stopped already carries one from its admission."""

import unittest

from cflue_harness import (
    ALREADY_EXISTS, INVALID_ARGUMENT, NOT_FOUND,
    StoragedTestCase, common_pb2, store_pb2,
    admit, admit_request, append, claim, error_reason, get, list_all, read_all, record,
    request_abort, settle, settle_queued, ts_ms)

QUEUED = common_pb2.SUBMISSION_STATUS_QUEUED
RUNNING = common_pb2.SUBMISSION_STATUS_RUNNING
TERMINALIZING = common_pb2.SUBMISSION_STATUS_TERMINALIZING
SETTLED = common_pb2.SUBMISSION_STATUS_SETTLED
COMPLETED = common_pb2.OUTCOME_COMPLETED
FAILED = common_pb2.OUTCOME_FAILED
ABORTED = common_pb2.OUTCOME_ABORTED


def delegation(parent, depth=1, tool_call_id='call_1', sandbox_tools='', sandbox='', model='',
               cwd='', sandbox_placement=''):
    """A Delegation naming parent (a Submission) as the submission whose `task` call made it."""
    return common_pb2.Delegation(parent_submission_id=parent.submission_id,
                                 parent_conversation_id=parent.conversation_id,
                                 tool_call_id=tool_call_id, depth=depth,
                                 sandbox_tools=sandbox_tools, sandbox=sandbox, model=model,
                                 cwd=cwd, sandbox_placement=sandbox_placement)


def delegated_request(parent, agent='helper', text='do the subtask', key='', conv='', **kw):
    req = admit_request(agent=agent, conv=conv, text=text, key=key)
    req.delegation.CopyFrom(delegation(parent, **kw))
    return req


class DelegationCase(StoragedTestCase):

    def running(self, conv='', text='parent'):
        """A submission admitted and claimed: (row, fence)."""
        sub = admit(self.stub, conv=conv, text=text).submission
        c = claim(self.stub, submission_id=sub.submission_id)
        self.assertTrue(c.HasField('submission'), c)
        return c.submission, c.fence

    def delegate(self, parent, **kw):
        """Admits a child of parent; returns the AdmitResponse."""
        return self.stub.admit(delegated_request(parent, **kw))

    def child_running(self, parent, **kw):
        """A child of parent, admitted and claimed: (row, fence)."""
        sub = self.delegate(parent, **kw).submission
        c = claim(self.stub, submission_id=sub.submission_id)
        self.assertTrue(c.HasField('submission'), c)
        return c.submission, c.fence

    def abort_time(self, sub_id):
        return ts_ms(get(self.stub, sub_id).abort_request_time)


class AdmitTest(DelegationCase):

    def test_delegation_round_trips_on_admit_get_list_and_claim(self):
        parent, _ = self.running()
        want = delegation(parent, tool_call_id='toolu_01AbC', sandbox_tools='unix:/run/toold.sock',
                          sandbox='sb-1', model='openai/gpt-test', cwd='pkg/lib',
                          sandbox_placement='dns:toold.ns.svc:7000')
        req = delegated_request(parent, tool_call_id='toolu_01AbC',
                                sandbox_tools='unix:/run/toold.sock', sandbox='sb-1',
                                model='openai/gpt-test', cwd='pkg/lib',
                                sandbox_placement='dns:toold.ns.svc:7000')
        r = self.stub.admit(req)
        child = r.submission
        self.assertFalse(r.deduplicated)
        self.assertEqual(child.delegation, want)
        self.assertEqual(child.agent, 'helper')
        self.assertEqual(child.status, QUEUED)
        self.assertTrue(child.conversation_id.startswith('conv_'), child.conversation_id)
        self.assertNotEqual(child.conversation_id, parent.conversation_id)
        self.assertEqual(r.offset, -1)  # a new conversation: nothing to read yet
        self.assertEqual(ts_ms(child.abort_request_time), 0)
        self.assertEqual(get(self.stub, child.submission_id).delegation, want)
        listed = list_all(self.stub, conversation_id=child.conversation_id)
        self.assertEqual([s.delegation for s in listed], [want])
        c = claim(self.stub, submission_id=child.submission_id)
        self.assertEqual(c.submission.delegation, want)
        self.assertEqual(c.submission.status, RUNNING)
        # an ordinary submission has none
        self.assertFalse(get(self.stub, parent.submission_id).HasField('delegation'))

    def test_admit_with_claim_keeps_delegation(self):
        parent, _ = self.running()
        req = delegated_request(parent)
        req.claim.owner_id = 'owner-1'
        r = self.stub.admit(req)
        self.assertTrue(r.HasField('claim'), r)
        self.assertEqual(r.submission.delegation, delegation(parent))
        self.assertEqual(r.claim.submission.delegation, delegation(parent))

    def test_grandchild_is_one_level_below(self):
        parent, _ = self.running()
        child, _ = self.child_running(parent)
        g = self.delegate(child, depth=2).submission
        self.assertEqual(get(self.stub, g.submission_id).delegation.depth, 2)
        self.assertEqual(g.delegation.parent_conversation_id, child.conversation_id)
        # a level skipped, or repeated, is refused: the depth bound must mean something
        for depth in (1, 3):
            e = self.assertRpcError(INVALID_ARGUMENT, self.delegate, child, depth=depth,
                                    details_has='depth')
            self.assertEqual(error_reason(e), 'INVALID_ARGUMENT')

    def test_invalid_delegations_are_refused(self):
        parent, _ = self.running()
        before = len(list_all(self.stub))
        cases = [
            ('depth 0', dict(depth=0), 'delegation.depth'),
            ('depth 5', dict(depth=5), 'delegation.depth'),
            ('no tool call id', dict(tool_call_id=''), 'delegation.tool_call_id'),
            ('tool call id too long', dict(tool_call_id='c' * 257), 'delegation.tool_call_id'),
            ('conversation given', dict(conv='somewhere'), 'conversation_id'),
            ('sandbox without its tools', dict(sandbox='sb'), 'sandbox'),
            ('tools without a sandbox', dict(sandbox_tools='unix:/x'), 'sandbox'),
            ('sandbox name too long', dict(sandbox_tools='unix:/x', sandbox='s' * 257),
             'delegation.sandbox'),
            ('model too long', dict(model='openai/' + 'm' * 250), 'delegation.model'),
            ('cwd without a sandbox', dict(cwd='pkg'), 'delegation.cwd'),
            ('placement without a sandbox', dict(sandbox_placement='dns:t:1'),
             'delegation.sandbox_placement'),
            ('placement not by dns', dict(sandbox_tools='unix:/x', sandbox='sb',
                                          sandbox_placement='a:1,b:1'),
             'delegation.sandbox_placement'),
            ('placement too long', dict(sandbox_tools='unix:/x', sandbox='sb',
                                        sandbox_placement='dns:' + 't' * 295 + ':12'),
             'delegation.sandbox_placement'),
            ('address too long', dict(sandbox_tools='t' * 298 + ':12', sandbox='sb'),
             'delegation.sandbox_tools'),
            ('cwd too long', dict(sandbox_tools='unix:/x', sandbox='sb', cwd='d/' * 600),
             'delegation.cwd'),
        ] + [
            ('cwd %r' % cwd, dict(sandbox_tools='unix:/x', sandbox='sb', cwd=cwd), 'delegation.cwd')
            for cwd in ('/abs', 'pkg/', 'a//b', './a', 'a/..', '..', 'a/./b')
        ]
        for what, kw, word in cases:
            with self.subTest(what):
                e = self.assertRpcError(INVALID_ARGUMENT, self.delegate, parent,
                                        details_has=word, **kw)
                self.assertEqual(error_reason(e), 'INVALID_ARGUMENT')
        # missing parent ids, a parent in another conversation, a compaction
        req = delegated_request(parent)
        req.delegation.parent_submission_id = ''
        self.assertRpcError(INVALID_ARGUMENT, self.stub.admit, req,
                            details_has='parent_submission_id')
        req = delegated_request(parent)
        req.delegation.parent_conversation_id = ''
        self.assertRpcError(INVALID_ARGUMENT, self.stub.admit, req,
                            details_has='parent_conversation_id')
        req = delegated_request(parent)
        req.delegation.parent_conversation_id = 'conv_elsewhere'
        self.assertRpcError(INVALID_ARGUMENT, self.stub.admit, req,
                            details_has=['parent_conversation_id', parent.conversation_id])
        req = store_pb2.AdmitRequest(agent='helper', kind=common_pb2.SUBMISSION_KIND_COMPACT)
        req.delegation.CopyFrom(delegation(parent))
        self.assertRpcError(INVALID_ARGUMENT, self.stub.admit, req, details_has='MESSAGE')
        self.assertEqual(len(list_all(self.stub)), before)

    def test_unknown_parent_is_not_found(self):
        parent, _ = self.running()
        req = delegated_request(parent)
        req.delegation.parent_submission_id = 'sub_nope'
        e = self.assertRpcError(NOT_FOUND, self.stub.admit, req,
                                details_has=['parent', 'sub_nope'])
        self.assertEqual(error_reason(e), 'NOT_FOUND')
        self.assertEqual(len(list_all(self.stub)), 1)

    def test_same_key_is_deduplicated_into_the_same_child(self):
        parent, pf = self.running()
        a = self.delegate(parent, key='task:call_1')
        b = self.delegate(parent, key='task:call_1')
        self.assertFalse(a.deduplicated)
        self.assertTrue(b.deduplicated)
        self.assertEqual(b.submission.submission_id, a.submission.submission_id)
        self.assertEqual(b.submission.conversation_id, a.submission.conversation_id)
        self.assertEqual(b.submission.delegation, a.submission.delegation)
        # another call with the same key is another payload
        e = self.assertRpcError(ALREADY_EXISTS, self.delegate, parent, key='task:call_1',
                                tool_call_id='call_2')
        self.assertEqual(error_reason(e), 'IDEMPOTENCY_CONFLICT')
        # a retry after the parent settled still finds its child (and stamps nothing new)
        settle(self.stub, pf)
        c = self.delegate(parent, key='task:call_1')
        self.assertTrue(c.deduplicated)
        self.assertEqual(c.submission.submission_id, a.submission.submission_id)
        self.assertEqual(ts_ms(c.submission.abort_request_time), 0)
        self.assertEqual(len(list_all(self.stub)), 2)

    def test_a_retry_reaching_the_sandbox_elsewhere_finds_its_child(self):
        """Where the parent's sandbox is reached may change between the parent's attempts (its
        replica given up, an agentd of another version), and what its definitions say (its
        sandbox's name, limits, model: reloaded): the task call is the same, and its retry
        finds the child admitted first, as it was admitted."""
        parent, _ = self.running()
        a = self.delegate(parent, key='task:call_9', sandbox_tools='toold-0.toold:7102',
                          sandbox='sb', sandbox_placement='dns:toold:7102')
        b = self.delegate(parent, key='task:call_9', sandbox_tools='toold-1.toold:7102',
                          sandbox='sb')
        self.assertFalse(a.deduplicated)
        self.assertTrue(b.deduplicated)
        self.assertEqual(b.submission.submission_id, a.submission.submission_id)
        self.assertEqual(b.submission.delegation.sandbox_placement, 'dns:toold:7102')
        self.assertEqual(b.submission.delegation.sandbox_tools, 'toold-0.toold:7102')
        c = self.delegate(parent, key='task:call_9', sandbox_tools='toold-0.toold:7102',
                          sandbox='renamed', model='anthropic/other')
        self.assertTrue(c.deduplicated)
        self.assertEqual(c.submission.submission_id, a.submission.submission_id)
        self.assertEqual(c.submission.delegation.sandbox, 'sb')
        # another directory (the call's own argument) is another admission
        e = self.assertRpcError(ALREADY_EXISTS, self.delegate, parent, key='task:call_9',
                                sandbox_tools='toold-0.toold:7102',
                                sandbox_placement='dns:toold:7102', sandbox='sb', cwd='pkg')
        self.assertEqual(error_reason(e), 'IDEMPOTENCY_CONFLICT')
        self.assertEqual(len(list_all(self.stub)), 2)

    def test_child_of_a_stopped_parent_is_admitted_with_an_abort_intent(self):
        aborted, _ = self.running(text='aborted parent')
        request_abort(self.stub, submission_id=aborted.submission_id, reason='user hit stop')
        child = self.delegate(aborted).submission
        self.assertEqual(child.status, QUEUED)
        self.assertGreater(ts_ms(child.abort_request_time), 0)
        self.assertGreater(self.abort_time(child.submission_id), 0)
        done, df = self.running(text='completed parent')
        settle(self.stub, df)
        late = self.delegate(done).submission
        self.assertGreater(ts_ms(late.abort_request_time), 0)
        # a parent that is neither: no intent
        live, _ = self.running(text='live parent')
        self.assertEqual(ts_ms(self.delegate(live).submission.abort_request_time), 0)
        # it is listed with the other abort intents
        got = [s.submission_id for s in list_all(self.stub, abort_requested=True)]
        self.assertEqual(got, [aborted.submission_id, child.submission_id, late.submission_id])


class CascadeTest(DelegationCase):

    def tree(self):
        """parent (running) -> child (running) -> grandchild (queued); parent -> done (settled
        completed); parent -> closing (terminalizing, completed reserved); an unrelated
        submission."""
        parent, pf = self.running()
        child, cf = self.child_running(parent, tool_call_id='call_child')
        grand = self.delegate(child, depth=2, tool_call_id='call_grand').submission
        done, df = self.child_running(parent, tool_call_id='call_done')
        settle(self.stub, df)
        closing, zf = self.child_running(parent, tool_call_id='call_closing')
        settle(self.stub, zf, reserve_only=True)
        other = admit(self.stub, text='unrelated').submission
        return dict(parent=parent, pf=pf, child=child, cf=cf, grand=grand, done=done,
                    closing=closing, other=other)

    def assertStamped(self, t, names):
        for name in ('parent', 'child', 'grand', 'done', 'closing', 'other'):
            stamped = self.abort_time(t[name].submission_id) > 0
            self.assertEqual(stamped, name in names, '%s stamped: %s' % (name, stamped))

    def test_request_abort_of_the_parent_stamps_its_unsettled_descendants(self):
        t = self.tree()
        r = request_abort(self.stub, submission_id=t['parent'].submission_id, reason='stop')
        self.assertEqual(list(r.affected), [t['parent'].submission_id, t['child'].submission_id,
                                            t['grand'].submission_id])
        self.assertStamped(t, {'parent', 'child', 'grand'})
        self.assertEqual(get(self.stub, t['grand'].submission_id).status, QUEUED)  # untouched
        self.assertEqual(get(self.stub, t['closing'].submission_id).status, TERMINALIZING)
        # idempotent: the same ids, the first stamp kept
        first = self.abort_time(t['grand'].submission_id)
        again = request_abort(self.stub, submission_id=t['parent'].submission_id, reason='again')
        self.assertEqual(list(again.affected), list(r.affected))
        self.assertEqual(self.abort_time(t['grand'].submission_id), first)

    def test_request_abort_of_the_conversation_reaches_other_conversations(self):
        t = self.tree()
        r = request_abort(self.stub, conversation_id=t['parent'].conversation_id)
        self.assertEqual(set(r.affected), {t['parent'].submission_id, t['child'].submission_id,
                                           t['grand'].submission_id})
        self.assertStamped(t, {'parent', 'child', 'grand'})

    def test_request_abort_of_a_child_stops_its_subtree_only(self):
        t = self.tree()
        r = request_abort(self.stub, submission_id=t['child'].submission_id)
        self.assertEqual(list(r.affected), [t['child'].submission_id, t['grand'].submission_id])
        self.assertStamped(t, {'child', 'grand'})

    def test_an_earlier_intent_keeps_its_time(self):
        t = self.tree()
        request_abort(self.stub, submission_id=t['grand'].submission_id, reason='first')
        first = self.abort_time(t['grand'].submission_id)
        request_abort(self.stub, submission_id=t['parent'].submission_id, reason='later')
        self.assertEqual(self.abort_time(t['grand'].submission_id), first)

    def test_settle_failed_stamps_the_running_child(self):
        t = self.tree()
        settle(self.stub, t['pf'], FAILED, 'model error')
        self.assertStamped(t, {'child', 'grand'})
        self.assertEqual(get(self.stub, t['child'].submission_id).status, RUNNING)

    def test_settle_aborted_stamps_children(self):
        t = self.tree()
        settle(self.stub, t['pf'], ABORTED, 'aborted by the user')
        self.assertStamped(t, {'child', 'grand'})

    def test_settle_completed_stamps_nothing(self):
        t = self.tree()
        settle(self.stub, t['pf'], COMPLETED)
        self.assertStamped(t, set())

    def test_reserving_a_failure_stamps_children_at_once(self):
        t = self.tree()
        settle(self.stub, t['pf'], FAILED, 'over budget', reserve_only=True)
        self.assertEqual(get(self.stub, t['parent'].submission_id).status, TERMINALIZING)
        self.assertStamped(t, {'child', 'grand'})
        first = self.abort_time(t['child'].submission_id)
        settle(self.stub, t['pf'], FAILED, 'over budget')  # finishes the reserved outcome
        self.assertEqual(self.abort_time(t['child'].submission_id), first)

    def test_a_child_settling_failed_stops_its_own_children(self):
        t = self.tree()
        settle(self.stub, t['cf'], FAILED, 'subagent failed')
        self.assertStamped(t, {'grand'})

    def test_a_queued_parent_settled_failed_without_attempt(self):
        parent = admit(self.stub, text='never ran').submission
        child = self.delegate(parent).submission
        settle_queued(self.stub, parent.submission_id)
        self.assertGreater(self.abort_time(child.submission_id), 0)

    def test_four_levels_deep(self):
        subs = [self.running()[0]]
        for depth in range(1, 5):
            subs.append(self.delegate(subs[-1], depth=depth).submission)
        self.assertRpcError(INVALID_ARGUMENT, self.delegate, subs[-1], depth=5,
                            details_has='depth')
        r = request_abort(self.stub, submission_id=subs[0].submission_id)
        self.assertEqual(list(r.affected), [s.submission_id for s in subs])


class TaskStartedTest(DelegationCase):

    def test_task_started_record_is_stored_and_checked(self):
        parent, pf = self.running()
        child = self.delegate(parent, tool_call_id='call_7').submission
        body = common_pb2.TaskStarted(turn=2, index=1, tool_call_id='call_7', agent='helper',
                                      child_submission_id=child.submission_id,
                                      child_conversation_id=child.conversation_id, depth=1)
        r = append(self.stub, pf, [record('task_started', body, id_='task:call_7')])
        recs = read_all(self.stub, parent.conversation_id)
        self.assertEqual([x.WhichOneof('body') for x in recs], ['task_started'])
        self.assertEqual(recs[0].task_started, body)
        self.assertEqual(recs[0].offset, r.first_offset)
        # resent unchanged: deduplicated
        self.assertTrue(append(self.stub, pf, [record('task_started', body,
                                                      id_='task:call_7')]).deduplicated)
        bad = [
            ('depth 0', dict(depth=0), 'depth'),
            ('depth 5', dict(depth=5), 'depth'),
            ('no child submission', dict(child_submission_id=''), 'child_submission_id'),
            ('no child conversation', dict(child_conversation_id=''), 'child_conversation_id'),
            ('no tool call id', dict(tool_call_id=''), 'tool_call_id'),
            ('no agent', dict(agent=''), 'agent'),
            ('turn 0', dict(turn=0), 'turn'),
            ('negative index', dict(index=-1), 'index'),
            ('bad child id', dict(child_submission_id='sub/../x'), 'child_submission_id'),
        ]
        for what, change, word in bad:
            with self.subTest(what):
                b = common_pb2.TaskStarted()
                b.CopyFrom(body)
                for k, v in change.items():
                    setattr(b, k, v)
                e = self.assertRpcError(INVALID_ARGUMENT, append, self.stub, pf,
                                        [record('task_started', b)],
                                        details_has=['records[0].task_started', word])
                self.assertEqual(error_reason(e), 'INVALID_ARGUMENT')
        self.assertEqual(len(read_all(self.stub, parent.conversation_id)), 1)


if __name__ == '__main__':
    unittest.main()
