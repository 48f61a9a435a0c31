"""Kubernetes Events (events.k8s.io/v1) the agent writes for what an operator must see: how each is built, how
repeats are aggregated into series, and the recorder that writes them without ever failing the work they tell of.
"""
