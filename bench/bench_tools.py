"""bench_tools - toold's tools against the commands a person would run directly.

Generates a tree of FILES files (default 20,000, about 200 MB) and a 100 MB text file, starts
toold on it, and times in one run:
  grep through toold  vs  rg  and  LC_ALL=C grep -rnE   (same pattern, same tree)
  glob through toold  vs  find -name
  read of the 100 MB file page by page through toold  vs  sed -n per page
Each figure is the median of REPEAT runs; ratios are toold / direct (target <= 1.3 for grep
and glob). Caches are warm: every command runs once before it is timed.

usage: /usr/bin/python3 bench/bench_tools.py --toold build/toold/toold [--files N] [--repeat N]
           [--file-bytes N] [--big-mb N] [--pages N] [--json FILE]
--json FILE also writes the ratios as JSON (bench/benchjson.py), for bench/run.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "integration"))
sys.path.insert(0, here)
from benchjson import run_reporting  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta theta lambda sigma omega request response "
         "buffer socket thread commit ledger record stream offset").split()


def make_tree(root, files, file_bytes):
    rnd = random.Random(7)
    for i in range(files):
        d = os.path.join(root, "pkg%03d" % (i % 200), "mod%02d" % (i % 17))
        os.makedirs(d, exist_ok=True)
        lines, size = [], 0
        while size < file_bytes:
            line = " ".join(rnd.choice(WORDS) for _ in range(8))
            if rnd.random() < 0.0005:
                line += " needle_%d" % i
            lines.append(line)
            size += len(line) + 1
        ext = ".c" if i % 3 else ".py"
        with open(os.path.join(d, "file%05d%s" % (i, ext)), "w") as f:
            f.write("\n".join(lines) + "\n")


def timed(fn, repeat):
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--toold", required=True)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--file-bytes", type=int, default=10240)
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pages", type=int, default=200, help="pages of the big file to read")
    ap.add_argument("--json", help="also write the figures here as JSON")
    run_reporting("bench_tools", run_bench, ap.parse_args())


def run_bench(a, report):

    import grpc
    build = os.path.dirname(os.path.dirname(os.path.abspath(a.toold)))
    sys.path.insert(0, os.path.join(build, "py"))
    from cflue.v1 import tools_pb2

    tmp = tempfile.mkdtemp(prefix="cflue-bench-tools-")
    try:
        ws = os.path.join(tmp, "root", "bench")
        os.makedirs(ws)
        t0 = time.time()
        make_tree(os.path.join(ws, "tree"), a.files, a.file_bytes)
        with open(os.path.join(ws, "big.txt"), "w") as f:
            line = "x" * 49 + "\n"
            f.write(line * (a.big_mb * 1024 * 1024 // 50))
        total = subprocess.run(["du", "-sm", ws], capture_output=True, text=True).stdout.split()[0]
        print("tree: %d files, %s MB on disk, built in %.1f s" % (a.files, total, time.time() - t0))

        sock = os.path.join(tmp, "t.sock")
        proc = subprocess.Popen([a.toold, "--listen", "unix:" + sock, "--root", os.path.join(tmp, "root"),
                                 "--log-level", "warn"], stderr=subprocess.DEVNULL)
        ch = grpc.insecure_channel("unix:" + sock, options=[("grpc.max_receive_message_length", 64 << 20)])
        grpc.channel_ready_future(ch).result(timeout=10)
        ex = ch.unary_unary("/cflue.v1.Tools/Execute", request_serializer=tools_pb2.ToolCall.SerializeToString,
                            response_deserializer=tools_pb2.ToolResult.FromString)

        def tool(name, **args):
            r = ex(tools_pb2.ToolCall(sandbox="bench", name=name, arguments_json=json.dumps(args)), timeout=600)
            if r.is_error:
                raise SystemExit("%s failed: %s" % (name, r.text))
            return r

        def run(cmd):
            subprocess.run(cmd, cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, shell=True)

        pattern = "needle_[0-9]+7\\b"
        rows = []  # (label, toold s, direct s, JSON id, direct command, target)
        t_grep = timed(lambda: tool("grep", pattern=pattern, path="tree"), a.repeat)
        t_rg = timed(lambda: run("rg -n --no-heading '%s' tree" % pattern), a.repeat)
        t_gnu = timed(lambda: run("LC_ALL=C grep -rnE 'needle_[0-9]+7' tree"), a.repeat)
        rows.append(("grep (toold) / rg", t_grep, t_rg, "grep.rg", "rg", True))
        rows.append(("grep (toold) / LC_ALL=C grep -rnE", t_grep, t_gnu, "grep.gnu", "LC_ALL=C grep -rnE",
                     True))
        t_glob = timed(lambda: tool("glob", pattern="*7.py", path="tree"), a.repeat)
        t_find = timed(lambda: run("find tree -type f -name '*7.py'"), a.repeat)
        rows.append(("glob (toold) / find -name", t_glob, t_find, "glob.find", "find -name", True))

        def read_pages():
            off = 1
            for _ in range(a.pages):
                r = tool("read", path="big.txt", offset=off)
                off = r.truncation.next_offset
                if not off:
                    break

        def sed_pages():
            off = 1
            for _ in range(a.pages):
                run("sed -n '%d,%dp;%dq' big.txt" % (off, off + 1023, off + 1023))
                off += 1024

        t_read = timed(read_pages, 1)
        t_sed = timed(sed_pages, 1)
        rows.append(("read %d pages (toold) / sed -n" % a.pages, t_read, t_sed, "read.sed", "sed -n per page",
                     False))

        print("%-40s %10s %10s %7s" % ("comparison", "toold s", "direct s", "ratio"))
        for name, mine, direct, fid, what, has_target in rows:
            print("%-40s %10.3f %10.3f %7.2f" % (name, mine, direct, mine / direct))
            tool_name = name.split(" (")[0] + " (toold)"
            if has_target:
                report.add(fid, "%s, %d files" % (tool_name, a.files), mine, "s", direct, what,
                           target="<= 1.3x", meets=mine / direct <= 1.3)
            else:
                report.add(fid, tool_name, mine, "s", direct, what)
        proc.terminate()
        proc.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
