"""The shm backend: numerics on both sides of the one-/two-shot threshold, C++ vs pure-torch,
bit-identical ranks, and its failure modes (killed ranks, leftover segments)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ranks_call_pairing
import ranks_numerics
import ranks_residual
import ranks_shm_lifetime
from harness import run_ranks, values
from numerics_check import check_case, ulps_apart
from reference import PATTERNS, Case


def shm_cases(tokens: int) -> list[Case]:
    out = []
    for dtype in ("bf16", "fp16", "fp32"):
        for hidden in (48, 208):
            for pattern in PATTERNS:
                if pattern.startswith("nvfp4") and dtype == "fp32":
                    continue
                out.append(Case(dtype, tokens, hidden, pattern))
        out.append(Case(dtype, tokens, 37, "norm"))  # odd hidden
        out.append(Case(dtype, tokens, 88, "fp8"))  # bf16: 16-wide steps, one 8-wide, no tail
        out.append(Case(dtype, tokens, 37, "plain"))
        out.append(Case(dtype, tokens, 48, "norm", residual=False))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_shm_numerics(world: int, mode: str) -> None:
    # 9 tokens: uneven two-shot blocks on 2 and 4 ranks; 130 more than one swizzle tile
    cases = [*shm_cases(9), Case("bf16", 130, 48, "nvfp4_swizzled"),
             Case("fp16", 130, 48, "nvfp4_linear"),
             Case("bf16", 100, 1040, "norm"),  # 4 one-shot blocks: copying runs ahead
             # two-shot in several steps (the next step's copy taken between rows or segments)
             Case("fp32", 100, 1040, "plain"), Case("fp16", 100, 1040, "fp8"),
             Case("bf16", 100, 1040, "nvfp4_linear")]
    results = values(run_ranks(ranks_numerics.numerics, world, "shm", cases, 256, mode))
    for case in cases:
        entries = [r[case] for r in results]
        assert all(e["path"] == "c++" for e in entries)
        check_case(case, entries, "shm")
    stats = results[0][Case("stats", 0, 0, "plain")]["stats"]
    assert all(s["fused"] == s["calls"] for s in stats.values())


def test_shm_automatic_threshold_both_sides() -> None:
    """Without forcing: small calls one-shot, large calls two-shot, same results as reference."""
    from arfuse.backends.shm.workspace import ONESHOT_MAX_BYTES

    big = ONESHOT_MAX_BYTES // (1040 * 2) + 3
    cases = [Case("bf16", 1, 1040, "norm"), Case("bf16", big, 1040, "norm"),
             Case("bf16", big, 1040, "plain")]
    results = values(run_ranks(ranks_numerics.numerics, 3, "shm", cases, big, None))
    for case in cases:
        check_case(case, [r[case] for r in results], "shm")
    assert results[0][cases[0]]["mode"] == "oneshot"
    assert results[0][cases[1]]["mode"] == "twoshot"


def test_two_ranks_go_one_shot_again_above_the_ring_size() -> None:
    """At two ranks, calls of more than RING_ONESHOT_ABOVE_BYTES per rank run one-shot (round the
    slot's ring), smaller ones from the second row two-shot; with three ranks, two-shot."""
    from arfuse.backends.shm.workspace import RING_ONESHOT_ABOVE_BYTES

    rows = RING_ONESHOT_ABOVE_BYTES // (1040 * 4)  # fp32: the last row count below it
    exactly = RING_ONESHOT_ABOVE_BYTES // (1024 * 4)
    cases = [Case("fp32", rows, 1040, "norm"), Case("fp32", rows + 1, 1040, "norm"),
             Case("fp32", exactly, 1024, "plain")]
    for world, modes in ((2, ["twoshot", "oneshot", "twoshot"]), (3, ["twoshot"] * 3)):
        results = values(run_ranks(ranks_numerics.numerics, world, "shm", cases, exactly + 1,
                                   None))
        for case in cases:
            check_case(case, [r[case] for r in results], "shm")
        assert [results[0][case]["mode"] for case in cases] == modes


def test_cxx_and_pure_torch_paths_agree() -> None:
    """Documented tolerance (README): residual_out and plain sums bit-equal; out within 1 ulp in
    bf16/fp16 and 8 ulp in fp32; quant codes equal but for a small fraction. The only
    difference is the order in which the sum of squares is added up."""
    cases = [Case(d, 9, h, p) for d in ("bf16", "fp32") for p in ("plain", "norm", "fp8")
             for h in (208, 88, 37)]
    cases.append(Case("bf16", 9, 208, "nvfp4_linear"))
    cxx = values(run_ranks(ranks_numerics.numerics, 2, "shm", cases, 64, None))
    pure = values(run_ranks(ranks_numerics.numerics, 2, "shm", cases, 64, None,
                            env={"ARFUSE_SHM_PURE_TORCH": "1"}))
    assert pure[0][cases[0]]["path"] == "pure-torch" and cxx[0][cases[0]]["path"] == "c++"
    for case in cases:
        a, b = cxx[0][case], pure[0][case]
        if a["residual_out"] is not None:
            assert torch.equal(a["residual_out"], b["residual_out"]), case
        assert ulps_apart(a["out_raw"], b["out_raw"]).max() <= (8 if case.dtype == "fp32" else 1)
        if case.pattern == "plain":
            assert torch.equal(a["out_raw"], b["out_raw"]), case
        if a["quant_out"] is not None:
            differ = (a["quant_out"] != b["quant_out"]).float().mean().item()
            assert differ <= 0.01, f"{case}: {differ:.2%} quant codes differ"



def _kill_mid_call(rank: int, world: int) -> dict[str, object]:
    import signal
    import time

    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=64, dtype=torch.float32,
                                 timeout_s=8)
    name = comm.workspace.name  # type: ignore[attr-defined]
    x = torch.ones(4, 64)
    comm(x)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        comm(x)
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started, "name": name,
                "type": type(exc).__name__, "silent": getattr(exc, "silent", None)}
    return {"error": "", "seconds": time.monotonic() - started, "name": name}


