"""MCP servers over streamable HTTP (agent definition `mcp:`; agentd/mcp.c): against the real
reference server `@modelcontextprotocol/server-everything` (npm, run on Node.js; scripts/setup
installs it under tests/integration/mcp/), its tools are offered as mcp__<server>__<tool> and
called (text, an error result marked as one, an image recorded with the result and shown to
the model in its tool_result); a server killed during a call gives an error result and a
signal, one unreachable when a submission starts is left out and told. A small MCP server
written here covers what the reference server does not ask of a client: an auth header from
the environment, tools/list pagination, plain JSON answers, a session the server forgot (the
client sets up a new one), and image content that cannot be shown (bad base64, a type no
provider takes) staying a note, next to one that is shown, on the OpenAI wire too. The fake
model plays the agents.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_mcp
"""

import base64
import http.server
import json
import os
import shutil
import threading
import time
import unittest

from test_agentd import COMPLETED, body, kind, new_conv, request_system
from test_agentd_tool_servers import ServersCase, ToolServer, call, free_port, role

HERE = os.path.dirname(os.path.abspath(__file__))
EVERYTHING_JS = os.path.join(HERE, 'mcp', 'node_modules', '@modelcontextprotocol',
                             'server-everything', 'dist', 'index.js')
# gives Node.js 18 (Debian 12's) the global `crypto` the server's sessions need
WEBCRYPTO_CJS = os.path.join(HERE, 'mcp', 'webcrypto.cjs')
TOKEN = 'tok-%d' % os.getpid()
GIF = base64.b64encode(b'GIF89a\x01\x00\x01\x00\x00\x00\x00;').decode()
PICTURES = [{'type': 'text', 'text': 'Three pictures:'},
            {'type': 'image', 'mimeType': 'image/png', 'data': 'iVBOR*not base64*'},
            {'type': 'image', 'mimeType': 'image/svg+xml', 'data': 'PHN2Zy8+'},
            {'type': 'image', 'mimeType': 'image/gif', 'data': GIF}]


def everything():
    """The reference MCP server in its streamable HTTP mode; its URL in .url."""
    node = shutil.which('node')
    if not node or not os.path.exists(EVERYTHING_JS):
        raise AssertionError('the MCP reference server is not installed (%s): run scripts/setup'
                             % EVERYTHING_JS)
    port = free_port()
    server = ToolServer([node, '--require', WEBCRYPTO_CJS, EVERYTHING_JS, 'streamableHttp'], port,
                        env=dict(os.environ, PORT=str(port)))
    server.url = 'http://127.0.0.1:%d/mcp' % port
    return server


class MiniMCP(object):
    """A small MCP server: JSON answers (no event streams), an Authorization header required,
    tools/list in two pages, sessions it can be told to forget."""

    def __init__(self):
        self.sessions = set()
        self.unknown_session = 404  # what it answers a session it does not know
        self.initializes = 0
        self.auth_seen = []
        self.lock = threading.Lock()
        mini = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, code, obj=None, headers=()):
                data = json.dumps(obj).encode() if obj is not None else b''
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                msg = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
                with mini.lock:
                    mini.auth_seen.append(self.headers.get('Authorization'))
                if self.headers.get('Authorization') != 'Bearer ' + TOKEN:
                    return self.answer(401, {'error': 'unauthorized'})
                method, rid = msg.get('method'), msg.get('id')
                if method == 'initialize':
                    with mini.lock:
                        mini.initializes += 1
                        sid = 'sess-%d' % mini.initializes
                        mini.sessions.add(sid)
                    return self.answer(200, {'jsonrpc': '2.0', 'id': rid, 'result': {
                        'protocolVersion': '2025-06-18', 'capabilities': {'tools': {}},
                        'serverInfo': {'name': 'mini', 'version': '1'}}},
                        [('Mcp-Session-Id', sid)])
                with mini.lock:
                    known = self.headers.get('Mcp-Session-Id') in mini.sessions
                if not known:
                    return self.answer(mini.unknown_session, {'error': 'no such session'})
                if method == 'notifications/initialized':
                    return self.answer(202)
                if method == 'tools/list':
                    page2 = (msg.get('params') or {}).get('cursor') == 'page-2'
                    tool = {'name': 'stamp' if page2 else 'lookup',
                            'description': 'A tool of the small test server.',
                            'inputSchema': {'type': 'object',
                                            'properties': {'q': {'type': 'string'}}}}
                    result = {'tools': [tool]}
                    if not page2:
                        result['nextCursor'] = 'page-2'
                    return self.answer(200, {'jsonrpc': '2.0', 'id': rid, 'result': result})
                if method == 'tools/call':
                    p = msg['params']
                    q = p.get('arguments', {}).get('q', '')
                    content = [{'type': 'text', 'text': '%s: %s' % (p['name'], q)}]
                    if q == 'pictures':
                        content = PICTURES
                    return self.answer(200, {'jsonrpc': '2.0', 'id': rid, 'result': {
                        'content': content}})
                return self.answer(200, {'jsonrpc': '2.0', 'id': rid, 'error': {
                    'code': -32601, 'message': 'no method ' + str(method)}})

        self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.url = 'http://127.0.0.1:%d/mcp' % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forget_sessions(self):
        with self.lock:
            self.sessions.clear()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def agent_md(name, servers, model='anthropic/claude-test-1'):
    lines = ''.join('  %s: {url: "%s"%s}\n' % (n, url, extra) for n, url, extra in servers)
    return ('---\nname: %s\ndescription: Uses MCP servers.\nmodel: %s\n'
            'mcp:\n%sdurability:\n  max_attempts: 3\n  timeout_ms: 120000\n---\n\nROLE %s.\n'
            % (name, model, lines, name))


