"""A database that fails under storaged: every SQLite step error reaches the client as an
error status (DATA_LOSS for corruption, INTERNAL or UNAVAILABLE otherwise), never as an empty
or "not found" answer. The fault is real: a page of the database file is overwritten while
storaged is stopped, the way a bad disk sector or a stray writer would. And a disk that fills
up under a running storaged (a real tmpfs, filled and emptied again) refuses writes
RESOURCE_EXHAUSTED (STORAGE_FULL) until there is room, losing nothing. A second storaged
started on a running one's database or address is refused and leaves the first untouched.
"""

import os
import sqlite3
import threading
import unittest

import grpc

from cflue_harness import (
    Storaged, StoragedTestCase, StoreStub, TmpfsStoraged, admit, append, claim, common_pb2, error_reason, get,
    private_mount_problem, read_all, record, require_namespace, settle, store_pb2)

ERROR_CODES = (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNAVAILABLE)


def corrupt_index(db_path, index_name):
    """Overwrites every page of one index b-tree with garbage. The database must be closed
    (storaged stopped, so its WAL is checkpointed into the file)."""
    con = sqlite3.connect(db_path)
    try:
        page_size = con.execute('PRAGMA page_size').fetchone()[0]
        root = con.execute('SELECT rootpage FROM sqlite_master WHERE name = ?',
                           (index_name,)).fetchone()
        assert root, 'no index named %s' % index_name
        count = con.execute('PRAGMA page_count').fetchone()[0]
    finally:
        con.close()
    assert not os.path.exists(db_path + '-wal') or os.path.getsize(db_path + '-wal') == 0, \
        'the WAL was not checkpointed'
    # The test's index is tiny: its root page is its only page (a leaf).
    assert 1 < root[0] <= count
    with open(db_path, 'r+b') as f:
        f.seek((root[0] - 1) * page_size)
        f.write(b'\xff' * page_size)


class StepErrorTest(StoragedTestCase):

    def settled_conversation(self):
        stub = self.stub
        sub = admit(stub, conv='dberr-c', text='hello').submission
        c = claim(stub, submission_id=sub.submission_id)
        append(stub, c.fence, [record(id_='r1', body={'n': 1}), record(id_='r2', body={'n': 2})])
        s = settle(stub, c.fence, common_pb2.OUTCOME_FAILED, 'boom')
        self.assertGreaterEqual(s.record_offset, 0)
        return sub, c.fence, s.record_offset

    def test_corrupt_record_index_is_an_error_not_an_empty_answer(self):
        """The records' (conversation, record id) index is corrupted. Follow until_settled
        looks the settlement record up through it: the old code read the step error as "not
        settled yet" and waited for a settlement that had happened (DEADLINE_EXCEEDED); now
        the stream fails at once with an error status. A repeated identical Settle fails at
        the same lookup, naming it (the old code answered its job OK with record_offset -1 and
        only the COMMIT failed). Reads by offset (another b-tree) still work."""
        sd = self.storaged
        sub, fence_, offset = self.settled_conversation()
        sd.stop()
        corrupt_index(sd.db, 'sqlite_autoindex_records_2')
        sd.start()
        stub = sd.stub

        # the records themselves are intact and readable by offset
        self.assertEqual([r.id for r in read_all(stub, 'dberr-c')][:2], ['r1', 'r2'])

        stream = stub.follow(store_pb2.FollowRequest(conversation_id='dberr-c',
                                                     after_offset=offset,
                                                     until_settled=sub.submission_id),
                             timeout=5)
        with self.assertRaises(grpc.RpcError) as cm:
            list(stream)
        self.assertIn(cm.exception.code(), ERROR_CODES, cm.exception.details())

        e = self.assertRpcError(ERROR_CODES, settle, stub, fence_, common_pb2.OUTCOME_FAILED, 'boom')
        self.assertIn('settlement record', e.details())

        # a resent record goes through the same index: an error, not a second copy
        self.assertRpcError(ERROR_CODES + (grpc.StatusCode.FAILED_PRECONDITION,), append, stub,
                            fence_, [record(id_='r1', body={'n': 1})])

        # storaged keeps serving what it can
        self.assertEqual(stub.get(store_pb2.GetRequest(submission_id=sub.submission_id)).status,
                         common_pb2.SUBMISSION_STATUS_SETTLED)



