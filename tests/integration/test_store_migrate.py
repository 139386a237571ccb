"""storaged opens a database written by an earlier schema and migrates it in place. Version 1
(JSON record bodies, compaction as metadata cflue.kind=compact): every record becomes its typed
body, unknown types become legacy signals, compact submissions get kind COMPACT. Version 2
(no `runnable` table): the Claim indexes are built and filled, so Claim finds the right heads.
Version 3 (no List indexes): the indexes of List's owner and abort filters are built.
Version 4 (no parent column): every submission gets parent_submission_id NULL and its index, and
delegated submissions can be admitted under the migrated ones. Version 5 (no principal columns):
every conversation and submission gets principal NULL (none: made without authentication), so
only an admin Admit or one without a principal goes into a migrated conversation. Version 6
(no trace columns): every submission gets traceparent and tracestate NULL (read back empty),
and submissions admitted afterwards keep theirs. Version 7 (no claimer start): a restarted owner
takes its attempts back by storaged's clock until they are claimed again. Version 8 (records
WITHOUT ROWID): the records are copied into the rowid table, long ones included, in order,
and the conversation goes on after them."""

import json
import os
import sys

import grpc
import sqlite3
import tempfile
import unittest

from cflue_harness import (
    NamespacedStoraged, StoragedTestCase, TmpfsNamespace, admit, admit_request, append, claim,
    common_pb2, error_reason, get, private_mount_problem, read_all, record, request_abort,
    require_namespace, settle, store_pb2)

# The version-1 schema exactly as storaged wrote it (git show d3f3e8f:storaged/db.c).
OLD_SCHEMA = '''
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE conversations(  conversation_id TEXT PRIMARY KEY,  agent TEXT NOT NULL,  created_at INTEGER NOT NULL,  next_pos INTEGER NOT NULL DEFAULT 0,  epoch INTEGER NOT NULL DEFAULT 0);
CREATE TABLE submissions(  sequence INTEGER PRIMARY KEY AUTOINCREMENT,  submission_id TEXT NOT NULL UNIQUE,  conversation_id TEXT NOT NULL REFERENCES conversations(conversation_id),  agent TEXT NOT NULL,  idempotency_key TEXT,  payload BLOB NOT NULL,  status TEXT NOT NULL CHECK (status IN    ('queued','running','terminalizing','settled','joining','joined')),  outcome TEXT CHECK (outcome IN ('completed','failed','aborted')),  error TEXT,  attempt_id TEXT,  epoch INTEGER NOT NULL DEFAULT 0,  owner_id TEXT,  lease_expires_at INTEGER NOT NULL DEFAULT 0,  attempt_count INTEGER NOT NULL DEFAULT 0,  max_attempts INTEGER NOT NULL DEFAULT 10,  timeout_at INTEGER NOT NULL DEFAULT 0,  accepted_at INTEGER NOT NULL,  started_at INTEGER,  input_applied_at INTEGER,  abort_requested_at INTEGER,  abort_reason TEXT,  joined_into TEXT,  settled_at INTEGER,  answered_by TEXT,  reserved_outcome TEXT CHECK (reserved_outcome IN ('completed','failed','aborted')),  reserved_error TEXT,  admit_pos INTEGER NOT NULL,  input_tokens INTEGER NOT NULL DEFAULT 0,  output_tokens INTEGER NOT NULL DEFAULT 0,  cost_usd REAL NOT NULL DEFAULT 0,  CHECK ((status = 'settled') = (outcome IS NOT NULL)));
CREATE UNIQUE INDEX submissions_by_key ON submissions(agent, idempotency_key)  WHERE idempotency_key IS NOT NULL;
CREATE INDEX submissions_by_conversation ON submissions(conversation_id, status, sequence);
CREATE INDEX submissions_by_status ON submissions(status, sequence);
CREATE INDEX submissions_by_host ON submissions(joined_into) WHERE joined_into IS NOT NULL;
CREATE TABLE records(  conversation_id TEXT NOT NULL,  pos INTEGER NOT NULL,  record_id TEXT NOT NULL,  type TEXT NOT NULL,  submission_id TEXT,  attempt_id TEXT,  ts INTEGER NOT NULL,  body TEXT NOT NULL,  PRIMARY KEY (conversation_id, pos),  UNIQUE (conversation_id, record_id)) WITHOUT ROWID;
INSERT INTO meta(key, value) VALUES ('schema_version', '1');
'''

