"""Per-kernel GPU profiles, design measurements and the sm_90 build check of the lm_head op
(moved here from lowerings/linear_logprobs/, whose bench_*.py / aot_check.py they were):

    op.py              `python -m bench.kernels.op`: the recompute op alone, per-kernel times
    rows.py, fused.py  the same for the row-masked and the fused-gradient path
    fused_probes.py    fused.py's timed loop, clocks and one-off probes (cuBLAS blocks, launcher
                       host time, CUDA graph replay)
    dw_ws.py           the Triton and Gluon dW steps on one block (launchers the GPU test uses)
    host.py            host-side launch costs
    scaled_operand.py  the A-operand-scaled dX / dW GEMMs (an experiment; interpreter test)
    aot_check.py       `python -m bench.kernels.aot_check`: every CUDA kernel compiled for sm_90
                       at its launch tiles, on any machine (no GPU)
    sass.py            `python -m bench.kernels.sass [LABEL]`: one of those builds' SASS and the
                       instructions of its main loop (an epilogue's cost an element, no GPU)
"""
