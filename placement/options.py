"""`vela place`'s command-line inputs as `PlacementProblem` fields: a profile file, bandwidths, capacities
and nodes as a user types them. Apart from `placement.io` (files) so that `placement.problem` and the
file readers it uses do not import the problem back."""

from __future__ import annotations

from typing import Any

from placement.io import (
    DEFAULT_HIDDEN_SIZE, DEFAULT_TOKENS_PER_STEP, GB, infer_top_k, load_profile, parse_capacities, parse_numbers,
)
from placement.problem import node_shared_links


def fields_from_options(
    *,
    profile: str,
    bandwidths_gb_s: str,
    capacities: str,
    tokens_per_step: int | None = None,
    hidden_size: int | None = None,
    bits_per_element: int = 16,
    top_k: int | None = None,
    nodes: str | None = None,
    master_node: str | None = None,
    include_backward: bool = True,
    nic_gb_s: float | None = None,
) -> dict[str, Any]:
    """`PlacementProblem` fields from command-line style inputs (`vela place --profile ...`).

    bandwidths_gb_s: comma list or file, GB/s per worker; capacities: one integer
    or a comma list; nodes: comma list of node ids, one per worker. Without
    tokens_per_step or hidden_size the `DEFAULT_*` sizes stand in: every expected
    time and byte count is proportional to tokens x hidden, so the best placement
    is the same for any of them (only the printed numbers are off by the ratio).
    nic_gb_s: every node's NIC bandwidth; master traffic shares them (`node_shared_links`), which
    needs nodes and master_node.
    """
    probs, profile_top_k = load_profile(profile)
    bandwidths = [GB * value for value in parse_numbers(bandwidths_gb_s, "bandwidths")]
    worker_nodes = [node.strip() for node in nodes.split(",")] if nodes else None
    shared_links = []
    if nic_gb_s is not None:
        if worker_nodes is None or master_node is None:
            raise ValueError("--nic needs --nodes and --master-node: which workers share which NIC")
        shared_links = node_shared_links(worker_nodes, master_node, GB * nic_gb_s)
    return dict(
        probs=probs,
        top_k=top_k or profile_top_k or infer_top_k(probs, source=profile),
        tokens_per_step=tokens_per_step or DEFAULT_TOKENS_PER_STEP,
        hidden_size=hidden_size or DEFAULT_HIDDEN_SIZE,
        bits_per_element=bits_per_element,
        bandwidths=bandwidths,
        capacities=parse_capacities(capacities, len(bandwidths)),
        worker_nodes=worker_nodes,
        master_node=master_node,
        include_backward=include_backward,
        shared_links=shared_links,
    )


def assumed_sizes_note(tokens_per_step: int | None, hidden_size: int | None) -> str | None:
    """What `fields_from_options` assumed for sizes left out, as one line for a summary; None if none."""
    assumed = [
        f"{flag} {default}"
        for flag, value, default in (
            ("--tokens", tokens_per_step, DEFAULT_TOKENS_PER_STEP),
            ("--hidden", hidden_size, DEFAULT_HIDDEN_SIZE),
        )
        if value is None
    ]
    if not assumed:
        return None
    return (
        f"note: times and bytes below assume {' and '.join(assumed)} (not given); they scale "
        "with tokens x hidden, the placement does not, so give both for absolute numbers"
    )