@pytest.mark.parametrize("env", [{}, {"ARFUSE_SHM_PURE_TORCH": "1"}], ids=["kernel", "pure-torch"])
def test_rank_killed_mid_call_others_fail_clearly_and_nothing_is_left(
        env: dict[str, str]) -> None:
    """The kernel's wait and the pure-torch path's alike (one liveness rule, csrc/liveness.h):
    the survivor names the dead rank well before the call's 8 s timeout."""
    results = run_ranks(_kill_mid_call, 2, env=env, timeout=60)
    survivor = results[0]
    assert survivor.ok, survivor.error
    err = survivor.value["error"]
    assert "arfuse shm: rank 1 (pid " in err and ") died during a call" in err, err
    assert survivor.value["seconds"] < 4, survivor.value
    assert survivor.value["type"] == "CallTimeout" and survivor.value["silent"] == (1,), err
    assert results[1].exitcode == -9
    assert not (os.path.exists(f"/dev/shm/{survivor.value['name']}"))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("arfuse-")]


def _normal_exit(rank: int, world: int) -> str:
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=32, dtype=torch.float32)
    comm(torch.ones(1, 32))
    return str(comm.workspace.name)  # type: ignore[attr-defined]


def test_no_segment_outlives_the_job() -> None:
    names = values(run_ranks(_normal_exit, 2))
    assert names[0] == names[1]
    assert not os.path.exists(f"/dev/shm/{names[0]}")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("arfuse-")]


def _segment_file(path: Path, pid: int, start: int, pidns: int | None = None) -> Path:
    """A file with a segment's header naming creator (pid, start)."""
    from arfuse.backends.shm import segment as shm_segment
    from arfuse.backends.shm.layout import SEGMENT_VERSION, SegmentId

    pidns = shm_segment.pid_namespace() if pidns is None else pidns
    path.write_bytes(SegmentId(SEGMENT_VERSION, pid, start, pidns).encode() + bytes(4096))
    return path


DEAD = (999999999, 1)  # above the kernel's pid limit: never a live process


