"""Claims: reading a ResourceClaim, preparing and unpreparing it crash-safely, the checkpoint that remembers
it, and what recovers or reaps claims after a restart."""
