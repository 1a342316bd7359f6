"""Hosts h0..hN-1 on one machine: each a network namespace on a bridge with its own address, hostname,
sshd and slurmd; slurmctld on h0 and munged in the root namespace. Everything lives in one temp dir.

    with Cluster(4) as c:          # up() on enter, down() on exit (also after an exception or Ctrl-C)
        c.run("h0", ["hostname"])  # -> CompletedProcess, run inside h0

Each host has an init process started as ``ip netns exec NS unshare --uts --mount --pid --fork --mount-proc``
that sets the hostname and bind-mounts TMP/hosts on /etc/hosts, and every process of the host enters its
namespaces (``nsenter -t INIT --net --uts --mount --pid``): a private hostname, an /etc/hosts that names every
host (so gloo and pdsh resolve h0..hN to bridge addresses, never to 127.0.1.1) and private process ids (a
``pkill -f`` on one host, as DeepSpeed's pdsh runner sends to every host on a stop, reaches only that
host's processes, as on separate machines). Nothing is changed on the machine itself.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.rehearsal.link import Link, tc_argv

NETNS_PREFIX = "vapo-"  # namespace names: vapo-h0, vapo-h1, ...; the hostnames inside are h0, h1, ...
BRIDGE = "vapo-br0"
LOCK_FILE = "/run/vapo-rehearsal.lock"
SUBNET = "10.213.7"  # a private /24 used only between namespaces this file creates
# A host's daemons and the wrappers that entered its namespaces (slurmscriptd: slurmctld's helper).
ENGINE_TMP_PREFIX = "vapo-engine-"  # an SGLang engine's private TMPDIR (common.remote --private-tmp)
DAEMONS = ("sshd", "slurmd", "slurmctld", "slurmscriptd", "nsenter", "unshare")
PACKAGES = {"ip": "iproute2", "nsenter": "util-linux", "python3": "python3", "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
            "pdsh": "pdsh", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm",
            "munged": "munge", "unshare": "util-linux"}


def become_subreaper() -> None:
    """Adopt orphans (slurmstepd and sshd daemonise): reaped by ``reap()`` here, whatever this machine's
    init does, so no zombie of the rehearsal outlives it."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap(own: set[int] | frozenset[int] = frozenset()) -> int:
    """Wait for every exited child adopted as subreaper (not ``own``: Popen objects wait for those).
    Returns how many were reaped."""
    me, n = str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if fields[0] == "Z" and fields[1] == me and pid not in own:
            try:
                os.waitpid(pid, os.WNOHANG)
                n += 1
            except ChildProcessError:
                pass
    return n


def _zombie_children() -> bool:
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and fields[1] == me:
            return True
    return False


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the rehearsal (not root, no namespaces, a package missing)."""


def proc_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with; OSError once it is gone."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="surrogateescape")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def engine_tmps_of(pids: list[int]) -> set[Path]:
    """The ``TMPDIR`` of each of ``pids`` that runs in an SGLang engine's private one."""
    found: set[Path] = set()
    for p in pids:
        try:
            tmp = proc_environ(p).get("TMPDIR", "")
        except OSError:
            continue
        if tmp and Path(tmp).name.startswith(ENGINE_TMP_PREFIX):
            found.add(Path(tmp))
    return found


def engine_tmps_left(before: set[Path], root: Path | None = None) -> list[str]:
    """SGLang engines' private temporary directories in ``root`` (default: this machine's temporary directory,
    every host's here) that were not there ``before`` and that no living process runs in: what the rehearsal's
    engines left."""
    now = set(Path(root or tempfile.gettempdir()).glob(ENGINE_TMP_PREFIX + "*")) - before
    live = engine_tmps_of([int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]) if now else set()
    return sorted(str(d) for d in now - live)


