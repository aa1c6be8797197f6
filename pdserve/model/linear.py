"""The layer projections' fast paths on CPU (bf16 activations), behind one call: `packed(x) == x @ W.T`.

- `Bf16DotLinear`: pdserve's kernel (`csrc/linear_bf16.cpp`): W packed into 32-column panels of k
  pairs for AVX-512 BF16 dot products, 12-row register tiles, W prefetched 8 KB ahead, rows in blocks
  that stay in L2. Fastest at decode-sized row counts where a step streams W from DRAM; it does no AMX,
  so from a few dozen rows on an AMX host oneDNN is several times faster. A row's result does not
  depend on the other rows (fixed fp32 accumulation order): the only batch-invariant kernel here.
- `AmxLinear` ("amx"): pdserve's AMX kernel (`linear_amx`, same file), on CPUs with AMX BF16: the
  same panels read as AMX B tiles (a panel's 16 k pairs x 16 columns at a 128-byte stride are a B tile
  as they lie; x's rows are the A tiles), 2 x 2 tiles per step (32 rows x 32 columns). Work items run
  panel-major, each thread on its own panels, and while a panel's tiles run the thread prefetches its
  next panel into L2, so weights stream from DRAM under the tile compute (oneDNN does not prefetch: on
  a step whose attention evicted the L3 it pays its weight reads on top, `benchmarks/linear_cache_state.py`).
  Row-independent too (the tile unit's fixed k order), but not bitwise equal to the AVX-512 kernel
  (the tile unit adds a k pair's two products in the other order). It shares the AVX-512 kernel's
  packed copy where both win buckets (`_pack_once`). Needs K % 32 == 0.
- `OneDnnLinear`: oneDNN's blocked layout via torch's mkldnn ops (bit-identical to `F.linear`); on CPUs
  with AMX it runs AMX tiles (`ONEDNN_VERBOSE=1` shows `brg_matmul:avx512_core_amx`). Its blocking, and
  so a row's rounding, changes with the row count.
- `TorchLinear`: plain `F.linear` on the unpacked weight (no extra memory).
- `Fp32Linear` ("fp32"): a float32 copy of W and `F.linear` in float32 (oneDNN/MKL's sgemm), the output
  rounded to bf16: the same math as a bf16 GEMM (bf16 products are exact in fp32, sums in fp32), on the
  fp32 units. For CPUs without native bf16 (no AVX-512 BF16, no AMX: AMD Zen 2/3, older Xeons), where
  oneDNN has no bf16 matmul at all and torch's bf16 GEMM runs at a few GFLOP/s, it is the compute-bound
  kernel; it costs twice the bf16 weights' memory where it wins a bucket.

`Bf16DotLinear` has a second build path for those CPUs (AVX2 + FMA: the same panels widened to fp32 in
registers), so decode-sized row counts still stream bf16 weights.

With 8-bit weights (`--weight-dtype int8`: `Int8Weight`, W ~ scale[n] * Q[n, :], symmetric per output
channel, half the bytes a decode step streams) the same three names mean:

- `Int8DotLinear` ("pdserve"): `csrc/linear_int8.cpp`, the bf16 kernel's layout at one byte per weight,
  widened to bf16 in registers as it streams (one row tile) or once per panel into L2 (several);
  row-independent like its bf16 sibling. Its AVX2 + FMA build (no AVX-512 BF16) runs the AVX2 bf16
  kernel's fp32 tiles (`csrc/linear_avx2.h`) on int8 panels, scaling the fp32 sums per column.
- `Int8AmxLinear` ("amx"): on CPUs with AMX BF16, the same int8 panels and scales (one copy for both)
  on pdserve's AMX kernel (`csrc/linear_amx.h`): each panel widened to bf16 once per call into L2 (exact),
  its tiles run as for bf16 weights, the fp32 sums scaled per column. Prompt chunks and large decode
  batches then run at the bf16 AMX rate while the weights stream at one byte each; row-independent.
- `AtenInt8Linear` ("torch"): ATen's `_weight_int8pack_mm` (bf16 x int8, per-channel bf16 scales),
  on Q itself (no copy). It needs K % 16 == 0 (it crashes otherwise: checked before packing).
- `DequantOneDnnLinear` ("onednn"): each call widens Q to bf16 (exact) and runs `F.linear` (oneDNN, AMX
  where present), scaling the output: for prompt-sized row counts, where the GEMM is compute-bound and
  one widening of W is cheap next to it.

With `--weight-dtype w8a8` (the same `Int8Weight`s; vLLM's name) the kernels may also quantize the
activations, dynamically per token (symmetric, one fp32 scale per row: `quantize_rows`), and multiply
int8 x int8 with int32 sums, rescaled once by row scale x channel scale: compute-bound row counts then run
on AMX-INT8 / VNNI at twice the bf16 rate. The candidates are the int8 ones above plus

- `OneDnnW8A8Linear` ("onednn-a8"): oneDNN's int8 GEMM (`onednn.qlinear_pointwise` on a
  `qlinear_prepack`ed Q, AMX-INT8 where present) with an activation scale of 1 and fp32 output, which the
  per-row scales then multiply (oneDNN's quantized linear takes one activation scale per tensor); a
  candidate only where a probe finds it off its reference loop (`onednn_int8_usable`).
- `IntMmW8A8Linear` ("torch-a8"): `torch._int_mm` (int8 x int8 -> int32) on Q^T, rescaled in fp32.

so a w8a8 row bucket picks an int8 x int8 kernel only where it measures faster than the weight-only ones.
`--linear-kernel onednn|torch` with w8a8 names the "-a8" kernel; "pdserve" stays weight-only. Both are
row-independent (a row's quantization is its own, int32 sums are exact in any order), so
`--batch-invariant` may pin one.

`pack_cpu_linears` packs a model's projections: a named kernel for every row count, or ("auto") the
kernel measured fastest per row bucket on this host (`autotune.py`; cached on disk), dispatched by
`BucketedLinear` with one bisect on the row count. Each kernel that wins a bucket holds its own copy of
the weights (plain `F.linear` runs from the layer's tensor itself); the model then frees the layer's
copies no kernel runs from (`LlamaModel.prepack_for_cpu`; with int8, `quantize_linears` frees the float
ones).

"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.model import autotune
from pdserve.config import WEIGHT_DTYPES  # noqa: F401  (re-exported; auto = bfloat16, the model's dtype)
from pdserve.model.autotune import ROW_BUCKETS, TuneTable

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "linear_bf16.cpp")
_SOURCE_INT8 = os.path.join(os.path.dirname(__file__), "csrc", "linear_int8.cpp")
# included by both kernels' sources
_HEADERS = tuple(
    os.path.join(os.path.dirname(__file__), "csrc", h) for h in ("linear_common.h", "linear_avx2.h", "linear_amx.h")
)

PackedLinear = Callable[[torch.Tensor], torch.Tensor]
LINEAR_KINDS = ("auto", "pdserve", "amx", "onednn", "fp32", "torch")
# Kernels whose rows do not depend on the batch (tests/model/test_linear*.py): pdserve's two (fixed fp32
# order) and the int8 x int8 ones (a row's quantization is its own and int32 sums are exact in any order).
ROW_INDEPENDENT = ("pdserve", "amx", "onednn-a8", "torch-a8")


def _build(name: str, source: str, needs: str) -> Any:
    from pdserve.extensions import load_extension

    ext = load_extension(
        name,
        [source],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],  # -fopenmp: at::parallel_for (see cpu_paged.py)
        extra_ldflags=["-fopenmp"],
    )
    if not ext.available():
        raise RuntimeError(f"this CPU/compiler has no {needs}")
    return ext


@functools.cache
def _kernel() -> Any:
    return _build("pdserve_linear_bf16", _SOURCE, "AVX-512 BF16 or AVX2 + FMA")


@functools.cache
def _kernel_int8() -> Any:
    return _build("pdserve_linear_int8", _SOURCE_INT8, "AVX-512 BF16 or AVX2 + FMA")


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight quantized per output channel, symmetric: W[n, :] ~ scale[n] * q[n, :], |q| <= 127."""

    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8: (q [M, K] int8, scale [M, 1] fp32) with x[m, :] ~ scale[m] * q[m, :],
    symmetric (scale = max|row| / 127, round to nearest; an all-zero row gets scale 1 and q = 0)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf.div_(scale)).clamp_(-127, 127).to(torch.int8), scale


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per-channel symmetric int8 (scale = max|row| / 127, round to nearest), computed in float32 from
    whatever `w` holds (the loader's float32, so a GGUF Q8_0 tensor is requantized without a bf16 detour).
    Every element's error is at most scale / 2; an all-zero row gets scale 1."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


class Bf16DotLinear:
    def __init__(self, weight: torch.Tensor, panels: torch.Tensor | None = None) -> None:
        self._ext = _kernel()
        self.out_features = weight.shape[0]
        self.packed = self._ext.pack(weight) if panels is None else panels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.linear(x, self.packed, self.out_features)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed,)


