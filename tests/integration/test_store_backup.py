"""`cflue store backup FILE` (Store.Backup): a consistent copy of storaged's database taken while
it serves, and the restore docs/operations.md describes.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_store_backup

What is checked: a backup taken while a writer keeps admitting is a whole database (SQLite's
integrity check) holding every submission admitted before it began, and a storaged started on
it (the restore) serves them; an existing FILE is refused; a second Backup while one runs is
RESOURCE_EXHAUSTED, and a cancelled one frees the way; storaged killed mid-stream leaves no FILE,
no FILE.partial and no copy in its directory; a copy left by a storaged killed before it
unlinked the copy is removed at the next start.
"""

import os
import shutil
import sqlite3
import tempfile
import threading
import time
import unittest

import grpc

import cflue_harness as H
from cflue_harness import Storaged, backup_call, store_pb2
from test_cli import run_cli


class BackupCase(unittest.TestCase):
    def setUp(self):
        self.out = tempfile.mkdtemp(prefix='cflue-backup-')
        self.addCleanup(shutil.rmtree, self.out, True)
        self.sds = []

    def tearDown(self):
        for sd in self.sds:
            sd.remove()

    def storaged(self, **kw):
        sd = Storaged(tcp=True, **kw)
        self.sds.append(sd)
        return sd

    def backup(self, sd, name='copy.db'):
        path = os.path.join(self.out, name)
        rc, out, err = run_cli(['store', 'backup', path, '--store', sd.target], timeout=120)
        return rc, out, err, path

    def leftovers(self, sd):
        return [n for n in os.listdir(sd.dir) if '.backup-' in n]


class BackupTest(BackupCase):
    def test_a_backup_while_writing_is_whole_and_restores(self):
        sd = self.storaged()
        before = [H.admit(sd.stub, text='before %d ' % i + 'x' * 50000).submission.submission_id
                  for i in range(40)]  # about 2 MB: several chunks
        stop = threading.Event()
        during = []

        def writer():
            i = 0
            while not stop.is_set():
                during.append(H.admit(sd.stub, text='during %d' % i).submission.submission_id)
                i += 1
        t = threading.Thread(target=writer)
        t.start()
        try:
            time.sleep(0.2)
            rc, out, err, path = self.backup(sd)
        finally:
            stop.set()
            t.join()
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r'^backup: %s \(\d+ bytes, schema version 9\)' % path)
        self.assertGreater(len(during), 0)
        self.assertFalse(os.path.exists(path + '.partial'))
        self.assertEqual(self.leftovers(sd), [])
        db = sqlite3.connect(path)
        self.assertEqual(db.execute('PRAGMA integrity_check').fetchall(), [('ok',)])
        held = {r[0] for r in db.execute('SELECT submission_id FROM submissions')}
        db.close()
        self.assertTrue(set(before) <= held)
        self.assertLessEqual(len(held), len(before) + len(during))
        self.assertIn('event=backup bytes=', sd.stderr_text())
        # the restore: a storaged on the copy serves what it holds
        restored = self.storaged(db=path)
        for sid in before:
            self.assertEqual(H.get(restored.stub, sid).submission_id, sid)

    def test_an_existing_file_is_refused(self):
        sd = self.storaged()
        H.admit(sd.stub, text='one')
        path = os.path.join(self.out, 'taken.db')
        with open(path, 'w') as f:
            f.write('mine')
        rc, _, err = run_cli(['store', 'backup', path, '--store', sd.target])
        self.assertEqual(rc, 2)
        self.assertIn('exists already', err)
        with open(path) as f:
            self.assertEqual(f.read(), 'mine')

    def test_one_backup_at_a_time_and_a_cancelled_one_frees_the_way(self):
        sd = self.storaged()
        for i in range(24):
            H.admit(sd.stub, text='%d ' % i + 'y' * (1 << 20))
        slow = backup_call(sd)(store_pb2.BackupRequest(), timeout=60)
        first = next(slow)  # the copy is taken and being sent; nothing more is read
        self.assertGreater(len(first.data), 0)
        with self.assertRaises(grpc.RpcError) as cm:
            list(backup_call(sd)(store_pb2.BackupRequest(), timeout=30))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn('a backup is running already', cm.exception.details())
        slow.cancel()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rc, _, err, _ = self.backup(sd, 'after-%d.db' % int(time.monotonic() * 1000))
            if rc == 0:
                break
            self.assertIn('a backup is running already', err)
            time.sleep(0.1)
        self.assertEqual(rc, 0, err)
        self.assertIn('sent=0', sd.stderr_text())  # the cancelled one, logged as not sent
        self.assertEqual(self.leftovers(sd), [])

    def test_a_client_that_stops_reading_is_cut_off(self):
        """A Backup client that read one chunk and then nothing held the backup open for
        ever: every later backup was refused, and the copy stayed on disk. Past
        --stream-stall-ms without the client taking anything, the stream is cut."""
        sd = self.storaged(env={'CFLUE_STREAM_STALL_MS': '1500'})
        for i in range(24):
            H.admit(sd.stub, text='%d ' % i + 'y' * (1 << 20))
        stuck = backup_call(sd)(store_pb2.BackupRequest(), timeout=120)
        self.assertGreater(len(next(stuck).data), 0)  # then nothing more is read
        deadline = time.monotonic() + 30
        while 'rpc_stream_stalled' not in sd.stderr_text():
            self.assertLess(time.monotonic(), deadline, 'the stalled stream was not cut')
            time.sleep(0.1)
        while True:  # the cut stream's handler lets go of the backup right after the log line
            rc, _, err, _ = self.backup(sd, 'after-stall-%d.db' % int(time.monotonic() * 1000))
            if rc == 0 or time.monotonic() > deadline:
                break
            self.assertIn('a backup is running already', err)
            time.sleep(0.1)
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.leftovers(sd), [])
        with self.assertRaises(grpc.RpcError) as cm:
            list(stuck)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)


class BackupFaultTest(BackupCase):
    def test_storaged_killed_mid_stream_leaves_nothing(self):
        sd = self.storaged(env={'CFLUE_FAILPOINTS': 'storaged.backup.chunk=crash:2'})
        for i in range(4):
            H.admit(sd.stub, text='%d ' % i + 'z' * (1 << 20))
        rc, _, err, path = self.backup(sd)
        self.assertEqual(rc, 1, err)
        self.assertFalse(os.path.exists(path))
        self.assertFalse(os.path.exists(path + '.partial'))
        sd.proc.wait(10)  # the failpoint ended it mid-stream
        self.assertEqual(self.leftovers(sd), [])  # unlinked once open: nothing to sweep

    def test_a_copy_left_by_a_killed_storaged_is_swept_at_start(self):
        sd = self.storaged(env={'CFLUE_FAILPOINTS': 'storaged.backup.copied=crash'})
        H.admit(sd.stub, text='one')
        rc, _, err, path = self.backup(sd)
        self.assertEqual(rc, 1, err)
        sd.proc.wait(10)
        left = self.leftovers(sd)
        self.assertEqual(len(left), 1, left)
        del sd.env['CFLUE_FAILPOINTS']
        sd.start()
        self.assertEqual(self.leftovers(sd), [])
        self.assertIn('event=backup_swept file=', sd.stderr_text())
        rc, _, err, _ = self.backup(sd, 'again.db')
        self.assertEqual(rc, 0, err)


if __name__ == '__main__':
    unittest.main()
