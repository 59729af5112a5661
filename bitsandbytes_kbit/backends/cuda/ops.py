"""CUDA registrations of the k-bit ops: check what the kernels assume, allocate the outputs and
call the C ABI on the tensor's device and current stream. No math here."""

import concurrent.futures
import ctypes as ct
import functools

import torch

from ... import functional as _functional
from ..._ops import (
    check_dequantize_args,
    check_dequantize_out_args,
    check_dequantize_tiled_args,
    check_gemm_args,
    check_gemm_out_args,
    check_quantize_args,
    check_repack_args,
    num_blocks,
    register_kernel,
    tiled_shapes,
)
from ...cextension import get_lib
from ..default.ops import check_finite

# The C ABI's codes for the element type and the absmax storage (csrc/ops.cuh, KbitDtype / KbitAbsmaxFormat).
_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_ABSMAX_CODE = {torch.uint8: 0, torch.float16: 1, torch.float32: 2}

# The ctypes signatures, one table (upstream's _setup_ctypes). Every entry that does work returns 0 on success and 1
# on failure, with the message in ckbit_last_error; k, dtype and absmax_format are runtime ints.
_INT, _PTR, _SIZE = ct.c_int, ct.c_void_p, ct.c_size_t
_FORMAT = [_INT, _INT, _INT]  # k, dtype code, absmax code
_SIGNATURES = {
    # (k, dtype, absmax_format, A, codebook, codebook_len, packed, absmax, n, stream)
    "ckbit_quantize": (_INT, [*_FORMAT, _PTR, _PTR, _INT, _PTR, _PTR, ct.c_longlong, _PTR]),
    # (k, dtype, absmax_format, A, codebook, codebook_len, packed, absmax, n, below, above, stream)
    "ckbit_quantize_mse": (_INT, [*_FORMAT, _PTR, _PTR, _INT, _PTR, _PTR, ct.c_longlong, _INT, _INT, _PTR]),
    # (k, dtype, absmax_format, packed, absmax, codebook, codebook_len, out, n, stream)
    "ckbit_dequantize": (_INT, [*_FORMAT, _PTR, _PTR, _PTR, _INT, _PTR, ct.c_longlong, _PTR]),
    # (k, dtype, absmax_format, B_packed, B_absmax, codebook, codebook_len, out, N, K_dim, n_begin, n_end, k_begin,
    #  k_end, stream)
    "ckbit_dequantize_tiled": (_INT, [*_FORMAT, _PTR, _PTR, _PTR, _INT, _PTR, *[_INT] * 6, _PTR]),
    # (k, absmax_format, packed_flat, absmax_flat, B_packed, B_absmax, N, K_dim, stream)
    "ckbit_repack": (_INT, [_INT, _INT, _PTR, _PTR, _PTR, _PTR, _INT, _INT, _PTR]),
    # (k, dtype, absmax_format, A, B_packed, B_absmax, codebook, codebook_len, bias, C, M, N, K_dim, lda, workspace,
    #  workspace_bytes, stream)
    "ckbit_gemm": (
        _INT,
        [*_FORMAT, _PTR, _PTR, _PTR, _PTR, _INT, _PTR, _PTR, _INT, _INT, _INT, _INT, _PTR, _SIZE, _PTR],
    ),
    # (config, sm_count): the test hook, -1 = none
    "ckbit_gemm_set_test_override": (None, [_INT, _INT]),
    # (M, N, K_dim, k, sm_count); sm_count <= 0: the current device's
    "ckbit_gemm_workspace_bytes": (_SIZE, [_INT] * 5),
    "ckbit_gemm_plan": (_INT, [_INT] * 5),
    "ckbit_gemm_staged_preferred": (_INT, [_INT] * 5),
    # (config, M, N, K_dim, k, sm_count, out[8]) -> feature count
    "ckbit_gemm_cost_features": (_INT, [_INT] * 6 + [ct.POINTER(ct.c_float)]),
    "ckbit_gemm_num_configs": (_INT, []),
    "ckbit_gemm_config_available": (_INT, [_INT]),
    "ckbit_tiled_words": (_SIZE, [_INT] * 3),
    "ckbit_tiled_absmax": (_SIZE, [_INT] * 2),
    "ckbit_last_error": (ct.c_char_p, []),
}