class AmxLinear(Bf16DotLinear):
    """pdserve's AMX kernel (`linear_amx` in `csrc/linear_bf16.cpp`): the same packed panels as
    `Bf16DotLinear`, read as AMX B tiles; pass `panels` (a `Bf16DotLinear`'s) to share them."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.linear_amx(x, self.packed, self.out_features)


class OneDnnLinear:
    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed,)


class TorchLinear:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # the layer's own tensor: no copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


class Fp32Linear:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight).to(x.dtype)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


class Int8DotLinear:
    def __init__(self, weight: Int8Weight, shared: Int8DotLinear | None = None) -> None:
        self._ext = _kernel_int8()
        self.out_features = weight.shape[0]
        if shared is not None:  # another int8 panel kernel's packing of the same weight
            self.packed, self.scale = shared.packed, shared.scale
            return
        self.packed = self._ext.pack(weight.q)
        self.scale = torch.zeros(self.packed.shape[0] * 32)  # padded to whole 32-column panels
        self.scale[: self.out_features] = weight.scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.linear(x, self.packed, self.scale, self.out_features)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scale)


class Int8AmxLinear(Int8DotLinear):
    """pdserve's AMX kernel for int8 weights (`linear_amx` in `csrc/linear_int8.cpp`): the same packed
    panels and scales as `Int8DotLinear`, each panel widened to bf16 once per call into L2 and run on
    AMX BF16 tiles; pass `shared` (an `Int8DotLinear`) to share its copy."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ext.linear_amx(x, self.packed, self.scale, self.out_features)


