"""Read pages and Follow batches are bounded by bytes, not only by record count (issue 7,
defect 3). Before the fix, once a conversation's records within one 1000-record page added up
to more than the message limit, every Read failed RESOURCE_EXHAUSTED and the conversation
could never settle. Append bounds each record so that one record always fits a page.
"""

import json
import unittest

import grpc

from cflue_harness import (
    INVALID_ARGUMENT, StoragedTestCase, admit, append, claim, read, record, settle, store_pb2)

MiB = 1 << 20
PAGE_BYTES = 8 * MiB       # storaged's page budget at the default --max-message-bytes (16 MiB)
SLACK = 1024               # LEDGER_RECORD_SLACK


def big_record(i, size):
    """A record whose text is about size bytes."""
    return record(id_='big-%d' % i, body_json=json.dumps({'i': i, 'pad': 'x' * size}))


def sized_record(id_, size):
    """A record whose encoded size is exactly size bytes."""
    pad = size
    while True:
        rec = record(id_=id_, body_json=json.dumps({'p': 'y' * pad}))
        got = rec.ByteSize()
        if got == size:
            return rec
        pad += size - got


class PageBytesTest(StoragedTestCase):

    def fill(self, conv, count, size, per_batch):
        stub = self.stub
        sub = admit(stub, conv=conv, text='big').submission
        c = claim(stub, submission_id=sub.submission_id)
        for start in range(0, count, per_batch):
            append(stub, c.fence, [big_record(i, size)
                                   for i in range(start, min(count, start + per_batch))],
                   timeout=60)
        return sub, c.fence

    def page_through(self, conv, limit=1000):
        """Reads every record with the given limit; returns (records, pages)."""
        stub = self.stub
        out, pages, after, token = [], 0, -1, ''
        while True:
            r = read(stub, conv, limit=limit, page_token=token, timeout=60)
            pages += 1
            self.assertGreater(len(r.records), 0, 'a page with records left must hold one')
            self.assertEqual(r.records[0].offset, after + 1)
            self.assertLessEqual(r.ByteSize(), PAGE_BYTES + 64)
            self.assertEqual(r.next_page_token == '', r.records[-1].offset == r.head_offset)
            out.extend(r.records)
            after, token = r.records[-1].offset, r.next_page_token
            if not token:
                return out, pages
            self.assertLess(pages, 1000)

    def test_read_pages_through_records_over_the_message_limit(self):
        """40 records of ~1 MiB (40 MiB, well over the 16 MiB message limit, all within one
        1000-record page): Read with limit=1000 pages through all of them with no error, each
        page within the byte budget, next_offset and up_to_date right; Follow delivers them
        all; settling still works and the settlement record is read last."""
        n = 40
        sub, fence_ = self.fill('pages-a', n, MiB, per_batch=8)
        recs, pages = self.page_through('pages-a')
        self.assertEqual([r.id for r in recs], ['big-%d' % i for i in range(n)])
        self.assertEqual([r.offset for r in recs], list(range(n)))
        self.assertEqual(json.loads(recs[17].assistant_message.text)['i'], 17)
        self.assertGreaterEqual(pages, n // 8)

        # a page that starts in the middle, and an empty page at the head
        r = read(self.stub, 'pages-a', after_offset=35, limit=1000, timeout=60)
        self.assertEqual([x.offset for x in r.records], [36, 37, 38, 39])
        self.assertEqual(r.next_page_token, '')
        r = read(self.stub, 'pages-a', after_offset=39, limit=1000)
        self.assertEqual((len(r.records), r.next_page_token, r.head_offset), (0, '', 39))

        s = settle(self.stub, fence_)
        self.assertEqual(s.record_offset, n)
        got = []
        stream = self.stub.follow(store_pb2.FollowRequest(
            conversation_id='pages-a', after_offset=-1, until_settled=sub.submission_id),
            timeout=60)
        for rec in stream:
            got.append(rec.offset)
        self.assertEqual(got, list(range(n + 1)))
        recs, _ = self.page_through('pages-a')
        self.assertEqual(recs[-1].WhichOneof('body'), 'submission_settled')

    def test_record_limit_keeps_one_record_within_a_page(self):
        """Append refuses a record whose encoded size would not fit a page on its own
        (INVALID_ARGUMENT naming the record and the limit), and accepts one right at the limit;
        pages holding such records stay within the page budget."""
        stub = self.stub
        sub = admit(stub, conv='pages-b', text='limit').submission
        c = claim(stub, submission_id=sub.submission_id)
        limit = PAGE_BYTES - SLACK
        ok = sized_record('at-limit', limit)
        too_big = sized_record('over', limit + 1)
        self.assertRpcError(INVALID_ARGUMENT, append, stub, c.fence, [too_big], timeout=60,
                            details_has=['records[0]', str(limit)])
        append(stub, c.fence, [record(id_='small', body={'a': 1})])
        append(stub, c.fence, [ok], timeout=60)
        append(stub, c.fence, [sized_record('at-limit-2', limit)], timeout=60)
        append(stub, c.fence, [record(id_='small-2', body={'a': 2})])
        pages = []
        after = -1
        while True:
            r = read(stub, 'pages-b', after_offset=after, limit=1000, timeout=60)
            pages.append([x.id for x in r.records])
            self.assertLessEqual(r.ByteSize(), PAGE_BYTES + 64)
            after = r.records[-1].offset
            if not r.next_page_token:
                break
        # what storaged adds to a stored record stays within the slack: a small record and
        # one at the limit share a page; two at the limit never do
        self.assertEqual(pages, [['small', 'at-limit'], ['at-limit-2', 'small-2']])


class SmallMessageLimitTest(StoragedTestCase):
    """With --max-message-bytes 2 MiB the page budget is 1 MiB and a record at most 1 MiB - 1
    KiB: ten records of 600 KiB page through one per page, with no error."""

    storaged_kwargs = {'extra_args': ['--max-message-bytes', str(2 * MiB)]}

    def test_small_limit(self):
        stub = self.stub
        sub = admit(stub, conv='pages-c', text='small').submission
        c = claim(stub, submission_id=sub.submission_id)
        for i in range(10):
            append(stub, c.fence, [big_record(i, 600 * 1024)])
        self.assertRpcError(INVALID_ARGUMENT, append, stub, c.fence,
                            [big_record(99, MiB - 512)], details_has='limit')
        after, ids = -1, []
        while True:
            r = read(stub, 'pages-c', after_offset=after, limit=1000)
            self.assertEqual(len(r.records), 1)  # two 600 KiB records exceed 1 MiB
            ids.extend(x.id for x in r.records)
            after = r.records[-1].offset
            if not r.next_page_token:
                break
        self.assertEqual(ids, ['big-%d' % i for i in range(10)])


if __name__ == '__main__':
    unittest.main()
