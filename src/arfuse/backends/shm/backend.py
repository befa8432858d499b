"""The shm backend: its local checks and the collective creation of a group's workspace (rank 0
makes the segment, every rank opens, reserves and maps it; ``segment`` says how)."""

from __future__ import annotations

import os
import platform
from typing import Any

from ... import log
from ...errors import CreationFailed
from ...spec import Spec
from ..base import Backend, Workspace
from . import build as shm_build
from . import layout_of
from .layout import ShmLayout
from .mapping import map_segment, retire
from .segment import (
    SegmentFile,
    clean_stale_segments,
    create_segment,
    file_id,
    name_segment,
    open_shared,
    pid_namespace,
    process_identity,
    reserve,
    segment_dir,
    segment_label,
)
from .workspace import ShmWorkspace

# Machines whose stores become visible to other cores in program order (x86's TSO), as the
# pure-torch path's flags need: it writes a slot, then the flag, with plain tensor stores.
STORE_ORDERED_MACHINES = ("x86_64", "AMD64", "i386", "i686")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _why_or_none(exc: BaseException | None) -> str:
    return "" if exc is None else _why(exc)


def _discard(workspace: ShmWorkspace | None) -> None:
    """Free a workspace this rank will not keep; never raises (the caller is on its way to
    tell the group why, or to raise the cause)."""
    if workspace is None:
        return
    try:
        workspace.destroy()
    except Exception as exc:
        log.logger.warning("arfuse shm: freeing a failed workspace raised %s: %s",
                           type(exc).__name__, exc)


