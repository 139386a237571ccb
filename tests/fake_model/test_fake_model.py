"""Tests for fake_model.py: both providers' wire formats (streaming through `curl -sN`,
non-streaming through urllib), scripted errors, broken responses, matching, the request log,
SIGTERM, HTTP/1.1 keep-alive with the connection counts of /_stats, and the demo brain driven through a real repair of a temporary copy of
examples/project.

    /usr/bin/python3 -m unittest -v test_fake_model        (from tests/fake_model/)
"""

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FAKE = os.path.join(HERE, "fake_model.py")
EXAMPLE = os.path.join(REPO, "examples", "project")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
BUILD_DIR = os.path.abspath(os.environ.get("CFLUE_BUILD_DIR") or os.path.join(REPO, "build"))
TOOLD = os.path.join(BUILD_DIR, "toold", "toold")
CFLUE = os.path.join(BUILD_DIR, "cli", "cflue")

ANTHROPIC_HEADERS = {"x-api-key": "test-key", "anthropic-version": "2023-06-01",
                     "content-type": "application/json", "accept": "application/json"}
OPENAI_HEADERS = {"authorization": "Bearer test-key", "content-type": "application/json"}

TOOL_SPECS = [
    ("read", "Show a text file", {"path": "string", "offset": "integer", "limit": "integer"},
     ["path"]),
    ("write", "Write a file", {"path": "string", "content": "string"}, ["path", "content"]),
    ("edit", "Replace exact text", {"path": "string", "oldText": "string",
                                    "newText": "string", "replaceAll": "boolean"},
     ["path", "oldText", "newText"]),
    ("bash", "Run a command", {"command": "string", "timeout": "number"}, ["command"]),
    ("grep", "Search files", {"pattern": "string", "path": "string"}, ["pattern"]),
    ("glob", "Find files", {"pattern": "string", "path": "string"}, ["pattern"]),
]


def tools_for(provider):
    out = []
    for name, desc, props, req in TOOL_SPECS:
        schema = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                  "required": req}
        if provider == "anthropic":
            out.append({"name": name, "description": desc, "input_schema": schema})
        else:
            out.append({"type": "function", "function": {"name": name, "description": desc,
                                                         "parameters": schema,
                                                         "strict": False}})
    return out


class FakeModel:
    """fake_model.py in a subprocess on a free port."""

    def __init__(self, tmp, steps=None, extra=()):
        self.log_path = os.path.join(tmp, "requests.jsonl")
        cmd = [PYTHON, FAKE, "--port", "0", "--log", self.log_path, "--quiet"]
        if steps is not None:
            path = os.path.join(tmp, "scenario.json")
            with open(path, "w") as f:
                json.dump({"steps": steps}, f)
            cmd += ["--scenario", path]
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError("fake_model did not start: %r %s" % (line,
                                                                     self.proc.stderr.read()))
        self.port = int(line.split()[2])
        self.base = "http://127.0.0.1:%d" % self.port

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(10)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()
        return rc

    def log(self):
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path) as f:
            return [json.loads(line) for line in f if line.strip()]


# -- clients ------------------------------------------------------------------------------

def post(url, body, headers, raw=None):
    """urllib POST -> (status, headers lowercased, body bytes)."""
    data = raw if raw is not None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def curl(url, body, headers, extra=()):
    """curl -sN POST -> (exit code, stdout text)."""
    cmd = ["curl", "-sN", "-X", "POST", url, "--data-binary", "@-"] + list(extra)
    for k, v in headers.items():
        cmd += ["-H", "%s: %s" % (k, v)]
    p = subprocess.run(cmd, input=json.dumps(body).encode("utf-8"), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=30)
    return p.returncode, p.stdout.decode("utf-8")


def parse_sse(text):
    """SSE text -> [(event or None, data string)], one per blank-line-terminated event."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            else:
                raise AssertionError("unexpected SSE line %r" % line)
        events.append((event, "\n".join(data)))
    return events


def assemble_anthropic(tc, text):
    """Checks an Anthropic event stream's grammar and rebuilds the message from it."""
    events = [(e, json.loads(d)) for e, d in parse_sse(text)]
    for name, data in events:
        tc.assertEqual(name, data["type"])
    names = [e for e, _ in events]
    tc.assertEqual(names[0], "message_start")
    tc.assertEqual(names[-2:], ["message_delta", "message_stop"])
    tc.assertIn("ping", names)
    msg = dict(events[0][1]["message"])
    tc.assertEqual(msg["role"], "assistant")
    tc.assertEqual(msg["content"], [])
    tc.assertIsNone(msg["stop_reason"])
    blocks, open_index, deltas = [], None, {}
    for name, data in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            tc.assertIsNone(open_index, "block started while another is open")
            tc.assertEqual(data["index"], len(blocks))
            open_index = data["index"]
            blocks.append(dict(data["content_block"], _json=""))
            deltas[open_index] = []
        elif name == "content_block_delta":
            tc.assertEqual(data["index"], open_index)
            b, d = blocks[open_index], data["delta"]
            deltas[open_index].append(d)
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] += d["signature"]
            else:
                tc.fail("unknown delta %r" % d)
        elif name == "content_block_stop":
            tc.assertEqual(data["index"], open_index)
            b = blocks[open_index]
            if b["type"] == "tool_use":
                b["input"] = json.loads(b["_json"])
            open_index = None
        else:
            tc.fail("unexpected event %s" % name)
    tc.assertIsNone(open_index)
    for b in blocks:
        del b["_json"]
    md = events[-2][1]
    msg["content"] = blocks
    msg["stop_reason"] = md["delta"]["stop_reason"]
    msg["usage"] = dict(msg["usage"], output_tokens=md["usage"]["output_tokens"])
    return msg, deltas


