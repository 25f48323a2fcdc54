"""verl's platform interface (verl/plugin/platform) for a CPU-only process: verl 0.9.1 registers
nvidia, huawei and amd and falls back to CUDA on a CPU machine, so its FSDP engine runs on gloo
ranks only with this set first (``set_platform(PlatformCPU())``): tests/verl_engine_harness.py,
``python -m bench.verl_engine --cpu``."""
from contextlib import nullcontext

import torch
from verl.plugin.platform.platform_base import PlatformBase


class PlatformCPU(PlatformBase):
    @property
    def device_name(self): return "cpu"
    @property
    def vendor_name(self): return "cpu"
    @property
    def device_module(self): return torch.cpu
    def is_available(self): return True
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, device_index): pass
    def synchronize(self, device_index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, device_index=0): return (None, None)
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
    def nvtx_range(self, msg): return nullcontext()
    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "CPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None
