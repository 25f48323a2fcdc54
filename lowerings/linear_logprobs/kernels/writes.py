"""The `writes` declaration of a kernel's written pointer parameters (launching/traced.py reads it). Here,
beside the kernels and free of torch, so that the precompile worker imports the kernels with
triton alone (precompile_worker.py)."""


def writes(*always: str, **when: str):
    """Declare the pointer parameters a @triton.jit kernel writes: `always`, plus each keyword's
    parameter when the constexpr it names is true at the launch (`dbp_ptr="NEED_DB"`)."""
    def mark(kernel):
        kernel.declared_writes = (tuple(always), dict(when))
        return kernel
    return mark
