"""A drive's first steps: the conversation read page by page, and one call to toold
(agentd/drive_store.c, agentd/prompt.c).

A later submission of a conversation of 2,500 records (three Read pages) is driven on the
whole conversation: the system prompt in force is the one recorded last, on the last page,
and the model is asked with it; no new prompt is composed. storaged gone in the middle of
that reading for longer than the retry window ends the attempt interrupted (the page tried
again on a timer meanwhile); once it is back the work resumes and settles once.

The tool set, the project notes and the working directory's listing come in one
Sandbox.Glance that holds no engine thread: toold (CFLUE_RPC_STATS=1, its per-method counts
logged when it stops) serves one Glance per drive and no Tools.List, ReadFile or ReadDir. A
tool server in front of toold whose Glance does not list the tools, or that has no Glance at
all, is read with the older calls, and the conversation gets the same system prompt, word for
word, as from toold itself.
"""
import json
import os
import re
import sys
import time
import unittest
from concurrent import futures

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import BenchBrainStack, body_of, read_all  # noqa: E402
from cflue_harness import admit, append, claim, record, settle  # noqa: E402
from cflue_harness import common_pb2, sandbox_pb2  # noqa: E402

AGENT = BenchBrainStack.AGENT
COMPLETED = common_pb2.OUTCOME_COMPLETED


class Stack(BenchBrainStack):
    """BenchBrainStack with toold counting its calls, project notes in the workspace, and no
    agentd yet (start_agentd)."""

    NOTES = '# Project notes\n\nThe bench reads big.txt.\n'

    def __init__(self):
        super(Stack, self).__init__(0, 'a line of the file the bench brain reads\n' * 100,
                                    n_agentd=0, tool_env={'CFLUE_RPC_STATS': '1'},
                                    prefix='cflue-prompt-it-')
        with open(os.path.join(self.td.workspace('bench'), 'AGENTS.md'), 'w') as f:
            f.write(self.NOTES)

    def start_agentd(self, tools_target):
        """One agentd whose agent reaches its tools at tools_target."""
        path = os.path.join(self.agents, self.AGENT + '.md')
        with open(path) as f:
            text = f.read()
        with open(path, 'w') as f:
            f.write(re.sub(r'tools: "[^"]*"', 'tools: "%s"' % tools_target, text))
        self.ad = self.add_agentd()
        return self.ad

    def tool_counts(self):
        """Stops toold; returns its {method path: calls}."""
        self.td.stop()
        counts = {}
        for m in re.finditer(r'event=rpc_stats method=(\S+) calls=(\d+)', self.td.stderr_text()):
            counts[m.group(1)] = int(m.group(2))
        if not counts:
            raise AssertionError('toold logged no rpc_stats\n' + self.td.stderr_text())
        return counts


class OlderToolServer(object):
    """A tool server in front of toold that forwards every call as bytes, except Glance:
    mode 'no_tools' answers it without the tool set (a toold from before list_tools), mode
    'unimplemented' has none (UNIMPLEMENTED), mode 'own_set' offers a tool set of its own
    (toold's without grep and glob, and a `query` tool): a sandbox for another environment."""

    def __init__(self, toold_target, mode):
        self.mode = mode
        self.upstream = grpc.insecure_channel(toold_target)
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port('127.0.0.1:0')
        self.target = '127.0.0.1:%d' % self.port
        self.server.start()

    def service(self, details):
        method = details.method
        if method.endswith('ExecuteBatch'):
            forward = self.upstream.unary_stream(method)
            return grpc.unary_stream_rpc_method_handler(
                lambda req, ctx: forward(req, timeout=60))
        forward = self.upstream.unary_unary(method)

        def unary(req, ctx):
            if method == '/cflue.v1.Sandbox/Glance':
                if self.mode == 'unimplemented':
                    ctx.abort(grpc.StatusCode.UNIMPLEMENTED, 'no Glance here')
                g = sandbox_pb2.GlanceResponse.FromString(forward(req, timeout=10))
                if self.mode == 'own_set':
                    kept = [t for t in g.tools if t.name not in ('grep', 'glob')]
                    del g.tools[:]
                    g.tools.extend(kept)
                    g.tools.add(name='query', description='Runs a query against the '
                                'environment\'s database.', parameters_json=json.dumps(
                                    {'type': 'object', 'properties': {'sql': {'type': 'string'}},
                                     'required': ['sql']}))
                else:
                    del g.tools[:]
                return g.SerializeToString()
            return forward(req, timeout=60)
        return grpc.unary_unary_rpc_method_handler(unary)

    def close(self):
        self.server.stop(None)
        self.upstream.close()


