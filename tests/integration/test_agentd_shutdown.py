"""agentd's graceful shutdown: SIGTERM with a live Watch, a waiting GetSubmission and a
running submission ends the process with exit code 0 (under the ASan build this also proves
no leaks), and the interrupted submission is finished by the next agentd."""
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import Agentd, common_pb2  # noqa: E402
from test_agentd import Stack  # noqa: E402


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
        settled = [r for r in ad2.watch_all(first.conversation_id)
                   if r.WhichOneof('body') == 'submission_settled'
                   and r.submission_id == second.submission_id]
        self.assertEqual(len(settled), 1)
        self.assertEqual(settled[0].submission_settled.outcome, sub.outcome)

    @staticmethod
    def _drain(it):
        try:
            for r in it:
                yield r
        except Exception:
            return


if __name__ == '__main__':
    unittest.main()
