"""A Compact submission (agentd admits it with metadata cflue.kind=compact) is its own ordered
work: ClaimJoinable never joins it into a running submission, the joinable run stops before it
without skipping it (FIFO holds), and nothing joins a running Compact.

Before the fix a Compact queued behind a running prompt was absorbed as a join: the model got
"(compact the conversation)" as user text and nothing was compacted (issue 7, defect 9).
"""

import unittest

from cflue_harness import (
    StoragedTestCase, admit, claim, claim_joinable, common_pb2, get, settle)



class CompactJoinTest(StoragedTestCase):

    def admit_ids(self, conv, kinds):
        out = []
        for i, k in enumerate(kinds):
            kind = common_pb2.SUBMISSION_KIND_COMPACT if k == 'compact' else 0
            out.append(admit(self.stub, conv=conv, text='%s-%d' % (k, i), kind=kind,
                             metadata={'i': str(i)}).submission.submission_id)
        return out

    def claim_id(self, sub_id):
        c = claim(self.stub, submission_id=sub_id)
        self.assertTrue(c.HasField('submission'), 'could not claim %s' % sub_id)
        self.assertEqual(c.submission.submission_id, sub_id)
        return c

    def test_run_stops_before_compact_and_fifo_holds(self):
        """host, prompt, compact, prompt: ClaimJoinable takes only the first prompt. The
        compact then runs alone, in order, with nothing joined into it; the last prompt runs
        after it."""
        host, p1, comp, p2 = self.admit_ids('cj-a', ['prompt', 'prompt', 'compact', 'prompt'])
        c = self.claim_id(host)
        joined = claim_joinable(self.stub, c.fence)
        self.assertEqual([s.submission_id for s in joined], [p1])
        self.assertEqual(get(self.stub, comp).status, common_pb2.SUBMISSION_STATUS_QUEUED)
        self.assertEqual(get(self.stub, p2).status, common_pb2.SUBMISSION_STATUS_QUEUED)
        # a second call does not skip over the compact either
        self.assertEqual(claim_joinable(self.stub, c.fence), [])

        settle(self.stub, c.fence)
        # the joining prompt went back to the queue when its host settled (never finalized):
        # it runs next, then the compact, then the last prompt
        c1 = claim(self.stub, conversation_id='cj-a')
        self.assertEqual(c1.submission.submission_id, p1)
        self.assertEqual(claim_joinable(self.stub, c1.fence), [])
        settle(self.stub, c1.fence)

        cc = claim(self.stub, conversation_id='cj-a')
        self.assertEqual(cc.submission.submission_id, comp)
        self.assertEqual(cc.submission.kind, common_pb2.SUBMISSION_KIND_COMPACT)
        self.assertFalse(cc.submission.HasField('message'))
        # nothing joins a running compact
        self.assertEqual(claim_joinable(self.stub, cc.fence), [])
        self.assertEqual(get(self.stub, p2).status, common_pb2.SUBMISSION_STATUS_QUEUED)
        settle(self.stub, cc.fence)

        c2 = claim(self.stub, conversation_id='cj-a')
        self.assertEqual(c2.submission.submission_id, p2)

    def test_compact_right_behind_host_is_never_joined(self):
        """The compact is the head of the queued run: ClaimJoinable returns nothing, even
        with prompts queued behind it."""
        host, comp, p1 = self.admit_ids('cj-b', ['prompt', 'compact', 'prompt'])
        c = self.claim_id(host)
        self.assertEqual(claim_joinable(self.stub, c.fence), [])
        self.assertEqual(claim_joinable(self.stub, c.fence, limit=5), [])
        for s in (comp, p1):
            row = get(self.stub, s)
            self.assertEqual(row.status, common_pb2.SUBMISSION_STATUS_QUEUED)
            self.assertEqual(row.joined_into, '')

    def test_other_kinds_still_join(self):
        """Only cflue.kind=compact is kept out: other metadata joins as before."""
        host, p1, p2 = self.admit_ids('cj-c', ['prompt', 'prompt', 'prompt'])
        c = self.claim_id(host)
        self.assertEqual([s.submission_id for s in claim_joinable(self.stub, c.fence)],
                         [p1, p2])


if __name__ == '__main__':
    unittest.main()
