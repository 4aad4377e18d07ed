"""What every benchmark's command line shares: its ``--help`` layout and the line its tables open with
(when, on what machine, and the exact command), so that a kept table says where it was measured and how
to measure it again. Knows nothing of specserve."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its examples keep their lines); each flag's default after its help,
    unless the help already names it or there is none to name (a switch, a value computed later)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or action.default in (None, "", argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser for ``python -m <module>`` whose description is the module's docstring."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.strip(), formatter_class=HelpFormatter)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """The machine in a few words: OS, its cores (and how many this process may use, where the harness
    pinned it to fewer), CPU model, memory, and the GPU when torch (already imported by the benchmark) sees one."""
    total = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    pinned = f", this process on {usable}" if usable < total else ""
    parts = [f"{platform.system()} {platform.machine()}, {total} CPUs ({_cpu_model()}{pinned})"]
    try:
        parts.append(f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    else:
        parts.append("no GPU")
    return ", ".join(parts)


def header(module: str, argv: list[str] | None) -> str:
    """``2026-11-27 17:41 UTC; <machine>; `python -m <module> <argv>```: the first line of a run's tables."""
    args = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python", "-m", module, *map(shlex.quote, args)])
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}; `{command}`"
