"""Data-driven toold cases: one test method per directory of tests/tools/cases (and per grep
engine when the case lists engines). The format is described in tests/tools/README.md.

Every engine gets one toold (started on first use, shared by the cases of that engine, with
--grep-engine set when the engine is named); every case runs in a fresh sandbox named after
its directory.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import unittest

from cflue_harness import REPO, Toold, _tail, result_details  # noqa: F401
from cflue_harness import tool_call, truncation_dict  # noqa: F401,E402

CASES_DIR = os.path.join(REPO, 'tests', 'tools', 'cases')
DEFAULT_ENGINE = 'default'  # toold started without --grep-engine
SECRET_ENV = {'CFLUE_TEST_SECRET': 'this-must-not-leak'}
SCRIPT_TIMEOUT_S = 120

_servers = {}


def server(engine):
    td = _servers.get(engine)
    if td is None or not td.alive():
        td = Toold(grep_engine=None if engine == DEFAULT_ENGINE else engine, env=SECRET_ENV)
        _servers[engine] = td
    return td


def tearDownModule():
    for td in _servers.values():
        td.remove()
    _servers.clear()


def _read(path, binary=False):
    with open(path, 'rb') as f:
        data = f.read()
    return data if binary else data.decode('utf-8')


def _substitute(value, tokens, prev=None):
    """Replaces {{TOKEN}} in every string of value; a string that is exactly one
    {{prev.details.X}} / {{prev.truncation.X}} token becomes that value (number or string)."""
    if isinstance(value, str):
        m = re.fullmatch(r'\{\{prev\.(details|truncation)\.(\w+)\}\}', value)
        if m and prev is not None:
            return prev[m.group(1)][m.group(2)]
        for k, v in tokens.items():
            value = value.replace('{{%s}}' % k, v)
        if prev is not None:
            value = re.sub(r'\{\{prev\.(details|truncation)\.(\w+)\}\}',
                           lambda mm: str(prev[mm.group(1)][mm.group(2)]), value)
        return value
    if isinstance(value, list):
        return [_substitute(v, tokens, prev) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, tokens, prev) for k, v in value.items()}
    return value


def _subset_mismatches(expected, actual, where):
    out = []
    for k, v in expected.items():
        if k not in actual:
            out.append('%s.%s missing (expected %r)' % (where, k, v))
        elif isinstance(v, dict) and isinstance(actual[k], dict):
            out.extend(_subset_mismatches(v, actual[k], where + '.' + k))
        elif actual[k] != v:
            out.append('%s.%s = %r, expected %r' % (where, k, actual[k], v))
    return out


def _short(text, n=3000):
    return text if len(text) <= n else text[:n // 2] + '\n...[%d chars]...\n' % len(text) \
        + text[-n // 2:]


class Step(object):
    """One call of a case (the case directory itself, or its then/ directory)."""

    def __init__(self, path):
        self.path = path
        self.call = json.loads(_read(os.path.join(path, 'call.json')))

    def file(self, name):
        p = os.path.join(self.path, name)
        return p if os.path.exists(p) else None


class Case(object):
    def __init__(self, name):
        self.name = name
        self.dir = os.path.join(CASES_DIR, name)
        self.steps = [Step(self.dir)]
        then = os.path.join(self.dir, 'then')
        if os.path.isdir(then):
            self.steps.append(Step(then))
        self.engines = self.steps[0].call.get('engines') or [DEFAULT_ENGINE]


def _run_script(tc, script, ws, env, what):
    p = subprocess.run(['bash', script], cwd=ws, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=SCRIPT_TIMEOUT_S)
    out = p.stdout.decode('utf-8', 'replace')
    if p.returncode != 0:
        tc.fail('%s exited with %d:\n%s' % (what, p.returncode, _short(out)))


def run_case(tc, case, engine):
    td = server(engine)
    sandbox = case.name
    ws = td.workspace(sandbox)
    outside = os.path.join(td.dir, 'outside', sandbox)
    for d in (ws, outside):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    files = os.path.join(case.dir, 'files')
    if os.path.isdir(files):
        shutil.copytree(files, ws, symlinks=True, dirs_exist_ok=True)
    tokens = {'WS': ws, 'OUTSIDE': outside, 'SANDBOX': sandbox, 'ENGINE': engine}
    env = dict(os.environ)
    env.update({'WS': ws, 'OUTSIDE': outside, 'SANDBOX': sandbox, 'ENGINE': engine,
                'CASE_DIR': case.dir, 'LC_ALL': 'C.UTF-8'})
    setup = os.path.join(case.dir, 'setup.sh')
    if os.path.exists(setup):
        _run_script(tc, setup, ws, env, 'setup.sh')

    prev = None
    for i, step in enumerate(case.steps):
        label = 'then/' if i else ''
        call = step.call
        args = call.get('arguments_json')
        if args is None:
            args = json.dumps(_substitute(call.get('arguments', {}), tokens, prev))
        else:
            args = _substitute(args, tokens, prev)
        res = td.execute(sandbox, call['name'], args, timeout_ms=call.get('timeout_ms', 0),
                         call_id='%s%s' % (case.name, '/then' if i else ''))
        text = res.text
        details = result_details(res)
        trunc = truncation_dict(res)
        problems = []

        exp_txt, exp_re = step.file('expected.txt'), step.file('expected_re.txt')
        if exp_txt:
            want = _substitute(_read(exp_txt), tokens, prev)
            if text != want:
                problems.append('%sresult text differs\n---- expected ----\n%s\n---- got ----\n'
                                '%s\n---- end ----' % (label, _short(want), _short(text)))
        elif exp_re:
            pattern = _read(exp_re)
            if pattern.endswith('\n'):
                pattern = pattern[:-1]
            esc = {k: re.escape(v) for k, v in tokens.items()}
            pattern = _substitute(pattern, esc, None)
            if not re.fullmatch(pattern, text):
                problems.append('%sresult text does not fullmatch expected_re.txt\n---- regex '
                                '----\n%s\n---- got ----\n%s\n---- end ----'
                                % (label, _short(pattern), _short(text)))
        else:
            problems.append('%s: no expected.txt or expected_re.txt' % step.path)

        exp_json = step.file('expected.json')
        if exp_json:
            want = _substitute(json.loads(_read(exp_json)), tokens, prev)
            if 'is_error' in want and res.is_error != want['is_error']:
                problems.append('%sis_error = %r, expected %r' % (label, res.is_error,
                                                                   want['is_error']))
            problems += _subset_mismatches(want.get('truncation', {}), trunc,
                                           label + 'truncation')
            problems += _subset_mismatches(want.get('details', {}), details, label + 'details')

        check = step.file('check.sh')
        if check:
            rdir = os.path.join(td.dir, 'results')
            os.makedirs(rdir, exist_ok=True)
            rtext = os.path.join(rdir, '%s.%s.%d.txt' % (sandbox, engine, i))
            with open(rtext, 'wb') as f:
                f.write(text.encode('utf-8'))
            rjson = rtext[:-4] + '.json'
            with open(rjson, 'w') as f:
                json.dump({'is_error': res.is_error, 'details': details, 'truncation': trunc},
                          f)
            cenv = dict(env, RESULT_TEXT=rtext, RESULT_JSON=rjson)
            p = subprocess.run(['bash', check], cwd=ws, env=cenv, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=SCRIPT_TIMEOUT_S)
            if p.returncode != 0:
                problems.append('%scheck.sh exited with %d:\n%s'
                                % (label, p.returncode, _short(p.stdout.decode('utf-8',
                                                                               'replace'))))
        if problems:
            tc.fail('case %s (engine %s):\n%s\n(is_error=%r details=%s truncation=%s)'
                    % (case.name, engine, '\n'.join(problems), res.is_error,
                       json.dumps(details), json.dumps(trunc)))
        prev = {'details': details, 'truncation': trunc}


class TooldCases(unittest.TestCase):
    """Generated: test_<case>[__<engine>] for every case directory."""

    maxDiff = None


def _method(case, engine):
    def test(self):
        run_case(self, case, engine)
    test.__doc__ = '%s%s' % (case.name, '' if engine == DEFAULT_ENGINE else ' [%s]' % engine)
    return test


def _load():
    if not os.path.isdir(CASES_DIR):
        return
    for name in sorted(os.listdir(CASES_DIR)):
        if not os.path.exists(os.path.join(CASES_DIR, name, 'call.json')):
            continue
        case = Case(name)
        for engine in case.engines:
            mname = 'test_' + re.sub(r'\W', '_', name)
            if engine != DEFAULT_ENGINE:
                mname += '__' + engine
            setattr(TooldCases, mname, _method(case, engine))


_load()

if __name__ == '__main__':
    unittest.main()
