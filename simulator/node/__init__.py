"""A simulated node on disk: its profile, PCIe layout, sysfs and /dev trees, and its NVIDIA driver's files."""
