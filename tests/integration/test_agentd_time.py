"""Time seen from outside agentd: hosts whose wall clocks differ or are set while the
daemons run (libfaketime), and a storaged away for longer than a lease (stopped, or frozen).
Real storaged, toold and agentd processes; the offline model.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_time

Each test ends with the rule test_agentd_faults checks: a submission settles `completed` only
when its stream ends with a finished answer.
"""

import calendar
import os
import re
import shutil
import signal
import tempfile
import time
import unittest

from cflue_harness import (
    CLOCK_READ_S, clock_apart_env, set_clock, settable_clock_env, skip_without_faketime)
from test_agentd import bind, new_conv, outcome_name
from test_agentd_faults import FaultsBase


class SleepingToolCase(FaultsBase):
    """Work whose tool call sleeps through the fault a test makes (no tests of its own)."""

    def start_sleeping_tool(self, tag, agent='runner-anthropic', secs=30):
        """Submits a conversation whose model calls bash to sleep secs seconds, then answers;
        returns (conversation, submission id) once the command runs."""
        conv = new_conv(tag)
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {
                'command': 'touch started; sleep %d; echo slept' % secs}}]},
            {'text': 'done'}], conv))
        sid = self.ad.submit(agent, 'sleep (%s)' % conv, conversation_id=conv).submission_id
        self.wait_for('the tool call to start',
                      lambda: os.path.exists(os.path.join(ws, 'started')), timeout=30)
        return conv, sid

    def assert_completed_in_second_attempt(self, conv, sid, timeout):
        """The sleeping tool's submission, interrupted once, completes in its second attempt
        within timeout seconds."""
        sub = self.wait_settled(sid, timeout=timeout)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 2)
        self.assert_outcome_true(conv, sid)

    def assert_kept(self, conv, sid, what, storaged_says):
        """storaged back after an absence: the sleeping tool's submission is still in its first
        attempt 2 s later (agentd claims every 0.5 s: a lease that looked ended would have been
        taken over; else the failure says what), completes in it, and storaged's log says
        storaged_says (a regular expression)."""
        time.sleep(2)
        self.assertEqual(self.ad.get_submission(sid).attempt_count, 1, what)
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertEqual(sub.attempt_count, 1)
        self.assert_outcome_true(conv, sid)
        self.assertRegex(self.stack.sd.stderr_text(), storaged_says)


class ClockCase(SleepingToolCase):
    """A stack whose daemons run on wall clocks of their own (no tests of its own)."""

    @classmethod
    def setUpClass(cls):
        skip_without_faketime()
        super(ClockCase, cls).setUpClass()

    def assert_clock_apart(self, hours, daemon=None, event=None):
        """A daemon's log lines (agentd's by default; the last one, or the last of `event`)
        bear its clock's time: `hours` off this one's."""
        text = (daemon or self.ad).stderr_text()
        stamps = re.findall(r'^ts=(\S+)Z .*?event=%s\b' % (event or r'\S+'), text, re.M)
        self.assertTrue(stamps, 'no log line with a time (%s)' % (event or 'any event'))
        t = calendar.timegm(time.strptime(stamps[-1].split('.')[0], '%Y-%m-%dT%H:%M:%S'))
        self.assertAlmostEqual((t - time.time()) / 3600.0, hours, delta=0.1, msg=stamps[-1])


class ClockApart(object):
    """agentd on a wall clock an hour off storaged's (mixed into a ClockCase that sets the
    clock; no tests run from it alone). The 'brief' agent has 4 s per submission: storaged's
    deadline, counted by agentd from the claim."""

    def test_a_submission_has_its_whole_time(self):
        conv = new_conv('clock-whole')
        ws = self.workspace(conv)
        self.fm.set_scenario(bind([
            {'tool_calls': [{'name': 'bash', 'arguments': {'command': 'echo ran > ran.txt'}}]},
            {'text': 'done'}], conv))
        adm = self.ad.submit('brief', 'quick (%s)' % conv, conversation_id=conv)
        sub = self.wait_settled(adm.submission_id, timeout=30)
        self.assertEqual(outcome_name(sub.outcome), 'COMPLETED', sub.error)
        self.assertTrue(os.path.exists(os.path.join(ws, 'ran.txt')))

    def test_the_time_limit_ends_it_on_time(self):
        self.assert_limit_ends_a_late_answer('clock-limit')


