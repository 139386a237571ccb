"""agentd's graceful shutdown: SIGTERM with a live Watch, a waiting GetSubmission and a
running submission ends the process with exit code 0 (under the ASan build this also proves
no leaks), and the interrupted submission is finished by the next agentd; the leases of the
work it stopped are handed back (Store.Release), so another agentd takes it over at once
rather than when the leases run out."""
import os
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import NOT_SERVING, SERVING, Agentd, common_pb2  # noqa: E402
from test_agentd import Stack  # noqa: E402
import cflue_harness as H  # noqa: E402


def settled_records(ad, conversation_id, submission_id):
    """The submission_settled records of submission_id in the conversation's stream."""
    return [r for r in ad.watch_all(conversation_id)
            if r.WhichOneof('body') == 'submission_settled' and r.submission_id == submission_id]


class ShutdownTest(unittest.TestCase):
    def setUp(self):
        self.stack = Stack(agents=('runner-anthropic',), owner_ids=['shutdown-a'],
                           agentd_args=('--lease-ms', '2000', '--heartbeat-ms', '500',
                                        '--grace-ms', '1000'))

    def tearDown(self):
        self.stack.remove()

    def test_sigterm_with_live_streams_exits_zero_and_work_resumes(self):
        fm, ad = self.stack.fm, self.stack.ad
        fm.set_scenario([{'text': 'first'},
                         {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 3'}}]},
                         {'text': 'done after the restart'}])
        first = ad.submit('runner-anthropic', 'hello')
        ad.get_submission(first.submission_id, wait=True, timeout=30)
        # a follow Watch and a waiting GetSubmission stay open on an idle conversation
        watch = ad.watch(first.conversation_id, follow=True, timeout=60)
        seen = []
        t = threading.Thread(target=lambda: [seen.append(r) for r in self._drain(watch)])
        t.start()
        second = ad.submit('runner-anthropic', 'run the slow command',
                           conversation_id=first.conversation_id)
        time.sleep(1.0)  # the sleep is running in toold
        t0 = time.time()
        code = ad.terminate(timeout=15)
        self.assertEqual(code, 0, 'agentd did not exit 0 on SIGTERM:\n' + ad.stderr_text()[-3000:])
        self.assertLess(time.time() - t0, 10)
        t.join(10)
        self.assertFalse(t.is_alive(), 'the Watch stream did not end when agentd stopped')
        # a new agentd (same owner) finishes the interrupted submission exactly once
        ad2 = Agentd(self.stack.sd.target, self.stack.agents_dir, owner_id='shutdown-a',
                     env=self.stack.env, workdir=self.stack._sub('agentd-b'))
        self.stack.daemons.append(('agentd-b', ad2))
        sub = ad2.get_submission(second.submission_id, wait=True, timeout=60)
        self.assertEqual(sub.status, common_pb2.SUBMISSION_STATUS_SETTLED)
        settled = settled_records(ad2, first.conversation_id, second.submission_id)
        self.assertEqual(len(settled), 1)
        self.assertEqual(settled[0].submission_settled.outcome, sub.outcome)

    @staticmethod
    def _drain(it):
        try:
            for r in it:
                yield r
        except Exception:
            return


class HandBackTest(unittest.TestCase):
    """Two agentds with the default 30 s lease: the one that stops hands its lease back."""

    def setUp(self):
        self.stack = Stack(agents=('runner-anthropic',), n_agentd=2,
                           owner_ids=['handback-a', 'handback-b'])

    def tearDown(self):
        self.stack.remove()

    def test_sigterm_hands_the_lease_back_and_another_agentd_takes_over_at_once(self):
        a, b = self.stack.agentds
        self.stack.fm.set_scenario([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 5'}}]},
            {'text': 'done by the other agentd'}])
        sub = a.submit('runner-anthropic', 'run the slow command')
        self.assertEqual(a.get_submission(sub.submission_id).owner_id, 'handback-a')
        time.sleep(1.0)  # the sleep is running in toold, under A's 30 s lease
        t0 = time.time()
        self.assertEqual(a.terminate(timeout=20), 0, a.stderr_text()[-3000:])
        self.assertIn('event=leases_released released=1 lost=0 not_released=0',
                      a.stderr_text())
        done = b.get_submission(sub.submission_id, wait=True, timeout=25)
        took = time.time() - t0
        self.assertEqual(done.outcome, common_pb2.OUTCOME_COMPLETED, done)
        self.assertEqual(done.owner_id, 'handback-b')
        self.assertEqual(done.attempt_count, 2)
        # the lease was 30 s: without the hand-back B could not have claimed it before then
        self.assertLess(took, 20, 'B took the work over %.1f s after the SIGTERM' % took)
        self.assertEqual(len(settled_records(b, sub.conversation_id, sub.submission_id)), 1)

    def test_work_waiting_to_be_retried_is_handed_back_too(self):
        """With toold down, A's drive is interrupted at once and waits on the resume list to
        be claimed again (1 s, then 2 s): a drive that holds its lease and no thread. A stop
        during that wait hands that lease back too."""
        a, b = self.stack.agentds
        self.stack.fm.set_scenario([{'text': 'done once toold is back'}])
        self.stack.td.kill()
        sub = a.submit('runner-anthropic', 'hello')
        H.poll_until(lambda: a.stderr_text().count('event=drive_interrupted') >= 2, 20)
        # the second interruption: the next claim is 2 s away
        self.assertEqual(a.stderr_text().count('event=drive_interrupted'), 2, a.stderr_text())
        t0 = time.time()
        self.assertEqual(a.terminate(timeout=20), 0, a.stderr_text()[-3000:])
        self.assertIn('event=leases_released released=1 lost=0 not_released=0',
                      a.stderr_text())
        self.stack.td.start()
        done = b.get_submission(sub.submission_id, wait=True, timeout=25)
        took = time.time() - t0
        self.assertEqual(done.outcome, common_pb2.OUTCOME_COMPLETED, done)
        self.assertEqual(done.owner_id, 'handback-b')
        # A's two attempts (three, had the stop come after the next one) and B's
        self.assertIn(done.attempt_count, (3, 4))
        self.assertLess(took, 20, 'B took the work over %.1f s after the SIGTERM' % took)

    def test_a_hand_back_storaged_does_not_answer_is_logged_and_the_stop_goes_on(self):
        a = self.stack.agentds[0]
        self.stack.fm.set_scenario([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep 5'}}]},
            {'text': 'done'}])
        a.submit('runner-anthropic', 'run the slow command')
        time.sleep(1.0)
        self.stack.sd.kill()
        t0 = time.time()
        self.assertEqual(a.terminate(timeout=30), 0, a.stderr_text()[-3000:])
        self.assertLess(time.time() - t0, 15)
        self.assertRegex(a.stderr_text(), r'event=leases_not_released n=1 err=')
        self.assertIn('event=leases_released released=0 lost=0 not_released=1',
                      a.stderr_text())


class DrainStack(object):
    """Two agentds (owners drain-a, drain-b) with --drain-ms drain_ms and the default 30 s
    lease."""

    def setUp(self):
        self.stack = Stack(agents=('runner-anthropic',), n_agentd=2,
                           owner_ids=['drain-a', 'drain-b'],
                           agentd_args=('--drain-ms', str(self.DRAIN_MS)))

    def tearDown(self):
        self.stack.remove()

    def start_slow_command(self, seconds):
        """Submits through A a conversation whose first answer runs `sleep seconds`, then its
        second and any other answer are text; returns once the command runs."""
        a = self.stack.agentds[0]
        self.stack.fm.set_scenario([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'sleep %d' % seconds}}]},
            {'text': 'answered'}, {'text': 'answered'}])
        sub = a.submit('runner-anthropic', 'run the slow command')
        H.poll_until(self.stack.fm.requests, 20)
        time.sleep(0.5)  # the answer is in: the command runs in toold
        return sub

    def sigterm_and_wait_for_the_drain(self, a):
        a.proc.send_signal(signal.SIGTERM)
        H.poll_until(lambda: 'event=draining' in a.stderr_text(), 10)
        self.assertIn('event=draining drives=1 up_to_ms=%d' % self.DRAIN_MS, a.stderr_text())


