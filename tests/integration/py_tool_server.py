"""A cflue.v1.Tools server in Python (grpcio generic handlers, no generated stubs): the second
example of a custom tool server (docs/tool-servers.md), and the one the tool-server tests start
with whatever tools they need.

    /usr/bin/python3 py_tool_server.py --tools '[{"name": "echo", "description": "...",
        "schema": {...}, "reply": "echoed", "sleep": 0}]' [--no-batch] [--list-sleep S]

It binds 127.0.0.1 on a free port and prints "listening on PORT" once serving. Each call's
result text is the tool's `reply` (`repeat` times) followed by the call's arguments JSON, after
sleeping `sleep` seconds; a tool's `description_hex` lists it with those bytes as its
description, UTF-8 or not (a broken server's); a tool's `images` ([{"name", "mime_type", "data" (base64) or "size" (that many
bytes, made up)}]) go with each result as ToolResult.images. With --no-batch, ExecuteBatch is left unimplemented (UNIMPLEMENTED, as the protocol
allows): the caller must use Execute per call. Every call is appended to --log as one JSON line.
"""

import argparse
import base64
import json
import sys
import threading
import time
from concurrent import futures

import grpc

import cflue_harness  # noqa: F401  (puts the generated modules on sys.path)
from cflue.v1 import common_pb2, tools_pb2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--tools', required=True, help='JSON list of tools')
    ap.add_argument('--no-batch', action='store_true')
    ap.add_argument('--log', default='')
    ap.add_argument('--port', type=int, default=0)
    ap.add_argument('--list-sleep', type=float, default=0, help='seconds each List takes')
    ap.add_argument('--list-sleep-sandbox', default='',
                    help='only a List for this sandbox takes --list-sleep (default: every List)')
    args = ap.parse_args()
    tools = json.loads(args.tools)
    by_name = {t['name']: t for t in tools}
    log_lock = threading.Lock()

    def run(call):
        if args.log:
            with log_lock, open(args.log, 'a') as f:
                f.write(json.dumps({'name': call.name, 'sandbox': call.sandbox,
                                    'arguments': call.arguments_json,
                                    'timeout_s': call.timeout.seconds}) + '\n')
        t = by_name.get(call.name)
        if t is None:
            return tools_pb2.ToolResult(text='no tool named %s' % call.name, is_error=True)
        time.sleep(t.get('sleep', 0))
        images = [common_pb2.Attachment(name=i.get('name', ''), mime_type=i['mime_type'],
                                        data=base64.b64decode(i['data']) if 'data' in i
                                        else (b'\x89PNG' * i['size'])[:i['size']])
                  for i in t.get('images', ())]
        reply = t.get('reply', '') * t.get('repeat', 1)
        return tools_pb2.ToolResult(text='%s %s' % (reply, call.arguments_json), images=images)

    def description(t):
        """The description, or a stand-in of the raw bytes' length (list_bytes swaps them)."""
        if 'description_hex' in t:
            return '\x01' * len(bytes.fromhex(t['description_hex']))
        return t.get('description', t['name'])

    def list_tools(req, ctx):
        if not args.list_sleep_sandbox or req.sandbox == args.list_sleep_sandbox:
            time.sleep(args.list_sleep)
        return tools_pb2.ListToolsResponse(tools=[
            tools_pb2.ToolSpec(name=t['name'], description=description(t),
                               parameters_json=json.dumps(t.get('schema', {'type': 'object'})))
            for t in tools])

    def list_bytes(resp):
        """The encoded listing, each raw description put in place of its stand-in (of the same
        length: the encoding's lengths stay right)."""
        data = resp.SerializeToString()
        for t in tools:
            if 'description_hex' in t:
                raw = bytes.fromhex(t['description_hex'])
                data = data.replace(b'\x01' * len(raw), raw, 1)
        return data

    def execute(call, ctx):
        return run(call)

    def execute_batch(batch, ctx):
        for i, call in enumerate(batch.calls):
            yield tools_pb2.BatchResult(index=i, result=run(call))

    handlers = {
        'List': grpc.unary_unary_rpc_method_handler(
            list_tools, request_deserializer=tools_pb2.ListToolsRequest.FromString,
            response_serializer=list_bytes),
        'Execute': grpc.unary_unary_rpc_method_handler(
            execute, request_deserializer=tools_pb2.ToolCall.FromString,
            response_serializer=tools_pb2.ToolResult.SerializeToString),
    }
    if not args.no_batch:
        handlers['ExecuteBatch'] = grpc.unary_stream_rpc_method_handler(
            execute_batch, request_deserializer=tools_pb2.ToolBatch.FromString,
            response_serializer=tools_pb2.BatchResult.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler('cflue.v1.Tools', handlers),))
    port = server.add_insecure_port('127.0.0.1:%d' % args.port)
    server.start()
    sys.stdout.write('listening on %d\n' % port)
    sys.stdout.flush()
    server.wait_for_termination()


if __name__ == '__main__':
    main()
