"""Float64 identities of the reference ops (issue 2's 'done when'). Skipped where torch is not installed."""
import pytest

torch = pytest.importorskip("torch")

from k3ref import mxfp4  # noqa: E402
from k3ref.attnres import attn_res  # noqa: E402
from k3ref.config import k3_mini  # noqa: E402
from k3ref.kda import kda_chunked, kda_chunked_fast, kda_gate, kda_recurrent, l2norm  # noqa: E402
from k3ref.mla import MLA  # noqa: E402
from k3ref.model import K3ForCausalLM  # noqa: E402
from k3ref.moe import route  # noqa: E402
from k3ref.situ import situ_glu  # noqa: E402


def kda_inputs(b, t, h, k, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, kk = l2norm(r(b, t, h, k)), l2norm(r(b, t, h, k))
    gate = kda_gate(r(b, t, h, k), r(h) * 0.5 + 1.0, r(h * k), -5.0)
    beta = torch.sigmoid(r(b, t, h))
    return q, kk, r(b, t, h, v), gate, beta, r(b, h, k, v) * 0.3


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t,chunk", [(100, 16), (130, 64), (64, 64), (1, 16)])
def test_kda_chunked_equals_recurrent_f64(with_state, t, chunk):
    q, k, v, g, beta, s0 = kda_inputs(2, t, 3, 32, 24, torch.float64, seed=t + chunk)
    s0 = s0 if with_state else None
    emit = [n for n in (1, 17, 64, t - 1, t) if 1 <= n <= t]
    o_r, s_r, e_r = kda_recurrent(q, k, v, g, beta, 32 ** -0.5, s0, emit_at=emit)
    o_c, s_c, e_c = kda_chunked(q, k, v, g, beta, 32 ** -0.5, s0, chunk=chunk, emit_at=emit)
    assert (o_r - o_c).abs().max() < 1e-10
    assert (s_r - s_c).abs().max() < 1e-10
    for n in emit:
        assert (e_r[n] - e_c[n]).abs().max() < 1e-10


def test_kda_fast_form_matches_f32():
    q, k, v, g, beta, s0 = kda_inputs(1, 77, 2, 128, 128, torch.float32, seed=3)
    o_r, s_r, _ = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), 128 ** -0.5,
                                s0.double())
    o_f, s_f = kda_chunked_fast(q, k, v, g, beta, 128 ** -0.5, s0)
    assert (o_r - o_f.double()).abs().max() / o_r.abs().max() < 1e-4
    assert (s_r - s_f.double()).abs().max() / s_r.abs().max() < 1e-4


@pytest.mark.parametrize("t", [1, 64, 150])
def test_kda_training_form_is_exact_f64_with_gradients(t):
    q, k, v, g, beta, s0 = kda_inputs(1, t, 2, 16, 8, torch.float64, seed=40 + t)
    a = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o_f, s_f = kda_chunked_fast(*a, 16 ** -0.5, s0)
    (o_f.pow(2).sum() + s_f.sum()).backward()
    b = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o_r, s_r, _ = kda_recurrent(*b, 16 ** -0.5, s0)
    (o_r.pow(2).sum() + s_r.sum()).backward()
    assert (o_f - o_r).abs().max() < 1e-10 and (s_f - s_r).abs().max() < 1e-10
    assert max(float((x.grad - y.grad).abs().max()) for x, y in zip(a, b)) < 1e-9


def test_kda_training_form_is_finite_at_the_gate_bound():
    q, k, v, g, beta, _ = kda_inputs(2, 200, 2, 128, 128, torch.float32, seed=5)
    g = torch.full_like(g, -4.999).requires_grad_(True)
    o, s = kda_chunked_fast(q, k, v, g, beta, 128 ** -0.5)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(g.grad).all()


def test_mla_absorbed_equals_naive_f64():
    torch.manual_seed(0)
    mla = MLA(k3_mini()).double()
    x = torch.randn(2, 9, 256, dtype=torch.float64)
    past = torch.randn(2, 5, 160, dtype=torch.float64)
    y_n, rows_n = mla(x, past, absorbed=False)
    y_a, rows_a = mla(x, past, absorbed=True)
    assert torch.equal(rows_n, rows_a)
    assert (y_n - y_a).abs().max() < 1e-10


