"""Compile every Triton kernel ahead of time for a GPU architecture, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, but not that they compile:
it accepts code the real compiler rejects (shapes too small for tensor cores, type mismatches
across branches). This lowers each kernel through Triton's whole CUDA pipeline, ptxas included,
for representative constexpr values, and reports registers spilled to local memory.

    python -m kvscale.kernels.aot_check --arch 90   # prints one JSON object; exit 1 on a failure
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cases(quick: bool):
    from kvscale.kernels import triton_kv_cache, triton_norm, triton_paged_attention, triton_rotary

    pa = triton_paged_attention
    for dt in ("bf16",) if quick else ("bf16", "fp16", "fp32"):
        p = "*" + dt
        prec = "ieee" if dt == "fp32" else "tf32"
        attn = {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "scale_log2": "fp32"}
        attn |= {n: "*fp32" for n in ("tmp_out_ptr", "max_logits_ptr", "exp_sums_ptr")}
        attn |= {n: "*i64" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        for group, bs, use_parts in ((8, 16, True), (1, 128, False), (4, 8, True))[: 1 if quick else 3]:
            yield f"decode-{dt}-g{group}-bs{bs}-split{int(use_parts)}", pa._paged_decode_kernel, attn, {
                "GROUP": group, "BLOCK_G": max(16, group), "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": bs,
                "BLOCK_N": pa.DECODE_BLOCK_N, "PARTITION_SIZE": 512, "USE_PARTITIONS": use_parts,
                "DOT_PRECISION": prec,
            }  # fmt: skip
        yield f"decode-reduce-{dt}", pa._paged_decode_reduce_kernel, attn, {
            "HEAD_DIM": 128, "BLOCK_D": 128, "PARTITION_SIZE": 512, "BLOCK_P": 64, "CHUNK_P": 16,
        }  # fmt: skip
        for group, bs in ((8, 16), (1, 32), (4, 128))[: 1 if quick else 3]:
            block_m = max(pa.PREFILL_BLOCK_M, group)
            yield f"prefill-{dt}-g{group}-bs{bs}", pa._paged_prefill_kernel, attn, {
                "GROUP": group, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": bs, "BLOCK_M": block_m,
                "BLOCK_Q": block_m // group, "BLOCK_N": pa.PREFILL_BLOCK_N, "DOT_PRECISION": prec,
            }  # fmt: skip
        kv = {"key_ptr": p, "value_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_mapping_ptr": "*i64"}
        yield f"kv-write-{dt}", triton_kv_cache._write_kv_cache_kernel, kv, {
            "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16,
        }  # fmt: skip
        norm = {n: p for n in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")}
        norm["eps"] = "fp32"
        for has_residual in (True,) if quick else (False, True):
            yield f"rms-norm-{dt}-res{int(has_residual)}", triton_norm._rms_norm_kernel, norm, {
                "HAS_RESIDUAL": has_residual, "BLOCK": 4096,
            }  # fmt: skip
        rot = {"out_ptr": p, "x_ptr": p, "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        yield f"rotary-{dt}", triton_rotary._rotary_kernel, rot, {
            "HALF": 64, "HEAD_DIM": 128, "BLOCK_H": 32, "BLOCK_D": 128,
        }  # fmt: skip


def compile_all(arch: int, quick: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = {}
    for name, fn, types, constexprs in _cases(quick):
        names = fn.arg_names
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        src = ASTSource(
            fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
        )
        try:
            kernel = triton.compile(src, target=target, options={"num_warps": 4})
        except Exception as e:  # report every failure, not only the first
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        results[name] = {
            "ok": True,
            "shared_bytes": kernel.metadata.shared,
            "local_loads": kernel.asm["ptx"].count("ld.local"),  # > 0: registers spilled
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--quick", action="store_true", help="bfloat16 only, one variant per kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(json.dumps({"error": "unset TRITON_INTERPRET: the interpreter compiles nothing"}))
        return 1
    results = compile_all(args.arch, args.quick)
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({"arch": args.arch, "ok": ok, "kernels": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