def assemble_openai(tc, text):
    """Checks an OpenAI chunk stream and rebuilds (message, finish_reason, usage, chunks)."""
    events = parse_sse(text)
    tc.assertTrue(all(e is None for e, _ in events))
    tc.assertEqual(events[-1][1], "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    content, calls, finish, usage = None, {}, None, None
    for i, c in enumerate(chunks):
        tc.assertEqual(c["object"], "chat.completion.chunk")
        tc.assertEqual(c["id"], chunks[0]["id"])
        if c.get("usage"):
            usage = c["usage"]
            tc.assertEqual(c["choices"], [])
            continue
        ch = c["choices"][0]
        tc.assertIsNone(finish, "a chunk after finish_reason")
        d = ch["delta"]
        if i == 0:
            tc.assertEqual(d.get("role"), "assistant")
        if d.get("content"):
            content = (content or "") + d["content"]
        for t in d.get("tool_calls") or []:
            slot = calls.setdefault(t["index"], {"id": None, "name": None, "arguments": "",
                                                 "pieces": 0})
            if "id" in t:
                slot["id"] = t["id"]
                tc.assertEqual(t["type"], "function")
                slot["name"] = t["function"]["name"]
            if t["function"].get("arguments"):
                slot["arguments"] += t["function"]["arguments"]
                slot["pieces"] += 1
        finish = ch["finish_reason"] or finish
    tool_calls = [calls[i] for i in sorted(calls)]
    return {"content": content, "tool_calls": tool_calls}, finish, usage, chunks


def anthropic_body(messages, stream=True, **kw):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 1024, "stream": stream,
            "system": [{"type": "text", "text": "You are a test."}], "messages": messages}
    body.update(kw)
    return body


def openai_body(messages, stream=True, usage=True, **kw):
    body = {"model": "gpt-test", "messages": [{"role": "system", "content": "test"}] + messages}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    body.update(kw)
    return body


USER_HI = [{"role": "user", "content": "hi"}]


class ServerCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fake_model_test.")
        self.servers = []

    def tearDown(self):
        for s in self.servers:
            self.assertEqual(s.stop(), 0, "fake_model did not exit 0 on SIGTERM")
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, steps=None, extra=()):
        s = FakeModel(self.tmp, steps, extra)
        self.servers.append(s)
        return s


# -- wire formats ---------------------------------------------------------------------------