def test_the_sweep_removes_only_segments_whose_header_names_a_dead_creator(
        tmp_path: Path) -> None:
    from arfuse.backends.shm import segment as shm_segment

    me = shm_segment.process_identity()
    dead = _segment_file(tmp_path / "arfuse-999999999-1-deadbeef0000", *DEAD)
    renamed = _segment_file(tmp_path / "arfuse-copy", *DEAD)  # the header counts, not the name
    live = _segment_file(tmp_path / f"arfuse-{me[0]}-{me[1]}-cafe00000000", *me)
    # pids this process cannot judge
    elsewhere = _segment_file(tmp_path / "arfuse-999999999-1-0e0e", *DEAD,
                              pidns=shm_segment.pid_namespace() + 1)
    outside = _segment_file(tmp_path.parent / f"{tmp_path.name}-outside", *DEAD)
    (tmp_path / "arfuse-999999999-1-5e5e").symlink_to(outside)
    os.mkfifo(tmp_path / "arfuse-999999999-1-f1f0")
    (tmp_path / "arfuse-999999999-1-d1d1").mkdir()
    (tmp_path / "arfuse-1-1-notes.txt").write_text("a user's notes")
    (tmp_path / "arfuse-2024-12-report.csv").write_text("a,b\n")
    (tmp_path / "arfuse-999999999-1-short").write_bytes(b"x")
    before = set(os.listdir(tmp_path))
    removed = shm_segment.clean_stale_segments(tmp_path)
    assert sorted(removed) == sorted([dead.name, renamed.name])
    assert set(os.listdir(tmp_path)) == before - set(removed)
    assert live.exists() and elsewhere.exists() and outside.exists()
    outside.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_the_sweep_leaves_another_users_segment(tmp_path: Path) -> None:
    from arfuse.backends.shm import segment as shm_segment

    theirs = _segment_file(tmp_path / "arfuse-999999999-1-0be0", *DEAD)
    os.chown(theirs, 65534, 65534)
    assert shm_segment.clean_stale_segments(tmp_path) == [] and theirs.exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_shm_dir_variable_means_unset(monkeypatch: pytest.MonkeyPatch, value: str,
                                              tmp_path: Path) -> None:
    from arfuse.backends.shm import segment as shm_segment

    monkeypatch.setenv("ARFUSE_SHM_DIR", str(tmp_path))
    assert shm_segment.segment_dir() == tmp_path  # read at each use
    monkeypatch.setenv("ARFUSE_SHM_DIR", value)
    assert shm_segment.segment_dir() == Path("/dev/shm")


def test_user_files_in_the_working_directory_survive_an_empty_shm_dir(tmp_path: Path) -> None:
    """ARFUSE_SHM_DIR= (set, empty) once meant the working directory: segments were made
    there and the sweep deleted files merely named like them."""
    for name in ("arfuse-1-1-notes.txt", "arfuse-2024-12-report.csv", "arfuse-3-4-x"):
        (tmp_path / name).write_text("the user's")
    listings = values(run_ranks(ranks_shm_lifetime.create_with_user_files_in_the_working_directory,
                                2, str(tmp_path), env={"ARFUSE_SHM_DIR": ""}))
    expected = ["arfuse-1-1-notes.txt", "arfuse-2024-12-report.csv", "arfuse-3-4-x"]
    assert listings == [expected, expected]
    assert all((tmp_path / name).read_text() == "the user's" for name in expected)


@pytest.mark.parametrize("pure", [False, True])
def test_a_slot_view_outlives_close_reading_zeros_and_frees_with_its_last_view(
        pure: bool) -> None:
    """close() while the caller still holds a view from input_buffer(): the view stays
    readable and writable (it reads zeros: the segment's pages were replaced by this
    process's own), the segment itself is let go at once, and the addresses are freed when
    the last view goes (reference counts alone, no garbage collection)."""
    env = {"ARFUSE_SHM_PURE_TORCH": "1"} if pure else {}
    results = run_ranks(ranks_shm_lifetime.slot_view_after_close, 2, env=env, timeout=90)
    assert [r.exitcode for r in results] == [0, 0], results  # was -11 (SIGSEGV) on both
    for report in values(results):
        assert report["path"] == ("pure-torch" if pure else "c++")
        assert report["out"] == 4 * 64 * 3 and not report["out_in_segment"]
        assert report["read_after_close"] == 0
        assert report["written_after_close"] == 4 * 64 * 5
        assert report["held_after_close"] == {"fds": [], "maps": []}
        assert report["mapped_while_viewed"] == report["segment_bytes"]
        # the allocator may reuse some of the freed addresses, never all of them at once
        assert report["mapped_after_last_view"] < report["segment_bytes"] // 2, report


