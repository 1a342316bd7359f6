"""The launcher's stop of an srun'd process against real Slurm (two hosts as network namespaces, the
rehearsal's cluster): srun turns a SIGTERM into SIGKILL for its whole step, so the launcher asks an srun'd
engine or actor to stop with SIGUSR1 (``common.remote.SRUN_STOP``), which srun passes on; the guard turns it
into a SIGTERM, the process stops in order, and an engine's private TMPDIR on its host is removed.

Needs what the rehearsal needs (root, sshd, Slurm, munge: ``.ci/run`` installs them) and skips naming what is
missing; ~30 s (the cluster's start most of it). Marked slow: CI runs it with the rehearsal.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

from common import remote
from common.config import load_config
from ops.rehearsal.cluster import Cluster, missing_prerequisites

ROOT = Path(__file__).resolve().parents[2]

# The stopped process: reports its TMPDIR and whether SIGUSR1 reaches it, leaves a file there (as SGLang
# leaves its sockets), and on SIGTERM (its orderly stop) leaves a mark and exits 0.
CHILD = (
    "import json, os, signal, sys, tempfile, time\n"
    "report, mark = sys.argv[1], sys.argv[2]\n"
    "signal.signal(signal.SIGTERM, lambda *_: (open(mark, 'w').close(), sys.exit(0)))\n"
    "open(os.path.join(tempfile.gettempdir(), 'sock'), 'w').close()\n"
    "json.dump({'tmp': tempfile.gettempdir(), 'usr1_ignored': signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN},"
    " open(report + '.part', 'w'))\n"
    "os.rename(report + '.part', report)\n"
    "time.sleep(600)\n")

# The launcher's side, on h0 inside an allocation: the srun command as a supervised child, asked to stop as
# the launcher asks it (``Child.ask_to_stop``) once the process reported.
DRIVER = (
    "import json, sys, time\n"
    "from pathlib import Path\n"
    "from ops.launch_child import Child\n"
    "argv, report, log, stop = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])\n"
    "c = Child('engine-0', argv, log, via='srun', host='h1', stop_signal=stop)\n"
    "c.start()\n"
    "deadline = time.time() + 60\n"
    "while not report.exists() and c.alive() and time.time() < deadline:\n"
    "    time.sleep(0.1)  # polling for the remote process's report, with a deadline\n"
    "c.ask_to_stop()\n"
    "print(json.dumps({'reported': report.exists(), 'rc': c.proc.wait(timeout=30)}))\n")


def _stop_once(cluster: Cluster, tmp: Path, stop: int) -> dict:
    """Start the guarded process on h1 through srun from h0, stop it with ``stop``; what each side saw."""
    tmp.mkdir()
    report, mark = tmp / "report.json", tmp / "got-sigterm"
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", ["placement.remote=srun",
                                                                 "placement.srun_cpus_per_task=1"])
    argv = remote.wrap_remote(cfg, "h1", [sys.executable, "-c", CHILD, str(report), str(mark)], {}, ROOT,
                              sys.executable, environ={}, private_tmp="vapo-engine-srunstop-")
    r = cluster.run("h0", ["salloc", "--nodes=2", "--nodelist=h0,h1", sys.executable, "-c", DRIVER,
                           json.dumps(argv), str(report), str(tmp / "child.log"), str(int(stop))],
                    timeout=120, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    seen = json.loads(report.read_text())
    return {**json.loads(lines[-1]), **seen, "sigterm_handled": mark.exists(), "tmp_left": Path(seen["tmp"]).exists()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_srun_stop_reaches_the_process_in_order_and_its_tmp_goes(tmp_path: Path) -> None:
    why = missing_prerequisites()
    if why:
        pytest.skip(f"no Slurm cluster here: {why}")
    try:
        with Cluster(n_hosts=2, cpus_per_host=2) as cluster:
            # What srun does with a SIGTERM (the premise): the step is killed, no handler runs, the directory stays.
            term = _stop_once(cluster, tmp_path / "sigterm", signal.SIGTERM)
            # What the launcher sends instead.
            usr1 = _stop_once(cluster, tmp_path / "srun-stop", remote.SRUN_STOP)
    finally:  # every host's temporary directory is this machine's here
        for report in tmp_path.glob("*/report.json"):
            shutil.rmtree(json.loads(report.read_text())["tmp"], ignore_errors=True)
    assert term["reported"] and not term["sigterm_handled"] and term["tmp_left"], term
    assert usr1["reported"] and usr1["usr1_ignored"], usr1
    assert usr1["sigterm_handled"] and not usr1["tmp_left"] and usr1["rc"] == 0, usr1
