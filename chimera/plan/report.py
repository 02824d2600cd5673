"""The planner's tables: ranked candidates and the infeasible ones with their reasons."""

from __future__ import annotations

from collections.abc import Sequence

from chimera.plan.candidate import Evaluated, PlanResult


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def ranked_table(rows: Sequence[Evaluated]) -> str:
    """Markdown-style table of ranked candidates (``≈``: the first pass's estimate, not refined)."""
    out = ["| # | schedule | D | W | B | N | step s | samples/s | bubble | peak GiB/worker | partition |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(rows, 1):
        c = e.candidate
        out.append(f"| {i} | {c.label} | {c.stages} | {c.data_parallel} | {c.micro_batch_size} | {c.micro_batches} | "
                   f"{'' if e.exact else '≈'}{e.step_s:.4g} | {e.samples_per_s:.4g} | {e.bubble:.3f} | "
                   f"{_gib(e.peak_memory)} | "
                   f"{','.join(map(str, e.partition or []))} |")
    return "\n".join(out)


def infeasible_table(rows: Sequence[Evaluated], limit: int) -> str:
    """The infeasible candidates (first ``limit``), each with its reason."""
    out = ["| schedule | D | W | B | N | why not |", "|---|---|---|---|---|---|"]
    for e in rows[:limit]:
        c = e.candidate
        out.append(f"| {c.label} | {c.stages} | {c.data_parallel} | {c.micro_batch_size} | {c.micro_batches} | "
                   f"{e.reason} |")
    if len(rows) > limit:
        out.append(f"| ... | | | | | {len(rows) - limit} more |")
    return "\n".join(out)


def report(result: PlanResult, top: int) -> str:
    """Both tables and a line on what was considered."""
    inp = result.inputs
    head = (f"{inp['workers']} workers, global batch {inp['global_batch']}, memory limit "
            f"{_gib(inp.get('memory_limit')) + ' GiB' if inp.get('memory_limit') else 'none'}: "
            f"{len(result.ranked)} feasible, {len(result.infeasible)} infeasible, {result.pruned} pruned by their "
            "lower bound or first estimate" + ("; optimizer state sharded over each stage's replicas (--shard-optimizer)"
                             if inp.get("shard_optimizer") else ""))
    parts = [head, "", ranked_table(result.ranked[:top])]
    if result.infeasible:
        parts += ["", "Infeasible:", infeasible_table(result.infeasible, top)]
    return "\n".join(parts)
