"""The chaos checker: reads what the client was told, the final ledger and the side-effect
ledgers, and counts violations of cflue's promises. Pure data in, violations out, so the
rules can be tested on hand-made histories (test_checker.py).

Inputs (plain Python data, no gRPC objects):

    acks      [{'key', 'tag', 'conv', 'sid', 'dedup', 'retried', 'resend'}]: every
              acknowledged Submit, in the order the client received them. 'retried': an
              earlier call with this key got no answer; 'resend': a deliberate duplicate of a
              key that was acknowledged before.
    subs      {sid: submission dict} from Store.List: submission_id, conversation_id,
              sequence, status, outcome, error, answered_by, joined_into, attempt_count,
              max_attempts, abort_request_time_ms, settle_time_ms (names as in common.proto,
              Timestamps as epoch milliseconds, 0 when unset; status/outcome as their enum
              value names without the prefix: 'SETTLED', 'COMPLETED').
    records   {conv: [record dict]} from Store.Read: offset, id, type (the name of the typed
              body: 'user_message', ...; None when the record has no body), submission_id,
              attempt_id, create_time_ms, body (the typed body's fields by their proto names,
              enums as value names without the prefix: a settlement's outcome 'COMPLETED').
    side      {conv: [ledger line]} from each workspace's chaos-ledger.txt: "<call id> <tag>
              <step>" per bash run.
    watched   {conv: [(offset, id)]}: what a Watch showed the client.
    unsettled_after_bound  [sid]: acknowledged submissions not settled within the bound.

check() returns (violations, notes): {category: [example strings]}.
"""

import collections

CHAOS_NO_TOOLS = 'CHAOS-NO-TOOLS'
# How long after an abort stamp an agentd may still finish a response it was producing
# (its abort poll runs every second; a finished response settles completed regardless of the
# stamp, as the runtime spec says).
ABORT_NOTICE_MS = 3000

# the typed record bodies (common.proto Record.body)
RECORD_TYPES = frozenset(('user_message', 'system_prompt', 'assistant_delta',
                          'assistant_message', 'tool_result', 'signal', 'compaction',
                          'submission_settled'))

CATEGORIES = [
    ('lost', 'an acknowledged submission is not in the ledger'),
    ('untyped_record', 'a record without a typed body (or of a type this checker does not '
                       'know)'),
    ('unsettled', 'an acknowledged submission was not settled within the bound'),
    ('settled_twice', 'more than one submission_settled record for a submission'),
    ('settled_without_admission', 'a settlement for a submission the ledger never admitted '
                                  '(or of another conversation)'),
    ('settlement_mismatch', 'the row and the settlement record disagree (missing record, '
                            'other outcome, record of an unsettled row)'),
    ('outcome_false', 'completed, but the answer in the stream does not show it'),
    ('model_without_tools', 'the model was reached without the sandbox tools'),
    ('partial_system_prompt', 'a frozen system prompt lacks the tool roster or working '
                              'directory'),
    ('order', 'inputs or settlements of a conversation out of admission order'),
    ('stale_write', 'a record of an attempt landed after a later attempt wrote'),
    ('tool_rerun', 'a call whose result was recorded ran more than once'),
    ('abort_not_honoured', 'an abort intent did not end aborted (nor the outcome it already '
                           'had)'),
    ('dedupe_broken', 'the same idempotency key and payload did not return the same '
                      'submission (deduplicated)'),
    ('stream_rewritten', 'a record a client saw through Watch differs in the final stream'),
]


def _calls(rec):
    return (rec.get('body') or {}).get('tool_calls') or []