class DrainTest(DrainStack, unittest.TestCase):
    """A SIGTERM lets the drives in flight settle where they are (for up to 60 s here) while
    nothing new is claimed there."""
    DRAIN_MS = 60000

    def test_work_in_flight_settles_before_the_stop_and_new_work_goes_elsewhere(self):
        a, b = self.stack.agentds
        sub = self.start_slow_command(2)
        self.sigterm_and_wait_for_the_drain(a)
        # A still serves its API while it drains, not ready (a load balancer sends new calls
        # elsewhere) and claiming nothing new: B takes this one
        self.assertEqual(a.health_check('readiness'), NOT_SERVING)
        self.assertEqual(a.health_check('liveness'), SERVING)
        other = a.submit('runner-anthropic', 'submitted while A drains')
        self.assertEqual(a.proc.wait(60), 0, a.stderr_text()[-3000:])
        a.terminate()  # it exited: the harness forgets it
        self.assertRegex(a.stderr_text(), r'event=drained after_ms=\d+')
        self.assertNotIn('event=leases_released', a.stderr_text())
        done = b.get_submission(sub.submission_id)
        self.assertEqual(done.outcome, common_pb2.OUTCOME_COMPLETED, done)
        self.assertEqual((done.owner_id, done.attempt_count), ('drain-a', 1))
        later = b.get_submission(other.submission_id, wait=True, timeout=30)
        self.assertEqual(later.outcome, common_pb2.OUTCOME_COMPLETED, later)
        self.assertEqual((later.owner_id, later.attempt_count), ('drain-b', 1))

    def test_a_second_sigterm_ends_the_drain(self):
        a = self.stack.agentds[0]
        self.start_slow_command(120)
        self.sigterm_and_wait_for_the_drain(a)
        t0 = time.time()
        self.assertEqual(a.terminate(timeout=40), 0, a.stderr_text()[-3000:])
        self.assertLess(time.time() - t0, 30, 'the second SIGTERM did not end the 60 s drain')
        self.assertRegex(a.stderr_text(), r'event=drain_ended drives_left=1 reason=signal')
        self.assertIn('event=leases_released released=1', a.stderr_text())


class DrainTimeTest(DrainStack, unittest.TestCase):
    DRAIN_MS = 2000

    def test_a_drain_past_its_time_stops_the_rest_and_hands_it_back(self):
        a, b = self.stack.agentds
        sub = self.start_slow_command(30)
        t0 = time.time()
        self.assertEqual(a.terminate(timeout=30), 0, a.stderr_text()[-3000:])
        self.assertGreaterEqual(time.time() - t0, 2)
        self.assertRegex(a.stderr_text(), r'event=drain_ended drives_left=1 reason=time')
        self.assertIn('event=leases_released released=1 lost=0 not_released=0',
                      a.stderr_text())
        done = b.get_submission(sub.submission_id, wait=True, timeout=30)
        self.assertEqual(done.outcome, common_pb2.OUTCOME_COMPLETED, done)
        self.assertEqual((done.owner_id, done.attempt_count), ('drain-b', 2))
        # the lease was 30 s: without the hand-back B could not have claimed it before then
        self.assertLess(time.time() - t0, 25)


if __name__ == '__main__':
    unittest.main()
