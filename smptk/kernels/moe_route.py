"""moe_route: top-k expert selection, routing weights and the router's auxiliary losses in one pass.

Legend: T tokens, E experts, k = top_k slots per token; ``s = logits[t]`` in fp32; ``score`` the per-expert
score (softmax(s) or sigmoid(s)); ``sel = score + expert_bias`` the selection key.

Shapes: logits ``[T, E]`` (float32/float16/bfloat16, any strides) -> weights ``[T, k]`` fp32, expert_ids
``[T, k]`` int32, tokens_per_expert ``[E]`` int64, aux_loss and z_loss 0-d fp32.

What it computes, per token:

- ``expert_ids[t]``: the k experts with the largest ``sel``, in descending ``sel`` order; on equal ``sel``
  the lower expert id comes first (and is the one picked). NaN keys are never preferred over numbers (the
  picked set is then unspecified; the weights come out NaN anyway).
- ``weights[t, j] = score[expert_ids[t, j]]``, divided by their sum over the k slots (plus ``RENORM_EPS`` =
  1e-20, as Hugging Face's DeepSeek-V3 router: a token whose k sigmoid scores underflow to 0, at logits
  below about -104, gets zero weights, not 0 / 0) if ``renormalize``.
  ``expert_bias`` ([E]) moves the *selection* only (aux-loss-free load balancing, DeepSeek-V3): the weights
  use the unbiased score, and no gradient reaches the bias.
- ``tokens_per_expert[e]``: the pairs assigned to e (sum = T * k).
- ``aux_loss = E * sum_e f_e * P_e``, the switch-style load-balancing loss (Switch Transformer, Fedus et al.
  2021): ``f_e = tokens_per_expert[e] / (T * k)`` (a count, no gradient; with a bias it counts the biased
  selection, i.e. the real assignments) and ``P_e = mean_t q[t, e]`` with ``q`` the router probabilities:
  ``q = softmax(s)`` for softmax scores; for sigmoid scores ``q = sigmoid(s) / (sum_e sigmoid(s) +
  RENORM_EPS)``, the scores normalized per token (as in DeepSeek-V3's sequence-wise balance loss), so that
  ``sum_e q = 1`` in both cases and a perfectly balanced router gives ``aux_loss = 1``.
- ``z_loss = mean_t logsumexp(s)^2``, the router z-loss (ST-MoE, Zoph et al. 2022), whatever the score.
- T = 0 gives empty weights and ids, zero counts and both losses 0 (not the NaN of an empty mean).

Worked example, 4 tokens, E = 3, k = 2, softmax, renormalize::

    logits            = [[2, 0, 1], [0, 1, 2], [1, 1, 0], [1, 0, 3]]
    expert_ids        = [[0, 2], [2, 1], [0, 1], [2, 0]]      token 2: experts 0 and 1 tie, 0 goes first
    weights           = [[.731, .269], [.731, .269], [.5, .5], [.881, .119]]   softmax over the two picked
    tokens_per_expert = [3, 2, 3]
    aux_loss          = 3 * (3/8 * P_0 + 2/8 * P_1 + 3/8 * P_2) = 1.0501, P = column means of softmax(logits)
    z_loss            = mean of logsumexp(row)^2 = 6.2770

Kernels (Triton, forward and backward):

1. ``_route_fwd_kernel``: each program takes ``ROWS_PER_PROG`` tokens in sub-blocks of ``BLOCK_T`` x
   ``BLOCK_E`` (BLOCK_E = next power of 2 >= E, padded experts masked to -inf). Scores, then k rounds of
   selection: ``best = max(sel over available experts)``, ``id = min(e : available and sel[e] == best)``.
   Taking the *minimum index among the maxima* is what breaks ties toward the lower id (it does not rely on
   an argmax's tie rule); the picked expert is then marked unavailable. Weights and ids are kept as
   ``[BLOCK_T, BLOCK_K]`` register tiles, renormalized and stored once. Per program the kernel also sums
   the picks per expert, ``q`` per expert and ``lse^2`` into partial rows (``[num_progs, E]`` and
   ``[num_progs]``).
2. ``_route_stats_kernel`` (one program) adds the partial rows in a fixed order (deterministic, no float
   atomics) and writes tokens_per_expert, aux_loss and z_loss.
3. ``_route_bwd_kernel``: from the weights' gradient g (``[T, k]``) and the two scalar loss gradients,
   recomputes the scores from the logits and writes dlogits (logits' dtype):
   score gradient ``G`` (g at the picked experts; with renormalize ``(G - sum_j g_j w_j) / Z``, Z the
   picked scores' sum), aux gradient ``d aux / d q[t, e] = E * f_e / T``, then the softmax Jacobian
   ``p * (g - <p, g>)`` or, for sigmoid, the per-token normalization's Jacobian and
   ``sigmoid(s) * sigmoid(-s)`` (not ``sc * (1 - sc)``, which cancels where sc is near 1); the z-loss adds
   ``2 * lse / T * softmax(s)``.

The kernels live in ``_moe_route_kernels.py``, imported with triton on the first Triton-path call (see
``_triton.py``); this file holds their tunables and launchers, the checks, the autograd wiring and the
PyTorch path.

Example (on a GPU; the CPU examples are :func:`moe_route`'s and :class:`MoERouting`'s)::

    >>> logits = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16,  # needs CUDA  # doctest: +SKIP
    ...                      requires_grad=True)
    >>> r = moe_route(logits, 8)  # needs CUDA  # doctest: +SKIP
    >>> r.weights.shape, r.expert_ids.dtype, int(r.tokens_per_expert.sum())  # needs CUDA  # doctest: +SKIP
    (torch.Size([4096, 8]), torch.int32, 32768)
    >>> (r.aux_loss * 1e-2 + r.z_loss * 1e-3).backward()  # needs CUDA  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer, new_index_buffer
from smptk.kernels._checks import check_float_tensor
from smptk.kernels._dispatch import first_derivative_only, outside_graphs
from smptk.kernels._triton import cdiv, kernel_module, next_power_of_2

# The @triton.jit kernels, imported (with triton) on the first Triton-path call: see smptk.kernels._triton.
_kernels = kernel_module("smptk.kernels._moe_route_kernels")

SCORE_FUNCS = {"softmax": 0, "sigmoid": 1}
# Added to the sums that normalize sigmoid scores (the k weights' with renormalize, and all E scores' for
# the aux loss's q) so that scores that all underflow to 0 give 0, not 0 / 0; below every sum of fp32 scores
# that is not ~0. The kernels in _moe_route_kernels.py write the same literal (imported only with triton).
RENORM_EPS = 1e-20

# ROWS_PER_PROG tokens per program bound the partial rows to T/256 x E (256 KB at T = 64K, E = 256) and
# leave 256 programs (~2 waves of 132 SMs) at that T. Sub-blocks of BLOCK_T tokens keep a
# BLOCK_T x BLOCK_E tile at ~1K fp32 (BLOCK_T = clamp(TILE_ELEMS // BLOCK_E, 1, 32)): at 2K, 8 x 256 for
# DeepSeek-V3's E = 256 with fp32 logits spilled 12 B on sm_80 (Triton 3.9); at 4 x 256, 106-128 registers
# and no spill on sm_80 or sm_90, Triton 3.6 or 3.9. Untuned for speed.
_FWD_BLOCKS = {"ROWS_PER_PROG": 256, "TILE_ELEMS": 1024, "MAX_BLOCK_T": 32, "MAX_STATS_BLOCK_B": 32}
# Interpreter: programs of 16 tokens in blocks of 8, so CPU tests at T <= 40 cross both boundaries.
_FWD_BLOCKS_INTERPRETER = {"ROWS_PER_PROG": 16, "TILE_ELEMS": 64, "MAX_BLOCK_T": 8, "MAX_STATS_BLOCK_B": 2}


def _blocks(E: int, b: dict[str, int] | None = None) -> dict[str, int]:
    """The kernels' block sizes for E experts, from ``b`` (default: this process's block table)."""
    if b is None:
        b = _FWD_BLOCKS_INTERPRETER if runtime.interpreter_enabled() else _FWD_BLOCKS
    BLOCK_E = next_power_of_2(E)
    # Powers of two no larger than ROWS_PER_PROG (a power of two), so sub-blocks tile a program exactly.
    BLOCK_T = max(1, min(b["TILE_ELEMS"] // BLOCK_E, b["MAX_BLOCK_T"], b["ROWS_PER_PROG"]))
    return {
        "BLOCK_E": BLOCK_E,
        "BLOCK_T": BLOCK_T,
        "ROWS_PER_PROG": b["ROWS_PER_PROG"],
        # The stats kernel's [BLOCK_B, BLOCK_E] tiles: TILE_ELEMS too. At 4K (16 x 256 for E = 256), Triton
        # 3.6 spilled 8 B on sm_90; at 8 x 256 and 4 x 256, neither version does.
        "STATS_BLOCK_B": max(1, min(b["TILE_ELEMS"] // BLOCK_E, b["MAX_STATS_BLOCK_B"])),
    }


class MoERouting(NamedTuple):
    """What :func:`moe_route` returns (see the module docstring for the definitions).

    Example (the module docstring's worked example)::

        >>> import torch
        >>> from smptk.kernels import moe_route
        >>> logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 1.0, 0.0], [1.0, 0.0, 3.0]],
        ...                       requires_grad=True)
        >>> r = moe_route(logits, 2)
        >>> r._fields
        ('weights', 'expert_ids', 'tokens_per_expert', 'aux_loss', 'z_loss')
        >>> weights, expert_ids, tokens_per_expert, aux_loss, z_loss = r  # a tuple: it unpacks
        >>> weights.shape, expert_ids.dtype, tokens_per_expert.tolist(), round(z_loss.item(), 4)
        (torch.Size([4, 2]), torch.int32, [3, 2, 3], 6.277)
        >>> (r.aux_loss * 1e-2 + r.z_loss * 1e-3).backward()   # the losses are differentiable in logits
        >>> logits.grad.shape
        torch.Size([4, 3])
    """

    weights: torch.Tensor  # [T, k] fp32
    expert_ids: torch.Tensor  # [T, k] int32
    tokens_per_expert: torch.Tensor  # [E] int64
    aux_loss: torch.Tensor  # 0-d fp32
    z_loss: torch.Tensor  # 0-d fp32


def route_fwd(
    logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, score_func: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward: ``(weights, expert_ids, tokens_per_expert, aux_loss [], z_loss [])``."""
    T, E = logits_TE.shape
    device = logits_TE.device
    b = _blocks(E)
    num_progs = cdiv(T, b["ROWS_PER_PROG"])
    weights = new_buffer((T, top_k), torch.float32, device)
    ids = new_index_buffer((T, top_k), torch.int32, device)
    cnt_part = new_index_buffer((num_progs, E), torch.int32, device)
    q_part = new_buffer((num_progs, E), torch.float32, device)
    z_part = new_buffer((num_progs,), torch.float32, device)
    counts = new_index_buffer((E,), torch.int64, device)
    aux = new_buffer((), torch.float32, device)  # 0-d outputs of their own: not views (in-place updates work)
    z = new_buffer((), torch.float32, device)
    if num_progs:
        _kernels._route_fwd_kernel[(num_progs,)](
            logits_TE,
            bias_E if bias_E is not None else logits_TE,
            weights,
            ids,
            cnt_part,
            q_part,
            z_part,
            T,
            E,
            top_k,
            logits_TE.stride(0),
            logits_TE.stride(1),
            SCORE_FUNC=score_func,
            RENORMALIZE=renormalize,
            HAS_BIAS=bias_E is not None,
            BLOCK_T=b["BLOCK_T"],
            BLOCK_E=b["BLOCK_E"],
            BLOCK_K=next_power_of_2(top_k),
            ROWS_PER_PROG=b["ROWS_PER_PROG"],
        )
    _kernels._route_stats_kernel[(1,)](
        cnt_part,
        q_part,
        z_part,
        counts,
        aux,
        z,
        num_progs,
        T,
        E,
        top_k,
        BLOCK_B=b["STATS_BLOCK_B"],
        BLOCK_E=b["BLOCK_E"],
    )
    return weights, ids, counts, aux, z


