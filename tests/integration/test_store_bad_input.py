"""Bad input: malformed bytes, missing fields, oversized messages, unknown ids, conflicting
settles, out-of-range offsets, unknown methods. One daemon serves the whole class and must
still be healthy at the end (test_zz_still_serving runs last: unittest sorts by name)."""

import base64
import unittest

import grpc
STALE = grpc.StatusCode.ABORTED  # a stale fence (reason STALE_FENCE)
from cflue_harness import (
    error_reason, duration, admit_request,
    ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT, MiB, NOT_FOUND, OUT_OF_RANGE,
    RESOURCE_EXHAUSTED, SERVING, UNIMPLEMENTED, StoragedTestCase, common_pb2, store_pb2,
    admit, admit_request, append, claim, fence, get, read, record, settle)

GARBAGE = b'\xff\xff\xff'


class BadInputTest(StoragedTestCase):
    shared_storaged = True

    stopped = False

    def tearDown(self):
        if not type(self).stopped:
            self.assertTrue(self.storaged.alive(),
                            'storaged died:\n' + self.storaged.stderr_text())

    def running(self, conv=''):
        s = admit(self.stub, conv=conv).submission
        c = claim(self.stub, submission_id=s.submission_id)
        self.assertTrue(c.HasField('submission'))
        return c

    def invalid(self, fn, *args, **kwargs):
        """INVALID_ARGUMENT whose details name `field` (all of a list, or any of a tuple)."""
        field = kwargs.pop('field', None)
        e = self.assertRpcError(INVALID_ARGUMENT, fn, *args, **kwargs)
        if field is not None:
            details = (e.details() or '').lower()
            if isinstance(field, tuple):
                self.assertTrue(any(f.lower() in details for f in field),
                                'details %r name none of %r' % (e.details(), field))
            else:
                self.assertIn(field.lower(), details, 'details %r do not name %r'
                              % (e.details(), field))
        return e

    # ---- malformed protobuf ----

    def test_malformed_bytes(self):
        """Undecodable request bytes → INVALID_ARGUMENT, for unary and streaming methods."""
        for m in ('Admit', 'Claim', 'Settle', 'Append', 'Get', 'Heartbeat'):
            self.assertRpcError(INVALID_ARGUMENT, self.stub.raw, '/cflue.v1.Store/' + m, GARBAGE)
        self.assertRpcError(INVALID_ARGUMENT, self.stub.raw, '/cflue.v1.Store/Follow', GARBAGE,
                            streaming=True)

    # ---- missing or invalid fields ----

    def test_admit_missing_fields(self):
        """Admit without agent / without message → INVALID_ARGUMENT naming the field."""
        self.invalid(self.stub.admit, store_pb2.AdmitRequest(
            message=common_pb2.Message(text='hi')), field='agent')
        self.invalid(self.stub.admit, store_pb2.AdmitRequest(agent='assistant'),
                     field='message')

    def test_admit_invalid_fields(self):
        """Admit field rules: agent charset/length, conversation id charset/length, text or
        attachments, mime_type, at most 16 attachments, key at most 256 chars, at most 64
        metadata entries."""
        s = self.stub
        self.invalid(admit, s, agent='bad agent!', field='agent')
        self.invalid(admit, s, agent='a' * 129, field='agent')
        self.invalid(admit, s, conv='bad/conv', field='conversation_id')
        self.invalid(admit, s, conv='c' * 129, field='conversation_id')
        self.invalid(admit, s, text='', field=('text', 'message', 'attachment'))
        self.invalid(admit, s, attachments=[{'name': 'x.png', 'data': b'123'}],
                     field='mime_type')
        self.invalid(admit, s, attachments=[{'mime_type': 'text/plain', 'data': b'x'}] * 17,
                     field='attachments')
        self.invalid(admit, s, key='k' * 257, field='idempotency_key')
        self.invalid(admit, s, metadata={'k%d' % i: 'v' for i in range(65)},
                     field='metadata')
        # the limits themselves are accepted
        ok = admit(s, agent='a' * 128, conv='c' * 128, key='k' * 256,
                   metadata={'k%d' % i: 'v' for i in range(64)},
                   attachments=[{'mime_type': 'text/plain', 'data': b'x'}] * 16)
        self.assertEqual(ok.submission.conversation_id, 'c' * 128)
        self.assertEqual(len(ok.submission.message.attachments), 16)
        ok = admit(s, agent='A-z_0.9', conv='Conv_1.2-3', text='',
                   attachments=[{'mime_type': 'image/png', 'data': b'x'}])
        self.assertEqual(ok.submission.agent, 'A-z_0.9')

    def test_admit_reserved_metadata_and_kinds(self):
        """Metadata keys starting "cflue." are RESERVED_METADATA_KEY; kind COMPACT needs an
        existing conversation and no message; an unknown kind is refused."""
        s = self.stub
        e = self.invalid(admit, s, metadata={'cflue.kind': 'compact'}, field='cflue.kind')
        self.assertEqual(error_reason(e), 'RESERVED_METADATA_KEY')
        self.assertEqual(admit(s, metadata={'cflueX': '1', 'x.cflue.': '2'})
                         .submission.metadata['cflueX'], '1')
        self.invalid(admit, s, kind=common_pb2.SUBMISSION_KIND_COMPACT, field='conversation_id')
        self.assertRpcError(NOT_FOUND, admit, s, conv='never', kind=common_pb2.SUBMISSION_KIND_COMPACT)
        req = admit_request(conv='x', kind=common_pb2.SUBMISSION_KIND_COMPACT)
        req.message.text = 'no'
        self.invalid(s.admit, req, field='message')
        self.invalid(s.admit, admit_request(kind=7), field='kind')

    def test_durations_and_page_sizes(self):
        """lease_duration is 100 ms to 1 h (or unset); negative page sizes are refused;
        RequestAbort needs its target."""
        s = self.stub
        for ms in (1, 99, 3600001):
            self.invalid(s.claim, store_pb2.ClaimRequest(owner_id='o', lease_duration=duration(ms)),
                         field='lease_duration')
        self.invalid(s.heartbeat, store_pb2.HeartbeatRequest(owner_id='o',
                                                             lease_duration=duration(50)),
                     field='lease_duration')
        fence = store_pb2.Fence(submission_id='sub_x', attempt_id='att_x', epoch=1)
        self.invalid(s.release, store_pb2.ReleaseRequest(fences=[fence]), field='owner_id')
        self.invalid(s.release, store_pb2.ReleaseRequest(owner_id='o', fences=[fence] * 1001),
                     field='fences')
        self.invalid(s.release, store_pb2.ReleaseRequest(owner_id='o', fences=[
            store_pb2.Fence(attempt_id='att_x', epoch=1)]), field='submission_id')
        self.invalid(s.release, store_pb2.ReleaseRequest(
            owner_id='o', fences=[fence], expire_after=duration(3600001)), field='expire_after')
        self.invalid(s.list, store_pb2.ListRequest(page_size=-1), field='page_size')
        self.invalid(s.scan_expired, store_pb2.ScanExpiredRequest(page_size=-1), field='page_size')
        self.invalid(s.read, store_pb2.ReadRequest(conversation_id='c', page_size=-1),
                     field='page_size')
        self.invalid(s.request_abort, store_pb2.RequestAbortRequest(reason='x'), field='target')
        e = self.invalid(s.scan_expired, store_pb2.ScanExpiredRequest(page_token='zz'))
        self.assertEqual(error_reason(e), 'INVALID_PAGE_TOKEN')

    def test_claim_missing_owner(self):
        """Claim without owner_id → INVALID_ARGUMENT naming owner_id."""
        self.invalid(self.stub.claim, store_pb2.ClaimRequest(lease_duration=duration(1000)), field='owner_id')

    def test_append_missing_and_invalid_fields(self):
        """Append without fence → names fence; 0 or 1001 records; a record without a body
        (MISSING_RECORD_BODY); a submission_settled (RESERVED_RECORD_TYPE); each body type's
        field checks."""
        c = self.running()
        self.invalid(self.stub.append, store_pb2.AppendRequest(records=[record()]),
                     field='fence')
        self.invalid(append, self.stub, c.fence, [], field='records')
        self.invalid(append, self.stub, c.fence, [record() for _ in range(1001)],
                     field='records')
        e = self.invalid(append, self.stub, c.fence, [common_pb2.Record(id='x')],
                         field='records[0]')
        self.assertEqual(error_reason(e), 'MISSING_RECORD_BODY')
        e = self.invalid(append, self.stub, c.fence, [record('submission_settled')],
                         field='submission_settled')
        self.assertEqual(error_reason(e), 'RESERVED_RECORD_TYPE')
        bad = [('assistant_message', {'turn': 0}, 'turn'),
               ('assistant_delta', {'turn': -1}, 'turn'),
               ('tool_result', {'turn': 0}, 'turn'),
               ('tool_result', {'index': -1}, 'index'),
               ('tool_result', {'tool_call_id': ''}, 'tool_call_id'),
               ('tool_result', {'name': ''}, 'name'),
               ('signal', {'kind': 'Bad-Kind'}, 'signal.kind'),
               ('signal', {'kind': ''}, 'signal.kind'),
               ('signal', {'kind': 'k' * 65}, 'signal.kind'),
               ('compaction', {'trigger': 'COMPACTION_TRIGGER_UNSPECIFIED'}, 'trigger'),
               ('compaction', {'first_kept_offset': -1}, 'first_kept_offset'),
               ('assistant_message', {'tool_calls': [{'id': 'a', 'name': 'x'},
                                                     {'id': 'a', 'name': 'y'}]}, 'repeats'),
               ('assistant_message', {'tool_calls': [{'id': '', 'name': 'x'}]}, 'tool_calls'),
               ('assistant_message', {'usage': {'input_tokens': -1}}, 'usage'),
               ('user_message', {'attachments': [{'size_bytes': -1}]}, 'size_bytes')]
        # a tool result's images: a type no provider shows, none or too many bytes, more than
        # 8 of them, more than 6 MiB together
        png = {'name': 'image-1', 'mime_type': 'image/png', 'data': 'iVBORw=='}
        b64 = lambda n: base64.b64encode(b'\0' * n).decode()  # noqa: E731
        bad += [('tool_result', {'images': [dict(png, mime_type='image/svg+xml')]},
                 "tool_result.images[0].mime_type 'image/svg+xml' is not one of"),
                ('tool_result', {'images': [png, dict(png, data='')]},
                 'tool_result.images[1].data is 0 bytes'),
                ('tool_result', {'images': [dict(png, data=b64(5 * MiB + 1))]},
                 'tool_result.images[0].data is 5242881 bytes; it must be 1 to 5242880'),
                ('tool_result', {'images': [png] * 9},
                 'tool_result.images: 9 images; the limit is 8'),
                ('tool_result', {'images': [dict(png, data=b64(3 * MiB + 512 * 1024))] * 2},
                 'tool_result.images hold 7340032 bytes together; the limit is 6291456')]
        for type_, body, field in bad:
            self.invalid(append, self.stub, c.fence, [record(type_, body)], field=field)
        self.invalid(append, self.stub, c.fence, [record(id_='settled:x')], field='settled:')
        # ids repeated within the batch: the first record that repeats one is named, with the
        # first record of that id (a thousand records, checked on the poller, sorted)
        ids = ['r%d' % i for i in range(1000)]
        ids[700], ids[999], ids[800] = 'r3', 'r500', 'r3'
        e = self.invalid(append, self.stub, c.fence, [record(id_=i) for i in ids],
                         field='records[700]')
        self.assertIn("records[700].id 'r3' repeats records[3]", e.details())
        conv = c.submission.conversation_id
        self.assertEqual(read(self.stub, conv).head_offset, -1)
        r = append(self.stub, c.fence, [record() for _ in range(1000)])
        self.assertEqual((r.first_offset, r.last_offset), (0, 999))

    def test_settle_missing_fields(self):
        """Settle without outcome → names outcome; FAILED/ABORTED without error → names
        error; the row is untouched."""
        c = self.running()
        self.invalid(self.stub.settle, store_pb2.SettleRequest(fence=c.fence), field='outcome')
        self.invalid(settle, self.stub, c.fence, common_pb2.OUTCOME_FAILED, '', field='error')
        self.invalid(settle, self.stub, c.fence, common_pb2.OUTCOME_ABORTED, '', field='error')
        self.invalid(settle, self.stub, c.fence, common_pb2.OUTCOME_FAILED, '', reserve_only=True,
                     field='error')
        self.assertEqual(get(self.stub, c.fence.submission_id).status, common_pb2.SUBMISSION_STATUS_RUNNING)

    # ---- size ----

    def test_oversized_message(self):
        """A 20 MiB attachment (client send limit 64 MiB) → RESOURCE_EXHAUSTED; nothing
        admitted."""
        big = b'\0' * (20 * MiB)
        self.assertRpcError(RESOURCE_EXHAUSTED, admit, self.stub, key='oversized',
                            attachments=[{'mime_type': 'application/octet-stream',
                                          'data': big}], timeout=30)
        again = admit(self.stub, key='oversized')
        self.assertFalse(again.deduplicated)

    def test_admission_that_no_answer_could_carry(self):
        """An attachment that brings the admission just under the 16 MiB limit: the Admit
        committed, its answer (the Submission carries the message) was over the limit and was
        never sent (the caller heard RESOURCE_EXHAUSTED), every Claim of it failed the same way
        and it never settled, its conversation blocked behind it. Refused now, by name; one
        64 KiB under the limit is admitted, claimed and read whole."""
        conv = 'c-near-limit'
        near = b'\0' * (16 * MiB - 2048)
        e = self.invalid(admit, self.stub, conv=conv, key='near-limit', field='at most',
                         attachments=[{'mime_type': 'application/octet-stream', 'data': near}],
                         timeout=30)
        self.assertEqual(error_reason(e), 'ADMISSION_TOO_LARGE')
        fits = b'\0' * (16 * MiB - 65 * 1024 - 4096)
        sub = admit(self.stub, conv=conv, key='fits', timeout=30,
                    attachments=[{'mime_type': 'application/octet-stream', 'data': fits}])
        c = claim(self.stub, submission_id=sub.submission.submission_id, timeout=30)
        self.assertEqual(len(c.submission.message.attachments[0].data), len(fits))
        self.assertEqual(len(get(self.stub, sub.submission.submission_id)
                             .message.attachments[0].data), len(fits))

    # ---- unknown ids ----

    def test_unknown_submission(self):
        """Get / Settle of an unknown submission id → NOT_FOUND."""
        self.assertRpcError(NOT_FOUND, get, self.stub, 'sub_unknown')
        self.assertRpcError(NOT_FOUND, settle, self.stub, fence('sub_unknown'),
                            common_pb2.OUTCOME_FAILED, 'x')
        self.assertRpcError(NOT_FOUND, settle, self.stub, fence('sub_unknown', 'att_x', 3),
                            common_pb2.OUTCOME_COMPLETED)

    # ---- conflicting settles ----

    def test_second_settle_with_other_outcome(self):
        """A second Settle with another outcome → FAILED_PRECONDITION and the first outcome
        is kept; the identical Settle by the same attempt → OK, already_settled."""
        c = self.running()
        first = settle(self.stub, c.fence, common_pb2.OUTCOME_COMPLETED)
        self.assertFalse(first.already_settled)
        e = self.assertRpcError(FAILED_PRECONDITION, settle, self.stub, c.fence,
                                common_pb2.OUTCOME_FAILED, 'too late')
        self.assertTrue(e.details())
        self.assertRpcError(FAILED_PRECONDITION, settle, self.stub, c.fence,
                            common_pb2.OUTCOME_ABORTED, 'too late')
        row = get(self.stub, c.fence.submission_id)
        self.assertEqual((row.status, row.outcome, row.error),
                         (common_pb2.SUBMISSION_STATUS_SETTLED, common_pb2.OUTCOME_COMPLETED, ''))
        again = settle(self.stub, c.fence, common_pb2.OUTCOME_COMPLETED)
        self.assertTrue(again.already_settled)
        self.assertEqual(again.submission.outcome, common_pb2.OUTCOME_COMPLETED)
        self.assertEqual(again.record_offset, first.record_offset)
        conv = c.submission.conversation_id
        self.assertEqual(read(self.stub, conv).head_offset, first.record_offset)

    # ---- offsets ----

    def test_offset_beyond_head(self):
        """Read/Follow with after_offset beyond the head → OUT_OF_RANGE; unknown
        conversation → NOT_FOUND."""
        c = self.running()
        conv = c.submission.conversation_id
        self.assertRpcError(OUT_OF_RANGE, read, self.stub, conv, 0)
        append(self.stub, c.fence, [record(), record()])
        self.assertRpcError(OUT_OF_RANGE, read, self.stub, conv, 2)
        self.assertRpcError(OUT_OF_RANGE, read, self.stub, conv, 1000)
        self.assertEqual(len(read(self.stub, conv, 1).records), 0)

        def follow(after, conversation=conv):
            return list(self.stub.follow(store_pb2.FollowRequest(
                conversation_id=conversation, after_offset=after), timeout=5))
        self.assertRpcError(OUT_OF_RANGE, follow, 2)
        self.assertRpcError(OUT_OF_RANGE, follow, 99)
        self.assertRpcError(NOT_FOUND, read, self.stub, 'no-such-conversation', -1)
        self.assertRpcError(NOT_FOUND, follow, -1, 'no-such-conversation')

    # ---- methods and services ----

    def test_unknown_method(self):
        """/cflue.v1.Store/Nope and an unknown service → UNIMPLEMENTED; an unknown health
        service → NOT_FOUND."""
        self.assertRpcError(UNIMPLEMENTED, self.stub.raw, '/cflue.v1.Store/Nope', b'')
        self.assertRpcError(UNIMPLEMENTED, self.stub.raw, '/cflue.v1.Nope/Admit', b'')
        self.assertRpcError(NOT_FOUND, self.storaged.health_check, 'cflue.v1.Nope')
        self.assertEqual(self.storaged.health_check('cflue.v1.Store'), SERVING)

    def test_conflicting_key_does_not_break_later_admits(self):
        """ALREADY_EXISTS is an ordinary answer; the same key keeps working afterwards."""
        a = admit(self.stub, key='bad-input-key', text='one')
        self.assertRpcError(ALREADY_EXISTS, admit, self.stub, key='bad-input-key', text='two')
        b = admit(self.stub, key='bad-input-key', text='one')
        self.assertEqual(a.submission.submission_id, b.submission.submission_id)

    def test_zz_still_serving(self):
        """After all of the above, Health is SERVING and an Admit still works."""
        self.assertEqual(self.storaged.health_check(''), SERVING)
        self.assertEqual(self.storaged.health_check('cflue.v1.Store'), SERVING)
        r = self.stub.admit(admit_request(text='still here'))
        self.assertEqual(r.submission.status, common_pb2.SUBMISSION_STATUS_QUEUED)
        self.assertEqual(get(self.stub, r.submission.submission_id).message.text, 'still here')
        type(self).stopped = True
        self.storaged.stop()


if __name__ == '__main__':
    unittest.main()
