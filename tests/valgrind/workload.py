"""A storaged workload for leak checking: every Store method, errors included, then SIGTERM.

Usage: workload.py ADDR   (storaged already listening at ADDR)
"""
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.environ.get("CFLUE_BUILD_DIR", "build"), "py"))
import grpc  # noqa: E402
from cflue.v1 import common_pb2 as c, store_pb2 as s  # noqa: E402
from google.protobuf import duration_pb2  # noqa: E402
import health_pb2  # noqa: E402

ch = grpc.insecure_channel(sys.argv[1])


def call(method, req, resp, ok=True):
    fn = ch.unary_unary("/cflue.v1.Store/" + method, request_serializer=type(req).SerializeToString,
                        response_deserializer=resp.FromString)
    try:
        out = fn(req, timeout=30)
        assert ok, method + " should have failed"
        return out
    except grpc.RpcError as e:
        assert not ok, "%s failed: %s %s" % (method, e.code(), e.details())
        return e.code()


def follow(conv, until):
    fn = ch.unary_stream("/cflue.v1.Store/Follow", request_serializer=s.FollowRequest.SerializeToString,
                         response_deserializer=c.Record.FromString)
    return list(fn(s.FollowRequest(conversation_id=conv, after_offset=-1, until_settled=until), timeout=30))


for i in range(20):
    a = call("Admit", s.AdmitRequest(agent="leak", conversation_id="conv-%d" % (i % 3),
                                     idempotency_key="k%d" % i, metadata={"i": str(i)},
                                     message=c.Message(text="m%d" % i, attachments=[
                                         c.Attachment(name="a", mime_type="text/plain", data=b"x" * 100)])),
             s.AdmitResponse)
    call("Admit", s.AdmitRequest(agent="leak", conversation_id="conv-%d" % (i % 3), idempotency_key="k%d" % i,
                                 metadata={"i": str(i)}, message=c.Message(text="m%d" % i, attachments=[
                                     c.Attachment(name="a", mime_type="text/plain", data=b"x" * 100)])),
         s.AdmitResponse)
    call("Admit", s.AdmitRequest(agent="leak", idempotency_key="k%d" % i, message=c.Message(text="other")),
         s.AdmitResponse, ok=False)
for n in range(3):
    cl = call("Claim", s.ClaimRequest(owner_id="w"), s.ClaimResponse)
    f = cl.fence
    conv = cl.submission.conversation_id
    t = threading.Thread(target=follow, args=(conv, f.submission_id))
    t.start()
    call("Heartbeat", s.HeartbeatRequest(owner_id="w", fences=[f]), s.HeartbeatResponse)
    call("MarkInputApplied", s.MarkInputAppliedRequest(fence=f, max_attempts=3), c.Submission)
    js = call("ClaimJoinable", s.ClaimJoinableRequest(host=f, limit=2), s.ClaimJoinableResponse)
    for j in js.submissions:
        call("Append", s.AppendRequest(fence=f, records=[c.Record(
            id="input:" + j.submission_id, submission_id=j.submission_id,
            user_message=c.UserMessage(text="joined", attachments=[
                c.AttachmentRef(name="a", mime_type="text/plain", size_bytes=100)]))]),
             s.AppendResponse)
    if js.submissions:
        call("FinalizeJoin", s.JoinRequest(host=f, submission_id=js.submissions[0].submission_id), c.Submission)
    if len(js.submissions) > 1:
        call("RevertJoin", s.JoinRequest(host=f, submission_id=js.submissions[1].submission_id), c.Submission)
    # every record type agentd writes, each body with its nested messages
    call("Append", s.AppendRequest(fence=f, records=[
        c.Record(id="system:%d" % n, system_prompt=c.SystemPrompt(text="sys")),
        c.Record(id="delta:%d" % n, assistant_delta=c.AssistantDelta(turn=1, text="d")),
        c.Record(id="assistant:%d" % n, assistant_message=c.AssistantMessage(
            turn=1, text="t", stop_reason="tool_use", model="m/x",
            tool_calls=[c.ToolCallRequest(id="x", name="bash", arguments_json="{}")],
            usage=c.Usage(input_tokens=1, output_tokens=2, cost_usd=0.5))),
        c.Record(id="tool:%d" % n, tool_result=c.ToolCallResult(
            turn=1, tool_call_id="x", name="bash", text="out", truncation=c.Truncation(
                truncated=True, by=c.TRUNCATED_BY_LINES, total_lines=3))),
        c.Record(id="signal:%d" % n, signal=c.Signal(kind="resources", text="s")),
        c.Record(id="compaction:%d" % n, compaction=c.Compaction(
            summary="sum", first_kept_offset=1, trigger=c.COMPACTION_TRIGGER_REQUEST))]),
         s.AppendResponse)
    # refused: no body; a settlement (storaged's own record type); the same id, other content
    call("Append", s.AppendRequest(fence=f, records=[c.Record(id="nobody")]), s.AppendResponse,
         ok=False)
    call("Append", s.AppendRequest(fence=f, records=[c.Record(
        id="settled:x", submission_settled=c.SubmissionSettled(outcome=c.OUTCOME_COMPLETED))]),
         s.AppendResponse, ok=False)
    call("Append", s.AppendRequest(fence=f, records=[c.Record(
        id="system:%d" % n, system_prompt=c.SystemPrompt(text="other"))]), s.AppendResponse, ok=False)
    call("RequestAbort", s.RequestAbortRequest(submission_id=f.submission_id, reason="test"), s.RequestAbortResponse)
    call("Settle", s.SettleRequest(fence=f, outcome=c.OUTCOME_FAILED, error="e", reserve_only=True),
         s.SettleResponse)
    call("Settle", s.SettleRequest(fence=f, outcome=c.OUTCOME_COMPLETED,
                                   usage=c.Usage(input_tokens=3, output_tokens=4)), s.SettleResponse)
    call("Settle", s.SettleRequest(fence=f, outcome=c.OUTCOME_COMPLETED), s.SettleResponse, ok=False)
    t.join()
    page = call("Read", s.ReadRequest(conversation_id=conv, after_offset=-1, page_size=2), s.ReadResponse)
    while page.next_page_token:
        page = call("Read", s.ReadRequest(conversation_id=conv, page_token=page.next_page_token, page_size=2),
                    s.ReadResponse)
    call("Read", s.ReadRequest(conversation_id=conv, page_token="garbled"), s.ReadResponse, ok=False)
    call("Read", s.ReadRequest(conversation_id=conv, after_offset=10**6), s.ReadResponse, ok=False)
    call("GetConversation", s.ConversationRequest(conversation_id=conv), s.Conversation)
