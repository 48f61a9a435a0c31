"""The node: where its hardware is seen, the backends that discover it, the kernel event sources (udev,
rtnetlink), and the board of device health."""
