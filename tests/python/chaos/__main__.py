"""Runs one chaos run outside pytest, with any RunSpec field overridden (for probing limits):

    cd tests/python
    FENCEGATE_BIN=/path/to/fencegate python3 -m chaos '{"name": "probe", "topology": "redis",
        "replicas": 3, "seconds": 60, "inflight_deadline_ms": 1000, "hold_range": [0.75, 1.0],
        "commit_within_s": 1.25, "faults": {"kill9": 4, "stop_long": 2}}'

`topology` is "embedded", "redis" or "etcd" (three etcd members; fault `etcd_leader_kill9`).
Prints the checker's summary; exits 1 if the run found violations. Its files (fencegate logs,
history.json) stay in a new directory under /tmp.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fencegate_testlib
os.environ["AWS_CONFIG_FILE"] = os.devnull  # as conftest.py: no user AWS configuration
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull

from chaos.harness import ChaosRun, RunSpec  # noqa: E402
from fencegate_testlib import MotoServer  # noqa: E402


def main(argv: list) -> int:
    over = json.loads(argv[1]) if len(argv) > 1 else {}
    over.setdefault("name", "chaos-cli")
    over.setdefault("topology", "embedded")
    over.setdefault("seconds", 30)
    if "hold_range" in over:
        over["hold_range"] = tuple(over["hold_range"])
    spec = RunSpec(**over)
    workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{spec.name}-"))
    moto = MotoServer(workdir).start()
    run = ChaosRun(spec, moto, workdir / spec.name)
    try:
        run.start()
        report, text, _history = run.run()
        print(text, flush=True)
        return 0 if report.ok else 1
    finally:
        run.close()
        moto.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
