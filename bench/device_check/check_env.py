"""The device a check runs on: what every figure is labelled with (device, driver, torch, CUDA,
triton), and the small helpers every section uses (free device memory, one-line errors)."""
from __future__ import annotations

import os
import platform
import subprocess
import time
import traceback
from pathlib import Path

import torch


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_line(err: BaseException) -> str:
    """One line for the report: the exception and where it was raised."""
    tb = traceback.extract_tb(err.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}{where}"


def environment(device: str) -> dict:
    """What every figure of the report is labelled with."""
    env = {"device": device, "device_name": "cpu", "driver": None, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": None, "triton": None, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count(),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
        env["driver"] = nvidia_driver()
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def nvidia_driver() -> str | None:
    """The NVIDIA driver version: nvidia-smi's, else the kernel module's (/proc/driver/nvidia/version),
    else None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass  # no nvidia-smi on PATH: the kernel module's version below
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip()


def label(env: dict) -> str:
    """The one-line label every table carries."""
    return (f"{env['device_name']}, driver {env['driver'] or '-'}, torch {env['torch']}, CUDA {env['cuda'] or '-'}, "
            f"triton {env['triton'] or '-'}, Python {env['python']}")
