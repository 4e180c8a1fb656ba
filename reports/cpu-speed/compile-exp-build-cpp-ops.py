import time, torch, ctypes
from torch.utils.cpp_extension import load
t=time.perf_counter()
load(name="meshcpp_ops", sources=["/tmp/cmp/cppops/ops.cpp"], build_directory="/tmp/cmp/cppops/build", is_python_module=False, extra_cflags=["-O2"], verbose=False)
print("built", time.perf_counter()-t)
