"""The field's failures (DESIGN 1) replayed as scenarios (``arfuse scenario run FILE|DIR``).

Why: each row of docs/design.md section 1 went wrong in the field in a way one process cannot
show (a rank that hangs, dies, fails alone or sees other memory). A scenario states ranks,
topology, settings, faults, the spec, the calls and the expected outcome in one TOML file; the
runner replays it with real ranks (or, for GPU-only rows, at the decision level) under a hard
limit per scenario, so a hang fails and never blocks.

Three layers: the runner (this process) starts one *job* per scenario in a session of its own
and kills the whole session when the limit is over; the job (a fresh interpreter, in a private
mount namespace when the scenario mounts a tiny tmpfs) forks the ranks, then checks the outcome
and what is left behind; each rank runs the scenario's steps and reports one JSON line per step,
so a rank that dies still leaves what it did. The schema is in ``scenarios/README.md``.

Modules: ``language`` (load a scenario), ``calls`` (inputs, call forms, the check of a result),
``leaks`` (what a process holds), ``decision`` (plans of GPU topologies), ``ranks`` (one rank's
steps), ``job`` (one scenario's ranks and verdict), ``runner`` (jobs under hard limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy
from .language import Scenario, load_scenario, scenario_files
from .runner import Outcome, run_one

if TYPE_CHECKING:
    from .calls import check_result, make_inputs, run_pattern
    from .leaks import LeakBaseline, child_pids, fd_targets, is_segment, mapped_segments

# what a rank uses loads on first use: the runner (``arfuse scenario run``) needs no torch
_IN_RANKS = {**dict.fromkeys(("check_result", "make_inputs", "run_pattern"), "calls"),
             **dict.fromkeys(("LeakBaseline", "child_pids", "fd_targets", "is_segment",
                              "mapped_segments"), "leaks")}


__getattr__ = lazy.attributes(__name__, _IN_RANKS, globals())

__all__ = ["LeakBaseline", "Outcome", "Scenario", "check_result", "child_pids", "fd_targets",
           "is_segment", "load_scenario", "make_inputs", "mapped_segments", "run_one",
           "run_pattern", "scenario_files"]
