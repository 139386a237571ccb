"""Secrets never reach a log or a record: every daemon the harness starts is looked through.

The harness tells this module each secret a test run hands out: the value of every variable
of a daemon's environment whose name says it is one (API_KEY, TOKEN, SECRET, PASSWORD; at
least MIN_LEN characters, shorter ones cannot be told from chance), and every value made with
secret() (bearer tokens, which only clients hold). Before a daemon's directory is removed, and
at exit for those still there, its logs (*.stderr) are searched byte for byte and its
databases (storaged's *.db, read through SQLite: every column of every row of every table, so
a value split across database pages is still found) plus their write-ahead logs.

A secret found makes the test process fail at exit (exit code 1, the places named on stderr).
With CFLUE_SECRET_SCAN_DIR set (CTest sets it), each process also leaves a report there,
<pid>.json, which tests/tools/secret_scan_report.py sums up after a full run and fails on any
finding. What is not looked through: the sandboxes' workspaces (the model's files, where a test
may put anything), the fake model's request log, and processes the harness did not start.
"""

import atexit
import hashlib
import json
import os
import re
import shutil
import sqlite3
import sys

NAME_RE = re.compile(r'API_KEY|TOKEN|SECRET|PASSWORD', re.I)
MIN_LEN = 6
LOG_SUFFIXES = ('.stderr', '.log')
DB_SUFFIXES = ('.db',)
WAL_SUFFIXES = ('.db-wal',)

_secrets = set()
_watched = []      # daemon directories and database files, in the order seen
_skipped = set()   # directories not looked into (workspaces)
_seen = set()      # paths already scanned (before their removal)
_stats = {'paths': 0, 'files': 0, 'bytes': 0, 'rows': 0, 'findings': [], 'unreadable': []}


def secret(label):
    """A new secret for this run (e.g. a bearer token), remembered so that the scan looks
    for it."""
    s = 'cfsecret-%s-%s' % (label, os.urandom(8).hex())
    _secrets.add(s)
    return s


def note_env(env):
    """Remembers the secrets among a daemon's environment variables."""
    for k, v in env.items():
        if NAME_RE.search(k) and isinstance(v, str) and len(v) >= MIN_LEN:
            _secrets.add(v)


def watch(path):
    """Looks through path (a daemon's directory, or a database file) before discard() and at
    exit."""
    if path not in _watched:
        _watched.append(path)


def skip(path):
    """Never looks below the directory path (a sandbox root: the model's own files)."""
    _skipped.add(os.path.realpath(path))


def discard(path):
    """Scans path, then removes it (a directory, as shutil.rmtree(ignore_errors=True))."""
    _scan_into(path)
    shutil.rmtree(path, ignore_errors=True)


def scan(path, secrets):
    """The places under path (or the file path) holding one of secrets: a list of
    (file, where, secret label), plus counts {'files', 'bytes', 'rows', 'unreadable'}."""
    counts = {'files': 0, 'bytes': 0, 'rows': 0, 'unreadable': []}
    found = []
    if os.path.isdir(path):
        for top, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs
                       if os.path.realpath(os.path.join(top, d)) not in _skipped]
            for f in sorted(files):
                _scan_file(os.path.join(top, f), secrets, counts, found)
    elif os.path.isfile(path):
        _scan_file(path, secrets, counts, found, always=True)
    return found, counts


def _label(s):
    """How a report names a secret without showing it: its first 4 characters and the start
    of its SHA-256."""
    return '%s...#%s' % (s[:4], hashlib.sha256(s.encode()).hexdigest()[:10])


def _scan_file(p, secrets, counts, found, always=False):
    """Searches a log, a write-ahead log or a database (by name; always: a file watched by
    its own path, taken as a database unless its name says otherwise)."""
    log_or_wal = p.endswith(LOG_SUFFIXES + WAL_SUFFIXES)
    is_db = p.endswith(DB_SUFFIXES) or (always and not log_or_wal)
    if not (is_db or log_or_wal):
        return
    if is_db:
        _scan_db(p, secrets, counts, found)
    try:
        with open(p, 'rb') as f:
            data = f.read()
    except OSError:
        return
    counts['files'] += 1
    counts['bytes'] += len(data)
    for s in secrets:
        i = data.find(s.encode())
        if i >= 0:
            line = data.count(b'\n', 0, i) + 1
            found.append((p, 'byte %d (line %d)' % (i, line), _label(s)))


