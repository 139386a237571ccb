#!/usr/bin/python3
"""An offline model server that speaks the real Anthropic Messages and OpenAI Chat
Completions wire protocols, for cflue's tests and for the README's demo.

    fake_model.py --port 0 [--host 127.0.0.1] [--scenario FILE.json] [--log FILE.jsonl]
                  [--require-key KEY] [--no-validate] [--quiet] [--brain demo|chaos|bench]
                  [--delay-ms MS]

Endpoints:
    POST /v1/messages                          Anthropic Messages API (x-api-key,
                                               anthropic-version)
    POST /v1/chat/completions, /chat/completions
                                               OpenAI Chat Completions (Authorization: Bearer)
    GET  /_fake/health                         {"ok": true, "requests": N, "steps_left": N}
    GET  /_stats                               {"connections": N, "requests": M, "accepted": A}:
                                               model traffic only (see README.md)
    POST /_fake/scenario                       replace the scenario ({"steps": [...]})

Both endpoints answer streaming ("stream": true -> text/event-stream, chunked) and
non-streaming requests. With --scenario, each request consumes one scripted step (see
README.md beside this file); without it, a built-in "demo brain" repairs the example project
in examples/project by deciding each step from the conversation it is sent.

The first line on stdout is "listening on PORT". SIGTERM and SIGINT exit with status 0.
Standard library only.

One thread serves every connection (asyncio): a thousand model calls waiting out --delay-ms
cost a thousand sleeping coroutines, not a thousand threads taking turns at the interpreter
lock. A request is read whole, answered by Handler into a Recorder (the bytes of each flush,
and the pauses between them), and the recording is then sent as it was written: each flush
its own send, each pause a sleep.
"""

import argparse
import asyncio
import io
import json
import re
import signal
import socket
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

MAX_BODY = 64 * 1024 * 1024
# paths that observe or steer the server: not counted in /_stats
CONTROL_PATHS = ("/_stats", "/_fake/health", "/health", "/_fake/scenario")
ANTHROPIC_PATHS = ("/v1/messages",)
OPENAI_PATHS = ("/v1/chat/completions", "/chat/completions")

STEP_KEYS = {
    "text", "thinking", "signature", "tool_calls", "error", "garbage", "content_type",
    "disconnect_after_chunks", "delay_ms", "chunk_delay_ms", "usage", "match",
    "stop_reason", "finish_reason", "model", "comment", "keepalive",
}
MATCH_KEYS = {"last_user_contains", "system_contains", "model", "provider"}

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 529: "overloaded_error",
}
ANTHROPIC_ERROR_MESSAGES = {
    400: "Invalid request.", 401: "invalid x-api-key", 403: "Permission denied.",
    404: "Not found.", 413: "Request exceeds the maximum allowed size.",
    429: "Number of requests has exceeded your rate limit. Please try again later.",
    500: "Internal server error", 529: "Overloaded",
}
# status -> (type, code, message) in OpenAI's shape
OPENAI_ERRORS = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory",
          "Permission denied."),
    404: ("invalid_request_error", "model_not_found", "Not found."),
    429: ("requests", "rate_limit_exceeded",
          "Rate limit reached for requests. Please try again later."),
    500: ("server_error", None,
          "The server had an error while processing your request. Sorry about that!"),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
    529: ("server_error", None, "The engine is currently overloaded, please try again later."),
}

ANTHROPIC_TO_OPENAI_FINISH = {
    "end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop",
    "tool_use": "tool_calls", "max_tokens": "length", "refusal": "content_filter",
}


