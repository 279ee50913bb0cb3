"""Where the quantizing dispatch puts each thread's e4m3 bytes (Triton's interpreter, on the CPU): the halves that
`smsplit.ep.kernels.rows.e4m3_halves` makes of a row's bytes (an fp32 / fp16 x's path), stored at the word offsets
`chunk_halves` gives (every path), rebuild the row byte for byte, poisoned output. (A bf16 x's halves come from
inline PTX, which the interpreter cannot run: the GPU tests compare those rows with the reference bit for bit.)"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl
    from smsplit.ep.kernels.rows import chunk_halves, e4m3_halves

    @triton.jit
    def place(q_ptr, out_ptr, NG: tl.constexpr, TB: tl.constexpr, QG: tl.constexpr):
        r = tl.arange(0, TB)[:, None, None]
        g3 = tl.arange(0, QG)[None, :, None]
        c = tl.arange(0, 128)[None, None, :]
        for g0 in range(0, NG, QG):
            q = tl.load(q_ptr + r * (NG * 128) + (g0 + g3) * 128 + c, mask=(g0 + g3) < NG, other=0)
            q0, q1, q2, q3 = e4m3_halves(q.to(tl.float8e4nv, bitcast=True), TB, QG)
            lo, hi = chunk_halves(g0, QG)
            row = tl.arange(0, TB)[:, None] * (NG * 32)
            tl.store(out_ptr + row + lo, q0, mask=lo < NG * 32)
            tl.store(out_ptr + row + lo + 1, q1, mask=lo < NG * 32)
            tl.store(out_ptr + row + hi, q2, mask=hi < NG * 32)
            tl.store(out_ptr + row + hi + 1, q3, mask=hi < NG * 32)

    for NG, QG in ((8, 8), (7, 4), (3, 2)):
        TB = 4
        q = torch.randint(0, 256, (TB, NG * 128), dtype=torch.uint8)
        out = torch.full((TB, NG * 32), 0x5A5A5A5A, dtype=torch.int32)  # poisoned
        place[(1,)](q, out, NG, TB, QG)
        assert torch.equal(out.view(torch.uint8), q), (NG, QG)
    print("ok")
''')


@pytest.mark.compile
def test_e4m3_halves_at_chunk_halves_rebuild_the_row():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
