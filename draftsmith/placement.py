"""GPU placement and engine environment of the jobs that run the target.

Snakemake counts GPUs (``resources: gpu=N`` against ``--resources gpu=M``) but does not say which
ones a job may use (snakemake/snakemake#281), so two TP=4 extraction parts on an 8-GPU node would
both start on GPUs 0-3. A job therefore claims its devices itself before its engine starts:

- **Under SLURM** (``SLURM_JOB_ID`` set) the job's allocation is its own: the devices SLURM made
  visible are used as they are, with no lock (SLURM's device ids restart at 0 in every job's cgroup,
  so ids say nothing about other jobs).
- **Elsewhere** the job claims ``N`` free devices of the machine (or of the ``CUDA_VISIBLE_DEVICES``
  the workflow was started with): one lock file per device, ``flock``-ed by this process in a
  machine-wide folder, taken all at once under a folder lock. The kernel drops ``flock`` locks when
  the last descriptor closes, so a job that exits, fails or is killed (SIGKILL, OOM) frees its
  devices without any clean-up step (once the warm engine it was attached to, which holds copies
  of the descriptors while it works for the job, has finished the call it was in).
  ``CUDA_VISIBLE_DEVICES`` is then set to the claimed ids, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so
  that CUDA numbers devices as ``nvidia-smi`` does.

Devices are listed by ``nvidia-smi`` (index and UUID; locks are named by UUID, so two checkouts or
containers on one machine contend for the same physical GPU), or by ``DRAFTSMITH_DEVICES`` (a
comma-separated list, for tests and for machines without ``nvidia-smi``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

DEVICES_ENV = "DRAFTSMITH_DEVICES"
LOCK_DIR_ENV = "DRAFTSMITH_GPU_LOCK_DIR"
WAIT_LOG_INTERVAL_S = 60.0
POLL_S = 2.0
# Set for every job that starts an engine unless the config's engine_env says otherwise: vLLM
# reports usage to its authors by default (vllm/usage/usage_lib.py reads both).
ENGINE_ENV_DEFAULTS = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
ENGINE_RULES = ("synthesize_conversations", "regenerate_responses", "extract_hidden_states", "evaluate_draft",
                "train_draft_online")
JOB_GPUS_ENV = "DRAFTSMITH_JOB_GPUS"  # the UUIDs of the job's GPUs: which warm engines it may attach to
KEEP_WARM_ENV = "DRAFTSMITH_KEEP_WARM_S"  # seconds a warm target engine outlives its last job (draftsmith.engines.warm)


class PlacementError(DraftsmithError):
    """A job cannot get the GPUs it declared."""


@dataclass(frozen=True)
class Device:
    index: str  # CUDA_VISIBLE_DEVICES id (nvidia-smi's index)
    uuid: str


def list_devices() -> list[Device]:
    """This machine's GPUs, restricted to the ``CUDA_VISIBLE_DEVICES`` the workflow runs under."""
    fake = os.environ.get(DEVICES_ENV)
    if fake is not None:
        devices = [Device(i, f"{DEVICES_ENV}-{i}") for i in _split(fake)]
    else:
        devices = _nvidia_smi_devices()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return devices
    allowed = _split(visible)
    return [d for d in devices if d.index in allowed or d.uuid in allowed]


def _split(ids: str) -> list[str]:
    return [i.strip() for i in ids.split(",") if i.strip()]


def _nvidia_smi_devices() -> list[Device]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PlacementError(f"cannot list this machine's GPUs with nvidia-smi: {e}", where="nvidia-smi",
                             fix=f"install the NVIDIA driver tools, or list the device ids in {DEVICES_ENV} "
                                 "(e.g. 0,1,2,3)") from e
    devices = []
    for line in out.splitlines():
        if line.strip():
            index, uuid = (p.strip() for p in line.split(",", 1))
            devices.append(Device(index, uuid))
    return devices


def lock_dir() -> Path:
    """Machine-wide (not per checkout): every workflow on this machine shares its GPUs."""
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "draftsmith-gpus")


# The lock files of the claims this process holds: a warm engine serving this job holds copies of
# their descriptors while it works for it (draftsmith.engines.warm), so that a job killed in the
# middle of a call leaves its devices claimed until the engine has finished that call.
_held_files: list = []


@dataclass
class Claim:
    """Devices held by this process until ``release`` (or its exit, however it ends)."""

    devices: list[Device]
    source: str  # "slurm", "lock" or "none"
    _files: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        _held_files.extend(self._files)

    @property
    def visible(self) -> str:
        return ",".join(d.index for d in self.devices)

    def release(self) -> None:
        for f in self._files:
            _held_files.remove(f)
            f.close()  # closing the last descriptor drops the flock
        self._files = []


def held_device_locks() -> list[int]:
    """The descriptors of the device locks this process holds (none under SLURM or on the CPU)."""
    return [f.fileno() for f in _held_files]