def dumps(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def split_text(text, min_pieces=3, size=40):
    """Split text into at least min_pieces pieces (when long enough) of about size chars."""
    if not text:
        return []
    n = max(min_pieces, (len(text) + size - 1) // size)
    n = min(n, len(text))
    step = len(text) / n
    cuts = [round(i * step) for i in range(n + 1)]
    return [text[cuts[i]:cuts[i + 1]] for i in range(n) if cuts[i] < cuts[i + 1]]


def estimate_tokens(s):
    return max(1, (len(s) + 3) // 4)


# ---------------------------------------------------------------------------------------
# Requests, normalized across the two providers


def content_text(content):
    """Text of an Anthropic/OpenAI content value (string or list of blocks/parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict):
                if block.get("type") == "text" and isinstance(block.get("text"), str):
                    out.append(block["text"])
                elif block.get("type") == "tool_result":
                    out.append(content_text(block.get("content")))
            elif isinstance(block, str):
                out.append(block)
    return "\n".join(out)


def normalize(provider, body):
    """Returns (system_text, messages) where each message is
    {"role": "user"|"assistant", "text": str, "tool_calls": [{"id","name","args"}],
     "tool_results": [{"id","text","is_error"}]}. OpenAI tool messages become user messages
    carrying tool_results, as in the Anthropic shape."""
    msgs, system = [], []
    if provider == "anthropic":
        system.append(content_text(body.get("system")))
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role, content = m.get("role"), m.get("content")
        if role in ("system", "developer"):
            system.append(content_text(content))
            continue
        entry = {"role": "assistant" if role == "assistant" else "user", "text": "",
                 "tool_calls": [], "tool_results": []}
        texts = []
        if provider == "anthropic":
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                for b in content:
                    if not isinstance(b, dict):
                        continue
                    t = b.get("type")
                    if t == "text":
                        texts.append(b.get("text") or "")
                    elif t == "tool_use":
                        entry["tool_calls"].append({"id": b.get("id"), "name": b.get("name"),
                                                    "args": b.get("input")})
                    elif t == "tool_result":
                        entry["tool_results"].append({
                            "id": b.get("tool_use_id"), "text": content_text(b.get("content")),
                            "is_error": bool(b.get("is_error"))})
        else:
            if role == "tool":
                entry["tool_results"].append({"id": m.get("tool_call_id"),
                                              "text": content_text(content),
                                              "is_error": False})
            else:
                texts.append(content_text(content))
                for tc in m.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    try:
                        args = json.loads(fn.get("arguments") or "{}")
                    except ValueError:
                        args = None
                    entry["tool_calls"].append({"id": tc.get("id"), "name": fn.get("name"),
                                                "args": args})
        entry["text"] = "\n".join(t for t in texts if t)
        msgs.append(entry)
    return "\n".join(s for s in system if s), msgs


def newest_user_text(msgs):
    """Text of the messages after the last assistant message (user text and tool results);
    if the conversation ends with an assistant message, the newest user message."""
    tail = []
    for m in reversed(msgs):
        if m["role"] == "assistant":
            if tail:
                break
            continue
        tail.append(m)
    parts = []
    for m in reversed(tail):
        if m["text"]:
            parts.append(m["text"])
        parts.extend(r["text"] for r in m["tool_results"])
    return "\n".join(parts)


def offered_tools(provider, body):
    names = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if provider == "anthropic":
            names.append(t.get("name"))
        else:
            names.append((t.get("function") or {}).get("name"))
    return [n for n in names if n]


# ---------------------------------------------------------------------------------------
# Request validation (the checks the real APIs make that a client is most likely to fail)


def validate_anthropic(headers, body):
    if "anthropic-version" not in headers:
        return "anthropic-version: header is required"
    if not isinstance(body, dict):
        return "The request body is not valid JSON: expected an object."
    for field in ("model", "max_tokens", "messages"):
        if field not in body:
            return "%s: Field required" % field
    if not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1:
        return "max_tokens: must be a positive integer"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "stream: Input should be a valid boolean"
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        return "messages: at least one message is required"
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or not tool.get("name"):
            return "tools.%d.name: Field required" % i
        if tool.get("type") in (None, "custom") and "input_schema" not in tool:
            return "tools.%d.custom.input_schema: Field required" % i
    pending = []  # tool_use ids of the previous assistant message
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return "messages.%d: Input should be a valid dictionary" % i
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            return "messages.%d.role: Input should be 'user' or 'assistant'" % i
        if content is None:
            return "messages.%d.content: Field required" % i
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            return "messages.%d.content: Input should be a valid list" % i
        last = i == len(msgs) - 1
        if not blocks and not (last and role == "assistant"):
            return ("messages.%d: all messages must have non-empty content except for the "
                    "optional final assistant message" % i)
        results = []
        uses = []
        for j, b in enumerate(blocks):
            if not isinstance(b, dict) or "type" not in b:
                return "messages.%d.content.%d.type: Field required" % (i, j)
            t = b["type"]
            if t == "text":
                if not isinstance(b.get("text"), str) or (b["text"] == "" and not (
                        last and role == "assistant")):
                    return "messages: text content blocks must be non-empty"
            elif t == "tool_use":
                if role != "assistant":
                    return ("messages.%d.content.%d: tool_use blocks are only allowed in "
                            "assistant messages" % (i, j))
                if not b.get("id") or not b.get("name") or not isinstance(b.get("input"),
                                                                         dict):
                    return "messages.%d.content.%d.tool_use: id, name and input are required" \
                        % (i, j)
                uses.append(b["id"])
            elif t == "tool_result":
                if role != "user":
                    return ("messages.%d.content.%d: tool_result blocks are only allowed in "
                            "user messages" % (i, j))
                if b.get("tool_use_id") not in pending:
                    return ("messages.%d.content.%d: unexpected `tool_use_id` found in "
                            "`tool_result` blocks: %s. Each `tool_result` block must have a "
                            "corresponding `tool_use` block in the previous message."
                            % (i, j, b.get("tool_use_id")))
                results.append(b["tool_use_id"])
        if pending:
            missing = [x for x in pending if x not in results]
            if missing:
                return ("messages.%d: `tool_use` ids were found without `tool_result` blocks "
                        "immediately after: %s. Each `tool_use` block must have a "
                        "corresponding `tool_result` block in the next message."
                        % (i - 1, ", ".join(missing)))
        pending = uses
    return None


def validate_openai(headers, body):
    if not isinstance(body, dict):
        return ("We could not parse the JSON body of your request.", None, None)
    if "model" not in body:
        return ("you must provide a model parameter", None, None)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return ("Missing required parameter: 'messages'.", "missing_required_parameter",
                "messages")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return ("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                None, "stream_options")
    pending = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in (
                "system", "developer", "user", "assistant", "tool"):
            return ("Invalid value for 'messages[%d].role'." % i, "invalid_value",
                    "messages[%d].role" % i)
        role = m["role"]
        if role == "tool":
            if m.get("tool_call_id") not in pending:
                return ("Invalid parameter: messages with role 'tool' must be a response to "
                        "a preceeding message with 'tool_calls'.", None,
                        "messages.[%d].role" % i)
            pending.remove(m["tool_call_id"])
            continue
        if pending:
            return ("An assistant message with 'tool_calls' must be followed by tool messages "
                    "responding to each 'tool_call_id'. The following tool_call_ids did not "
                    "have response messages: %s" % ", ".join(pending), None,
                    "messages.[%d].role" % i)
        if role == "assistant":
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not tc.get("id") or not fn.get("name") or \
                        not isinstance(fn.get("arguments"), str):
                    return ("Invalid 'messages[%d].tool_calls': id, type, function.name and "
                            "function.arguments (a string) are required." % i, None,
                            "messages[%d].tool_calls" % i)
                pending.append(tc["id"])
            if m.get("content") in (None, "") and not m.get("tool_calls"):
                return ("Invalid value for 'content': expected a string, got null.", None,
                        "messages.[%d].content" % i)
    if pending:
        return ("An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                "response messages: %s" % ", ".join(pending), None, "messages")
    return None


# ---------------------------------------------------------------------------------------
# Scenario


def check_step(i, step):
    where = "steps[%d]" % i
    if not isinstance(step, dict):
        raise ValueError("%s must be an object" % where)
    unknown = set(step) - STEP_KEYS
    if unknown:
        raise ValueError("%s has unknown keys: %s" % (where, ", ".join(sorted(unknown))))
    kinds = [k for k in ("error", "garbage") if k in step]
    if len(kinds) > 1 or (kinds and ("text" in step or "tool_calls" in step)):
        raise ValueError("%s mixes error/garbage with an answer" % where)
    if "error" in step:
        err = step["error"]
        if not isinstance(err, dict) or not isinstance(err.get("status"), int):
            raise ValueError("%s.error needs an integer status" % where)
    for j, tc in enumerate(step.get("tool_calls") or []):
        if not isinstance(tc, dict) or not isinstance(tc.get("name"), str):
            raise ValueError("%s.tool_calls[%d] needs a name" % (where, j))
        if not isinstance(tc.get("arguments", {}), (dict, str)):
            raise ValueError("%s.tool_calls[%d].arguments must be an object or a string"
                             % (where, j))
    if "match" in step:
        m = step["match"]
        if not isinstance(m, dict) or set(m) - MATCH_KEYS or not m:
            raise ValueError("%s.match takes %s" % (where, ", ".join(sorted(MATCH_KEYS))))


def load_scenario(data):
    if isinstance(data, list):
        data = {"steps": data}
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError('a scenario is {"steps": [STEP, ...]}')
    for i, step in enumerate(data["steps"]):
        check_step(i, step)
    window = data.get("context_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError("context_window must be a positive integer")
    return Script(data["steps"], window)


class Script:
    """Scripted steps, consumed one per request; matched steps are tried first. With a
    context_window, a request whose input (about 4 characters a token of its JSON body) and
    max_tokens exceed it is refused as a real provider would, consuming no step."""

    def __init__(self, steps, context_window=None):
        self.lock = threading.Lock()
        self.steps = list(steps)
        self.used = [False] * len(self.steps)
        self.context_window = context_window

    def too_long(self, body):
        """The refusal (an error step) when body does not fit the context window, else None."""
        if not self.context_window:
            return None
        tokens = estimate_tokens(dumps(body))
        asked = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        if tokens + asked <= self.context_window:
            return None
        return {"error": {"status": 400, "type": "invalid_request_error",
                          "message": "prompt is too long: %d tokens + %d max_tokens > %d "
                                     "maximum" % (tokens, asked, self.context_window)}}

    def left(self):
        with self.lock:
            return self.used.count(False)

    def take(self, ctx):
        with self.lock:
            for i, step in enumerate(self.steps):
                if not self.used[i] and "match" in step and matches(step["match"], ctx):
                    self.used[i] = True
                    return i, step
            for i, step in enumerate(self.steps):
                if not self.used[i] and "match" not in step:
                    self.used[i] = True
                    return i, step
        return None, None


def matches(cond, ctx):
    if "last_user_contains" in cond and cond["last_user_contains"] not in ctx["last_user"]:
        return False
    if "system_contains" in cond and cond["system_contains"] not in ctx["system"]:
        return False
    if "model" in cond and cond["model"] != ctx["model"]:
        return False
    if "provider" in cond and cond["provider"] != ctx["provider"]:
        return False
    return True


# ---------------------------------------------------------------------------------------
# The demo brain: repairs examples/project deciding each step from the conversation.

DEMO_TAG = "[offline demo model]"
DEMO_NOTE = ("(This answer comes from cflue's offline demo model, which follows a fixed "
             "repair script; set ANTHROPIC_API_KEY or OPENAI_API_KEY to use a real model.)")
TEST_COMMAND = "python3 -B -m unittest -v"
LOOP_SKIPS_FIRST = re.compile(r"^([ \t]*)for\s+(\w+)\s+in\s+(\w+)\[1:\]\s*:[ \t]*$", re.M)
PY_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.py)\b")


def unittest_summary(text):
    """{"ran": N|None, "passed": bool, "failed": [test names], "assertion": str|None}"""
    ran = re.search(r"^Ran (\d+) tests? in", text, re.M)
    ok = re.search(r"^OK\b", text, re.M)
    failed = re.findall(r"^(?:FAIL|ERROR): (\w+)", text, re.M)
    assertion = re.search(r"^\w*(?:Error|Exception): .*$", text, re.M)
    return {"ran": int(ran.group(1)) if ran else None,
            "passed": bool(ran and ok and not failed and "[Exit code" not in text),
            "failed": failed, "assertion": assertion.group(0) if assertion else None}


def find_bug(source):
    """Finds the example's bug (a loop over values[1:] that drops the first value) in the
    text of a source file. Returns {"old", "new", "function", "line", "what"} or None."""
    m = LOOP_SKIPS_FIRST.search(source)
    if not m:
        return None
    lines = source.split("\n")
    lineno = source.count("\n", 0, m.start())
    old_lines = [lines[lineno]]
    first = lineno
    while source.count("\n".join(old_lines)) > 1 and first > 0:
        first -= 1
        old_lines.insert(0, lines[first])
    old = "\n".join(old_lines)
    fixed = m.group(0).replace("%s[1:]" % m.group(3), m.group(3))
    new = "\n".join(old_lines[:-1] + [fixed])
    function = None
    for ln in reversed(lines[:lineno]):
        d = re.match(r"\s*def\s+(\w+)\s*\(", ln)
        if d:
            function = d.group(1)
            break
    return {"old": old, "new": new, "function": function, "line": lineno + 1,
            "before": m.group(0).strip(), "after": fixed.strip(), "seq": m.group(3)}


def failed_result(result):
    if result is None:
        return True
    if result["is_error"]:
        return True
    head = result["text"].strip().split("\n", 1)[0]
    return "nothing was changed" in head or bool(re.search(
        r"No such file|not found|cannot read|is a directory|outside the workspace", head))


def pick_target(*texts):
    for text in texts:
        for name in PY_FILE.findall(text or ""):
            base = name.rsplit("/", 1)[-1]
            if not base.startswith("test_") and not base.endswith("_test.py"):
                return name
    return "calc.py"


def demo_decide(provider, body):
    """Returns a step (as in a scenario) for this request."""
    system, msgs = normalize(provider, body)
    tools = offered_tools(provider, body)
    missing = [t for t in ("read", "bash", "edit") if t not in tools]
    if missing:
        # Also what a compaction (summary) request without tools gets: a short, honest text.
        asked = newest_user_text(msgs).strip().replace("\n", " ")
        if len(asked) > 200:
            asked = asked[:200] + "..."
        return {"text": "%s This placeholder answer comes from cflue's offline demo model. It "
                        "only knows how to repair the example project, which needs the read, "
                        "bash and edit tools (not offered here: %s). The conversation so far "
                        "has %d message(s); the newest one says: \"%s\""
                        % (DEMO_TAG, ", ".join(missing), len(msgs), asked)}
    start = 0
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and not m["tool_calls"]:
            start = i + 1
    recent = msgs[start:]
    results = {}
    for m in recent:
        for r in m["tool_results"]:
            results[r["id"]] = r
    calls = [(tc, results.get(tc["id"])) for m in recent for tc in m["tool_calls"]]
    user_text = "\n".join(m["text"] for m in recent if m["role"] == "user")
    target = pick_target(user_text, system)
    total_calls = sum(len(m["tool_calls"]) for m in msgs)

    def tool(name, args, preface):
        return {"text": "%s %s" % (DEMO_TAG, preface),
                "tool_calls": [{"name": name, "arguments": args,
                                "id": demo_id(provider, total_calls + 1)}]}

    def final(text):
        return {"text": "%s %s\n\n%s" % (DEMO_TAG, text, DEMO_NOTE)}

    if not calls:
        return tool("read", {"path": target},
                    "I'll read %s first to see what the code does." % target)
    if len(calls) >= 8:
        return final("I have made %d tool calls without finishing the repair, so I am stopping "
                     "here." % len(calls))
    last, last_result = calls[-1]
    if last_result is None:
        return final("The %s call got no result, so I cannot continue." % last["name"])
    reads = [(c, r) for c, r in calls if c["name"] == "read" and not failed_result(r)]
    edits = [(c, r) for c, r in calls if c["name"] == "edit" and not failed_result(r)]
    runs = [(c, r) for c, r in calls if c["name"] == "bash"]
    last_args = last.get("args") if isinstance(last.get("args"), dict) else {}
    path = last_args.get("path", target)
    if last["name"] == "read":
        if failed_result(last_result):
            return final("I could not read %s: %s" % (path, last_result["text"].strip()))
        return tool("bash", {"command": TEST_COMMAND},
                    "Now I'll run the tests to see what fails.")
    if last["name"] == "edit":
        if failed_result(last_result):
            return final("My edit of %s did not apply: %s" % (path, last_result["text"].strip()))
        return tool("bash", {"command": TEST_COMMAND}, "Running the tests again to check the fix.")
    if last["name"] != "bash":
        return final("The last tool I saw was %s, which is not part of my script; stopping."
                     % last["name"])
    run = unittest_summary(last_result["text"])
    if not edits:
        if run["passed"]:
            return final("All %d tests already pass, so there is nothing to fix." % run["ran"])
        bug = None
        bug_path = target
        for c, r in reversed(reads):
            bug = find_bug(r["text"])
            if bug:
                bug_path = (c["args"] or {}).get("path", target)
                break
        if run["ran"] is None:
            return final("The test command did not run the tests:\n\n%s"
                         % last_result["text"].strip()[-1500:])
        if not bug:
            return final("%d test(s) fail (%s), but this demo model only knows how to fix the "
                         "example's bug and did not find it in the code I read."
                         % (len(run["failed"]), ", ".join(run["failed"]) or "see the output"))
        fn = "`%s()`" % bug["function"] if bug["function"] else "The loop"
        return tool("edit", {"path": bug_path, "oldText": bug["old"], "newText": bug["new"]},
                    "%d of %d tests fail (%s). %s loops over `%s[1:]`, so it skips the first "
                    "value while still dividing by the full count. I'll make it loop over "
                    "every value." % (len(run["failed"]), run["ran"],
                                      ", ".join(run["failed"]), fn, bug["seq"]))
    # tests after the edit: summarize
    before = unittest_summary(runs[0][1]["text"]) if runs and runs[0][1] else None
    edit_call = edits[-1][0]["args"]
    bug = None
    for c, r in reversed(reads):
        bug = find_bug(r["text"])
        if bug:
            break
    bug = bug or find_bug(edit_call.get("oldText", ""))
    where = edit_call.get("path", target)
    if bug:
        what = ("%s looped over `%s[1:]`, leaving out the first value but still dividing by "
                "the full count" % ("`%s()`" % bug["function"] if bug["function"] else
                                    "the loop", bug["seq"]))
    else:
        what = "the code had a bug"
    if before and before["assertion"]:
        what += " (the tests reported %s)" % before["assertion"]
    change = "I changed `%s` to `%s`." % (bug["before"], bug["after"]) if bug else \
        "I edited it."
    if before and before["ran"] is not None:
        was = "Before the fix %d of %d tests failed" % (len(before["failed"]), before["ran"])
    else:
        was = "Before the fix the tests failed"
    if run["passed"]:
        return final("Fixed the bug in %s: %s. %s %s; now all %d pass (`%s`)."
                     % (where, what, change, was, run["ran"], TEST_COMMAND))
    return final("I changed %s (%s), but the tests still do not pass:\n\n%s"
                 % (where, change, last_result["text"].strip()[-1500:]))


_DEMO_NONCE = "%08x" % (int(time.time() * 1000) & 0xFFFFFFFF)


def demo_id(provider, n):
    """Tool-call ids for the demo: unique within a conversation even across restarts of
    this server (the README's demo may reuse a conversation)."""
    return "%s_%s_%d" % ("toolu" if provider == "anthropic" else "call", _DEMO_NONCE, n)


# ---------------------------------------------------------------------------------------
# The chaos brain (--brain chaos): the workload of tests/chaos. Stateless like the demo
# brain: every step is decided from the conversation it is sent.
#
# A user message "chaos tag=TAG plan=S1.S2..." asks for one turn per step; the plan of the
# first such message after the last final answer is followed (messages that joined later are
# answered by the same final answer). Steps:
#   l        bash: append the call's ledger line
#   sMS      bash: append the ledger line, then sleep MS milliseconds
#   oBYTES   bash: append the ledger line, then print BYTES bytes of output
#   r        read the ledger file
#   p        two bash calls in one turn (each appends its own line)
# Every bash command first appends "<call id> <tag> <step index>" to CHAOS_LEDGER in the
# sandbox's working directory, so a command that ran leaves exactly one line per run. Call ids
# are unique per server start. When the plan is done: a final text naming every tag seen
# since the last final answer. Without the bash tool offered it answers the text
# CHAOS_NO_TOOLS at once (the harness counts that as a model reached without its tools).

CHAOS_LEDGER = "chaos-ledger.txt"
CHAOS_NO_TOOLS = "CHAOS-NO-TOOLS"
CHAOS_RE = re.compile(r"chaos tag=(\S+) plan=(\S*)")
_CHAOS_NONCE = "%06x" % ((int(time.time() * 1000) ^ (id(object()) >> 4)) & 0xFFFFFF)


def chaos_call(ids, name, args):
    with ids.lock:
        ids.tool += 1
        n = ids.tool
    return {"name": name, "arguments": args, "id": "chx%s_%d" % (_CHAOS_NONCE, n)}


def chaos_bash(call, tag, k, tail):
    line = "%s %s %d" % (call["id"], tag, k)
    call["arguments"] = {"command": "echo '%s' >> %s%s" % (line, CHAOS_LEDGER, tail)}
    return call


def chaos_decide(provider, body, ids):
    system, msgs = normalize(provider, body)
    if "bash" not in offered_tools(provider, body):
        return {"text": "%s: the request offered no bash tool" % CHAOS_NO_TOOLS}
    start = 0
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and not m["tool_calls"]:
            start = i + 1
    recent = msgs[start:]
    plans = [CHAOS_RE.search(m["text"]) for m in recent if m["role"] == "user" and m["text"]]
    plans = [p for p in plans if p]
    tags = [p.group(1) for p in plans]
    done = sum(1 for m in recent if m["role"] == "assistant" and m["tool_calls"])
    steps = [s for s in plans[0].group(2).split(".") if s] if plans else []
    if done >= len(steps):
        return {"text": "chaos done tag=%s answered=%s" % (tags[0] if tags else "-",
                                                            ",".join(tags))}
    tag, step = tags[0], steps[done]
    kind, num = step[:1], int(step[1:] or 0)
    if kind == "s":
        calls = [chaos_bash(chaos_call(ids, "bash", {}), tag, done,
                            "; sleep %.3f; echo slept" % (num / 1000.0))]
    elif kind == "o":
        calls = [chaos_bash(chaos_call(ids, "bash", {}), tag, done,
                            "; head -c %d /dev/zero | tr '\\0' x | fold -w 100" % num)]
    elif kind == "r":
        calls = [chaos_call(ids, "read", {"path": CHAOS_LEDGER})]
    elif kind == "p":
        calls = [chaos_bash(chaos_call(ids, "bash", {}), tag, done, "; echo one"),
                 chaos_bash(chaos_call(ids, "bash", {}), tag, done, "; echo two")]
    else:
        calls = [chaos_bash(chaos_call(ids, "bash", {}), tag, done, "; echo ok")]
    return {"text": "chaos step %d of %s" % (done, tag), "tool_calls": calls}


# The bench brain (--brain bench): the 3-call conversation of bench/bench_engine.py, stateless.
# After the last final answer: first `bash echo hello` (`sleep S; echo hello` when a user
# message since then says "sleep=S"), then `read` of the path named by "read=PATH" in such a
# message (default big.txt), then a short final text.

BENCH_READ_RE = re.compile(r"read=(\S+)")
BENCH_SLEEP_RE = re.compile(r"sleep=([0-9]+(?:\.[0-9]+)?)")


def bench_decide(provider, body, ids):
    system, msgs = normalize(provider, body)
    start = 0
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and not m["tool_calls"]:
            start = i + 1
    recent = msgs[start:]
    done = sum(1 for m in recent if m["role"] == "assistant" and m["tool_calls"])
    if done == 0:
        slept = [BENCH_SLEEP_RE.search(m["text"] or "") for m in recent if m["role"] == "user"]
        slept = [a.group(1) for a in slept if a]
        command = ("sleep %s; " % slept[0] if slept else "") + "echo hello"
        return {"text": "Running a command.",
                "tool_calls": [chaos_call(ids, "bash", {"command": command})]}
    if done == 1:
        asked = [BENCH_READ_RE.search(m["text"] or "") for m in recent if m["role"] == "user"]
        found = [a for a in asked if a]
        path = found[0].group(1) if found else "big.txt"
        return {"text": "Reading the file.",
                "tool_calls": [chaos_call(ids, "read", {"path": path})]}
    return {"text": "Done: the command said hello and the file was read."}


# ---------------------------------------------------------------------------------------
# Responses


class Reply:
    """An assistant answer built from a step: thinking, text, tool calls, stop, usage."""

    def __init__(self, step, provider, body, ids):
        self.thinking = step.get("thinking")
        self.signature = step.get("signature") or "fake-signature-%08x" % (
            zlib.crc32((self.thinking or "").encode("utf-8")))
        self.text = step.get("text") or ""
        self.model = step.get("model") or body.get("model") or "fake-model"
        self.calls = []
        for tc in step.get("tool_calls") or []:
            args = tc.get("arguments", {})
            raw = args if isinstance(args, str) else dumps(args)
            cid = tc.get("id") or ids.tool_id(provider)
            self.calls.append({"id": cid, "name": tc["name"], "raw": raw,
                               "input": args if isinstance(args, dict) else _loads_or_empty(args)})
        self.stop_reason = step.get("stop_reason") or ("tool_use" if self.calls else "end_turn")
        self.finish_reason = step.get("finish_reason") or ANTHROPIC_TO_OPENAI_FINISH.get(
            self.stop_reason, "stop")
        usage = step.get("usage") or {}
        out_chars = self.text + (self.thinking or "") + "".join(c["raw"] for c in self.calls)
        self.usage = {
            "input_tokens": usage.get("input_tokens", estimate_tokens(dumps(body))),
            "output_tokens": usage.get("output_tokens", estimate_tokens(out_chars)),
            "cache_read_input_tokens": usage.get("cache_read_input_tokens", 0),
            "cache_creation_input_tokens": usage.get("cache_creation_input_tokens", 0),
            "reasoning_tokens": usage.get("reasoning_tokens", 0),
        }

    # Anthropic ---------------------------------------------------------------------------

    def anthropic_usage(self, output=None):
        u = self.usage
        return {"input_tokens": u["input_tokens"],
                "cache_creation_input_tokens": u["cache_creation_input_tokens"],
                "cache_read_input_tokens": u["cache_read_input_tokens"],
                "output_tokens": u["output_tokens"] if output is None else output}

    def anthropic_message(self, msg_id):
        content = []
        if self.thinking:
            content.append({"type": "thinking", "thinking": self.thinking,
                            "signature": self.signature})
        if self.text:
            content.append({"type": "text", "text": self.text})
        for c in self.calls:
            content.append({"type": "tool_use", "id": c["id"], "name": c["name"],
                            "input": c["input"]})
        return {"id": msg_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": None,
                "usage": self.anthropic_usage()}

    def anthropic_events(self, msg_id):
        ev = [("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": self.anthropic_usage(output=1)}})]
        index = 0
        pinged = False

        def start(block):
            nonlocal pinged
            ev.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": block}))
            if not pinged:
                ev.append(("ping", {"type": "ping"}))
                pinged = True

        def delta(d):
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": d}))

        def stop():
            ev.append(("content_block_stop", {"type": "content_block_stop", "index": index}))

        if self.thinking:
            start({"type": "thinking", "thinking": "", "signature": ""})
            for piece in split_text(self.thinking):
                delta({"type": "thinking_delta", "thinking": piece})
            delta({"type": "signature_delta", "signature": self.signature})
            stop()
            index += 1
        if self.text:
            start({"type": "text", "text": ""})
            for piece in split_text(self.text):
                delta({"type": "text_delta", "text": piece})
            stop()
            index += 1
        for c in self.calls:
            start({"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}})
            delta({"type": "input_json_delta", "partial_json": ""})
            for piece in split_text(c["raw"], min_pieces=2, size=24):
                delta({"type": "input_json_delta", "partial_json": piece})
            stop()
            index += 1
        if not pinged:
            ev.insert(1, ("ping", {"type": "ping"}))
        ev.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": self.stop_reason,
                                               "stop_sequence": None},
                                     "usage": {"output_tokens": self.usage["output_tokens"]}}))
        ev.append(("message_stop", {"type": "message_stop"}))
        return ["event: %s\ndata: %s\n\n" % (name, dumps(data)) for name, data in ev]

    # OpenAI ------------------------------------------------------------------------------

    def openai_usage(self):
        u = self.usage
        prompt = u["input_tokens"] + u["cache_read_input_tokens"]
        return {"prompt_tokens": prompt, "completion_tokens": u["output_tokens"],
                "total_tokens": prompt + u["output_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cache_read_input_tokens"],
                                          "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": u["reasoning_tokens"],
                                              "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0,
                                              "rejected_prediction_tokens": 0}}

    def openai_completion(self, cid, created):
        message = {"role": "assistant", "content": self.text or None, "refusal": None,
                   "annotations": []}
        if self.thinking:
            message["reasoning_content"] = self.thinking
        if self.calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["raw"]}}
                                     for c in self.calls]
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self.finish_reason}],
                "usage": self.openai_usage(), "service_tier": "default",
                "system_fingerprint": "fp_fake"}

    def openai_chunks(self, cid, created, include_usage):
        chunks = []

        def chunk(delta, finish=None):
            c = {"id": cid, "object": "chat.completion.chunk", "created": created,
                 "model": self.model, "service_tier": "default",
                 "system_fingerprint": "fp_fake",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            chunks.append(c)

        chunk({"role": "assistant", "content": "", "refusal": None})
        for piece in split_text(self.thinking or ""):
            chunk({"reasoning_content": piece})
        for piece in split_text(self.text):
            chunk({"content": piece})
        for i, c in enumerate(self.calls):
            chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": ""}}]})
            for piece in split_text(c["raw"], min_pieces=2, size=24):
                chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        chunk({}, self.finish_reason)
        if include_usage:
            chunks.append({"id": cid, "object": "chat.completion.chunk", "created": created,
                           "model": self.model, "service_tier": "default",
                           "system_fingerprint": "fp_fake", "choices": [],
                           "usage": self.openai_usage()})
        return ["data: %s\n\n" % dumps(c) for c in chunks] + ["data: [DONE]\n\n"]


def _loads_or_empty(s):
    try:
        v = json.loads(s)
        return v if isinstance(v, dict) else {}
    except ValueError:
        return {}


def error_payload(provider, err, request_id):
    """(status, json body, headers) for an error step in the provider's real shape."""
    status = err["status"]
    if provider == "anthropic":
        etype = err.get("type") or ANTHROPIC_ERROR_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error")
        msg = err.get("message") or ANTHROPIC_ERROR_MESSAGES.get(status, "Error %d" % status)
        payload = {"type": "error", "error": {"type": etype, "message": msg},
                   "request_id": request_id}
    else:
        dtype, dcode, dmsg = OPENAI_ERRORS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None,
                     "Error %d" % status))
        payload = {"error": {"message": err.get("message") or dmsg,
                             "type": err.get("type") or dtype,
                             "param": err.get("param"),
                             "code": err.get("code", dcode)}}
    return payload