@pytest.mark.parametrize(("phase", "fails"), [("shm-name", "exchange"),
                                              ("shm-opened", "exchange"),
                                              ("shm-mapped", "exchange"),
                                              ("shm-mapped", "cleanup")])
def test_a_peer_failing_creation_leaves_the_others_no_descriptor_mapping_or_file(
        tmp_path: Path, phase: str, fails: str) -> None:
    """Rank 1 fails at a step of the shm creation (announcing it, so the others stop waiting
    there with PeerAborted; or after mapping, and then freeing raises too): right after the
    failed attempt, without a garbage collection, the healthy ranks hold no descriptor and no
    mapping of the segment, and nothing is left in the directory. A failure while freeing
    does not keep the failing rank from giving its reason in the exchange."""
    env = {"ARFUSE_SHM_DIR": str(tmp_path), "ARFUSE_TIMEOUT_S": "20"}
    results = values(run_ranks(ranks_shm_lifetime.peer_fails_in_shm_exchange, 3, phase,
                               str(tmp_path), fails, env=env, timeout=90))
    for rank in (0, 2):
        report = results[rank]
        assert report["backend"] == "torch", report
        assert report["held"] == {"fds": [], "maps": []}, report
        assert report["left"] == [], report
        assert "rank 1: MemoryError" in report["attempts"][0], report
    if fails == "cleanup":  # the healthy ranks answered, only rank 1 failed
        assert "rank 0" not in results[0]["attempts"][0], results[0]


@pytest.mark.parametrize(("named", "point", "left"), [
    ("never", "shm-name", 0), ("never", "shm-opened", 0), ("never", "shm-mapped", 0),
    ("for a peer", "named", 1), ("for a peer", "shm-named-opened", 0),
    ("from the start", "shm-name", 1), ("from the start", "shm-opened", 0)])
def test_what_a_creator_killed_during_creation_leaves(tmp_path: Path, named: str, point: str,
                                                      left: int) -> None:
    """SIGKILL of rank 0 inside creation. A segment that never has a name cannot remain. One
    that has a name (for a peer in another pid namespace, or on a filesystem without unnamed
    files) remains only while the name exists and not every rank has it open; then the next
    creation's sweep (or arfuse doctor) removes it. Once every rank has it open, a surviving
    rank removes the name itself."""
    from arfuse.backends.shm import segment as shm_segment

    env = {"ARFUSE_SHM_DIR": str(tmp_path), "ARFUSE_TIMEOUT_S": "10"}
    results = run_ranks(ranks_shm_lifetime.creator_killed_at, 2, point, named, env=env, timeout=90)
    assert results[0].exitcode == -9, results
    assert results[1].ok and results[1].value != "created", results
    remaining = sorted(os.listdir(tmp_path))
    assert len(remaining) == left, remaining
    assert shm_segment.clean_stale_segments(tmp_path) == remaining
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("named", ["never", "for a peer", "from the start"])
def test_every_way_of_opening_the_segment_works_and_leaves_no_name(tmp_path: Path,
                                                                   named: str) -> None:
    env = {"ARFUSE_SHM_DIR": str(tmp_path)}
    for report in values(run_ranks(ranks_shm_lifetime.shm_segment_named, 2, named, env=env)):
        assert report == {"out": 2 * 64 * 2, "left": []}, report


def test_no_segment_left_when_a_peer_never_answers_creation(tmp_path) -> None:
    """Rank 0 made the segment, then timed out waiting for a peer that never took part: the
    segment goes with the error (it stayed while the creator lived)."""
    env = {"ARFUSE_SHM_DIR": str(tmp_path)}
    got = values(run_ranks(ranks_shm_lifetime.shm_create_with_a_silent_peer, 2, str(tmp_path),
                           env=env, timeout=60))[0]
    assert got == "NegotiationTimeout; left: []", got


@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_hung_rank_in_a_call_times_out_naming_it(mode: str) -> None:
    env = {"ARFUSE_FAULTS": "shm.call@1=hang", "ARFUSE_TIMEOUT_S": "2"}
    results = run_ranks(ranks_call_pairing.call_then_report, 2, mode, env=env, timeout=60, expect=1)
    survivor = results[0].value
    assert survivor is not None and survivor["backend"] == "shm", results
    assert "timed out" in survivor["error"] and "rank(s) 1" in survivor["error"], survivor
    assert survivor["error"].startswith("CallTimeout: "), survivor
    assert "phase 'call'" in survivor["error"] and "backend shm" in survivor["error"]
    assert "timed out after 2" in survivor["error"], survivor