class AnthropicTest(ServerCase):
    ARGS = {"command": "printf 'héllo \"quoted\"\\n' && ls -la /tmp", "timeout": 30}

    def test_stream_text(self):
        fm = self.start([{"text": "The answer is forty-two, as computed by a long process.",
                          "usage": {"input_tokens": 17, "output_tokens": 9}}])
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        self.assertEqual(rc, 0)
        msg, deltas = assemble_anthropic(self, out)
        self.assertEqual(msg["content"], [{"type": "text", "text": "The answer is forty-two, "
                                           "as computed by a long process."}])
        self.assertGreaterEqual(len(deltas[0]), 2)
        self.assertEqual(msg["stop_reason"], "end_turn")
        self.assertEqual(msg["usage"]["input_tokens"], 17)
        self.assertEqual(msg["usage"]["output_tokens"], 9)
        self.assertTrue(msg["id"].startswith("msg_"))
        self.assertEqual(msg["model"], "claude-sonnet-4-5")

    def test_stream_tool_calls(self):
        fm = self.start([{"text": "Let me look.", "tool_calls": [
            {"name": "bash", "arguments": self.ARGS},
            {"name": "read", "arguments": {"path": "ünï.txt"}, "id": "toolu_custom"}]}])
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        self.assertEqual(rc, 0)
        msg, deltas = assemble_anthropic(self, out)
        self.assertEqual([b["type"] for b in msg["content"]], ["text", "tool_use", "tool_use"])
        self.assertEqual(msg["content"][0]["text"], "Let me look.")
        bash, read = msg["content"][1], msg["content"][2]
        self.assertEqual((bash["name"], bash["id"], bash["input"]), ("bash", "toolu_1",
                                                                       self.ARGS))
        self.assertEqual((read["name"], read["id"], read["input"]),
                         ("read", "toolu_custom", {"path": "ünï.txt"}))
        for index in (1, 2):
            pieces = [d["partial_json"] for d in deltas[index] if d["partial_json"]]
            self.assertGreaterEqual(len(pieces), 2, "arguments must come in 2+ pieces")
        self.assertEqual(msg["stop_reason"], "tool_use")

    def test_non_stream(self):
        fm = self.start([{"text": "Plain.", "tool_calls": [{"name": "bash",
                                                            "arguments": self.ARGS}]}])
        status, headers, body = post(fm.base + "/v1/messages",
                                     anthropic_body(USER_HI, stream=False), ANTHROPIC_HEADERS)
        self.assertEqual(status, 200)
        self.assertTrue(headers["content-type"].startswith("application/json"))
        self.assertIn("request-id", headers)
        msg = json.loads(body)
        self.assertEqual(msg["type"], "message")
        self.assertEqual(msg["role"], "assistant")
        self.assertEqual(msg["stop_reason"], "tool_use")
        self.assertEqual(msg["content"], [
            {"type": "text", "text": "Plain."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": self.ARGS}])
        for k in ("input_tokens", "output_tokens"):
            self.assertIsInstance(msg["usage"][k], int)

    def test_thinking_block(self):
        fm = self.start([{"thinking": "Consider the options carefully.", "signature": "sig",
                          "text": "Done."}])
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        msg, _ = assemble_anthropic(self, out)
        self.assertEqual(msg["content"][0], {"type": "thinking", "signature": "sig",
                                             "thinking": "Consider the options carefully."})
        self.assertEqual(msg["content"][1]["text"], "Done.")


class OpenAITest(ServerCase):
    ARGS = {"path": "a/b.txt", "oldText": "x = 1\n", "newText": "x = 2\n"}

    def test_stream_text_with_usage(self):
        fm = self.start([{"text": "Streaming answer in several pieces, please.",
                          "usage": {"input_tokens": 30, "output_tokens": 7}}])
        rc, out = curl(fm.base + "/v1/chat/completions", openai_body(USER_HI), OPENAI_HEADERS)
        self.assertEqual(rc, 0)
        msg, finish, usage, chunks = assemble_openai(self, out)
        self.assertEqual(msg["content"], "Streaming answer in several pieces, please.")
        self.assertGreaterEqual(sum(1 for c in chunks if c["choices"] and
                                    c["choices"][0]["delta"].get("content")), 2)
        self.assertEqual(finish, "stop")
        self.assertEqual(usage["prompt_tokens"], 30)
        self.assertEqual(usage["completion_tokens"], 7)
        self.assertEqual(usage["total_tokens"], 37)

    def test_stream_tool_calls_no_usage(self):
        fm = self.start([{"tool_calls": [{"name": "edit", "arguments": self.ARGS},
                                         {"name": "bash", "arguments": {"command": "ls"}}]}])
        # OPENAI_BASE_URL often already ends in /v1: the bare path must work too
        rc, out = curl(fm.base + "/chat/completions", openai_body(USER_HI, usage=False),
                       OPENAI_HEADERS)
        self.assertEqual(rc, 0)
        msg, finish, usage, chunks = assemble_openai(self, out)
        self.assertIsNone(usage)
        self.assertTrue(all("usage" not in c for c in chunks))
        self.assertEqual(finish, "tool_calls")
        self.assertEqual([(c["id"], c["name"]) for c in msg["tool_calls"]],
                         [("call_1", "edit"), ("call_2", "bash")])
        self.assertEqual(json.loads(msg["tool_calls"][0]["arguments"]), self.ARGS)
        self.assertGreaterEqual(msg["tool_calls"][0]["pieces"], 2)
        self.assertGreaterEqual(msg["tool_calls"][1]["pieces"], 2)

    def test_non_stream(self):
        fm = self.start([{"text": "Hello.", "tool_calls": [{"name": "edit",
                                                            "arguments": self.ARGS}]},
                         {"text": "Bye."}])
        for path, want in (("/v1/chat/completions", "tool_calls"),
                           ("/chat/completions", "stop")):
            status, headers, body = post(fm.base + path, openai_body(USER_HI, stream=False),
                                         OPENAI_HEADERS)
            self.assertEqual(status, 200)
            c = json.loads(body)
            self.assertEqual(c["object"], "chat.completion")
            self.assertEqual(c["choices"][0]["finish_reason"], want)
            self.assertEqual(c["choices"][0]["message"]["role"], "assistant")
            self.assertIn("prompt_tokens", c["usage"])
        self.assertEqual(json.loads(body)["choices"][0]["message"]["content"], "Bye.")

    def test_tool_call_message_shape(self):
        fm = self.start([{"tool_calls": [{"name": "edit", "arguments": self.ARGS}]}])
        _, _, body = post(fm.base + "/v1/chat/completions", openai_body(USER_HI, stream=False),
                          OPENAI_HEADERS)
        m = json.loads(body)["choices"][0]["message"]
        self.assertIsNone(m["content"])
        self.assertEqual(m["tool_calls"][0]["type"], "function")
        self.assertEqual(json.loads(m["tool_calls"][0]["function"]["arguments"]), self.ARGS)


# -- scripted failures ----------------------------------------------------------------------

class ErrorTest(ServerCase):
    def test_anthropic_errors(self):
        fm = self.start([{"error": {"status": 429, "retry_after": 3}},
                         {"error": {"status": 529}},
                         {"error": {"status": 500}},
                         {"error": {"status": 401}},
                         {"error": {"status": 400, "message": "prompt is too long: 250000 "
                                                              "tokens > 200000 maximum"}}])
        want = [(429, "rate_limit_error"), (529, "overloaded_error"), (500, "api_error"),
                (401, "authentication_error"), (400, "invalid_request_error")]
        for i, (status, etype) in enumerate(want):
            got, headers, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI),
                                      ANTHROPIC_HEADERS)
            self.assertEqual(got, status)
            err = json.loads(body)
            self.assertEqual(err["type"], "error")
            self.assertEqual(err["error"]["type"], etype)
            self.assertTrue(err["error"]["message"])
            if i == 0:
                self.assertEqual(headers.get("retry-after"), "3")
            else:
                self.assertNotIn("retry-after", headers)
        self.assertIn("prompt is too long", err["error"]["message"])

    def test_openai_errors(self):
        fm = self.start([{"error": {"status": 429, "retry_after": 1}},
                         {"error": {"status": 500}},
                         {"error": {"status": 401}},
                         {"error": {"status": 503, "body": "upstream connect error"}}])
        status, headers, body = post(fm.base + "/v1/chat/completions", openai_body(USER_HI),
                                     OPENAI_HEADERS)
        self.assertEqual(status, 429)
        self.assertEqual(headers["retry-after"], "1")
        err = json.loads(body)["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"})
        self.assertEqual(err["code"], "rate_limit_exceeded")
        status, _, body = post(fm.base + "/v1/chat/completions", openai_body(USER_HI),
                               OPENAI_HEADERS)
        self.assertEqual((status, json.loads(body)["error"]["type"]), (500, "server_error"))
        status, _, body = post(fm.base + "/v1/chat/completions", openai_body(USER_HI),
                               OPENAI_HEADERS)
        self.assertEqual((status, json.loads(body)["error"]["code"]), (401, "invalid_api_key"))
        status, _, body = post(fm.base + "/v1/chat/completions", openai_body(USER_HI),
                               OPENAI_HEADERS)
        self.assertEqual((status, body), (503, b"upstream connect error"))

    def test_error_inside_stream(self):
        fm = self.start([{"error": {"status": 529, "in_stream": True}}])
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        self.assertEqual(rc, 0)
        events = parse_sse(out)
        self.assertEqual(events[0][0], "message_start")
        self.assertEqual(events[-1][0], "error")
        self.assertEqual(json.loads(events[-1][1])["error"]["type"], "overloaded_error")

    def test_garbage(self):
        fm = self.start([{"garbage": "this is {not json"}, {"garbage": "event: nonsense\n"}])
        status, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                               ANTHROPIC_HEADERS)
        self.assertEqual((status, body), (200, b"this is {not json"))
        rc, out = curl(fm.base + "/v1/chat/completions", openai_body(USER_HI), OPENAI_HEADERS)
        self.assertEqual((rc, out), (0, "event: nonsense\n"))

    def test_disconnect_mid_stream(self):
        fm = self.start([{"text": "a long answer that never finishes", "tool_calls": [
                              {"name": "bash", "arguments": {"command": "ls"}}],
                          "disconnect_after_chunks": 4},
                         {"text": "cut", "disconnect_after_chunks": 2},
                         {"text": "cut non-streaming", "disconnect_after_chunks": 1}])
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        self.assertEqual(rc, 18, "curl must see a transfer cut short (CURLE_PARTIAL_FILE)")
        events = parse_sse(out)
        self.assertEqual(len(events), 4)
        self.assertNotIn("message_stop", [e for e, _ in events])
        rc, out = curl(fm.base + "/v1/chat/completions", openai_body(USER_HI), OPENAI_HEADERS)
        self.assertEqual(rc, 18)
        self.assertEqual(len(parse_sse(out)), 2)
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                       ANTHROPIC_HEADERS)
        self.assertEqual(rc, 18)
        self.assertRaises(ValueError, json.loads, out)

    def test_delays(self):
        fm = self.start([{"text": "slow", "delay_ms": 400},
                         {"text": "one two three four five six", "chunk_delay_ms": 100}])
        t0 = time.monotonic()
        post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False), ANTHROPIC_HEADERS)
        self.assertGreaterEqual(time.monotonic() - t0, 0.4)
        t0 = time.monotonic()
        rc, out = curl(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        n = len(parse_sse(out))
        self.assertGreaterEqual(time.monotonic() - t0, (n - 1) * 0.1 * 0.9)

    def test_require_key(self):
        fm = self.start([{"text": "ok"}, {"text": "ok too"}], ["--require-key", "sekrit"])
        status, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI),
                               ANTHROPIC_HEADERS)
        self.assertEqual(status, 401)
        self.assertEqual(json.loads(body)["error"]["type"], "authentication_error")
        status, _, body = post(fm.base + "/chat/completions", openai_body(USER_HI),
                               OPENAI_HEADERS)
        self.assertEqual(status, 401)
        self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
        status, _, _ = post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                            dict(ANTHROPIC_HEADERS, **{"x-api-key": "sekrit"}))
        self.assertEqual(status, 200)
        status, _, _ = post(fm.base + "/chat/completions", openai_body(USER_HI, stream=False),
                            dict(OPENAI_HEADERS, authorization="Bearer sekrit"))
        self.assertEqual(status, 200)

    def test_request_checks(self):
        fm = self.start([{"text": "never used"}])
        no_version = {k: v for k, v in ANTHROPIC_HEADERS.items() if k != "anthropic-version"}
        status, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI), no_version)
        self.assertEqual(status, 400)
        self.assertIn("anthropic-version", json.loads(body)["error"]["message"])
        dangling = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9",
                                                       "name": "bash", "input": {}}]},
                    {"role": "user", "content": "no result"}]
        status, _, body = post(fm.base + "/v1/messages", anthropic_body(dangling),
                               ANTHROPIC_HEADERS)
        self.assertEqual(status, 400)
        self.assertIn("toolu_9", json.loads(body)["error"]["message"])
        dangling = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_9", "type": "function",
                         "function": {"name": "bash", "arguments": "{}"}}]}]
        status, _, body = post(fm.base + "/chat/completions", openai_body(dangling),
                               OPENAI_HEADERS)
        self.assertEqual(status, 400)
        self.assertIn("call_9", json.loads(body)["error"]["message"])
        status, _, _ = post(fm.base + "/v1/messages", None, ANTHROPIC_HEADERS, raw=b"{oops")
        self.assertEqual(status, 400)
        status, _, _ = post(fm.base + "/v1/complete", anthropic_body(USER_HI),
                            ANTHROPIC_HEADERS)
        self.assertEqual(status, 404)
        # rejected requests do not consume steps
        _, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                          ANTHROPIC_HEADERS)
        self.assertEqual(json.loads(body)["content"][0]["text"], "never used")


