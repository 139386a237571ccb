"""The secret scan (secret_scan.py) finds what it is there to find: a secret in a storaged
record (also one stored across database pages), in a log, in a write-ahead log; not in a
sandbox's workspace; and a test process whose daemons logged a secret fails at exit.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_secret_scan
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import cflue_harness as H
import secret_scan


def planted(label):
    """A secret the scan was not told of (so that this test's own exit stays clean)."""
    return 'cfplanted-%s-%s' % (label, os.urandom(8).hex())


class ScanTest(unittest.TestCase):
    def test_records_logs_and_wal_are_searched_and_workspaces_are_not(self):
        sd = H.Storaged()
        try:
            small, big, never = planted('small'), planted('big'), planted('never')
            H.admit(sd.stub, conv='c-small', text='my key is ' + small)
            # 40 KiB before it: the record spans several database pages
            H.admit(sd.stub, conv='c-big', text='x' * 40960 + big)
            sd.close()  # killed: its last writes may be in the write-ahead log only
            with open(os.path.join(sd.dir, 'extra.stderr'), 'a') as f:
                f.write('level=info msg="sent ' + small + '"\n')
            ws = os.path.join(sd.dir, 'root', 'sb')
            os.makedirs(ws)
            with open(os.path.join(ws, 'notes.log'), 'w') as f:
                f.write(never)
            secret_scan.skip(os.path.join(sd.dir, 'root'))
            found, counts = secret_scan.scan(sd.dir, [small, big, never])

            def places(secret):
                label = secret_scan._label(secret)
                return {(os.path.basename(p), where.split(' ')[0])
                        for p, where, what in found if what == label}
            self.assertIn(('store.db', 'table'), places(small), found)  # a row holds it
            self.assertIn(('store.db', 'table'), places(big), found)    # across pages too
            self.assertIn(('extra.stderr', 'byte'), places(small), found)
            self.assertEqual(places(never), set(), found)  # the workspace is not looked at
            self.assertNotIn(secret_scan._label(small), ' '.join(w for _, w, _ in found))
            self.assertGreater(counts['rows'], 0)
            self.assertGreaterEqual(counts['files'], 2)
        finally:
            sd.close()
            shutil.rmtree(sd.dir, ignore_errors=True)

    def test_a_process_whose_daemon_logged_a_secret_fails_at_exit(self):
        d = tempfile.mkdtemp(prefix='cflue-scan-')
        self.addCleanup(shutil.rmtree, d, True)
        script = ('import os, secret_scan\n'
                  'os.environ["CFLUE_SECRET_SCAN_DIR"] = %r\n'
                  's = secret_scan.secret("leak")\n'
                  'open(os.path.join(%r, "agentd.stderr"), "w").write("key=" + s)\n'
                  'secret_scan.watch(%r)\n' % (os.path.join(d, 'reports'), d, d))
        r = subprocess.run([sys.executable, '-c', script], cwd=H.HERE, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('SECRET SCAN: 1 place(s) hold a secret of this run', r.stderr)
        self.assertIn('agentd.stderr: byte 4 (line 1): cfse...', r.stderr)
        self.assertNotIn('cfsecret-leak-', r.stderr)  # the report names it, never shows it
        [report] = os.listdir(os.path.join(d, 'reports'))
        self.assertTrue(report.endswith('.json'))
        # the same without the secret in the log: exit 0
        clean = script.replace('"key=" + s', '"nothing here"')
        r = subprocess.run([sys.executable, '-c', clean], cwd=H.HERE, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)


if __name__ == '__main__':
    unittest.main()
