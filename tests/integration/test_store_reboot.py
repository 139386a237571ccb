"""Durability across a machine restart. Claims, heartbeats and appends commit with
synchronous=NORMAL: a process crash loses none of them, but a power loss can lose the newest
ones while the agentd attempts that made them keep running elsewhere. storaged tells the two
apart by the kernel's boot id: after an unclean stop on another boot it fences every running
attempt off (fresh attempt id, expired lease) so none of them can write on top of lost
commits; recovery continues them. A kill -9 on the same boot, or a clean stop, fences nothing.
The boot id is read from --boot-id-file, which the test rewrites to simulate a reboot.
"""

import os
import shutil
import tempfile
import unittest

import grpc
STALE = grpc.StatusCode.ABORTED  # a stale fence (reason STALE_FENCE)
from cflue_harness import (
    FAILED_PRECONDITION, StoragedTestCase, admit, append, claim, common_pb2, heartbeat, read_all,
    record, scan_expired, settle)


class RebootFencingTest(StoragedTestCase):

    def setUp(self):
        d = tempfile.mkdtemp(prefix='cflue-boot-')
        self.addCleanup(shutil.rmtree, d, True)
        self.boot_file = os.path.join(d, 'boot_id')
        self.set_boot('boot-A')

    def set_boot(self, value):
        with open(self.boot_file, 'w') as f:
            f.write(value + '\n')

    def test_reboot_after_unclean_stop_fences_running_attempts(self):
        """kill -9 on the same boot keeps the attempt; kill -9 and a new boot fence it off
        (writes, heartbeats and settle refused) and make it claimable at once as a takeover;
        a clean stop followed by a new boot fences nothing."""
        sd = self.start_storaged(extra_args=['--boot-id-file', self.boot_file])
        stub = sd.stub
        sub = admit(stub, conv='boot-c', text='hi').submission
        c = claim(stub, submission_id=sub.submission_id)
        append(stub, c.fence, [record(id_='r1')])

        # kill -9 on the same boot: nothing was lost, the attempt keeps its fence
        sd.restart()
        append(sd.stub, c.fence, [record(id_='r2')])
        self.assertEqual(heartbeat(sd.stub, 'test-owner', [c.fence]).renewed, [sub.submission_id])

        # kill -9, then the machine "reboots": the attempt is fenced off
        sd.kill()
        self.set_boot('boot-B')
        sd.start()
        stub = sd.stub
        self.assertRpcError(STALE, append, stub, c.fence, [record(id_='r3')])
        self.assertEqual(heartbeat(stub, 'test-owner', [c.fence]).lost, [sub.submission_id])
        self.assertRpcError(STALE, settle, stub, c.fence)
        self.assertIn('fenced_after_reboot', sd.stderr_text())
        # recovery takes it over at once (the lease was expired)
        self.assertEqual([s.submission_id for s in scan_expired(stub)],
                         [sub.submission_id])
        t = claim(stub, owner='recovery')
        self.assertTrue(t.takeover)
        self.assertEqual(t.submission.submission_id, sub.submission_id)
        self.assertEqual([r.id for r in read_all(stub, 'boot-c')], ['r1', 'r2'])
        append(stub, t.fence, [record(id_='r3')])

        # a clean stop, then a new boot: nothing to fence
        sd.stop()
        self.set_boot('boot-C')
        sd.start()
        append(sd.stub, t.fence, [record(id_='r4')])
        self.assertEqual(settle(sd.stub, t.fence).submission.status, common_pb2.SUBMISSION_STATUS_SETTLED)

    def test_queued_work_is_untouched(self):
        """A new boot after an unclean stop fences attempts only: queued work stays queued
        and is claimed normally (no takeover)."""
        sd = self.start_storaged(extra_args=['--boot-id-file', self.boot_file])
        q = admit(sd.stub, conv='boot-q', text='queued').submission
        sd.kill()
        self.set_boot('boot-Z')
        sd.start()
        c = claim(sd.stub)
        self.assertEqual(c.submission.submission_id, q.submission_id)
        self.assertFalse(c.takeover)
        self.assertNotIn('fenced_after_reboot', sd.stderr_text())


if __name__ == '__main__':
    unittest.main()
