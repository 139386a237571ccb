"""The chaos checker's rules on hand-made histories: a clean history has no violation, and
each kind of broken promise is counted in its own category (and nowhere else).

    cd tests/chaos && /usr/bin/python3 -m unittest -v test_checker
"""

import copy
import unittest

import checker

SYS = '## Tools you can call\n- bash\n\n## Environment\nWorking directory: /w/c1'


def sub(sid, seq, outcome='COMPLETED', answered_by=None, conv='c1', **kw):
    s = {'submission_id': sid, 'conversation_id': conv, 'sequence': seq, 'status': 'SETTLED',
         'outcome': outcome, 'error': '', 'answered_by': answered_by or sid, 'joined_into': '',
         'attempt_count': 1, 'max_attempts': 10, 'abort_request_time_ms': 0,
         'settle_time_ms': 1000 + seq}
    s.update(kw)
    return s


class History(object):
    """A clean history: s1 runs two turns (one bash call), s2 joins it, s3 runs alone."""

    def __init__(self):
        self.recs = []
        self.add('input:s1', 'user_message', 's1', 'a1', {'text': 'chaos tag=t1 plan=l'})
        self.add('system:1', 'system_prompt', '', 'a1', {'text': SYS})
        self.add('assistant:s1:0', 'assistant_message', 's1', 'a1',
                 {'turn': 0, 'tool_calls': [{'id': 'x1', 'name': 'bash'}]})
        self.add('tool:s1:0:x1', 'tool_result', 's1', 'a1', {'tool_call_id': 'x1'})
        self.add('input:s2', 'user_message', 's2', 'a1', {'text': 'chaos tag=t2 plan=l'})
        self.add('assistant:s1:1', 'assistant_message', 's1', 'a1',
                 {'turn': 1, 'tool_calls': [], 'text': 'done'})
        self.add('settled:s1', 'submission_settled', 's1', 'a1', {'outcome': 'COMPLETED'})
        self.add('settled:s2', 'submission_settled', 's2', 'a1', {'outcome': 'COMPLETED'})
        self.add('input:s3', 'user_message', 's3', 'a2', {'text': 'chaos tag=t3 plan='})
        self.add('assistant:s3:0', 'assistant_message', 's3', 'a2',
                 {'turn': 0, 'tool_calls': [], 'text': 'done'})
        self.add('settled:s3', 'submission_settled', 's3', 'a2', {'outcome': 'COMPLETED'})
        self.subs = {'s1': sub('s1', 1), 's2': sub('s2', 2, answered_by='s1'),
                     's3': sub('s3', 3)}
        self.acks = [{'key': 'k%d' % i, 'tag': 't%d' % i, 'conv': 'c1', 'sid': 's%d' % i,
                      'dedup': False, 'retried': False, 'resend': False} for i in (1, 2, 3)]
        self.side = {'c1': ['x1 t1 0']}

    def add(self, rid, rtype, sid, att, body, ts=None):
        self.recs.append({'offset': len(self.recs), 'id': rid, 'type': rtype,
                          'submission_id': sid, 'attempt_id': att,
                          'create_time_ms': ts if ts is not None else 100 + len(self.recs),
                          'body': body})

    def renumber(self):
        for i, r in enumerate(self.recs):
            r['offset'] = i

    def find(self, rid):
        return [r for r in self.recs if r['id'] == rid][0]

    def check(self, **kw):
        v, notes = checker.check(self.acks, self.subs, {'c1': self.recs}, self.side, **kw)
        return {k: x for k, x in v.items() if x}, notes


