"""bench_agentd - agentd's own cost per turn, and its memory with many idle conversations.

Starts storaged, toold, the offline model (answering instantly) and agentd on loopback, then
in one run:
  1. times TURNS submissions of two turns each (a bash tool call, then a text answer), end to
     end through Submit -> settled, and the fake model's own response time for requests of the
     same shape sent to it directly; prints agentd's per-turn overhead against it;
  2. admits one submission into each of CONVERSATIONS new conversations, waits until all are
     settled (the conversations are then idle), and prints agentd's resident memory against
     its memory right after start-up.

usage: /usr/bin/python3 bench/bench_agentd.py --build build [--turns 100] [--conversations 1000]
           [--json FILE]
--json FILE also writes the figures as JSON (bench/benchjson.py), for bench/run.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
sys.path.insert(0, here)
from benchjson import run_reporting  # noqa: E402


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wait_port_file(path, proc, timeout=20):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and open(path).read().strip():
            return int(open(path).read())
        if proc.poll() is not None:
            raise SystemExit("a daemon exited at start")
        time.sleep(0.05)
    raise SystemExit("timeout waiting for " + path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(root, "build"))
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--json", help="also write the figures here as JSON")
    run_reporting("bench_agentd", run_bench, ap.parse_args())


def run_bench(a, report):
    sys.path.insert(0, os.path.join(a.build, "py"))
    import grpc
    from cflue.v1 import agent_pb2, common_pb2

    tmp = tempfile.mkdtemp(prefix="cflue-bench-agentd-")
    procs = []
    try:
        steps = []
        for _ in range(a.turns):
            steps.append({"tool_calls": [{"name": "bash", "arguments": {"command": "true"}}]})
            steps.append({"text": "done"})
        steps += [{"text": "direct"}] * 50 + [{"text": "idle"}] * a.conversations
        with open(os.path.join(tmp, "scenario.json"), "w") as f:
            json.dump({"steps": steps}, f)
        fm = subprocess.Popen([sys.executable, os.path.join(root, "tests/fake_model/fake_model.py"), "--port", "0",
                               "--scenario", os.path.join(tmp, "scenario.json"), "--quiet",
                               "--log", os.path.join(tmp, "fm.jsonl")],
                              stdout=subprocess.PIPE, text=True)
        procs.append(fm)
        fm_port = int(fm.stdout.readline().split()[-1])
        st = subprocess.Popen([os.path.join(a.build, "storaged/storaged"), "--listen", "127.0.0.1:0", "--db",
                               os.path.join(tmp, "db"), "--port-file", os.path.join(tmp, "sp"), "--log-level", "warn"])
        procs.append(st)
        sp = wait_port_file(os.path.join(tmp, "sp"), st)
        td = subprocess.Popen([os.path.join(a.build, "toold/toold"), "--listen", "127.0.0.1:0", "--root",
                               os.path.join(tmp, "ws"), "--port-file", os.path.join(tmp, "tp"), "--log-level", "warn"])
        procs.append(td)
        tp = wait_port_file(os.path.join(tmp, "tp"), td)
        os.makedirs(os.path.join(tmp, "agents"))
        with open(os.path.join(tmp, "agents", "bench.md"), "w") as f:
            f.write("---\nmodel: anthropic/bench\nsandbox: {tools: \"127.0.0.1:%d\", workspace: bench}\n---\n"
                    "Answer briefly.\n" % tp)
        env = dict(os.environ, ANTHROPIC_BASE_URL="http://127.0.0.1:%d" % fm_port, ANTHROPIC_API_KEY="bench")
        ag = subprocess.Popen([os.path.join(a.build, "agentd/agentd"), "--listen", "127.0.0.1:0", "--store",
                               "127.0.0.1:%d" % sp, "--agents", os.path.join(tmp, "agents"), "--port-file",
                               os.path.join(tmp, "ap"), "--log-level", "warn", "--workers", "8"], env=env)
        procs.append(ag)
        ap_port = wait_port_file(os.path.join(tmp, "ap"), ag)
        ch = grpc.insecure_channel("127.0.0.1:%d" % ap_port)
        grpc.channel_ready_future(ch).result(timeout=10)
        submit = ch.unary_unary("/cflue.v1.Agent/Submit", request_serializer=agent_pb2.SubmitRequest.SerializeToString,
                                response_deserializer=agent_pb2.Admission.FromString)
        get = ch.unary_unary("/cflue.v1.Agent/GetSubmission",
                             request_serializer=agent_pb2.GetSubmissionRequest.SerializeToString,
                             response_deserializer=common_pb2.Submission.FromString)
        time.sleep(0.5)
        base_rss = rss_kb(ag.pid)

        # 1. per-turn overhead
        conv = ""
        t0 = time.perf_counter()
        for _ in range(a.turns):
            r = submit(agent_pb2.SubmitRequest(agent="bench", conversation_id=conv,
                                               message=common_pb2.Message(text="go")), timeout=30)
            conv = "bench-turns"  # the first one creates a conversation; keep it short: new each
            s = get(agent_pb2.GetSubmissionRequest(submission_id=r.submission_id, wait=True), timeout=60)
            assert s.outcome == common_pb2.OUTCOME_COMPLETED, s
            conv = ""
        e2e = (time.perf_counter() - t0) / (a.turns * 2)
        # the model's own time: replay the last request agentd sent (same size and shape)
        with open(os.path.join(tmp, "fm.jsonl")) as f:
            body = json.dumps(json.loads(f.readlines()[-1])["body"]).encode()
        samples = []
        for _ in range(50):
            req = urllib.request.Request("http://127.0.0.1:%d/v1/messages" % fm_port, data=body, headers={
                "content-type": "application/json", "x-api-key": "bench", "anthropic-version": "2023-06-01"})
            t1 = time.perf_counter()
            urllib.request.urlopen(req).read()
            samples.append(time.perf_counter() - t1)
        samples.sort()
        model = samples[len(samples) // 2]
        print("per turn, end to end through agentd: %7.2f ms" % (e2e * 1000))
        print("fake model's own response time:       %7.2f ms (median of 50 direct replays of agentd's "
              "last request)" % (model * 1000))
        print("agentd overhead per turn:             %7.2f ms = %.1fx the model's own time"
              % ((e2e - model) * 1000, (e2e - model) / model))
        report.add("turn.e2e", "per turn through agentd", e2e * 1000, "ms", model * 1000,
                   "fake model's own time")

        # 2. memory with idle conversations
        ids = [submit(agent_pb2.SubmitRequest(agent="bench", message=common_pb2.Message(text="hi")), timeout=30)
               .submission_id for _ in range(a.conversations)]
        for sid in ids:
            get(agent_pb2.GetSubmissionRequest(submission_id=sid, wait=True), timeout=120)
        time.sleep(1)
        idle_rss = rss_kb(ag.pid)
        print("agentd resident memory: %d KiB at start, %d KiB with %d idle conversations (ratio %.2f)"
              % (base_rss, idle_rss, a.conversations, idle_rss / base_rss))
        report.add("rss.idle", "agentd RSS, %d idle conversations" % a.conversations,
                   idle_rss / 1024.0, "MiB", base_rss / 1024.0, "at start")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
