"""This process's memory cgroup, read from /sys/fs/cgroup (v1 or the unified v2 hierarchy): the
OOM killer's count, which says why a local job died (`launch`), and the memory limit, which says
whether a warm server fits beside the jobs (`warm_jobs`)."""

from pathlib import Path


def memory_file(v1: str, v2: str) -> Path | None:
    """The first readable file of this process's memory cgroup: `v1` in cgroup v1's memory
    controller, else `v2` in the unified hierarchy; None where neither can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidates = [Path(f"/sys/fs/cgroup/memory{path}/{v1}")]
        elif not controllers:  # the unified (v2) hierarchy, alone or beside v1's
            candidates = [Path(f"/sys/fs/cgroup{path}/{v2}"), Path(f"/sys/fs/cgroup/unified{path}/{v2}")]
        else:
            continue
        for file in candidates:
            try:
                file.read_bytes()
                return file
            except OSError:
                continue
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup
    (v1 `memory.oom_control`, v2 `memory.events`); None where that cannot be read."""
    if (file := memory_file("memory.oom_control", "memory.events")) is None:
        return None
    try:
        fields = dict(line.split() for line in file.read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return None
    return int(fields["oom_kill"]) if "oom_kill" in fields else None


def memory_limit() -> int | None:
    """This process's memory cgroup's limit in bytes; None where there is none (or it cannot be read)."""
    if (file := memory_file("memory.limit_in_bytes", "memory.max")) is None:
        return None
    text = file.read_text().strip()
    return None if text == "max" or int(text) >= 1 << 62 else int(text)