def _open_lock(path: Path):
    """The lock file, created writable by every user of the machine; another user's file opens
    read-only, which flock takes as well."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.fdopen(os.open(path, os.O_RDONLY), "r")
    if os.fstat(fd).st_uid == os.getuid():
        os.fchmod(fd, 0o666)  # past the umask: the next user's job must open it too
    return os.fdopen(fd, "r+")


def _shared_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if folder.stat().st_uid == os.getuid():
        folder.chmod(0o1777)  # every user may add locks, none may remove another's (sticky)
    return folder


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def claim_devices(count: int, *, timeout: float | None = None) -> Claim:
    """Claim ``count`` GPUs for this process: SLURM's allocation, or ``count`` free devices of this
    machine, waiting (forever, or ``timeout`` seconds) while other jobs hold them."""
    if count <= 0:
        return Claim([], "none")
    if os.environ.get("SLURM_JOB_ID") and os.environ.get(DEVICES_ENV) is None:
        return _slurm_claim(count)
    devices = list_devices()
    if len(devices) < count:
        raise PlacementError(
            f"the job needs {count} GPUs; this machine has {len(devices)} usable "
            f"({', '.join(d.index for d in devices) or 'none'})",
            where="resources gpu (tensor_parallel_size, train.devices)",
            fix="lower the tensor parallel size or run on a machine with more GPUs")
    folder = _shared_folder(lock_dir())
    started = last_log = time.monotonic()
    while True:
        with _open_lock(folder / "claim.lock") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # one claimer at a time: no two jobs split the free set
            held, files = [], []
            for device in devices:
                f = _open_lock(folder / f"{device.uuid}.lock")
                if _try_lock(f):
                    held.append(device)
                    files.append(f)
                    if len(held) == count:
                        break
                else:
                    f.close()
            if len(held) == count:
                for f in files:
                    if f.writable():  # who holds it, for a person looking
                        f.seek(0)
                        f.truncate()
                        f.write(f"{os.getpid()}\n")
                        f.flush()
                return Claim(held, "lock", files)
            for f in files:
                f.close()
        now = time.monotonic()
        if timeout is not None and now - started >= timeout:
            raise PlacementError(
                f"{count} of the GPUs {', '.join(d.index for d in devices)} are not free: other jobs hold them",
                where=str(folder), fix="wait for them to finish, or run with fewer GPUs per job")
        if now - last_log >= WAIT_LOG_INTERVAL_S:
            log.info("waiting for %d free GPUs (locks in %s)", count, folder)
            last_log = now
        time.sleep(POLL_S)


def _slurm_claim(count: int) -> Claim:
    """The allocation's devices as SLURM made them visible; SLURM is the authority here, so a
    count that differs from the rule's is logged, not refused."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = _split(visible) if visible else _split(os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS") or "")
    if len(ids) < count:
        log.warning("SLURM job %s shows %d GPUs (%s), the rule declared %d; running on what SLURM gave",
                    os.environ["SLURM_JOB_ID"], len(ids), ",".join(ids) or "none", count)
    return Claim([Device(i, i) for i in ids[:count]], "slurm")


def engine_env(config: Mapping, rule: str) -> dict[str, str]:
    """The environment of ``rule``'s engine: the defaults, the config's ``engine_env`` variables,
    then that rule's own entries (``engine_env.<rule>``), and how long its engine stays warm after
    the job (``warm_target.minutes``)."""
    section = dict(config.get("engine_env") or {})
    env = dict(ENGINE_ENV_DEFAULTS)
    env.update({k: _text(v) for k, v in section.items() if k not in ENGINE_RULES})
    env.update({k: _text(v) for k, v in (section.get(rule) or {}).items()})
    env[KEEP_WARM_ENV] = _text(60 * float((config.get("warm_target") or {}).get("minutes", 0)))
    return env


def _text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@contextmanager
def engine_placement(gpus: int, env: Mapping[str, str] | None = None, *,
                     timeout: float | None = None) -> Iterator[Claim]:
    """Run the body on ``gpus`` devices of its own with ``env`` set: call before the engine starts
    (CUDA reads ``CUDA_VISIBLE_DEVICES`` once, at initialisation)."""
    os.environ.update(env or {})
    claim = claim_devices(int(gpus or 0), timeout=timeout)
    if claim.devices:
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = claim.visible
        os.environ[JOB_GPUS_ENV] = ",".join(d.uuid for d in claim.devices)
        log.info("GPUs of this job (%s): CUDA_VISIBLE_DEVICES=%s; UUIDs %s", claim.source, claim.visible,
                 ", ".join(d.uuid for d in claim.devices))
    try:
        yield claim
    finally:
        claim.release()


def host_memory_bytes() -> int:
    """This machine's memory, or the limit of the cgroup this process runs in where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
