"""Test doubles of the agent's peers: a Kubernetes API server and a kubelet."""
