"""toold's test helpers on the v1 protocol, over cflue_harness.

The toold part of cflue_harness (tool_call, Toold.sandbox, SANDBOX_METHODS, truncation_dict)
still speaks the old protocol: ToolCall.timeout_ms, ReadDir(PathRequest), TruncatedBy in
tools.proto. Until it is brought over, the toold tests import these from here; importing this
module also points the harness's Toold at them. Tests keep writing timeout_ms=N (milliseconds):
it becomes the Duration field `timeout`.
"""

import json

import cflue_harness
from cflue_harness import sandbox_pb2, tools_pb2
from cflue.v1 import common_pb2  # noqa: E402


def set_timeout_ms(msg, timeout_ms):
    """Sets msg.timeout (a Duration) to timeout_ms milliseconds; 0 or None leaves it unset."""
    if timeout_ms:
        msg.timeout.FromMilliseconds(timeout_ms)
    return msg


def tool_call(sandbox, name, arguments, timeout_ms=0, call_id=''):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = tools_pb2.ToolCall(sandbox=sandbox, name=name, arguments_json=args, call_id=call_id)
    return set_timeout_ms(call, timeout_ms)


def truncation_dict(res):
    t = res.truncation
    return {'truncated': t.truncated, 'by': common_pb2.TruncatedBy.Name(t.by),
            'total_lines': t.total_lines, 'total_bytes': t.total_bytes,
            'shown_first_line': t.shown_first_line, 'shown_last_line': t.shown_last_line,
            'next_offset': t.next_offset, 'line_too_long': t.line_too_long}


def _sandbox(self, method, timeout=60, **fields):
    """Calls /cflue.v1.Sandbox/<method> with a request built from fields (timeout_ms=N sets
    the request's Duration `timeout`; `timeout` is the RPC's own deadline in seconds)."""
    req_cls, resp_cls = cflue_harness.SANDBOX_METHODS[method]
    timeout_ms = fields.pop('timeout_ms', 0)
    req = set_timeout_ms(req_cls(**fields), timeout_ms)
    c = self._current_channel().unary_unary(
        '/cflue.v1.Sandbox/' + method, request_serializer=req_cls.SerializeToString,
        response_deserializer=resp_cls.FromString)
    return c(req, timeout=timeout)


def _error_reason(rpc_error):
    """The ErrorInfo reason of a grpc.RpcError ('' when it carries none)."""
    from google.rpc import error_details_pb2, status_pb2
    for key, value in (rpc_error.trailing_metadata() or ()):
        if key == 'grpc-status-details-bin':
            st = status_pb2.Status.FromString(value)
            for d in st.details:
                info = error_details_pb2.ErrorInfo()
                if d.Unpack(info):
                    return info.reason
    return ''


error_reason = getattr(cflue_harness, 'error_reason', _error_reason)

cflue_harness.SANDBOX_METHODS['ReadDir'] = (sandbox_pb2.ReadDirRequest,
                                            sandbox_pb2.ReadDirResponse)
cflue_harness.tool_call = tool_call
cflue_harness.truncation_dict = truncation_dict
cflue_harness.Toold.sandbox = _sandbox
