"""Agent definitions reloaded without a restart (agentd/defs.c: SIGHUP, and the watch of
--agents), and the signals that tell the model what changed while its system prompt stays
frozen (agentd/narrate.c): an `instructions` signal with the new instructions, an `environment`
signal when the sandbox goes (and the six tools with it), `resources` signals when tools come
and go, a reload during a drive told at its next turn; a definition that does not load leaves
the ones in force. Real storaged, toold and
agentd; the fake model plays the agents.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v \
        test_agentd_reload
"""

import json
import os
import signal
import threading
import time
import unittest

from test_agentd import COMPLETED, AgentdCase, body, kind, new_conv, request_system
from test_agentd_tool_servers import free_port, py_server, role, tool

SANDBOX_TOOLS = ['read', 'write', 'edit', 'bash', 'grep', 'glob']


def agent_md(name, instructions, toold=None, servers=(), workspace='{conversation}',
             subagents=()):
    sandbox = ('sandbox:\n  tools: "%s"\n  workspace: "%s"\n' % (toold, workspace)) if toold else ''
    tools = 'tools: [%s]\n' % ', '.join('"%s"' % s for s in servers) if servers else ''
    agents = 'agents: [%s]\n' % ', '.join(subagents) if subagents else ''
    return ('---\nname: %s\ndescription: Reload test agent.\nmodel: anthropic/claude-test-1\n'
            '%s%s%sdurability:\n  max_attempts: 3\n  timeout_ms: 120000\n---\n\nROLE %s. %s\n'
            % (name, sandbox, tools, agents, name, instructions))