def converse(ad, conversation_id=''):
    """One submission to the bench agent, waited for; returns the settled submission."""
    adm = ad.submit(AGENT, 'run the steps you are given', conversation_id=conversation_id)
    sub = ad.get_submission(adm.submission_id, wait=True, timeout=60)
    return sub


def system_prompts(stack, conversation_id):
    return [body.text for kind, body in
            (body_of(r) for r in read_all(stack.sd.stub, conversation_id))
            if kind == 'system_prompt']


class FirstStepTest(unittest.TestCase):
    def setUp(self):
        self.stack = Stack()

    def tearDown(self):
        self.stack.remove()

    def test_one_glance_per_drive_and_no_other_call_before_the_first_turn(self):
        ad = self.stack.start_agentd(self.stack.td.target)
        first = converse(ad)
        self.assertEqual(first.outcome, COMPLETED, first.error)
        # a later submission of the conversation keeps its frozen prompt
        again = converse(ad, first.conversation_id)
        self.assertEqual(again.outcome, COMPLETED, again.error)
        others = [converse(ad) for _ in range(2)]
        for s in others:
            self.assertEqual(s.outcome, COMPLETED, s.error)
        prompts = system_prompts(self.stack, first.conversation_id)
        self.assertEqual(len(prompts), 1, prompts)
        self.assertIn('The bench reads big.txt.', prompts[0])
        self.assertIn('big.txt', prompts[0].split('## Environment')[1])
        for name in ('read', 'write', 'edit', 'bash', 'grep', 'glob'):
            self.assertIn('\n- %s: ' % name, prompts[0])
        ad.stop()
        counts = self.stack.tool_counts()
        self.assertEqual(counts.get('/cflue.v1.Sandbox/Glance'), 4, counts)
        for m in ('/cflue.v1.Tools/List', '/cflue.v1.Sandbox/ReadFile',
                  '/cflue.v1.Sandbox/ReadDir'):
            self.assertEqual(counts.get(m, 0), 0, counts)
        # bash, then read: two batches per drive
        self.assertEqual(counts.get('/cflue.v1.Tools/ExecuteBatch'), 8, counts)

    def same_prompt_through(self, mode, calls):
        ad = self.stack.start_agentd(self.stack.td.target)
        direct = converse(ad)
        self.assertEqual(direct.outcome, COMPLETED, direct.error)
        ad.stop()
        older = OlderToolServer(self.stack.td.target, mode)
        try:
            ad = self.stack.start_agentd(older.target)
            through = converse(ad)
            self.assertEqual(through.outcome, COMPLETED, through.error)
            ad.stop()
        finally:
            older.close()
        self.assertEqual(system_prompts(self.stack, through.conversation_id),
                         system_prompts(self.stack, direct.conversation_id))
        counts = self.stack.tool_counts()
        calls['/cflue.v1.Tools/ExecuteBatch'] = 4  # each conversation's two, none again
        for m, n in calls.items():
            self.assertEqual(counts.get(m, 0), n, (m, counts))

    def test_a_glance_without_the_tool_set_is_followed_by_tools_list(self):
        self.same_prompt_through('no_tools', {'/cflue.v1.Sandbox/Glance': 2,
                                              '/cflue.v1.Tools/List': 1})

    def test_the_tool_set_is_the_sandbox_servers_own(self):
        server = OlderToolServer(self.stack.td.target, 'own_set')
        try:
            ad = self.stack.start_agentd(server.target)
            sub = converse(ad)  # the bench brain calls bash and read: both still offered
            self.assertEqual(sub.outcome, COMPLETED, sub.error)
            ad.stop()
        finally:
            server.close()
        reqs = self.stack.fm.requests()
        self.assertTrue(reqs)
        for e in reqs:
            self.assertEqual([t['name'] for t in e['body']['tools']],
                             ['read', 'write', 'edit', 'bash', 'query', 'task'])
        [prompt] = system_prompts(self.stack, sub.conversation_id)
        self.assertIn("\n- query: Runs a query against the environment's database.", prompt)
        self.assertNotIn('\n- grep: ', prompt)

    def test_a_tool_server_without_glance_is_read_with_the_older_calls(self):
        # the notes: AGENTS.md is the first read; the listing: one ReadDir
        self.same_prompt_through('unimplemented', {'/cflue.v1.Sandbox/Glance': 1,
                                                   '/cflue.v1.Tools/List': 1,
                                                   '/cflue.v1.Sandbox/ReadFile': 1,
                                                   '/cflue.v1.Sandbox/ReadDir': 1})


