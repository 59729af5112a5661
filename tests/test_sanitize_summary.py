"""benchmarking/sanitize_gpu.py's reading of racecheck's analysis reports (CPU: synthetic logs)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
import sanitize_gpu

WS = "kbit::KbitWsConfig<(int)5, (bool)1, (int)128>"


def _log(write: str, reads: list[str]) -> str:
    lines = ["========= COMPUTE-SANITIZER", f"========= Error: Race reported between Write access at {write}"]
    lines += [f"=========     and Read access at {r} [100 hazards]" for r in reads]
    lines += ["========= ", "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"]
    return "\n".join(lines + ["========= ERROR SUMMARY: 1 error"])


def test_the_mbarrier_ordered_ring_refill_is_not_counted():
    log = _log(
        "kbit::bulk_copy_g2s(unsigned int, const void *, unsigned int, unsigned int)+0x9310 in kbit_gemm_wgmma_ws.cuh:125",
        [
            f"void kbit::lds_unit_words<{WS}>(unsigned int (&)[8], unsigned int, int)+0x1530 in kbit_gemm.cuh:799",
            f"void kbit::lds_unit_absmax<{WS}>(unsigned int (&)[2], unsigned int)+0x15f0 in kbit_gemm.cuh:822",
        ],
    )
    errors, detail = sanitize_gpu.summarize("racecheck", log)
    assert errors == 0 and "1 of them" in detail


def test_any_other_read_site_counts():
    log = _log(
        "kbit::bulk_copy_g2s(unsigned int, const void *, unsigned int, unsigned int)+0x9310 in kbit_gemm_wgmma_ws.cuh:125",
        [f"void kbit::ws_consumer<{WS}>(int)+0x10 in kbit_gemm_wgmma_ws.cuh:400"],
    )
    errors, _ = sanitize_gpu.summarize("racecheck", log)
    assert errors == 1


def test_reports_without_source_lines_count_and_say_why():
    kernel = f"void kbit::kbit_gemm_wgmma_ws_kernel<{WS}, __half>(kbit::KbitGemmParams, CUtensorMap_st)"
    errors, detail = sanitize_gpu.summarize("racecheck", _log(kernel + "+0xaea0", [kernel + "+0x14b0"]))
    assert errors == 1 and "-lineinfo" in detail
