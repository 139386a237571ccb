"""storaged's principal rule (AdmitRequest.principal, Conversation.principal,
Submission.principal): the first Admit of a conversation makes its principal the
conversation's; an Admit by another principal into it is refused by storaged itself
(PERMISSION_DENIED, reason NOT_CONVERSATION_OWNER), whatever agentd did, so two agentds racing
one conversation id cannot both get it; an admin Admit and an Admit without a principal (no
authentication) pass; a subagent's conversation takes its parent's principal; another
principal's idempotency key is a conflict that names nothing of theirs."""

import threading
import unittest
import uuid

import grpc

from cflue_harness import (StoragedTestCase, admit_request, common_pb2, error_reason,
                           get, get_conversation)


def conv_id(tag):
    return 'p-%s-%s' % (tag, uuid.uuid4().hex[:8])


class PrincipalTest(StoragedTestCase):
    shared_storaged = True

    def admit(self, principal='', conv='', admin=False, key='', text='hi', **kw):
        req = admit_request(conv=conv, key=key, text=text, **kw)
        req.principal = principal
        req.admin = admin
        return self.stub.admit(req)

    def refused(self, code, reason, fn, *args, **kw):
        e = self.assertRpcError(code, fn, *args, **kw)
        self.assertEqual(error_reason(e), reason, e.details())
        return e

    def test_first_admit_owns_and_others_are_refused(self):
        conv = conv_id('own')
        first = self.admit('alice', conv)
        self.assertEqual(first.submission.principal, 'alice')
        self.assertEqual(get_conversation(self.stub, conv).principal, 'alice')
        # the owner again, and an Admit without a principal (authentication off): admitted
        self.assertEqual(self.admit('alice', conv).submission.principal, 'alice')
        self.assertEqual(self.admit('', conv).submission.principal, 'alice')
        e = self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER',
                         self.admit, 'bob', conv)
        self.assertNotIn('alice', e.details())
        # checked before the agent: bob learns nothing of the conversation's agent either
        e = self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER',
                         self.admit, 'bob', conv, agent='other')
        self.assertNotIn('assistant', e.details())
        # a compaction is an Admit too
        self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER', self.admit,
                     'bob', conv, kind=common_pb2.SUBMISSION_KIND_COMPACT)
        # an admin may; the conversation keeps its principal, and so does the submission
        by_admin = self.admit('root', conv, admin=True)
        self.assertEqual(by_admin.submission.principal, 'alice')
        self.assertEqual(get(self.stub, by_admin.submission.submission_id).principal, 'alice')
        self.assertEqual(get_conversation(self.stub, conv).principal, 'alice')

    def test_conversation_without_principal_is_admins_only(self):
        conv = conv_id('none')
        self.assertEqual(self.admit('', conv).submission.principal, '')
        self.assertEqual(get_conversation(self.stub, conv).principal, '')
        e = self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER',
                         self.admit, 'alice', conv)
        self.assertIn('no principal', e.details())
        self.assertEqual(self.admit('root', conv, admin=True).submission.principal, '')

    def test_bad_principals(self):
        for bad in ('has space', 'x' * 65, 'semi;colon', 'tab\tx'):
            self.refused(grpc.StatusCode.INVALID_ARGUMENT, 'INVALID_ARGUMENT', self.admit, bad,
                         conv_id('bad'))
        e = self.refused(grpc.StatusCode.INVALID_ARGUMENT, 'INVALID_ARGUMENT', self.admit, '',
                         conv_id('bad'), admin=True)
        self.assertIn('admin', e.details())
        self.assertEqual(self.admit('a.b_c-d@e.f' + 'x' * 53, conv_id('ok')).submission.principal,
                         'a.b_c-d@e.f' + 'x' * 53)

    def test_race_for_one_conversation_id(self):
        """Eight principals admit into one new conversation id at once: one gets it, every
        other is refused, and the conversation is the winner's."""
        conv = conv_id('race')
        results = {}

        def go(who):
            try:
                results[who] = self.admit(who, conv).submission.principal
            except grpc.RpcError as e:
                results[who] = e.code()

        threads = [threading.Thread(target=go, args=('p%d' % i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [w for w, r in results.items() if isinstance(r, str)]
        self.assertEqual(len(won), 1, results)
        self.assertEqual(results[won[0]], won[0])
        for w, r in results.items():
            if w != won[0]:
                self.assertEqual(r, grpc.StatusCode.PERMISSION_DENIED, results)
        self.assertEqual(get_conversation(self.stub, conv).principal, won[0])

    def test_child_takes_the_parents_principal(self):
        parent = self.admit('alice', conv_id('parent')).submission

        def child(principal, key):
            req = admit_request(agent='helper', text='subtask', key=key)
            req.principal = principal
            req.delegation.CopyFrom(common_pb2.Delegation(
                parent_submission_id=parent.submission_id,
                parent_conversation_id=parent.conversation_id, tool_call_id='call_1', depth=1))
            return self.stub.admit(req).submission

        c = child('', 'k-child-1')  # agentd's task tool names no principal
        self.assertEqual(c.principal, 'alice')
        self.assertEqual(get_conversation(self.stub, c.conversation_id).principal, 'alice')
        self.assertEqual(child('alice', 'k-child-2').principal, 'alice')
        self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER', child, 'bob',
                     'k-child-3')
        # bob cannot come in through the child's conversation either
        self.refused(grpc.StatusCode.PERMISSION_DENIED, 'NOT_CONVERSATION_OWNER', self.admit,
                     'bob', c.conversation_id, agent='helper')

    def test_idempotency_key_of_another_principal(self):
        key = 'k-' + uuid.uuid4().hex[:8]
        first = self.admit('alice', conv_id('idem'), key=key)
        again = self.admit('alice', first.submission.conversation_id, key=key)
        self.assertTrue(again.deduplicated)
        self.assertEqual(again.submission.submission_id, first.submission.submission_id)
        # bob's request with alice's key (even her conversation and text) is not hers: a
        # conflict that does not name her submission
        e = self.refused(grpc.StatusCode.ALREADY_EXISTS, 'IDEMPOTENCY_CONFLICT', self.admit, 'bob',
                         first.submission.conversation_id, key=key)
        self.assertNotIn(first.submission.submission_id, e.details())
        # the admin flag is no part of the payload: alice's retry as admin is still hers
        again = self.admit('alice', first.submission.conversation_id, admin=True, key=key)
        self.assertTrue(again.deduplicated)


if __name__ == '__main__':
    unittest.main()
