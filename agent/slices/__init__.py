"""ResourceSlices: built from the inventory, checked against the API server's rules, tainted from device
health, and kept in the API server."""
