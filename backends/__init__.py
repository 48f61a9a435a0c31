"""Device-family backends: the built-in ones (NVIDIA GPUs and MIG, SR-IOV NICs, TPUs) and the contract every
backend, built-in or third-party, implements. A plugin imports what it uses from `backends.plugin`."""