class ShmBackend(Backend):
    name = "shm"

    def local_check(self, ctx: Any, spec: Spec) -> str:
        directory = segment_dir()
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            return f"{directory} is not a writable directory"
        need = layout_of(ctx.world_size, spec).total_bytes
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < need:
            return (f"{directory} has {free / 1024:.0f} KiB free, the segment needs "
                    f"{need / 1024:.0f} KiB (docker: --shm-size)")
        if shm_build.load() is None and platform.machine() not in STORE_ORDERED_MACHINES:
            # the pure-torch path publishes its flags with plain stores after the data
            return (f"no compiled kernel ({shm_build.why_not()}) and the pure-torch path "
                    f"relies on x86's store order; this CPU is {platform.machine()}")
        return ""

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        """Collective: rank 0 makes the segment, every rank opens it (through rank 0's
        descriptor, so it never has a name; or by a name rank 0 removes once every rank has it
        open), then every rank maps it. A rank that fails still takes part in every exchange
        (its reason in it), so the others are not left waiting; whatever it made is freed
        before it raises."""
        layout = layout_of(ctx.world_size, spec)
        segment = SegmentFile(segment_dir())
        fd, error, mode, label = -1, "", None, segment_label()
        directory: list[int] = []
        if ctx.rank == 0:
            try:
                mode = ctx.fault(self.name, "create")
                clean_stale_segments(segment.directory)
                st = os.stat(segment.directory)
                directory = [st.st_dev, st.st_ino]
                fd, segment.name = create_segment(segment.directory, layout, label)
                segment.file = file_id(fd)
            except (Exception, MemoryError) as exc:
                error = _why(exc)
        try:
            try:
                shared = ctx.all_gather("shm-name", {
                    "label": label, "name": segment.name, "fd": fd, "error": error,
                    "directory": directory, "pidns": pid_namespace(),
                    "creator": list(process_identity())}, self.name)[0]
            except BaseException:  # a silent peer: nobody opens it
                segment.remove_name()
                raise
            if shared["error"]:
                raise CreationFailed(f"rank 0 could not create the segment: {shared['error']}")
            return self._join(ctx, spec, layout, segment, shared, fd, mode)
        finally:
            if fd >= 0:  # rank 0's, whatever happened; the others close their own
                os.close(fd)

    def _join(self, ctx: Any, spec: Spec, layout: ShmLayout, segment: SegmentFile,
              shared: dict[str, Any], fd: int, mode: str | None) -> ShmWorkspace | None:
        """Every rank but 0 opens the segment, then all map it (``fd``: rank 0's)."""
        segment.name = shared["name"]
        failure: BaseException | None = None
        need_name = False
        mine = fd
        try:
            if ctx.rank != 0:
                try:
                    mode = ctx.fault(self.name, "create")
                    if mode != "none":
                        mine = open_shared(segment, shared, layout)
                        need_name = mine < 0
                except (Exception, MemoryError) as exc:
                    failure = exc
            opened = self._exchange(ctx, "shm-opened", {"why": _why_or_none(failure),
                                                        "need_name": need_name}, segment,
                                    opened=True)
            if any(o["need_name"] for o in opened):
                mine, failure = self._open_by_name(ctx, layout, segment, shared, fd, mine,
                                                   need_name, failure)
            workspace = None
            if failure is None and mode != "none":
                try:
                    workspace = self._map(ctx, spec, layout, shared["label"], mine)
                    workspace.publish_identity()
                except (Exception, MemoryError) as exc:
                    _discard(workspace)  # mapped, then failed: it goes now
                    workspace, failure = None, exc
            mapped = self._exchange(ctx, "shm-mapped", {"why": _why_or_none(failure), "kernel": (
                workspace is not None and workspace.kernel is not None)}, segment, workspace)
            if failure is not None:
                try:
                    raise failure
                finally:  # its traceback holds this frame: no reference cycle through it
                    failure = None
        finally:
            if ctx.rank != 0 and mine >= 0:
                os.close(mine)
        if workspace is not None and not all(m["kernel"] for m in mapped if not m["why"]):
            workspace.use_pure_path()  # one protocol for the whole group
        if workspace is not None and mode == "null":
            workspace.poison()
        return workspace

    def _open_by_name(self, ctx: Any, layout: ShmLayout, segment: SegmentFile,
                      shared: dict[str, Any], fd: int, mine: int, need_name: bool,
                      failure: BaseException | None) -> tuple[int, BaseException | None]:
        """Some rank cannot reach rank 0's descriptor: rank 0 names the segment, those ranks
        open it by name. Returns this rank's descriptor and its failure, if any."""
        if ctx.rank == 0:
            try:
                segment.name = name_segment(segment.directory, fd, shared["label"])
            except (Exception, MemoryError) as exc:
                failure = exc
        named = self._exchange(ctx, "shm-named", {"name": segment.name,
                                                  "why": _why_or_none(failure)}, segment)[0]
        if need_name and failure is None:
            try:
                if not named["name"]:
                    raise CreationFailed(f"rank 0 could not name the segment for ranks that "
                                         f"cannot reach its descriptor: {named['why']}")
                segment.name = named["name"]
                mine = open_shared(segment, shared, layout)
            except (Exception, MemoryError) as exc:
                failure = exc
        self._exchange(ctx, "shm-named-opened", _why_or_none(failure), segment, opened=True)
        try:
            return mine, failure
        finally:  # its traceback holds this frame: no reference cycle through it
            failure = None

    def _exchange(self, ctx: Any, phase: str, value: Any, segment: SegmentFile,
                  workspace: ShmWorkspace | None = None, opened: bool = False) -> list[Any]:
        """One exchange of the creation. If it fails (a peer failed or is gone: rank 0 may
        be), nothing of this attempt stays: the workspace is freed and, on any rank that has
        the segment open, its name removed. ``opened``: the exchange after which every rank
        that could open the segment by its name has done so, so rank 0 removes it."""
        try:
            got: list[Any] = ctx.all_gather(phase, value, self.name)
        except BaseException:
            _discard(workspace)
            segment.remove_name()
            raise
        finally:
            if opened and ctx.rank == 0:
                segment.remove_name()
        return got

    @staticmethod
    def _map(ctx: Any, spec: Spec, layout: ShmLayout, name: str, fd: int) -> ShmWorkspace:
        """This rank's part reserved (rank 0 reserved its own at creation), the segment
        mapped; the caller closes ``fd`` (the mapping needs none)."""
        if ctx.rank != 0:
            reserve(fd, layout, ctx.rank)
        st = os.fstat(fd)
        segment = map_segment(fd, layout.total_bytes)
        try:
            return ShmWorkspace(ctx, spec, layout, name, segment,
                                st.st_mode & 0o777 if st.st_uid == os.geteuid() else -1)
        except BaseException:
            retire(segment)  # whatever still holds a view of it reads zeros
            raise
