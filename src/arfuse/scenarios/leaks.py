"""What a process holds of arfuse's (segments mapped, descriptors, threads, children), and the
check that nothing is left after ``destroy_all``."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.hier import backend as hier_backend
from ..backends.shm import cache as shm_cache

NAMED_SEGMENT = re.compile(r"arfuse-\d+-\d+-[0-9a-f]+")
UNNAMED_FILE = re.compile(r"#\d+")  # an O_TMPFILE file, as /proc shows it



def fd_targets() -> dict[int, str]:
    """Open descriptors of this process and what they point to."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def segment_modes() -> list[int]:
    """Permission bits of the segment of every live shm workspace of this process (0o600
    expected; -1: another user's), as each saw its file before it closed the descriptor."""
    from .. import registry
    from ..backends.shm.workspace import ShmWorkspace

    return [ws.segment_mode for ws in registry.REGISTRY.workspaces()
            if isinstance(ws, ShmWorkspace)]


def is_segment(path: str) -> bool:
    """Whether a file /proc shows (a descriptor's target, a mapping's path) is a shm segment:
    named ``arfuse-<pid>-<start>-<hex>``, or unnamed (``#<inode>``) in the segment
    directory."""
    directory, _, name = path.removesuffix(" (deleted)").rpartition("/")
    if NAMED_SEGMENT.fullmatch(name):
        return True
    if not UNNAMED_FILE.fullmatch(name):
        return False
    from ..backends.shm.segment import segment_dir

    return directory == os.path.realpath(segment_dir())


def mapped_segments() -> list[str]:
    with contextlib.suppress(OSError):
        paths = [fields[5] for line in Path("/proc/self/maps").read_text().splitlines()
                 if len(fields := line.split(maxsplit=5)) == 6]
        return [p.removesuffix(" (deleted)") for p in paths if is_segment(p)]
    return []


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def child_pids() -> list[int]:
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/self/task/{task}/children").read_text()
                pids.extend(int(p) for p in text.split())
    return pids


@dataclass
class LeakBaseline:
    """What a process holds before arfuse does anything; compared after ``destroy_all``."""

    fds: dict[int, str] = field(default_factory=fd_targets)
    threads: int = field(default_factory=threading.active_count)
    tasks: int = field(default_factory=task_count)
    children: frozenset[int] = field(default_factory=lambda: frozenset(child_pids()))
    # the OS threads hier's process-lifetime subgroups held then (more may be made later)
    lifetime_tasks: int = field(default_factory=lambda: hier_backend.held_for_the_process()[1])

    def leaks(self) -> list[str]:
        """What is held now and was not before (segments, descriptors, threads, children),
        looked at before any garbage collection: what only a cyclic collection frees stays
        until the collector happens to run, so it is a leak too (and said so)."""
        held = self._held()
        gc.collect()
        after = set(self._held())
        return [what if what in after else f"{what} (until a cyclic garbage collection)"
                for what in held]

    def _held(self) -> list[str]:
        found = []
        maps = mapped_segments()
        if maps:
            found.append(f"segments still mapped: {maps}")
        now = fd_targets()
        # the kernel's binary and hier's subgroups between hosts, kept for the process
        lifetime_fds, lifetime_tasks = hier_backend.held_for_the_process()
        kept = set(shm_cache.held_descriptors()) | lifetime_fds
        extra = {fd: t for fd, t in now.items() if fd not in self.fds and fd not in kept}
        if extra:
            found.append(f"descriptors opened and not closed: {extra}")
        if threading.active_count() > self.threads:
            found.append(f"threads: {threading.active_count()} > {self.threads} before")
        allowed = self.tasks + lifetime_tasks - self.lifetime_tasks
        if task_count() > allowed:
            found.append(f"OS threads: {task_count()} > {allowed} before")
        children = [pid for pid in child_pids() if pid not in self.children]
        if children:
            found.append(f"child processes: {children}")
        return found
