"""A readable text summary of a placement, as printed by `vela place`.

    print(format_summary(problem, placement))

One row per worker (node, bandwidth, capacity, experts held, expected bytes
per step, busy share = sum_l E[T_{n,l}] / step time, layers it is the
bottleneck of), one line per shared link (its busy share and bottleneck
layers), then the step's expected communication time against the LP
bound, and the bytes that cross node boundaries when nodes are known.
"""

from __future__ import annotations

from placement.cost import cost_report
from placement.problem import PlacementProblem
from placement.solvers import Placement


def format_summary(problem: PlacementProblem, placement: Placement, lower_bound: float | None = None) -> str:
    """Per-worker table plus totals; `lower_bound` overrides the placement's own (if any)."""
    report = cost_report(problem, placement.as_array())
    nodes = problem.worker_nodes or ["-"] * problem.num_workers
    header = ("worker", "node", "bandwidth", "capacity", "experts", "bytes/step", "busy", "bottleneck of")
    rows = [
        (name, node, f"{bandwidth / 1e9:.3g} GB/s", str(capacity), str(experts),
         _bytes(nbytes), f"{share:.1%}", f"{layers} layers")
        for name, node, bandwidth, capacity, experts, nbytes, share, layers in zip(
            problem.names, nodes, problem.bandwidths, problem.capacities, report.worker_experts,
            report.worker_bytes, report.worker_busy_share, report.bottleneck_layers)
    ]
    lines = _table(header, rows)
    for link in problem.shared_links:
        lines.append(f"shared link {link.name} ({link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
                     f"{len(link.workers)} workers): busy {report.shared_link_busy_share[link.name]:.1%}, "
                     f"bottleneck of {report.shared_link_bottleneck_layers[link.name]} layers")
    bound = lower_bound if lower_bound is not None else placement.lower_bound
    lines.append("")
    lines.append(f"solver: {placement.solver} ({placement.solve_seconds:.2f} s)")
    counts_compute = problem.compute_seconds_per_row is not None and problem.compute_in_objective
    what = "communication + compute" if counts_compute else "communication"
    lines.append(f"expected {what} time per step: {report.step_time * 1e3:.2f} ms"
                 + ("" if problem.include_backward else " (forward only)"))
    if bound:
        lines.append(f"LP lower bound: {bound * 1e3:.2f} ms (gap {report.step_time / bound - 1:+.1%})")
    if report.cross_node_bytes is not None:
        per_node = ", ".join(f"{node}: {_bytes(nbytes)}" for node, nbytes in report.cross_node_bytes_per_node.items())
        lines.append(f"cross-node bytes per step: {_bytes(report.cross_node_bytes)}"
                     + (f" ({per_node})" if per_node else ""))
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in (header, *rows)]


def _bytes(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"
