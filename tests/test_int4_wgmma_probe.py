"""tools/int4_wgmma_probe.py runs only on a GPU; here its weight packing is modelled on the CPU:
the unpacking PTX (test_int4_ptx's model) on words packed by natural_words, split and permuted
as the Gluon decode kernel's A operand is (SWAPPED_ORDER), must give every weight row's 128 + nibble
in the inputs' own order, so that the activations need no permutation; or, for moegen's own
layout (the routed GEMM1), the activations permuted by activation_positions. The kernels are
compiled for sm_90 (no GPU needed): each layout conversion to the wgmma operand must be trivial."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_tool
from test_int4_gluon_probe import _unpacked, probe  # noqa: F401 - the fixture

TOOL = Path(__file__).resolve().parents[1] / "tools" / "int4_wgmma_probe.py"


@pytest.fixture(scope="module")
def wgmma_probe():
    pytest.importorskip("triton.experimental.gluon")
    return load_tool("int4_wgmma_probe")


def _a_operand(probe, words: torch.Tensor, k0: int, kb: int) -> torch.Tensor:  # noqa: F811
    """The MMA's A operand [rows, 128] (128 + nibble, by MMA input) of the 128-wide step at k0 of
    int32 words [rows, K / 8], unpacked by the PTX model and permuted as the kernel's _a_operand."""
    n = words.shape[0]
    step = words[:, k0 // 8:(k0 + 128) // 8].reshape(n, 4, kb).permute(2, 1, 0)  # (b, t, n): word KB t + b
    a = _unpacked(probe, step).reshape(kb // 2, 2, 4, n // 16, 2, 8, 2, 2, 2)
    return a.permute(*probe.SWAPPED_ORDER.value).reshape(n, 128)


def test_natural_words_put_each_input_where_the_mma_takes_it(probe, wgmma_probe):  # noqa: F811
    g = torch.Generator().manual_seed(82)
    n, k, kb = 32, 256, 4
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    words = wgmma_probe.natural_words(q)
    assert words.shape == (n, k // 8) and words.dtype == torch.int32
    for k0 in range(0, k, 128):
        torch.testing.assert_close(_a_operand(probe, words, k0, kb), 128.0 + q[:, k0:k0 + 128].double(),
                                   rtol=0, atol=0)


def test_permuted_activations_meet_moegen_stored_words(probe, wgmma_probe):  # noqa: F811
    # The routed GEMM1 keeps moegen's int4 layout and permutes the activations instead: MMA input
    # L of a step multiplies the weight of input activation_positions()[L].
    from moegen.quant.quantize import pack_int4

    g = torch.Generator().manual_seed(83)
    n, k, kb = 32, 256, 4
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    words = pack_int4(q[None])[0].view(torch.int32)
    x = torch.randn(3, k, generator=g, dtype=torch.float64)
    xp = wgmma_probe.permuted_activations(x)
    for k0 in range(0, k, 128):
        a = _a_operand(probe, words, k0, kb) - 128.0
        torch.testing.assert_close(xp[:, k0:k0 + 128] @ a.T, x[:, k0:k0 + 128] @ q[:, k0:k0 + 128].double().T)


def test_wgmma_probe_compiles_for_hopper_with_its_operand_in_place(wgmma_probe, tmp_path, no_interpreter_env):
    # Its own process, a fresh cache (as test_int4_gluon_probe's): assert_trivial fails the build
    # if the dequantized tile needs a conversion to be wgmma's register operand.
    env = dict(no_interpreter_env, TRITON_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(TOOL), "--compile"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    tiles = [line for line in run.stdout.splitlines() if "BLOCK_N" in line]
    assert len(tiles) == len(wgmma_probe.CONFIGS) + 2 * len(wgmma_probe.ROUTED_CONFIGS), run.stdout
    for line in tiles:
        assert "HGMMA" in line and "(0 HGMMA)" not in line, line
