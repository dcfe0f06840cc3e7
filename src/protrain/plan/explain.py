"""A plan in words: the knobs, what they cost, why they were chosen, and the runners-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protrain.plan.plan import KNOBS, Plan

if TYPE_CHECKING:
    from protrain.plan.search import PlanProblem

_GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def reasons_for(plan: Plan, problem: PlanProblem) -> list[str]:
    out = []
    fixed = plan.fixed_knobs
    if fixed:
        out.append("fixed by the user: " + ", ".join(f"{k}={v}" for k, v in fixed.items()))
    searched = [k for k in KNOBS if k not in fixed]
    if searched:
        out.append("searched: " + ", ".join(searched))
    budget = plan.gpu_budget_bytes
    out.append(
        f"fastest of the plans that fit {_gib(budget)}: predicted peak "
        f"{_gib(plan.predicted_peak_bytes)} ({_gib(budget - plan.predicted_peak_bytes)} left)"
    )
    if plan.n_persist == plan.n_chunks:
        if problem.hardware.device == "cuda":
            out.append("every chunk stays on the GPU: no parameter traffic, no host optimizer")
        else:  # planned for the CPU: the device is the host, nothing moves
            out.append(
                f"every chunk stays on the device ({problem.hardware.device}): no chunk copies, "
                "no separate host optimizer"
            )
    else:
        nxt = problem.memory.model_states[min(plan.n_persist + 1, plan.n_chunks)]
        more = nxt - problem.memory.model_states[plan.n_persist]
        out.append(
            f"n_persist={plan.n_persist} of {plan.n_chunks} chunks: one more persistent chunk "
            f"needs {_gib(more)} of model states"
        )
    t = plan.time_terms
    if t:
        out.append(
            f"step {plan.predicted_step_s:.3f} s: compute {t['compute']:.3f} s"
            + (
                f" (of which {t['swap_wait']:.3f} s swapped blocks wait for their copies)"
                if t.get("swap_wait")
                else ""
            )  # fmt: skip
            + f", copies "
            f"{t['copy']:.3f} s ({t['copy_exposed']:.3f} s not hidden), device optimizer "
            f"{t['device_optimizer']:.3f} s, host optimizer {t['host_optimizer']:.3f} s "
            f"({t['host_optimizer_exposed']:.3f} s the next forward waits for)"
        )
    if plan.n_checkpoint or plan.n_swap:
        out.append(
            f"activations: {plan.n_swap} blocks swapped, {plan.n_checkpoint} checkpointed, "
            f"{plan.n_blocks - plan.n_swap - plan.n_checkpoint} kept"
        )
    return out


def loss_words(plan: Plan) -> str:
    """The plan's loss in words ("" where the planner does not own the loss)."""
    if not plan.loss_planned:
        return ""
    if plan.chunked_loss_tokens is None:
        return "loss over the whole logits"
    return f"loss in chunks of {plan.chunked_loss_tokens} tokens"


def candidates_table(plan: Plan) -> str:
    loss = any("chunked_loss_tokens" in c for c in plan.candidates)
    rows = [("n_persist", "n_buffer", "n_swap", "n_ckpt", "peak GiB", "step s", "tokens/s")]
    if loss:
        rows[0] += ("loss chunk",)
    for c in plan.candidates:
        row = (
            str(c["n_persist"]),
            str(c["n_buffer"]),
            str(c["n_swap"]),
            str(c["n_checkpoint"]),
            f"{c['predicted_peak_bytes'] / _GIB:.2f}",
            f"{c['predicted_step_s']:.3f}",
            f"{c['predicted_tokens_per_s']:,.0f}",
        )
        if loss:
            row += (str(c.get("chunked_loss_tokens") or "off"),)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def explain(plan: Plan, *, with_candidates: bool = True) -> str:
    lines = [
        f"Plan: n_persist={plan.n_persist}, n_buffer={plan.n_buffer}, n_swap={plan.n_swap}, "
        f"n_checkpoint={plan.n_checkpoint} ({plan.n_chunks} chunks of "
        f"{plan.chunk_size_bytes / (1 << 20):.1f} MiB, {plan.n_blocks} blocks"
        + (f"; {loss_words(plan)}" if plan.loss_planned else "")
        + ")",
        f"  predicted peak {_gib(plan.predicted_peak_bytes)} of {_gib(plan.gpu_budget_bytes)}; "
        f"step {plan.predicted_step_s:.3f} s, {plan.predicted_tokens_per_s:,.0f} tokens/s; "
        f"host memory {_gib(plan.predicted_host_bytes)}",
        "  memory terms: " + ", ".join(f"{k} {_gib(v)}" for k, v in plan.memory_terms.items()),
    ]
    if plan.world_size > 1:  # the figures above are each rank's
        lines.insert(1, f"  per rank, {plan.world_size} ranks, {plan.distributed_mode} mode: every "
                        "rank runs these knobs; tokens/s of one rank")  # fmt: skip
    lines += [f"  - {r}" for r in plan.reasons]
    if with_candidates and plan.candidates:
        lines.append("best candidates:")
        lines += ["  " + row for row in candidates_table(plan).splitlines()]
    return "\n".join(lines)