def test_mxfp4_exact_on_representable_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=g)
    exps = torch.randint(-6, 6, (8, 2), generator=g).repeat_interleave(32, dim=1)
    lut = torch.tensor(mxfp4.FP4_VALUES + [-v for v in mxfp4.FP4_VALUES], dtype=torch.float64)
    w = lut[codes] * torch.exp2(exps.double())
    packed, scale = mxfp4.quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32) and scale.shape == (8, 2)
    assert torch.equal(mxfp4.dequantize(packed, scale, torch.float64), w)


def test_mxfp4_layout_and_rounding():
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, :6] = torch.tensor([6.0, -0.5, 0.25, 0.75, 5.0, 7.5])  # amax 7.5 -> scale 1 (2^(2-2))
    packed, scale = mxfp4.quantize(w)
    assert int(scale[0, 0]) == 127
    # element 0 (6.0 -> code 7) low nibble, element 1 (-0.5 -> code 9) high nibble
    assert int(packed[0, 0]) == 0x97
    # 0.25 ties to 0 (even), 0.75 ties to 1.0 (even code 2), 5.0 ties to 4, 7.5 saturates to 6
    assert mxfp4.dequantize(packed, scale, torch.float64)[0, :6].tolist() == [6.0, -0.5, 0.0, 1.0, 4.0, 6.0]


def test_fake_quant_is_straight_through():
    w = torch.randn(4, 64, requires_grad=True)
    y = mxfp4.fake_quantize(w)
    p, s = mxfp4.quantize(w.detach())
    assert torch.equal(y.detach(), mxfp4.dequantize(p, s))
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_attn_res_uniform_at_zero_query_and_softmax():
    p = torch.randn(3, 16, dtype=torch.float64)
    bank = [torch.randn(3, 16, dtype=torch.float64) for _ in range(2)]
    out = attn_res(p, bank, torch.ones(16, dtype=torch.float64), torch.zeros(1, 16, dtype=torch.float64), 1e-5)
    assert torch.allclose(out, (p + bank[0] + bank[1]) / 3)
    w = torch.randn(16, dtype=torch.float64)
    out = attn_res(p, bank, w, torch.ones(1, 16, dtype=torch.float64), 1e-5)
    V = torch.stack(bank + [p], 1)
    s = (V / V.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * w).sum(-1)
    assert torch.allclose(out, (torch.softmax(s, 1).unsqueeze(-1) * V).sum(1))


def test_router_bias_selects_but_does_not_weight():
    x = torch.randn(5, 8, dtype=torch.float64)
    gw = torch.randn(6, 8, dtype=torch.float64)
    bias = torch.zeros(6, dtype=torch.float64)
    bias[5] = 100.0  # always selected
    idx, w, s = route(x, gw, bias, 2)
    assert (idx == 5).any(-1).all()
    assert torch.allclose(w.sum(-1), torch.ones(5, dtype=torch.float64))
    assert torch.allclose(w, s.gather(-1, idx) / s.gather(-1, idx).sum(-1, keepdim=True))


def test_situ_matches_silu_near_zero_and_is_bounded():
    g = torch.linspace(-0.01, 0.01, 11, dtype=torch.float64)
    assert torch.allclose(situ_glu(g, torch.ones_like(g), 4.0, None), g * torch.sigmoid(g), atol=1e-9)
    big = torch.tensor([1e4, -1e4], dtype=torch.float64)
    out = situ_glu(big, big)
    assert out.abs().max() <= 4 * 25 + 1e-9


def test_model_cache_continuation_equals_full_pass():
    torch.manual_seed(0)
    m = K3ForCausalLM(k3_mini()).double().eval()
    ids = torch.randint(0, 8192, (1, 37))
    full = m(ids)
    cache = m.new_cache()
    a = m(ids[:, :20], cache)
    b = m(ids[:, 20:36], cache)
    c = m(ids[:, 36:], cache, absorbed=True)
    assert (torch.cat([a, b, c], 1) - full).abs().max() < 1e-9
