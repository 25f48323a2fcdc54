"""How kernels are launched: traced.py (declared writes: custom ops under torch.compile), fast.py
(eager launches past Triton's binding), precompile.py and precompile_worker.py (kernels compiled
in worker processes while a trace runs), triton_compat.py (the Triton releases checked and every
Triton internal used). Torch-free at import: the precompile worker loads triton_compat through
this package with triton alone."""