class ClockAheadTest(ClockCase, ClockApart):
    """Counted by agentd's wall clock, every deadline would be an hour past at once."""
    stack_kwargs = dict(FaultsBase.stack_kwargs, agentd_env=clock_apart_env('+1h'))

    def setUp(self):
        super(ClockAheadTest, self).setUp()
        self.assert_clock_apart(+1)


class ClockBehindTest(ClockCase, ClockApart):
    """Counted by agentd's wall clock, no deadline would come for an hour."""
    stack_kwargs = dict(FaultsBase.stack_kwargs, agentd_env=clock_apart_env('-1h'))

    def setUp(self):
        super(ClockBehindTest, self).setUp()
        self.assert_clock_apart(-1)


class SettableClockCase(ClockCase):
    """A stack whose agentd or storaged (clock_daemon) runs on a wall clock the tests set
    while it runs (set_clock, self.clock_file); no tests of its own."""
    clock_daemon = 'agentd'

    @classmethod
    def setUpClass(cls):
        skip_without_faketime()
        cls.clock_dir = tempfile.mkdtemp(prefix='cflue-clock-')
        cls.clock_file = os.path.join(cls.clock_dir, 'offset')
        set_clock(cls.clock_file, '+0')
        cls.stack_kwargs = dict(cls.stack_kwargs, **{
            cls.clock_daemon + '_env': settable_clock_env(cls.clock_file)})
        super(SettableClockCase, cls).setUpClass()

    @classmethod
    def tearDownClass(cls):
        super(SettableClockCase, cls).tearDownClass()
        shutil.rmtree(cls.clock_dir, ignore_errors=True)


class ClockSetBackTest(SettableClockCase):
    """agentd's wall clock set back an hour, while it runs or between a crash and its restart.
    Its attempts carry its start by the clock of before: the claim that resumes interrupted
    work, and the restarted process's claims that take back its work, must still find them.
    A 60 s lease: work that waited for it would be late."""
    stack_kwargs = {'agents': ('runner-anthropic',), 'agentd_args': ('--lease-ms', '60000')}

    def setUp(self):
        set_clock(self.clock_file, '+0')  # each test starts on the host's clock
        super(ClockSetBackTest, self).setUp()
        time.sleep(CLOCK_READ_S)

    def test_a_restart_on_a_clock_set_back_takes_its_work_back_at_once(self):
        conv, sid = self.start_sleeping_tool('clock-restart')
        self.ad.kill()
        set_clock(self.clock_file, '-1h')
        t0 = time.monotonic()
        self.ad.start()  # the same owner id, its start an hour before the last one's
        self.assert_completed_in_second_attempt(conv, sid, timeout=40)
        self.assertLess(time.monotonic() - t0, 20,
                        'the work waited for its lease instead of being taken back')
        self.assert_clock_apart(-1, event='reclaimed')

    def test_work_interrupted_after_the_clock_was_set_back_resumes_at_once(self):
        conv, sid = self.start_sleeping_tool('clock-back')
        set_clock(self.clock_file, '-1h')
        time.sleep(CLOCK_READ_S)
        self.stack.td.kill()  # the drive is interrupted: its work goes on the resume list
        t0 = time.monotonic()
        self.stack.td.start()
        self.assert_completed_in_second_attempt(conv, sid, timeout=40)
        self.assertLess(time.monotonic() - t0, 20,
                        'the work waited for its lease instead of being resumed')
        self.assert_clock_apart(-1, event='resumed')


