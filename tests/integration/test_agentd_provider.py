"""agentd against a model server that misbehaves: answers the providers' real APIs would never
send but a proxy, an OpenAI-compatible server or a broken network might. Real storaged,
toold and agentd; the fake model (tests/fake_model) sends each answer as a step gives it,
raw SSE included ("garbage"). Each test names what happened before its fix.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v test_agentd_provider
"""

import json
import time
import unittest

from test_agentd import (AgentdCase, FAILED, bind, body, kind, new_conv,
                         outcome_name)

STALL_MS = 2000  # agentd's --model-stall-ms here: a stream with no content this long is given up


def sse(events):
    """Anthropic's stream: each (type, data) as an `event:` and its JSON `data:`."""
    return ''.join('event: %s\ndata: %s\n\n' % (t, json.dumps(dict(d, type=t)))
                   for t, d in events)


def message_start(input_tokens=1):
    """Anthropic's first event of a stream."""
    return ('message_start', {'message': {'id': 'msg_x', 'type': 'message', 'role': 'assistant',
                                          'model': 'claude-test-1', 'content': [],
                                          'usage': {'input_tokens': input_tokens,
                                                    'output_tokens': 1}}})


def anthropic_calls(calls, usage=None):
    """An Anthropic stream whose answer is the tool calls (id, name, input), one block each."""
    ev = [message_start(10)]
    for i, (cid, name, args) in enumerate(calls):
        block = {'type': 'tool_use', 'name': name, 'input': {}}
        if cid is not None:
            block['id'] = cid
        ev += [('content_block_start', {'index': i, 'content_block': block}),
               ('content_block_delta', {'index': i, 'delta': {
                   'type': 'input_json_delta', 'partial_json': json.dumps(args)}}),
               ('content_block_stop', {'index': i})]
    ev += [('message_delta', {'delta': {'stop_reason': 'tool_use'},
                              'usage': usage or {'output_tokens': 5}}),
           ('message_stop', {})]
    return sse(ev)


def openai_chunks(chunks):
    """An OpenAI stream of the chunks' deltas (each chunk a dict merged into a choice)."""
    out = ''
    for c in chunks:
        out += 'data: %s\n\n' % json.dumps(dict({
            'id': 'chatcmpl-x', 'object': 'chat.completion.chunk', 'created': 0,
            'model': 'gpt-test-1'}, **c))
    return out + 'data: [DONE]\n\n'


def bash(command):
    return {'command': command}


