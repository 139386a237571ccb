"""How a drive's records reach storaged (agentd/drive_store.c): the records a model call is
asked with and that are not stored yet (the first turn's input and prompt, a tool batch's last
results) wait for its answer, up to --hold-writes-ms, and go out with it in one Append, or with
the Settle when the answer ends the work (the input stamped applied there too); when the answer
is slower, they are stored on their own once the wait is over. Either way the conversation's
stream holds the same records in the same order. The bench brain's 3-call scenario (`bash`,
`read`, an answer), and a scripted one-turn answer; storaged counts its calls
(CFLUE_RPC_STATS=1) and logs them when it stops.
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import BenchBrainStack, FakeModel, agent_pb2, body_of, common_pb2  # noqa: E402
from cflue_harness import read_all, ts_ms  # noqa: E402

AGENT = BenchBrainStack.AGENT
# The stream of one conversation of the 3-call scenario, whatever the Appends that carried it.
KINDS = ['user_message', 'system_prompt', 'assistant_message', 'tool_result',
         'assistant_message', 'tool_result', 'assistant_message', 'submission_settled']


class OneTurnStack(BenchBrainStack):
    """The stack with a scripted model that answers every request with a text alone."""

    def start_model(self, delay_ms):
        return FakeModel(steps=[{'text': 'Hello.'}] * 20, workdir=self._sub('fake_model'))


class HoldWritesTest(unittest.TestCase):
    def tearDown(self):
        self.stack.remove()

    def converse(self, n, delay_ms, hold_ms, kinds=KINDS, stack_cls=BenchBrainStack):
        """Runs n conversations one after another on a stack whose model answers after
        delay_ms and whose agentd holds writes hold_ms; checks each stream (kinds, without
        streamed text) and that the input was stamped applied. Returns (storaged's
        {method: calls} less the Appends of streamed text, one per assistant_delta record, and
        the streams without those records)."""
        self.stack = stack_cls(
            delay_ms, 'a line of the file the bench brain reads\n' * 100,
            agentd_args=['--hold-writes-ms', str(hold_ms)],
            store_env={'CFLUE_RPC_STATS': '1'}, prefix='cflue-writes-it-')
        ad = self.stack.ad
        streams, deltas = [], 0
        for i in range(n):
            adm = ad.submit(AGENT, 'writes %d' % i)
            sub = ad.call('GetSubmission', agent_pb2.GetSubmissionRequest(
                submission_id=adm.submission_id, wait=True), timeout=60)
            self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub.error)
            self.assertGreater(ts_ms(sub.input_apply_time), 0, sub)
            recs = read_all(self.stack.sd.stub, adm.conversation_id)
            deltas += sum(body_of(r)[0] == 'assistant_delta' for r in recs)
            recs = [r for r in recs if body_of(r)[0] != 'assistant_delta']
            self.assertEqual([body_of(r)[0] for r in recs], kinds)
            streams.append(recs)
        counts = self.stack.store_counts()
        counts['Append'] = counts.get('Append', 0) - deltas
        return counts, streams

    def test_writes_go_out_with_a_quick_answer(self):
        # a hold far longer than any answer of the fake model takes, whatever the build
        counts, _ = self.converse(4, delay_ms=0, hold_ms=10000)
        # per conversation: the input and prompt with the first answer, the first results
        # with the second; the last results and the final answer go with the Settle
        self.assertEqual(counts['Append'], 2 * 4, counts)
        self.assertEqual(counts.get('Settle', 0), 4, counts)
        self.assertEqual(counts.get('MarkInputApplied', 0), 0, counts)

    def test_a_first_answer_that_ends_the_work_goes_with_the_input_in_the_settle(self):
        counts, _ = self.converse(3, delay_ms=0, hold_ms=10000, stack_cls=OneTurnStack,
                                  kinds=['user_message', 'system_prompt', 'assistant_message',
                                         'submission_settled'])
        self.assertEqual(counts['Append'], 0, counts)
        self.assertEqual(counts.get('Settle', 0), 3, counts)
        self.assertEqual(counts.get('MarkInputApplied', 0), 0, counts)

    def test_without_a_hold_each_write_is_an_append(self):
        counts, _ = self.converse(4, delay_ms=0, hold_ms=0)
        self.assertEqual(counts['Append'], 5 * 4, counts)
        self.assertEqual(counts.get('Settle', 0), 4, counts)

    def test_writes_are_stored_while_a_slow_answer_is_awaited(self):
        counts, streams = self.converse(2, delay_ms=1500, hold_ms=50)
        self.assertEqual(counts['Append'], 5 * 2, counts)
        for recs in streams:
            for i, r in enumerate(recs):
                if body_of(r)[0] in ('system_prompt', 'tool_result'):
                    stored_ms = r.create_time.ToMilliseconds()
                    answered_ms = recs[i + 1].create_time.ToMilliseconds()
                    self.assertGreater(answered_ms - stored_ms, 1000,
                                       'the writes were stored only with the answer')


if __name__ == '__main__':
    unittest.main()