def route_bwd(
    dw_TK: torch.Tensor,
    daux: torch.Tensor,
    dz: torch.Tensor,
    logits_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    counts_E: torch.Tensor,
    score_func: int,
    renormalize: bool,
) -> torch.Tensor:
    """Triton backward: dlogits ``[T, E]`` in logits' dtype."""
    T, E = logits_TE.shape
    dlogits = new_buffer((T, E), logits_TE.dtype, logits_TE.device)
    if T == 0:
        return dlogits
    b = _blocks(E)
    dw_TK = dw_TK.float()
    _kernels._route_bwd_kernel[(cdiv(T, b["BLOCK_T"]),)](
        logits_TE,
        ids_TK,
        dw_TK,
        counts_E,
        daux.float().reshape(1),
        dz.float().reshape(1),
        dlogits,
        T,
        E,
        ids_TK.shape[1],
        logits_TE.stride(0),
        logits_TE.stride(1),
        dw_TK.stride(0),
        dw_TK.stride(1),
        SCORE_FUNC=score_func,
        RENORMALIZE=renormalize,
        BLOCK_T=b["BLOCK_T"],
        BLOCK_E=b["BLOCK_E"],
    )
    return dlogits


class MoERouteFunction(torch.autograd.Function):
    """Autograd wrapper over the Triton forward and backward (inputs already checked)."""

    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k: int, score_func: int, renormalize: bool):
        weights, ids, counts, aux, z = route_fwd(logits_TE, bias_E, top_k, score_func, renormalize)
        # Backward reads private copies of the ids and counts, not the returned tensors: a caller may edit
        # those in place (as on the PyTorch path) without changing the gradient or failing the saved
        # tensors' version check. Only where a backward can run ([T, k] int32 + [E] int64).
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits_TE, ids.clone(), counts.clone())
        ctx.score_func = score_func
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(ids, counts)
        return weights, ids, counts, aux, z

    @staticmethod
    @first_derivative_only("moe_route", torch_path=True)
    def backward(ctx, dw_TK, _dids, _dcounts, daux, dz):
        logits_TE, ids, counts = ctx.saved_tensors
        dlogits = route_bwd(dw_TK, daux, dz, logits_TE, ids, counts, ctx.score_func, ctx.renormalize)
        return dlogits, None, None, None, None