class CheckerTest(unittest.TestCase):

    def only(self, h, category, **kw):
        v, _ = h.check(**kw)
        self.assertEqual(sorted(v), [category], v)
        return v[category]

    def test_clean_history_has_no_violation(self):
        v, notes = History().check(watched={'c1': [(0, 'input:s1'), (1, 'system:1')]})
        self.assertEqual(v, {})
        self.assertEqual(dict(notes), {})

    def test_lost(self):
        h = History()
        h.acks.append({'key': 'k9', 'tag': 't9', 'conv': 'c1', 'sid': 's9', 'dedup': False,
                       'retried': False, 'resend': False})
        self.assertIn('s9', self.only(h, 'lost')[0])

    def test_unsettled(self):
        self.only(History(), 'unsettled', unsettled_after_bound=['s3'])

    def test_settled_twice(self):
        h = History()
        h.add('settled:s3b', 'submission_settled', 's3', 'a2', {'outcome': 'COMPLETED'})
        self.only(h, 'settled_twice')

    def test_settled_without_admission(self):
        h = History()
        h.add('settled:s7', 'submission_settled', 's7', 'a2', {'outcome': 'FAILED'})
        self.only(h, 'settled_without_admission')

    def test_settlement_mismatch(self):
        h = History()
        h.find('settled:s3')['body']['outcome'] = 'FAILED'
        self.only(h, 'settlement_mismatch')

    def test_false_completed_pending_call(self):
        # defect 1: the host's last assistant message asks for a tool and has no result
        h = History()
        h.find('assistant:s3:0')['body']['tool_calls'] = [{'id': 'x3', 'name': 'bash'}]
        errs = self.only(h, 'outcome_false')
        self.assertTrue(any('asks for 1 tool call' in e for e in errs), errs)
        self.assertTrue(any('x3' in e and 'no tool_result' in e for e in errs), errs)

    def test_false_completed_joined_member(self):
        # the member completes with its host; a host that failed is no answer
        h = History()
        h.subs['s1']['outcome'] = 'FAILED'
        h.find('settled:s1')['body']['outcome'] = 'FAILED'
        errs = self.only(h, 'outcome_false')
        self.assertTrue(any(e.startswith('s2 ') for e in errs), errs)

    def test_false_completed_input_after_answer(self):
        h = History()
        rec = h.find('input:s2')
        h.recs.remove(rec)
        h.recs.insert(h.recs.index(h.find('settled:s1')), rec)
        h.renumber()
        self.assertIn('came after the final answer', self.only(h, 'outcome_false')[0])

    def test_outcome_unknown_result_is_a_result(self):
        h = History()
        # "whether it took effect is unknown"
        h.find('tool:s1:0:x1')['body'].update(is_error=True, outcome_unknown=True)
        self.assertEqual(h.check()[0], {})

    def test_untyped_record(self):
        h = History()
        h.add('odd:1', None, 's3', 'a2', {})
        self.only(h, 'untyped_record')

    def test_model_without_tools(self):
        h = History()
        h.find('assistant:s3:0')['body']['text'] = 'CHAOS-NO-TOOLS: no bash'
        self.only(h, 'model_without_tools')

    def test_partial_system_prompt(self):
        h = History()
        h.find('system:1')['body']['text'] = 'You follow the plan.'
        self.only(h, 'partial_system_prompt')

    def test_order_of_settlements(self):
        h = History()
        a, b = h.find('settled:s1'), h.find('settled:s2')
        i, j = h.recs.index(a), h.recs.index(b)
        h.recs[i], h.recs[j] = b, a
        h.renumber()
        self.only(h, 'order')

    def test_stale_write(self):
        h = History()
        h.add('assistant_delta:x', 'assistant_delta', 's1', 'a1', {})
        self.only(h, 'stale_write')

    def test_queued_settlement_without_attempt_is_no_stale_write(self):
        h = History()
        h.subs['s4'] = sub('s4', 4, outcome='FAILED')
        h.add('settled:s4', 'submission_settled', 's4', '', {'outcome': 'FAILED'})
        h.add('settled:s4x', 'assistant_delta', 's3', 'a2', {})  # a2 again after no attempt
        self.assertEqual(h.check()[0], {})

    def test_tool_rerun(self):
        h = History()
        h.side['c1'].append('x1 t1 0')
        self.only(h, 'tool_rerun')

    def test_abort_not_honoured(self):
        h = History()
        h.subs['s3']['abort_request_time_ms'] = 50  # stamped long before the answer (111)
        h.find('assistant:s3:0')['create_time_ms'] = 50 + checker.ABORT_NOTICE_MS + 1
        self.only(h, 'abort_not_honoured')

    def test_abort_after_the_answer_keeps_completed(self):
        h = History()
        h.subs['s3']['abort_request_time_ms'] = h.find('assistant:s3:0')['create_time_ms'] + 5
        self.assertEqual(h.check()[0], {})

    def test_abort_honoured(self):
        h = History()
        h.subs['s3'].update(outcome='ABORTED', abort_request_time_ms=50)
        h.find('settled:s3')['body']['outcome'] = 'ABORTED'
        self.assertEqual(h.check()[0], {})

    def test_dedupe(self):
        h = History()
        h.acks.append(dict(h.acks[0], dedup=True, resend=True))
        self.assertEqual(h.check()[0], {})
        h.acks.append(dict(h.acks[0], sid='s2', dedup=True, resend=True))
        self.only(h, 'dedupe_broken')
        h = History()
        h.acks.append(dict(h.acks[0], dedup=False, resend=True))
        self.only(h, 'dedupe_broken')

    def test_first_ack_deduplicated_after_a_lost_answer(self):
        h = History()
        h.acks[0].update(dedup=True, retried=True)
        self.assertEqual(h.check()[0], {})

    def test_stream_rewritten(self):
        self.only(History(), 'stream_rewritten', watched={'c1': [(0, 'input:other')]})

    def test_each_category_is_documented(self):
        names = [c for c, _ in checker.CATEGORIES]
        self.assertEqual(len(names), len(set(names)))
        h = copy.deepcopy(History())
        self.assertEqual(h.check()[0], {})


if __name__ == '__main__':
    unittest.main()