class ScenarioTest(ServerCase):
    def test_match_and_order(self):
        fm = self.start([{"text": "first unmatched"},
                         {"match": {"last_user_contains": "beta"}, "text": "for beta"},
                         {"text": "second unmatched"},
                         {"match": {"last_user_contains": "RESULT-7"}, "text": "saw result"}])

        def ask(content):
            _, _, body = post(fm.base + "/v1/messages",
                              anthropic_body([{"role": "user", "content": content}],
                                             stream=False), ANTHROPIC_HEADERS)
            return json.loads(body)["content"][0]["text"]

        self.assertEqual(ask("alpha"), "first unmatched")
        self.assertEqual(ask("beta please"), "for beta")
        self.assertEqual(ask("beta again"), "second unmatched")  # the match was consumed
        tool_turn = [{"role": "user", "content": "go"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                        "name": "bash", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": "RESULT-7"}]}]
        _, _, body = post(fm.base + "/v1/messages", anthropic_body(tool_turn, stream=False),
                          ANTHROPIC_HEADERS)
        self.assertEqual(json.loads(body)["content"][0]["text"], "saw result")
        self.assertEqual(ask("anything"), "(scenario finished)")
        rc, out = curl(fm.base + "/chat/completions", openai_body(USER_HI), OPENAI_HEADERS)
        self.assertEqual(assemble_openai(self, out)[0]["content"], "(scenario finished)")

    def test_context_window(self):
        """A request over the scenario's context_window is refused as too long, consuming no
        step; one that fits gets the next step."""
        fm = self.start([])
        post(fm.base + "/_fake/scenario",
             {"steps": [{"text": "fits"}], "context_window": 2000}, {})
        big = anthropic_body([{"role": "user", "content": "x" * 8000}], stream=False)
        code, _, body = post(fm.base + "/v1/messages", big, ANTHROPIC_HEADERS)
        self.assertEqual(code, 400)
        self.assertIn("prompt is too long", json.loads(body)["error"]["message"])
        _, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                          ANTHROPIC_HEADERS)
        self.assertEqual(json.loads(body)["content"][0]["text"], "fits")
        self.assertEqual([e["step"] for e in fm.log()], ["too_long", 0])

    def test_log(self):
        fm = self.start([{"text": "a"}, {"error": {"status": 500}}])
        post(fm.base + "/v1/messages", anthropic_body(USER_HI), ANTHROPIC_HEADERS)
        post(fm.base + "/chat/completions", openai_body(USER_HI, stream=False),
             dict(OPENAI_HEADERS, **{"X-Custom-Header": "Yes"}))
        log = fm.log()
        self.assertEqual([e["n"] for e in log], [1, 2])
        self.assertEqual([e["provider"] for e in log], ["anthropic", "openai"])
        self.assertEqual([e["path"] for e in log], ["/v1/messages", "/chat/completions"])
        self.assertEqual(log[0]["headers"]["anthropic-version"], "2023-06-01")
        self.assertEqual(log[0]["headers"]["x-api-key"], "test-key")
        self.assertEqual(log[1]["headers"]["x-custom-header"], "Yes")
        self.assertEqual(log[1]["headers"]["authorization"], "Bearer test-key")
        self.assertEqual(log[0]["body"], anthropic_body(USER_HI))
        self.assertEqual(log[1]["body"]["model"], "gpt-test")
        self.assertTrue(all(k == k.lower() for e in log for k in e["headers"]))

    def test_bad_scenario_is_refused(self):
        path = os.path.join(self.tmp, "bad.json")
        with open(path, "w") as f:
            json.dump({"steps": [{"txet": "typo"}]}, f)
        p = subprocess.run([PYTHON, FAKE, "--port", "0", "--scenario", path],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=10)
        self.assertEqual(p.returncode, 2)
        self.assertIn("txet", p.stderr)

    def test_sigterm_during_slow_request(self):
        fm = FakeModel(self.tmp, [{"text": "slow", "delay_ms": 30000}])
        client = subprocess.Popen(["curl", "-sN", "-X", "POST", fm.base + "/v1/messages",
                                   "-H", "anthropic-version: 2023-06-01", "-d",
                                   json.dumps(anthropic_body(USER_HI))],
                                  stdout=subprocess.DEVNULL)
        time.sleep(0.3)
        t0 = time.monotonic()
        self.assertEqual(fm.stop(), 0)
        self.assertLess(time.monotonic() - t0, 5)
        client.wait(10)


def stats(fm):
    with urllib.request.urlopen(fm.base + "/_stats", timeout=10) as r:
        return json.loads(r.read())


def read_chunked_sse(resp):
    """Reads a whole chunked SSE answer from an http.client response."""
    assert resp.getheader("Transfer-Encoding") == "chunked", resp.getheaders()
    assert resp.getheader("Content-Length") is None
    return resp.read().decode("utf-8")


class KeepAliveTest(ServerCase):
    """Every answer is delimited (Content-Length or chunked), so a client keeps one
    connection for many requests; /_stats counts connections and requests of model traffic."""

    def test_one_connection_for_many_requests(self):
        fm = self.start([{"text": "one"}, {"error": {"status": 429, "retry_after": 1}},
                         {"text": "two", "tool_calls": [{"name": "bash",
                                                         "arguments": {"command": "ls"}}]},
                         {"garbage": "not json"}])
        self.assertEqual(stats(fm), {"connections": 0, "requests": 0, "accepted": 1})
        conn = http.client.HTTPConnection("127.0.0.1", fm.port, timeout=10)
        answers = []
        for provider, stream in [("anthropic", True), ("anthropic", False), ("openai", True),
                                 ("openai", False), ("openai", True), ("anthropic", False)]:
            if provider == "anthropic":
                path, body, headers = "/v1/messages", anthropic_body(USER_HI, stream=stream), \
                    ANTHROPIC_HEADERS
            else:
                path, body, headers = "/v1/chat/completions", openai_body(USER_HI, stream), \
                    OPENAI_HEADERS
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            self.assertEqual(resp.version, 11)
            self.assertFalse(resp.will_close, "the server must keep the connection open")
            if resp.getheader("Content-Type", "").startswith("text/event-stream"):
                answers.append((resp.status, read_chunked_sse(resp)))
            else:
                self.assertIsNotNone(resp.getheader("Content-Length"))
                answers.append((resp.status, resp.read().decode("utf-8")))
        self.assertEqual([a[0] for a in answers], [200, 429, 200, 200, 200, 200])
        msg, _ = assemble_anthropic(self, answers[0][1])
        self.assertEqual(msg["content"][0]["text"], "one")
        self.assertEqual(answers[3][1], "not json")
        self.assertEqual(assemble_openai(self, answers[4][1])[0]["content"],
                         "(scenario finished)")
        # control traffic (this /_stats, /_fake/health) is not counted
        urllib.request.urlopen(fm.base + "/_fake/health", timeout=10).read()
        self.assertEqual(stats(fm)["connections"], 1)
        self.assertEqual(stats(fm)["requests"], 6)
        conn.close()
        # a second client is a second connection
        post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False), ANTHROPIC_HEADERS)
        st = stats(fm)
        self.assertEqual((st["connections"], st["requests"]), (2, 7))
        self.assertGreaterEqual(st["accepted"], 2 + 4)

    def test_dropped_connection_is_not_reused(self):
        fm = self.start([{"text": "cut short", "disconnect_after_chunks": 2}, {"text": "whole"}])
        conn = http.client.HTTPConnection("127.0.0.1", fm.port, timeout=10)
        conn.request("POST", "/v1/messages", json.dumps(anthropic_body(USER_HI)),
                     ANTHROPIC_HEADERS)
        resp = conn.getresponse()
        self.assertRaises(http.client.IncompleteRead, resp.read)
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", fm.port, timeout=10)
        conn.request("POST", "/v1/messages", json.dumps(anthropic_body(USER_HI)),
                     ANTHROPIC_HEADERS)
        msg, _ = assemble_anthropic(self, read_chunked_sse(conn.getresponse()))
        self.assertEqual(msg["content"][0]["text"], "whole")
        conn.close()
        self.assertEqual({k: stats(fm)[k] for k in ("connections", "requests")},
                         {"connections": 2, "requests": 2})

    def test_curl_reuses_the_connection(self):
        fm = self.start()
        url = fm.base + "/v1/messages"
        cmd = ["curl", "-sS"]
        for i in range(3):
            if i:
                cmd.append("--next")
            cmd += ["-o", "/dev/null", "-w", "%{num_connects}\\n", "-X", "POST", url,
                    "--data-binary", json.dumps(anthropic_body(USER_HI))]
            for k, v in ANTHROPIC_HEADERS.items():
                cmd += ["-H", "%s: %s" % (k, v)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split(), ["1", "0", "0"])
        self.assertEqual({k: stats(fm)[k] for k in ("connections", "requests")},
                         {"connections": 1, "requests": 3})