# The version-2 schema exactly as storaged wrote it (git show 8ff4733:storaged/db.c).
V2_SCHEMA = OLD_SCHEMA.replace(
    "cost_usd REAL NOT NULL DEFAULT 0,",
    "cost_usd REAL NOT NULL DEFAULT 0,  kind INTEGER NOT NULL DEFAULT 1 CHECK (kind IN (1, 2)),"
).replace(
    "CREATE TABLE records(  conversation_id TEXT NOT NULL,  pos INTEGER NOT NULL,  record_id "
    "TEXT NOT NULL,  type TEXT NOT NULL,  submission_id TEXT,  attempt_id TEXT,  ts INTEGER "
    "NOT NULL,  body TEXT NOT NULL,",
    "CREATE TABLE records(conversation_id TEXT NOT NULL,  pos INTEGER NOT NULL,  record_id "
    "TEXT NOT NULL,  kind INTEGER NOT NULL,  submission_id TEXT,  attempt_id TEXT,  ts INTEGER "
    "NOT NULL,  body BLOB NOT NULL,"
).replace("VALUES ('schema_version', '1')", "VALUES ('schema_version', '2')")

T = 1700000000000

# The schema version this storaged writes.
CURRENT = '9'

# What turns this version's schema back into version 8's: records WITHOUT ROWID, keyed by
# position (git show 7b1aaf0:storaged/db.h).
TO_V8 = ("CREATE TABLE records_v8(conversation_id TEXT NOT NULL,  pos INTEGER NOT NULL,  "
         "record_id TEXT NOT NULL,  kind INTEGER NOT NULL,  submission_id TEXT,  attempt_id "
         "TEXT,  ts INTEGER NOT NULL,  body BLOB NOT NULL,  PRIMARY KEY (conversation_id, pos),  "
         "UNIQUE (conversation_id, record_id)) WITHOUT ROWID;"
         "INSERT INTO records_v8 SELECT conversation_id, pos, record_id, kind, submission_id, "
         "attempt_id, ts, body FROM records;"
         "DROP TABLE records;"
         "ALTER TABLE records_v8 RENAME TO records;")

# ... and into version 7's: no claimer start.
TO_V7 = TO_V8 + "ALTER TABLE submissions DROP COLUMN owner_started_at;"

# ... and into version 6's: no trace columns.
TO_V6 = TO_V7 + ("ALTER TABLE submissions DROP COLUMN tracestate;"
                 "ALTER TABLE submissions DROP COLUMN traceparent;")

# ... and into version 5's: no principal columns.
TO_V5 = TO_V6 + ("ALTER TABLE conversations DROP COLUMN principal;"
                 "ALTER TABLE submissions DROP COLUMN principal;")

# ... and into version 4's: no parent column, no index of it.
TO_V4 = TO_V5 + ("DROP INDEX submissions_by_parent;"
                 "ALTER TABLE submissions DROP COLUMN parent_submission_id;")


def payload(text='', metadata=None, key=''):
    req = store_pb2.AdmitRequest(agent='assistant', conversation_id='old', idempotency_key=key)
    req.message.text = text
    for k, v in sorted((metadata or {}).items()):
        req.metadata[k] = v
    return req.SerializeToString(deterministic=True)


RECORDS = [
    ('system_prompt', {'text': 'be brief'}),
    ('user_message', {'text': 'hi', 'attachments': [
        {'name': 'a.png', 'mime_type': 'image/png', 'bytes': 12}]}),
    ('assistant_delta', {'turn': 1, 'text': 'he'}),
    ('assistant_message', {'turn': 1, 'text': 'hello', 'tool_calls': [
        {'id': 'c1', 'name': 'bash', 'arguments': '{"command":"ls"}'}],
        'stop_reason': 'tool_use', 'model': 'fake/m', 'usage': {
            'input_tokens': 10, 'output_tokens': 3}, 'cost_usd': 0.25}),
    ('tool_result', {'turn': 1, 'index': 0, 'tool_call_id': 'c1', 'name': 'bash',
                     'text': 'out', 'is_error': True, 'truncation': {
                         'truncated': True, 'total_lines': 9, 'total_bytes': 99,
                         'next_offset': 5}}),
    ('signal', {'type': 'resources', 'text': 'disk low'}),
    ('compaction', {'summary': 'sum', 'first_kept_offset': 2, 'tokens_before': 100,
                    'tokens_after': 10, 'reason': 'overflow'}),
    ('submission_settled', {'outcome': 'failed', 'error': 'boom',
                            'answered_by': 'sub_a'}),
    ('note.v2', {'x': 1}),
]


# Reads, inside a TmpfsNamespace, its store.db's schema version, the rows of each records table
# (both while the move is part way) and SQLite's integrity check.
DISK_STATE = """
import json, sqlite3, sys
con = sqlite3.connect(sys.argv[1])
state = {'version': con.execute("SELECT value FROM meta WHERE key = 'schema_version'")
         .fetchone()[0], 'check': con.execute('PRAGMA integrity_check').fetchone()[0]}
for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
    if t in ('records', 'records_v9'):
        state[t] = con.execute('SELECT count(*) FROM ' + t).fetchone()[0]
print(json.dumps(state))
"""


