"""scripts/gpu_wheels.py (`make gpu-wheels`) offline: the closure it reads from this venv's metadata and the
60 MiB limit on what travels to the GPU node. Nothing is downloaded or built."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

gpu_wheels = load_script("scripts/gpu_wheels.py")
NODE_ENV = gpu_wheels.marker_env("3.12", "manylinux_2_28_x86_64")


def test_transformers_closure_is_pinned_and_stops_at_what_the_node_has():
    pins = gpu_wheels.read_pins()
    members = gpu_wheels.closure(("transformers",), pins, NODE_ENV)
    assert {"transformers", "huggingface-hub", "tokenizers", "safetensors"} <= set(members)
    assert not {"torch", "numpy", "filelock", "fsspec"} & set(members)
    assert all(version == pins[name] for name, version in members.items())
    assert "accelerate" not in members  # only under transformers' [torch] extra, which is dropped


def test_the_roots_need_no_ray_and_ask_the_node_for_its_torch():
    members = gpu_wheels.closure(gpu_wheels.ROOTS, gpu_wheels.read_pins(), NODE_ENV)
    assert {"peft", "accelerate", "pydantic-core", "psutil"} <= set(members)
    assert "typing-extensions" in members  # pydantic's pin needs a newer one than a torch image may have
    assert not {"ray", "cvxpy", "datasets", "matplotlib"} & set(members)
    assert "torch>=1.13.0 (peft)" in gpu_wheels.node_requires(members, NODE_ENV)


def test_an_unpinned_member_fails_naming_it():
    pins = gpu_wheels.read_pins()
    with pytest.raises(gpu_wheels.GpuWheelsError, match=r"^not-a-pinned-package \(required by a root\) is not "
                                                        r"pinned in constraints\.txt$"):
        gpu_wheels.closure(("not-a-pinned-package",), pins, NODE_ENV)
    del pins["regex"]
    with pytest.raises(gpu_wheels.GpuWheelsError, match=r"^regex \(required by transformers\) is not pinned"):
        gpu_wheels.closure(("transformers",), pins, NODE_ENV)


def test_the_node_platform_brings_the_older_manylinux_tags_it_runs():
    tags = gpu_wheels.node_platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and {"manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(tags)
    with pytest.raises(gpu_wheels.GpuWheelsError, match="manylinux_2_Y_ARCH"):
        gpu_wheels.node_platforms("linux_x86_64")


def test_a_folder_over_the_limit_fails_naming_its_size(tmp_path: Path):
    with open(tmp_path / "big-1.0-py3-none-any.whl", "wb") as wheel:
        wheel.truncate(gpu_wheels.LIMIT_BYTES)  # sparse: its apparent size counts, as for du -sb
    (tmp_path / "INSTALL").write_text("")
    assert gpu_wheels.check_size(tmp_path) == gpu_wheels.LIMIT_BYTES
    (tmp_path / "INSTALL").write_text("x")
    with pytest.raises(gpu_wheels.GpuWheelsError, match=rf"holds {gpu_wheels.LIMIT_BYTES + 1} bytes \(60\.0 MiB\), "
                                                         r"over the 60\.0 MiB"):
        gpu_wheels.check_size(tmp_path)