class BenchBrainTest(ServerCase):
    """--brain bench: bash, then read of the named file, then a final answer, per message."""

    def ask(self, fm, messages):
        status, _, data = post(fm.base + "/v1/messages",
                               anthropic_body(messages, stream=False, tools=tools_for("anthropic")),
                               ANTHROPIC_HEADERS)
        self.assertEqual(status, 200, data)
        return json.loads(data)["content"]

    def test_three_calls_then_again(self):
        fm = self.start(extra=["--brain", "bench", "--delay-ms", "300"])
        msgs = [{"role": "user", "content": "bench read=data/big.txt"}]
        t0 = time.monotonic()
        seen = []
        for _ in range(3):
            content = self.ask(fm, msgs)
            msgs.append({"role": "assistant", "content": content})
            uses = [c for c in content if c["type"] == "tool_use"]
            seen.append([(u["name"], u["input"]) for u in uses])
            if uses:
                msgs.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": u["id"], "content": "ok"}
                    for u in uses]})
        # every answer waited the server-wide delay
        self.assertGreaterEqual(time.monotonic() - t0, 0.9)
        self.assertEqual(seen, [[("bash", {"command": "echo hello"})],
                                [("read", {"path": "data/big.txt"})], []])
        # a new message after the final answer starts over
        msgs.append({"role": "user", "content": "bench"})
        content = self.ask(fm, msgs)
        self.assertEqual([c["input"] for c in content if c["type"] == "tool_use"],
                         [{"command": "echo hello"}])


