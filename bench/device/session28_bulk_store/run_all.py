"""Compile every prototype for sm_90a (no GPU) and grep the PTX/SASS. Run: . venv/bin/activate && python run_all.py"""
import re, subprocess
import plain_bulk, gluon_tma, desc_store


import os, triton
B = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
k1 = plain_bulk.compile_sm90(plain_bulk.bulk_stage_kernel, {"src_ptr": "*i32", "dst_addr_ptr": "*i64", "n_steps": "i32",
                             "TB": "constexpr", "ROW_BYTES": "constexpr"}, {"TB": 16, "ROW_BYTES": 1024},
                             num_warps=16, aligned=("src_ptr", "dst_addr_ptr"))
k2 = plain_bulk.build_variant2(num_warps=16)
sig = {"dst_desc": f"tensordesc<i32[1, 256],{gluon_tma.SMEM_LAYOUT!r}>", "src_ptr": "*i32", "rows_ptr": "*i32",
       "n_steps": "i32", "chunk": "i32", "TB": "constexpr", "num_warps": "constexpr"}
k3 = gluon_tma.compile_gluon_sm90(gluon_tma.gluon_tma_rows_kernel, sig, {"TB": 16}, num_warps=16, aligned=("src_ptr",))
k4 = desc_store.compile_sm90(desc_store.desc_store_kernel, {"dst_desc": "tensordesc<i32[1, 256]>", "src_ptr": "*i32",
                             "rows_ptr": "*i32", "n_steps": "i32", "chunk": "i32", "TB": "constexpr"}, {"TB": 16},
                             num_warps=16, aligned=("src_ptr",))
for name, k in [("a: plain triton + asm bulk", k1), ("a2: plain, per-thread issue", k2),
                ("b: gluon TMA tensor store", k3), ("c: plain tl descriptor store", k4)]:
    ptx = k.asm["ptx"]
    with open("/tmp/_k.cubin", "wb") as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([f"{B}/cuobjdump", "--dump-resource-usage", "/tmp/_k.cubin"], capture_output=True, text=True).stdout
    static = re.search(r"SHARED:(\d+)", res).group(1)
    print(f"== {name}: sm_90a={'.target sm_90a' in ptx} dyn_smem={k.metadata.shared} static_smem={static}")
    for pat in [r"cp\.async\.bulk\.global\.shared::cta\.bulk_group", r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.bulk_group",
                r"cp\.async\.bulk\.commit_group", r"cp\.async\.bulk\.wait_group(\.read)?\s+\d+", r"fence\.proxy\.async[\w:.]*", r"bar\.sync"]:
        hits = [m.group(0) for m in re.finditer(r"(?m)^.*" + pat + ".*$", ptx)]
        kinds = sorted(set(re.search(pat, h).group(0).replace("\t", " ") for h in hits))
        if hits:
            print(f"   {len(hits):3d} x {', '.join(kinds)}")