def tool_result_block(req, call_id):
    """The Anthropic tool_result block answering call_id in a logged model request."""
    for m in req['body']['messages']:
        for b in m['content'] if isinstance(m['content'], list) else ():
            if b.get('type') == 'tool_result' and b.get('tool_use_id') == call_id:
                return b
    raise AssertionError('no tool_result for %s in the request' % call_id)


class MCPTest(ServersCase):
    stack_kwargs = {'agents': ('task-scout',), 'with_toold': False}

    @classmethod
    def setUpClass(cls):
        os.environ['CFLUE_TEST_MCP_TOKEN'] = TOKEN  # agentd inherits it (its headers say ${...})
        super(MCPTest, cls).setUpClass()
        cls.servers = []
        try:
            cls.everything = cls._keep(everything())
            cls.fragile = cls._keep(everything())
            cls.mini = cls._keep(MiniMCP())
            gone = 'http://127.0.0.1:%d/mcp' % free_port()
            auth = ', headers: {Authorization: "Bearer ${CFLUE_TEST_MCP_TOKEN}"}'
            cls.install_agents({
                'mcp-user': agent_md('mcp-user', [('everything', cls.everything.url, '')]),
                'mcp-mini': agent_md('mcp-mini', [('mini', cls.mini.url, auth)]),
                'mcp-mini-openai': agent_md('mcp-mini-openai', [('mini', cls.mini.url, auth)],
                                            model='openai/gpt-test-1'),
                'mcp-fragile': agent_md('mcp-fragile', [('ev', cls.fragile.url, '')]),
                'mcp-absent': agent_md('mcp-absent', [('gone', gone, ''),
                                                      ('mini', cls.mini.url, auth)]),
            })
        except BaseException:
            cls.tearDownClass()
            raise

    def run_agent(self, agent, steps, timeout=60, during=None):
        conv = new_conv(agent)
        self.fm.set_scenario(steps)
        seen = len(self.fm.requests())
        sid = self.ad.submit(agent, 'Use your MCP tools.', conversation_id=conv).submission_id
        if during:
            during(conv)
        sub = self.wait_settled(sid, timeout=timeout)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        reqs = [e for e in self.fm.requests()[seen:] if 'ROLE %s.' % agent in request_system(e)]
        recs = self.records(conv)
        results = {}
        for r in recs:
            if kind(r) == 'tool_result':
                results.setdefault(body(r).turn, {})[body(r).index] = body(r)
        return recs, results, reqs

    def test_the_reference_servers_tools_are_offered_and_called(self):
        recs, results, reqs = self.run_agent('mcp-user', [
            role('mcp-user', tool_calls=[call('mcp__everything__echo', message='hello mcp'),
                                         call('mcp__everything__get-sum', a=2, b=3),
                                         call('mcp__everything__get-sum', a=2, b='x'),
                                         call('mcp__everything__get-tiny-image'),
                                         call('mcp__everything__echo', message='and again')]),
            role('mcp-user', text='All five answered.')])
        names = [t['name'] for t in reqs[0]['body']['tools']]
        self.assertEqual(names[0], 'task')
        for n in ('mcp__everything__echo', 'mcp__everything__get-sum',
                  'mcp__everything__get-tiny-image'):
            self.assertIn(n, names)
        self.assertTrue(all(n == 'task' or n.startswith('mcp__everything__') for n in names))
        echo_tool = [t for t in reqs[0]['body']['tools'] if t['name'] == 'mcp__everything__echo']
        self.assertIn('message', json.dumps(echo_tool[0]['input_schema']))
        r = results[1]
        self.assertEqual((r[0].text, r[0].is_error), ('Echo: hello mcp', False))
        self.assertFalse(r[1].is_error, r[1])
        self.assertIn('5', r[1].text)
        self.assertTrue(r[2].is_error, r[2])  # the server's isError
        self.assertIn('expected number', r[2].text)
        self.assertFalse(r[3].is_error, r[3])
        self.assertIn('[image-1 (image/png, ', r[3].text)
        self.assertEqual(len(r[3].images), 1)
        # five calls at once on one session: each answer reached its own call
        self.assertEqual((r[4].text, r[4].is_error), ('Echo: and again', False))
        self.assertFalse([x for x in recs if kind(x) == 'signal'])

    def test_an_image_is_recorded_and_shown_to_the_model(self):
        """get-tiny-image's PNG: the tool_result record holds it (decoded, image/png, named
        image-1) with a line in the text where it was; the next model request shows it as an
        image block of the tool_result's content, after the text."""
        recs, results, reqs = self.run_agent('mcp-user', [
            role('mcp-user', tool_calls=[call('mcp__everything__get-tiny-image')]),
            role('mcp-user', text='I saw the logo.')])
        res = results[1][0]
        self.assertFalse(res.is_error, res)
        self.assertEqual(len(res.images), 1, res)
        img = res.images[0]
        self.assertEqual((img.name, img.mime_type), ('image-1', 'image/png'))
        self.assertTrue(img.data.startswith(b'\x89PNG\r\n\x1a\n'), img.data[:16])
        self.assertEqual(res.text, "Here's the image you requested:\n[image-1 (image/png, %d "
                         "bytes) is shown after this text]\nThe image above is the MCP logo."
                         % len(img.data))
        self.assertEqual(len(reqs), 2)
        call_id = [body(r) for r in recs if kind(r) == 'assistant_message'][0].tool_calls[0].id
        block = tool_result_block(reqs[1], call_id)
        self.assertFalse(block['is_error'])
        text, image = block['content']
        self.assertEqual(text, {'type': 'text', 'text': res.text})
        self.assertEqual(image['type'], 'image')
        self.assertEqual((image['source']['type'], image['source']['media_type']),
                         ('base64', 'image/png'))
        self.assertEqual(base64.b64decode(image['source']['data']), img.data)

    def test_images_that_cannot_be_shown_stay_notes(self):
        """Bad base64 and a type no provider takes are lines of the text saying why; the GIF
        next to them is an image (on the OpenAI wire: the tool message holds the text, and one
        user message after the turn's tool messages shows the image)."""
        for agent in ('mcp-mini', 'mcp-mini-openai'):
            recs, results, reqs = self.run_agent(agent, [
                role(agent, tool_calls=[call('mcp__mini__lookup', q='pictures'),
                                        call('mcp__mini__stamp', q='plain')]),
                role(agent, text='Saw one picture.')])
            res = results[1][0]
            self.assertFalse(res.is_error, res)
            self.assertEqual(res.text.split('\n'), [
                'Three pictures:',
                '[image content (image/png, about 12 bytes) that cannot be shown: its data is '
                'not valid base64]',
                '[image content (image/svg+xml, about 6 bytes) that cannot be shown: only PNG, '
                'JPEG, GIF and WebP images can be shown]',
                '[image-1 (image/gif, 14 bytes) is shown after this text]'])
            self.assertEqual([(i.name, i.mime_type, i.data) for i in res.images],
                             [('image-1', 'image/gif', base64.b64decode(GIF))])
            self.assertEqual((results[1][1].text, len(results[1][1].images)), ('stamp: plain', 0))
            ids = [c.id for c in [body(r) for r in recs if kind(r) == 'assistant_message'][0]
                   .tool_calls]
            if agent == 'mcp-mini':
                text, image = tool_result_block(reqs[1], ids[0])['content']
                self.assertEqual(text['text'], res.text)
                self.assertEqual(image['source'], {'type': 'base64', 'media_type': 'image/gif',
                                                   'data': GIF})
                self.assertEqual(tool_result_block(reqs[1], ids[1])['content'], 'stamp: plain')
                continue
            msgs = reqs[1]['body']['messages']
            at = [i for i, m in enumerate(msgs) if m.get('tool_calls')][0]
            self.assertEqual([(m['role'], m.get('tool_call_id'), m['content'])
                              for m in msgs[at + 1:at + 3]],
                             [('tool', ids[0], res.text), ('tool', ids[1], 'stamp: plain')])
            shown = msgs[at + 3]
            self.assertEqual(shown['role'], 'user')
            self.assertEqual(shown['content'], [
                {'type': 'text', 'text': 'Images returned by the tool calls above:'},
                {'type': 'text', 'text': 'From mcp__mini__lookup (call %s):' % ids[0]},
                {'type': 'image_url', 'image_url': {'url': 'data:image/gif;base64,' + GIF}}])
            self.assertEqual(len(msgs), at + 4)

    def test_auth_header_pages_json_answers_and_a_forgotten_session(self):
        steps = [role('mcp-mini', tool_calls=[call('mcp__mini__lookup', q='first'),
                                              call('mcp__mini__stamp', q='page two')]),
                 role('mcp-mini', text='Both ran.')]
        _, results, _ = self.run_agent('mcp-mini', steps)
        self.assertEqual(results[1][0].text, 'lookup: first')
        self.assertEqual(results[1][1].text, 'stamp: page two')  # listed on the second page
        self.assertTrue(self.mini.auth_seen)
        self.assertEqual(set(self.mini.auth_seen), {'Bearer ' + TOKEN})
        before = self.mini.initializes
        self.mini.forget_sessions()  # the next request meets HTTP 404: a new session is made
        _, results, _ = self.run_agent('mcp-mini', [
            role('mcp-mini', tool_calls=[call('mcp__mini__lookup', q='again')]),
            role('mcp-mini', text='Ran again.')])
        self.assertEqual(results[1][0].text, 'lookup: again')
        self.assertEqual(self.mini.initializes, before + 1)
        # a server that answers an unknown session 400 (as the reference server does after a
        # restart) gets a new one too, instead of failing every call until agentd restarts
        self.mini.unknown_session = 400
        self.mini.forget_sessions()
        try:
            _, results, _ = self.run_agent('mcp-mini', [
                role('mcp-mini', tool_calls=[call('mcp__mini__lookup', q='after 400')]),
                role('mcp-mini', text='Ran after the 400.')])
        finally:
            self.mini.unknown_session = 404
        self.assertEqual(results[1][0].text, 'lookup: after 400')
        self.assertEqual(self.mini.initializes, before + 2)

    def test_a_server_killed_during_a_call_gives_an_error_result_and_a_signal(self):
        def kill_during_the_call(conv):
            def started():
                return any(kind(r) == 'assistant_message' and body(r).tool_calls
                           for r in self.records(conv))
            deadline = time.monotonic() + 30
            while not started() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # the call is at the server, which works for 20 s
            self.fragile.kill()

        recs, results, reqs = self.run_agent('mcp-fragile', [
            role('mcp-fragile', tool_calls=[
                call('mcp__ev__trigger-long-running-operation', duration=20, steps=2)]),
            role('mcp-fragile', text='The long operation failed.')],
            during=kill_during_the_call)
        res = results[1][0]
        self.assertTrue(res.is_error, res)
        self.assertIn('The MCP server "ev" failed before answering this call', res.text)
        [sig] = [body(r) for r in recs if kind(r) == 'signal']
        self.assertEqual(sig.kind, 'resources')
        self.assertIn('The MCP server "ev" stopped answering', sig.text)
        self.assertIn('stopped answering', json.dumps(reqs[-1]['body']['messages']))

    def test_a_server_unreachable_at_the_start_is_left_out_and_told(self):
        recs, results, reqs = self.run_agent('mcp-absent', [
            role('mcp-absent', tool_calls=[call('mcp__mini__lookup', q='still here')]),
            role('mcp-absent', text='One server was missing.')])
        names = [t['name'] for t in reqs[0]['body']['tools']]
        self.assertEqual(names, ['task', 'mcp__mini__lookup', 'mcp__mini__stamp'])
        [sig] = [body(r) for r in recs if kind(r) == 'signal']
        self.assertIn('The MCP server "gone" cannot be reached for this message', sig.text)
        self.assertEqual(results[1][0].text, 'lookup: still here')


if __name__ == '__main__':
    unittest.main()