class AtenInt8Linear:
    def __init__(self, weight: Int8Weight) -> None:
        assert weight.shape[1] % 16 == 0, "ATen's int8 kernel reads K in 16s"
        self.q = weight.q  # no copy
        self.scale = weight.scale.bfloat16()  # the op takes the activations' dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.scale)


class DequantOneDnnLinear:
    def __init__(self, weight: Int8Weight) -> None:
        self.q = weight.q  # no copy
        self.scale = weight.scale
        # Without a oneDNN bf16 matmul (no AVX-512) torch's bf16 GEMM crawls: widen to fp32 instead.
        self.wide = torch.bfloat16 if onednn_bf16() else torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # q is exact in bf16 (|q| <= 127), so the only roundings are F.linear's output and the scaling.
        if self.wide == x.dtype:
            return F.linear(x, self.q.to(x.dtype)).mul_(self.scale)
        return F.linear(x.to(self.wide), self.q.to(self.wide)).mul_(self.scale).to(x.dtype)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.scale)


class OneDnnW8A8Linear:
    def __init__(self, weight: Int8Weight) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.onednn.qlinear_prepack(weight.q, None)
        self.scale = weight.scale  # fp32, per output channel (oneDNN applies it to the int32 sums)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, self.packed, self.scale, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return y.mul_(s).to(x.dtype)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scale)


