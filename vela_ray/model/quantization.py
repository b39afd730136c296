"""Frozen weights held quantized, dequantized at use: the storage formats, and the one matmul that uses them.

LoRA trains on top of frozen weights, so the frozen weights need not be held at full width: QLoRA keeps them
in NF4, DeepSeek-V3 and Qwen3 ship them in FP8 with 128x128 block scales, gpt-oss its experts in MXFP4. A
quantized matrix here is a few plain tensors (`parts`: integer codes and fp32 or e8m0 scales, every one with
the matrix's leading dims, so an expert stack [E, out, in] slices, stacks, migrates and uploads per expert
like any other expert tensor) and the format that reads them back:

    fmt = FORMATS["nf4"]
    parts = fmt.quantize(w_OI)                 # {"codes": uint8 [O, I/2], "absmax": fp32 [O, I/64]}
    w_OI == fmt.dequantize(parts, torch.float32)  # up to NF4's rounding; exactly the same every time

Every format quantizes a matrix in [out, in] orientation (blocks run along the input, the reduction dim; a
channel scale is per output), whatever layout the model stores it in: a family whose stacks are [E, in, out]
(`is_transposed`) transposes before quantizing and after dequantizing (`ExpertParams` then hold the [out, in]
parts, as gpt-oss's checkpoint does).

    fp8    e4m3 codes, one fp32 scale per 128 x 128 block (DeepSeek-V3's and Qwen3's `weight_scale_inv`)
    int8   symmetric int8 codes, one fp32 scale per output channel
    nf4    QLoRA's NormalFloat4 codes, two per byte, one fp32 absmax per 64 inputs (no double quantization)
    mxfp4  OCP MX FP4 (e2m1) codes, two per byte, one e8m0 exponent per 32 inputs (gpt-oss's `_blocks`/`_scales`)

Use (`frozen_matmul`): the weight is dequantized in the compute dtype for one multiply and dropped, and made
again in backward for d(input) instead of being saved, so a step holds one layer's full-width weight at a time,
never the model's (what bitsandbytes' 4-bit matmul does). Frozen weights get no gradient. Codes are integer
tensors (fp8 codes as their uint8 bytes), so every transport, checkpoint and `.to(device)` moves them as bytes.

Exact: training on quantized weights computes what training on `dequantize(parts)` computes, bit for bit in
fp32 (tests/unit/test_quantization.py against peft on the dequantized model); the quantization itself is the
lossy part, and the job says so (`model.quantization`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

Parts = dict[str, torch.Tensor]

PART_SEPARATOR = ":"
"""A quantized weight's parts in a state or an expert's params: `<weight>:<format>:<part>`, e.g.
`gate_up_proj:nf4:codes` (a module buffer name may not hold dots)."""


@dataclass(frozen=True)
class Format:
    """A storage format of [..., out, in] matrices. Subclasses define `_quantize` and `_dequantize`."""

    name: ClassVar[str]
    parts: ClassVar[tuple[str, ...]]
    block: ClassVar[tuple[int, int]]  # (rows, inputs) one scale covers; 0 rows: a whole output channel
    bits: ClassVar[float]  # code bits per weight, scales excluded

    def unfit(self, shape: tuple[int, ...]) -> str | None:
        """Why a matrix of `shape` ([..., out, in]) cannot be held in this format, None if it can."""
        out_features, in_features = shape[-2:]
        rows, inputs = self.block
        if in_features % inputs or (rows and out_features % rows):
            block = f"{rows} x {inputs}" if rows else f"{inputs} inputs"
            return (f"its [out, in] = [{out_features}, {in_features}] is not a whole number of {self.name}'s "
                    f"{block} blocks")
        return None

    def quantize(self, w_OI: torch.Tensor) -> Parts:
        """`w_OI`'s parts, computed a few rows at a time (`CHUNK_BYTES` of fp32 each): the arithmetic's temporaries
        stay small whatever the matrix, so quantizing as weights are read adds little to a process's peak."""
        why = self.unfit(tuple(w_OI.shape))
        if why:
            raise ValueError(f"cannot quantize a {list(w_OI.shape)} weight to {self.name}: {why}")
        block_rows = self.block[0] or 1
        rows = max(block_rows, CHUNK_BYTES // (4 * w_OI.shape[-1]) // block_rows * block_rows)
        with torch.no_grad():
            if w_OI.dim() != 2 or w_OI.shape[0] <= rows or w_OI.device.type == "meta":
                return self._quantize(w_OI.detach().float())
            parts = {name: torch.empty(shape, dtype=dtype, device=w_OI.device)  # allocated once, filled in place
                     for name, (shape, dtype) in self.part_shapes(tuple(w_OI.shape)).items()}
            done = dict.fromkeys(parts, 0)
            for chunk in w_OI.split(rows):
                for name, piece in self._quantize(chunk.detach().float()).items():
                    parts[name].narrow(0, done[name], piece.shape[0]).copy_(piece)
                    done[name] += piece.shape[0]
            return parts

    def dequantize(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The [..., out, in] matrix `parts` hold, computed in fp32 and then cast to `dtype`."""
        return self._dequantize(parts).to(dtype)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the parts of a [..., out, in] matrix: what a worker holds for it."""
        return sum(math.prod(s) * dtype.itemsize for s, dtype in self.part_shapes(shape).values())

    def part_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each part's shape and dtype for a [..., out, in] matrix (from a quantization of a meta tensor)."""
        parts = self._quantize(torch.empty(shape, device="meta"))
        return {name: (tuple(t.shape), t.dtype) for name, t in parts.items()}

    def _quantize(self, w_OI: torch.Tensor) -> Parts:
        raise NotImplementedError

    def _dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


CHUNK_BYTES = 1 << 20  # fp32 bytes of rows `Format.quantize` works on at a time

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def _blocks(x: torch.Tensor, rows: int, inputs: int) -> torch.Tensor:
    """[..., O, I] as [..., O/rows, rows, I/inputs, inputs]."""
    *lead, out_features, in_features = x.shape
    return x.reshape(*lead, out_features // rows, rows, in_features // inputs, inputs)


@dataclass(frozen=True)
class Fp8Block(Format):
    """DeepSeek-V3's fine-grained FP8: e4m3 codes, `scale_inv` = the block's absmax / 448 (what the weight is
    multiplied by to dequantize, as the checkpoints name it), [ceil(out / 128), ceil(in / 128)]: edge blocks may
    be partial, as in DeepSeek-V3's own (its kv_a_proj_with_mqa is [576, 7168])."""

    name = "fp8"
    parts = ("codes", "scale_inv")
    block = (128, 128)
    bits = 8

    def unfit(self, shape):
        return None

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        rows, inputs = self.block
        return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // inputs))

    def _quantize(self, w_OI):
        out_features, in_features = w_OI.shape[-2:]
        rows, inputs = self.block
        padded = torch.nn.functional.pad(w_OI, (0, -in_features % inputs, 0, -out_features % rows))
        blocks = _blocks(padded, rows, inputs)
        scale = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12) / FP8_MAX
        codes = (blocks / scale).to(FP8).reshape(padded.shape)[..., :out_features, :in_features]
        return {"codes": codes.contiguous().view(torch.uint8), "scale_inv": scale.squeeze(-1).squeeze(-2)}

    def _dequantize(self, parts):
        codes = parts["codes"].view(FP8)
        out_features, in_features = codes.shape[-2:]
        rows, inputs = self.block
        scale = parts["scale_inv"].repeat_interleave(rows, -2)[..., :out_features, :]
        return codes.float() * scale.repeat_interleave(inputs, -1)[..., :in_features]


@dataclass(frozen=True)
class Int8Channel(Format):
    """Symmetric int8, one scale per output channel (absmax / 127)."""

    name = "int8"
    parts = ("codes", "scale")
    block = (0, 1)
    bits = 8

    def _quantize(self, w_OI):
        scale = w_OI.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        return {"codes": torch.round(w_OI / scale).clamp(-127, 127).to(torch.int8), "scale": scale}

    def _dequantize(self, parts):
        return parts["codes"].float() * parts["scale"]


NF4_CODES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)
"""QLoRA's NormalFloat4 (Dettmers et al. 2023, Appendix E): quantiles of N(0, 1) scaled to [-1, 1], with an
exact zero."""

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The OCP MX FP4 (e2m1) values by 4-bit code."""


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, two per byte along the last dim, the first in the low nibble (gpt-oss's order)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each value's nearest entry of `table` (sorted ascending), as its index into `table`."""
    midpoints = (table[1:] + table[:-1]) / 2
    return torch.bucketize(values.contiguous(), midpoints)


@dataclass(frozen=True)
class Nf4(Format):
    """QLoRA's NF4 storage, one fp32 absmax per block of 64 inputs (QLoRA's second quantization of the absmax,
    0.37 bits per weight more saved, is left out)."""

    name = "nf4"
    parts = ("codes", "absmax")
    block = (1, 64)
    bits = 4

    def _quantize(self, w_OI):
        blocks = _blocks(w_OI, *self.block)
        absmax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
        table = torch.tensor(NF4_CODES, device=w_OI.device)
        codes = _nearest(blocks / absmax, table).reshape(w_OI.shape)
        return {"codes": _pack_nibbles(codes), "absmax": absmax.reshape(*w_OI.shape[:-1], -1)}

    def _dequantize(self, parts):
        codes = _unpack_nibbles(parts["codes"])
        values = torch.tensor(NF4_CODES, device=codes.device)[codes]
        return (_blocks(values, *self.block) * parts["absmax"][..., None, :, None]).reshape(values.shape)


@dataclass(frozen=True)
class Mxfp4(Format):
    """OCP MX FP4 as gpt-oss ships its experts: per output row, `blocks` [..., O, I/32, 16] (32 e2m1 codes in
    16 bytes) and `scales` [..., O, I/32] (e8m0: the block's power of two + 127)."""

    name = "mxfp4"
    parts = ("blocks", "scales")
    block = (1, 32)
    bits = 4

    def _quantize(self, w_OI):
        blocks = _blocks(w_OI, *self.block).squeeze(-3)  # [..., O, I/32, 32]
        absmax = blocks.abs().amax(dim=-1, keepdim=True)
        # the scale that puts the block's largest value at or below 6 (e2m1's largest), as OCP's conversion does
        exponent = torch.where(absmax > 0, torch.ceil(torch.log2(absmax.clamp(min=1e-30) / 6)), -127.0)
        exponent = exponent.clamp(-127, 127)
        table = torch.tensor(FP4_E2M1[:8], device=w_OI.device)  # the magnitudes
        scaled = blocks / torch.exp2(exponent)
        codes = _nearest(scaled.abs(), table) | ((scaled < 0).long() << 3)
        return {"blocks": _pack_nibbles(codes), "scales": (exponent.squeeze(-1) + 127).to(torch.uint8)}

    def _dequantize(self, parts):
        codes = _unpack_nibbles(parts["blocks"])  # [..., O, I/32, 32]
        values = torch.tensor(FP4_E2M1, device=codes.device)[codes]
        values = torch.ldexp(values, parts["scales"].long()[..., None] - 127)
        return values.flatten(-2)


FORMATS: dict[str, Format] = {f.name: f for f in (Fp8Block(), Int8Channel(), Nf4(), Mxfp4())}


def part_name(weight: str, fmt: Format, part: str) -> str:
    return PART_SEPARATOR.join((weight, fmt.name, part))


def split_part_name(name: str) -> tuple[str, Format, str] | None:
    """(weight, format, part) of a quantized part's name, None for any other name."""
    pieces = name.split(PART_SEPARATOR)
    if len(pieces) != 3 or pieces[1] not in FORMATS:
        return None
    return pieces[0], FORMATS[pieces[1]], pieces[2]


def quantized_weights(named: Mapping[str, torch.Tensor]) -> dict[str, tuple[Format, Parts]]:
    """{weight: (format, its parts)} of the quantized weights among `named` tensors (an expert's params, a
    module's buffers)."""
    found: dict[str, tuple[Format, Parts]] = {}
    for name, tensor in named.items():
        split = split_part_name(name)
        if split is not None:
            weight, fmt, part = split
            found.setdefault(weight, (fmt, {}))[1][part] = tensor
    return found


def round_trip(weight: torch.Tensor, fmt: Format, transposed: bool = False) -> torch.Tensor:
    """`weight` as `fmt` holds it, dequantized back in its own dtype: what a quantized job computes with. `transposed`:
    the weight is stored [..., in, out] and quantized as its transpose."""
    w_OI = weight.transpose(-2, -1) if transposed else weight
    back = fmt.dequantize(fmt.quantize(w_OI), weight.dtype)
    return back.transpose(-2, -1) if transposed else back


class _FrozenMatmul(torch.autograd.Function):
    """y = x w for a frozen w [K, N] (or [n, K, N] with grouped rows) that `make()` builds; backward makes w again
    for dx = dy w^T rather than keeping it between forward and backward."""

    @staticmethod
    def forward(ctx, x, make, multiply):
        ctx.make, ctx.multiply = make, multiply
        return multiply(x, make())

    @staticmethod
    def backward(ctx, dy):
        return ctx.multiply(dy, ctx.make().transpose(-2, -1)), None, None


def frozen_matmul(x: torch.Tensor, make: Callable[[], torch.Tensor],
                  multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul) -> torch.Tensor:
    """x times the frozen matrix `make()` returns, [K, N] (`multiply` = matmul) or [n, K, N] (`multiply` = a grouped
    multiply over rows sorted by group), which is made in forward and again in backward, never kept: a
    quantized weight's full-width copy lives for one multiply."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return multiply(x, make())
    return _FrozenMatmul.apply(x, make, multiply)


class QuantizedLinear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is held in a `Format`'s parts (buffers named `weight:<format>:<part>`),
    dequantized at each use in `compute_dtype` (`frozen_matmul`); the bias stays as it was. peft wraps it like an
    nn.Linear (it reads `compute_dtype` for the adapters' dtype, as for bitsandbytes' layers)."""

    def __init__(self, linear: torch.nn.Linear, fmt: Format, parts: Parts | None = None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt, self.compute_dtype = fmt, linear.weight.dtype
        parts = fmt.quantize(linear.weight) if parts is None else parts
        for part, tensor in parts.items():
            self.register_buffer(part_name("weight", fmt, part), tensor)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight as it is held, its format's codes (integer): what code reading an nn.Linear's weight for
        its device or shape gets (peft does); its values are `dequantized()`."""
        return self.weight_parts[self.fmt.parts[0]]

    @property
    def weight_parts(self) -> Parts:
        return {part: self._buffers[part_name("weight", self.fmt, part)] for part in self.fmt.parts}

    def dequantized(self) -> torch.Tensor:
        return self.fmt.dequantize(self.weight_parts, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_matmul(x, lambda: self.dequantized().t())
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"
