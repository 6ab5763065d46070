"""bench/bench_pass_profile.py's bookkeeping: perf report lines are summed by what each function does, with the names
our kernels and llama.cpp's / ik_llama.cpp's carry, and the loading left out of the per-pass figures."""
from __future__ import annotations

import click
import pytest

from bench import bench_pass_profile as bpp


@pytest.mark.parametrize("symbol, category", [
    ("[.] r16g256_q4_K", "Q4_K matrices"),
    ("[.] r16g_q6_K", "Q6_K matrices"),
    ("[.] r16g256_iq4_nl", "IQ4_NL matrices"),
    ("[.] (anonymous namespace)::mul_mat_q4_k_r4_q8_k<8>", "Q4_K matrices"),
    ("[.] (anonymous namespace)::mul_mat_q6_k_r4_q8_k<1>", "Q6_K matrices"),
    ("[.] ggml_vec_dot_q8_0_q8_0", "Q8_0 matrices"),
    ("[.] (anonymous namespace)::iqk_quantize_row_q8_K_T<1>", "activation quantization"),
    ("[.] quantize_act_256", "activation quantization"),
    ("[.] r16_expand_256", "group expansion (ours)"),
    ("[.] attend_rows_256_f16", "attention"),
    ("[.] (anonymous namespace)::mul_mat_Qx_Qy_MxN_fa4<(anonymous namespace)::QFT<float, 4>>", "attention"),
    ("[.] ggml_barrier", "thread sync"),
    ("[.] repack_q4_k", bpp.LOAD),
    ("[k] clear_page_erms", bpp.LOAD),
    ("[.] rmsnorm.avx2", "the rest"),
    ("[.] k256_f32", "the rest"),
])
def test_functions_are_sorted_by_what_they_do(symbol, category):
    assert bpp.symbol_category(symbol) == category


REPORT = """\
# Samples: 5K of event 'cpu-clock'
#
# Overhead       Samples  Symbol
# ........  ............  ......
#
    50.00%          2500  [.] r16g256_q4_K
    20.00%          1000  [.] r16g256_q6_K
    10.00%           500  [k] clear_page_erms
     6.00%           300  [.] attend_rows_256_f16
     4.00%           200  [.] r16_expand_256
     2.00%           100  [.] r16g_q4_K
     8.00%           400  [.] rmsnorm.avx2
"""


def test_a_report_is_summed_per_category_and_per_pass_without_the_loading():
    samples = bpp.parse_report(REPORT)
    assert samples == {"Q4_K matrices": 2600, "Q6_K matrices": 1000, bpp.LOAD: 500, "attention": 300,
                       "group expansion (ours)": 200, "the rest": 400}
    assert bpp.per_pass(samples, 4) == {"Q4_K matrices": 0.65, "Q6_K matrices": 0.25, "attention": 0.075,
                                        "group expansion (ours)": 0.05, "the rest": 0.1}


def test_the_peers_warmup_is_turned_off_with_its_own_flag():
    # the usage lines as llama.cpp's and ik_llama.cpp's llama-bench print them
    assert bpp.no_warmup_args("  --no-warmup                                 skip warmup runs before benchmarking\n") \
        == ("--no-warmup",)
    assert bpp.no_warmup_args("  -w, --warmup <0|1>                  (default: 1)\n") == ("-w", "0")
    with pytest.raises(click.UsageError):
        bpp.no_warmup_args("  -r, --repetitions <n>                     (default: 5)\n")
