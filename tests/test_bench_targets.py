"""The CPU targets' verdicts (arfuse.bench.targets, which benchmarks/targets.py reports), from
synthetic `arfuse bench` and oversubscribed reports: the median over runs decides, each run is
counted, a missing row is "not measured"."""

from __future__ import annotations

from typing import Any

from arfuse.bench import targets


def _report(in_place: float, new: float, x_floor: float, ds_us: float = 100.0,
            overhead: float = 0.1, with_ds: bool = True) -> dict[str, Any]:
    rows = [{"dtype": "fp32", "tokens": 64, "backend": "shm-inplace",
             "median_us": in_place * ds_us, "x_floor": x_floor},
            {"dtype": "fp32", "tokens": 64, "backend": "shm", "median_us": new * ds_us,
             "x_floor": x_floor * new / in_place},
            {"dtype": "fp32", "tokens": 64, "backend": "shm-replicated",
             "median_us": (new - 0.1) * ds_us}]
    if with_ds:
        rows.append({"dtype": "fp32", "tokens": 64, "backend": "deepspeed", "median_us": ds_us})
    return {"results": rows, "python_overhead": {"fp32": {"overhead_us": overhead}}}


def _one_core(call_us: float, ratio: float) -> dict[str, Any]:
    return {"rows": [{"placement": "shared", "call_us": call_us, "gloo_over_arfuse": ratio},
                     {"placement": "own", "call_us": 1.0, "gloo_over_arfuse": 9.0}]}


def _by_target(found: list[targets.Verdict]) -> dict[str, targets.Verdict]:
    return {v.target: v for v in found}


def test_the_median_over_runs_decides_and_each_run_is_counted() -> None:
    reports = [_report(0.99, 1.20, 1.9), _report(1.02, 1.08, 2.1), _report(0.98, 1.12, 1.95)]
    found = _by_target(targets.verdicts(reports, _one_core(9.6, 1.65), tokens=(64,),
                                        dtypes=("fp32",)))
    in_place = found["in place x DeepSpeed"]
    assert [round(x, 2) for x in in_place.per_run] == [0.99, 1.02, 0.98]
    assert in_place.met is True and in_place.runs_met == 2
    new = found["new outputs x DeepSpeed"]
    assert round(new.median or 0, 2) == 1.12 and new.met is False and new.runs_met == 1
    replicated = found["new outputs, replicated x DeepSpeed"]
    assert [round(x, 2) for x in replicated.per_run] == [1.10, 0.98, 1.02] and replicated.met
    assert found["in place, replicated x DeepSpeed"].per_run == []  # no such row here
    floor = found["in place x floor"]
    assert floor.met is True and floor.runs_met == 2
    assert found["python overhead us"].met is True
    assert found["one core: 1-token call us"].per_run == [9.6]  # the shared placement only
    assert found["one core: decode step gloo / arfuse"].met is True


def test_limits_hold_at_the_line_and_at_least_targets_point_the_other_way() -> None:
    found = _by_target(targets.verdicts([_report(1.0, 1.1, 2.0)], _one_core(40.5, 1.49),
                                        tokens=(64,), dtypes=("fp32",)))
    assert found["in place x DeepSpeed"].met is True  # at most 1.0: 1.0 meets it
    assert found["new outputs x DeepSpeed"].met is True
    assert found["one core: 1-token call us"].met is False
    assert found["one core: decode step gloo / arfuse"].met is False  # at least 1.5


def test_missing_rows_are_not_measured_and_the_floor_starts_at_64_tokens() -> None:
    found = targets.verdicts([_report(0.9, 1.0, 1.5, with_ds=False)], None, tokens=(8, 64),
                             dtypes=("fp32",))
    by_key = {(v.target, v.tokens): v for v in found}
    assert by_key[("in place x DeepSpeed", 64)].met is None
    assert by_key[("in place x DeepSpeed", 8)].per_run == []  # no row at 8 tokens at all
    assert ("in place x floor", 8) not in by_key and by_key[("in place x floor", 64)].met
    assert by_key[("one core: 1-token call us", 1)].met is None
    text = targets.table(found, {"cpu": "test cpu", "kernel_isa": "scalar"})
    assert "not measured" in text and "test cpu, kernel scalar" in text
