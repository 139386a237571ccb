"""Typed records over the wire: every record type round-trips through Append, Read and Follow
byte-identical; conflicts carry their ErrorInfo reasons."""

import unittest

import grpc

from cflue_harness import (
    ALREADY_EXISTS, RECORD_DEFAULTS, StoragedTestCase, admit, append, claim, common_pb2,
    error_reason, read_all, record, settle, store_pb2)

FULL = {
    'user_message': {'text': 'héllo', 'attachments': [
        {'name': 'a.png', 'mimeType': 'image/png', 'sizeBytes': 7}]},
    'system_prompt': {'text': 'you are a test'},
    'assistant_delta': {'turn': 2, 'text': 'par'},
    'assistant_message': {'turn': 2, 'text': 'answer', 'toolCalls': [
        {'id': 'c1', 'name': 'bash', 'argumentsJson': '{"command":"ls"}'},
        {'id': 'c2', 'name': 'read', 'argumentsJson': 'not json'}],
        'stopReason': 'tool_use', 'model': 'fake/m',
        'usage': {'inputTokens': 10, 'outputTokens': 3, 'costUsd': 0.5}},
    'tool_result': {'turn': 2, 'index': 1, 'toolCallId': 'c2', 'name': 'read', 'text': 'x',
                    'isError': True, 'outcomeUnknown': True, 'truncation': {
                        'truncated': True, 'by': 'TRUNCATED_BY_LINES', 'totalLines': 9,
                        'totalBytes': 99, 'shownFirstLine': 1, 'shownLastLine': 4,
                        'nextOffset': 5, 'lineTooLong': True},
                    'images': [{'name': 'image-1', 'mimeType': 'image/png',
                                'data': 'iVBORw0KGgo='}]},
    'signal': {'kind': 'resources_1', 'text': 'disk low'},
    'compaction': {'summary': 'sum', 'firstKeptOffset': 2, 'tokensBefore': 100,
                   'tokensAfter': 10, 'trigger': 'COMPACTION_TRIGGER_REQUEST'},
    'task_started': {'turn': 2, 'index': 1, 'toolCallId': 'c2', 'agent': 'helper',
                     'childSubmissionId': 'sub_01CHILD', 'childConversationId': 'conv_01CHILD',
                     'depth': 3},
}


class RecordsTest(StoragedTestCase):

    def test_every_type_round_trips(self):
        s = admit(self.stub, conv='typed').submission
        c = claim(self.stub)
        sent = [record(t, FULL[t], id_='r-' + t) for t in RECORD_DEFAULTS
                if t != 'submission_settled']
        append(self.stub, c.fence, sent)
        settle(self.stub, c.fence)
        got = read_all(self.stub, 'typed')
        self.assertEqual(len(got), len(sent) + 1)
        for a, b in zip(sent, got):
            kind = a.WhichOneof('body')
            self.assertEqual(b.WhichOneof('body'), kind)
            self.assertEqual(getattr(b, kind).SerializeToString(deterministic=True),
                             getattr(a, kind).SerializeToString(deterministic=True), kind)
        self.assertEqual(got[-1].WhichOneof('body'), 'submission_settled')
        followed = list(self.stub.follow(store_pb2.FollowRequest(
            conversation_id='typed', after_offset=-1, until_settled=s.submission_id),
            timeout=10))
        self.assertEqual([x.SerializeToString() for x in followed],
                         [x.SerializeToString() for x in got])

    def test_conflict_reasons(self):
        admit(self.stub, conv='cf', key='k1', text='one')
        e = self.assertRpcError(ALREADY_EXISTS, admit, self.stub, conv='cf', key='k1',
                                text='two')
        self.assertEqual(error_reason(e), 'IDEMPOTENCY_CONFLICT')
        c = claim(self.stub)
        append(self.stub, c.fence, [record('signal', {'text': 'a'}, id_='x')])
        # the same content in another type is other content
        e = self.assertRpcError(ALREADY_EXISTS, append, self.stub, c.fence,
                                [record('system_prompt', {'text': 'a'}, id_='x')])
        self.assertEqual(error_reason(e), 'RECORD_CONFLICT')
        r = append(self.stub, c.fence, [record('signal', {'text': 'a'}, id_='x')])
        self.assertTrue(r.deduplicated)


if __name__ == '__main__':
    unittest.main()
