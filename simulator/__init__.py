"""Stand-ins for the world outside the agent, for the demo, the tests and the benchmarks: a simulated node (its
sysfs, /dev, kernel, NVIDIA driver and NVML library, udev), a Kubernetes API server, a kubelet, the scheduler's
allocator with its CEL, the demo, and the conformance kit that plugin authors test their backends with.

The product (`agent`, `backends`, `cdi`) never imports this package; `agent/node/simulated.py` is the one place
that reaches it, and only when a command asks for a simulated node or the demo.
"""
