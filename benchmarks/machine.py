"""What every benchmark records about the machine it ran on (results compare only within one run)."""

import platform


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
