"""How a drive's records reach storaged (agentd/drive_store.c): a tool batch's last results wait
for the next model answer, up to --hold-results-ms, and go out with it in one Append (or with
the Settle, when the answer is the last); when the answer is slower, they are stored on their
own once the wait is over. Either way the conversation's stream holds the same records in the
same order. The bench brain's 3-call scenario (`bash`, `read`, an answer); storaged counts its
calls (CFLUE_RPC_STATS=1) and logs them when it stops.
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import BenchBrainStack, agent_pb2, body_of, common_pb2, read_all  # noqa: E402

AGENT = BenchBrainStack.AGENT
# The stream of one conversation of the scenario, whatever the Appends that carried it.
KINDS = ['user_message', 'system_prompt', 'assistant_message', 'tool_result',
         'assistant_message', 'tool_result', 'assistant_message', 'submission_settled']


class HoldResultsTest(unittest.TestCase):
    def tearDown(self):
        self.stack.remove()

    def converse(self, n, delay_ms, hold_ms):
        """Runs n conversations one after another on a stack whose model answers after
        delay_ms and whose agentd holds results hold_ms; checks each stream and returns
        (storaged's {method: calls} less the Appends of streamed text, one per assistant_delta
        record, and the streams without those records)."""
        self.stack = BenchBrainStack(
            delay_ms, 'a line of the file the bench brain reads\n' * 100,
            agentd_args=['--hold-results-ms', str(hold_ms)],
            store_env={'CFLUE_RPC_STATS': '1'}, prefix='cflue-writes-it-')
        ad = self.stack.ad
        streams, deltas = [], 0
        for i in range(n):
            adm = ad.submit(AGENT, 'writes %d' % i)
            sub = ad.call('GetSubmission', agent_pb2.GetSubmissionRequest(
                submission_id=adm.submission_id, wait=True), timeout=60)
            self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub.error)
            recs = read_all(self.stack.sd.stub, adm.conversation_id)
            deltas += sum(body_of(r)[0] == 'assistant_delta' for r in recs)
            recs = [r for r in recs if body_of(r)[0] != 'assistant_delta']
            self.assertEqual([body_of(r)[0] for r in recs], KINDS)
            streams.append(recs)
        counts = self.stack.store_counts()
        counts['Append'] = counts.get('Append', 0) - deltas
        return counts, streams

    def test_results_go_out_with_a_quick_answer(self):
        # a hold far longer than any answer of the fake model takes, whatever the build
        counts, _ = self.converse(4, delay_ms=0, hold_ms=10000)
        # per conversation: the input and prompt (stamped applied: never held), the first
        # answer, the first results with the second answer; the last results and the final
        # answer go with the Settle
        self.assertEqual(counts.get('Append', 0), 3 * 4, counts)
        self.assertEqual(counts.get('Settle', 0), 4, counts)

    def test_without_a_hold_each_write_is_an_append(self):
        counts, _ = self.converse(4, delay_ms=0, hold_ms=0)
        self.assertEqual(counts.get('Append', 0), 5 * 4, counts)
        self.assertEqual(counts.get('Settle', 0), 4, counts)

    def test_results_are_stored_while_a_slow_answer_is_awaited(self):
        counts, streams = self.converse(2, delay_ms=1500, hold_ms=50)
        self.assertEqual(counts.get('Append', 0), 5 * 2, counts)
        for recs in streams:
            for i, r in enumerate(recs):
                if body_of(r)[0] == 'tool_result':
                    stored_ms = r.create_time.ToMilliseconds()
                    answered_ms = recs[i + 1].create_time.ToMilliseconds()
                    self.assertGreater(answered_ms - stored_ms, 1000,
                                       'the results were stored only with the answer')


if __name__ == '__main__':
    unittest.main()
