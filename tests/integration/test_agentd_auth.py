"""Bearer tokens on the Agent API (agentd --tokens, docs/security.md "Tokens"): a call without a
token or with an unknown one is UNAUTHENTICATED; a token not allowed for an agent is
PERMISSION_DENIED (AGENT_NOT_ALLOWED); a conversation belongs to the principal that created it,
and another principal gets PERMISSION_DENIED (NOT_CONVERSATION_OWNER) on Submit into it, Watch,
GetSubmission, Abort, Compact and GetConversation, while an admin token passes; the principal is
durable (an agentd restarted from scratch still enforces it); the CLI sends CFLUE_TOKEN; SIGHUP
reloads the token file (a bad one keeps the tokens in force); a bad token file stops agentd at
start with exit 2, naming the file and the line; and no secret is ever found in any daemon's
log or in storaged's database files.

    cd tests/integration && CFLUE_BUILD_DIR=/work/main/build /usr/bin/python3 -m unittest -v test_agentd_auth
"""

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import uuid

import grpc

import cflue_harness as H
import secret_scan
from cflue_harness import (Agentd, FakeModel, Storaged, agent_pb2, common_pb2, error_reason,
                           get, get_conversation, _tail)

COMPLETED = common_pb2.OUTCOME_COMPLETED
DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTH = grpc.StatusCode.UNAUTHENTICATED

AGENT = '''---
name: %s
description: Test agent without tools (auth tests).
model: anthropic/claude-test-plain
---

You answer every message with one short sentence.
'''

# every secret this test ever sends, the wrong ones too: none may be found on disk afterwards
SECRETS = {name: secret_scan.secret('token-' + name)
           for name in ('alice', 'bob', 'carol', 'root', 'dave', 'wrong')}


def sha(secret):
    return hashlib.sha256(secret.encode()).hexdigest()


def entry(name, agents, admin=False):
    return ('  - name: %s\n    sha256: %s\n    agents: [%s]\n    admin: %s\n'
            % (name, sha(SECRETS[name]), ', '.join('"%s"' % a for a in agents),
               'true' if admin else 'false'))


TOKENS_V1 = ('tokens:\n' + entry('alice', ['plain']) + entry('bob', ['*'])
             + entry('carol', ['other']) + entry('root', ['*'], admin=True))
# the reload: dave added, carol removed
TOKENS_V2 = ('tokens:\n' + entry('alice', ['plain']) + entry('bob', ['*'])
             + entry('root', ['*'], admin=True) + entry('dave', ['plain', 'other']))


def new_conv(tag):
    return 'c-auth-%s-%s' % (tag, uuid.uuid4().hex[:10])


def write_atomically(path, text):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        f.write(text)
    os.rename(tmp, path)


class AgentdAuthTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix='cflue-auth-it-')
        cls.daemons = []
        try:
            cls.sd = cls._add(Storaged(workdir=cls._sub('storaged')))
            cls.fm = cls._add(FakeModel(steps=[], workdir=cls._sub('fake_model')))
            cls.agents_dir = cls._sub('agents')
            for name in ('plain', 'other'):
                with open(os.path.join(cls.agents_dir, name + '.md'), 'w') as f:
                    f.write(AGENT % name)
            cls.tokens = os.path.join(cls._sub('etc'), 'tokens.yaml')
            write_atomically(cls.tokens, TOKENS_V1)
            env = {'ANTHROPIC_BASE_URL': cls.fm.anthropic_base_url,
                   'ANTHROPIC_API_KEY': 'test-anthropic-key'}
            # --agents-poll-ms 0: only SIGHUP reloads, so the reload test decides when
            cls.ad = cls._add(Agentd(cls.sd.target, cls.agents_dir, owner_id='auth-it', env=env,
                                     workdir=cls._sub('agentd'),
                                     extra_args=('--tokens', cls.tokens,
                                                 '--agents-poll-ms', '0')))
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for d in reversed(cls.daemons):
            try:
                d.close()
            except Exception:
                pass
        secret_scan.discard(cls.dir)

    @classmethod
    def _sub(cls, name):
        p = os.path.join(cls.dir, name)
        os.makedirs(p, exist_ok=True)
        return p

    @classmethod
    def _add(cls, d):
        cls.daemons.append(d)
        return d

    def run(self, result=None):
        if result is None:
            return super().run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super().run(result)
        finally:
            if len(result.failures) + len(result.errors) > before:
                for d in self.daemons:
                    print('\n==== %s stderr ====\n%s'
                          % (type(d).__name__, _tail(d.stderr_text(), 60)))

    # ---- calls ----

    def call(self, method, req, who=None, auth=None, timeout=10):
        """The Agent method with the token of `who` (a name of SECRETS), or the raw
        authorization value `auth`, or no metadata at all. A stream is read to its end."""
        req_cls, resp_cls, streaming = H.AGENT_METHODS[method]
        md = ()
        if auth is not None:
            md = (('authorization', auth),)
        elif who is not None:
            md = (('authorization', 'Bearer ' + SECRETS[who]),)
        ch = self.ad._current_channel()
        path = '/cflue.v1.Agent/' + method
        if streaming:
            return list(ch.unary_stream(path, request_serializer=req_cls.SerializeToString,
                                        response_deserializer=resp_cls.FromString)(
                req, timeout=timeout, metadata=md))
        return ch.unary_unary(path, request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)(
            req, timeout=timeout, metadata=md)

    def refused(self, code, reason, method, req, **kw):
        with self.assertRaises(grpc.RpcError) as cm:
            self.call(method, req, **kw)
        e = cm.exception
        self.assertEqual(e.code(), code, '%s: %s' % (method, e.details()))
        if reason:
            self.assertEqual(error_reason(e), reason, '%s: %s' % (method, e.details()))
        for s in SECRETS.values():
            self.assertNotIn(s, e.details() or '')
        return e

    def submit(self, who, agent='plain', conv='', text='hello'):
        return self.call('Submit', agent_pb2.SubmitRequest(
            agent=agent, conversation_id=conv, message=common_pb2.Message(text=text)), who=who)

    def settled(self, who, sid):
        sub = self.call('GetSubmission', agent_pb2.GetSubmissionRequest(
            submission_id=sid, wait=True), who=who, timeout=30)
        self.assertEqual(sub.outcome, COMPLETED, sub.error)
        return sub

    def alices_conversation(self):
        adm = self.submit('alice', conv=new_conv('owned'))
        self.settled('alice', adm.submission_id)
        return adm

    def wait_log(self, event, count, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ad.stderr_text().count('event=' + event) >= count:
                return
            time.sleep(0.02)
        self.fail('no %d-th %s in the log:\n%s' % (count, event, _tail(self.ad.stderr_text())))

    def hup(self, event):
        n = self.ad.stderr_text().count('event=' + event)
        self.ad.proc.send_signal(signal.SIGHUP)
        self.wait_log(event, n + 1)

    # ---- tests ----

    def test_no_token_or_an_unknown_one(self):
        req = agent_pb2.SubmitRequest(agent='plain', message=common_pb2.Message(text='hi'))
        e = self.refused(UNAUTH, 'UNAUTHENTICATED', 'Submit', req)
        self.assertIn('Bearer', e.details())
        for method, r in (('ListAgents', agent_pb2.ListAgentsRequest()),
                          ('Watch', agent_pb2.WatchRequest(conversation_id='c-x')),
                          ('GetSubmission', agent_pb2.GetSubmissionRequest(submission_id='s-x')),
                          ('Abort', agent_pb2.AbortRequest(conversation_id='c-x')),
                          ('Compact', agent_pb2.CompactRequest(conversation_id='c-x')),
                          ('GetConversation',
                           agent_pb2.GetConversationRequest(conversation_id='c-x'))):
            self.refused(UNAUTH, 'UNAUTHENTICATED', method, r)
            self.refused(UNAUTH, 'UNAUTHENTICATED', method, r, who='wrong')
        e = self.refused(UNAUTH, 'UNAUTHENTICATED', 'Submit', req, who='wrong')
        self.assertIn('not one this agentd knows', e.details())
        # not a bearer token, or a secret with a space: refused without a word of it
        for auth in ('Basic ' + SECRETS['wrong'], 'Bearer', 'Bearer ' + SECRETS['wrong'] + ' x',
                     'Bearer ' + 'x' * 1025, SECRETS['alice']):
            self.refused(UNAUTH, 'UNAUTHENTICATED', 'Submit', req, auth=auth)
        # the scheme in any case, and the secret exact: a prefix of alice's is no token
        self.refused(UNAUTH, 'UNAUTHENTICATED', 'ListAgents', agent_pb2.ListAgentsRequest(),
                     auth='Bearer ' + SECRETS['alice'][:-1])
        self.call('ListAgents', agent_pb2.ListAgentsRequest(), auth='bEaReR ' + SECRETS['alice'])
        # health stays open
        self.assertEqual(self.ad.health_check(''), H.SERVING)

    def test_agents_a_token_allows(self):
        self.refused(DENIED, 'AGENT_NOT_ALLOWED', 'Submit', agent_pb2.SubmitRequest(
            agent='plain', message=common_pb2.Message(text='hi')), who='carol')
        # an agent it may not use is refused even when unknown: no existence oracle
        self.refused(DENIED, 'AGENT_NOT_ALLOWED', 'Submit', agent_pb2.SubmitRequest(
            agent='nobody', message=common_pb2.Message(text='hi')), who='carol')
        self.refused(grpc.StatusCode.NOT_FOUND, 'UNKNOWN_AGENT', 'Submit', agent_pb2.SubmitRequest(
            agent='nobody', message=common_pb2.Message(text='hi')), who='bob')
        names = lambda who: [a.name for a in self.call('ListAgents', agent_pb2.ListAgentsRequest(),
                                                       who=who).agents]
        self.assertEqual(names('carol'), ['other'])
        self.assertEqual(names('alice'), ['plain'])
        self.assertEqual(names('bob'), ['other', 'plain'])
        page = self.call('ListAgents', agent_pb2.ListAgentsRequest(page_size=1), who='bob')
        self.assertEqual([a.name for a in page.agents], ['other'])
        page = self.call('ListAgents', agent_pb2.ListAgentsRequest(
            page_size=1, page_token=page.next_page_token), who='bob')
        self.assertEqual(([a.name for a in page.agents], page.next_page_token), (['plain'], ''))
        carol = self.submit('carol', agent='other')
        self.settled('carol', carol.submission_id)

    def test_conversation_belongs_to_its_creator(self):
        adm = self.alices_conversation()
        conv, sid = adm.conversation_id, adm.submission_id
        # alice's own calls work, end to end
        recs = self.call('Watch', agent_pb2.WatchRequest(conversation_id=conv, after_offset=-1),
                         who='alice')
        self.assertIn('user_message', [r.WhichOneof('body') for r in recs])
        self.assertEqual(recs[-1].WhichOneof('body'), 'submission_settled')
        self.assertEqual(self.call('GetSubmission', agent_pb2.GetSubmissionRequest(
            submission_id=sid), who='alice').principal, 'alice')
        view = self.call('GetConversation', agent_pb2.GetConversationRequest(
            conversation_id=conv), who='alice')
        self.assertEqual(view.principal, 'alice')
        second = self.submit('alice', conv=conv, text='again')
        self.settled('alice', second.submission_id)
        # bob: refused everywhere, without learning whose it is
        reqs = [('Watch', agent_pb2.WatchRequest(conversation_id=conv, after_offset=-1)),
                ('Watch', agent_pb2.WatchRequest(conversation_id=conv, follow=True)),
                ('GetSubmission', agent_pb2.GetSubmissionRequest(submission_id=sid)),
                ('GetSubmission', agent_pb2.GetSubmissionRequest(submission_id=sid, wait=True)),
                ('Abort', agent_pb2.AbortRequest(submission_id=sid)),
                ('Abort', agent_pb2.AbortRequest(conversation_id=conv)),
                ('Compact', agent_pb2.CompactRequest(conversation_id=conv)),
                ('GetConversation', agent_pb2.GetConversationRequest(conversation_id=conv)),
                ('Submit', agent_pb2.SubmitRequest(agent='plain', conversation_id=conv,
                                                   message=common_pb2.Message(text='mine?')))]
        for method, req in reqs:
            e = self.refused(DENIED, 'NOT_CONVERSATION_OWNER', method, req, who='bob')
            self.assertNotIn('alice', e.details())
        # storaged's durable record says so, and holds nothing of bob's attempts
        self.assertEqual(get_conversation(self.sd.stub, conv).principal, 'alice')
        self.assertEqual(get_conversation(self.sd.stub, conv).unsettled, 0)
        # an admin token passes everywhere; what it adds stays alice's conversation
        for method, req in reqs[:4] + reqs[7:8]:
            if not (method == 'Watch' and req.follow):
                self.call(method, req, who='root')
        by_root = self.submit('root', conv=conv, text='from the admin')
        self.assertEqual(self.settled('root', by_root.submission_id).principal, 'alice')
        self.assertEqual(get(self.sd.stub, by_root.submission_id).principal, 'alice')
        self.refused(grpc.StatusCode.FAILED_PRECONDITION, 'NOTHING_TO_COMPACT', 'Compact',
                     agent_pb2.CompactRequest(conversation_id=conv), who='root')
        self.call('Abort', agent_pb2.AbortRequest(conversation_id=conv), who='root')
        self.call('Abort', agent_pb2.AbortRequest(conversation_id=conv), who='alice')

    def test_a_chosen_conversation_id_is_taken_by_its_first_submit(self):
        conv = new_conv('chosen')
        first = self.submit('bob', conv=conv)
        self.refused(DENIED, 'NOT_CONVERSATION_OWNER', 'Submit', agent_pb2.SubmitRequest(
            agent='plain', conversation_id=conv, message=common_pb2.Message(text='x')),
            who='alice')
        self.settled('bob', first.submission_id)

    def test_principal_survives_an_agentd_restart(self):
        adm = self.alices_conversation()
        self.ad.restart()
        self.refused(DENIED, 'NOT_CONVERSATION_OWNER', 'Watch', agent_pb2.WatchRequest(
            conversation_id=adm.conversation_id), who='bob')
        self.refused(DENIED, 'NOT_CONVERSATION_OWNER', 'Submit', agent_pb2.SubmitRequest(
            agent='plain', conversation_id=adm.conversation_id,
            message=common_pb2.Message(text='x')), who='bob')
        again = self.submit('alice', conv=adm.conversation_id, text='after the restart')
        self.settled('alice', again.submission_id)

    def test_cli_sends_the_token(self):
        env = dict(os.environ, CFLUE_AGENTD=self.ad.target)
        env.pop('CFLUE_TOKEN', None)
        env.pop('CFLUE_TOKEN_FILE', None)

        def cli(args, extra, stdin=None):
            return subprocess.run([H.CLI_BIN] + args, env=dict(env, **extra), input=stdin,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                                  universal_newlines=True)

        r = cli(['submit', '--agent', 'plain', 'hello from the cli'],
                {'CFLUE_TOKEN': SECRETS['alice']})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('scenario finished', r.stdout)
        r = cli(['agents'], {'CFLUE_TOKEN': SECRETS['carol']})
        self.assertEqual((r.returncode, [l.split()[0] for l in r.stdout.splitlines()]),
                         (0, ['other']), r.stderr)
        # a token file of the caller's (outside the directory test_zz_no_secret_on_disk reads)
        secret_dir = tempfile.mkdtemp(prefix='cflue-auth-token-')
        try:
            path = os.path.join(secret_dir, 'alice.token')
            with open(path, 'w') as f:
                f.write(SECRETS['alice'] + '\n')
            r = cli(['agents', '--token-file', path], {})
            self.assertEqual((r.returncode, r.stdout.split()[0]), (0, 'plain'), r.stderr)
            r = cli(['agents'], {'CFLUE_TOKEN_FILE': path})
            self.assertEqual(r.returncode, 0, r.stderr)
        finally:
            shutil.rmtree(secret_dir, ignore_errors=True)
        for extra in ({}, {'CFLUE_TOKEN': SECRETS['wrong']}):
            r = cli(['agents'], extra)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn('UNAUTHENTICATED', r.stderr)
            self.assertNotIn(SECRETS['wrong'], r.stdout + r.stderr)
        r = cli(['agents'], {'CFLUE_TOKEN': 'two words'})
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertNotIn('two words', r.stderr)
        r = cli(['token', 'hash'], {}, stdin=SECRETS['dave'] + '\n')
        self.assertEqual((r.returncode, r.stdout.strip()), (0, sha(SECRETS['dave'])), r.stderr)
        r = cli(['token', 'new'], {})
        self.assertEqual(r.returncode, 0, r.stderr)
        fields = dict(l.split(':', 1) for l in r.stdout.splitlines())
        self.assertEqual(sha(fields['token'].strip()), fields['sha256'].strip())

    def test_sighup_reloads_the_tokens(self):
        try:
            self.refused(UNAUTH, 'UNAUTHENTICATED', 'ListAgents', agent_pb2.ListAgentsRequest(),
                         who='dave')
            write_atomically(self.tokens, TOKENS_V2)
            self.hup('tokens_reloaded')
            self.call('ListAgents', agent_pb2.ListAgentsRequest(), who='dave')
            self.refused(UNAUTH, 'UNAUTHENTICATED', 'ListAgents', agent_pb2.ListAgentsRequest(),
                         who='carol')
            dave = self.submit('dave', agent='other')
            self.settled('dave', dave.submission_id)
            # a bad file: the tokens in force stay, and the log names the file and line
            write_atomically(self.tokens, TOKENS_V2 + '  - name: dave\n    sha256: 00\n')
            self.hup('tokens_reload_failed')
            self.assertIn('tokens.yaml:', self.ad.stderr_text().split(
                'event=tokens_reload_failed')[-1].splitlines()[0])
            self.call('ListAgents', agent_pb2.ListAgentsRequest(), who='dave')
        finally:
            write_atomically(self.tokens, TOKENS_V1)
            self.hup('tokens_reloaded')
        self.call('ListAgents', agent_pb2.ListAgentsRequest(), who='carol')
        self.refused(UNAUTH, 'UNAUTHENTICATED', 'ListAgents', agent_pb2.ListAgentsRequest(),
                     who='dave')

    def test_bad_token_file_stops_agentd(self):
        cases = [
            ('duplicate', TOKENS_V1 + entry('alice', ['plain']).replace(
                sha(SECRETS['alice']), sha('other secret')), 'tokens.yaml:18', 'alice'),
            ('same hash', TOKENS_V1 + entry('bob', ['*']).replace('name: bob', 'name: bob2'),
             'tokens.yaml:18', 'same hash'),
            ('unknown key', 'tokens:\n  - name: x\n    secret: hunter2\n', 'tokens.yaml:3',
             'unknown key'),
            ('bad hex', 'tokens:\n  - name: x\n    sha256: zz\n', 'tokens.yaml:3', 'sha256'),
            ('bad name', 'tokens:\n  - name: "a b"\n    sha256: %s\n' % ('0' * 64),
             'tokens.yaml:2', 'name'),
            ('top level', 'token:\n  - name: x\n', 'tokens.yaml:1', 'unknown key'),
            ('not yaml', 'tokens: [\n', 'tokens.yaml:', ''),
            ('missing', None, 'tokens.yaml', 'cannot read'),
        ]
        for what, text, where, word in cases:
            d = tempfile.mkdtemp(dir=self.dir)
            path = os.path.join(d, 'tokens.yaml')
            if text is not None:
                with open(path, 'w') as f:
                    f.write(text)
            r = subprocess.run([H.AGENTD_BIN, '--listen', '127.0.0.1:0', '--store',
                                self.sd.target, '--agents', self.agents_dir, '--tokens', path],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=20,
                               universal_newlines=True)
            self.assertEqual(r.returncode, 2, '%s: %s' % (what, r.stderr))
            self.assertIn(where, r.stderr, what)
            self.assertIn(word, r.stderr, what)
            self.assertNotIn('hunter2', r.stderr, what)

    def test_zz_no_secret_on_disk(self):
        """Runs last (by name): after every other test used every secret (the wrong ones too),
        none is in any daemon's log, in storaged's database, WAL or any other file."""
        self.alices_conversation()
        found = []
        for root, _, files in os.walk(self.dir):
            for name in files:
                if not os.path.isfile(os.path.join(root, name)):
                    continue  # the daemons' sockets
                with open(os.path.join(root, name), 'rb') as f:
                    data = f.read()
                for who, s in SECRETS.items():
                    if s.encode() in data:
                        found.append((os.path.join(root, name), who))
        self.assertEqual(found, [])
        db = [n for n in os.listdir(self.sd.dir) if n.startswith(os.path.basename(self.sd.db))]
        self.assertTrue(db, os.listdir(self.sd.dir))  # the database was looked at


if __name__ == '__main__':
    unittest.main()