def check(acks, subs, records, side, watched=None, unsettled_after_bound=()):
    v = collections.defaultdict(list)
    notes = collections.defaultdict(list)
    watched = watched or {}

    # ---- client log: lost, dedupe ----
    by_key = collections.OrderedDict()
    for a in acks:
        by_key.setdefault(a['key'], []).append(a)
    for key, lst in by_key.items():
        sids = sorted(set(a['sid'] for a in lst))
        if len(sids) > 1:
            v['dedupe_broken'].append('key %s answered with %d submissions: %s'
                                      % (key, len(sids), ', '.join(sids)))
        for a in lst[1:]:
            if not a['dedup']:
                v['dedupe_broken'].append('key %s: a repeated Submit (same payload) was not '
                                          'deduplicated (submission %s)' % (key, a['sid']))
        if lst[0]['dedup'] and not lst[0].get('retried'):
            v['dedupe_broken'].append('key %s: the first Submit was answered deduplicated '
                                      '(submission %s)' % (key, lst[0]['sid']))
    acked = collections.OrderedDict()
    for a in acks:
        acked.setdefault(a['sid'], a)
    for sid, a in acked.items():
        s = subs.get(sid)
        if s is None:
            v['lost'].append('%s (key %s, conversation %s) is not in the ledger'
                             % (sid, a['key'], a['conv']))
        elif s['conversation_id'] != a['conv']:
            v['lost'].append('%s was admitted to %s but the ledger has it in %s'
                             % (sid, a['conv'], s['conversation_id']))
    for sid in unsettled_after_bound:
        s = subs.get(sid) or {}
        v['unsettled'].append('%s (conversation %s): %s, attempts %s/%s'
                              % (sid, s.get('conversation_id'), s.get('status'),
                                 s.get('attempt_count'), s.get('max_attempts')))

    # ---- per conversation ----
    convs = sorted(set(list(records)) | set(s['conversation_id'] for s in subs.values()))
    for conv in convs:
        recs = records.get(conv, [])
        mine = sorted((s for s in subs.values() if s['conversation_id'] == conv),
                      key=lambda s: s['sequence'])
        by_id = {}
        for r in recs:
            by_id[r['id']] = r
        settled_recs = collections.defaultdict(list)
        for r in recs:
            if r['type'] not in RECORD_TYPES:
                v['untyped_record'].append('%s: record %s at offset %d has type %r'
                                           % (conv, r['id'], r['offset'], r['type']))
            if r['type'] == 'submission_settled':
                settled_recs[r['submission_id']].append(r)

        # settlement records vs rows
        for sid, lst in settled_recs.items():
            if len(lst) > 1:
                v['settled_twice'].append('%s has %d settlement records (offsets %s)'
                                          % (sid, len(lst), [r['offset'] for r in lst]))
            s = subs.get(sid)
            if s is None or s['conversation_id'] != conv:
                v['settled_without_admission'].append(
                    '%s: settlement record at offset %d of %s, but the ledger %s'
                    % (sid, lst[0]['offset'], conv,
                       'has no such submission' if s is None else
                       'has it in %s' % s['conversation_id']))
                continue
            if s['status'] != 'SETTLED':
                v['settlement_mismatch'].append('%s has a settlement record but is %s'
                                                % (sid, s['status']))
            elif (lst[0]['body'] or {}).get('outcome') != s['outcome']:
                v['settlement_mismatch'].append(
                    '%s: record says %s, row says %s' % (sid, (lst[0]['body'] or {})
                                                         .get('outcome'), s['outcome']))
        for s in mine:
            if s['status'] == 'SETTLED' and s['submission_id'] not in settled_recs:
                v['settlement_mismatch'].append('%s is settled %s without a settlement record'
                                                % (s['submission_id'], s['outcome']))

        # per-conversation order: inputs and settlements in admission order
        seq = {s['submission_id']: s['sequence'] for s in mine}
        for rtype, what in (('user_message', 'input'), ('submission_settled', 'settlement')):
            order = []
            for r in recs:
                if r['type'] != rtype or r['submission_id'] not in seq:
                    continue
                if rtype == 'user_message' and r['id'] != 'input:' + r['submission_id']:
                    continue
                order.append(r)
            for a, b in zip(order, order[1:]):
                if seq[b['submission_id']] < seq[a['submission_id']]:
                    v['order'].append('%s: %s of %s (offset %d) before that of %s (offset %d), '
                                      'admitted later' % (conv, what, a['submission_id'],
                                                          a['offset'], b['submission_id'],
                                                          b['offset']))

        # stale writes: the records of each attempt form one contiguous run
        seen, cur = set(), None
        for r in recs:
            att = r.get('attempt_id') or ''
            if not att or att == cur:
                continue
            if att in seen:
                v['stale_write'].append('%s: record %s (offset %d, %s) of attempt %s landed '
                                        'after attempt %s wrote' % (conv, r['id'], r['offset'],
                                                                    r['type'], att, cur))
            seen.add(att)
            cur = att

        # frozen system prompts
        for r in recs:
            if r['type'] == 'system_prompt':
                text = (r['body'] or {}).get('text') or ''
                missing = [w for w in ('## Tools you can call', 'Working directory:')
                           if w not in text]
                if missing:
                    v['partial_system_prompt'].append('%s: %s (offset %d) lacks %s'
                                                      % (conv, r['id'], r['offset'],
                                                         ' and '.join(repr(m) for m in missing)))

        # the model reached without tools
        for r in recs:
            if r['type'] == 'assistant_message' and \
                    CHAOS_NO_TOOLS in ((r['body'] or {}).get('text') or ''):
                v['model_without_tools'].append('%s: %s (offset %d) answered without tools'
                                                % (conv, r['id'], r['offset']))

        # outcome true
        assistants = collections.defaultdict(list)
        for r in recs:
            if r['type'] == 'assistant_message':
                assistants[r['submission_id']].append(r)
        for s in mine:
            if s['status'] != 'SETTLED' or s['outcome'] != 'COMPLETED':
                continue
            sid = s['submission_id']
            host = s.get('answered_by') or sid
            problems = _outcome_problems(sid, host, subs, assistants, by_id, settled_recs)
            for p in problems:
                v['outcome_false'].append('%s (answered by %s): %s' % (sid, host, p))

        # tool re-runs, from the side-effect ledger
        runs = collections.Counter(line.split()[0] for line in side.get(conv, []) if line.split())
        recorded_calls = set()
        for r in recs:
            if r['type'] == 'assistant_message':
                for c in _calls(r):
                    recorded_calls.add(c.get('id'))
        for r in recs:
            if r['type'] != 'tool_result':
                continue
            cid = (r['body'] or {}).get('tool_call_id')
            if runs.get(cid, 0) > 1:
                v['tool_rerun'].append('%s: call %s (result %s at offset %d) ran %d times'
                                       % (conv, cid, r['id'], r['offset'], runs[cid]))
        for cid, n in runs.items():
            if cid not in recorded_calls:
                notes['unrecorded_run'].append('%s: call %s ran %d time(s) but no recorded '
                                               'assistant message asked for it' % (conv, cid, n))

        # Watch showed the client the same records the stream holds
        for off, rid in watched.get(conv, []):
            if off >= len(recs) or recs[off]['id'] != rid or recs[off]['offset'] != off:
                v['stream_rewritten'].append('%s: Watch showed %s at offset %d, the stream has '
                                             '%s' % (conv, rid, off, recs[off]['id']
                                                     if off < len(recs) else 'nothing'))
                break

    # ---- aborts ----
    for sid, s in subs.items():
        stamp = s.get('abort_request_time_ms') or 0
        if not stamp or s['status'] != 'SETTLED' or s['outcome'] == 'ABORTED':
            continue
        host = s.get('answered_by') or sid
        if s['outcome'] == 'COMPLETED':
            final = (assistants_of(records.get(s['conversation_id'], []), host) or [None])[-1]
            if final is not None and final['create_time_ms'] <= stamp + ABORT_NOTICE_MS:
                continue  # the response had finished (or was finishing) when the stamp came
            hs = subs.get(host) or {}
            if host != sid and not hs.get('abort_request_time_ms'):
                notes['abort_of_joined_member'].append(
                    '%s was stamped alone while joined into %s, which completed' % (sid, host))
                continue
            v['abort_not_honoured'].append(
                '%s: stamped at %d, completed with an answer recorded at %s'
                % (sid, stamp, final['create_time_ms'] if final else '(none)'))
        else:
            if s.get('settle_time_ms', 0) <= stamp + ABORT_NOTICE_MS:
                continue
            v['abort_not_honoured'].append('%s: stamped at %d, settled %s at %d: %s'
                                           % (sid, stamp, s['outcome'], s['settle_time_ms'],
                                              s.get('error', '')[:200]))

    # ---- notes ----
    for sid, s in subs.items():
        if s.get('max_attempts') and s.get('attempt_count', 0) > s['max_attempts'] + 1:
            notes['attempts_past_budget'].append('%s: %d attempts of %d (%s %s)'
                                                 % (sid, s['attempt_count'], s['max_attempts'],
                                                    s['status'], s.get('outcome')))
    return v, notes