# -- the demo brain, through a real repair ---------------------------------------------------

class Workspace:
    """Runs the demo's tool calls for real on a copy of examples/project, shaping results
    the way toold does."""

    def __init__(self, root):
        self.root = root

    def run(self, name, args):
        """-> (text, is_error)"""
        if name == "read":
            try:
                with open(os.path.join(self.root, args["path"]), encoding="utf-8") as f:
                    data = f.read()
            except OSError as e:
                return "%s: cannot open it: %s" % (args["path"], e.strerror), True
            return (data[:-1] if data.endswith("\n") else data), False
        if name == "bash":
            p = subprocess.run(["bash", "-c", args["command"]], cwd=self.root,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
            text = p.stdout.decode("utf-8", "replace") or "[no output]"
            if p.returncode:
                text += "\n\n[Exit code %d]" % p.returncode
            return text, False
        if name == "edit":
            path = os.path.join(self.root, args["path"])
            with open(path, encoding="utf-8") as f:
                data = f.read()
            n = data.count(args["oldText"])
            if n != 1:
                return ("oldText occurs %d times in %s; nothing was changed." %
                        (n, args["path"])), True
            with open(path, "w", encoding="utf-8") as f:
                f.write(data.replace(args["oldText"], args["newText"]))
            return "Edited %s: replaced 1 occurrence." % args["path"], False
        return "unknown tool %s" % name, True


class TooldWorkspace:
    """The same tool calls, run by the real toold (local driver) through `cflue tool`."""

    def __init__(self, tc, root):
        self.root = root
        os.makedirs(os.path.join(root, "example"))
        for name in os.listdir(EXAMPLE):
            if name != "__pycache__":
                shutil.copy(os.path.join(EXAMPLE, name), os.path.join(root, "example", name))
        port_file = os.path.join(root, "port")
        self.proc = subprocess.Popen([TOOLD, "--listen", "127.0.0.1:0", "--root", root,
                                      "--driver", "local", "--port-file", port_file],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                tc.fail("toold did not start")
            time.sleep(0.05)
        self.addr = "127.0.0.1:%s" % open(port_file).read().strip()

    def run(self, name, args):
        p = subprocess.run([CFLUE, "tool", self.addr, name, json.dumps(args),
                            "--sandbox", "example"], capture_output=True, timeout=120)
        text = p.stdout.decode("utf-8")
        return (text[:-1] if text.endswith("\n") else text), p.returncode != 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)
        self.proc.stderr.close()


def system_prompt(root):
    listing = "\n".join(sorted(os.listdir(root)))
    return ("You are a careful coding agent.\n\nWorking directory: /workspace\n\n"
            "Files:\n%s" % listing)


class Agent:
    """A minimal agent loop over one provider's wire format."""

    def __init__(self, tc, fm, provider, root, stream):
        self.tc, self.fm, self.provider, self.stream = tc, fm, provider, stream
        self.ws = Workspace(root)
        self.system = system_prompt(root)
        self.messages = []

    def call(self):
        if self.provider == "anthropic":
            body = anthropic_body(self.messages, stream=self.stream,
                                  tools=tools_for("anthropic"))
            body["system"] = [{"type": "text", "text": self.system,
                               "cache_control": {"type": "ephemeral"}}]
            if self.stream:
                rc, out = curl(self.fm.base + "/v1/messages", body, ANTHROPIC_HEADERS)
                self.tc.assertEqual(rc, 0)
                msg, _ = assemble_anthropic(self.tc, out)
            else:
                status, _, raw = post(self.fm.base + "/v1/messages", body, ANTHROPIC_HEADERS)
                self.tc.assertEqual(status, 200, raw)
                msg = json.loads(raw)
            text = "".join(b["text"] for b in msg["content"] if b["type"] == "text")
            calls = [(b["id"], b["name"], b["input"]) for b in msg["content"]
                     if b["type"] == "tool_use"]
            self.messages.append({"role": "assistant", "content": msg["content"]})
            return text, calls
        body = openai_body(self.messages, stream=self.stream, tools=tools_for("openai"))
        body["messages"][0]["content"] = self.system
        if self.stream:
            rc, out = curl(self.fm.base + "/chat/completions", body, OPENAI_HEADERS)
            self.tc.assertEqual(rc, 0)
            m, _, _, _ = assemble_openai(self.tc, out)
            tool_calls = [{"id": c["id"], "type": "function",
                           "function": {"name": c["name"], "arguments": c["arguments"]}}
                          for c in m["tool_calls"]]
            text = m["content"]
        else:
            status, _, raw = post(self.fm.base + "/chat/completions", body, OPENAI_HEADERS)
            self.tc.assertEqual(status, 200, raw)
            m = json.loads(raw)["choices"][0]["message"]
            tool_calls, text = m.get("tool_calls") or [], m["content"]
        entry = {"role": "assistant", "content": text}
        if tool_calls:
            entry["tool_calls"] = tool_calls
        self.messages.append(entry)
        return text or "", [(c["id"], c["function"]["name"],
                             json.loads(c["function"]["arguments"])) for c in tool_calls]

    def submit(self, prompt):
        """Runs one user message to a final answer -> (tool names, results, final text)."""
        self.messages.append({"role": "user", "content": prompt})
        names, results = [], []
        for _ in range(12):
            text, calls = self.call()
            if not calls:
                return names, results, text
            outs = []
            for cid, name, args in calls:
                out, is_error = self.ws.run(name, args)
                names.append(name)
                results.append(out)
                outs.append((cid, out, is_error))
            if self.provider == "anthropic":
                self.messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": cid, "content": out,
                     "is_error": is_error} for cid, out, is_error in outs]})
            else:
                self.messages += [{"role": "tool", "tool_call_id": cid, "content": out}
                                  for cid, out, _ in outs]
        self.tc.fail("the demo brain did not finish")