def entry_point_names() -> list[str]:
    """Every C symbol this backend may call (for the build test)."""
    return list(_SIGNATURES)


@functools.cache
def _entry(name: str) -> ct._CFuncPtr:
    fn = getattr(get_lib(), name)
    fn.restype, fn.argtypes = _SIGNATURES[name]
    return fn


def _ptr(t: torch.Tensor) -> ct.c_void_p:
    return ct.c_void_p(t.data_ptr())


def _stream(t: torch.Tensor) -> ct.c_void_p:
    return ct.c_void_p(torch._C._cuda_getCurrentRawStream(t.device.index))


def _raise(op: str) -> None:
    """Raise the message of the C entry that just failed on this thread."""
    raise RuntimeError(f"{op}: {_entry('ckbit_last_error')().decode()}")


def _call(op: str, name: str, *args) -> None:
    """Call C entry ``name`` and raise its message on failure."""
    if _entry(name)(*args) != 0:
        _raise(op)


@register_kernel("bitsandbytes::quantize_kbit", "cuda")
def _(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(A, codebook, k, absmax_dtype)
    _functional.check_not_capturing("quantize_kbit", A)
    check_finite("quantize_kbit", "A", A)
    return _quantize(A, codebook, k, absmax_dtype)


def _quantize_with(name: str, A: torch.Tensor, codebook, k: int, absmax_dtype: torch.dtype, *rule_args):
    """One quantize entry (``name``: the absmax rule's or the mse rule's) on checked arguments, no host sync;
    ``rule_args`` go between n and the stream."""
    A = A.contiguous()
    codebook = codebook.contiguous()
    nb = num_blocks(A.numel())
    packed = torch.empty(nb * k, dtype=torch.int32, device=A.device)
    absmax = torch.empty(nb, dtype=absmax_dtype, device=A.device)
    with torch.cuda.device(A.device):
        args = (_ptr(A), _ptr(codebook), codebook.numel(), _ptr(packed), _ptr(absmax), A.numel(), *rule_args)
        _call("quantize_kbit", name, k, _DTYPE_CODE[A.dtype], _ABSMAX_CODE[absmax_dtype], *args, _stream(A))
    return packed, absmax


def _quantize(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype):
    """The kernel call of quantize_kbit (the absmax rule) on checked arguments (no host sync)."""
    return _quantize_with("ckbit_quantize", A, codebook, k, absmax_dtype)


def _quantize_mse(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype, below: int, above: int):
    """The error-minimizing quantize (scale_search.quantize_blocks_mse's rule) in one kernel, on checked arguments
    (no host sync): ``below`` / ``above`` candidate scales around the rounded absmax."""
    return _quantize_with("ckbit_quantize_mse", A, codebook, k, absmax_dtype, below, above)


def _dequantize(packed, absmax, codebook, k, n, dtype, out) -> None:
    packed = packed.contiguous()
    absmax = absmax.contiguous()
    codebook = codebook.contiguous()
    with torch.cuda.device(packed.device):
        _call(
            "dequantize_kbit",
            "ckbit_dequantize",
            k,
            _DTYPE_CODE[dtype],
            _ABSMAX_CODE[absmax.dtype],
            _ptr(packed),
            _ptr(absmax),
            _ptr(codebook),
            codebook.numel(),
            _ptr(out),
            n,
            _stream(packed),
        )


@register_kernel("bitsandbytes::dequantize_kbit", "cuda")
def _(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    _dequantize(packed, absmax, codebook, k, n, dtype, out)
    return out


@register_kernel("bitsandbytes::dequantize_kbit.out", "cuda")
def _(packed, absmax, codebook, k: int, n: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    check_dequantize_out_args(packed, absmax, codebook, k, n, dtype, out)
    _dequantize(packed, absmax, codebook, k, n, dtype, out)


# ---------------------------------------------------------------- repack + fused GEMM


@register_kernel("bitsandbytes::repack_kbit", "cuda")
def _(packed: torch.Tensor, absmax: torch.Tensor, k: int, N: int, K_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_repack_args(packed, absmax, k, N, K_dim)
    words_shape, absmax_shape = tiled_shapes(k, N, K_dim)
    packed = packed.contiguous()
    absmax = absmax.contiguous()
    B_packed = torch.zeros(words_shape, dtype=torch.int32, device=packed.device)
    B_absmax = torch.zeros(absmax_shape, dtype=absmax.dtype, device=packed.device)
    with torch.cuda.device(packed.device):
        args = (_ptr(packed), _ptr(absmax), _ptr(B_packed), _ptr(B_absmax), N, K_dim, _stream(packed))
        _call("repack_kbit", "ckbit_repack", k, _ABSMAX_CODE[absmax.dtype], *args)
    return B_packed, B_absmax


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Split-K workspaces. The kernel's tile counters reset themselves after each call, so a zero-initialised buffer is
# reused, but two GEMMs running at once must never share one: eager calls get one buffer per (device, stream),
# ordered by that stream. Calls under CUDA-graph capture use one buffer per device kept for graphs, which every
# eager call also grows to what it needed (a capture never allocates: a memset recorded in a graph would not run
# before a later eager call); a call that needs more than it has while capturing gets fewer k-splits (the dispatcher
# falls back). A graph buffer that was captured is never freed (the graph keeps its address), and graphs on one
# device share it: replay graphs holding k-bit GEMMs one at a time (on one stream), not concurrently.
# A buffer holds at most ~32 MiB of split-K tiles (csrc/kbit_gemm.cu, MAX_WORKSPACE_BYTES).
_MIN_WORKSPACE_BYTES = 8 << 20
_workspaces: dict[tuple[int, int], torch.Tensor] = {}  # (device index, raw stream) -> eager buffer
_graph_workspaces: dict[int, torch.Tensor] = {}  # device index -> buffer for calls under capture
_captured_workspaces: list[torch.Tensor] = []  # graph buffers replaced by a bigger one, kept alive for their graphs
_captured_ids: set[int] = set()  # data_ptr of graph buffers used under capture


@functools.cache
def _allocator_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kbit-alloc")


def _kept_buffer(numel: int, dtype: torch.dtype, device: torch.device, zero: bool) -> torch.Tensor:
    """A buffer this module keeps across calls, allocated on a thread of its own. torch routes every allocation made
    by a thread that is warming up or recording a CUDA graph (inductor's cudagraph trees, mode="reduce-overhead")
    into that graph's private pool, where a tensor that outlives the graph's outputs is refused ("tensor(s) in the
    cudagraph pool not tracked as outputs") and would be overwritten by later replays. The caller's stream waits for
    the allocation's zero fill, and the buffer is marked as used on that stream (freed only after its work)."""

    def allocate():
        with torch.cuda.device(device):
            buf = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
            done = torch.cuda.Event()
            done.record()  # on this thread's current stream: the device's default stream
        return buf, done

    buf, done = _allocator_thread().submit(allocate).result()
    stream = torch.cuda.current_stream(device)
    stream.wait_event(done)
    buf.record_stream(stream)
    return buf


def _grown(ws: torch.Tensor | None, needed: int, device: torch.device) -> torch.Tensor:
    if ws is not None and ws.numel() >= needed:
        return ws
    size = max(needed, _MIN_WORKSPACE_BYTES, 0 if ws is None else ws.numel())
    return _kept_buffer(size, torch.uint8, device, zero=True)


def _workspace(device: torch.device, stream: int, needed: int) -> torch.Tensor:
    """The split-K buffer for a call on ``stream`` of ``device`` needing ``needed`` bytes (see above)."""
    index = device.index
    if torch.cuda.is_current_stream_capturing():
        ws = _graph_workspaces.get(index)
        if ws is None:
            raise RuntimeError(
                "kbit_gemm: first call on this device happened under CUDA-graph capture; run it once eagerly first"
            )
        _captured_ids.add(ws.data_ptr())
        return ws
    ws = _workspaces[(index, stream)] = _grown(_workspaces.get((index, stream)), needed, device)
    graph_ws = _graph_workspaces.get(index)
    if graph_ws is None or graph_ws.numel() < needed:
        if graph_ws is not None and graph_ws.data_ptr() in _captured_ids:
            _captured_workspaces.append(graph_ws)
        _graph_workspaces[index] = _grown(graph_ws, needed, device)
    return ws


def gemm_num_configs() -> int:
    return _entry("ckbit_gemm_num_configs")()


def library_problem() -> str | None:
    """None when the native library with the k-bit entry points loads, else the loader's message (checked at model
    load, before any weight is placed on a GPU)."""
    try:
        gemm_num_configs()
    except (OSError, RuntimeError, AttributeError) as err:
        return str(err)
    return None


def gemm_config_available(config: int, device=None) -> bool:
    """Whether `config` can run on ``device`` (the current one by default): the wgmma configs need a
    compute capability 9.0 GPU and a library built for sm_90a, the widest shared-A one 226 KB of
    shared memory per block."""
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        return bool(_entry("ckbit_gemm_config_available")(config))


def gemm_plan(M: int, N: int, K_dim: int, k: int, sm_count: int = 0, device=None) -> tuple[int, int]:
    """(config, k splits) the fused kernel's dispatcher picks for this call on ``device`` (the current one by
    default; ``sm_count`` > 0 plans for that many SMs instead of the device's), for benchmarks and tests."""
    index = torch.device(device if device is not None else torch.cuda.current_device()).index
    index = torch.cuda.current_device() if index is None else index
    with torch.cuda.device(index):
        plan = _entry("ckbit_gemm_plan")(M, N, K_dim, k, sm_count or _sm_count(index))
    return plan % 256, plan // 256


def _dequantize_tiled_block(B_packed, B_absmax, codebook, k, N, K_dim, n_begin, n_end, k_begin, k_end, out) -> None:
    """W[n_begin:n_end, k_begin:k_end] into the contiguous ``out`` (n_begin % 16 == 0, k_begin % 128 == 0)."""
    with torch.cuda.device(out.device):
        _call(
            "dequantize_kbit_tiled",
            "ckbit_dequantize_tiled",
            k,
            _DTYPE_CODE[out.dtype],
            _ABSMAX_CODE[B_absmax.dtype],
            _ptr(B_packed),
            _ptr(B_absmax),
            _ptr(codebook),
            codebook.numel(),
            _ptr(out),
            N,
            K_dim,
            n_begin,
            n_end,
            k_begin,
            k_end,
            _stream(out),
        )


@register_kernel("bitsandbytes::dequantize_kbit_tiled", "cuda")
def _(B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, dtype) -> torch.Tensor:
    check_dequantize_tiled_args(B_packed, B_absmax, codebook, k, N, K_dim, dtype)
    out = torch.empty((N, K_dim), dtype=dtype, device=B_packed.device)
    _dequantize_tiled_block(B_packed, B_absmax, codebook.contiguous(), k, N, K_dim, 0, N, 0, K_dim, out)
    return out


# The staged path: the weight dequantized in chunks to a cached scratch, then cuBLAS. From STAGED_MIN_M tokens the
# native dispatcher's cost model (ckbit_gemm_staged_preferred, csrc/kbit_gemm.cu) weighs it against the fused configs;
# below, the fused kernel always runs, so no fp16 copy of W is made at decode sizes. The scratch holds at most
# STAGING_BYTES (one chunk), per device, stream and dtype; under CUDA-graph capture each call takes its chunk from the
# graph's private memory pool instead (freed after the call, so the staged calls of one graph share one chunk).
STAGED_MIN_M = 64
STAGING_BYTES = 64 << 20
STAGING_ALIGN = 128  # chunk edges on whole cuBLAS tiles (and whole units: 16 rows, 128 k)
# From this many tokens deep weights are cut into rows too (staging_chunks)
STAGED_ROWS_MIN_M = 2048
# one scratch per (device, stream, dtype): GEMMs running at once on two streams never share one
_scratch: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _staging_buffer(device: torch.device, dtype: torch.dtype, elems: int) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        # the graph's own pool: a cached buffer would be reused or freed by later eager calls under the graph
        return torch.empty(elems, dtype=dtype, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < elems:
        buf = _scratch[key] = _kept_buffer(elems, dtype, device, zero=False)
    return buf


def staging_chunks(
    N: int, K_dim: int, elem_bytes: int = 2, M: int = 0, axis: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """How the staged path cuts W[N, K_dim] for M tokens: ("n", row ranges) or ("k", column ranges),
    chunks of at most STAGING_BYTES with edges on STAGING_ALIGN, equal where a chunk count up to twice
    the fewest divides the side into whole STAGING_ALIGN blocks (8192 rows: 8 x 1024, not 6 x 1280 + 512).

    A wide weight (gate/up) is cut into rows, which keep K whole. A deep one (down) is cut into k
    chunks below STAGED_ROWS_MIN_M tokens, which keep N whole and accumulate into C: rows of a deep
    weight gave cuBLAS half-width products there. From STAGED_ROWS_MIN_M on, rows again: every further k
    chunk re-reads and re-writes C. ``axis`` ("n" or "k") overrides the rule (to time both)."""
    n_chunks = -(-N * K_dim * elem_bytes // STAGING_BYTES)
    axis = axis or ("n" if N >= K_dim or M >= STAGED_ROWS_MIN_M else "k")
    length = N if axis == "n" else K_dim
    blocks = -(-length // STAGING_ALIGN)
    count = next((c for c in range(n_chunks, 2 * n_chunks + 1) if c <= blocks and blocks % c == 0), n_chunks)
    step = max(STAGING_ALIGN, -(-blocks // count) * STAGING_ALIGN) if count <= blocks else STAGING_ALIGN
    return axis, [(i, min(length, i + step)) for i in range(0, length, step)]


@torch.no_grad()  # the op has no autograd formula; cuBLAS' out= calls refuse inputs that require grad
def _staged_gemm(A2, B_packed, B_absmax, codebook, k, N, K_dim, bias, C2) -> None:
    axis, chunks = staging_chunks(N, K_dim, A2.element_size(), A2.shape[0])
    span = max(e - b for b, e in chunks)
    scratch = _staging_buffer(A2.device, A2.dtype, span * (K_dim if axis == "n" else N))
    for i, (c0, c1) in enumerate(chunks):
        if axis == "n":
            W = scratch[: (c1 - c0) * K_dim].view(c1 - c0, K_dim)
            _dequantize_tiled_block(B_packed, B_absmax, codebook, k, N, K_dim, c0, c1, 0, K_dim, W)
            out = C2 if len(chunks) == 1 else C2[:, c0:c1]
            if bias is not None:
                torch.addmm(bias[c0:c1], A2, W.t(), out=out)
            else:
                torch.mm(A2, W.t(), out=out)
        else:  # C = sum over k chunks of A[:, chunk] @ W[:, chunk]^T, accumulated in C (beta = 1)
            W = scratch[: N * (c1 - c0)].view(N, c1 - c0)
            _dequantize_tiled_block(B_packed, B_absmax, codebook, k, N, K_dim, 0, N, c0, c1, W)
            A_part = A2 if len(chunks) == 1 else A2[:, c0:c1]
            if i > 0:
                C2.addmm_(A_part, W.t())
            elif bias is not None:
                torch.addmm(bias, A_part, W.t(), out=C2)
            else:
                torch.mm(A_part, W.t(), out=C2)


def _staged_preferred(device, M, N, K_dim, k, sms) -> bool:
    """The native dispatcher's choice between the staged path and the fused kernel (its cost model's prediction
    for each) from STAGED_MIN_M tokens."""
    with torch.cuda.device(device):
        return bool(_entry("ckbit_gemm_staged_preferred")(M, N, K_dim, k, sms))


@functools.lru_cache(maxsize=4096)
def _workspace_bytes(M: int, N: int, K_dim: int, k: int, sms: int) -> int:
    return _entry("ckbit_gemm_workspace_bytes")(M, N, K_dim, k, sms)


def kbit_gemm_cuda(
    A, B_packed, B_absmax, codebook, k, N, K_dim, bias, out, config: int = -1, sm_count: int = 0, path: str = "auto"
) -> None:
    """C = A @ W^T (+ bias) into ``out`` ([..., N], A's dtype). Arguments are checked by the caller.

    path: "auto" (the fused kernel below STAGED_MIN_M tokens; from there, whichever the native dispatcher's cost
    model predicts faster), "fused" or "staged".
    config forces one compiled configuration of the fused kernel (-1: its dispatcher picks) and
    sm_count overrides the SM count it plans with, so tests reach every config and split on any GPU; both go
    through the library's test hook (ckbit_gemm_set_test_override), set for this call only.

    This is the whole host path of a decode-time call, so it does only what each call needs: cached entry
    points, workspace sizes and SM counts, plain ints for the pointers, and a device switch only when A is
    not on the current device."""
    if A.is_contiguous() and A.data_ptr() % 16 == 0:
        A2, M, lda = A, A.numel() // K_dim, K_dim  # the kernel reads rows of lda elements: no view needed
    else:
        A2 = A.reshape(-1, K_dim)
        if A2.stride(-1) != 1 or A2.stride(0) < K_dim or A2.data_ptr() % 16 or A2.stride(0) % 8:
            A2 = A2.contiguous()
        M, lda = A2.shape[0], A2.stride(0)
    if M == 0:
        return
    index = A.get_device()
    sms = sm_count or _sm_count(index)
    staged = path == "staged" or (
        path == "auto" and config < 0 and M >= STAGED_MIN_M and _staged_preferred(A.device, M, N, K_dim, k, sms)
    )
    if staged:
        _staged_gemm(A2.view(M, K_dim), B_packed, B_absmax, codebook, k, N, K_dim, bias, out.view(M, N))
        return
    fn = _entry("ckbit_gemm")
    ws_bytes = _workspace_bytes(M, N, K_dim, k, sms)
    stream = torch._C._cuda_getCurrentRawStream(index)
    ws = _workspaces.get((index, stream))
    if ws is None or ws.numel() < ws_bytes or torch._C._cuda_isCurrentStreamCapturing():
        ws = _workspace(A.device, stream, ws_bytes)
    args = (
        k,
        _DTYPE_CODE[A.dtype],
        _ABSMAX_CODE[B_absmax.dtype],
        A2.data_ptr(),
        B_packed.data_ptr(),
        B_absmax.data_ptr(),
        codebook.data_ptr(),
        codebook.numel(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        M,
        N,
        K_dim,
        lda,
        ws.data_ptr(),
        ws.numel(),
        stream,
    )
    if config >= 0 or sm_count > 0:
        _gemm_with_test_override(fn, args, index, config, sm_count)
    elif torch._C._cuda_getDevice() == index:
        if fn(*args) != 0:
            _raise("kbit_gemm")
    else:
        with torch.cuda.device(index):
            if fn(*args) != 0:
                _raise("kbit_gemm")


def _gemm_with_test_override(fn, args, index: int, config: int, sm_count: int) -> None:
    """One ckbit_gemm call under the test hook (a forced config and/or SM count), cleared again whatever happens."""
    hook = _entry("ckbit_gemm_set_test_override")
    with torch.cuda.device(index):
        hook(config, sm_count)
        try:
            err = fn(*args)
        finally:
            hook(-1, -1)
        if err != 0:
            _raise("kbit_gemm")


@register_kernel("bitsandbytes::kbit_gemm", "cuda")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias=None) -> torch.Tensor:
    check_gemm_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias)
    out = torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
    kbit_gemm_cuda(A, B_packed, B_absmax, codebook.contiguous(), k, N, K_dim, bias, out)
    return out


@register_kernel("bitsandbytes::kbit_gemm.out", "cuda")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias, out: torch.Tensor) -> None:
    check_gemm_out_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias, out)
    kbit_gemm_cuda(A, B_packed, B_absmax, codebook.contiguous(), k, N, K_dim, bias, out)


# Eager calls of functional.kbit_gemm on CUDA tensors skip the dispatcher (they run the same checks first).
_functional._eager_gemm["cuda"] = kbit_gemm_cuda
_functional._eager_quantize["cuda"] = _quantize
_functional._mse_quantize["cuda"] = _quantize_mse