def _scan_db(p, secrets, counts, found):
    try:
        db = sqlite3.connect('file:%s?mode=ro' % p, uri=True, timeout=1)
    except sqlite3.Error:
        return
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for t in tables:
            for row in db.execute('SELECT * FROM "%s"' % t.replace('"', '""')):
                counts['rows'] += 1
                for col, v in enumerate(row):
                    b = v.encode() if isinstance(v, str) else v if isinstance(v, bytes) else None
                    if not b:
                        continue
                    for s in secrets:
                        if s.encode() in b:
                            found.append((p, 'table %s, column %d' % (t, col), _label(s)))
    except sqlite3.Error as e:  # not a database, or a damaged one (a crash test): raw bytes only
        counts['unreadable'].append('%s: %s' % (p, e))
    finally:
        db.close()


def _scan_into(path):
    if path in _seen or not os.path.exists(path):
        return
    _seen.add(path)
    found, counts = scan(path, sorted(_secrets))
    _stats['paths'] += 1
    for k in ('files', 'bytes', 'rows', 'unreadable'):
        _stats[k] += counts[k]
    _stats['findings'] += found


@atexit.register
def _at_exit():
    """Registered at import, before the harness's own handlers: it runs after them, once every
    daemon is dead."""
    for p in _watched:
        _scan_into(p)
    findings = _stats['findings']
    out = os.environ.get('CFLUE_SECRET_SCAN_DIR')
    if out:
        os.makedirs(out, exist_ok=True)
        report = dict(_stats, secrets=len(_secrets), argv=sys.argv,
                      findings=[list(f) for f in findings])
        with open(os.path.join(out, '%d.json' % os.getpid()), 'w') as f:
            json.dump(report, f)
    if findings:
        sys.stdout.flush()
        sys.stderr.write('\nSECRET SCAN: %d place(s) hold a secret of this run:\n' % len(findings))
        for p, where, what in findings:
            sys.stderr.write('  %s: %s: %s\n' % (p, where, what))
        sys.stderr.flush()
        os._exit(1)


FULL_RUN_REPORTS = 10  # from this many test processes on, a run that scanned nothing fails


def _report(out):
    """Sums up the reports a run left in out (python3 secret_scan.py report DIR): exit 1 on a
    finding, or, for a run of at least FULL_RUN_REPORTS test processes, on one that scanned no
    file or knew no secret (the scan itself broken)."""
    totals = {'reports': 0, 'paths': 0, 'files': 0, 'bytes': 0, 'rows': 0}
    findings, unreadable, secrets = [], [], 0
    names = sorted(n for n in os.listdir(out) if n.endswith('.json')) if os.path.isdir(out) else []
    for n in names:
        with open(os.path.join(out, n)) as f:
            r = json.load(f)
        totals['reports'] += 1
        for k in ('paths', 'files', 'bytes', 'rows'):
            totals[k] += r[k]
        secrets += r['secrets']
        who = ' '.join(r['argv'][-1:])
        findings += ['%s: %s' % (who, ': '.join(f)) for f in r['findings']]
        unreadable += ['%s: %s' % (who, u) for u in r['unreadable']]
    print('secret scan: %(reports)d test processes, %(paths)d daemon directories, %(files)d '
          'files (%(bytes)d bytes), %(rows)d database rows' % totals)
    print('secret scan: %d secrets handed out (summed over processes)' % secrets)
    for u in unreadable:
        print('secret scan: read as bytes only (not a readable database): ' + u)
    for f in findings:
        print('secret scan: FOUND ' + f)
    blind = totals['reports'] >= FULL_RUN_REPORTS and (not secrets or not totals['files'])
    if findings or blind:
        print('secret scan: FAILED' + ('' if findings else ' (nothing was scanned)'))
        return 1
    if totals['reports'] < FULL_RUN_REPORTS:
        print('secret scan: %d test processes: too few to judge what the scan covers'
              % totals['reports'])
    print('secret scan: no secret in any log or record')
    return 0


if __name__ == '__main__':
    atexit.unregister(_at_exit)  # the tool itself leaves no report
    if len(sys.argv) == 3 and sys.argv[1] in ('reset', 'report'):
        if sys.argv[1] == 'reset':
            shutil.rmtree(sys.argv[2], ignore_errors=True)
            os.makedirs(sys.argv[2])
            sys.exit(0)
        sys.exit(_report(sys.argv[2]))
    sys.stderr.write('usage: secret_scan.py reset|report DIR\n')
    sys.exit(2)