cl = call("Claim", s.ClaimRequest(owner_id="w", lease_duration=duration_pb2.Duration(nanos=100 * 10**6)),
          s.ClaimResponse)
call("Requeue", s.FencedRequest(fence=cl.fence), c.Submission)
call("RequestAbort", s.RequestAbortRequest(conversation_id="conv-0"), s.RequestAbortResponse)
call("RequestAbort", s.RequestAbortRequest(), s.RequestAbortResponse, ok=False)
call("ScanExpired", s.ScanExpiredRequest(page_size=1), s.ListResponse)
page = call("List", s.ListRequest(statuses=[c.SUBMISSION_STATUS_QUEUED, c.SUBMISSION_STATUS_SETTLED], page_size=5),
            s.ListResponse)
while page.next_page_token:
    page = call("List", s.ListRequest(statuses=[c.SUBMISSION_STATUS_QUEUED, c.SUBMISSION_STATUS_SETTLED],
                                      page_size=5, page_token=page.next_page_token), s.ListResponse)
call("List", s.ListRequest(page_token="garbled"), s.ListResponse, ok=False)
call("Admit", s.AdmitRequest(agent="leak", message=c.Message(text="m"), metadata={"cflue.kind": "x"}),
     s.AdmitResponse, ok=False)
call("Admit", s.AdmitRequest(agent="leak", conversation_id="conv-0", kind=c.SUBMISSION_KIND_COMPACT),
     s.AdmitResponse)
call("Admit", s.AdmitRequest(agent="leak", conversation_id="conv-none", kind=c.SUBMISSION_KIND_COMPACT),
     s.AdmitResponse, ok=False)
call("Get", s.GetRequest(submission_id="missing"), c.Submission, ok=False)
call("Get", s.GetRequest(), c.Submission, ok=False)
raw = ch.unary_unary("/cflue.v1.Store/Admit", request_serializer=lambda b: b, response_deserializer=lambda b: b)
try:
    raw(b"\xff\xff\xff", timeout=10)
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
h = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                   response_deserializer=health_pb2.HealthCheckResponse.FromString)
assert h(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
# Backup: a whole copy streamed, then one cancelled after its first chunk
bk = ch.unary_stream("/cflue.v1.Store/Backup", request_serializer=s.BackupRequest.SerializeToString,
                     response_deserializer=s.BackupChunk.FromString)
chunks = list(bk(s.BackupRequest(), timeout=60))
assert chunks[-1].done and chunks[-1].size_bytes == sum(len(x.data) for x in chunks), chunks[-1]
part = bk(s.BackupRequest(), timeout=60)
next(part)
part.cancel()
print("workload done")
