"""The simulated node's NVML: a real shared library (libnvidia-ml.so.1) that forwards every call to one NVML
server per node, where the GPUs' state and NVML's rules live."""
