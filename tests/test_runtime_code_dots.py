"""The fused generation products of the types runtime/code_dots.py unpacks (grid i-quants, MXFP4,
ternary, Q8_KV, and the interleaved layouts of their own: iq1_s_r4, iq1_m_r4, q8_KV_r8, q8_k_r8), against the reference implementation's decoder on the reference bytes.

The rows are the golden vectors' (../shared/golden: what the C quantizers wrote, edge-case rows
included), decoded by the wheel's ``to_float`` (ik_llama.cpp) or, for tq1_0/tq2_0 that the wheel
lacks, by gguf-py's; the product's twin is those rows times the activations rounded as the fused
product rounds them (q8_0, 8 bits per 32), in float64.  These checks need no quantkit decoder, so
they hold before the types' formats are registered.
"""
from __future__ import annotations

import gguf
import numpy as np
import peers
import pytest
from quant_checks import golden_bytes, golden_input
from test_runtime_matvec import rounded

from quantkit import formats
from quantkit.formats import interleave
from quantkit.runtime import code_dots, matvec, ops_cpu
from quantkit.errors import QuantkitError
from quantkit.gguf_io.reader import TensorInfo
from quantkit.runtime.weights import Weight, load_weight
from quantkit.types import TYPE_TRAITS, QuantType, traits, type_name

T = QuantType
MAINLINE_ONLY = {T.TQ1_0, T.TQ2_0}
# the interleaved layouts whose rows are their base's, regrouped: they take the base's product
# and MXFP4, a legacy layout with an E8M0 scale (matvec.E8M0_LAYOUTS): golden bytes checked here too
GOLDEN_CHECKED = [*code_dots.TYPES, *matvec.E8M0_LAYOUTS]
INTERLEAVED = sorted((q for q, t in TYPE_TRAITS.items() if t.interleave_rows > 1 and t.base in GOLDEN_CHECKED
                      and matvec.regroups(q) and matvec.kind_of(q) is not None), key=int)


def _reference_rows(qtype, blocks: np.ndarray, n: int) -> np.ndarray:
    """The rows (n_rows, row_size) decoded by the reference, float64."""
    t = traits(qtype)
    if qtype in MAINLINE_ONLY:
        return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(qtype))).astype(np.float64)
    meta = t.row_meta_size
    if qtype in (T.IQ1_BN, T.IQ2_BN):
        # ik's to_float of these decodes blocks from the row's first byte, without the row scale in
        # front of them (its products read the scale, then the blocks after it): decode the blocks
        # after the scale (the meta bytes of padding at the end are not read), then scale the row
        moved = np.concatenate([blocks[:, meta:], np.zeros((blocks.shape[0], meta), np.uint8)], axis=1)
        codes = peers.to_float(int(qtype), moved, blocks.shape[0] * n, n).reshape(-1, n)
        scale = blocks[:, :meta].copy().view(np.float16 if meta == 2 else np.float32)
        return codes.astype(np.float64) * scale.astype(np.float64)
    return peers.to_float(int(qtype), blocks, blocks.shape[0] * n, n).reshape(-1, n).astype(np.float64)


def _golden(shared_dir, qtype):
    flavor = "mainline" if qtype in MAINLINE_ONLY else "ik"
    _, x, _ = golden_input(shared_dir, flavor, "gauss")
    n = x.shape[1]
    return golden_bytes(shared_dir, flavor, "gauss", qtype, True).reshape(x.shape[0], -1), n


def _check_product(w: Weight, ref_rows: np.ndarray):
    n = w.n_in
    for n_tok in (1, ops_cpu.FUSED_TOKENS):
        x = np.random.default_rng(n_tok).standard_normal((n_tok, n)).astype(np.float32) * 3
        got = ops_cpu.matmul_q(w, x)
        ref = rounded(x, T.Q8_0).astype(np.float64) @ ref_rows.T
        assert got.shape == (n_tok, ref_rows.shape[0]) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=0, atol=3e-6 * np.abs(ref).max(),
                                   err_msg=f"{type_name(w.qtype)} tokens={n_tok}")


@pytest.mark.parametrize("qtype", GOLDEN_CHECKED, ids=type_name)
def test_fused_product_equals_the_reference_decoder_times_rounded_activations(shared_dir, qtype):
    if qtype not in MAINLINE_ONLY and peers.load_ggml() is None:
        pytest.skip("the ik-llama-cpp-python wheel is not installed")
    blocks, n = _golden(shared_dir, qtype)
    ref_rows = _reference_rows(qtype, blocks, n)
    assert np.isfinite(ref_rows).all() and np.abs(ref_rows).max() > 0
    # 16 rows of 1024: 4 super-blocks, 16 blocks of 64 or 32 of 32 a row, the edge-case rows among them
    _check_product(Weight("w", qtype, (n, blocks.shape[0]), blocks), ref_rows)


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=type_name)
def test_interleaved_layouts_take_their_base_types_product(shared_dir, qtype):
    if peers.load_ggml() is None:
        pytest.skip("the ik-llama-cpp-python wheel is not installed")
    try:
        blocks, n = _golden(shared_dir, qtype)
        plain = interleave.deinterleave(blocks, qtype, n)
    except NotImplementedError:
        pytest.skip(f"{type_name(qtype)}'s interleave permutation is not there yet (formats/interleave.py)")
    base = traits(qtype).base
    w = Weight("w", qtype, (n, blocks.shape[0]), blocks)
    assert w.plain_layout()[0] == base
    _check_product(w, _reference_rows(base, plain, n))
    # the interleaved bytes decode to the same values (the wheel's to_float of the interleaved type;
    # the wheel's older ggml does not know mxfp4_r8: quantkit's decoder of it then)
    if peers.type_traits(int(qtype)) is not None:
        as_stored = _reference_rows(qtype, blocks, n)
    else:
        as_stored = formats.dequantize(blocks, qtype, n).reshape(-1, n).astype(np.float64)
    np.testing.assert_array_equal(as_stored, _reference_rows(base, plain, n))


def test_layouts_of_their_own_are_read_as_stored():
    """iq1_s_r4 / iq1_m_r4 (blocks of 32, quantized on their own), q8_KV_r8 (a float scale per
    row) and q8_k_r8 (q8_K is no file type) are no regrouping of a base's rows: their products read
    the interleaved rows in place (their golden rows above); the regrouped ones read plain rows."""
    for q in (T.IQ1_S_R4, T.IQ1_M_R4, T.Q8_KV_R8, T.Q8_K_R8):
        assert matvec.kind_of(q) is not None and not matvec.regroups(q), type_name(q)
    assert matvec.regroups(T.IQ2_XXS_R4) and matvec.kind_of(T.IQ2_XXS_R4) == matvec.kind_of(T.IQ2_XXS)
    assert not matvec.regroups(T.IQ2_XXS)


def test_interleaved_matrices_must_hold_whole_groups():
    """A product reads row k of a group inside the group's bytes: a 3-D tensor whose matrices (an
    expert's rows) are not whole groups is refused, though its total row count is a multiple."""
    n = 256
    info = TensorInfo("blk.0.ffn_up_exps.weight", (n, 6, 2), T.IQ4_K_R4, 0, 12 * traits(T.IQ4_K_R4).row_size(n), None)
    with pytest.raises(QuantkitError, match=r"ffn_up_exps.weight: 6 rows are not a multiple of 4 \(iq4_k_r4\)"):
        load_weight(info)
