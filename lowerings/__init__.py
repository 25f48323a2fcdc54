"""Below torch.compile's surface: one package per op or pass.

    linear_logprobs/  the `compiled_grpo::linear_logprobs` op (Triton on CUDA, chunked PyTorch elsewhere)
    naive_fusion/     the Inductor pre-grad pass that rewrites naive log_softmax(h @ W.T) code into it

Import from the packages (`from lowerings.linear_logprobs import linear_logprobs`): this module
re-exports nothing, so `lowerings.linear_logprobs` always names the package, never the function.
"""