class IntMmW8A8Linear:
    def __init__(self, weight: Int8Weight) -> None:
        self.qt = weight.q.t().contiguous()  # [K, N]: the layout _int_mm's CPU kernel reads fastest
        self.scale = weight.scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows(x)
        # channel scale first, then the row scale: the order oneDNN applies them, so the two agree bitwise
        return torch._int_mm(q, self.qt).float().mul_(self.scale).mul_(s).to(x.dtype)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qt, self.scale)


class BucketedLinear:
    """Several kernels for one weight, chosen by row count: `kernels[i]` serves rows up to `bounds[i]`
    (the last serves every larger count too). One bisect per call, no timing."""

    __slots__ = ("bounds", "kernels")

    def __init__(self, bounds: Sequence[int], kernels: Sequence[PackedLinear]) -> None:
        assert len(bounds) == len(kernels) >= 1
        self.bounds = tuple(bounds)
        self.kernels = tuple(kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels[min(bisect_left(self.bounds, x.shape[0]), len(self.kernels) - 1)](x)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for k in self.kernels for t in k.weight_tensors())  # type: ignore[attr-defined]


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a kernel that keeps the layer's own tensor, or two
    kernels sharing one int8 copy, count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.is_mkldnn:  # oneDNN's packed weight: opaque, no storage to share
            seen[id(t)] = t.numel() * t.element_size()
        else:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def available_kernels(weight_dtype: str = "bfloat16") -> dict[str, Callable[[Any], PackedLinear]]:
    """Name -> packer for each kernel that works on this host for bf16 (`torch.Tensor`), int8 or w8a8
    (`Int8Weight`) weights, in autotune order: the library GEMMs first, oneDNN then fp32 (compute-bound
    kernels: timed first they bound the large buckets, which lets the slower kernels stop early; timed
    after a kernel that wins the small buckets, they would be the ones given up on before the row counts
    where they win), pdserve's, torch; w8a8 puts its int8 x int8 kernels
    ("-a8") before the weight-only ones. oneDNN's bf16 matmul needs AVX-512 (or AVX-NE-CONVERT): without
    it oneDNN is not a bf16 candidate (packing would raise)."""
    if weight_dtype == "w8a8":
        return {**_w8a8_kernels(), **_int8_kernels()}
    if weight_dtype == "int8":
        return _int8_kernels()
    out: dict[str, Callable[[Any], PackedLinear]] = {}
    if onednn_bf16():
        out["onednn"] = OneDnnLinear
    if amx_bf16():
        out["amx"] = AmxLinear
    out["fp32"] = Fp32Linear
    try:
        _kernel()
        out["pdserve"] = Bf16DotLinear
    except Exception as e:  # noqa: BLE001 - no compiler, no AVX-512 BF16 and no AVX2: the others remain
        logger.info("pdserve's bf16 linear kernel is unavailable here (%s)", e)
    out["torch"] = TorchLinear
    return out


@functools.cache
def amx_bf16() -> bool:
    """Whether pdserve's AMX kernel runs here: built with AMX BF16 (`-march=native` on a CPU that has it)
    and granted the tile state by the OS."""
    try:
        return bool(_kernel().amx_available())
    except Exception:  # noqa: BLE001 - no compiler or no usable instruction set
        return False


@functools.cache
def amx_int8_weights() -> bool:
    """Whether pdserve's AMX kernel for int8 weights runs here (as `amx_bf16`, for its int8 build)."""
    try:
        return bool(_kernel_int8().amx_available())
    except Exception:  # noqa: BLE001 - no compiler or no usable instruction set
        return False


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_kernel_isa() -> str:
    """The instruction set pdserve's bf16 linear kernel runs on here ("" where it does not build)."""
    try:
        return str(_kernel().isa())
    except Exception:  # noqa: BLE001 - no compiler or no usable instruction set
        return ""


def _int8_kernels() -> dict[str, Callable[[Any], PackedLinear]]:
    out: dict[str, Callable[[Any], PackedLinear]] = {"onednn": DequantOneDnnLinear}
    if amx_int8_weights():
        out["amx"] = Int8AmxLinear
    try:
        _kernel_int8()
        out["pdserve"] = Int8DotLinear
    except Exception as e:  # noqa: BLE001 - no compiler or no AVX-512 BF16: the others remain
        logger.info("pdserve's int8 linear kernel is unavailable here (%s)", e)
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        out["torch"] = AtenInt8Linear
    return out