@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_input_written_into_the_shared_slot(mode: str) -> None:
    for result in values(run_ranks(ranks_numerics.zero_copy, 2, mode)):
        assert all(result["same"]), result
        assert result["stats"]["unfused_over_capacity"] == 1


@pytest.mark.parametrize(("world", "mode"), [(2, None), (3, "twoshot")])
def test_copy_modes_give_the_same_results_and_ranks_agree_on_the_mode(
        world: int, mode: str | None) -> None:
    reports = values(run_ranks(ranks_numerics.copy_modes, world, mode))
    for report in reports:
        assert report["same"] and all(report["same"])
    for dtype, modes in reports[0]["modes"].items():
        assert all(r["modes"][dtype] == modes for r in reports), "ranks chose differently"
        decided = [m for m in modes.values() if "undecided" not in m]
        assert len(decided) == 1 and decided[0] in ("cached", "streaming"), modes
        assert sum("undecided" in m for m in modes.values()) == 1, modes


@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_and_two_shot_agree_bit_for_bit_with_special_values(world: int) -> None:
    for differ in values(run_ranks(ranks_numerics.one_vs_two_shot, world)):
        assert differ == [], differ


@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_input_going_round_the_slot_ring_gives_two_shot_bits(world: int) -> None:
    reports = values(run_ranks(ranks_numerics.ring, world))
    # blocks of 15 rows: 300 tokens 20, 121 tokens 9, 120 tokens 8; rank 0 wrote its 300-token
    # input into its slot itself; the rings: rank 0 3 blocks, rank 1 8, rank 2 none
    expected = [[3, 0, 0, 3, 3, 0, 3], [8, 0, 8, 8, 0, 8, 8], [0] * 7]
    for rank, report in enumerate(reports):
        assert report["differ"] == [], (rank, report)
        assert report["ring"] == expected[rank], (rank, report)


def _sleepy_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 enters a call half a second after rank 0: rank 0 must sleep on the flag (futex),
    not burn its core; afterwards no rank counts itself as asleep on any flag."""
    import time

    import arfuse
    from arfuse.backends.shm.layout import (
        ARRIVE_OFFSET,
        CACHE_LINE,
        DONE_OFFSET,
        MAX_WORLD,
        WAITERS_OFFSET,
    )

    comm = arfuse.FusedAllReduce(max_token_num=8, hidden_dim=64, dtype=torch.float32,
                                 backend="shm", strict=True, timeout_s=30)
    x = torch.ones(1, 64)
    comm(x)
    report: dict[str, Any] = {}
    for tokens in (1, 8):  # one-shot, then two-shot (arrival and done flags)
        if rank == 1:
            time.sleep(0.5)
        cpu, wall = time.process_time(), time.monotonic()
        out = comm(torch.ones(tokens, 64)).out
        report[tokens] = {"cpu": time.process_time() - cpu, "wall": time.monotonic() - wall,
                          "ok": bool(torch.all(out == world))}
    comm(x)
    torch.distributed.barrier()  # every rank is out of its calls
    view = comm.workspace._view_or_private()  # type: ignore[attr-defined]
    waiters = [int(view[base + CACHE_LINE * r + WAITERS_OFFSET:
                        base + CACHE_LINE * r + WAITERS_OFFSET + 4].view(torch.int32))
               for base in (ARRIVE_OFFSET, DONE_OFFSET) for r in range(MAX_WORLD)]
    report["waiters"] = waiters
    comm.close()
    return report


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning() -> None:
    results = values(run_ranks(_sleepy_peer, 2))
    for tokens in (1, 8):
        early = results[0][tokens]
        assert early["ok"] and results[1][tokens]["ok"]
        assert early["wall"] > 0.4, early  # it did wait for the peer
        assert early["cpu"] < 0.15, f"rank 0 burnt {early['cpu']:.3f}s of CPU waiting"
    for r in results:
        assert r["waiters"] == [0] * len(r["waiters"]), r["waiters"]


def _one_core(rank: int, world: int, calls: int) -> dict[str, Any]:
    import time

    import arfuse

    os.sched_setaffinity(0, {0})  # both ranks on core 0: they take turns
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=4096, dtype=torch.bfloat16,
                                 backend="shm", strict=True, timeout_s=30)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, 4096, generator=gen).to(torch.bfloat16)
    weight = torch.ones(4096, dtype=torch.bfloat16)
    expected = comm(x, residual=residual, weight=weight)
    started = time.monotonic()
    same = all(torch.equal(comm(x, residual=residual, weight=weight).out, expected.out)
               for _ in range(calls))
    seconds = time.monotonic() - started
    comm.close()
    return {"same": same, "per_call_s": seconds / calls}


def test_ranks_sharing_one_core_take_turns_quickly() -> None:
    """Two ranks pinned to one core: each waiting rank sleeps at once (its peer last ran on its
    CPU), so the peer runs; a call costs microseconds, not a scheduler time slice."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    results = values(run_ranks(_one_core, 2, 500, timeout=120))
    for r in results:
        assert r["same"]
        assert r["per_call_s"] < 2e-3, r  # was ~0.05-0.12 ms spinning; a slice is ~3 ms