def _moe_route_torch(logits, top_k, score_func, renormalize, expert_bias) -> MoERouting:
    T, E = logits.shape
    s = logits.float()
    if score_func == "softmax":
        score = torch.softmax(s, dim=-1)
        q = score
    else:
        score = torch.sigmoid(s)
        q = score / (score.sum(dim=-1, keepdim=True) + RENORM_EPS)
    sel = score.detach() if expert_bias is None else score.detach() + expert_bias.float()
    # As the kernel picks: the largest number first, ties to the lower id (a stable descending sort keeps
    # equal keys in index order), a NaN key only after every number (torch's sort puts NaN first), then NaN
    # keys by id. Two stable sorts: by key, then by NaN-ness.
    nan = sel.isnan()
    by_key = torch.sort(sel.masked_fill(nan, -math.inf), dim=-1, descending=True, stable=True).indices
    by_nan = torch.sort(nan.gather(1, by_key).to(torch.uint8), dim=-1, stable=True).indices
    ids = by_key.gather(1, by_nan)[:, :top_k]
    weights = score.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    flat = ids.reshape(-1)
    # scatter_add, not bincount: bincount sizes its output from the ids' maximum (a host sync on CUDA, and
    # no meta kernel), while the counts' size E is known. Out of place: torch.func.vmap batches the result.
    counts = torch.zeros(E, dtype=torch.int64, device=logits.device).scatter_add(
        0, flat, torch.ones_like(flat)
    )
    if T == 0:
        zero = s.sum() * 0.0
        return MoERouting(weights, ids.int(), counts, zero, zero.clone())
    f = counts.float() / (T * top_k)
    aux = E * (f * q.mean(dim=0)).sum()
    z = torch.logsumexp(s, dim=-1).square().mean()
    return MoERouting(weights, ids.int(), counts, aux, z)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
) -> MoERouting:
    """Pick ``top_k`` experts per token and return their weights, the counts and the router losses.

    Args:
        logits: ``[T, E]`` router logits, float32, float16 or bfloat16, any strides. Scores are fp32.
        top_k: k, ``1 <= k <= E``.
        score_func: "softmax" or "sigmoid".
        renormalize: divide each token's k weights by their sum (plus ``RENORM_EPS`` = 1e-20).
        expert_bias: None or ``[E]`` float (read as fp32) on logits' device, added to the scores for the
            selection only (the weights and losses use the unbiased scores; it gets no gradient).

    Returns:
        :class:`MoERouting` ``(weights [T, k] fp32, expert_ids [T, k] int32, tokens_per_expert [E] int64,
        aux_loss [] fp32, z_loss [] fp32)``. ``weights``, ``aux_loss`` and ``z_loss`` are differentiable in
        logits. Ids are in descending selection order, lower id first on ties. Definitions and the sources
        of the two losses in the module docstring.

    Runs the Triton kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``, bf16 included: no tl.dot
    here, though the interpreter truncates fp32 -> bf16 where a GPU rounds), the PyTorch path otherwise;
    ``SMPTK_KERNELS=triton|torch`` forces one.

    Example::

        >>> logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 1.0, 0.0], [1.0, 0.0, 3.0]])
        >>> r = moe_route(logits, 2)
        >>> r.expert_ids.tolist(), r.tokens_per_expert.tolist()
        ([[0, 2], [2, 1], [0, 1], [2, 0]], [3, 2, 3])
        >>> [round(w, 3) for w in r.weights[3].tolist()], round(r.aux_loss.item(), 4)
        ([0.881, 0.119], 1.0501)
    """
    check_float_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D [T, E] tensor, got shape {tuple(logits.shape)}")
    E = logits.shape[1]
    if E == 0:
        raise ValueError(f"logits: expected at least one expert (E >= 1), got shape {tuple(logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1 <= top_k <= E = {E}, got {top_k}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: {score_func!r} is not supported; expected one of {tuple(SCORE_FUNCS)}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    if expert_bias is not None:
        check_float_tensor("expert_bias", expert_bias)
        if tuple(expert_bias.shape) != (E,):
            raise ValueError(
                f"expert_bias: expected shape ({E},) to match logits' E, got {tuple(expert_bias.shape)}"
            )
        if expert_bias.device != logits.device:
            raise ValueError(f"expert_bias: on {expert_bias.device} but logits is on {logits.device}")
    # No tl.dot here: bf16 runs under the interpreter too (see runtime.select_path).
    if runtime.select_path(logits, dot=False) == "torch":
        return _moe_route_torch(logits, top_k, score_func, renormalize, expert_bias)
    bias = expert_bias.detach().contiguous() if expert_bias is not None else None
    return MoERouting(*_route_triton(logits, bias, top_k, SCORE_FUNCS[score_func], renormalize))


@outside_graphs  # torch.compile: a graph break, then the Triton launch as in eager (see _dispatch)
def _route_triton(logits, bias, top_k: int, score_func: int, renormalize: bool) -> tuple:
    return MoERouteFunction.apply(logits, bias, top_k, score_func, renormalize)
