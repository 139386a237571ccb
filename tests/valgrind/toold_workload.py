"""A toold workload for leak checking: every tool and Sandbox method, errors included.

Usage: toold_workload.py ADDR   (toold already listening at ADDR)
"""
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.environ.get("CFLUE_BUILD_DIR", "build"), "py"))
import grpc  # noqa: E402
from cflue.v1 import sandbox_pb2 as sb, tools_pb2 as t  # noqa: E402

ch = grpc.insecure_channel(sys.argv[1])
ex = ch.unary_unary("/cflue.v1.Tools/Execute", request_serializer=t.ToolCall.SerializeToString,
                    response_deserializer=t.ToolResult.FromString)
batch = ch.unary_stream("/cflue.v1.Tools/ExecuteBatch", request_serializer=t.ToolBatch.SerializeToString,
                        response_deserializer=t.BatchResult.FromString)


def tool(name, args, raw=None):
    return ex(t.ToolCall(sandbox="vg", call_id="c", name=name,
                         arguments_json=raw if raw is not None else json.dumps(args)), timeout=60)


def sandbox(method, req, resp, ok=True):
    fn = ch.unary_unary("/cflue.v1.Sandbox/" + method, request_serializer=type(req).SerializeToString,
                        response_deserializer=resp.FromString)
    try:
        out = fn(req, timeout=60)
        assert ok, method
        return out
    except grpc.RpcError:
        assert not ok, method
        return None


ch.unary_unary("/cflue.v1.Tools/List", request_serializer=t.ListToolsRequest.SerializeToString,
               response_deserializer=t.ListToolsResponse.FromString)(t.ListToolsRequest(), timeout=30)
tool("write", {"path": "d/a.txt", "content": "one\ntwo\nthree\n" * 2000})
tool("read", {"path": "d/a.txt"})
tool("read", {"path": "d/a.txt", "offset": 3000, "limit": 5})
tool("read", {"path": "d/a.txt", "offset": 999999})
tool("read", {"path": "d"})
tool("read", {"path": "../x"})
tool("edit", {"path": "d/a.txt", "oldText": "one", "newText": "1", "replaceAll": True})
tool("edit", {"path": "d/a.txt", "oldText": "two", "newText": "2"})
tool("edit", {"path": "d/a.txt", "oldText": "", "newText": "2"})
tool("bash", {"command": "seq 1 100000; echo done >&2; exit 2"})
tool("bash", {"command": "sleep 5", "timeout": 0.3})
tool("bash", {"command": "echo hi", "timeout": -1})
tool("grep", {"pattern": "thr+ee", "path": "d"})
tool("grep", {"pattern": "(", "path": "d"})
tool("grep", {"pattern": "1", "literal": True, "include": "*.txt"})
tool("glob", {"pattern": "*.txt"})
tool("glob", {"pattern": "a/b"})
call = t.ToolCall(sandbox="vg", name="bash", arguments_json='{"command": "sleep 5"}')
call.timeout.FromMilliseconds(300)
ex(call, timeout=60)
call.timeout.seconds, call.timeout.nanos = -1, 0
try:
    ex(call, timeout=60)
    raise AssertionError("a negative timeout ran")
except grpc.RpcError:
    pass
tool("nope", {})
tool("read", None, raw="{bad json")
tool("read", None, raw='{"path": 1}')
calls = [t.ToolCall(sandbox="vg", name="edit", arguments_json=json.dumps(
    {"path": "d/b.txt", "oldText": "x%d" % i, "newText": "y%d" % i})) for i in range(5)]
tool("write", {"path": "d/b.txt", "content": "".join("x%d\n" % i for i in range(5))})
list(batch(t.ToolBatch(calls=calls), timeout=60))
threads = [threading.Thread(target=tool, args=("bash", {"command": "echo %d" % i})) for i in range(8)]
[th.start() for th in threads]
[th.join() for th in threads]
sandbox("WriteFile", sb.WriteFileRequest(sandbox="vg", path="s/f.bin", data=b"\x00\x01" * 1000), sb.WriteFileResponse)
sandbox("ReadFile", sb.ReadFileRequest(sandbox="vg", path="s/f.bin"), sb.ReadFileResponse)
sandbox("ReadFile", sb.ReadFileRequest(sandbox="vg", path="missing"), sb.ReadFileResponse, ok=False)
sandbox("Stat", sb.PathRequest(sandbox="vg", path="s/f.bin"), sb.FileInfo)
for i in range(30):
    sandbox("WriteFile", sb.WriteFileRequest(sandbox="vg", path="s/p%02d" % i, data=b"x"), sb.WriteFileResponse)
token, seen = "", 0
while True:
    page = sandbox("ReadDir", sb.ReadDirRequest(sandbox="vg", path="s", page_size=7, page_token=token),
                   sb.ReadDirResponse)
    seen += len(page.entries)
    token = page.next_page_token
    if not token:
        break
assert seen == 31, seen
sandbox("ReadDir", sb.ReadDirRequest(sandbox="vg", path="d", page_token="7a7a"), sb.ReadDirResponse, ok=False)
sandbox("ReadDir", sb.ReadDirRequest(sandbox="vg", path="s/f.bin"), sb.ReadDirResponse, ok=False)
sandbox("ReadFile", sb.ReadFileRequest(sandbox="vg", path="s"), sb.ReadFileResponse, ok=False)
sandbox("Remove", sb.RemoveRequest(sandbox="vg", path="s"), sb.RemoveResponse, ok=False)
sandbox("Mkdir", sb.MkdirRequest(sandbox="vg", path="m/n/o", parents=True), sb.MkdirResponse)
sandbox("Remove", sb.RemoveRequest(sandbox="vg", path="m", recursive=True), sb.RemoveResponse)
sandbox("Exec", sb.ExecRequest(sandbox="vg", command="cat; echo $X", env={"X": "1"}, stdin=b"in"), sb.ExecResponse)
sandbox("Exec", sb.ExecRequest(sandbox="../bad", command="true"), sb.ExecResponse, ok=False)
req = sb.ExecRequest(sandbox="vg", command="sleep 5")
req.timeout.FromMilliseconds(200)
assert sandbox("Exec", req, sb.ExecResponse).timed_out
req.timeout.nanos = -1
sandbox("Exec", req, sb.ExecResponse, ok=False)
print("toold workload done")