def missing_prerequisites() -> str | None:
    """Why a cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge, sshd and slurmd as root)"
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None
                      and not Path(f"/usr/sbin/{tool}").exists()})
    if missing:
        return "missing Debian packages: " + " ".join(missing) + " (apt-get install them; .ci/run does)"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package creates it)"
    probe = f"{NETNS_PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterUnavailable(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


class Cluster:
    def __init__(self, n_hosts: int = 4, cpus_per_host: int = 2, keep: Path | None = None) -> None:
        self.hosts = [f"h{i}" for i in range(n_hosts)]
        self.ips = {h: f"{SUBNET}.{10 + i}" for i, h in enumerate(self.hosts)}
        self.cpus = cpus_per_host
        self.tmp = Path(tempfile.mkdtemp(prefix="vapo-rehearsal-"))
        self.keep = keep  # daemon logs are copied here on down()
        self.slurm_conf = self.tmp / "slurm" / "slurm.conf"
        self.ssh_config = self.tmp / "ssh" / "config"
        self.daemons: list[subprocess.Popen] = []
        self.inits: dict[str, int] = {}  # host -> pid (as seen here) of its init
        self._lock_fd = -1

    # ------------------------------------------------------------------ running things on a host

    def ns(self, host: str) -> str:
        return NETNS_PREFIX + host

    def wrap(self, host: str, argv: list[str], cwd: str | Path | None = None) -> list[str]:
        """``argv`` run on ``host`` in ``cwd`` (default: ours): its network, hostname, mount (/etc/hosts) and
        process-id namespaces. (Entering a mount namespace moves to its root: hence --wd.)"""
        return ["nsenter", "-t", str(self.inits[host]), "--net", "--uts", "--mount", "--pid",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def _start_init(self, host: str) -> None:
        """The host's init: the first process of its namespaces (they live as long as it does), reaping
        whatever is orphaned on the host. Killing every process of the host kills it too."""
        setup = (f"hostname {host} && mount --bind {self.tmp}/hosts /etc/hosts && exec python3 -c "
                 "'import os, time\nwhile True:\n    try: os.wait()\n    except ChildProcessError: time.sleep(0.5)'")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--mount", "--pid", "--fork",
                              "--mount-proc", "sh", "-c", setup], start_new_session=True)
        self.daemons.append(p)  # `unshare --fork` waits for the init; reaped with the daemons on down()
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            except OSError:
                kids = []
            if kids and Path(f"/proc/{kids[0]}/comm").read_text().strip() == "python3":
                self.inits[host] = int(kids[0])
                return
            time.sleep(0.05)  # polling for the init to exec, with a deadline
        raise ClusterUnavailable(f"the init of {host} did not start (unshare --pid --mount-proc)")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of cluster commands: Slurm's conf, and the cluster's ssh config for the launcher's
        ssh and pdsh through the documented ``$VAPO_SSH_ARGS`` (nothing read from ``~/.ssh``)."""
        e = dict(os.environ)
        e.update(SLURM_CONF=str(self.slurm_conf), VAPO_SSH_ARGS=f"-F {self.ssh_config}")
        e.update(extra)
        return e

    def run(self, host: str, argv: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        cmd = self.wrap(host, argv, kw.pop("cwd", None))
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, host: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("env", self.env())
        return subprocess.Popen(self.wrap(host, argv, kw.pop("cwd", None)), **kw)

    def pids(self, host: str) -> list[int]:
        r = _sh("ip", "netns", "pids", self.ns(host), check=False)
        return [int(p) for p in r.stdout.split()]

    def comm(self, pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    def run_pids(self, host: str) -> list[int]:
        """Processes on ``host`` other than its daemons (sshd, slurmd, slurmctld): what a run left behind."""
        return [p for p in self.pids(host) if self.comm(p) not in DAEMONS and p != self.inits.get(host)]

    def kill_host(self, host: str, sig: int = signal.SIGKILL) -> int:
        """Kill every process in ``host``'s namespace (daemons included): a host that died. Killed outright,
        its SGLang engines' private temporary directories stay, as files do in a lost node's /tmp; every host's
        /tmp is this machine's here, so they go with the host (a node that comes back starts with an empty one)."""
        engine_tmps = self._engine_tmps(host) if sig == signal.SIGKILL else set()
        n = 0
        for p in self.pids(host):
            try:
                os.kill(p, sig)
                n += 1
            except ProcessLookupError:
                pass
        for d in engine_tmps:
            shutil.rmtree(d, ignore_errors=True)
        return n

    def _engine_tmps(self, host: str) -> set[Path]:
        """The private ``TMPDIR`` of each SGLang engine process on ``host`` (common.remote, ops/launch.py)."""
        return engine_tmps_of(self.pids(host))

    def link(self, host: str, up: bool) -> None:
        _sh("ip", "link", "set", f"v{host}", "up" if up else "down")

    def shape(self, link: Link) -> dict[str, str]:
        """Every host's egress (its ``eth0``) shaped as ``link``; returns each host's qdisc as tc shows it.
        The qdiscs are removed with the namespaces on ``down()``."""
        shown = {}
        for h in self.hosts:
            r = _sh(*tc_argv(link, self.ns(h)), check=False)
            if r.returncode != 0:
                raise ClusterUnavailable(f"tc on {h}: {r.stderr.strip()} (a delay needs the kernel's netem qdisc; "
                                         "a rate alone uses tbf)")
            shown[h] = _sh("ip", "netns", "exec", self.ns(h), "tc", "qdisc", "show", "dev", "eth0").stdout.strip()
        return shown

    # ------------------------------------------------------------------------------ up / down

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> None:
        self._lock()
        become_subreaper()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
        self._network()
        self._files()
        for h in self.hosts:
            self._start_init(h)
        for h in self.hosts:
            self._start(h, ["/usr/sbin/sshd", "-D", "-f", str(self.tmp / "ssh" / f"sshd-{h}.conf"), "-E",
                            str(self.tmp / "logs" / f"sshd-{h}.log")])
        self._start(None, ["munged", "--foreground", "--force", f"--socket={self.tmp}/munge/munge.sock", f"--pid-file={self.tmp}/munge/munged.pid",
            f"--log-file={self.tmp}/logs/munged.log", f"--seed-file={self.tmp}/munge/munge.seed"])
        self._start("h0", ["slurmctld", "-D"])
        for h in self.hosts:
            self._start(h, ["slurmd", "-D", "-N", h])
        self._wait_ready()

    @property
    def owned(self) -> bool:
        """This cluster holds the machine's rehearsal lock (it came up, or is coming up, and is not down)."""
        return self._lock_fd >= 0

    def _lock(self) -> None:
        """One cluster per machine: the namespace and bridge names are fixed, so a second one would tear
        down the first. The lock dies with this process, so a killed rehearsal never blocks the next."""
        self._lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise ClusterUnavailable(f"another rehearsal holds {LOCK_FILE} (one at a time per machine)") from None

    def restart_host(self, host: str, own: frozenset[int] = frozenset()) -> None:
        """A killed host back up: its sshd and slurmd again (the namespace and its address never left).
        ``own``: children a Popen object of the caller waits for (never reaped here)."""
        self.daemons = [d for d in self.daemons if d.poll() is None]
        reap({d.pid for d in self.daemons} | own)
        self._start_init(host)
        self._start(host, ["/usr/sbin/sshd", "-D", "-f", str(self.tmp / "ssh" / f"sshd-{host}.conf"), "-E",
                           str(self.tmp / "logs" / f"sshd-{host}.log")])
        self._start(host, ["slurmd", "-D", "-N", host])
        self._wait_ready()

    def _network(self) -> None:
        self.down_network()  # a cluster left by a killed rehearsal would collide with this one
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "link", "set", BRIDGE, "up")
        for h in self.hosts:
            ns = self.ns(h)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"v{h}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", f"v{h}", "master", BRIDGE, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ips[h]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _files(self) -> None:
        t = self.tmp
        for d in ("ssh", "munge", "slurm", "logs", "slurm/state"):
            (t / d).mkdir(parents=True, exist_ok=True)
        (t / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {h}\n" for h, ip in self.ips.items()))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(t / "ssh" / "id"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(t / "ssh" / "host_key"))
        shutil.copy(t / "ssh" / "id.pub", t / "ssh" / "authorized_keys")
        for h, ip in self.ips.items():
            (t / "ssh" / f"sshd-{h}.conf").write_text(
                f"ListenAddress {ip}\nHostKey {t}/ssh/host_key\nAuthorizedKeysFile {t}/ssh/authorized_keys\n"
                f"PidFile {t}/ssh/sshd-{h}.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "UsePAM no\nStrictModes no\nPrintMotd no\nAcceptEnv no\nMaxStartups 64\nMaxSessions 64\n")
        self.ssh_config.write_text(
            f"Host *\n  IdentityFile {t}/ssh/id\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n  ServerAliveInterval 2\n  ServerAliveCountMax 3\n")
        nodes = "\n".join(f"NodeName={h} NodeAddr={ip} CPUs={self.cpus} State=UNKNOWN" for h, ip in self.ips.items())
        self.slurm_conf.write_text(f"""ClusterName=vapo-rehearsal
SlurmctldHost=h0({self.ips['h0']})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={t}/munge/munge.sock
StateSaveLocation={t}/slurm/state
SlurmdSpoolDir={t}/slurm/spool-%n
SlurmctldPidFile={t}/slurm/slurmctld.pid
SlurmdPidFile={t}/slurm/slurmd-%n.pid
SlurmctldLogFile={t}/logs/slurmctld.log
SlurmdLogFile={t}/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SlurmdTimeout=30
KillWait=5
{nodes}
PartitionName=rehearsal Nodes={','.join(self.hosts)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
        (self.slurm_conf.parent / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n")

    def _start(self, host: str | None, argv: list[str]) -> None:
        """A daemon in the foreground, as our child (we reap it: this machine's init may not)."""
        name = Path(argv[0]).name + (f"-{host}" if host else "")
        log = open(self.tmp / "logs" / f"{name}.out", "ab")  # the daemon's for its lifetime
        cmd = self.wrap(host, argv) if host else argv
        self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                             start_new_session=True))
        log.close()

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.time() + timeout_s
        last = ""
        while time.time() < deadline:
            ssh_ok = all(self.run("h0", ["ssh", "-F", str(self.ssh_config), h, "hostname"], timeout=20).stdout.strip() == h for h in self.hosts)
            r = self.run("h0", ["sinfo", "-h", "-o", "%T", "-N"], timeout=20)
            last = f"ssh {'ok' if ssh_ok else 'not yet'}; sinfo: {r.stdout.split()} {r.stderr.strip()}"
            if ssh_ok and r.returncode == 0 and r.stdout.split() and all(s == "idle" for s in r.stdout.split()):
                return
            time.sleep(0.5)  # polling daemons for readiness with a deadline
        raise ClusterUnavailable(f"cluster not ready after {timeout_s:.0f} s: {last}")

    def down(self) -> dict[str, int]:
        """Stop every daemon and process on every host, remove the namespaces and the bridge. Returns the
        processes found on each host just before its namespace was removed (after the kill: must be 0)."""
        left: dict[str, int] = {}
        if self._lock_fd < 0:  # never came up (another rehearsal owns the names): nothing here is ours
            shutil.rmtree(self.tmp, ignore_errors=True)
            return left
        for h in self.hosts:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self.pids(h):
                    self.kill_host(h, sig)
                    deadline = time.time() + 5
                    while self.pids(h) and time.time() < deadline:
                        time.sleep(0.05)  # polling for the processes to exit
            left[h] = len(self.pids(h))
        for d in self.daemons:  # munged (root namespace), and the reaping of the host daemons killed above
            if d.poll() is None:
                d.terminate()
            try:
                d.wait(timeout=5)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
        reap()
        self.down_network()
        if self.keep is not None and (self.tmp / "logs").exists():
            shutil.copytree(self.tmp / "logs", self.keep, dirs_exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        deadline = time.time() + 5
        while reap() == 0 and time.time() < deadline and _zombie_children():
            time.sleep(0.1)  # a dead host's init turns zombie once its namespace is torn down
        os.close(self._lock_fd)
        self._lock_fd = -1
        return left

    def down_network(self) -> None:
        existing = _sh("ip", "netns", "list", check=False).stdout.split()
        for h in self.hosts:
            if self.ns(h) in existing:
                for p in self.pids(h):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _sh("ip", "netns", "del", self.ns(h), check=False)
            _sh("ip", "link", "del", f"v{h}", check=False)
        _sh("ip", "link", "del", BRIDGE, check=False)
