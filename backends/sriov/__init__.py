"""The SR-IOV NIC backend: virtual functions as devices (`backend`), the physical functions' VF counts
(`numvfs`), a claim's `VfConfig` (`vf_config`), and handing a VF's network interface to a pod (`vf_netdev`).

The vfio-pci binding and the host network namespace it uses are shared with the GPU backend and live beside it
in `backends/` (`vfio`, `vfio_sysfs`, `host_net`).
"""