class HostileModelTest(AgentdCase):
    stack_kwargs = {'agents': ('runner-anthropic', 'runner-openai', 'brief'),
                    'agentd_args': ['--model-stall-ms', str(STALL_MS)]}

    def run_steps(self, agent, steps, text='go', timeout=30):
        conv = new_conv('hostile')
        self.workspace(conv)
        self.fm.set_scenario(bind(steps, conv))
        t0 = time.monotonic()
        sid = self.ad.submit(agent, text, conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=timeout)
        return sub, self.records(conv), time.monotonic() - t0

    def test_repeated_and_missing_call_ids_and_bad_usage_are_mended(self):
        """Two calls with one id (then none), output tokens of -5: storaged refused the answer,
        the user's message and the system prompt held with it were never stored, and the
        submission failed. Each call gets an id of its own, the usage is taken as 0."""
        stream = anthropic_calls([('dup', 'bash', bash('echo one')),
                                  ('dup', 'bash', bash('echo two')),
                                  (None, 'bash', bash('echo three'))],
                                 usage={'output_tokens': -5})
        sub, recs, _ = self.run_steps('runner-anthropic', [
            {'garbage': stream}, {'text': 'All three ran.'}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(kind(recs[0]), 'user_message')
        answer = [body(r) for r in recs if kind(r) == 'assistant_message'][0]
        ids = [c.id for c in answer.tool_calls]
        self.assertEqual(ids[0], 'dup')
        self.assertEqual(len(set(ids)), 3, ids)
        self.assertTrue(all(ids), ids)
        self.assertEqual(answer.usage.output_tokens, 0)
        results = sorted((body(r).tool_call_id, body(r).text.strip()) for r in recs
                         if kind(r) == 'tool_result')
        self.assertEqual(sorted(t for _, t in results), ['one', 'three', 'two'])
        self.assertEqual(sorted(i for i, _ in results), sorted(ids))

    def test_openai_calls_without_ids_and_a_null_error_field(self):
        """An OpenAI-compatible server whose tool call has no id, and whose chunks carry
        "error": null: the call failed (storaged refused the id), and a null error was taken
        for a stream error, asked again to the retry limit."""
        stream = openai_chunks([
            {'error': None, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'tool_calls': [
                {'index': 0, 'type': 'function',
                 'function': {'name': 'bash', 'arguments': json.dumps(bash('echo ok'))}}]}}]},
            {'error': None, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'tool_calls'}]},
        ])
        sub, recs, _ = self.run_steps('runner-openai', [{'garbage': stream}, {'text': 'Ran.'}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        [res] = [body(r) for r in recs if kind(r) == 'tool_result']
        self.assertTrue(res.tool_call_id)
        self.assertEqual(res.text.strip(), 'ok')

    def test_interleaved_tool_blocks_are_a_bad_answer(self):
        """Two tool_use blocks open at once, their inputs interleaved: the first call ran with
        both inputs run together (invalid JSON), the second with none. A stream the API never
        sends is a bad answer now; no tool runs."""
        stream = sse([
            message_start(),
            ('content_block_start', {'index': 0, 'content_block': {
                'type': 'tool_use', 'id': 'c0', 'name': 'bash', 'input': {}}}),
            ('content_block_start', {'index': 1, 'content_block': {
                'type': 'tool_use', 'id': 'c1', 'name': 'bash', 'input': {}}}),
            ('content_block_delta', {'index': 0, 'delta': {
                'type': 'input_json_delta', 'partial_json': '{"command": "echo zero"}'}}),
            ('content_block_delta', {'index': 1, 'delta': {
                'type': 'input_json_delta', 'partial_json': '{"command": "echo one"}'}}),
            ('content_block_stop', {'index': 0}), ('content_block_stop', {'index': 1}),
            ('message_delta', {'delta': {'stop_reason': 'tool_use'}}), ('message_stop', {})])
        sub, recs, _ = self.run_steps('runner-anthropic', [{'garbage': stream}])
        self.assertEqual(outcome_name(sub.outcome), 'FAILED')
        self.assertIn('before block 0 stopped', sub.error)
        self.assertFalse([r for r in recs if kind(r) == 'tool_result'])

    def test_a_stream_kept_open_after_its_last_event_ends_there(self):
        """A server that sends the whole answer, then keep-alives for 20 s without ending the
        response: the call lasted until the server stopped (or the stall bound passed)."""
        sub, _, took = self.run_steps('runner-anthropic', [
            {'text': 'Done early.', 'keepalive': {'at': 'end', 'every_ms': 300,
                                                  'for_ms': 20000}}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertLess(took, 8)

    def test_keep_alives_without_content_are_a_stall(self):
        """Pings every 300 ms and nothing else: libcurl's speed bound counted their bytes, and
        the call lasted as long as the server kept it up (the model timeout, 10 minutes, for
        each try). After five times --model-stall-ms of them the try is given up and asked
        again."""
        sub, recs, took = self.run_steps('runner-anthropic', [
            {'text': 'never', 'keepalive': {'at': 'start', 'every_ms': 300, 'for_ms': 30000,
                                            'ping': True}},
            {'text': 'Second try.'}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertLess(took, 20)
        [answer] = [body(r) for r in recs if kind(r) == 'assistant_message']
        self.assertEqual(answer.text, 'Second try.')
        self.assertIn('nothing but keep-alives', self.ad.stderr_text())

    def test_the_time_limit_inside_a_transfer_says_so(self):
        """The 'brief' agent's 4 s run out during the model call (keep-alives meanwhile): the
        submission failed as a broken connection ("Operation timed out ... past the time
        limit")."""
        keep = {'at': 'start', 'every_ms': 300, 'for_ms': 30000}
        sub, _, _ = self.run_steps('brief', [{'text': 'never', 'keepalive': keep},
                                             {'text': 'never', 'keepalive': keep}])
        self.assertEqual(sub.outcome, FAILED)
        self.assertEqual(sub.error, 'ran past its time limit before the work was finished')

    def test_only_a_context_overflow_compacts(self):
        """A 400 whose message only has the word "maximum" (a schema's) was taken for a
        context overflow: the conversation compacted (a summary call, its history replaced)
        before the submission failed anyway."""
        before = self.ad.stderr_text().count('reason=overflow')
        sub, _, _ = self.run_steps('runner-anthropic', [
            {'error': {'status': 400, 'type': 'invalid_request_error',
                       'message': 'tools.0.input_schema: maximum must be a number'}}])
        self.assertEqual(outcome_name(sub.outcome), 'FAILED')
        self.assertIn('maximum must be a number', sub.error)
        self.assertEqual(self.ad.stderr_text().count('reason=overflow'), before)

    def test_the_providers_overflow_errors_compact(self):
        """An OpenAI-style error that says so in its code alone (context_length_exceeded) was
        not taken for an overflow: no compaction was tried. Anthropic's "input length and
        `max_tokens` exceed context limit" (the estimate a little short) must stay one. With
        nothing to compact, the turn is asked once more, fitted tighter; a second overflow
        fails it."""
        for agent, err in (
                ('runner-anthropic', {'status': 400, 'type': 'invalid_request_error',
                                      'message': 'input length and `max_tokens` exceed context '
                                                 'limit: 199759 + 8192 > 200000'}),
                ('runner-openai', {'status': 400, 'type': 'invalid_request_error',
                                   'code': 'context_length_exceeded',
                                   'message': 'Your input is too large for this model.'})):
            with self.subTest(agent=agent):
                before = self.ad.stderr_text().count('reason=overflow')
                tightened = self.ad.stderr_text().count('context_fit_tightened')
                sub, _, _ = self.run_steps(agent, [{'error': err}, {'error': err}])
                self.assertEqual(outcome_name(sub.outcome), 'FAILED')
                self.assertEqual(self.ad.stderr_text().count('reason=overflow'), before + 1)
                self.assertEqual(self.ad.stderr_text().count('context_fit_tightened'),
                                 tightened + 1)

    def test_a_server_tools_input_is_not_ours(self):
        """A block of another kind (a server tool's, as a proxy may add) streams input too:
        it is left alone, not refused."""
        stream = sse([
            message_start(),
            ('content_block_start', {'index': 0, 'content_block': {
                'type': 'server_tool_use', 'id': 'srv_1', 'name': 'web_search', 'input': {}}}),
            ('content_block_delta', {'index': 0, 'delta': {
                'type': 'input_json_delta', 'partial_json': '{"query": "x"}'}}),
            ('content_block_stop', {'index': 0}),
            ('content_block_start', {'index': 1, 'content_block': {'type': 'text', 'text': ''}}),
            ('content_block_delta', {'index': 1, 'delta': {'type': 'text_delta',
                                                           'text': 'Searched.'}}),
            ('content_block_stop', {'index': 1}),
            ('message_delta', {'delta': {'stop_reason': 'end_turn'}}), ('message_stop', {})])
        sub, recs, _ = self.run_steps('runner-anthropic', [{'garbage': stream}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        [answer] = [body(r) for r in recs if kind(r) == 'assistant_message']
        self.assertEqual((answer.text, len(answer.tool_calls)), ('Searched.', 0))

    def test_a_long_error_page_is_still_retried(self):
        """A 503 with a 17 MiB HTML page: the body passed agentd's bound and the call failed
        for good. Only the page's start is kept now; a 503 is asked again."""
        sub, _, _ = self.run_steps('runner-anthropic', [
            {'error': {'status': 503, 'body': '<html>' + 'x' * (17 << 20),
                       'content_type': 'text/html'}},
            {'text': 'Back.'}], timeout=60)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)

    def test_an_error_body_answering_a_stream_is_retried(self):
        """{"type": "error", "error": {"type": "overloaded_error"}} as JSON with status 200
        to a streaming request failed the submission ("not a message"): an overload is
        asked again."""
        sub, _, _ = self.run_steps('runner-anthropic', [
            {'garbage': json.dumps({'type': 'error', 'error': {
                'type': 'overloaded_error', 'message': 'Overloaded'}}),
             'content_type': 'application/json'},
            {'text': 'Fine now.'}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)

    def test_a_retried_turn_restarts_its_deltas(self):
        """A stream that broke off after some text is asked again: the first try's deltas
        stayed in the stream, and a watcher showed them run into the second try's text. The
        first delta of each try is marked restart."""
        first = ' '.join('first%02d' % i for i in range(100))  # 20 events of text
        second = ' '.join('second%02d' % i for i in range(100))
        sub, recs, _ = self.run_steps('runner-anthropic', [
            {'text': first, 'chunk_delay_ms': 60, 'disconnect_after_chunks': 14},
            {'text': second, 'chunk_delay_ms': 60}])
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        deltas = [body(r) for r in recs if kind(r) == 'assistant_delta']
        self.assertTrue(any('first' in d.text for d in deltas), deltas)
        self.assertTrue(deltas[0].restart)
        last = max(i for i, d in enumerate(deltas) if d.restart)
        self.assertGreater(last, 0, [(d.restart, d.text[:30]) for d in deltas])
        shown = ''.join(d.text for d in deltas[last:])
        self.assertTrue(second.startswith(shown), shown)
        [answer] = [body(r) for r in recs if kind(r) == 'assistant_message']
        self.assertEqual(answer.text, second)


if __name__ == '__main__':
    unittest.main()
