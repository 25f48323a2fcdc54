"""Below torch.compile's surface: Triton kernels, the linear_logprobs op and Inductor passes."""
from lowerings.linear_logprobs import LinearLogprobs, linear_logprobs

__all__ = ["LinearLogprobs", "linear_logprobs"]