class LongConversationTest(unittest.TestCase):
    def setUp(self):
        self.stack = Stack()

    def tearDown(self):
        self.stack.remove()

    def test_a_later_submission_reads_every_page_of_its_conversation(self):
        stub = self.stack.sd.stub
        seed = admit(stub, agent=AGENT, text='seed').submission
        f = claim(stub, owner='seeder', submission_id=seed.submission_id).fence
        sid = seed.submission_id
        append(stub, f, [record('system_prompt', {'text': 'the first prompt'}, 'system:1', sid),
                         record('user_message', {'text': 'seed'}, 'input:' + sid, sid)])
        for b in range(5):  # 2,500 watcher-only records: three pages of 1,000
            append(stub, f, [record('assistant_delta', {'turn': 1, 'text': 'd%d' % (b * 500 + i)},
                                    'delta:%d' % (b * 500 + i), sid) for i in range(500)])
        # a compaction and the prompt recomposed after it, on the last page
        append(stub, f, [record('assistant_message', {'turn': 1, 'text': 'seeded answer'},
                                'assistant:%s:1' % sid, sid),
                         record('compaction', {'summary': 'the seeded summary',
                                               'first_kept_offset': 2},
                                'compaction:1', sid),
                         record('system_prompt', {'text': 'the prompt in force'}, 'system:2',
                                sid)])
        settle(stub, f)
        ad = self.stack.start_agentd(self.stack.td.target)
        sub = converse(ad, seed.conversation_id)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        self.assertEqual(system_prompts(self.stack, seed.conversation_id),
                         ['the first prompt', 'the prompt in force'])
        asked = self.stack.fm.requests()
        self.assertEqual(len(asked), 3, asked)
        for req in asked:
            self.assertEqual(req['body']['system'], 'the prompt in force', req)
            self.assertIn('the seeded summary', json.dumps(req['body']['messages']))


class ReadOutageTest(unittest.TestCase):
    """storaged gone while a drive reads its conversation (failpoint storaged.reply.Read:
    the page read, the answer never sent), for longer than the retry window (a 3 s lease: a
    5 s window): the attempt ends interrupted, and once storaged is back the work is
    resumed and settles once."""

    def test_storaged_gone_longer_than_the_retry_window_while_the_conversation_is_read(self):
        stack = BenchBrainStack(0, 'a line of the file the bench brain reads\n' * 100,
                                agentd_args=('--lease-ms', '3000'),
                                store_env={'CFLUE_FAILPOINTS': 'storaged.reply.Read=crash'},
                                prefix='cflue-prompt-it-')
        try:
            ad, sd = stack.ad, stack.sd
            first = converse(ad)  # a new conversation: nothing to read
            self.assertEqual(first.outcome, COMPLETED, first.error)
            adm = ad.submit(AGENT, 'and again', conversation_id=first.conversation_id)
            deadline = time.monotonic() + 20
            pat = 'event=drive_interrupted submission=%s' % adm.submission_id
            while pat not in ad.stderr_text():
                self.assertLess(time.monotonic(), deadline, ad.stderr_text())
                time.sleep(0.1)
            self.assertFalse(sd.alive())
            # tried again on a timer until the window was over
            self.assertIn('event=store_retry submission=%s method=Read' % adm.submission_id,
                          ad.stderr_text())
            self.assertIn('failpoint_crash point=storaged.reply.Read', sd.stderr_text())
            self.assertIn('reading the conversation failed', ad.stderr_text())
            del sd.env['CFLUE_FAILPOINTS']
            sd.start()
            deadline = time.monotonic() + 60
            while True:  # agentd's channel reconnects to the new storaged within its backoff
                try:
                    sub = ad.get_submission(adm.submission_id, wait=True, timeout=60)
                    break
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE, e.details())
                    self.assertLess(time.monotonic(), deadline, e.details())
                    time.sleep(0.2)
            self.assertEqual(sub.outcome, COMPLETED, sub.error)
            self.assertGreaterEqual(sub.attempt_count, 2)
            recs = [body_of(r) for r in read_all(sd.stub, first.conversation_id)]
            inputs = [b for k, b in recs if k == 'user_message']
            self.assertEqual([b.text for b in inputs],
                             ['run the steps you are given', 'and again'])
            self.assertEqual(len([1 for k, _ in recs if k == 'submission_settled']), 2)
        finally:
            stack.remove()


if __name__ == '__main__':
    unittest.main()