class StoragedClockStepTest(SettableClockCase):
    """storaged's wall clock stepped an hour while work runs. Its leases, time limits and
    attempts' starts are times of its clock: the step must not end every lease at once
    (forward), hold a dead agentd's work for the hour (back), or take the hour off a time
    limit. A 10 s lease renewed every 4 s; agentd claims every 0.5 s, so a lease that looked
    ended after the step would be taken over before its next renewal."""
    clock_daemon = 'storaged'
    stack_kwargs = {'agents': ('runner-anthropic', 'timed'),
                    'agentd_args': ('--lease-ms', '10000', '--heartbeat-ms', '4000')}

    def setUp(self):
        set_clock(self.clock_file, '+0')  # each test starts on the host's clock
        super(StoragedClockStepTest, self).setUp()
        time.sleep(CLOCK_READ_S)

    def test_a_step_forward_keeps_leases_and_time_limits(self):
        conv, sid = self.start_sleeping_tool('sd-forward', agent='timed')
        set_clock(self.clock_file, '+1h')
        time.sleep(3)  # storaged reads the offset within 1 s; agentd claims every 0.5 s
        self.assertEqual(self.ad.get_submission(sid).attempt_count, 1,
                         'the step ended the lease of running work')
        # interrupted: a new claim after the step reads the 20 s limit as storaged keeps it
        self.stack.td.kill()
        self.stack.td.start()
        self.assert_completed_in_second_attempt(conv, sid, timeout=30)
        self.assert_clock_apart(+1, daemon=self.stack.sd, event=r'clock_stepped step_ms=\d+')

    def test_a_step_back_does_not_hold_a_dead_agentds_work(self):
        conv, sid = self.start_sleeping_tool('sd-back')
        self.ad.kill()  # its lease ends within 10 s of its last renewal
        set_clock(self.clock_file, '-1h')
        time.sleep(CLOCK_READ_S)
        self.ad.owner_id += '-next'  # not a restart of the same owner: a takeover after the lease
        self.ad.start()
        self.assert_completed_in_second_attempt(conv, sid, timeout=40)
        # the step back, stamped by storaged's clock (the event of this step, not the last one:
        # libfaketime, rereading the offset file, has been seen to hand out the host's clock
        # for a moment, a step of its own)
        self.assert_clock_apart(-1, daemon=self.stack.sd, event=r'clock_stepped step_ms=-\d+')

    def test_a_step_while_storaged_is_down_keeps_leases_and_time_limits(self):
        """storaged's clock stepped an hour forward while it was stopped: every lease would
        look ended and the 20 s time limit an hour past. (The step, the wall clock's move less
        the boot clock's, is an hour within a second: each clock is read to the millisecond.
        A restart under a second extends no lease; a busy machine's may take longer, and the
        lease that ran is extended by the time down.)"""
        conv, sid = self.start_sleeping_tool('sd-down-step', agent='timed', secs=8)
        t0 = time.monotonic()
        self.stack.sd.stop()
        set_clock(self.clock_file, '+1h')
        self.stack.sd.start()
        extended = '0' if time.monotonic() - t0 < 1 else '[01]'
        self.assert_kept(conv, sid, 'the step ended the lease of running work',
                         r'event=downtime_taken_in down_ms=\d+ measured_by=boot_clock '
                         r'leases_extended=%s clock_step_ms=3(599|600)\d{3} submissions_moved=1'
                         % extended)


class StoragedAwayTest(SleepingToolCase):
    """storaged stopped, or frozen, for longer than a lease while a tool runs: no heartbeat
    can be stored meanwhile, and the time it was away counts against no lease, so the work is
    not taken over when it is back. A 10 s lease renewed every 4 s; agentd claims every 0.5 s,
    so a lease that looked ended would be taken over at once."""
    stack_kwargs = {'agents': ('runner-anthropic',),
                    'agentd_args': ('--lease-ms', '10000', '--heartbeat-ms', '4000')}

    def test_a_stop_longer_than_a_lease_keeps_the_running_work(self):
        """storaged stopped for 12 s (the lease: 10 s) while a tool runs: no heartbeat is
        stored meanwhile, and the work is not taken over when it is back."""
        conv, sid = self.start_sleeping_tool('sd-down', secs=16)
        self.stack.sd.stop()
        time.sleep(12)
        self.stack.sd.start()
        self.assert_kept(conv, sid, 'a lease that ran while storaged was down was taken over',
                         r'event=downtime_taken_in down_ms=1\d{4} measured_by=boot_clock '
                         r'leases_extended=1 ')

    def test_a_freeze_longer_than_a_lease_keeps_the_running_work(self):
        """storaged frozen (SIGSTOP) for 12 s: agentd's calls meanwhile wait or time out, and
        the first batch its writer runs after SIGCONT finds the stall."""
        conv, sid = self.start_sleeping_tool('sd-frozen', secs=16)
        sd = self.stack.sd
        sd.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(12)
        finally:
            sd.proc.send_signal(signal.SIGCONT)
        self.assert_kept(conv, sid, 'a lease that ran while storaged was frozen was taken over',
                         r'event=leases_extended outage_ms=1\d{4} submissions=1 '
                         r'cause=writer_stalled')


if __name__ == '__main__':
    unittest.main()