def disk_state(disk):
    return json.loads(disk.run('exec "$0" -c "$1" "$2"', sys.executable, DISK_STATE,
                               disk.path('store.db')))

class MigrateTest(StoragedTestCase):

    def make_old_db(self):
        path = os.path.join(tempfile.mkdtemp(prefix='cflue-mig-'), 'store.db')
        con = sqlite3.connect(path)
        con.executescript(OLD_SCHEMA)
        con.execute("INSERT INTO conversations VALUES ('old', 'assistant', ?, ?, 1)",
                    (T, len(RECORDS)))
        rows = [('sub_a', payload('hi'), 'settled', 'failed', 'boom', None),
                ('sub_c', payload('(compact)', {'cflue.kind': 'compact', 'z': '1'}, 'k-c'),
                 'queued', None, None, 'k-c')]
        for i, (sid, p, st, oc, er, key) in enumerate(rows):
            con.execute("INSERT INTO submissions(submission_id, conversation_id, agent, "
                        "idempotency_key, payload, status, outcome, error, accepted_at, "
                        "admit_pos) VALUES (?, 'old', 'assistant', ?, ?, ?, ?, ?, ?, -1)",
                        (sid, key, p, st, oc, er, T + i))
        for pos, (type_, body) in enumerate(RECORDS):
            con.execute("INSERT INTO records VALUES ('old', ?, ?, ?, 'sub_a', 'att_1', ?, ?)",
                        (pos, 'r%d' % pos, type_, T + pos, json.dumps(body)))
        con.commit()
        con.close()
        return path

    def test_migrates_records_and_kinds(self):
        path = self.make_old_db()
        sd = self.start_storaged(db=path)
        recs = read_all(sd.stub, 'old')
        self.assertEqual([r.WhichOneof('body') for r in recs],
                         ['system_prompt', 'user_message', 'assistant_delta',
                          'assistant_message', 'tool_result', 'signal', 'compaction',
                          'submission_settled', 'signal'])
        self.assertEqual([r.id for r in recs], ['r%d' % i for i in range(len(RECORDS))])
        self.assertEqual(recs[0].system_prompt.text, 'be brief')
        self.assertEqual(recs[1].user_message.attachments[0],
                         common_pb2.AttachmentRef(name='a.png', mime_type='image/png',
                                                  size_bytes=12))
        self.assertEqual((recs[2].assistant_delta.turn, recs[2].assistant_delta.text), (1, 'he'))
        am = recs[3].assistant_message
        self.assertEqual((am.turn, am.text, am.stop_reason, am.model), (1, 'hello', 'tool_use',
                                                                        'fake/m'))
        self.assertEqual(am.tool_calls[0], common_pb2.ToolCallRequest(
            id='c1', name='bash', arguments_json='{"command":"ls"}'))
        self.assertEqual(am.usage, common_pb2.Usage(input_tokens=10, output_tokens=3,
                                                    cost_usd=0.25))
        tr = recs[4].tool_result
        self.assertEqual((tr.turn, tr.index, tr.tool_call_id, tr.name, tr.text, tr.is_error),
                         (1, 0, 'c1', 'bash', 'out', True))
        self.assertEqual((tr.truncation.truncated, tr.truncation.total_lines,
                          tr.truncation.total_bytes, tr.truncation.next_offset),
                         (True, 9, 99, 5))
        self.assertEqual((recs[5].signal.kind, recs[5].signal.text), ('resources', 'disk low'))
        cp = recs[6].compaction
        self.assertEqual((cp.summary, cp.first_kept_offset, cp.tokens_before, cp.tokens_after,
                          cp.trigger), ('sum', 2, 100, 10, common_pb2.COMPACTION_TRIGGER_OVERFLOW))
        self.assertEqual(recs[7].submission_settled, common_pb2.SubmissionSettled(
            outcome=common_pb2.OUTCOME_FAILED, error='boom', answered_by='sub_a'))
        self.assertEqual(recs[8].signal.kind, 'legacy_note_v2')
        self.assertEqual(json.loads(recs[8].signal.text), {'x': 1})
        self.assertEqual(recs[3].create_time.ToMilliseconds(), T + 3)
        # the compaction submission: kind COMPACT, the reserved key gone, the rest kept
        c = get(sd.stub, 'sub_c')
        self.assertEqual(c.kind, common_pb2.SUBMISSION_KIND_COMPACT)
        self.assertEqual(dict(c.metadata), {'z': '1'})
        self.assertEqual(get(sd.stub, 'sub_a').kind, common_pb2.SUBMISSION_KIND_MESSAGE)
        # a fresh record appends after the migrated ones; the schema is stamped CURRENT
        r = admit(sd.stub, conv='old', text='new')
        self.assertEqual(r.offset, len(RECORDS) - 1)
        sd.stop()
        con = sqlite3.connect(path)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            cols = [row[1] for row in con.execute('PRAGMA table_info(records)')]
            self.assertIn('kind', cols)
            self.assertNotIn('type', cols)
            (sql,) = con.execute("SELECT sql FROM sqlite_master WHERE name = 'records'")\
                .fetchone()
            self.assertNotIn('WITHOUT ROWID', sql)
        finally:
            con.close()


    def test_migrates_version_2_and_claims_heads(self):
        """A version-2 database: a running head with a queued row behind it, a free queued
        head, a settled head with a queued row behind it. After the migration Claim takes the
        two queued heads, oldest first, and nothing behind the running one."""
        self.assertIn('kind INTEGER NOT NULL DEFAULT 1', V2_SCHEMA)
        self.assertIn('kind INTEGER NOT NULL,  submission_id', V2_SCHEMA)
        self.assertIn("'schema_version', '2'", V2_SCHEMA)
        path = os.path.join(tempfile.mkdtemp(prefix='cflue-mig2-'), 'store.db')
        con = sqlite3.connect(path)
        con.executescript(V2_SCHEMA)
        far = T * 2  # a lease that does not run out during the test
        rows = [  # (submission, conversation, status, outcome, attempt, lease, started)
            ('sub_b1', 'busy', 'running', None, 'att_b1', far, T),
            ('sub_b2', 'busy', 'queued', None, None, 0, None),
            ('sub_f1', 'free', 'queued', None, None, 0, None),
            ('sub_d1', 'done', 'settled', 'completed', 'att_d1', 0, T),
            ('sub_d2', 'done', 'queued', None, None, 0, None),
        ]
        for conv in ('busy', 'free', 'done'):
            con.execute("INSERT INTO conversations VALUES (?, 'assistant', ?, 0, 1)", (conv, T))
        for i, (sid, conv, st, oc, att, lease, started) in enumerate(rows):
            con.execute("INSERT INTO submissions(submission_id, conversation_id, agent, payload, "
                        "status, outcome, attempt_id, epoch, owner_id, lease_expires_at, "
                        "accepted_at, started_at, admit_pos) VALUES (?, ?, 'assistant', ?, ?, ?, "
                        "?, ?, ?, ?, ?, ?, -1)",
                        (sid, conv, payload('m%d' % i), st, oc, att, 1 if att else 0,
                         'other' if att else None, lease, T + i, started))
        con.commit()
        con.close()
        sd = self.start_storaged(db=path)
        got = [claim(sd.stub, owner='o2') for _ in range(3)]
        self.assertEqual(got[0].submission.submission_id, 'sub_f1')
        self.assertEqual(got[1].submission.submission_id, 'sub_d2')
        self.assertFalse(got[2].HasField('submission'), got[2])
        self.assertEqual(got[1].fence.epoch, 2)  # the conversation's epoch went on from 1
        sd.stop()
        con = sqlite3.connect(path)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            self.assertEqual(con.execute('SELECT count(*) FROM runnable').fetchone()[0], 0)
        finally:
            con.close()

    def test_migrates_version_3_and_lists_by_owner_and_abort(self):
        """A version-3 database (this schema without the two List indexes, stamped 3) with
        claimed and aborted rows: after the migration the indexes exist, List by owner and by
        abort intent answers from them, and the rows are untouched."""
        sd = self.start_storaged()
        mine = [admit(sd.stub, conv='m%d' % i).submission.submission_id for i in range(3)]
        for sid in mine:
            self.assertTrue(claim(sd.stub, owner='me', submission_id=sid).HasField('submission'))
        other = admit(sd.stub, conv='o').submission.submission_id
        sd.stub.request_abort(store_pb2.RequestAbortRequest(submission_id=mine[1], reason='x'))
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            con.executescript("DROP INDEX submissions_by_owner;"
                              "DROP INDEX submissions_abort_requested;"
                              + TO_V4 +
                              "UPDATE meta SET value = '3' WHERE key = 'schema_version';")
        finally:
            con.close()
        sd.start()
        got = sd.stub.list(store_pb2.ListRequest(owner_id='me')).submissions
        self.assertEqual([s.submission_id for s in got], mine)
        got = sd.stub.list(store_pb2.ListRequest(abort_requested=True)).submissions
        self.assertEqual([s.submission_id for s in got], [mine[1]])
        self.assertEqual(get(sd.stub, other).status, common_pb2.SUBMISSION_STATUS_QUEUED)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            names = set(r[0] for r in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index'"))
            self.assertLessEqual({'submissions_by_owner', 'submissions_abort_requested',
                                  'submissions_unsettled', 'submissions_by_lease'}, names)
        finally:
            con.close()

    def test_migrates_version_4_and_delegates(self):
        """A version-4 database (this schema without the parent column and its index, stamped
        4) with a running, an aborted and a settled submission: after the migration every row's
        parent is NULL, the index exists, the rows read as before (no delegation), and children
        admitted under the migrated rows behave as under new ones."""
        sd = self.start_storaged()
        running = admit(sd.stub, conv='r').submission
        c = claim(sd.stub, submission_id=running.submission_id)
        aborted = admit(sd.stub, conv='a').submission
        request_abort(sd.stub, submission_id=aborted.submission_id, reason='x')
        done = admit(sd.stub, conv='d').submission
        settle(sd.stub, claim(sd.stub, submission_id=done.submission_id).fence)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            fresh = list(con.execute('PRAGMA table_info(submissions)'))
            con.executescript(TO_V4 + "UPDATE meta SET value = '4' WHERE key = 'schema_version';")
            cols = [row[1] for row in con.execute('PRAGMA table_info(submissions)')]
            self.assertNotIn('parent_submission_id', cols)
        finally:
            con.close()
        sd.start()
        for sub in (running, aborted, done):
            self.assertFalse(get(sd.stub, sub.submission_id).HasField('delegation'))
        children = {}
        for name, parent in (('running', running), ('aborted', aborted), ('done', done)):
            req = admit_request(agent='helper', text='subtask')
            req.delegation.CopyFrom(common_pb2.Delegation(
                parent_submission_id=parent.submission_id,
                parent_conversation_id=parent.conversation_id, tool_call_id='call_1', depth=1))
            children[name] = sd.stub.admit(req).submission
            self.assertEqual(children[name].delegation.parent_submission_id,
                             parent.submission_id)
        stamped = lambda name: get(sd.stub, children[name].submission_id).HasField(
            'abort_request_time')
        self.assertEqual([stamped(n) for n in ('running', 'aborted', 'done')],
                         [False, True, True])
        settle(sd.stub, c.fence, common_pb2.OUTCOME_FAILED, 'boom')
        self.assertTrue(stamped('running'))
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            # the migrated table is the fresh one, column for column
            self.assertEqual(list(con.execute('PRAGMA table_info(submissions)')), fresh)
            parents = dict(con.execute('SELECT submission_id, parent_submission_id '
                                       'FROM submissions'))
            for sub in (running, aborted, done):
                self.assertIsNone(parents[sub.submission_id])
            self.assertEqual(parents[children['done'].submission_id], done.submission_id)
            (idx,) = con.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND "
                                 "name = 'submissions_by_parent'").fetchone()
            self.assertIn('WHERE parent_submission_id IS NOT NULL', idx)
        finally:
            con.close()

    def test_migrates_version_5_and_guards_principals(self):
        """A version-5 database (this schema without the principal columns, stamped 5): after
        the migration every conversation and submission has no principal, an Admit naming a
        principal is refused in a migrated conversation (nobody owns it) while an admin's and
        one without a principal pass, and a new conversation records its principal."""
        sd = self.start_storaged()
        old = admit(sd.stub, conv='before').submission
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            fresh = {t: list(con.execute('PRAGMA table_info(%s)' % t))
                     for t in ('conversations', 'submissions')}
            con.executescript(TO_V5 + "UPDATE meta SET value = '5' WHERE key = 'schema_version';")
        finally:
            con.close()
        sd.start()
        self.assertEqual(get(sd.stub, old.submission_id).principal, '')
        self.assertEqual(sd.stub.get_conversation(
            store_pb2.ConversationRequest(conversation_id='before')).principal, '')
        req = admit_request(conv='before', text='mine now?')
        req.principal = 'alice'
        self.assertRpcError(grpc.StatusCode.PERMISSION_DENIED, sd.stub.admit, req)
        req.admin = True
        self.assertEqual(sd.stub.admit(req).submission.principal, '')
        self.assertEqual(admit(sd.stub, conv='before').submission.principal, '')
        req = admit_request(conv='after')
        req.principal = 'alice'
        self.assertEqual(sd.stub.admit(req).submission.principal, 'alice')
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            for t, cols in fresh.items():  # the migrated tables are the fresh ones
                self.assertEqual(list(con.execute('PRAGMA table_info(%s)' % t)), cols)
            self.assertEqual(dict(con.execute('SELECT conversation_id, principal '
                                              'FROM conversations')),
                             {'before': None, 'after': 'alice'})
        finally:
            con.close()

    def test_migrates_version_6_and_keeps_traces(self):
        """A version-6 database (this schema without the trace columns, stamped 6) with a
        queued and a settled submission: after the migration both read back without a trace
        context and are claimed and settled as before; a submission admitted afterwards keeps
        its traceparent and tracestate, and a retried Admit with another trace is the same
        admission with the first one's."""
        tp = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'
        sd = self.start_storaged()
        queued = admit(sd.stub, conv='q').submission
        done = admit(sd.stub, conv='d').submission
        settle(sd.stub, claim(sd.stub, submission_id=done.submission_id).fence)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            fresh = list(con.execute('PRAGMA table_info(submissions)'))
            con.executescript(TO_V6 + "UPDATE meta SET value = '6' WHERE key = 'schema_version';")
            cols = [row[1] for row in con.execute('PRAGMA table_info(submissions)')]
            self.assertNotIn('traceparent', cols)
        finally:
            con.close()
        sd.start()
        for sub in (queued, done):
            got = get(sd.stub, sub.submission_id)
            self.assertEqual((got.traceparent, got.tracestate), ('', ''))
        c = claim(sd.stub, submission_id=queued.submission_id)
        self.assertEqual(c.submission.traceparent, '')
        settle(sd.stub, c.fence)
        req = admit_request(conv='after', key='k-trace')
        req.traceparent = tp
        req.tracestate = 'rojo=1'
        first = sd.stub.admit(req).submission
        self.assertEqual((first.traceparent, first.tracestate), (tp, 'rojo=1'))
        req.traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'
        req.tracestate = ''
        again = sd.stub.admit(req)
        self.assertTrue(again.deduplicated)
        self.assertEqual(again.submission.submission_id, first.submission_id)
        self.assertEqual((again.submission.traceparent, again.submission.tracestate),
                         (tp, 'rojo=1'))
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            # the migrated table is the fresh one, column for column
            self.assertEqual(list(con.execute('PRAGMA table_info(submissions)')), fresh)
            rows = dict(con.execute('SELECT submission_id, traceparent FROM submissions'))
            self.assertIsNone(rows[queued.submission_id])
            self.assertIsNone(rows[done.submission_id])
            self.assertEqual(rows[first.submission_id], tp)
        finally:
            con.close()

    def test_migrates_version_7_and_reclaims_by_the_owners_start(self):
        """A database of version 7 has no owner_started_at: its attempts are taken back by a
        restarted owner as before (their started_at, storaged's clock, before its start);
        once migrated, an attempt claimed with owner_started_at is taken back by that start
        alone, so one claimed since the new start is not taken again however storaged's clock
        stands."""
        sd = self.start_storaged()
        held = admit(sd.stub, conv='held').submission
        self.assertTrue(claim(sd.stub, owner='R', submission_id=held.submission_id)
                        .HasField('submission'))
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            fresh = list(con.execute('PRAGMA table_info(submissions)'))
            con.executescript(TO_V7 + "UPDATE meta SET value = '7' WHERE key = 'schema_version';")
        finally:
            con.close()
        sd.start()

        def reclaim(sub, started, before):
            req = store_pb2.ClaimRequest(owner_id='R', submission_id=sub.submission_id)
            req.owner_started_at.FromMilliseconds(started)
            req.reclaim_started_before.FromMilliseconds(before)
            return sd.stub.claim(req, timeout=5)

        import time
        ahead = int(time.time() * 1000) + 3600 * 1000  # the owner's clock, an hour ahead
        got = reclaim(held, ahead, ahead)
        self.assertTrue(got.HasField('submission') and got.takeover, got)
        again = reclaim(held, ahead, ahead)
        self.assertFalse(again.HasField('submission'), again)
        settle(sd.stub, got.fence)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            self.assertEqual(list(con.execute('PRAGMA table_info(submissions)')), fresh)
            (started,) = con.execute('SELECT owner_started_at FROM submissions WHERE '
                                     'submission_id = ?', (held.submission_id,)).fetchone()
            self.assertEqual(started, ahead)
        finally:
            con.close()

    def test_migrates_version_8_records_to_rowid(self):
        """A database of version 8 keeps its records WITHOUT ROWID. Once migrated, the table
        is keyed by rowid with unique indexes on position and id; every record reads back as
        written, in order, the long ones (overflow pages) included; an Append goes on at the
        next position; a repeated id with the same body is taken as a retry and one with
        another body is refused."""
        sd = self.start_storaged()
        adm = admit(sd.stub, conv='long')
        c = claim(sd.stub, submission_id=adm.submission.submission_id)
        long_text = ''.join('line %06d of a long page\n' % i for i in range(8000))  # 200 KB
        # 40 MB of records: more than one step of the move (32 MiB)
        written = [record('tool_result', {'text': long_text + str(i)}, id_='t%d' % i)
                   if i % 2 else record(id_='a%d' % i) for i in range(400)]
        for i in range(0, len(written), 20):
            append(sd.stub, c.fence, written[i:i + 20])
        before = read_all(sd.stub, 'long')
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            con.executescript(TO_V8 + "UPDATE meta SET value = '8' WHERE key = 'schema_version';")
            (old_sql,) = con.execute("SELECT sql FROM sqlite_master WHERE name = 'records'")\
                .fetchone()
            self.assertIn('WITHOUT ROWID', old_sql)
        finally:
            con.close()
        sd.start()
        after = read_all(sd.stub, 'long', page_size=7)
        self.assertEqual(after, before)
        self.assertEqual([r.id for r in after[-400:]], [r.id for r in written])
        self.assertEqual(after[-1].tool_result.text, long_text + '399')
        r = append(sd.stub, c.fence, [record(id_='next')])
        self.assertEqual(r.first_offset, before[-1].offset + 1)
        again = append(sd.stub, c.fence, [written[3]])
        self.assertEqual(again.first_offset, after[-397].offset)
        e = self.assertRpcError(grpc.StatusCode.ALREADY_EXISTS, append, sd.stub, c.fence,
                                [record('tool_result', {'text': 'other'}, id_='t3')])
        self.assertEqual(error_reason(e), 'RECORD_CONFLICT')
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
            (sql,) = con.execute("SELECT sql FROM sqlite_master WHERE name = 'records'")\
                .fetchone()
            self.assertNotIn('WITHOUT ROWID', sql)
            plan = ' '.join(row[-1] for row in con.execute(
                "EXPLAIN QUERY PLAN SELECT body FROM records WHERE conversation_id = 'long' "
                "AND pos > 2 ORDER BY pos"))
            self.assertIn('USING INDEX', plan)
            self.assertEqual(con.execute("SELECT count(*) FROM records WHERE conversation_id = "
                                         "'long'").fetchone()[0], len(after) + 1)
        finally:
            con.close()

    def test_migrates_version_8_after_a_partial_move(self):
        """The move of version 8's records goes in steps of 32 MiB, each its own transaction.
        storaged killed after the first step leaves the records in two tables under a stamp a
        storaged of version 8 refuses (MIGRATE_MOVING_STAMP); the next start moves the rest,
        and every record of every conversation reads back once, in order."""
        sd = self.start_storaged()
        long_text = ''.join('line %06d of a long page\n' % i for i in range(8000))  # 200 KB
        convs = ['c%d' % i for i in range(4)]
        before = {}
        for conv in convs:  # 4 x 60 records of 200 KB: 48 MB, two steps
            c = claim(sd.stub, submission_id=admit(sd.stub, conv=conv).submission.submission_id)
            for i in range(0, 60, 20):
                append(sd.stub, c.fence, [
                    record('tool_result', {'text': long_text + str(j)}, id_='%s-%d' % (conv, j))
                    for j in range(i, i + 20)])
            before[conv] = read_all(sd.stub, conv)
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            con.executescript(TO_V8 + "UPDATE meta SET value = '8' WHERE key = 'schema_version';")
        finally:
            con.close()
        sd.env['CFLUE_FAILPOINTS'] = 'storaged.migrate.step=crash'
        rc, err = sd.run_to_exit(timeout=60)
        self.assertNotEqual(rc, 0, err)
        del sd.env['CFLUE_FAILPOINTS']
        con = sqlite3.connect(sd.db)
        try:
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, '9-moving')
            moved = con.execute('SELECT count(*) FROM records_v9').fetchone()[0]
            left = con.execute('SELECT count(*) FROM records').fetchone()[0]
            self.assertTrue(moved > 0 and left > 0, (moved, left))
        finally:
            con.close()
        sd.start()
        for conv in convs:
            self.assertEqual(read_all(sd.stub, conv, page_size=7), before[conv])
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            names = set(r[0] for r in con.execute("SELECT name FROM sqlite_master"))
            self.assertIn('records', names)
            self.assertNotIn('records_v9', names)
            self.assertEqual(con.execute('SELECT count(*) FROM records').fetchone()[0],
                             moved + left)
            (v,) = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            self.assertEqual(v, CURRENT)
        finally:
            con.close()

    def test_a_move_that_matches_no_row_stops(self):
        """A row storaged did not write (a BLOB conversation id, which no bound text equals)
        would make every step of the move match nothing: storaged stops with an error naming
        it instead of looping, and the database keeps every row."""
        sd = self.start_storaged()
        c = claim(sd.stub, submission_id=admit(sd.stub, conv='ok').submission.submission_id)
        append(sd.stub, c.fence, [record(id_='r1')])
        sd.stop()
        con = sqlite3.connect(sd.db)
        try:
            con.executescript(TO_V8 + "UPDATE meta SET value = '8' WHERE key = 'schema_version';"
                              "INSERT INTO records VALUES (x'00ff', 0, 'odd', 1, NULL, NULL, 0,"
                              "  x'');")
            total = con.execute('SELECT count(*) FROM records').fetchone()[0]
        finally:
            con.close()
        rc, err = sd.run_to_exit(timeout=30)
        self.assertNotEqual(rc, 0, err)
        self.assertIn('matched no record', err)
        con = sqlite3.connect(sd.db)
        try:
            names = set(r[0] for r in con.execute("SELECT name FROM sqlite_master"))
            moved = (con.execute('SELECT count(*) FROM records_v9').fetchone()[0]
                     if 'records_v9' in names else 0)
            left = con.execute('SELECT count(*) FROM records').fetchone()[0]
            self.assertEqual(moved + left, total)
        finally:
            con.close()

    def test_a_full_disk_stops_the_move_and_space_lets_it_finish(self):
        """The disk fills up part way through the move of version 8's records (a real tmpfs, in
        a mount namespace that outlives each storaged): storaged stops with an error that says
        the disk is full and how much room the move wants; the database keeps the step it
        committed and every record, in exactly one of the two tables, and SQLite finds it
        sound. Once the disk has room, the next start finishes the move and every conversation
        reads back as it was written."""
        require_namespace(self, private_mount_problem())
        sd = self.start_storaged()
        c = claim(sd.stub, submission_id=admit(sd.stub, conv='c0').submission.submission_id)
        long_text = ''.join('line %06d of a long page\n' % i for i in range(8000))  # 200 KB
        append(sd.stub, c.fence, [record('tool_result', {'text': long_text + str(j)},
                                         id_='t%d' % j) for j in range(10)])
        append(sd.stub, c.fence, [record(id_='last')])
        before = read_all(sd.stub, 'c0')
        sd.stop()
        convs = ['c%d' % i for i in range(40)]  # 40 x 2 MB: three steps of the move
        con = sqlite3.connect(sd.db)
        try:
            for conv in convs[1:]:
                con.execute("INSERT INTO conversations(conversation_id, agent, created_at, "
                            "next_pos, epoch) SELECT ?, agent, created_at, next_pos, epoch FROM "
                            "conversations WHERE conversation_id = 'c0'", (conv,))
                con.execute("INSERT INTO records(conversation_id, pos, record_id, kind, "
                            "submission_id, attempt_id, ts, body) SELECT ?, pos, record_id, "
                            "kind, submission_id, attempt_id, ts, body FROM records WHERE "
                            "conversation_id = 'c0'", (conv,))
            con.commit()
            con.executescript(TO_V8 + "UPDATE meta SET value = '8' WHERE key = 'schema_version';"
                              "VACUUM;")
            total = con.execute('SELECT count(*) FROM records').fetchone()[0]
        finally:
            con.close()
        # room for the database and two and a half steps: the first step commits (its WAL
        # holds its new rows and the zeros secure_delete writes over the pages it frees: two
        # steps), the next one finds the disk full (its WAL cannot start over while the first
        # step's frames are not all in the database: their checkpoint found no room either)
        disk = TmpfsNamespace(tempfile.mkdtemp(prefix='cflue-mig-full-'),
                              os.path.getsize(sd.db) // (1 << 20) + 80)
        self.addCleanup(disk.close)
        disk.run('cp "$0" "$1"', sd.db, disk.path('store.db'))
        moved = NamespacedStoraged(disk, db=disk.path('store.db'), start=False)
        self._daemons.append(moved)
        rc, err = moved.run_to_exit(timeout=60)
        self.assertNotEqual(rc, 0, err)
        self.assertIn('from schema version 8 to 9 (the disk is full: the move of the records '
                      'wants about 96 MiB free beside the database; make room and start again, '
                      'it goes on with the records not moved yet): ', err)
        state = disk_state(disk)
        self.assertEqual((state['version'], state['check']), ('9-moving', 'ok'), state)
        self.assertTrue(state['records'] > 0 and state['records_v9'] > 0, state)
        self.assertEqual(state['records'] + state['records_v9'], total)
        disk.resize(1024)
        moved.start()
        for conv in convs:
            self.assertEqual(read_all(moved.stub, conv, page_size=3), before, conv)
        moved.stop()
        self.assertEqual(disk_state(disk), {'version': CURRENT, 'records': total, 'check': 'ok'})


if __name__ == '__main__':
    unittest.main()
