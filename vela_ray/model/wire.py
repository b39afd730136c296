"""Low-bit wire formats: opt-in, LOSSY compression of what crosses a link (ZO-Offloading §5.4).

Rows between the master and the ExpertManagers (`data_plane.row_format`) and frozen expert weights
uploaded into a tiered worker's device cache (`expert_tiers.upload_format`) may travel in
fewer bits; they are computed on in the receiver's own dtype after `decode`. Formats:

    exact     unchanged (the default: results equal transformers + peft)
    bfloat16  half the bytes of fp32 (a no-op for a bf16 model)
    float8    a quarter: float8 e4m3 with one fp32 scale per row (the row's absolute maximum maps
              to e4m3's largest finite value, 448), packed with it into uint8 [..., D + 4]

A tensor on the wire says its own format (uint8: float8-packed; bf16 where the sender computes in
fp32), so a worker needs no setting: it decodes what it gets and encodes its reply the same way
(`reply_format`). Reply shapes and dtypes thus equal the request's, which the collective data plane
relies on to post its receives before any worker answers.

    wire = encode(rows_RD, "float8")         # uint8 [R, D + 4]: 0.25x the bytes of fp32
    rows_RD = decode(wire, torch.float32)    # per-element error <= 2^-4 of the row's max
"""

from __future__ import annotations

import torch

from vela_ray.model.traffic import RowFormat
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_SCALE_BYTES = 4  # one fp32 scale per row, stored as 4 uint8 after the row's D float8 bytes


def encode(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """`x` [..., D] in `fmt`'s wire form (a fresh tensor unless `fmt` leaves it as is)."""
    if fmt == "exact" or x.dtype == FP8:
        return x
    if fmt == "bfloat16":
        return x.to(torch.bfloat16)
    if fmt == "float8":
        return _encode_float8(x)
    raise ValueError(f"unknown wire format {fmt!r}: use exact, bfloat16 or float8")


def decode(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The `dtype` tensor `wire` stands for (a cast for exact and bfloat16; float8 unpacked and scaled)."""
    if wire.dtype == torch.uint8:
        return _decode_float8(wire, dtype)
    return wire.to(dtype)


def reply_format(request: torch.Tensor, compute_dtype: torch.dtype) -> RowFormat:
    """The format a reply to `request` travels in: the request's own (see the module docstring)."""
    if request.dtype == torch.uint8:
        return "float8"
    if request.dtype == torch.bfloat16 and compute_dtype != torch.bfloat16:
        return "bfloat16"
    return "exact"


def bytes_ratio(fmt: RowFormat, dtype: torch.dtype, width: int) -> float:
    """Wire bytes over `dtype` bytes for rows of `width` values."""
    size = torch.empty((), dtype=dtype).element_size()
    per_row = {"exact": size * width, "bfloat16": 2 * width if size > 2 else size * width,
               "float8": width + _SCALE_BYTES}[fmt]
    return per_row / (size * width)


def _encode_float8(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero row keeps scale 1
    payload = (x32 / scale).to(FP8).view(torch.uint8)
    return torch.cat([payload, scale.contiguous().view(torch.uint8)], dim=-1)


def _decode_float8(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    payload = wire[..., :-_SCALE_BYTES].contiguous().view(FP8)
    scale = wire[..., -_SCALE_BYTES:].contiguous().view(torch.float32)
    return (payload.float() * scale).to(dtype)
