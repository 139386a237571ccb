"""benchjson - the figures a bench writes with --json FILE, for bench/run (bench/README.md).

    {"bench": "bench_tools", "seconds": 12.3, "errors": [],
     "figures": [{"id": "grep.rg", "label": "...", "value": 0.26, "unit": "s",
                  "baseline": 0.13, "baseline_label": "rg", "ratio": 2.0,
                  "target": "<= 1.3x", "meets": false}, ...]}

baseline, baseline_label and ratio are there only when the figure has a baseline measured in
the same run; target and meets only when it has a target. A value that could not be measured
is null. bench_admit (C) writes the same format itself.
"""
import json
import math
import time


def _num(x):
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


class Report(object):
    def __init__(self, bench):
        self.bench = bench
        self.figures = []
        self.errors = []
        self.t0 = time.time()

    def add(self, id, label, value, unit, baseline=None, baseline_label=None, ratio=None,
            target=None, meets=None):
        """One figure. ratio defaults to value / baseline."""
        f = {'id': id, 'label': label, 'value': _num(value), 'unit': unit}
        if baseline is not None:
            if ratio is None and _num(value) is not None and _num(baseline):
                ratio = float(value) / float(baseline)
            f.update(baseline=_num(baseline), baseline_label=baseline_label, ratio=_num(ratio))
        if target is not None:
            f.update(target=target, meets=None if meets is None else bool(meets))
        self.figures.append(f)

    def error(self, text):
        self.errors.append(text)

    def write(self, path):
        if not path:
            return
        with open(path, 'w') as f:
            json.dump({'bench': self.bench, 'seconds': round(time.time() - self.t0, 1),
                       'errors': self.errors, 'figures': self.figures}, f, indent=1)
            f.write('\n')


def run_reporting(bench, run, args):
    """Runs run(args, report) for the bench named bench, with a Report that is written to
    args.json whatever happens: an exception is recorded as the run's error, then raised."""
    report = Report(bench)
    try:
        run(args, report)
    except BaseException as e:
        report.error("%s: %s" % (type(e).__name__, e))
        raise
    finally:
        report.write(args.json)
