"""A Kubernetes API server for tests, benchmarks and the demo: the real REST paths and JSON over HTTP."""