# oneDNN's int8 GEMM is a candidate only where it runs within this factor of torch._int_mm's time on a
# small probe (onednn_int8_probe): its reference loop measured ~400x slower (host G, session 25).
ONEDNN_A8_MAX_SLOWDOWN = 20.0


def onednn_int8_probe() -> float:
    """oneDNN's int8 x int8 GEMM time over torch._int_mm's on one small layer (16 rows, 512 x 512, best of
    3 calls each after one warm-up). Where oneDNN has a fast path for the CPU the two are within a few x
    (small shapes: call overheads); an AMD Zen 5 with VNNI (session 25) got oneDNN's reference loop: 44 ms
    for one row of a 576 x 3072 layer against _int_mm's 0.11 ms.

    One thread: with the cores busy (another process on both), a parallel call waits for a descheduled
    worker at every barrier, and both kernels then took ~15-80 ms (a scheduler quantum), a ratio of ~5
    whatever the kernel (session 26); one thread only shares its core."""
    g = torch.Generator().manual_seed(0)
    weight = quantize_int8(torch.randn(512, 512, generator=g))
    x = torch.randn(16, 512, generator=g).bfloat16()
    best: dict[str, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, cls in (("onednn", OneDnnW8A8Linear), ("torch", IntMmW8A8Linear)):
            kernel = cls(weight)
            kernel(x)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                kernel(x)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
    finally:
        torch.set_num_threads(threads)
    return best["onednn"] / max(best["torch"], 1e-9)


@functools.cache
def onednn_int8_usable() -> bool:
    """Whether oneDNN's int8 GEMM is a w8a8 candidate here: VNNI or AMX-INT8 (without VNNI, AVX2 only: AMD
    Zen 3, its results were measured wrong by more than bf16's rounding: not exact int32 sums, likely its
    int16 pair sums saturating as vpmaddubsw's do), and not its reference loop (`onednn_int8_probe`)."""
    vnni = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(autotune.cpu_info()[1]))
    if not (vnni and torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    if not hasattr(torch, "_int_mm"):
        return True
    slowdown = onednn_int8_probe()
    if slowdown > ONEDNN_A8_MAX_SLOWDOWN:
        logger.info("oneDNN's int8 GEMM is not a w8a8 candidate here: %.0fx torch._int_mm's time on the probe "
                    "(its reference loop)", slowdown)
        return False
    return True


def _w8a8_kernels() -> dict[str, Callable[[Any], PackedLinear]]:
    out: dict[str, Callable[[Any], PackedLinear]] = {}
    if onednn_int8_usable():
        out["onednn-a8"] = OneDnnW8A8Linear
    if hasattr(torch, "_int_mm"):
        out["torch-a8"] = IntMmW8A8Linear
    return out


def _can_pack(kind: str, weight: torch.Tensor | Int8Weight) -> bool:
    if kind == "pdserve":
        return weight.shape[1] % 2 == 0  # the kernels read k in pairs
    if kind == "amx":
        return weight.shape[1] % 32 == 0  # a tile step takes 32 k
    if kind == "torch" and isinstance(weight, Int8Weight):
        return weight.shape[1] % 16 == 0  # ATen's int8 kernel reads K in 16s (and crashes otherwise)
    return True


def _weight_dtype(weights: Mapping[str, Sequence[torch.Tensor | Int8Weight]], asked: str | None = None) -> str:
    """The weights' dtype for kernel choice: `asked` ("w8a8" for `Int8Weight`s that may meet int8
    activations), else what the weights are (int8 or bfloat16)."""
    first = next(iter(weights.values()))[0]
    held = "int8" if isinstance(first, Int8Weight) else "bfloat16"
    if asked is None or asked == held:
        return held
    if asked == "w8a8" and held == "int8":
        return asked
    raise ValueError(f"{asked} kernels need {'Int8Weight' if asked == 'w8a8' else asked} weights, not {held}")


def cpu_linear_packer(kind: str = "auto") -> Callable[[torch.Tensor], PackedLinear] | None:
    """A function that packs a bf16 [N, K] weight with one named kernel, or None for plain `F.linear`.
    "auto" here (no measurement) is pdserve's kernel where it builds and K is even, else oneDNN."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"unknown linear kernel {kind!r}; choose from {LINEAR_KINDS}")
    if kind == "torch":
        return None
    kernels = available_kernels()
    onednn = kernels.get("onednn")
    if kind == "fp32":
        return kernels["fp32"]
    if kind == "amx":
        if "amx" not in kernels:
            raise ValueError("pdserve's AMX kernel is unavailable here (a CPU or OS without AMX BF16, or a "
                             "compiler without it): use --linear-kernel auto")
        fallback = onednn or kernels["fp32"]
        return lambda weight: AmxLinear(weight) if _can_pack("amx", weight) else fallback(weight)
    if kind == "onednn":
        if onednn is None:
            raise ValueError("oneDNN has no bf16 matmul here (no oneDNN in this torch build, or a CPU without "
                             "AVX-512): use --linear-kernel fp32 or auto")
        return onednn
    if "pdserve" not in kernels:
        if kind == "pdserve":
            raise ValueError("pdserve's bf16 linear kernel is unavailable here (no compiler, or neither AVX-512 "
                             "BF16 nor AVX2 + FMA)")
        return onednn or kernels["fp32"]

    def pack(weight: torch.Tensor) -> PackedLinear:
        if not _can_pack("pdserve", weight):
            return (onednn or kernels["fp32"])(weight)
        return Bf16DotLinear(weight)

    return pack


_PANEL_KERNELS = (Bf16DotLinear, AmxLinear)  # read the same packed panels
_INT8_PANEL_KERNELS = (Int8DotLinear, Int8AmxLinear)  # read the same int8 panels and scales


def _pack_once(
    names: Iterable[str], weight: torch.Tensor | Int8Weight, kernels: Mapping[str, Callable[[Any], PackedLinear]]
) -> dict[str, PackedLinear]:
    """Each named kernel's packing of one weight, one copy each, except that pdserve's AVX-512 and AMX
    kernels share one copy of the panels (bf16 or int8)."""
    out: dict[str, PackedLinear] = {}
    panels: torch.Tensor | None = None
    int8: Int8DotLinear | None = None
    for name in names:
        pack = kernels[name]
        if pack in _PANEL_KERNELS:
            out[name] = pack(weight, panels)  # type: ignore[call-arg]
            panels = out[name].packed  # type: ignore[attr-defined]
        elif pack in _INT8_PANEL_KERNELS:
            out[name] = int8 = pack(weight, int8)  # type: ignore[call-arg]
        else:
            out[name] = pack(weight)
    return out


@dataclass(slots=True)
class LinearPlan:
    """What `pack_cpu_linears` decided: the packed ops, and the measured table where "auto" measured
    (None for a named kernel). `cache` is the file it was read from or written to."""

    packed: dict[str, list[PackedLinear]]
    kind: str
    table: TuneTable | None = None
    cache: str | None = None
    cache_hit: bool = False
    weight_dtype: str = "bfloat16"

    def weight_tensors(self) -> list[torch.Tensor]:
        kernels = [p for ps in self.packed.values() for p in ps]
        return [t for p in kernels for t in p.weight_tensors()]  # type: ignore[attr-defined]

    def describe(self) -> str:
        weights = {"bfloat16": "bf16", "int8": "int8-weight"}.get(self.weight_dtype, self.weight_dtype)
        if self.table is None:
            return f"{weights} linear kernel: {self.kind} at every row count"
        if self.cache_hit:
            src = f"cached {self.cache}"
        else:
            saved = self.cache and self.table.noise <= autotune.NOISY
            src = f"measured, saved to {self.cache}" if saved else "measured, not cached"
        pin = f", pinned to {self.table.pinned} (batch-invariant)" if self.table.pinned else ""
        table = autotune.format_table(self.table)
        return f"{weights} linear kernels by row count ({src}{pin}); ms per full pass:\n{table}"


def tune_key(
    weights: Mapping[str, Sequence[torch.Tensor | Int8Weight]],
    candidates: Sequence[str],
    buckets: Sequence[int],
    weight_dtype: str | None = None,
) -> dict:
    """What a measured table depends on: the host (CPU model and flags), torch, the thread count, the
    weights' dtype, the shapes and how many of each, the candidates, and the source of pdserve's kernel
    (with the header it shares)."""
    cpu, flags = autotune.cpu_info()
    weight_dtype = _weight_dtype(weights, weight_dtype)
    digest = hashlib.sha256()
    for src in (_SOURCE if weight_dtype == "bfloat16" else _SOURCE_INT8, *_HEADERS):
        with open(src, "rb") as f:
            digest.update(f.read())
    kernel_digest = digest.hexdigest()[:16]
    return {
        "cpu": cpu,
        "flags": list(flags),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": "bfloat16",
        "weight_dtype": weight_dtype,
        "ops": {op: [*ws[0].shape, len(ws)] for op, ws in weights.items()},
        "buckets": list(buckets),
        "candidates": list(candidates),
        "pdserve_kernel": kernel_digest,
    }


def _pass_builder(
    weights: Mapping[str, Sequence[torch.Tensor | Int8Weight]], kind: str, pack: Callable[[Any], PackedLinear]
) -> Callable[[int], autotune.Pass]:
    """Pack every weight with one kernel; `pass_for(rows)` is a forward's calls in layer order, so each
    weight arrives as cold as in a real step."""
    packed = {op: [pack(w) for w in ws] for op, ws in weights.items() if _can_pack(kind, ws[0])}
    gen = torch.Generator().manual_seed(0)

    def pass_for(rows: int) -> autotune.Pass:
        xs = {op: torch.randn(rows, ws[0].shape[1], generator=gen).bfloat16() for op, ws in weights.items()}
        depth = max(len(ws) for ws in packed.values()) if packed else 0
        calls = []
        for i in range(depth):
            for op, ps in packed.items():
                if i < len(ps):
                    calls.append((op, functools.partial(ps[i], xs[op])))
        return calls

    return pass_for


@torch.inference_mode()
def measure_linears(
    weights: Mapping[str, Sequence[torch.Tensor | Int8Weight]],
    buckets: Sequence[int] = ROW_BUCKETS,
    kernels: Mapping[str, Callable[[Any], PackedLinear]] | None = None,
    repeats: int = 5,
    give_up: float = 2.0,
    timer: autotune.Timer = time.perf_counter,
    weight_dtype: str | None = None,
) -> TuneTable:
    """Seconds per full pass of each op with each kernel at each bucket's row count (`autotune.tune`;
    `give_up=math.inf` times every kernel everywhere, for a complete A/B table). `weight_dtype` "w8a8"
    adds the int8-activation kernels to `Int8Weight`s' candidates."""
    kernels = available_kernels(_weight_dtype(weights, weight_dtype)) if kernels is None else kernels
    return autotune.tune(
        list(kernels), lambda c: _pass_builder(weights, c, kernels[c]), list(weights), buckets,
        repeats=repeats, timer=timer, give_up=give_up,
    )