class Ids:
    def __init__(self):
        self.lock = threading.Lock()
        self.msg = 0
        self.tool = 0
        self.req = 0

    def next_msg(self):
        with self.lock:
            self.msg += 1
            return self.msg

    def next_req(self):
        with self.lock:
            self.req += 1
            return self.req

    def tool_id(self, provider):
        with self.lock:
            self.tool += 1
            return ("toolu_%d" if provider == "anthropic" else "call_%d") % self.tool


# ---------------------------------------------------------------------------------------
# HTTP


class Dropped(Exception):
    """The step asked for the connection to be dropped."""


class Recorder:
    """Handler's wfile: what it writes, cut into one piece per flush, and the pauses between
    pieces, for Server.serve_connection to send in that order."""

    def __init__(self):
        self.ops = []  # bytes: one send each; a float: seconds to wait
        self.buf = []

    def write(self, data):
        self.buf.append(bytes(data))
        return len(data)

    def flush(self):
        if self.buf:
            self.ops.append(b"".join(self.buf))
            self.buf = []

    def pause(self, seconds):
        self.flush()
        self.ops.append(float(seconds))

    def take(self):
        self.flush()
        ops, self.ops = self.ops, []
        return ops


class Handler(BaseHTTPRequestHandler):
    """Answers the requests of one connection. BaseHTTPRequestHandler parses each request
    and formats the status and headers; Server.serve_connection does the socket I/O."""

    protocol_version = "HTTP/1.1"

    def __init__(self, server, client_address):
        # not BaseRequestHandler's __init__, which would serve a socket itself
        self.server = server
        self.client_address = client_address
        self.wfile = Recorder()
        self.rfile = io.BytesIO()
        self.counted = False  # this connection carried model traffic
        self.dropped = False  # a step asked for the connection to be dropped
        with self.server.stats_lock:
            self.server.stats["accepted"] += 1

    def version_string(self):
        return "fake-model/1.0"

    def log_message(self, fmt, *args):
        pass

    def count_request(self, path):
        """Counts a request (and its connection, the first time) unless it is control traffic."""
        if path in CONTROL_PATHS:
            return
        with self.server.stats_lock:
            self.server.stats["requests"] += 1
            if not self.counted:
                self.server.stats["connections"] += 1
                self.counted = True

    def note(self, text):
        if not self.server.quiet:
            sys.stderr.write("fake_model: %s\n" % text)
            sys.stderr.flush()

    # -- plumbing --------------------------------------------------------------------------

    def read_body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            data = bytearray()
            while True:
                line = self.rfile.readline(1024)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                if len(data) + size > MAX_BODY:
                    raise ValueError("body too large")
                data += self.rfile.read(size)
                self.rfile.readline(16)
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        return self.rfile.read(n) if n else b""

    def send_bytes(self, status, data, ctype, extra=None, cut=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if cut is not None:
            self.wfile.write(data[:cut])
            self.wfile.flush()
            raise Dropped()
        self.wfile.write(data)
        self.wfile.flush()

    def send_json(self, status, obj, extra=None, cut_half=False):
        data = dumps(obj).encode("utf-8")
        self.send_bytes(status, data, "application/json", extra,
                        cut=len(data) // 2 if cut_half else None)

    def send_stream(self, events, extra, step):
        limit = step.get("disconnect_after_chunks")
        gap = (step.get("chunk_delay_ms") or 0) / 1000.0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.flush()
        keep = step.get("keepalive") or {}
        if keep.get("at") == "start":
            self.keep_alive(keep)
        for i, ev in enumerate(events):
            if limit is not None and i >= limit:
                raise Dropped()
            if i and gap:
                self.wfile.pause(gap)
            data = ev.encode("utf-8")
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        if limit is not None and limit <= len(events):
            raise Dropped()
        if keep.get("at") == "end":
            self.keep_alive(keep)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def keep_alive(self, keep):
        """Keep-alives and no content: an SSE comment (or, with "ping", Anthropic's ping
        event) every every_ms for for_ms."""
        beat = (b'event: ping\ndata: {"type": "ping"}\n\n' if keep.get("ping")
                else b": keep-alive\n\n")
        every = max(1, int(keep.get("every_ms", 500)))
        for _ in range(int(keep.get("for_ms", 0)) // every):
            self.wfile.pause(every / 1000.0)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(beat), beat))
            self.wfile.flush()

    # -- requests --------------------------------------------------------------------------

    def do_GET(self):
        path = urlsplit(self.path).path
        self.count_request(path)
        if path == "/_stats":
            with self.server.stats_lock:
                stats = dict(self.server.stats)
            self.send_json(200, stats)
        elif path in ("/_fake/health", "/health"):
            self.send_json(200, {"ok": True, "requests": self.server.ids.req,
                                 "steps_left": self.server.script.left()
                                 if self.server.script else None})
        else:
            self.send_json(404, {"type": "error", "error": {"type": "not_found_error",
                                                            "message": "Not Found"}})

    def do_POST(self):
        try:
            self.handle_post()
        except Dropped:
            self.close_connection = True
            self.dropped = True

    def handle_post(self):
        path = urlsplit(self.path).path
        self.count_request(path)
        try:
            raw = self.read_body()
        except ValueError:
            self.close_connection = True
            self.send_json(413, {"type": "error", "error": {
                "type": "request_too_large", "message": "Request exceeds the maximum size"}})
            return
        if path == "/_fake/scenario":
            try:
                script = load_scenario(json.loads(raw.decode("utf-8")))
            except ValueError as e:
                self.send_json(400, {"error": str(e)})
                return
            self.server.script = script
            self.send_json(200, {"ok": True, "steps": len(script.steps)})
            return
        if path in ANTHROPIC_PATHS:
            provider = "anthropic"
        elif path.rstrip("/") in OPENAI_PATHS:
            provider = "openai"
        else:
            self.send_json(404, {"type": "error", "error": {
                "type": "not_found_error", "message": "Not Found: %s" % path}})
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            body = None
        n = self.server.ids.next_req()
        entry = {"n": n, "path": path, "provider": provider, "headers": headers,
                 "body": body if body is not None else raw.decode("utf-8", "replace")}
        req_id = ("req_fake_%06d" if provider == "anthropic" else "req_fake%06d") % n
        id_header = {"request-id" if provider == "anthropic" else "x-request-id": req_id}

        # authentication, then the checks the real APIs make
        problem = None
        key = self.server.require_key
        if key is not None:
            got = headers.get("x-api-key") if provider == "anthropic" else \
                re.sub(r"^Bearer\s+", "", headers.get("authorization", ""), flags=re.I)
            if got != key:
                problem = {"status": 401}
        if problem is None and self.server.validate:
            if provider == "anthropic":
                msg = validate_anthropic(headers, body)
                if msg:
                    problem = {"status": 400, "message": msg}
            else:
                bad = validate_openai(headers, body)
                if bad:
                    problem = {"status": 400, "message": bad[0], "code": bad[1],
                               "param": bad[2]}
        if problem is not None:
            entry["rejected"] = problem.get("message") or "authentication"
            self.server.log(entry)
            self.note("#%d %s %s -> %d %s" % (n, provider, path, problem["status"],
                                              entry["rejected"]))
            self.send_json(problem["status"], error_payload(provider, problem, req_id),
                           id_header)
            return

        system, msgs = normalize(provider, body)
        ctx = {"provider": provider, "model": body.get("model"), "system": system,
               "last_user": newest_user_text(msgs)}
        script = self.server.script
        if script is not None:
            index, step = "too_long", script.too_long(body)
            if step is None:
                index, step = script.take(ctx)
            if step is None:
                step, label = {"text": "(scenario finished)"}, "finished"
            else:
                label = index
        elif self.server.brain == "chaos":
            step, label = chaos_decide(provider, body, self.server.ids), "chaos"
        elif self.server.brain == "bench":
            step, label = bench_decide(provider, body, self.server.ids), "bench"
        else:
            step, label = demo_decide(provider, body), "demo"
        entry["step"] = label
        entry["stream"] = body.get("stream") is True
        self.server.log(entry)
        self.note("#%d %s %s stream=%s step=%s" % (n, provider, path, entry["stream"], label))
        self.respond(provider, body, step, req_id, id_header)

    def respond(self, provider, body, step, req_id, id_header):
        delay_ms = step.get("delay_ms") or self.server.delay_ms
        if delay_ms:
            self.wfile.pause(delay_ms / 1000.0)
        stream = body.get("stream") is True
        if "error" in step:
            err = step["error"]
            extra = dict(id_header)
            if err.get("retry_after") is not None:
                extra["retry-after"] = str(err["retry_after"])
            if err.get("in_stream") and stream:
                payload = error_payload(provider, err, req_id)
                if provider == "anthropic":
                    head = Reply({}, provider, body, self.server.ids).anthropic_events(
                        "msg_fake_%d" % self.server.ids.next_msg())[:2]
                    events = head + ["event: error\ndata: %s\n\n" % dumps(payload)]
                else:
                    events = ["data: %s\n\n" % dumps(payload)]
                self.send_stream(events, extra, step)
                return
            if err.get("body") is not None:
                self.send_bytes(err["status"], err["body"].encode("utf-8"),
                                err.get("content_type", "application/json"), extra)
            else:
                self.send_json(err["status"], error_payload(provider, err, req_id), extra)
            return
        if "garbage" in step:
            ctype = step.get("content_type") or (
                "text/event-stream; charset=utf-8" if stream else "application/json")
            self.send_bytes(200, step["garbage"].encode("utf-8"), ctype, id_header)
            return
        reply = Reply(step, provider, body, self.server.ids)
        created = int(time.time())
        msg_n = self.server.ids.next_msg()
        if provider == "anthropic":
            msg_id = "msg_fake_%06d" % msg_n
            if stream:
                self.send_stream(reply.anthropic_events(msg_id), id_header, step)
            else:
                self.send_json(200, reply.anthropic_message(msg_id), id_header,
                               cut_half=step.get("disconnect_after_chunks") is not None)
        else:
            cid = "chatcmpl-fake%06d" % msg_n
            if stream:
                include = bool((body.get("stream_options") or {}).get("include_usage"))
                self.send_stream(reply.openai_chunks(cid, created, include), id_header, step)
            else:
                self.send_json(200, reply.openai_completion(cid, created), id_header,
                               cut_half=step.get("disconnect_after_chunks") is not None)


class Server:
    request_queue_size = 4096  # listen backlog: a thousand calls may connect at once

    def __init__(self, addr, script, log_path, require_key, validate, quiet, brain="demo",
                 delay_ms=0):
        self.addr = addr
        self.script = script
        self.require_key = require_key
        self.validate = validate
        self.quiet = quiet
        self.brain = brain
        self.delay_ms = delay_ms
        self.ids = Ids()
        self.stats_lock = threading.Lock()
        self.stats = {"connections": 0, "requests": 0, "accepted": 0}
        self.log_lock = threading.Lock()
        self.log_file = open(log_path, "a", encoding="utf-8") if log_path else None
        self.listener = None

    def log(self, entry):
        if self.log_file is None:
            return
        with self.log_lock:
            self.log_file.write(dumps(entry) + "\n")
            self.log_file.flush()

    async def listen(self):
        """Binds and starts accepting; returns the port (OSError when it cannot bind)."""
        self.listener = await asyncio.start_server(
            self.serve_connection, self.addr[0], self.addr[1], reuse_address=True,
            backlog=self.request_queue_size,
            family=socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET)
        return self.listener.sockets[0].getsockname()[1]

    async def serve_connection(self, reader, writer):
        sock = writer.get_extra_info("socket")
        # headers, body and each SSE chunk are separate sends: without TCP_NODELAY, Nagle
        # holds each one back until the client's delayed ACK of the previous one (40 ms)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        h = Handler(self, writer.get_extra_info("peername"))
        try:
            while await self.serve_request(h, reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            if h.dropped:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def serve_request(self, h, reader, writer):
        """Serves one request of h's connection; False when the connection is to close."""
        lines = []
        try:
            while not lines or (len(lines[0]) > 2 and lines[-1] not in (b"\r\n", b"\n")):
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    return False  # closed, between requests or within one
                lines.append(line)
        except ValueError:  # a line past the reader's limit, answered as http.server does
            h.requestline = h.request_version = h.command = ""
            h.send_error(431 if lines else 414)
            await self.send(writer, h.wfile.take())
            return False
        h.raw_requestline = lines[0]
        h.rfile = io.BytesIO(b"".join(lines[1:]))
        h.close_connection = True
        ok = h.parse_request()  # may record an error answer, or "100 Continue"
        await self.send(writer, h.wfile.take())
        if not ok:
            return False
        h.rfile = io.BytesIO(await self.read_body(h.headers, reader))
        method = getattr(h, "do_" + h.command, None)
        if method is None:
            h.send_error(501, "Unsupported method (%r)" % h.command)
        else:
            method()
        await self.send(writer, h.wfile.take())
        return not h.close_connection

    @staticmethod
    async def read_body(headers, reader):
        """The request's body as sent, chunked framing included. Handler.read_body decodes it
        and answers 413 past MAX_BODY or on framing it cannot read, as the old threaded server
        did; the body is then read no further, and the connection closes."""
        raw = bytearray()
        try:
            if "chunked" not in (headers.get("Transfer-Encoding") or "").lower():
                n = int(headers.get("Content-Length") or 0)
                return await reader.readexactly(n) if 0 < n <= MAX_BODY else b""
            body_len = 0
            while True:
                line = await reader.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:
                        trailer = await reader.readline()
                        raw += trailer
                        if trailer in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                if body_len + size > MAX_BODY:
                    return bytes(raw)
                raw += await reader.readexactly(size)
                raw += await reader.readline()
                body_len += size
        except ValueError:  # a size that is not a number, or a line past the reader's limit
            return bytes(raw)

    @staticmethod
    async def send(writer, ops):
        for op in ops:
            if isinstance(op, bytes):
                writer.write(op)
            else:
                await writer.drain()
                await asyncio.sleep(op)
        await writer.drain()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks one")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--scenario", help="JSON file {\"steps\": [...]}; default: the demo brain")
    ap.add_argument("--log", help="append one JSON line per model request to this file")
    ap.add_argument("--require-key", help="answer 401 unless the request carries this key")
    ap.add_argument("--no-validate", action="store_true",
                    help="skip the request checks the real APIs make (400 errors)")
    ap.add_argument("--quiet", action="store_true", help="no per-request lines on stderr")
    ap.add_argument("--brain", choices=("demo", "chaos", "bench"), default="demo",
                    help="who answers without --scenario: the demo brain (repairs "
                         "examples/project), the chaos brain (tests/chaos's workload) or the "
                         "bench brain (bench/bench_engine.py's 3-call conversation)")
    ap.add_argument("--delay-ms", type=int, default=0,
                    help="wait this long before every model answer (a step's own delay_ms "
                         "wins)")
    args = ap.parse_args(argv)

    script = None
    if args.scenario:
        try:
            with open(args.scenario, encoding="utf-8") as f:
                script = load_scenario(json.load(f))
        except (OSError, ValueError) as e:
            sys.stderr.write("fake_model: bad scenario %s: %s\n" % (args.scenario, e))
            return 2
    server = Server((args.host, args.port), script, args.log, args.require_key,
                    not args.no_validate, args.quiet, args.brain, args.delay_ms)
    try:
        return asyncio.run(serve(server, args))
    finally:
        if server.log_file:
            server.log_file.close()


async def serve(server, args):
    try:
        port = await server.listen()
    except OSError as e:
        sys.stderr.write("fake_model: cannot listen on %s:%d: %s\n" % (args.host, args.port, e))
        return 1
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    sys.stdout.write("listening on %d\n" % port)
    sys.stdout.flush()
    await stopped.wait()
    server.listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