class DemoBrainTest(ServerCase):
    def repair(self, provider, stream):
        root = os.path.join(self.tmp, "project-%s-%s" % (provider, stream))
        shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__"))
        fm = self.start()
        agent = Agent(self, fm, provider, root, stream)
        names, results, text = agent.submit("The tests in this project fail. Please find the "
                                            "bug and fix it.")
        self.assertEqual(names, ["read", "bash", "edit", "bash"])
        self.assertIn("def mean", results[0])
        self.assertIn("FAILED", results[1])
        self.assertIn("[Exit code 1]", results[1])
        self.assertEqual(results[2], "Edited calc.py: replaced 1 occurrence.")
        self.assertRegex(results[3], r"(?m)^OK$")
        self.assertIn("offline demo model", text)
        self.assertIn("calc.py", text)
        self.assertIn("all 9 pass", text)
        # the fix is exactly the one line, and the project's tests pass for real
        with open(os.path.join(EXAMPLE, "calc.py")) as f:
            original = f.read()
        with open(os.path.join(root, "calc.py")) as f:
            fixed = f.read()
        self.assertEqual(fixed, original.replace("for value in values[1:]:",
                                                 "for value in values:"))
        p = subprocess.run([PYTHON, "-B", "-m", "unittest"], cwd=root, capture_output=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        # every model request was logged and answered by the demo brain
        self.assertEqual([e["step"] for e in fm.log()], ["demo"] * 5)
        return agent

    def test_example_fails_before_the_fix(self):
        p = subprocess.run([PYTHON, "-B", "-m", "unittest"], cwd=EXAMPLE, capture_output=True)
        self.assertNotEqual(p.returncode, 0, "examples/project must start out broken")

    def test_anthropic_streaming(self):
        agent = self.repair("anthropic", True)
        # a second request in the same conversation: nothing left to fix
        names, _, text = agent.submit("Please check again.")
        self.assertEqual(names, ["read", "bash"])
        self.assertIn("already pass", text)
        ids = [b["id"] for m in agent.messages if m["role"] == "assistant"
               for b in m["content"] if b["type"] == "tool_use"]
        self.assertEqual(len(ids), len(set(ids)), "tool-call ids repeat in a conversation")

    def test_anthropic_non_streaming(self):
        self.repair("anthropic", False)

    def test_openai_streaming(self):
        self.repair("openai", True)

    def test_openai_non_streaming(self):
        self.repair("openai", False)

    @unittest.skipUnless(os.access(TOOLD, os.X_OK) and os.access(CFLUE, os.X_OK),
                         "needs the built toold and cflue (%s)" % BUILD_DIR)
    def test_with_the_real_toold(self):
        root = os.path.join(self.tmp, "toold-root")
        ws = TooldWorkspace(self, root)
        try:
            fm = self.start()
            agent = Agent(self, fm, "anthropic", os.path.join(root, "example"), True)
            agent.ws = ws
            names, results, text = agent.submit("Fix the failing tests.")
        finally:
            ws.stop()
        self.assertEqual(names, ["read", "bash", "edit", "bash"])
        self.assertIn("[Exit code 1]", results[1])
        self.assertRegex(results[3], r"(?m)^OK$")
        self.assertIn("now all 9 pass", text)

    def test_without_tools(self):
        fm = self.start()
        _, _, body = post(fm.base + "/v1/messages", anthropic_body(USER_HI, stream=False),
                          ANTHROPIC_HEADERS)
        msg = json.loads(body)
        self.assertEqual(msg["stop_reason"], "end_turn")
        self.assertIn("offline demo model", msg["content"][0]["text"])


if __name__ == "__main__":
    unittest.main()
