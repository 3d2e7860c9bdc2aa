"""Which device this machine is, and whether a profile was measured on it: a profile's times hold for the
device that was calibrated (the bundled localhost-cpu is one 2-core AMD EPYC VM), so the commands that
run here (validate, train, calibrate on top of earlier results) say in one line when they are elsewhere.
torch is imported only for GPU profiles."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    count: int | None  # logical CPUs of the host, or GPUs visible; None: not known

    def show(self) -> str:
        unit = "CPUs" if self.count and "GPU" not in self.name.upper() and not _is_gpu_name(self.name) else "GPUs"
        return self.name + (f" ({self.count} {unit})" if self.count else "")


def _is_gpu_name(name: str) -> bool:
    return any(w in name.upper() for w in ("NVIDIA", "A100", "H100", "H200", "GH200", "MI250", "MI300", "AMD INSTINCT"))


def cpu_name() -> str:
    """/proc/cpuinfo's model name (the calibration worker records the same), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def this_device(kind: str) -> Device | None:
    """This machine as a profile of `kind` would record it; None for a GPU profile where no GPU is visible."""
    if kind != "gpu":
        return Device(cpu_name(), os.cpu_count())
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return Device(torch.cuda.get_device_name(0), torch.cuda.device_count())


def _norm(name: str) -> str:
    return " ".join(name.replace("NVIDIA ", "").split()).lower()


def mismatch(profile, here: Device | None = None) -> str | None:
    """One sentence when `profile` (a MachineProfile) was measured on another device than this one, else None.
    A CPU profile's count is the host's logical CPUs: the same model with other cores is another machine."""
    recorded = getattr(profile, "device", "") or ""
    if not recorded:
        return None
    here = here or this_device(profile.kind)
    if here is None:
        return None
    count = getattr(profile, "device_count", None)
    same_name = _norm(recorded) == _norm(here.name)
    same_count = count is None or here.count is None or count == here.count or profile.kind == "gpu"
    if same_name and same_count:
        return None
    was = Device(recorded, count).show()
    return (f"profile '{profile.name}' was measured on {was}, this machine is {here.show()}: its times may not "
            f"hold here; calibrate this machine first (axoplan calibrate --nproc N --quick --out "
            f"machine_profiles/mine.yaml)")


def warn(line: str | None) -> None:
    """A mismatch on stderr, one line, never an error: the user may mean it (a profile for another node)."""
    if line:
        import click

        click.echo(f"warning: {line}", err=True)


def results_mismatch(results, cuda: bool) -> str | None:
    """`calibrate --parts` on top of a results folder measured on another device: the profile would mix them."""
    import json
    from pathlib import Path

    try:
        recorded = json.loads((Path(results) / "meta.json").read_text()).get("device") or ""
    except (OSError, ValueError, AttributeError):
        return None
    here = this_device("gpu" if cuda else "cpu")
    if not recorded or here is None or _norm(recorded) == _norm(here.name):
        return None
    return (f"the earlier results in {results} were measured on {recorded}, this machine is {here.name}: "
            f"--parts would mix two devices' measurements in one profile; calibrate all parts here instead")
