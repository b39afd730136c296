"""The emulated cluster's network: namespaces, shaped cross-node links, unshaped loopback, full cleanup.

Needs root and network namespaces (skipped otherwise); Ray is not started, so it takes seconds.
Its own prefix and subnet keep it apart from a benchmark's cluster running at the same time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deploy.emulated_cluster import (  # noqa: E402
    ClusterSpec, EmulatedCluster, ShapingUnavailable, check_can_shape, our_namespaces,
)

PREFIX = "velatst"


def _can_shape() -> bool:
    try:
        check_can_shape(PREFIX)
        return True
    except ShapingUnavailable:
        return False


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not _can_shape(), reason="needs root and netns + tbf")


@pytest.mark.slow
def test_cross_node_links_run_at_the_shaped_rate_and_loopback_stays_fast():
    spec = ClusterSpec(num_nodes=2, prefix=PREFIX, subnet="10.201.7", cross_mbit=400)
    cluster = EmulatedCluster(spec)
    try:
        cluster.up(start_ray=False)
        links = cluster.probe_links(seconds=1.0)
    finally:
        cluster.down()
    # 400 Mbit/s = 50 MB/s; TCP gets within a few percent of a tbf rate
    assert 0.7 * 50e6 < links["cross_bytes_per_s"] < 1.1 * 50e6
    assert links["intra_bytes_per_s"] > 5 * links["cross_bytes_per_s"]
    assert our_namespaces(PREFIX) == []
    assert PREFIX not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_spec_refuses_a_prefix_that_would_not_fit_interface_names():
    with pytest.raises(ValueError, match="prefix"):
        ClusterSpec(prefix="a-much-too-long-prefix")
