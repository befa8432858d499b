"""Scenarios at the decision level: plans and reuse rules of GPU topologies, pure."""

from __future__ import annotations

from typing import Any

from .language import Scenario, mentions, resolve_path

# --- the decision level --------------------------------------------------------------------------






def _check_error(exc: BaseException | None, expect: dict[str, Any], where: str) -> list[str]:
    wanted = expect.get("error")
    if exc is None:
        return [f"{where}: expected {wanted}, nothing was raised"] if wanted else []
    if not wanted:
        return [f"{where}: raised {type(exc).__name__}: {exc}"]
    problems = []
    names = [c.__name__ for c in type(exc).__mro__]
    if wanted not in names:
        problems.append(f"{where}: raised {type(exc).__name__}, expected {wanted}: {exc}")
    for fragment in expect.get("message", []):
        if not mentions(str(exc), fragment):
            problems.append(f"{where}: message lacks {fragment!r}: {exc}")
    return problems


def _decide(scn: Scenario, case: dict[str, Any], index: int) -> tuple[list[str], str]:
    """One ``[[decide]]`` entry: settings + topology + spec -> Plan, checked field by field."""
    from .. import faults, policy, settings, topology
    from ..spec import Spec

    where = f"decide[{index}]" + (f" ({case['label']})" if "label" in case else "")
    expect = dict(case.get("expect", {}))
    try:
        conf = settings.from_env({k: str(v) for k, v in case.get("settings", {}).items()})
        if "topology" in case:
            topo = topology.Topology.from_dict(case["topology"])
        else:
            topo = topology.load(resolve_path(scn, str(case["topology_file"])),
                                 f"topology_file of {scn.name} {where}")
        spec = Spec(**case.get("spec", {}))
        parsed = faults.parse(case.get("faults"))
        plan = policy.resolve(conf, topo, spec, case.get("blocked"))
    except (ValueError, TypeError, KeyError) as exc:
        return _check_error(exc, expect, where), f"{type(exc).__name__}"
    problems = _check_error(None, expect, where)
    simple = ("backend", "node_count", "max_fused_tokens", "workspace_bytes", "quant_fusion",
              "allow_fallback", "fused", "world_size")
    for key in simple:
        if key in expect and getattr(plan, key) != expect[key]:
            problems.append(f"{where}: {key}={getattr(plan, key)!r}, expected {expect[key]!r}")
    if plan.workspace_bytes < int(expect.get("workspace_bytes_at_least", 0)):
        problems.append(f"{where}: workspace_bytes={plan.workspace_bytes}, expected at least "
                        f"{expect['workspace_bytes_at_least']}")
    if "viable" in expect and list(plan.viable) != list(expect["viable"]):
        problems.append(f"{where}: viable={list(plan.viable)}, expected {expect['viable']}")
    for name, fragment in expect.get("reasons", {}).items():
        reason = plan.candidate(name).reason
        if fragment not in reason:
            problems.append(f"{where}: reason for {name} is {reason!r}, lacks {fragment!r}")
    for fragment in expect.get("warnings", []):
        if not any(fragment in w for w in plan.warnings):
            problems.append(f"{where}: no warning mentions {fragment!r}: {plan.warnings}")
    if "fails_over_to" in expect:
        # negotiation: a rank whose creation fails votes no; every rank drops the candidate
        # and tries the plan's next one, together (R7)
        failing = [r for r in range(topo.world_size)
                   if faults.mode_for(parsed, plan.backend, "create", r) in
                   ("raise", "none", "null", "oom")]
        nxt = plan.viable[1] if len(plan.viable) > 1 else None
        if not failing:
            problems.append(f"{where}: the faults make no rank fail creating {plan.backend}")
        if nxt != expect["fails_over_to"]:
            problems.append(f"{where}: after {plan.backend} fails the group tries {nxt}, "
                            f"expected {expect['fails_over_to']}")
    if "trtllm_mode_chosen_by_arfuse" in expect:
        from ..backends.flashinfer.workspace import trtllm_use_oneshot

        chosen = trtllm_use_oneshot(topo.world_size, spec.max_tokens, spec.hidden,
                                    spec.elem_size)
        if (chosen is not None) != expect["trtllm_mode_chosen_by_arfuse"]:
            problems.append(f"{where}: trtllm mode at world {topo.world_size}: {chosen!r}")
    return problems, f"{plan.backend} (nodes {plan.node_count}, cap {plan.max_fused_tokens})"


def _reuse(case: dict[str, Any], index: int) -> tuple[list[str], str]:
    """One ``[[reuse]]`` entry: does a workspace built for ``have`` serve ``want`` (R4, R5)?"""
    from ..spec import Spec

    have, want = Spec(**case["have"]), Spec(**case["want"])
    covers = have.covers(want)
    where = f"reuse[{index}]" + (f" ({case['label']})" if "label" in case else "")
    if covers != bool(case["reuse"]):
        return [f"{where}: covers={covers}, expected {case['reuse']}"], ""
    return [], f"{'reuse' if covers else 'new workspace'}"


def run_decision(scn: Scenario) -> dict[str, Any]:
    problems: list[str] = []
    facts: list[str] = []
    for i, case in enumerate(scn.data.get("decide", [])):
        p, fact = _decide(scn, case, i)
        problems += p
        facts.append(fact)
    for i, case in enumerate(scn.data.get("reuse", [])):
        p, fact = _reuse(case, i)
        problems += p
        facts.append(fact)
    return {"status": "fail" if problems else "pass", "problems": problems,
            "summary": "; ".join(dict.fromkeys(f for f in facts if f))}