def test_workspace_released_during_an_operator_call() -> None:
    """The Python side lets go of the kernel while a torch operator call is waiting for a
    peer: the call's own reference is the last, and it is released on a thread without the
    GIL (the process used to abort in ~ShmComm)."""
    results = run_ranks(ranks_shm_lifetime.release_during_operator_call, 2, timeout=60)
    assert [r.exitcode for r in results] == [0, 0], [(r.exitcode, r.error[-400:]) for r in results]
    rank0, rank1 = values(results)
    assert rank0 == {"out": 3.0, "released": True} and rank1["out"] == 3.0, (rank0, rank1)


@pytest.mark.parametrize("pure", [False, True])
def test_calls_from_two_threads_run_one_at_a_time(pure: bool) -> None:
    """A workspace runs one call at a time (the kernel's call mutex; a lock on the pure-torch
    path): calls from two threads of one rank pair up whole with the other rank's calls, in
    the order each rank made them, instead of mixing two calls' rows in one output."""
    env = {"ARFUSE_SHM_PURE_TORCH": "1"} if pure else {}
    results = values(run_ranks(ranks_call_pairing.calls_from_two_threads, 2, 8, 300, env=env,
                               timeout=150))
    assert results[0]["path"] == ("pure-torch" if pure else "c++")
    sums = {1.0 + 2.0, 1.0 + 200.0, 100.0 + 2.0, 100.0 + 200.0}
    for rank, result in enumerate(results):
        assert result["errors"] == [], (rank, result["errors"])
        for tag, outputs in result["seen"].items():
            assert len(outputs) == 300, (rank, tag)
            for values_of_one_call in outputs:
                assert len(values_of_one_call) == 1 and values_of_one_call[0] in sums, (
                    rank, tag, values_of_one_call)
    # each rank-1 call was paired with exactly one rank-0 call: the same multiset of sums
    rank0 = sorted(v[0] for o in results[0]["seen"].values() for v in o)
    rank1 = sorted(v[0] for o in results[1]["seen"].values() for v in o)
    assert rank0 == rank1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_replicated_residual_is_a_promise_two_shot_relies_on(world: int,
                                                             in_place: bool) -> None:
    """Without the promise every rank adds its own residual to every row (README: "Each rank
    adds its own residual"). With it, two-shot finishes the rows another rank reduced from
    that rank's residual_out, so residuals that differ show through: rank r's rows of owner
    j carry residual j + 1. One-shot reads every rank's own residual either way."""
    tokens = 10
    chunk = -(-tokens // world)
    for replicated, mode in ((False, "twoshot"), (True, "twoshot"), (True, "oneshot")):
        results = values(run_ranks(ranks_residual.residual_per_rank, world, replicated, mode,
                                   in_place))
        for rank, got in enumerate(results):
            assert got["uniform"] and got["path"] == "c++", got
            if replicated and mode == "twoshot":
                want = [world + 1.0 + row // chunk for row in range(tokens)]
            else:
                want = [world + 1.0 + rank] * tokens
            assert got["residual_out"] == want, (replicated, mode, rank, got)


def test_ranks_that_disagree_on_the_replicated_residual_fail_to_negotiate() -> None:
    for message in values(run_ranks(ranks_residual.replicated_residual_disagreement, 2)):
        assert "ARFUSE_REPLICATED_RESIDUAL" in message and "replicated_residual" in message, \
            message


@pytest.mark.parametrize(("same", "change"), [(True, "none"), (False, "one"),
                                            (False, "cancelling"), (False, "swapped")])
def test_replicated_residual_check_compares_the_ranks_residuals_every_call(
        same: bool, change: str) -> None:
    """"check": the promise, verified across ranks before each call; residuals that differ
    are a ValueError on every rank, and the group stays in step for the next call. Changes
    that a sum of the values (weighted by position or not) cannot see are caught too."""
    results = values(run_ranks(ranks_residual.residual_check, 2, same, 10, 1040, change))
    world = 2
    for got in results:
        assert got["promised"] and got["after"] == float(sum(range(1, world + 1)))
        if same:
            assert "error" not in got, got
            assert torch.equal(got["residual_out"], results[0]["residual_out"])
        else:
            assert "ranks [1] differ from rank 0" in got["error"], got
            assert "replicated_residual='check'" in got["error"]
        assert got["stats"]["calls"] == (2 if same else 1)


@pytest.mark.parametrize("change", ["one", "cancelling", "swapped"])
def test_residual_digest_sees_every_change_of_the_bytes(change: str) -> None:
    from arfuse.ops import residual_digest

    residual = torch.randn(10, 1040, generator=torch.Generator().manual_seed(5)).bfloat16()
    changed = residual.clone()
    ranks_residual.change_residual(changed, change)
    assert not torch.equal(changed, residual)
    assert not torch.equal(residual_digest(changed), residual_digest(residual))
    assert torch.equal(residual_digest(residual.clone()), residual_digest(residual))


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_replicated_residual_check_when_only_some_ranks_pass_a_residual(backend: str) -> None:
    """"check" with a residual on rank 0 only: MismatchedCall on every rank (R11), at once,
    and the next matching call goes ahead (this used to pair the check's all_gather on one
    rank with the backend's collective on the other: a crash or a hang past the timeout)."""
    results = values(run_ranks(ranks_residual.residual_check_presence, 2, backend, False,
                               timeout=60))
    for got in results:
        assert got["error"].startswith("MismatchedCall: arfuse: ranks [0] passed a residual "
                                       "and ranks [1] did not"), got
        assert got["after"] == 3.0, got  # in step: no timeout, the next call sums


def test_replicated_residual_check_keeps_the_deadline() -> None:
    """A peer that never calls: the check's exchange times out within the op's timeout,
    naming the silent rank, and the op refuses later calls (the group is out of step)."""
    results = run_ranks(ranks_residual.residual_check_presence, 2, "shm", True, timeout=60)
    got = values(results)[0]
    assert got["error"].startswith("CallTimeout") and "residual-check" in got["error"], got
    assert "rank(s) 1" in got["error"], got  # our deadline, not the process group's
    assert str(got["after"]).startswith("WorkspaceBroken"), got


def test_replicated_residual_keyword_is_checked() -> None:
    import arfuse

    with pytest.raises(ValueError, match="replicated_residual='maybe' is not valid"):
        arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64, replicated_residual="maybe")
    with pytest.raises(TypeError, match="replicated_residual must be a bool or 'check'"):
        arfuse.FusedAllReduce(max_token_num=4, hidden_dim=64,
                              replicated_residual=1)  # type: ignore[arg-type]



def test_the_torch_operator_refuses_a_workspace_whose_op_checks_the_residual() -> None:
    """The residual check across ranks is the op's: the torch operator, which skips it, refuses
    the handle of a "check" op on every rank (instead of finishing rows with another rank's
    residual, silently), and the group stays in step for the op's next call."""
    for got in values(run_ranks(ranks_residual.residual_check_through_the_operator, 2,
                                timeout=60)):
        if got["path"] != "c++":
            pytest.skip("no compiled kernel here")
        assert "replicated_residual='check'" in got.get("error", ""), got
        assert "call the op" in got["error"], got
        assert got["after"] == 4.0, got  # 1 + 2 + the residual 1