def pack_cpu_linears(
    weights: Mapping[str, Sequence[torch.Tensor | Int8Weight]],
    kind: str = "auto",
    *,
    batch_invariant: bool = False,
    cache_dir: str | None = None,
    buckets: Sequence[int] = ROW_BUCKETS,
    timer: autotune.Timer = time.perf_counter,
    kernels: Mapping[str, Callable[[Any], PackedLinear]] | None = None,
    weight_dtype: str | None = None,
) -> LinearPlan:
    """Pack bf16 [N, K] weights or `Int8Weight`s (all of one kind), grouped by op (e.g. {"qkv": [30
    layers' weights], "lm_head": [...]}); the candidates are that weight dtype's kernels (`weight_dtype`
    None: what the weights are; "w8a8": `Int8Weight`s whose kernels may quantize the activations).

    A named `kind` packs that kernel for every row count. "auto" times each available kernel on these
    weights at `buckets` rows (`autotune.tune`), or reads the table cached in `cache_dir` for the same
    host, torch, threads and shapes (None: no cache), and packs per op only the kernels that win a
    bucket. `batch_invariant` pins one row-independent kernel (pdserve's) for every row count; where
    none builds, the kernel fastest at decode-sized buckets, with a warning that rows may then depend on
    the batch. `timer` and `kernels` (name -> packer, default `available_kernels()`) are for tests."""
    weight_dtype = _weight_dtype(weights, weight_dtype)
    kernels = dict(available_kernels(weight_dtype) if kernels is None else kernels)
    if kind not in LINEAR_KINDS and kind not in kernels:  # a candidate's own name ("onednn-a8") is fine too
        raise ValueError(f"unknown linear kernel {kind!r}; choose from {LINEAR_KINDS}")
    if kind != "auto":
        if weight_dtype == "w8a8" and f"{kind}-a8" in kernels:
            kind = f"{kind}-a8"  # --linear-kernel onednn|torch with w8a8: that library's int8 x int8 kernel
        if kind not in kernels:
            raise ValueError(f"the {kind!r} linear kernel is unavailable here for {weight_dtype} weights; "
                             f"available: {sorted(kernels)}")
        pack = kernels[kind]
        fallback = kernels.get("onednn", Fp32Linear if weight_dtype == "bfloat16" else DequantOneDnnLinear)
        packed = {op: [pack(w) if _can_pack(kind, w) else fallback(w) for w in ws] for op, ws in weights.items()}
        return LinearPlan(packed, kind, weight_dtype=weight_dtype)

    candidates = list(kernels)
    if batch_invariant:
        invariant = [c for c in candidates if c in ROW_INDEPENDENT]
        if invariant:
            candidates = invariant
        else:
            logger.warning("--batch-invariant: no row-independent linear kernel builds here; pinning the "
                           "fastest at decode sizes, whose rows may still round differently with the batch")
    if len(candidates) == 1:
        pinned = candidates[0]
        packed = pack_cpu_linears(weights, pinned, kernels=kernels, weight_dtype=weight_dtype).packed
        return LinearPlan(packed, pinned, weight_dtype=weight_dtype)

    key = tune_key(weights, candidates, buckets, weight_dtype)
    path = autotune.cache_path(cache_dir, "linear", key) if cache_dir else None
    table = autotune.load_cached(path, key) if path else None
    hit = table is not None
    if table is None:
        t0 = time.perf_counter()
        table = measure_linears(weights, buckets, {c: kernels[c] for c in candidates}, timer=timer,
                                weight_dtype=weight_dtype)
        logger.info("%s linear kernels measured in %.1f s", weight_dtype, time.perf_counter() - t0)
        if table.noise > autotune.NOISY:
            logger.warning("the machine looked busy while timing the linear kernels (median %.1fx the best); "
                           "using the choice for this run only, not caching it", table.noise)
        elif path:
            autotune.save_cached(path, key, table)
    if batch_invariant:
        table.pinned = autotune.pick_one(table, candidates)

    packed: dict[str, list[PackedLinear]] = {}
    for op, ws in weights.items():
        winners = table.winners(op)
        runs: list[tuple[int, str]] = []  # (largest row count, kernel) per run of equal winners
        for b, name in zip(buckets, winners):
            if runs and runs[-1][1] == name:
                runs[-1] = (b, name)
            else:
                runs.append((b, name))
        runs[-1] = (math.inf, runs[-1][1])  # type: ignore[assignment]  # the last run serves every larger count
        ops_packed = []
        for w in ws:
            once = _pack_once(dict.fromkeys(name for _, name in runs), w, kernels)
            ks = [once[name] for _, name in runs]
            ops_packed.append(ks[0] if len(ks) == 1 else BucketedLinear([b for b, _ in runs], ks))
        packed[op] = ops_packed
    return LinearPlan(packed, "auto", table, path, hit, weight_dtype)
