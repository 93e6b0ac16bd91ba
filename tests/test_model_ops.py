"""labkit.model.ops and the int8/int4 linears' epilogue arguments the decoder's fused path passes them: the linear
with its neighbours inside the GEMV, the plan's norm, RoPE + cache write and activation against their torch
expressions."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.evaluate import relative_error
from labkit.kvcache import PagedKVCache, SeqBlocks
from labkit.model import FusionPlan, RMSNorm
from labkit.model.ops import act_and_mul, add_norm, rope_and_write
from labkit.quant.weight_only import Int4Linear


def _norm(dim, dtype=torch.float32, seed=12):
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return norm


def test_int4_projection_is_the_layer_with_its_neighbours():
    """An int4 linear with its epilogue as arguments (``lin(x, norm=, residual=, swiglu=)``) is ``residual +
    lin(act(x))`` with ``act`` an RMSNorm or ``silu(gate) * up``, by the fused kernel (the interpreter here): in
    float32 the separate ops within float32 rounding, and one bf16 row (the stationary GEMV with them inside) within
    bf16 rounding of a float32 reference. Bad widths and norm with swiglu are refused."""
    torch.manual_seed(11)
    lin = nn.Linear(256, 32, bias=False)
    q = Int4Linear.from_linear(lin, 64)
    norm = _norm(256)
    gate_up, x, res = torch.randn(3, 512), torch.randn(3, 256) * 3, torch.randn(3, 32)
    with torch.no_grad():
        gate, up = gate_up.chunk(2, dim=-1)
        assert relative_error(q(gate_up, swiglu=True, residual=res), res + q(F.silu(gate) * up)) < 1e-5
        assert relative_error(q(x, norm=norm), q(norm(x))) < 1e-5
        qb = Int4Linear(q.packed, q.scales.bfloat16(), q.zeros.bfloat16(), 64, backend="triton")
        w = q.dequantize(torch.float32)
        row, rb = gate_up[:1].bfloat16(), res[:1].bfloat16()
        g, u = row.chunk(2, dim=-1)
        ref = F.linear((F.silu(g) * u).float(), w) + rb.float()
        assert relative_error(qb(row, swiglu=True, residual=rb), ref) < 1e-2
        normb = _norm(256, torch.bfloat16)
        normb.weight.data.copy_(norm.weight)
        ref = F.linear(normb(x[:1].bfloat16()).float(), w)
        assert relative_error(qb(x[:1].bfloat16(), norm=normb), ref) < 1e-2
    with pytest.raises(ValueError, match=r"must be \[\.\.\., 2K\] = \[gate \| up\] with swiglu=True"):
        q(torch.randn(2, 256), swiglu=True)
    with pytest.raises(ValueError, match="norm_weight and swiglu=True cannot be combined"):
        q(gate_up, norm=norm, swiglu=True)


def test_triton_ops_match_torch():
    """The Triton norm (with the residual add), RoPE + cache write and SiLU-and-mul against the torch plan's."""
    g = torch.Generator().manual_seed(3)
    T, heads, kv, D = 5, 4, 2, 16
    norm = _norm(48)
    h, r = torch.randn(T, 48, generator=g), torch.randn(T, 48, generator=g)
    torch_plan, triton_plan = FusionPlan(), FusionPlan.triton()
    for a, b in zip(add_norm(norm, h, r, triton_plan), add_norm(norm, h, r, torch_plan)):
        assert relative_error(a, b) < 1e-5
    gate_up = torch.randn(T, 2 * 24, generator=g)
    assert relative_error(act_and_mul(F.silu, gate_up, triton_plan), act_and_mul(F.silu, gate_up, torch_plan)) < 1e-5
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (heads, kv, kv))
    pos = torch.tensor([0, 3, 7, 8, 20])
    freqs = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    out = {}
    for name, plan in (("torch", torch_plan), ("triton", triton_plan)):
        cache = PagedKVCache(1, kv, D, 4, 8)
        seq = SeqBlocks(list(range(T)))
        cache.allocate(seq)
        slots = torch.tensor(cache.slots(seq, 0, T))
        rotated = rope_and_write(q, k, v, cos, sin, cache, 0, slots, plan)
        out[name] = (*rotated, *(c[0].view(-1, kv, D)[slots].clone() for c in (cache.k_caches, cache.v_caches)))
    for a, b in zip(out["triton"], out["torch"]):
        assert relative_error(a, b) < 1e-5