def assistants_of(recs, sid):
    return [r for r in recs if r['type'] == 'assistant_message' and r['submission_id'] == sid]


def _outcome_problems(sid, host, subs, assistants, by_id, settled_recs):
    out = []
    hs = subs.get(host)
    if hs is None:
        return ['its answering submission is not in the ledger']
    if host != sid and (hs['status'] != 'SETTLED' or hs['outcome'] != 'COMPLETED'):
        out.append('its host is %s %s' % (hs['status'], hs['outcome']))
    mine = assistants.get(host, [])
    if not mine:
        return out + ['no assistant message of %s in the stream' % host]
    final = mine[-1]
    if _calls(final):
        out.append('the final assistant message %s (offset %d) asks for %d tool call(s)'
                   % (final['id'], final['offset'], len(_calls(final))))
    for a in mine:
        turn = (a['body'] or {}).get('turn')
        for c in _calls(a):
            rid = 'tool:%s:%s:%s' % (host, turn, c.get('id'))
            if rid not in by_id:
                out.append('call %s of %s (offset %d) has no tool_result'
                           % (c.get('id'), a['id'], a['offset']))
    inp = by_id.get('input:' + sid)
    if inp is None:
        out.append('its input never entered the stream')
    elif inp['offset'] > final['offset']:
        out.append('its input (offset %d) came after the final answer (offset %d)'
                   % (inp['offset'], final['offset']))
    st = settled_recs.get(sid)
    if st and st[0]['offset'] < final['offset']:
        out.append('settled at offset %d before the final answer at %d'
                   % (st[0]['offset'], final['offset']))
    return out