class DiskFullTest(StoragedTestCase):

    def setUp(self):
        require_namespace(self, private_mount_problem())

    def test_a_full_disk_refuses_writes_until_there_is_room(self):
        """The tmpfs under storaged's database fills up (a file written until ENOSPC). Admits
        are refused RESOURCE_EXHAUSTED, reason STORAGE_FULL, naming the full disk; reads go
        on; storaged keeps running. The file removed, the same storaged admits again, and
        every admission it had answered OK is there."""
        sd = TmpfsStoraged(start=False)
        self._daemons.append(sd)
        sd.start()
        stub = sd.stub
        ok = [admit(stub, conv='full-c', text='before %d' % i).submission.submission_id
              for i in range(5)]
        filled = sd.in_namespace('cat /dev/zero > %s/filler; df -k %s | tail -1'
                                 % (sd.mount_dir, sd.mount_dir))
        self.assertIn('No space left', filled.stdout)
        refused = None
        big = 'x' * (256 << 10)  # past what the WAL already holds: it must grow
        for i in range(40):
            try:
                ok.append(admit(stub, conv='full-c', text='%d %s' % (i, big)).submission.submission_id)
            except grpc.RpcError as e:
                refused = e
                break
        self.assertIsNotNone(refused, 'no Admit was refused on a full disk')
        self.assertEqual(refused.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details())
        self.assertEqual(error_reason(refused), 'STORAGE_FULL')
        self.assertIn('full', refused.details())
        # reads go on, storaged runs on and says what happened
        self.assertEqual(get(stub, ok[0]).submission_id, ok[0])
        self.assertIsNone(sd.proc.poll())
        self.assertIn('code=FULL', sd.stderr_text())
        # many at once, big and small, batched together: the batch-mates of a statement the
        # full disk stopped (SQLite rolls its whole transaction back) are refused the same way,
        # never INTERNAL
        codes, lock = {}, threading.Lock()

        def admit_many(k):
            for i in range(20):
                try:
                    text = big if k % 2 else 'small %d' % i
                    sid = admit(stub, conv='full-%d' % k, text=text).submission.submission_id
                    code = 'OK'
                except grpc.RpcError as e:
                    sid, code = None, '%s %s' % (e.code().name, error_reason(e))
                with lock:
                    codes[code] = codes.get(code, 0) + 1
                    if sid:
                        ok.append(sid)
        workers = [threading.Thread(target=admit_many, args=(k,)) for k in range(8)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        self.assertEqual(set(codes) - {'OK'}, {'RESOURCE_EXHAUSTED STORAGE_FULL'}, codes)
        # room again: the same process admits, and nothing answered OK was lost
        self.assertEqual(sd.in_namespace('rm %s/filler' % sd.mount_dir).returncode, 0)
        after = admit(stub, conv='full-c', text='after').submission.submission_id
        for sid in ok + [after]:
            self.assertEqual(get(stub, sid).submission_id, sid)
        self.assertIsNone(sd.proc.poll())

class ListeningOn(Storaged):
    """A storaged listening on the address given (another daemon's, in these tests)."""

    def __init__(self, listen, **kwargs):
        self.listen = listen
        Storaged.__init__(self, **kwargs)

    def listen_args(self):
        return ['--listen', self.listen]


def meta(db, key):
    con = sqlite3.connect('file:%s?mode=ro' % db, uri=True)
    try:
        row = con.execute('SELECT value FROM meta WHERE key = ?', (key,)).fetchone()
        return row[0] if row else None
    finally:
        con.close()


class SecondInstanceTest(StoragedTestCase):
    """A storaged already running keeps its database and its address: a second one started on
    either exits 1 saying what is in use, before it writes anything."""

    def second(self, **kwargs):
        sd = ListeningOn(start=False, **kwargs)
        self._daemons.append(sd)
        rc, err = sd.run_to_exit(timeout=15)
        self.assertEqual(rc, 1, err)
        return sd, err

    def assert_serving(self, sd):
        """Admits into sd and reads it back; returns the submission's id."""
        sid = admit(sd.stub, conv='still-here').submission.submission_id
        self.assertEqual(get(sd.stub, sid).submission_id, sid)
        return sid

    def test_the_same_database(self):
        first = self.start_storaged()
        before = self.assert_serving(first)
        _, err = self.second(listen='unix:' + os.path.join(first.dir, 'other.sock'), db=first.db)
        self.assertIn('database %s is in use by another process' % first.db, err)
        # it wrote nothing: not the clean stop a storaged stamps when it stops
        self.assertEqual(meta(first.db, 'clean_stop'), '0')
        self.assert_serving(first)
        first.stop()
        self.assertEqual(meta(first.db, 'clean_stop'), '1')
        # once the first is gone, the database is free
        again = self.start_storaged(db=first.db)
        self.assertEqual(get(again.stub, before).submission_id, before)

    def test_the_same_tcp_port(self):
        first = self.start_storaged(tcp=True)
        port = int(first.target.rsplit(':', 1)[1])
        _, err = self.second(listen='127.0.0.1:%d' % port)
        self.assertIn("cannot listen on '127.0.0.1:%d' (address in use" % port, err)
        # the port is the first one's alone: every new connection reaches it
        for _ in range(5):
            channel = grpc.insecure_channel(first.target)
            try:
                stub = StoreStub(lambda: channel)
                sid = admit(stub, conv='still-here').submission.submission_id
                self.assertEqual(get(first.stub, sid).submission_id, sid)
            finally:
                channel.close()

    def test_the_same_unix_socket(self):
        first = self.start_storaged()
        _, err = self.second(listen='unix:' + first.sock)
        self.assertIn("cannot listen on 'unix:%s': another process is listening there"
                      % first.sock, err)
        self.assertTrue(os.path.exists(first.sock))
        self.assert_serving(first)

    def test_a_socket_left_by_a_killed_storaged_is_reused(self):
        first = self.start_storaged()
        first.kill()
        self.assertTrue(os.path.exists(first.sock))  # nobody listens on it now
        first.start()
        self.assert_serving(first)


if __name__ == '__main__':
    unittest.main()