class ReloadTest(AgentdCase):
    stack_kwargs = {'agents': ('task-scout',), 'agentd_args': ('--agents-poll-ms', '200')}

    def write(self, name, text):
        path = os.path.join(self.stack.agents_dir, name + '.md')
        with open(path + '.tmp', 'w') as f:
            f.write(text)
        os.rename(path + '.tmp', path)  # as an editor or a ConfigMap swaps it

    def reloads(self, event='agents_reloaded'):
        return self.ad.stderr_text().count('event=' + event)

    def wait_reload(self, before, event='agents_reloaded', hup=False):
        if hup:
            self.ad.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while self.reloads(event) <= before:
            self.assertLess(time.monotonic(), deadline, 'no %s in the log' % event)
            time.sleep(0.05)

    def submit(self, agent, conv, steps):
        self.fm.set_scenario(steps)
        seen = len(self.fm.requests())
        sid = self.ad.submit(agent, 'Go on.', conversation_id=conv).submission_id
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        reqs = [e for e in self.fm.requests()[seen:] if 'ROLE %s.' % agent in request_system(e)]
        return sid, reqs

    def submit_asked(self, agent, conv):
        """Submits 'Go.' to agent in conv and returns (its id, the model requests before it)
        once the model has been asked: the first turn is being answered."""
        seen = len(self.fm.requests())
        sid = self.ad.submit(agent, 'Go.', conversation_id=conv).submission_id
        deadline = time.monotonic() + 60
        while len(self.fm.requests()) == seen:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        return sid, seen

    def signals(self, conv, sid=None):
        return [body(r) for r in self.records(conv)
                if kind(r) == 'signal' and (sid is None or r.submission_id == sid)]

    def test_edited_instructions_are_told_and_the_prompt_stays_frozen(self):
        toold = self.stack.td.target
        self.write('editor', agent_md('editor', 'First instructions.', toold))
        self.wait_reload(self.reloads(), hup=True)
        conv = new_conv('editor')
        self.workspace(conv)
        _, first = self.submit('editor', conv, [role('editor', text='one')])
        self.assertIn('First instructions.', request_system(first[0]))
        before = self.reloads()
        self.write('editor', agent_md('editor', 'Second instructions: be brief.', toold))
        self.wait_reload(before, hup=True)
        sid, second = self.submit('editor', conv, [role('editor', text='two')])
        [sig] = self.signals(conv, sid)
        self.assertEqual(sig.kind, 'instructions')
        self.assertIn('Second instructions: be brief.', sig.text)
        self.assertEqual(request_system(second[0]), request_system(first[0]))  # byte for byte
        self.assertIn('Second instructions: be brief.', json.dumps(second[0]['body']['messages']))
        # told once: the next submission has nothing new to hear
        sid, _ = self.submit('editor', conv, [role('editor', text='three')])
        self.assertEqual(self.signals(conv, sid), [])
        prompts = [r for r in self.records(conv) if kind(r) == 'system_prompt']
        self.assertEqual(len(prompts), 1)

    def test_a_removed_sandbox_is_told_and_its_tools_go(self):
        toold = self.stack.td.target
        self.write('mover', agent_md('mover', 'Move things.', toold))
        self.wait_reload(self.reloads(), hup=True)
        conv = new_conv('mover')
        self.workspace(conv)
        _, first = self.submit('mover', conv, [role('mover', text='with a sandbox')])
        self.assertEqual([t['name'] for t in first[0]['body']['tools']], SANDBOX_TOOLS + ['task'])
        before = self.reloads()
        self.write('mover', agent_md('mover', 'Move things.'))  # no sandbox now
        self.wait_reload(before)  # seen by the watch of the directory, no SIGHUP
        sid, second = self.submit('mover', conv, [role('mover', text='without one')])
        self.assertEqual([t['name'] for t in second[0]['body']['tools']], ['task'])
        [sig] = self.signals(conv, sid)
        self.assertEqual(sig.kind, 'environment')
        self.assertIn('There is no sandbox any more', sig.text)
        self.assertIn('All available tools: task', sig.text)
        self.assertEqual(request_system(second[0]), request_system(first[0]))

    def test_a_sandbox_attached_then_switched_is_told(self):
        toold = self.stack.td.target
        self.write('roamer', agent_md('roamer', 'Roam.'))
        self.wait_reload(self.reloads(), hup=True)
        conv = new_conv('roamer')
        _, first = self.submit('roamer', conv, [role('roamer', text='no sandbox yet')])
        self.assertEqual([t['name'] for t in first[0]['body']['tools']], ['task'])
        self.assertNotIn('Working directory', request_system(first[0]))
        # attached
        before = self.reloads()
        self.workspace(conv)
        self.write('roamer', agent_md('roamer', 'Roam.', toold))
        self.wait_reload(before, hup=True)
        sid, second = self.submit('roamer', conv, [role('roamer', text='a sandbox now')])
        self.assertEqual([t['name'] for t in second[0]['body']['tools']], SANDBOX_TOOLS + ['task'])
        [sig] = self.signals(conv, sid)
        self.assertEqual(sig.kind, 'environment')
        self.assertIn('You have a sandbox to work in now', sig.text)
        ws = os.path.realpath(self.stack.td.workspace(conv))
        self.assertIn('The working directory is now %s.' % ws, sig.text)
        self.assertIn('All available tools: %s, task' % ', '.join(SANDBOX_TOOLS), sig.text)
        self.assertEqual(request_system(second[0]), request_system(first[0]))  # still frozen
        # switched to another workspace of the same toold
        before = self.reloads()
        other = self.workspace(conv + '-moved')
        self.write('roamer', agent_md('roamer', 'Roam.', toold, workspace=conv + '-moved'))
        self.wait_reload(before, hup=True)
        sid, third = self.submit('roamer', conv, [role('roamer', text='elsewhere')])
        [sig] = self.signals(conv, sid)
        self.assertEqual(sig.kind, 'environment')
        self.assertIn('was replaced', sig.text)
        self.assertIn('The working directory is now %s.' % os.path.realpath(other), sig.text)
        self.assertEqual(request_system(third[0]), request_system(first[0]))
        # nothing changed since: nothing told
        sid, _ = self.submit('roamer', conv, [role('roamer', text='settled in')])
        self.assertEqual(self.signals(conv, sid), [])

    def test_skills_subagents_and_an_updated_tool_are_told(self):
        toold = self.stack.td.target
        first_server = py_server([tool('lookup')])
        second_server = None
        try:
            self.write('curator', agent_md('curator', 'Curate.', toold,
                                           servers=[first_server.addr]))
            self.wait_reload(self.reloads(), hup=True)
            conv = new_conv('curator')
            ws = self.workspace(conv)
            _, first = self.submit('curator', conv, [role('curator', text='first')])
            self.assertEqual([t['name'] for t in first[0]['body']['tools']],
                             SANDBOX_TOOLS + ['task', 'lookup'])
            # the same tool name from another server that describes it differently, a skill
            # appearing in the sandbox, and a subagent declared
            changed = tool('lookup')
            changed['description'] = 'Looks things up, now in two catalogues.'
            second_server = py_server([changed])
            os.makedirs(os.path.join(ws, '.agents', 'skills', 'tidy'))
            with open(os.path.join(ws, '.agents', 'skills', 'tidy', 'SKILL.md'), 'w') as f:
                f.write('---\nname: tidy\ndescription: Tidy <the> files & folders.\n---\nTidy.\n')
            before = self.reloads()
            self.write('curator', agent_md('curator', 'Curate.', toold,
                                           servers=[second_server.addr],
                                           subagents=['task-scout']))
            self.wait_reload(before, hup=True)
            sid, second = self.submit('curator', conv, [role('curator', text='second')])
            self.assertEqual([t['name'] for t in second[0]['body']['tools']],
                             SANDBOX_TOOLS + ['task', 'activate_skill', 'lookup'])
            told = {s.text.split('\n')[0]: s for s in self.signals(conv, sid)}
            self.assertEqual(sorted(s.kind for s in told.values()), ['resources'] * 3, told)
            tools = [s.text for s in told.values() if 'The tool "lookup" was updated.' in s.text]
            self.assertEqual(len(tools), 1, told)
            self.assertIn('New tool available:\n- **activate_skill**', tools[0])
            self.assertIn('All available tools: %s, task, activate_skill, lookup'
                          % ', '.join(SANDBOX_TOOLS), tools[0])
            skills = told['New skill available:'].text
            self.assertIn('- **tidy** — Tidy <the> files & folders.', skills)
            self.assertIn('All available skills: tidy', skills)
            agents = told['New agent available:'].text
            self.assertIn('- **task-scout** — Looks something up and answers briefly.', agents)
            self.assertIn('All available agents: task-scout', agents)
            # what the model reads is escaped inside the signal's envelope
            sent = json.dumps(second[0]['body']['messages'])
            self.assertIn('Tidy &lt;the&gt; files &amp; folders.', sent)
            self.assertIn('<signal type=\\"resources\\" resource=\\"skill\\">', sent)
            self.assertEqual(request_system(second[0]), request_system(first[0]))
            # the skill goes again
            os.remove(os.path.join(ws, '.agents', 'skills', 'tidy', 'SKILL.md'))
            sid, _ = self.submit('curator', conv, [role('curator', text='third')])
            texts = [s.text for s in self.signals(conv, sid)]
            self.assertTrue(any('The skill "tidy" is no longer available.' in t
                                for t in texts), texts)
        finally:
            first_server.close()
            if second_server:
                second_server.close()

    def test_tools_that_come_and_go_are_told(self):
        port = free_port()
        addr = '127.0.0.1:%d' % port
        server = py_server([tool('lookup')], port=port)
        self.write('gatherer', agent_md('gatherer', 'Gather.', servers=[addr]))
        self.wait_reload(self.reloads(), hup=True)
        conv = new_conv('gatherer')
        try:
            _, reqs = self.submit('gatherer', conv, [role('gatherer', text='with lookup')])
            self.assertEqual([t['name'] for t in reqs[0]['body']['tools']], ['task', 'lookup'])
            server.close()
            sid, reqs = self.submit('gatherer', conv, [role('gatherer', text='without')])
            self.assertEqual([t['name'] for t in reqs[0]['body']['tools']], ['task'])
            texts = [s.text for s in self.signals(conv, sid)]
            self.assertTrue(any('The tool "lookup" is no longer available.' in t
                                for t in texts), texts)
            server = py_server([tool('lookup'), tool('fetch')], port=port)
            deadline = time.monotonic() + 60
            while True:  # agentd's channel reconnects within a second
                sid, reqs = self.submit('gatherer', conv, [role('gatherer', text='back')])
                names = [t['name'] for t in reqs[0]['body']['tools']]
                if names != ['task'] or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            self.assertEqual(names, ['task', 'lookup', 'fetch'])
            [sig] = [s for s in self.signals(conv, sid) if s.state.tools]
            self.assertIn('New tools available:\n- **lookup** — The lookup tool', sig.text)
            self.assertIn('- **fetch**', sig.text)
            self.assertIn('All available tools: task, lookup, fetch', sig.text)
        finally:
            server.close()

    def test_a_reload_during_a_drive_is_told_at_the_next_turn(self):
        toold = self.stack.td.target
        self.write('longrun', agent_md('longrun', 'Old way.', toold))
        self.wait_reload(self.reloads(), hup=True)
        conv = new_conv('longrun')
        self.workspace(conv)
        # the reload below must land while the first answer is on its way (6 s: 2.5 s was
        # little for a HUP, a reload and its log line on a loaded machine)
        self.fm.set_scenario([
            role('longrun', delay_ms=6000,
                 tool_calls=[{'name': 'bash', 'arguments': {'command': 'echo hi'}}]),
            role('longrun', text='Done the new way.'),
        ])
        sid, seen = self.submit_asked('longrun', conv)
        before = self.reloads()
        self.write('longrun', agent_md('longrun', 'New way: be quick.', toold))
        self.wait_reload(before, hup=True)
        sub = self.wait_settled(sid, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub)
        reqs = [e for e in self.fm.requests()[seen:] if 'ROLE longrun.' in request_system(e)]
        self.assertEqual(len(reqs), 2)
        [sig] = self.signals(conv, sid)
        self.assertEqual(sig.kind, 'instructions')
        self.assertIn('New way: be quick.', sig.text)
        self.assertNotIn('New way', json.dumps(reqs[0]['body']['messages']))
        self.assertIn('New way: be quick.', json.dumps(reqs[1]['body']['messages']))
        self.assertEqual(request_system(reqs[1]), request_system(reqs[0]))
        self.assertEqual([t['name'] for t in reqs[1]['body']['tools']], SANDBOX_TOOLS + ['task'])
        self.assertIn('event=drive_rebound', self.ad.stderr_text())

    def test_two_reloads_at_one_turn_boundary_are_both_told(self):
        """A reload ends while the drive is taking up the one before (the agent's tool server
        answers each List in 4 s: the drive's prompt stage and each reload's check list it):
        the drive rebinds twice at one turn boundary. Both signals had the same id and the
        second was dropped: the model went on with the older instructions. Timeline, from the
        first model request at T (answered at T+7 s): reload TWO from T to T+4; reload THREE
        from T+6 to T+10; the drive rebinds to TWO at T+7 (it has until T+10: 3 s for the
        tool call and the turn's end on a slow machine) and lists until T+11, then rebinds to
        THREE."""
        addr = '127.0.0.1:%d' % free_port()
        server = py_server([tool('lookup')], port=int(addr.split(':')[1]), list_sleep=4)
        try:
            self.write('twice', agent_md('twice', 'Way ONE.', servers=[addr]))
            self.wait_reload(self.reloads(), hup=True)
            conv = new_conv('twice')
            self.fm.set_scenario([
                role('twice', delay_ms=7000, tool_calls=[{'name': 'lookup', 'arguments': {}}]),
                role('twice', text='Done.')])
            rebound = self.ad.stderr_text().count('event=drive_rebound')
            sid, seen = self.submit_asked('twice', conv)
            asked = time.monotonic()
            before = self.reloads()
            self.write('twice', agent_md('twice', 'Way TWO.', servers=[addr]))
            self.wait_reload(before, hup=True)
            time.sleep(max(0, asked + 6 - time.monotonic()))
            before = self.reloads()
            self.write('twice', agent_md('twice', 'Way THREE.', servers=[addr]))
            self.wait_reload(before, hup=True)
            sub = self.wait_settled(sid, timeout=60)
            self.assertEqual(sub.outcome, COMPLETED, sub)
            self.assertEqual(self.ad.stderr_text().count('event=drive_rebound'), rebound + 2)
            texts = [s.text for s in self.signals(conv, sid) if s.kind == 'instructions']
            self.assertEqual(len(texts), 2, texts)
            self.assertIn('Way TWO.', texts[0])
            self.assertIn('Way THREE.', texts[1])
            last = [e for e in self.fm.requests()[seen:] if 'ROLE twice.' in request_system(e)][-1]
            self.assertIn('Way THREE.', json.dumps(last['body']['messages']))
        finally:
            server.close()

    def test_reloads_faster_than_the_prompt_stage_do_not_hold_the_model_call(self):
        """Definitions rewritten every 0.3 s (another agent's) while the agent's tool server
        takes 1.5 s to list its tools for the drive (and answers the reloads' checks at once):
        every turn boundary found a newer generation than the one its prompt stage had just
        listed, and the drive rebound again and again without asking the model until the
        rewriting stopped. It takes up a few reloads at one boundary, then goes on."""
        toold = self.stack.td.target
        addr = '127.0.0.1:%d' % free_port()
        conv = new_conv('churn')
        server = py_server([tool('lookup')], port=int(addr.split(':')[1]), list_sleep=1.5,
                           list_sleep_sandbox=conv)
        stop = threading.Event()

        def storm():
            n = 0
            while not stop.wait(0.3):
                n += 1
                self.write('bystander', agent_md('bystander', 'Way %d.' % n, toold))
        try:
            self.write('churn', agent_md('churn', 'Way 0.', toold, servers=[addr]))
            self.workspace(conv)
            self.wait_reload(self.reloads(), hup=True)
            self.fm.set_scenario([
                role('churn', delay_ms=2000, tool_calls=[{'name': 'lookup', 'arguments': {}}]),
                role('churn', text='Done.')])
            rebound = self.ad.stderr_text().count('event=drive_rebound')
            sid, _ = self.submit_asked('churn', conv)
            churner = threading.Thread(target=storm)
            churner.start()
            started = time.monotonic()
            # DRIVE_REBINDS_MAX (4) prompt stages of 1.5 s, the turn, and room on a slow machine
            sub = self.wait_settled(sid, timeout=25)
            settled_after = time.monotonic() - started
            self.assertFalse(stop.is_set())
            stop.set()
            churner.join()
            self.assertEqual(sub.outcome, COMPLETED, sub)
            self.assertLess(settled_after, 25)
            self.assertEqual(self.ad.stderr_text().count('event=drive_rebound') - rebound, 4)
        finally:
            stop.set()
            server.close()

    def test_a_reload_whose_tools_clash_is_refused(self):
        server = py_server([tool('lookup'), tool('activate_skill')])
        try:
            self.write('clasher', agent_md('clasher', 'Clash.'))
            self.wait_reload(self.reloads(), hup=True)
            failed = self.reloads('agents_reload_failed')
            self.write('clasher', agent_md('clasher', 'Clash now.', servers=[server.addr]))
            self.wait_reload(failed, event='agents_reload_failed', hup=True)
            self.assertIn('tool name "activate_skill" is reserved by the framework, but the tool '
                          'server at %s offers a tool by that name' % server.addr,
                          self.ad.stderr_text().replace('\\"', '"'))  # logfmt quotes
            # the definition in force stays, and works
            _, reqs = self.submit('clasher', new_conv('clasher'), [role('clasher', text='ok')])
            self.assertEqual([t['name'] for t in reqs[0]['body']['tools']], ['task'])
            self.assertIn('ROLE clasher. Clash.', request_system(reqs[0]))
        finally:
            server.close()
            self.write('clasher', agent_md('clasher', 'Clash.'))

    def test_a_definition_that_does_not_load_leaves_the_ones_in_force(self):
        self.write('steady', agent_md('steady', 'Stay steady.'))
        self.wait_reload(self.reloads(), hup=True)
        failed = self.reloads('agents_reload_failed')
        self.write('steady', '---\nname: steady\nmodel: nobody/x\n---\nbroken\n')
        self.wait_reload(failed, event='agents_reload_failed')
        self.assertIn("unknown provider 'nobody'", self.ad.stderr_text())
        info = [a for a in self.ad.list_all_agents() if a.name == 'steady'][0]
        self.assertEqual(info.model, 'anthropic/claude-test-1')
        self.submit('steady', new_conv('steady'), [role('steady', text='still here')])
        # mended: the watch loads it
        before = self.reloads()
        self.write('steady', agent_md('steady', 'Steady again.').replace(
            'Reload test agent.', 'Mended.'))
        self.wait_reload(before)
        info = [a for a in self.ad.list_all_agents() if a.name == 'steady'][0]
        self.assertEqual(info.description, 'Mended.')

    def test_a_fifo_or_deep_brackets_are_refused_at_once(self):
        """A FIFO named like a definition hung the reload in open() (no later reload ran,
        SIGTERM waited on it); a frontmatter of brackets nested 200,000 deep held the reload
        in libyaml for minutes. Both are refused at once, the definitions in force kept."""
        self.write('calm', agent_md('calm', 'Stay calm.'))
        self.wait_reload(self.reloads(), hup=True)
        fifo = os.path.join(self.stack.agents_dir, 'pipe.md')
        os.mkfifo(fifo)
        try:
            failed = self.reloads('agents_reload_failed')
            self.wait_reload(failed, event='agents_reload_failed', hup=True)
            self.assertIn('pipe.md: not a regular file', self.ad.stderr_text())
        finally:
            os.unlink(fifo)
        failed = self.reloads('agents_reload_failed')
        started = time.monotonic()
        self.write('deep', '---\nname: deep\ndescription: x\nagents: ' + '[' * 200000 + '\n---\n')
        self.wait_reload(failed, event='agents_reload_failed', hup=True)
        self.assertLess(time.monotonic() - started, 10)
        self.assertIn('nest more than 64 deep', self.ad.stderr_text())
        os.unlink(os.path.join(self.stack.agents_dir, 'deep.md'))
        self.submit('calm', new_conv('calm'), [role('calm', text='still calm')])

    def test_an_edit_deep_in_a_skill_is_picked_up(self):
        """A declared skill's supporting file 8 levels below its directory (the deepest a
        skill may have) was read at a reload, but the watch looked 6 levels deep: editing it
        reloaded nothing until a SIGHUP."""
        deep = os.path.join(self.stack.agents_dir, 'skills', 'deepskill', *'abcdefgh')
        os.makedirs(deep)
        with open(os.path.join(self.stack.agents_dir, 'skills', 'deepskill', 'SKILL.md'),
                  'w') as f:
            f.write('---\nname: deepskill\ndescription: Deep.\n---\nRead the notes.\n')
        with open(os.path.join(deep, 'notes.md'), 'w') as f:
            f.write('first\n')
        self.write('deepuser', agent_md('deepuser', 'Use skills.').replace(
            'durability:', 'skills: [deepskill]\ndurability:'))
        self.wait_reload(self.reloads(), hup=True)
        time.sleep(1)  # the watch (every 200 ms) has seen the files written above
        before = self.reloads('agents_reloaded why=files_changed')
        with open(os.path.join(deep, 'notes.md'), 'w') as f:
            f.write('second, longer\n')
        self.wait_reload(before, event='agents_reloaded why=files_changed')  # no SIGHUP


if __name__ == '__main__':
    unittest.main()
