"""agentd's v1 API surface: ErrorInfo reasons (UNKNOWN_AGENT, RESERVED_METADATA_KEY,
NOTHING_TO_COMPACT, INVALID_PAGE_TOKEN, a storaged reason passed through), the Compact
submission kind, ListAgents and GetConversation paging, Abort's oneof target, Watch's
after_offset."""
import unittest

import grpc

from cflue_harness import agent_pb2, common_pb2, error_reason  # noqa: E402
from test_agentd import AgentdCase, kind, new_conv  # noqa: E402

COMPLETED = common_pb2.OUTCOME_COMPLETED


class AgentdApiV1Test(AgentdCase):
    stack_kwargs = {'agents': ('plain', 'brief', 'capped', 'compactor', 'runner-anthropic')}

    def expect_error(self, code, reason, fn, *args, **kw):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        self.assertEqual(error_reason(cm.exception), reason, cm.exception.details())
        return cm.exception

    def message(self, agent, text, conv=''):
        self.fm.set_scenario([{'text': 'ok: ' + text}])
        adm = self.ad.submit(agent, text, conversation_id=conv)
        sub = self.ad.get_submission(adm.submission_id, wait=True, timeout=60)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        self.assertEqual(sub.kind, common_pb2.SUBMISSION_KIND_MESSAGE)
        return adm, sub

    def test_submit_reasons(self):
        req = agent_pb2.SubmitRequest(agent='nobody', message=common_pb2.Message(text='hi'))
        self.expect_error(grpc.StatusCode.NOT_FOUND, 'UNKNOWN_AGENT', self.ad.call, 'Submit', req)
        req = agent_pb2.SubmitRequest(agent='plain', message=common_pb2.Message(text='hi'),
                                      metadata={'team': 'x', 'cflue.kind': 'compact'})
        e = self.expect_error(grpc.StatusCode.INVALID_ARGUMENT, 'RESERVED_METADATA_KEY',
                              self.ad.call, 'Submit', req)
        self.assertIn('cflue.kind', e.details())
        # a reason storaged gave passes through: same key, other payload
        conv = new_conv('idem')
        ok = agent_pb2.SubmitRequest(agent='plain', conversation_id=conv, idempotency_key='k1',
                                     message=common_pb2.Message(text='one'),
                                     metadata={'team': 'x'})
        self.fm.set_scenario([{'text': 'fine'}])
        first = self.ad.call('Submit', ok)
        again = self.ad.call('Submit', ok)
        self.assertTrue(again.deduplicated)
        self.assertEqual(again.submission_id, first.submission_id)
        other = agent_pb2.SubmitRequest(agent='plain', conversation_id=conv, idempotency_key='k1',
                                        message=common_pb2.Message(text='two'))
        self.expect_error(grpc.StatusCode.ALREADY_EXISTS, 'IDEMPOTENCY_CONFLICT', self.ad.call,
                          'Submit', other)
        self.ad.get_submission(first.submission_id, wait=True, timeout=60)

    def test_compact_kind_and_nothing_to_compact(self):
        adm, _ = self.message('compactor', 'short')
        conv = adm.conversation_id
        e = self.expect_error(grpc.StatusCode.FAILED_PRECONDITION, 'NOTHING_TO_COMPACT',
                              self.ad.call, 'Compact',
                              agent_pb2.CompactRequest(conversation_id=conv), timeout=60)
        self.assertIn('nothing to compact', e.details())
        # the compaction was a submission of its own kind, with no message and no metadata
        subs = self.ad.call('GetConversation',
                            agent_pb2.GetConversationRequest(conversation_id=conv)).submissions
        compacts = [s for s in subs if s.kind == common_pb2.SUBMISSION_KIND_COMPACT]
        self.assertEqual(len(compacts), 1, subs)
        self.assertFalse(compacts[0].HasField('message'))
        self.assertEqual(dict(compacts[0].metadata), {})
        self.assertEqual(compacts[0].outcome, common_pb2.OUTCOME_FAILED)
        self.assertIn('nothing to compact', compacts[0].error)
        recs = self.ad.watch_all(conv)
        self.assertEqual([r for r in recs if kind(r) == 'compaction'], [])
        self.expect_error(grpc.StatusCode.NOT_FOUND, 'NOT_FOUND', self.ad.call, 'Compact',
                          agent_pb2.CompactRequest(conversation_id='c-no-such-conv'))

    def test_compact_response_names_its_submission(self):
        steps = [{'tool_calls': [{'name': 'bash', 'arguments': {'command': 'seq 1 3000'}}]},
                 {'text': 'Listed.'}]
        self.fm.set_scenario(steps)
        adm = self.ad.submit('compactor', 'list')
        self.ad.get_submission(adm.submission_id, wait=True, timeout=60)
        self.fm.set_scenario([{'text': 'SUMMARY'}])
        r = self.ad.call('Compact', agent_pb2.CompactRequest(conversation_id=adm.conversation_id),
                         timeout=60)
        self.assertTrue(r.submission_id.startswith('sub_'), r)
        sub = self.ad.get_submission(r.submission_id)
        self.assertEqual(sub.kind, common_pb2.SUBMISSION_KIND_COMPACT)
        recs = self.ad.watch_all(adm.conversation_id)
        comp = [x for x in recs if kind(x) == 'compaction']
        self.assertEqual([c.submission_id for c in comp], [r.submission_id])
        self.assertEqual(comp[0].offset, r.record_offset)

    def test_list_agents_pages(self):
        names, token, pages = [], '', 0
        while True:
            r = self.ad.call('ListAgents', agent_pb2.ListAgentsRequest(page_size=2,
                                                                       page_token=token))
            pages += 1
            self.assertLessEqual(len(r.agents), 2)
            names += [a.name for a in r.agents]
            token = r.next_page_token
            if not token:
                break
        self.assertEqual(names, sorted(self.stack_kwargs['agents']))
        self.assertEqual(pages, 3)
        whole = self.ad.call('ListAgents', agent_pb2.ListAgentsRequest())
        self.assertEqual([a.name for a in whole.agents], names)
        self.assertEqual(whole.next_page_token, '')
        self.expect_error(grpc.StatusCode.INVALID_ARGUMENT, 'INVALID_PAGE_TOKEN', self.ad.call,
                          'ListAgents', agent_pb2.ListAgentsRequest(page_token='abc'))

    def test_get_conversation_pages_and_watch_after(self):
        adm, _ = self.message('plain', 'first')
        conv = adm.conversation_id
        self.message('plain', 'second', conv)
        everything = self.ad.watch_all(conv)
        got, token = [], ''
        while True:
            v = self.ad.call('GetConversation', agent_pb2.GetConversationRequest(
                conversation_id=conv, include_records=True, page_size=3, page_token=token))
            self.assertLessEqual(len(v.records), 3)
            got += list(v.records)
            token = v.next_page_token
            if not token:
                break
        self.assertEqual([r.offset for r in got], [r.offset for r in everything])
        self.assertTrue(all(r.WhichOneof('body') for r in got))
        v = self.ad.call('GetConversation', agent_pb2.GetConversationRequest(conversation_id=conv))
        self.assertEqual(len(v.records), 0)
        self.assertEqual(v.next_page_token, '')
        # another conversation's token is refused with storaged's reason
        other, _ = self.message('plain', 'other')
        first = self.ad.call('GetConversation', agent_pb2.GetConversationRequest(
            conversation_id=conv, include_records=True, page_size=1))
        self.expect_error(grpc.StatusCode.INVALID_ARGUMENT, 'INVALID_PAGE_TOKEN', self.ad.call,
                          'GetConversation', agent_pb2.GetConversationRequest(
                              conversation_id=other.conversation_id, include_records=True,
                              page_token=first.next_page_token))
        # Watch after an offset: strictly after it
        mid = everything[len(everything) // 2].offset
        after = self.ad.watch_all(conv, after_offset=mid)
        self.assertEqual([r.offset for r in after], [r.offset for r in everything if r.offset > mid])

    def test_abort_target(self):
        self.expect_error(grpc.StatusCode.INVALID_ARGUMENT, 'INVALID_ARGUMENT', self.ad.call,
                          'Abort', agent_pb2.AbortRequest())
        adm, _ = self.message('plain', 'done already')
        r = self.ad.call('Abort', agent_pb2.AbortRequest(submission_id=adm.submission_id))
        self.assertFalse(r.aborted)
        r = self.ad.call('Abort', agent_pb2.AbortRequest(conversation_id=adm.conversation_id))
        self.assertFalse(r.aborted)


if __name__ == '__main__':
    unittest.main()
